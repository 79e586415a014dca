"""The tokenizer is part of the checkpoint: a model trained with a BPE keeps it in every checkpoint folder, and
`generate`, `eval` and `export-hf` use it without a flag, even after the run folder has moved and the original
tokenizer file is gone. A stage never trains on other tokens than the checkpoint it starts from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_run_safety import run_cli

from prisme import checkpoint as ckpt
from prisme.data.tokenizers import BPETokenizer, ByteTokenizer

pytest.importorskip("tokenizers")

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families.\n") * 40


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> dict[str, Path]:
    """`prisme train --tokenizer bpe.json` on a text folder; then the tokenizer file is deleted and the run moved."""
    root = tmp_path_factory.mktemp("tok")
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text(TEXT)
    BPETokenizer.train(TEXT, 300).save(root / "bpe.json")
    cfg = root / "run.json"
    cfg.write_text(json.dumps({"model": {"preset": "tiny", "vocab_size": 320, "max_seq_len": 64}, "stage": "backbone",
                               "steps": 2, "batch_size": 4, "seq_len": 32, "eval_every": 0, "progress": False}))
    rc, _ = run_cli("train", "--config", str(cfg), "--dataset", str(root / "corpus"), "--tokenizer",
                    str(root / "bpe.json"), "--out", str(root / "run"), "--no-progress")
    assert rc == 0
    want = BPETokenizer.load(root / "bpe.json")
    (root / "bpe.json").unlink()
    shutil.move(root / "run", root / "moved")
    return {"root": root, "run": root / "moved", "want": want}


def test_every_checkpoint_holds_its_bpe_and_generate_uses_it_after_a_move(bpe_run, capsys):
    run = bpe_run["run"]
    tok = ckpt.load_tokenizer(run)
    assert isinstance(tok, BPETokenizer) and tok.identity == bpe_run["want"].identity
    rc, out = run_cli("generate", "--checkpoint", str(run), "--prompt", "a truth", "--max-new-tokens", "3")
    assert rc == 0 and out.startswith("a truth"), capsys.readouterr().err
    # the text after the prompt is what the BPE decodes (the byte tokenizer would be refused: vocab 256 <= 320,
    # but its ids would spell other strings)
    rc, ids_out = run_cli("generate", "--checkpoint", str(run), "--prompt-ids", ",".join(
        map(str, tok.encode("a truth"))), "--max-new-tokens", "3")
    new_ids = [int(t) for t in ids_out.split(",")[-1].split()[1:]]
    assert rc == 0 and out.strip() == "a truth" + tok.decode(new_ids)


def test_eval_uses_the_checkpoints_own_tokenizer_after_a_move(bpe_run, capsys):
    rc, out = run_cli("eval", "--checkpoint", str(bpe_run["run"]), "--batches", "1", "--batch-size", "2",
                      "--policies", "backbone", "--corpus", str(bpe_run["root"] / "corpus"))
    assert rc == 0, capsys.readouterr().err
    assert "backbone" in out


def test_a_missing_tokenizer_file_is_named(bpe_run, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(bpe_run["run"], broken)
    (ckpt.resolve_checkpoint(broken) / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"tokenizer\.json is missing"):
        ckpt.load_tokenizer(broken)


def test_a_stage_on_other_tokens_than_its_init_is_refused(bpe_run, tmp_path, capsys):
    """The workspace stage from the BPE backbone with the default (byte) tokenizer: refused, naming --tokenizer;
    with the checkpoint folder as --tokenizer it trains."""
    args = ["train", "--stage", "workspace", "--init-from", str(bpe_run["run"]), "--dataset",
            str(bpe_run["root"] / "corpus"), "--steps", "1", "--batch-size", "2", "--seq-len", "32", "--no-progress"]
    rc, _ = run_cli(*args, "--out", str(tmp_path / "ws"))
    err = capsys.readouterr().err
    assert rc == 2 and "--tokenizer" in err and "ByteTokenizer" in err
    assert not (tmp_path / "ws" / "latest").exists()
    rc, _ = run_cli(*args, "--out", str(tmp_path / "ws2"), "--tokenizer", str(ckpt.resolve_checkpoint(bpe_run["run"])))
    assert rc == 0
    assert isinstance(ckpt.load_tokenizer(tmp_path / "ws2"), BPETokenizer)


def test_token_id_models_record_no_tokenizer_and_generate_asks_for_ids(tmp_path, capsys):
    from prisme.config import PrismeConfig
    from prisme.training.config import StageConfig
    from prisme.training.trainer import train_stage

    res = train_stage(PrismeConfig.from_name("tiny"), StageConfig(
        stage="backbone", steps=1, batch_size=4, seq_len=16, out_dir=str(tmp_path / "m"), dataset="mqar",
        mqar=dict(vocab_size=64, seq_len=16, n_pairs=2, query_min_pos=4), progress=False, eval_every=0))
    assert ckpt.load_tokenizer(res.checkpoint) is None
    rc, _ = run_cli("generate", "--checkpoint", str(res.checkpoint), "--prompt", "hello")
    assert rc == 2 and "--prompt-ids" in capsys.readouterr().err
    assert run_cli("generate", "--checkpoint", str(res.checkpoint), "--prompt-ids", "1,2", "--max-new-tokens",
                   "1")[0] == 0


def test_a_checkpoint_saved_without_a_record_reads_its_stage_config(tmp_path):
    """Older checkpoints (no `tokenizer` entry in state.json) go by their stage config: byte unless MQAR."""
    from prisme.config import PrismeConfig
    from prisme.model.prisme import PrismeModel

    model = PrismeModel(PrismeConfig.from_name("tiny"))
    ckpt.save_checkpoint(tmp_path / "a", model, ckpt.TrainingState("backbone", 0, stage_config={"dataset": "austen"}))
    ckpt.save_checkpoint(tmp_path / "b", model, ckpt.TrainingState("backbone", 0, stage_config={"dataset": "mqar"}))
    assert isinstance(ckpt.load_tokenizer(tmp_path / "a"), ByteTokenizer)
    assert ckpt.load_tokenizer(tmp_path / "b") is None


def test_export_hf_writes_the_checkpoints_own_bpe(bpe_run, tmp_path):
    """`prisme export-hf` with no --tokenizer: the exported tokenizer is the BPE the model was trained with."""
    transformers = pytest.importorskip("transformers")
    rc, _ = run_cli("export-hf", "--checkpoint", str(bpe_run["run"]), "--out", str(tmp_path / "hf"))
    assert rc == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "a truth universally acknowledged"
    assert hf_tok(text)["input_ids"] == bpe_run["want"].encode(text)
    assert hf_tok(text)["input_ids"] != list(text.encode())  # control: not the byte tokenizer
