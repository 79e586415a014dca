"""The edges of the long-context surfaces (`study lengths`, `bench long`, `--confirm-of`, `--confirm-seeds`,
`--compile`) and the typed Python options: each unclear input is one error naming the option, field or file, before
any training or timing; where an input changes what was asked, one note says so. Each case is a row of
docs/reliability.md."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch

from prisme.bench import long as long_bench
from prisme.bench.harness import peak_memory
from prisme.bench.long import configs, memory_needed
from prisme.bench.long import main as bench_long
from prisme.config import PrismeConfig
from prisme.devices import check_fits
from prisme.io import check_output_file
from prisme.model.policy import Controller
from prisme.model.prisme import PrismeModel, decode_state_bytes
from prisme.options import DecodeOptions, ExecutionOptions


# ---------------------------------------------------------------------------------------------- the Python API
@pytest.mark.parametrize("target", [-3.0, 0.0, 0.5])
def test_a_target_cost_below_the_backbones_is_refused(target):
    """A target below 1 (the backbone alone costs 1 per token) can never be met: refused naming target_cost."""
    with pytest.raises(ValueError, match=r"target_cost must be a finite number >= 1"):
        Controller(1, target_cost=target)
    assert Controller(1, target_cost=1.0).target_cost == 1.0  # control: the backbone's own cost is a target


def test_an_unknown_compile_mode_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"compile_mode.*bogus-mode"):
        ExecutionOptions(compile_mode="bogus-mode")
    assert ExecutionOptions(compile_mode="reduce-overhead").compile_mode == "reduce-overhead"  # control


def test_a_bank_key_without_a_workspace_is_refused():
    with pytest.raises(ValueError, match=r"bank_key='preceding' configures the workspace's bank, but use_workspace"):
        PrismeConfig.from_name("tiny", bank_key="preceding", use_workspace=False)
    assert not PrismeConfig.from_name("tiny", use_workspace=False).use_workspace  # control: the default key is fine
    assert PrismeConfig.from_name("tiny", bank_key="preceding").bank_key == "preceding"


def test_fill_synthetic_names_a_generator_of_the_wrong_type():
    model = PrismeModel(PrismeConfig.from_name("tiny")).eval()
    state = model.new_decode_state(1)
    with pytest.raises(ValueError, match=r"generator must be a torch.Generator or None, got str"):
        state.fill_synthetic(4, generator="seed")
    state.fill_synthetic(4, generator=torch.Generator().manual_seed(0))  # control: a generator fills
    assert state.lengths == [4]


# --------------------------------------------------------------------------------------------------- bench long
def _long(tmp_path, **kw) -> argparse.Namespace:
    base = dict(shapes="d64_L2", contexts="128", batches="1", steps=4, repeats=1, edit_rate=0.2,
                bank_source="embedding", prefill=False, prefill_repeats=1, train=False, train_positions=16,
                train_repeats=1, threads=1, seed=0, json=str(tmp_path / "long.json"), device="cpu")
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("over, named", [
    (dict(contexts="200,200"), r"--contexts '200,200' lists 200 twice"),
    (dict(batches="3,3"), r"--batches '3,3' lists 3 twice"),
    (dict(contexts="5", steps=1), r"--contexts 5 is too short: PRISME's backbone attends over a 64-position window"),
    (dict(device="tpu"), r"--device tpu: a benchmark runs on cpu or cuda\[:N\]"),
    (dict(device="meta"), r"--device meta: a benchmark runs on cpu or cuda"),
    (dict(device="mps"), r"--device mps: a benchmark runs on cpu or cuda"),
])
def test_bench_long_names_the_option_before_any_timing(tmp_path, over, named):
    with pytest.raises(ValueError, match=named):
        bench_long(_long(tmp_path, **over))
    assert not (tmp_path / "long.json").exists()


def test_bench_long_refuses_a_case_that_cannot_fit_naming_the_figure(tmp_path, monkeypatch):
    """The estimate is the states' exact bytes (two small states give the line) and the cases' temporaries: the
    d512_L2, batch 64, T = 65,536 case of the report needs about 68 GB of dense K/V; refused before any model is
    built at that size, naming the options; a case that fits runs (control)."""
    decode = DecodeOptions(bank_tables=True, bank_store="ids")
    need = memory_needed("d512_L2", 65536, 64, "embedding", decode, False, False)
    dense_kv = 2 * 2 * 2 * 64 * 65536 * 512 * 4  # dense and dense_ks: 2 layers of K and V, batch 64, d 512, float32
    assert dense_kv <= need <= 1.15 * dense_kv  # and the fill's one [B, T, d] temporary
    cfgs = configs("d64_L2", 300, "embedding")  # the line is exact: a state built at that size holds those bytes
    for k, c in cfgs.items():
        assert decode_state_bytes(c, 3, 300, decode if k == "prisme" else None) == \
            PrismeModel(c, decode if k == "prisme" else None).new_decode_state(3).nbytes
    monkeypatch.setattr(long_bench, "check_fits",
                        lambda need, what, advice, device: check_fits(need, what, advice, device, available=2**30))
    with pytest.raises(ValueError, match=r"bench long d512_L2 at T = 65,536, batch 64 needs about 72\.\d GiB, more "
                                         r"than the 1\.0 GiB this machine has free: pass shorter --contexts"):
        bench_long(_long(tmp_path, shapes="d512_L2", contexts="65536", batches="64"))
    assert bench_long(_long(tmp_path)) == 0  # control: 128 positions fit in 1 GiB


def test_bench_long_notes_an_edit_rate_that_rounds_to_no_position(tmp_path, capfd):
    assert bench_long(_long(tmp_path, edit_rate=1e-9)) == 0
    err = capfd.readouterr().err
    assert "--edit-rate 1e-09 of the 4 timed positions at batch 1 rounds to none; the routed path fires at 1" in err
    doc = json.loads((tmp_path / "long.json").read_text())
    assert doc["results"][0]["fired_positions"] == 1
    assert bench_long(_long(tmp_path, edit_rate=0.5)) == 0  # control: no note where the rate picks positions
    assert "rounds to none" not in capfd.readouterr().err


def test_bench_long_writes_no_profiler_noise_and_its_peak_counts_every_free(tmp_path, capfd):
    """stderr holds nothing of the profiler's (its start/stop lines, the CPU allocator's warning about frees it cannot
    count); each path's peak is at least its state and the steps' logits."""
    assert bench_long(_long(tmp_path)) == 0
    err = capfd.readouterr().err
    assert "profiler_st" not in err and "allocated before the profiling started" not in err
    rows = json.loads((tmp_path / "long.json").read_text())["results"][0]["rows"]
    assert all(r["peak_bytes"] >= r["state_bytes"] + 256 * 4 for r in rows.values())


def test_peak_memory_refuses_a_run_that_frees_what_was_allocated_before_it():
    """A run that frees a 4 MiB tensor made before the profile, then makes a 4 MiB one, holds 4 MiB at most beyond
    what it started with, but the profiler cannot see the free: the sum would read 4 MiB high. It is an error; freeing
    it in `setup` gives the exact figure."""
    n = 2**20
    held = [torch.ones(n)]

    def run():
        held.clear()
        return torch.ones(n)

    with pytest.raises(RuntimeError, match="freed memory allocated before it"):
        peak_memory(run, torch.device("cpu"))
    held.append(torch.ones(n))
    assert peak_memory(run, torch.device("cpu"), setup=held.clear) == 4 * n


def test_an_output_file_the_filesystem_refuses_is_named_before_the_work(tmp_path):
    if not Path("/proc/version").exists():
        pytest.skip("needs /proc")
    with pytest.raises(ValueError, match=r"--json /proc/version: cannot write a file in /proc"):
        check_output_file("/proc/version", "--json")
    check_output_file(str(tmp_path / "x.json"), "--json")  # control


# ----------------------------------------------------------------------------------------- the confirmation pass
REFERENCE = Path(__file__).resolve().parents[1] / "prisme" / "reference" / "recall_context_frontier.json"


def _cli_error(capsys, *argv: str) -> str:
    from prisme import cli

    assert cli.main(list(argv)) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("doc, named", [
    ({"study": "text", "seeds": {"30": {}}, "sources": {}}, r"a document of `prisme study text`, not a frontier"),
    ({"seeds": "30", "frontier": {"dense": [], "prisme": []}}, r"the seeds its study ran must be a list of ints >= 0 "
                                                               r"\(`seeds`, or `scored.seeds`\), got '30'"),
    ({"seeds": [30], "frontier": "x"}, r"has neither a frontier \(its dense/prisme entries\) nor contexts"),
    ([1, 2], r"it holds a list"),
])
def test_a_document_that_is_not_a_frontier_studys_is_named_before_anything_trains(tmp_path, capsys, doc, named):
    """A text study's document and a document whose seeds are a string once passed the check and failed with
    `TypeError: can only concatenate str (not "int") to str`."""
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    err = _cli_error(capsys, "study", "recall", "--frontier", "--context", "256", "--confirm-of", str(path),
                     "--out", str(tmp_path / "out"))
    assert re.search(rf"--confirm-of {re.escape(str(path))}: .*{named}", err), err
    assert "TypeError" not in err and not (tmp_path / "out").exists()


def test_the_reference_document_still_reads():
    from prisme.studies.recall_confirm import read_recorded, recorded_seeds

    assert recorded_seeds(read_recorded(REFERENCE)) == [30, 31, 32, 33, 34]  # control: a real frontier document passes


@pytest.mark.parametrize("argv, named", [
    (("--frontier", "--context", "256", "--quick", "--confirm-of", str(REFERENCE)),
     "--quick trains smoke runs, whose accuracy cannot confirm or refute a recorded study's"),
    (("--quick", "--confirm-seeds", "3"), "--confirm-seeds needs --frontier"),
    (("--frontier", "--confirm-seeds", "0"), "--confirm-seeds 0 overlap the study's seeds 0,1,2,3,4: the "
                                             "confirmation pass trains on fresh seeds (or pass none for no pass)"),
])
def test_the_confirmation_options_are_refused_for_what_is_wrong(tmp_path, capsys, argv, named):
    """--quick with --confirm-of judged a smoke-trained seed against the full study and exited 0; --confirm-seeds
    without --frontier was blamed on overlapping seeds; --confirm-seeds 0 meant no pass."""
    err = _cli_error(capsys, "study", "recall", *argv, "--out", str(tmp_path / "out"))
    assert named in err, err


def test_quick_overlap_is_judged_against_the_seed_quick_trains(tmp_path):
    """--quick trains seed 0 alone: fresh seed 1 does not overlap it (it was refused against seeds 0-4); seed 0
    does (negative control)."""
    from prisme.studies.recall_setup import RecallStudyConfig

    RecallStudyConfig(frontier=True, quick=True, confirm_seeds=[1]).validate()
    with pytest.raises(ValueError, match=r"overlap the study's seeds 0 \(--quick trains the first alone\)"):
        RecallStudyConfig(frontier=True, quick=True, confirm_seeds=[0]).validate()


# ------------------------------------------------------------------------------------ options that do nothing, notes
def test_generate_compile_at_budget_0_is_refused_naming_both(capsys, monkeypatch):
    """`generate --compile [strict]` at budget 0 compiled nothing (the editor never runs) and said nothing."""
    import prisme.decoding.generate as gen

    monkeypatch.setattr(gen, "generate", lambda *a, **k: pytest.fail("the model decoded"))
    for argv in (["--compile"], ["--compile", "strict"]):
        err = _cli_error(capsys, "generate", "--preset", "demo", "--prompt", "Emma", *argv)
        assert f"--compile {argv[-1] if argv[-1] == 'strict' else 'auto'} only compiles the workspace's editor, but " \
               f"--budget is 0" in err, err


def test_a_held_out_text_that_is_the_training_text_is_noted(tmp_path, capfd, monkeypatch):
    """`study text --corpus bierce --held-out bierce` scored the training text as held out without a word."""
    import prisme.studies.text as text

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(text, "run_tasks", stop)
    from prisme import cli

    for held, noted in (("bierce", True), ("austen", False)):
        cli.main(["study", "text", "--corpus", "bierce", "--held-out", held, "--seeds", "1", "--scale", "0.01",
                  "--confirm-seeds", "none", "--out", str(tmp_path / held)])
        err = capfd.readouterr().err
        assert ("note: --held-out bierce is the training text (--corpus bierce): its scores are not held out"
                in err) == noted, err


def test_a_resumed_study_names_a_default_it_did_not_record_by_its_value(tmp_path):
    """A text study recorded with the default corpus (left out of its record) rerun with another said
    `study.corpus: was None`: it says `was 'austen' (the default)`."""
    from prisme.studies.records import differences
    from prisme.studies.text import RECORDED_DEFAULTS

    before, now = {"study": {"seeds": [1]}}, {"study": {"seeds": [1], "corpus": "bierce"}}
    assert differences(before, now, defaults=RECORDED_DEFAULTS) == [
        "study.corpus: was 'austen' (the default), now 'bierce'"]
    assert differences(before, {"study": {"seeds": [1], "corpus": "austen"}}, defaults=RECORDED_DEFAULTS) == []
    assert differences(before, now) == ["study.corpus: was None, now 'bierce'"]  # without the defaults: as before
