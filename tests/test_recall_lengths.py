"""`prisme study lengths`: a long-context recall study's finished runs, read from its records, rebuilt at a longer
T_max (the same function on the positions they had: RoPE tables are computed) and scored and decoded at longer
contexts. Untrained models of the study's shapes stand in for trained ones (what is checked is the machinery)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from prisme.checkpoint import TrainingState, checkpoint_name, save_checkpoint
from prisme.config import PrismeConfig
from prisme.model.prisme import PrismeModel
from prisme.studies.recall_lengths import at_length, format_lengths, main, members
from prisme.studies.recall_lengths import memory_needed as lengths_memory

LONG = dict(attn_window=64, key_shift=True, router=True, router_token=True)


def _model(**kw) -> PrismeModel:
    torch.manual_seed(0)
    return PrismeModel(PrismeConfig.from_name("recall_long", **kw)).eval()


def _study(tmp_path, T: int = 1024, recorded: bool = False):
    """A study folder whose records name one PRISME run (with its price) and one dense run trained at T, as the
    frontier writes them (`recorded`: the length in the task's record too, as written since `study lengths` reads
    it; else only in the names and folders, as older records have it)."""
    folder = tmp_path / "study"
    done = folder / ".prisme-study" / "done"
    done.mkdir(parents=True)
    runs = {"family": (f"T{T}_d12", _model(d_model=12, n_head=2, n_kv_head=2, **LONG), {"router": {"lambda": 0.2}}),
            "dense": (f"T{T}_L1_d16_ks", _model(d_model=16, n_head=2, n_kv_head=2, key_shift=True,
                                                use_workspace=False), {})}
    for kind, (name, model, extra) in runs.items():
        rel = f"study/frontier/T{T}/{name}_seed35/last/{checkpoint_name(1)}"
        save_checkpoint(tmp_path / rel, model, TrainingState("backbone", 1))
        task = {"kind": kind, "seed": 35, "name": name} | ({"context": T} if recorded else {})
        rec = {"task": task, "entry": {"checkpoint": rel, **extra}}
        (done / f"{name}.json").write_text(json.dumps(rec))
    (done / "other.json").write_text(json.dumps({"task": {"kind": "control"}, "entry": {}}))  # not a frontier run
    return folder


def test_members_are_read_from_the_records_with_their_prices(tmp_path):
    found = members(_study(tmp_path))
    assert [(m.family, m.name, m.seed, m.price, m.context) for m in found] == [
        ("dense", "T1024_L1_d16_ks", 35, None, 1024), ("prisme", "T1024_d12", 35, 0.2, 1024)]
    assert all(m.checkpoint.exists() for m in found)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="records no finished run"):
        members(tmp_path / "empty")
    with pytest.raises(ValueError, match="nowhere is not a folder; pass the --out folder of a `prisme study recall"):
        members(tmp_path / "nowhere")


def test_a_model_rebuilt_at_a_longer_context_computes_the_same_function(tmp_path):
    model = _model(**LONG).double()
    longer = at_length(model, 8192)
    assert longer.cfg.max_seq_len == 8192 and longer.backbone.rope_cos.shape[0] == 8192
    x = torch.randint(0, 64, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(longer.backbone.head(longer.backbone(x)), model.backbone.head(model.backbone(x)),
                                   rtol=0, atol=1e-12)
        # negative control: a model of the same shape without the trained weights is another function
        other = PrismeModel(longer.cfg).double().eval()
        assert not torch.allclose(other.backbone.head(other.backbone(x)), model.backbone.head(model.backbone(x)))


def test_the_study_scores_and_decodes_every_model_at_each_context(tmp_path, capsys):
    args = argparse.Namespace(runs=str(_study(tmp_path)), contexts="2048", sequences=2, repeats=1, threads=-1,
                              json=str(tmp_path / "lengths.json"), no_progress=True)
    assert main(args) == 0
    doc = json.loads((tmp_path / "lengths.json").read_text())
    assert doc["contexts"] == [1024, 2048] and set(doc["rows"]) == {"T1024_d12", "T1024_L1_d16_ks"}
    assert doc["trained_contexts"] == [1024] and {r["trained_context"] for r in doc["rows"].values()} == {1024}
    for row in doc["rows"].values():
        assert all(0 <= a <= 1 for T in ("1024", "2048") for a in row["accuracy"][T]) and row["seeds"] == [35]
    assert set(doc["decode_batch8_tokens_per_s"]["2048"]) == {"T1024_d12", "T1024_L1_d16_ks"}
    assert "T = 2,048" in format_lengths(doc) and "query accuracy" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--contexts must be longer than every length the study trained at "
                                         r"\(1,024\), got 512"):
        main(argparse.Namespace(**{**vars(args), "contexts": "512"}))


@pytest.mark.parametrize("recorded", [True, False], ids=["record", "names"])
def test_a_study_trained_at_another_length_is_scored_at_its_own(tmp_path, recorded):
    """A study trained at T = 81 (not the 1,024 the command once assumed): its runs are scored at 81 and at the
    longer contexts asked for, 512 among them, and the document says 81 (from the record, or from the names of a
    record written before the length was)."""
    args = argparse.Namespace(runs=str(_study(tmp_path, T=81, recorded=recorded)), contexts="512", sequences=2,
                              repeats=1, threads=-1, json=str(tmp_path / "lengths.json"), no_progress=True)
    assert main(args) == 0
    doc = json.loads((tmp_path / "lengths.json").read_text())
    assert doc["trained_contexts"] == [81] and doc["contexts"] == [81, 512]
    assert all(set(r["accuracy"]) == {"81", "512"} and r["trained_context"] == 81 for r in doc["rows"].values())
    assert "trained at T = 81" in format_lengths(doc)


def test_study_lengths_refuses_repeated_contexts_and_what_cannot_fit(tmp_path, monkeypatch):
    args = argparse.Namespace(runs=str(_study(tmp_path)), contexts="2048,2048", sequences=2, repeats=1, threads=-1,
                              json=None, no_progress=True)
    with pytest.raises(ValueError, match="--contexts '2048,2048' lists 2048 twice"):
        main(args)
    found = members(_study(tmp_path / "b"))
    from prisme.checkpoint import load_model
    loaded = {m: load_model(m.checkpoint)[0] for m in found}
    # the pairwise bank match of the workspace model dominates: b x T^2 x 10 bytes, b = 1 at long T
    need = lengths_memory(found, loaded, 10_000_000, 2)
    assert need >= 10_000_000 ** 2 * 10
    assert lengths_memory(found, loaded, 2048, 2) < 2**30  # control: a short context is small
    with pytest.raises(ValueError, match=r"study lengths at --contexts 10,000,000 needs about [\d,.]+ GiB, more than "
                                         r"the [\d,.]+ GiB this machine has free: pass shorter --contexts"):
        main(argparse.Namespace(**{**vars(args), "contexts": "10000000"}))
