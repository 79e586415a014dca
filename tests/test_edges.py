"""Nothing silently wrong at the edges: a model's tokenizer is part of every comparison, raw `.jsonl` is prepared
before it is trained on, a study is interrupted and re-scored as it was run, and each unclear input is one line naming
the option or file, before work starts. (The HF export's config and padding: `tests/test_hf_full.py`.)"""

from __future__ import annotations

import json
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
        ckpt.save_checkpoint(root / name / ckpt.checkpoint_name(1), PrismeModel(cfg), stage=stage, step=1,
                             tokenizer=tok, stage_config={**sc, "tokenizer": "byte" if tok_name == "byte" else
                                                          str(root / f"{tok_name}.json")},
                             extra={"trained_groups": ["backbone"] + (["workspace"] if stage == "workspace" else [])})
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
        ckpt.save_checkpoint(root / name / ckpt.checkpoint_name(1), PrismeModel(c), stage=stage, step=1,
                             tokenizer=None, stage_config=sc, extra={"trained_groups": groups})
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
