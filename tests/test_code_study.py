"""The text study on any corpus (`--corpus`, `--held-out` by name, file or folder), its slices by copy distance, and
the PRISME designs of the code study (`--sources *_preceding`, `--prisme-layers`, `--workspace-steps`)."""

from __future__ import annotations

import pytest
import torch

from prisme import cli
from prisme.config import PrismeConfig
from prisme.data.corpora import resolve_corpus
from prisme.studies.cli import text_config
from prisme.studies.text_data import held_out_bytes, training_data
from prisme.studies.text_setup import TextStudyConfig, context_slice_edges, source_config, stage_configs


def code_folder(root, n: int = 6):
    """A folder of small Python files, each repeating an identifier far apart (a corpus split by whole files)."""
    root.mkdir()
    for i in range(n):
        body = "".join(f"def handler_{i}_{k}(value):\n    return value * {k} + {i}\n\n" for k in range(12))
        (root / f"m{i}.py").write_text(f"# module {i}\nimport os\n\n{body}print(handler_{i}_0(3))\n")
    return root


def text_args(*argv: str):
    return cli.build_parser().parse_args(["study", "text", *argv])


def test_corpus_and_held_out_by_name_file_and_folder_reach_the_study_data(tmp_path):
    """`--corpus` / `--held-out` take a corpus name, a file or a folder: the study trains on that corpus's split
    (`data.corpora`: by whole files for code and folders, contiguously for a file), every stage names it, and the
    held-out text is the one named. Negative control: the defaults stay Austen and Bierce."""
    folder = code_folder(tmp_path / "code")
    one = tmp_path / "one.txt"
    one.write_text("Abasement, n. A decent and customary mental attitude. " * 40)
    named = text_config(text_args("--corpus", "python-stdlib", "--held-out", "click", "--out", str(tmp_path / "a")))
    assert (named.corpus, named.held_out) == ("python-stdlib", "click")
    ds = training_data(named.corpus)
    train, val = resolve_corpus("python-stdlib").split()
    assert ds.n_tokens("val") == sum(len(t.encode()) for _, t in val) and ds.n_tokens("train") > 3_000_000
    assert held_out_bytes("click") == len(resolve_corpus("click").text().encode())
    by_folder = text_config(text_args("--corpus", str(folder), "--held-out", str(one), "--out", str(tmp_path / "b")))
    ds = training_data(by_folder.corpus)
    texts = [t for _, t in resolve_corpus(str(folder)).documents()]
    assert ds.n_tokens("train") + ds.n_tokens("val") == sum(len(t.encode()) for t in texts)
    assert held_out_bytes(by_folder.held_out) == len(one.read_bytes())
    by_file = text_config(text_args("--corpus", str(one), "--held-out", str(folder), "--out", str(tmp_path / "c")))
    assert bytes(training_data(by_file.corpus).tokens.to(torch.uint8).tolist()) == one.read_bytes()
    assert held_out_bytes(by_file.held_out) == sum(len(t.encode()) for t in texts)
    st = stage_configs(by_folder, PrismeConfig.from_name("demo"), 1)
    assert {s.dataset for s in st.values()} == {str(folder)}
    default = text_config(text_args("--out", str(tmp_path / "d")))
    assert (default.corpus, default.held_out) == ("austen", "devils_dictionary")
    assert {s.dataset for s in stage_configs(default, PrismeConfig.from_name("demo"), 1).values()} == {"austen"}


@pytest.mark.parametrize("argv, want", [
    (["--corpus", "pyhton-stdlib"], "unknown corpus 'pyhton-stdlib': not a known name (austen, bierce, "
                                    "python-stdlib, click"),
    (["--held-out", "clik"], "--held-out: unknown corpus 'clik'"),
    (["--corpus", ""], "--corpus is empty"),
    (["--corpus", "SHORT", "--context", "512"], "--corpus SHORT: its training split holds"),
    (["--prisme-layers", "2"], "--prisme-layers goes with --context"),
    (["--context", "1024", "--prisme-layers", "2", "--frontier", "1,1w64ks,2ks"],
     "--prisme-layers 2: the dense frontier holds no 2-layer global model with its 64-window twin"),
    (["--context", "1024", "--workspace-steps", "0"], "workspace_steps (--workspace-steps) must be an int >= 1"),
    (["--sources", "residual_previous"], "'residual_previous' is not one of")])
def test_the_code_study_options_are_checked_before_anything_trains(argv, want, tmp_path, capsys, monkeypatch):
    """A misspelt corpus is an error listing the known names, a corpus too short for the window one naming --corpus,
    and the designs' options are checked (a depth without its frontier twins, a step count of 0), each before
    anything trains or is written."""
    import prisme.studies.text as text

    monkeypatch.setattr(text, "run_tasks", lambda *a, **k: pytest.fail("the study started"))
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n" * 60)
    argv = [str(short) if a == "SHORT" else a for a in argv]
    out = tmp_path / "study"
    assert cli.main(["study", "text", "--seeds", "1", "--scale", "0.01", "--out", str(out), *argv]) == 2
    assert want in capsys.readouterr().err.replace(str(short), "SHORT")
    assert not out.exists()


def test_the_preceding_sources_build_a_one_step_induction_bank():
    """`residual_preceding` is the demo's bank with `bank_key="preceding"` (query and bank from H), and
    `embedding_preceding` the embedding bank with it (no token shift: the key already reads j-1); negative control:
    the existing sources keep the current key."""
    demo = TextStudyConfig(context=1024).study_model(PrismeConfig.from_name("demo"))
    r, e = source_config(demo, "residual_preceding"), source_config(demo, "embedding_preceding")
    assert (r.bank_key, r.bank_source, r.query_source, r.bank_shift) == ("preceding", "residual", "residual", False)
    assert (e.bank_key, e.bank_source, e.bank_shift, e.controller_source) == ("preceding", "embedding", False,
                                                                               "residual")
    assert {source_config(demo, s).bank_key for s in ("residual", "embedding", "residual_shift")} == {"current"}
    assert r.router and r.attn_window == 64 and r.key_shift  # the long-context backbone under it


def test_prisme_layers_and_workspace_steps_set_the_backbone_depth_and_the_workspace_bytes(tmp_path):
    """`--prisme-layers N` makes PRISME's backbone N layers (its twins in the default frontier); `--workspace-steps`
    sets stage 2's steps, and the matched run and every frontier model train on the added bytes too."""
    demo = PrismeConfig.from_name("demo")
    base = TextStudyConfig(context=1024, out_dir=str(tmp_path))
    more = TextStudyConfig(context=1024, prisme_layers=3, workspace_steps=960, out_dir=str(tmp_path)).validate(demo)
    assert more.study_model(demo).n_layer == 3 and base.study_model(demo).n_layer == demo.n_layer
    nbytes = lambda s: s.steps * s.batch_size * s.seq_len  # noqa: E731
    a, b = (stage_configs(c, c.study_model(demo), 1) for c in (base, more))
    assert (a["workspace"].steps, b["workspace"].steps) == (240, 960)
    added = nbytes(b["workspace"]) - nbytes(a["workspace"])
    assert nbytes(b["matched"]) == nbytes(b["workspace"]) and added == 720 * 2048
    assert all(0 <= nbytes(b[k]) - nbytes(a[k]) - added < 2048 for k in a if k.startswith("frontier:"))


def test_slices_split_the_far_copies_by_distance_through_eval_options():
    """At `--context T` the slices' window is PRISME's, then 256 and 1,024 where below T; `EvalOptions.slices_window`
    takes such bucket edges and every row reports a slice per bucket. Negative controls: edges that do not increase,
    or edges without an n-gram length, are ValueErrors."""
    from prisme.evaluation.run import EvalOptions, evaluate_policies
    from prisme.model.prisme import PrismeModel

    assert context_slice_edges(64, 1024) == (64, 256) and context_slice_edges(64, 4096) == (64, 256, 1024)
    assert context_slice_edges(16, 64) == (16,) and context_slice_edges(None, 64) is None
    torch.manual_seed(0)
    model = PrismeModel(PrismeConfig.from_name("tiny", vocab_size=8, attn_window=4))
    x = torch.randint(0, 3, (2, 32))
    batches = [(x[:, :-1], x[:, 1:])]
    rep = evaluate_policies(model, batches, ["backbone"], EvalOptions(slices=2, slices_window=(4, 8), seq_len=31,
                                                                      bootstrap_samples=10))
    sl = rep.rows[0].slices
    assert list(sl) == ["ar_hit_in_window", "ar_hit_4_8", "ar_hit_beyond_8", "seen_miss", "other"]
    assert abs(sum(v["share_of_targets"] for v in sl.values()) - 1) < 1e-9
    for bad in (dict(slices=2, slices_window=(8, 4)), dict(slices_window=(4, 8)), dict(slices=2, slices_window=0)):
        with pytest.raises(ValueError, match="slices_window must be"):
            evaluate_policies(model, batches, ["backbone"], EvalOptions(seq_len=31, **bad))


def test_a_code_study_records_its_corpus_slices_by_distance_and_capture(tmp_path):
    """A tiny long-context study on a folder of code (T = 300, PRISME a 2-layer 16-window backbone with the
    preceding-key bank): the document and the report name the corpus and the held-out text, the slices split the far
    copies at 256, the capture is in the document, and the settings record the corpus. Negative control: a default
    (Austen) study's settings carry none of the new fields."""
    from prisme.studies.text import format_report, prepare_study, run_study, study_settings

    folder = code_folder(tmp_path / "code", n=8)
    held = code_folder(tmp_path / "held", n=2)
    cfg = TextStudyConfig(sources=["residual_preceding"], seeds=[3], scale=0.01, val_batches=1, held_out=str(held),
                          corpus=str(folder), jobs=1, progress=False, bootstrap_samples=20, context=300,
                          out_dir=str(tmp_path / "text"), prisme_layers=2, workspace_steps=100,
                          context_model={"attn_window": 16, "key_shift": True, "router": True, "router_ngram": 2},
                          context_frontier=[[2, None, True], [2, None, True, 16]], context_eval_batch_size=2,
                          context_lambdas=[0.0], copy_head=False)
    doc = run_study(cfg, PrismeConfig.from_name("tiny", vocab_size=256))
    assert doc["corpus"]["train"]["name"] == str(folder) and doc["corpus"]["train"]["split"] == "by whole files"
    assert doc["corpus"]["held_out"]["name"] == str(held) and doc["model"]["n_layer"] == 2
    rep = doc["seeds"]["3"]["sources"]["residual_preceding"]["held_out"]
    backbone = next(r for r in rep["rows"] if r["policy"] == "backbone")
    assert list(backbone["slices"]) == ["ar_hit_in_window", "ar_hit_16_256", "ar_hit_beyond_256", "seen_miss",
                                        "other"]
    assert doc["capture"] and {c["global"] for c in doc["capture"]} == {f"L2_d{doc['model']['d_model']}_ks"}
    ws = doc["stages"]["workspace"]
    assert ws["steps"] == 2 and doc["training_bytes"]["workspace"] == 2 * ws["batch_size"] * 300  # 100 x 0.01 steps
    report = format_report(doc)
    assert f"corpus: {folder} (folder" in report and "16-256" in report and "capture beyond" in report
    # training compute per model: PRISME trains its backbone, then its workspace and router stages on top
    from prisme.studies.text_compute import model_stages
    from prisme.training.compute import stage_compute

    tc, d = doc["training_compute"], doc["model"]["d_model"]
    assert set(tc) == {"backbone", "backbone+matched", "prisme:residual_preceding", f"frontier:L2_d{d}_ks",
                       f"frontier:L2_d{d}_w16_ks"} and "training compute per model" in report
    runs = model_stages(cfg, PrismeConfig.from_name("tiny", vocab_size=256).replace(**doc["model"]),
                        prepare_study(cfg, PrismeConfig.from_name("tiny", vocab_size=256))[1][3])
    for name, e in tc.items():
        assert e["training_ops"] == pytest.approx(sum(stage_compute(m, st).ops for m, st in runs[name]))
        assert e["training_core_s"] is not None and e["training_core_s"] > 0  # every stage's log has its time
    assert tc["prisme:residual_preceding"]["training_ops"] > tc["backbone+matched"]["training_ops"] > \
        tc["backbone"]["training_ops"]
    settings = study_settings(cfg, *prepare_study(cfg, PrismeConfig.from_name("tiny", vocab_size=256))[:2])
    assert settings["study"]["corpus"] == str(folder) and settings["corpus"]["sha256"]
    from pathlib import Path

    from prisme.studies.text import reuse_training

    other = TextStudyConfig(**{**cfg.__dict__, "prisme_layers": 1, "sources": ["residual"], "reuse": cfg.out_dir,
                               "context_frontier": [*cfg.context_frontier, [1, None, True], [1, None, True, 16]],
                               "out_dir": str(tmp_path / "again")})  # another PRISME: the same dense models
    model_cfg, stages, tasks = prepare_study(other, PrismeConfig.from_name("tiny", vocab_size=256))
    copied = reuse_training(other, study_settings(other, model_cfg, stages), tasks)
    d = doc["model"]["d_model"]
    assert sorted(Path(p).relative_to(tmp_path / "again").as_posix() for p in copied) == [
        f"seed3/frontier/L2_d{d}_ks", f"seed3/frontier/L2_d{d}_w16_ks"]  # not PRISME's 1-layer backbone
    plain = TextStudyConfig(seeds=[3], out_dir=str(tmp_path / "austen"))
    model_cfg, stages, _ = prepare_study(plain)
    recorded = study_settings(plain, model_cfg, stages)
    assert "corpus" not in recorded and not {"corpus", "prisme_layers", "workspace_steps"} & set(recorded["study"])


def test_a_copy_head_study_gives_the_dense_family_the_same_head_and_scores_the_exact_copy(tmp_path):
    """A tiny copy-head code study (T = 300): PRISME's chain runs the copy stage between stage 1 and the workspace;
    every dense frontier model has a "+copy" twin trained from its checkpoint (the same head, the same copy stage);
    the rows hold PRISME's local backbone without a far read and the untrained exact copy, and every row's paired
    difference to the exact copy; the capture is measured from the local backbone; the training compute counts the
    copy stages. Negative control: `copy_head=False` plans no twin and no copy stage."""
    from prisme.studies.text import prepare_study, run_study
    from prisme.studies.text_setup import EXACT_COPY, NO_COPY

    folder = code_folder(tmp_path / "code", n=8)
    held = code_folder(tmp_path / "held", n=2)
    cfg = TextStudyConfig(sources=["residual_preceding"], seeds=[3], scale=0.01, val_batches=1, held_out=str(held),
                          corpus=str(folder), jobs=1, progress=False, bootstrap_samples=20, context=300,
                          out_dir=str(tmp_path / "text"), prisme_layers=2, copy_steps=200,
                          context_model={"attn_window": 16, "key_shift": True, "router": True, "router_ngram": 2},
                          context_frontier=[[2, None, True], [2, None, True, 16]], context_eval_batch_size=2,
                          context_lambdas=[0.0])
    assert cfg.uses_copy  # a folder of files: on by default
    base = PrismeConfig.from_name("tiny", vocab_size=256)
    _, stages, tasks = prepare_study(cfg, base)
    d = base.d_model
    twin = f"frontier:L2_d{d}_w16_ks+copy"
    assert stages[3][twin].stage == "copy" and stages[3]["copy"].stage == "copy" and stages[3]["copy"].steps == 2
    needs = {t.name: t.needs for t in tasks}
    assert needs[f"s3/{twin}"] == (f"s3/frontier:L2_d{d}_w16_ks",)  # from its dense model's checkpoint
    doc = run_study(cfg, base)
    rep = doc["seeds"]["3"]["sources"]["residual_preceding"]["held_out"]
    rows = {r["policy"]: r for r in rep["rows"]}
    assert {NO_COPY, EXACT_COPY, f"L2_d{d}_ks+copy", f"L2_d{d}_w16_ks+copy"} <= set(rows)
    assert rows["backbone"]["delta_vs_reference"]["reference"] == EXACT_COPY
    assert "delta_vs_reference" not in rows[EXACT_COPY] or rows[EXACT_COPY]["delta_vs_reference"] is None
    assert any("against exact_copy_reference" in v for v in doc["verdicts"])
    tc = doc["training_compute"]
    assert tc[twin]["training_ops"] > tc[f"frontier:L2_d{d}_w16_ks"]["training_ops"]  # its dense model + the head
    plain = TextStudyConfig(**{**cfg.__dict__, "copy_head": False, "out_dir": str(tmp_path / "plain")})
    _, stages, tasks = prepare_study(plain, base)
    assert "copy" not in stages[3] and not any("+copy" in t.name for t in tasks)
