"""Nothing silently wrong at the edges: a model's tokenizer is part of every comparison, raw `.jsonl` is prepared
before it is trained on, a study is interrupted and re-scored as it was run, and each unclear input is one line naming
the option or file, before work starts. (The HF export's config and padding: `tests/test_hf_full.py`.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_run_safety import run_cli

from prisme import checkpoint as ckpt
from prisme.config import PrismeConfig
from prisme.data.shards import MANIFEST, ShardDataset, prepare
from prisme.data.text import load_text
from prisme.data.tokenizers import BPETokenizer, ByteTokenizer
from prisme.evaluation.report import EvalReport, EvalRow
from prisme.model.prisme import PrismeModel
from prisme.rebase import rebase
from prisme.training.config import StageConfig

V = 280  # the byte tokenizer and two BPEs of 280 ids: one vocabulary size, three meanings of its ids
TEXT_A = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 30
TEXT_B = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition. " * 30


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tok_world(tmp_path_factory):
    """A corpus, two BPEs of the same size, and checkpoints of one architecture trained (saved) with each tokenizer:
    byte, bpe_a, bpe_b (backbone stages), bpe_a2 (another model of bpe_a), ws_byte (a workspace stage, byte)."""
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("tokworld")
    (root / "corpus.txt").write_text(TEXT_A + TEXT_B)
    toks = {"byte": ByteTokenizer(), "bpe_a": BPETokenizer.train(TEXT_A, V), "bpe_b": BPETokenizer.train(TEXT_B, V)}
    for name in ("bpe_a", "bpe_b"):
        toks[name].save(root / f"{name}.json")
    assert toks["bpe_a"].vocab_size == toks["bpe_b"].vocab_size == V
    assert toks["bpe_a"].identity != toks["bpe_b"].identity
    cfg = PrismeConfig.from_name("tiny").replace(vocab_size=V)
    sc = {"dataset": str(root / "corpus.txt"), "seq_len": 16}
    for name, tok_name, seed, stage in (("byte", "byte", 0, "backbone"), ("bpe_a", "bpe_a", 1, "backbone"),
                                        ("bpe_b", "bpe_b", 2, "backbone"), ("bpe_a2", "bpe_a", 3, "backbone"),
                                        ("ws_byte", "byte", 4, "workspace")):
        torch.manual_seed(seed)
        tok = toks[tok_name]
        ckpt.save_checkpoint(root / name / ckpt.checkpoint_name(1), PrismeModel(cfg), ckpt.TrainingState(
            stage=stage, step=1, tokenizer=tok,
            stage_config={**sc, "tokenizer": "byte" if tok_name == "byte" else str(root / f"{tok_name}.json")},
            extra={"trained_groups": ["backbone"] + (["workspace"] if stage == "workspace" else [])}))
    docs = root / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(TEXT_A)
    (docs / "b.txt").write_text(TEXT_B)
    (docs / "c.txt").write_text(TEXT_A[::-1])
    prepare(docs, root / "prep_bpe_a", toks["bpe_a"], val_fraction=0.34)
    return {"root": root, "toks": toks, "cfg": cfg}


def eval_args(ck: Path, *more: str) -> list[str]:
    return ["eval", "--checkpoint", str(ck), "--batches", "1", "--batch-size", "2", "--seq-len", "16",
            "--bootstrap", "10", "--policies", "backbone", *more]


# ---------------------------------------------------------------------------------- a model's tokenizer
@pytest.mark.parametrize("ours, theirs, option", [("byte", "bpe_a", "--reference"), ("bpe_a", "bpe_b", "--reference"),
                                                   ("bpe_b", "byte", "--matched-backbone"),
                                                   ("bpe_a", "bpe_b", "--matched-backbone")])
def test_a_reference_or_matched_backbone_of_another_tokenizer_is_refused_naming_both(tok_world, capsys, ours,
                                                                                     theirs, option):
    """Same vocabulary size, other strings per id: refused naming the option and both tokenizers, before any row is
    scored; a reference of the same tokenizer is scored (control)."""
    root = tok_world["root"]
    value = f"other={root / theirs}" if option == "--reference" else str(root / theirs)
    rc, out = run_cli(*eval_args(root / ours, option, value))
    err = capsys.readouterr().err
    assert rc == 2 and out == "", err
    assert option in err and ("ByteTokenizer" in err) == ("byte" in (ours, theirs)) and "BPETokenizer" in err
    if "byte" not in (ours, theirs):  # two BPEs of one size: named apart by their identities
        ids = {tok_world["toks"][n].identity[:16] for n in (ours, theirs)}
        assert all(i in err for i in ids), err
    same = "bpe_a2" if ours == "bpe_a" else ours
    ctrl = f"other={root / same}" if option == "--reference" else str(root / same)
    assert run_cli(*eval_args(root / ours, option, ctrl))[0] == 0, capsys.readouterr().err


def test_an_evaluation_on_data_prepared_with_another_tokenizer_is_refused(tok_world, capsys):
    """`prisme eval --corpus DIR` where DIR was prepared with a BPE the byte model was not trained with: refused
    naming both (its ids fit the vocabulary and used to be scored); the BPE model itself evaluates there."""
    root = tok_world["root"]
    rc, out = run_cli(*eval_args(root / "byte", "--corpus", str(root / "prep_bpe_a")))
    err = capsys.readouterr().err
    assert rc == 2 and out == "" and "ByteTokenizer" in err and "BPETokenizer" in err and "prep_bpe_a" in err, err
    assert run_cli(*eval_args(root / "bpe_a", "--corpus", str(root / "prep_bpe_a")))[0] == 0


def test_a_rebase_onto_another_tokenizer_is_refused_before_anything_is_written(tok_world, tmp_path, capsys):
    """`rebase(..., tokenizer=)` and `prisme train --rebase --tokenizer OTHER`: refused naming both tokenizers; the
    run folder is not left behind. With the checkpoint's own tokenizer the rebase is written (control)."""
    root, toks = tok_world["root"], tok_world["toks"]
    cfg = tok_world["cfg"].replace(n_slots=4)
    with pytest.raises(ValueError, match="cannot rebase.*ByteTokenizer.*BPETokenizer"):
        rebase(root / "byte", cfg, tmp_path / "r", seed=0, tokenizer=toks["bpe_a"])
    assert not (tmp_path / "r").exists()
    assert rebase(root / "byte", cfg, tmp_path / "r", seed=0, tokenizer=ByteTokenizer()).is_dir()
    rc, _ = run_cli("train", "--stage", "workspace", "--init-from", str(root / "bpe_a"), "--rebase", "--preset",
                    "tiny", "--set", f"model.vocab_size={V}", "--set", "model.n_slots=4", "--tokenizer",
                    str(root / "bpe_b.json"), "--dataset", str(root / "corpus.txt"), "--steps", "1", "--batch-size",
                    "2", "--seq-len", "16", "--no-progress", "--out", str(tmp_path / "ws"))
    err = capsys.readouterr().err
    assert rc == 2 and "cannot rebase" in err and err.count("BPETokenizer") == 2, err
    assert not (tmp_path / "ws").exists()


def test_an_explicit_tokenizer_must_be_the_prepared_one(tok_world, tmp_path, capsys):
    """`--tokenizer byte` on BPE-prepared data (it trained on the BPE while recording byte) and `--tokenizer` on MQAR
    (ignored) are refused before the run folder exists; without --tokenizer the prepared one is used (control)."""
    root = tok_world["root"]
    base = ["train", "--preset", "tiny", "--set", f"model.vocab_size={V}", "--stage", "backbone", "--steps", "1",
            "--batch-size", "2", "--seq-len", "16", "--no-progress"]
    for i, extra in enumerate((["--dataset", str(root / "prep_bpe_a"), "--tokenizer", "byte"],
                               ["--dataset", str(root / "prep_bpe_a"), "--tokenizer", str(root / "bpe_b.json")],
                               ["--dataset", "mqar", "--tokenizer", "byte"])):
        rc, _ = run_cli(*base, *extra, "--out", str(tmp_path / f"r{i}"))
        err = capsys.readouterr().err
        assert rc == 2 and "--tokenizer" in err and not (tmp_path / f"r{i}").exists(), err
        if extra[1] != "mqar":
            assert "prep_bpe_a" in err and "BPETokenizer" in err
    assert run_cli(*base, "--dataset", str(root / "prep_bpe_a"), "--out", str(tmp_path / "ok"))[0] == 0
    assert ckpt.load_tokenizer(tmp_path / "ok").identity == tok_world["toks"]["bpe_a"].identity


def test_export_hf_with_another_tokenizer_than_the_checkpoints_is_refused(tok_world, tmp_path, capsys):
    pytest.importorskip("transformers")
    root = tok_world["root"]
    rc, _ = run_cli("export-hf", "--checkpoint", str(root / "byte"), "--out", str(tmp_path / "hf"), "--tokenizer",
                    str(root / "bpe_a.json"))
    err = capsys.readouterr().err
    assert rc == 2 and "--tokenizer" in err and "ByteTokenizer" in err and "BPETokenizer" in err, err
    assert run_cli("export-hf", "--checkpoint", str(root / "byte"), "--out", str(tmp_path / "hf2"), "--tokenizer",
                   "byte")[0] == 0


# ---------------------------------------------------------------------------------- raw documents
def jsonl(path: Path, rows: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("case", ["jsonl file", "folder with jsonl", "nested text", "saved dataset"])
def test_train_refuses_documents_only_data_prepare_reads_naming_the_command(tmp_path, capsys, case):
    """`prisme train --dataset f.jsonl` trained on the raw JSON (braces, keys); a folder's .jsonl and its subfolders'
    text were skipped silently. Each is refused with the `prisme data prepare` command, before the run folder exists;
    prepared, the same documents train (control)."""
    src = tmp_path / "src"
    rows = [TEXT_A[:200], TEXT_B[:200], TEXT_A[100:300]]
    if case == "jsonl file":
        src = jsonl(tmp_path / "d.jsonl", rows)
    elif case == "folder with jsonl":
        (src / "a.txt").parent.mkdir(parents=True)
        (src / "a.txt").write_text(TEXT_A)
        jsonl(src / "more" / "d.jsonl", rows)
    elif case == "nested text":
        (src / "sub").mkdir(parents=True)
        (src / "a.txt").write_text(TEXT_A)
        (src / "sub" / "b.txt").write_text(TEXT_B)
    else:
        src.mkdir()
        (src / "dataset_info.json").write_text("{}")
        (src / "a.txt").write_text(TEXT_A)
    with pytest.raises(ValueError, match="prisme data prepare"):
        load_text(src)
    args = ["train", "--preset", "tiny", "--set", "model.vocab_size=256", "--stage", "backbone", "--steps", "1",
            "--batch-size", "2", "--seq-len", "16", "--no-progress"]
    rc, _ = run_cli(*args, "--dataset", str(src), "--out", str(tmp_path / "run"))
    err = capsys.readouterr().err
    assert rc == 2 and f"prisme data prepare {src}" in err and not (tmp_path / "run").exists(), err
    if case != "saved dataset":
        assert run_cli("data", "prepare", str(src), "--out", str(tmp_path / "prep"))[0] == 0
        assert run_cli(*args, "--dataset", str(tmp_path / "prep"), "--out", str(tmp_path / "ok"))[0] == 0
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.txt").write_text(TEXT_A)
    assert load_text(tmp_path / "plain") == TEXT_A  # control: text directly in a folder is read as before


# ---------------------------------------------------------------------------------- unclear before, clear now
@pytest.mark.parametrize("value", ["0.9", '"x"', "[0.9]", '["a", "b"]', "[0.9, 1.5]"])
def test_set_betas_of_another_shape_names_the_field(tmp_path, capsys, value):
    rc, _ = run_cli("train", "--preset", "tiny", "--stage", "backbone", "--dataset", "mqar", "--steps", "1",
                    "--set", f"betas={value}", "--out", str(tmp_path / "r"))
    err = capsys.readouterr().err
    assert rc == 2 and "betas must be two" in err and "not iterable" not in err and not (tmp_path / "r").exists()
    assert StageConfig().replace(betas=[0.8, 0.9]).betas == (0.8, 0.9)  # control


def test_a_control_layers_entry_of_another_shape_names_it(tmp_path):
    from prisme.studies.recall_setup import study_config

    (tmp_path / "recall_study.json").write_text('{"control_layers": 3}')
    with pytest.raises(ValueError, match="control_layers must be two layer counts"):
        study_config({}, str(tmp_path))


@pytest.fixture(scope="module")
def ws_ckpt(tmp_path_factory):
    """A byte-level tiny model with a workspace, saved as a workspace stage and as a stage-1 (backbone) checkpoint,
    and a backbone-only model (use_workspace=False)."""
    root = tmp_path_factory.mktemp("wsck")
    torch.manual_seed(0)
    cfg = PrismeConfig.from_name("tiny").replace(vocab_size=256)
    sc = {"dataset": "mqar", "mqar": {"vocab_size": 64, "seq_len": 16, "n_pairs": 2, "query_min_pos": 4}}
    for name, stage, groups, c in (("ws", "workspace", ["backbone", "workspace"], cfg),
                                   ("s1", "backbone", ["backbone"], cfg),
                                   ("bb", "backbone", ["backbone"], cfg.replace(use_workspace=False))):
        ckpt.save_checkpoint(root / name / ckpt.checkpoint_name(1), PrismeModel(c), ckpt.TrainingState(
            stage=stage, step=1, tokenizer=None, stage_config=sc, extra={"trained_groups": groups}))
    return root


def mqar_eval(ck: Path, *more: str) -> list[str]:
    return ["eval", "--checkpoint", str(ck), "--batches", "1", "--batch-size", "2", "--bootstrap", "10", *more]


def test_slices_longer_than_the_window_are_refused_before_the_evaluation(ws_ckpt, capsys):
    """`--slices 100000` overflowed deep in the slices; now exit 2 naming --slices and the window, nothing scored.
    The n-gram code itself no longer overflows past float64's exact range (control: 16 still runs)."""
    from prisme.evaluation.slices import ar_slice_labels

    rc, out = run_cli(*mqar_eval(ws_ckpt / "ws", "--slices", "100000", "--policies", "backbone"))
    err = capsys.readouterr().err
    assert rc == 2 and out == "" and "--slices 100000" in err and "16" in err, err
    x = torch.randint(0, 256, (1, 40))
    assert ar_slice_labels(x, x, 30).shape == (1, 40)  # 256**30 > 2**53: compared token by token, no overflow
    assert run_cli(*mqar_eval(ws_ckpt / "ws", "--slices", "16", "--policies", "backbone"))[0] == 0


@pytest.mark.parametrize("name", ["fixed_1xk1", "controller(lambda=0)", "equal_edits(lambda=0.1)", "dense_2",
                                  "random_2xk2", "oracle(lambda=0)", "backbone", "backbone+matched"])
def test_a_reference_named_like_a_policy_row_is_refused_naming_the_option(ws_ckpt, capsys, name):
    """A reference whose name has the form of a policy row's (whatever prices the evaluation calibrates): exit 2
    naming --reference and the family, before any model is loaded."""
    rc, out = run_cli(*mqar_eval(ws_ckpt / "ws", "--reference", f"{name}={ws_ckpt / 'bb'}"))
    err = capsys.readouterr().err
    assert rc == 2 and out == "" and f"--reference {name}=" in err and "policy row's name" in err, err


def test_a_reference_name_of_its_own_is_scored(ws_ckpt, capsys):
    rc, out = run_cli(*mqar_eval(ws_ckpt / "ws", "--reference", f"fixed_model={ws_ckpt / 'bb'}", "--policies",
                                 "backbone,fixed"))
    assert rc == 0 and "fixed_model" in out and "fixed_1xk1" in out, capsys.readouterr().err


@pytest.mark.parametrize("which, want", [("bb", "backbone-only model"), ("s1", "no stage")])
def test_routing_bound_without_a_trained_workspace_fails_before_the_evaluation(ws_ckpt, capsys, which, want):
    rc, out = run_cli(*mqar_eval(ws_ckpt / which, "--reference", f"L1={ws_ckpt / 'bb'}", "--routing-bound",
                                 "--policies", "backbone"))
    err = capsys.readouterr().err
    assert rc == 2 and out == "" and "--routing-bound" in err and want in err, err


def prepared(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(TEXT_A[i * 50:i * 50 + 400])
    prepare(src, tmp_path / "prep", ByteTokenizer(), val_fraction=0.25)
    return tmp_path / "prep"


@pytest.mark.parametrize("case, named", [("train.bin missing", "train.bin is missing"),
                                         ("val.bin missing", "val.bin is missing"),
                                         ("odd size", "train.bin holds"), ("shorter", "val.bin holds"),
                                         ("no split", "no 'split' entry"), ("no val_fraction", "val_fraction"),
                                         ("no tokens", "no 'tokens' entry"), ("bad dtype", "dtype 'int8'"),
                                         ("not json", "not a readable manifest")])
def test_a_damaged_prepared_folder_is_an_error_naming_the_file(tmp_path, capsys, case, named):
    """Token files missing or cut (a whole token short, or half of one) and manifests missing an entry: each a
    ValueError naming the file (a missing file used to read as an empty split, a cut one as fewer tokens)."""
    d = prepared(tmp_path)
    m = json.loads((d / MANIFEST).read_text())
    if case.endswith("missing"):
        (d / case.split()[0]).unlink()
    elif case in ("odd size", "shorter"):
        f = d / ("train.bin" if case == "odd size" else "val.bin")
        f.write_bytes(f.read_bytes()[:-1 if case == "odd size" else -2])
    else:
        if case == "no split":
            m.pop("split")
        elif case == "no val_fraction":
            m["split"].pop("val_fraction")
        elif case == "no tokens":
            m.pop("tokens")
        elif case == "bad dtype":
            m["dtype"] = "int8"
        (d / MANIFEST).write_text("{" if case == "not json" else json.dumps(m))
    with pytest.raises(ValueError, match=named):
        ShardDataset(d)
    rc, _ = run_cli("train", "--preset", "tiny", "--set", "model.vocab_size=256", "--stage", "backbone", "--steps",
                    "1", "--batch-size", "2", "--seq-len", "8", "--dataset", str(d), "--out", str(tmp_path / "r"))
    err = capsys.readouterr().err
    assert rc == 2 and str(d) in err and "prepare the folder again" in err and not (tmp_path / "r").exists(), err


def test_a_whole_prepared_folder_reads(tmp_path):
    ds = ShardDataset(prepared(tmp_path))  # control for the damaged folders above
    assert ds.n_tokens("train") > 0 and ds.n_tokens("val") > 0


def test_prepare_refuses_what_no_training_can_validate_on(tmp_path, capsys):
    """`data prepare --val-fraction 0` and a one-document source (documents are split whole) made folders whose
    training then failed; now refused naming the option or the source. A folder prepared without validation (the
    API allows it, for measurements) is refused by training, naming it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(TEXT_A)
    (src / "b.txt").write_text(TEXT_B)
    rc, _ = run_cli("data", "prepare", str(src), "--out", str(tmp_path / "p0"), "--val-fraction", "0")
    assert rc == 2 and "--val-fraction" in capsys.readouterr().err and not (tmp_path / "p0").exists()
    with pytest.raises(ValueError, match="one document"):
        prepare(tmp_path / "src" / "a.txt", tmp_path / "p1", ByteTokenizer())
    m = prepare(src, tmp_path / "p2", ByteTokenizer(), val_fraction=0.99)  # at least one document stays in train
    assert m["documents"] == {"train": 1, "val": 1}
    prepare(src, tmp_path / "p3", ByteTokenizer(), val_fraction=0.0)
    rc, _ = run_cli("train", "--preset", "tiny", "--set", "model.vocab_size=256", "--stage", "backbone", "--steps",
                    "1", "--batch-size", "2", "--seq-len", "8", "--dataset", str(tmp_path / "p3"), "--out",
                    str(tmp_path / "r"))
    err = capsys.readouterr().err
    assert rc == 2 and "no validation documents" in err and "--val-fraction" in err, err


def test_a_vocabulary_no_text_can_reach_is_refused_before_the_trainer_allocates(tmp_path, capsys):
    """`tokenizer train --vocab-size 10000000000` aborted in the tokenizers library (out of memory); now exit 2."""
    pytest.importorskip("tokenizers")
    (tmp_path / "t.txt").write_text(TEXT_A)
    rc, _ = run_cli("tokenizer", "train", "--corpus", str(tmp_path / "t.txt"), "--vocab-size", "10000000000",
                    "--out", str(tmp_path / "bpe.json"))
    err = capsys.readouterr().err
    assert rc == 2 and "vocab_size=10000000000" in err and "at most" in err and not (tmp_path / "bpe.json").exists()


def test_the_eval_tables_verdicts_never_run_into_the_next_column():
    """"ties+0.0259": a difference with its verdict (31 characters) filled its 28-character column; a space now
    separates every column, header and rows alike."""
    d = {"mean": -0.1652, "lo": -0.1848, "hi": -0.1426}
    row = EvalRow(policy="fixed_1xk1", loss=3.28, ops_per_token=1.0, relative_ops=2.5, accuracy=None,
                  deployable=True, family="fixed", delta_vs_backbone=d, verdict_vs_backbone="beats",
                  delta_vs_matched=d, verdict_vs_matched="beats")
    rep = EvalReport(rows=[row], config={}, dataset="d", n_tokens=1, n_positions=1, batch_size=1, seq_len=1,
                     n_batches=1, accounting="optimised", lambdas=[], oracle_positions=None, seed=0)
    head, _, line = rep.table().splitlines()[:3]
    assert "beats -0.1652" in line and "beats    2.500" in line, line
    assert head.index("vs matched") == head.index("vs backbone") + 29 and head.index("rel ops") > 0


# ---------------------------------------------------------------------------------- studies
def tiny_recall_configs(tmp_path: Path) -> Path:
    """The recall recipe with small batches and evaluations (the quick study still runs every phase)."""
    from prisme.io import CONFIG_DIR
    from prisme.studies.recall_setup import RECIPE_FILES

    folder = tmp_path / "configs"
    folder.mkdir(exist_ok=True)
    for name in RECIPE_FILES.values():
        cfg = json.loads((CONFIG_DIR / name).read_text())
        if name == "recall_study.json":
            cfg.update(converged=False, eval_sequences=32, calibration_sequences=32, lambdas=[0.0, 0.1])
        else:
            cfg["batch_size"] = 8
        (folder / name).write_text(json.dumps(cfg))
    return folder


def recall_cmd(out: Path, configs: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "prisme", "study", "recall", "--quick", "--out", str(out), "--configs",
            str(configs), "--no-progress", *more]


def finished_stage(folder: Path) -> bool:
    meta = ckpt.read_meta(folder)
    return meta.step == meta.stage_config["steps"] and not meta.metrics.get("interrupted")


@pytest.mark.parametrize("sig, jobs", [(signal.SIGTERM, 2), (signal.SIGINT, 1)], ids=["SIGTERM-pool", "SIGINT-alone"])
def test_an_interrupted_study_stops_scores_nothing_and_continues(tmp_path, sig, jobs):
    """A signal while the study trains: it used to score the interrupted checkpoint, write recall.json and exit 0.
    Now every run saves and the study exits 130 / 143 saying how to continue, with no document; what it kept comes
    from finished stages only; rerunning (with --resume, or the same command) continues and tells so."""
    configs, out = tiny_recall_configs(tmp_path), tmp_path / "study"
    cmd = recall_cmd(out, configs, "--jobs", str(jobs))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and p.poll() is None and not any(out.glob("*/*/metrics.jsonl")):
        time.sleep(0.05)
    p.send_signal(sig)
    rc = p.wait(timeout=180)
    err = p.stderr.read()
    assert rc == 128 + sig, err
    assert sig.name in err and "--resume" in err and "Traceback" not in err, err
    assert not (out / "recall.json").exists()
    for metrics in out.glob("*/*/metrics.jsonl"):  # every stage that trained saved its checkpoint
        assert ckpt.latest_checkpoint(metrics.parent) is not None, metrics
    for kept in (out / ".prisme-study" / "done").glob("*.json"):  # a kept score comes from finished stages only
        run = Path(json.loads(kept.read_text())["task"]["folder"])
        assert all(finished_stage(stage) for stage in run.iterdir() if stage.is_dir()), run
    again = subprocess.run(cmd + (["--resume"] if jobs > 1 else []), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "continuing the study in" in again.stderr
    doc = json.loads((out / "recall.json").read_text())
    assert doc["scored"]["quick"] and doc["scored"]["eval_sequences"] == 32
    assert all(finished_stage(Path(s["controller_checkpoint"]).parent) for s in doc["seeds"])


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    """A finished quick recall study (tiny recipe, one process)."""
    root = tmp_path_factory.mktemp("quick")
    configs, out = tiny_recall_configs(root), root / "study"
    rc, _ = run_cli(*recall_cmd(out, configs, "--jobs", "1")[3:])
    assert rc == 0
    return configs, out


def test_evaluate_only_rescores_with_the_settings_the_study_was_run_with(quick_study, capsys):
    """`--evaluate-only` without --quick on a quick study re-scored it as a full study and overwrote recall.json
    (quick false, the full recipe's sequences and steps). Now it takes the study's own settings, says so, and the
    document keeps what it scored; the scores are the same."""
    configs, out = quick_study
    before = json.loads((out / "recall.json").read_text())
    rc, _ = run_cli(*[a for a in recall_cmd(out, configs, "--jobs", "1", "--evaluate-only", "--seeds", "0")[3:]
                      if a != "--quick"])
    err = capsys.readouterr().err
    assert rc == 0 and "re-scoring with the settings the study" in err and "quick=True" in err, err
    after = json.loads((out / "recall.json").read_text())
    assert after["scored"] == before["scored"] and after["scored"]["quick"] and after["study"]["quick"]
    assert after["scored"]["steps"]["seed0"] == {"backbone": 12, "workspace": 12, "controller": 6}
    assert after["seeds"][0]["controllers"] == before["seeds"][0]["controllers"]


def test_evaluate_only_rescores_a_study_recorded_before_a_config_field_was_added(quick_study, tmp_path, capsys):
    """A study recorded before a `PrismeConfig` field existed (`ADDED_CONFIG_FIELDS`, e.g. `bank_key`), and before
    the decode options and prices left it (`MOVED_CONFIG_FIELDS`, held at their defaults by its record and its
    checkpoints' config.json), re-scores with --evaluate-only to the same scores: the record is read at the values it
    ran with. Negative control: a record whose model differs in a real field (d_model) is refused, naming it."""
    import shutil

    from prisme.config import ADDED_CONFIG_FIELDS, MOVED_CONFIG_FIELDS

    configs, src = quick_study
    out = tmp_path / "older"
    shutil.copytree(src, out)
    record = out / ".prisme-study" / "settings.json"
    settings = json.loads(record.read_text())
    for run in settings["runs"].values():
        for field in ADDED_CONFIG_FIELDS:
            run["model"].pop(field, None)
        run["model"].update(MOVED_CONFIG_FIELDS)
    record.write_text(json.dumps(settings))
    for config in out.rglob("config.json"):  # each checkpoint's, as that version wrote it
        config.write_text(json.dumps({**json.loads(config.read_text()), **MOVED_CONFIG_FIELDS}))
    before = json.loads((out / "recall.json").read_text())
    rc, _ = run_cli(*recall_cmd(out, configs, "--jobs", "1", "--evaluate-only", "--seeds", "0")[3:])
    assert rc == 0, capsys.readouterr().err
    after = json.loads((out / "recall.json").read_text())
    assert [(s["fixed"], s["controllers"]) for s in after["seeds"]] == [(s["fixed"], s["controllers"])
                                                                      for s in before["seeds"]]
    next(iter(settings["runs"].values()))["model"]["d_model"] += 1
    record.write_text(json.dumps(settings))
    rc, _ = run_cli(*recall_cmd(out, configs, "--jobs", "1", "--evaluate-only", "--seeds", "0")[3:])
    err = capsys.readouterr().err
    assert rc == 2 and "other settings" in err and "d_model" in err, err


def test_evaluate_only_refuses_checkpoints_of_other_settings_and_a_document_of_another_kind(quick_study, tmp_path,
                                                                                           capsys):
    """Without the study's record (an older folder) a full re-score of quick checkpoints is refused naming the
    checkpoint's steps; a full study is never written over a quick study's document (refused before training);
    --resume on a folder holding no study is refused."""
    import shutil

    configs, src = quick_study
    out = tmp_path / "old"
    shutil.copytree(src, out)
    shutil.rmtree(out / ".prisme-study")
    (out / "recall.json").unlink()
    rc, _ = run_cli(*[a for a in recall_cmd(out, configs, "--jobs", "1", "--evaluate-only", "--seeds", "0")[3:]
                      if a != "--quick"])
    err = capsys.readouterr().err
    assert rc == 2 and "at step 24" in err and "quick: False" in err, err
    shutil.copy(src / "recall.json", out / "recall.json")
    listing = sorted(p.name for p in out.rglob("*"))
    rc, _ = run_cli(*[a for a in recall_cmd(out, configs, "--jobs", "1", "--seeds", "0")[3:] if a != "--quick"])
    err = capsys.readouterr().err
    assert rc == 2 and "recall.json is a study document of another kind" in err, err
    assert sorted(p.name for p in out.rglob("*")) == listing
    rc, _ = run_cli(*recall_cmd(tmp_path / "none", configs, "--jobs", "1", "--resume")[3:])
    assert rc == 2 and "holds no recall study to continue" in capsys.readouterr().err


def test_a_study_folder_continues_only_with_the_settings_it_was_started_with(tmp_path, capsys):
    """The text study and the demo: a folder where a study was started with other settings is refused naming them,
    --resume needs a started study, the same settings continue (nothing is trained by these checks)."""
    from prisme.studies import text
    from prisme.studies.demo import DemoOptions, run_demo
    from prisme.studies.runner import record_study

    model = PrismeConfig.from_name("tiny", vocab_size=256)
    cfg = text.TextStudyConfig(sources=["residual"], seeds=[3], scale=0.01, jobs=1, progress=False,
                               frontier=[[2, None]], out_dir=str(tmp_path / "text"))
    with pytest.raises(ValueError, match="--resume: .* holds no text study"):
        text.prepare_study(cfg, model, resume=True)
    model_cfg, stages, _ = text.prepare_study(cfg, model)
    record_study(cfg.out_dir, text.study_settings(cfg, model_cfg, stages))
    (tmp_path / "text" / "seed3").mkdir()
    assert text.prepare_study(cfg, model, resume=True)[2]  # the same settings: continued
    other = text.TextStudyConfig(**{**cfg.__dict__, "scale": 0.02})
    with pytest.raises(ValueError, match="other settings .*study.scale: was 0.01, now 0.02"):
        text.prepare_study(other, model)
    with pytest.raises(ValueError, match="holds no demo to continue"):
        run_demo(tmp_path / "demo", DemoOptions(scale=0.01, model_cfg=model, recall_seeds=[]), resume=True)


def stop_own_worker(seconds: float) -> str:
    os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends one worker
    time.sleep(seconds)
    return "never"


def sleep_then(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def test_a_signal_to_one_worker_stops_the_whole_pool_and_finished_tasks_are_kept(tmp_path):
    """SIGTERM to a single worker: its task stops and so does every other (the study raises StudyInterrupted once
    they have ended; the task that needs the stopped one never starts). A finished task is kept in the store and not
    run again by the next run, which tells that it continues."""
    from contextlib import redirect_stderr
    from io import StringIO

    from prisme.studies.runner import StudyInterrupted, Task, run_tasks

    store = tmp_path / "store"
    tasks = [Task("quick", sleep_then, (0.0,)), Task("stopped", stop_own_worker, (30.0,)),
             Task("after", sleep_then, (0.0,), needs=("stopped",))]
    assert run_tasks(tasks[:1], jobs=1, store=store) == {"quick": "slept"}
    with pytest.raises(StudyInterrupted) as e:
        run_tasks(tasks, jobs=2, store=store)
    assert e.value.signal == "SIGTERM" and "--resume" in str(e.value)
    ran = []
    err = StringIO()
    with redirect_stderr(err):
        got = run_tasks([tasks[0], Task("stopped", sleep_then, (0.0,)), tasks[2]], jobs=1, store=store,
                        on_done=lambda t, r, s: ran.append(t.name), resumed=True)
    assert ran == ["stopped", "after"] and got["quick"] == "slept" and "1 of 3 tasks had finished" in err.getvalue()


TINY_TEXT = """
import sys
from prisme import cli
from prisme.config import PrismeConfig
own = PrismeConfig.from_name.__func__
PrismeConfig.from_name = classmethod(lambda cls, name, **kw: own(cls, "tiny", vocab_size=256, **kw) if name == "demo"
                                     else own(cls, name, **kw))  # the text study on a tiny model
sys.exit(cli.main(sys.argv[1:]))
"""


def test_an_interrupted_text_study_stops_and_continues(tmp_path):
    """The text study (its pool, its training and evaluation tasks) under SIGINT: exit 130, no text.json, every
    stage that trained saved; the same command again continues to the document."""
    held = tmp_path / "held.txt"
    held.write_text(TEXT_B)
    out = tmp_path / "text"
    cmd = [sys.executable, "-c", TINY_TEXT, "study", "text", "--sources", "residual", "--seeds", "3", "--scale",
           "0.01", "--frontier", "2", "--val-batches", "1", "--held-out", str(held), "--jobs", "2", "--out",
           str(out), "--no-progress", "--confirm-seeds", "none"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and p.poll() is None and not list(out.rglob("metrics.jsonl")):
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=180)
    err = p.stderr.read()
    assert rc == 130 and "SIGINT" in err and "--resume" in err and not (out / "text.json").exists(), err
    for metrics in out.rglob("metrics.jsonl"):
        assert ckpt.latest_checkpoint(metrics.parent) is not None, metrics
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "continuing the study in" in again.stderr, again.stderr
    assert json.loads((out / "text.json").read_text())["seeds"]["3"]["sources"]["residual"]["val"]["rows"]
