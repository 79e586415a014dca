"""Your own data: `prisme data prepare` turns documents (a folder searched recursively for .txt / .md / .jsonl, or a
saved Hugging Face dataset) into memory-mapped token files split by whole documents, and `prisme train --dataset
DIR` trains on them with the prepared tokenizer, in memory that does not grow with the corpus."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from test_run_safety import run_cli

from prisme import checkpoint as ckpt
from prisme.data.shards import ShardDataset, prepare
from prisme.data.text import TokenDataset
from prisme.data.tokenizers import BPETokenizer, ByteTokenizer

DOCS = {"sub/a.txt": "It is a truth universally acknowledged.", "sub/deep/b.md": "Emma Woodhouse, handsome.",
        "c.jsonl": None}
ROWS = ["First row of the jsonl.", "Second row, with a comma.", "Third."]


def corpus(root: Path) -> Path:
    src = root / "src"
    for name, text in DOCS.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        if text is not None:
            (src / name).write_text(text)
    (src / "c.jsonl").write_text("\n".join(json.dumps({"text": r, "id": i}) for i, r in enumerate(ROWS)) + "\n\n")
    (src / "table.csv").write_text("a,b\n1,2\n")
    return src


def test_prepare_reads_a_folder_recursively_and_splits_whole_documents(tmp_path):
    src = corpus(tmp_path)
    tok = ByteTokenizer()
    m = prepare(src, tmp_path / "data", tok, val_fraction=0.2, seed=1)
    texts = [DOCS["sub/a.txt"], DOCS["sub/deep/b.md"], *ROWS]
    assert m["documents"] == {"train": 4, "val": 1} and m["dtype"] == "uint16" and m["eod_id"] == 0
    assert m["skipped"] == [str(src / "table.csv")]  # named, not silently dropped
    assert m["tokens"]["train"] + m["tokens"]["val"] == sum(len(t.encode()) + 1 for t in texts)
    ds = ShardDataset(tmp_path / "data")
    docs = {s: bytes(ds.split_tokens(s)[torch.arange(ds.n_tokens(s))].tolist()).decode().split("\x00")[:-1]
            for s in ("train", "val")}
    assert sorted(docs["train"] + docs["val"]) == sorted(texts) and len(docs["val"]) == 1  # whole documents


def test_shard_batches_equal_an_in_memory_dataset_of_the_same_tokens(tmp_path):
    prepare(corpus(tmp_path), tmp_path / "data", ByteTokenizer(), val_fraction=0.2)
    ds = ShardDataset(tmp_path / "data")
    train = np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint16)
    ref = TokenDataset(train.astype(np.int64), val_fraction=0.0)
    for seed in range(3):
        a = ds.batch("train", 4, 8, torch.Generator().manual_seed(seed))
        b = ref.batch("train", 4, 8, torch.Generator().manual_seed(seed))
        assert all(torch.equal(x, y) for x, y in zip(a, b)) and a[0].dtype == torch.long
    assert ds.n_eval_windows("train", 8) == ref.n_eval_windows("train", 8)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(ds.iter_eval("train", 3, 8), ref.iter_eval("train", 3, 8)))


def test_train_on_prepared_bpe_data_keeps_its_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    src = corpus(tmp_path)
    (src / "more.txt").write_text("It is a truth universally acknowledged, that a single man. " * 60)
    bpe = BPETokenizer.train((src / "more.txt").read_text(), 280)
    bpe.save(tmp_path / "bpe.json")
    rc, _ = run_cli("data", "prepare", str(src), "--out", str(tmp_path / "data"), "--tokenizer",
                    str(tmp_path / "bpe.json"))
    assert rc == 0
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model": {"preset": "tiny", "vocab_size": 300}, "stage": "backbone", "steps": 2,
                               "batch_size": 2, "seq_len": 16, "eval_every": 0}))
    rc, _ = run_cli("train", "--config", str(cfg), "--dataset", str(tmp_path / "data"), "--out", str(tmp_path / "r"),
                    "--no-progress")
    assert rc == 0
    assert ckpt.load_tokenizer(tmp_path / "r").identity == bpe.identity  # the manifest's tokenizer, no flag
    # as a user would: move the run (and drop the tokenizer file), then generate and evaluate with no tokenizer flag
    (tmp_path / "bpe.json").unlink()
    (tmp_path / "r").rename(tmp_path / "moved")
    rc, out = run_cli("generate", "--checkpoint", str(tmp_path / "moved"), "--prompt", "It is", "--max-new-tokens", "3")
    assert rc == 0 and out.startswith("It is")
    rc, out = run_cli("eval", "--checkpoint", str(tmp_path / "moved"), "--batches", "1", "--batch-size", "2",
                      "--policies", "backbone")
    assert rc == 0 and "backbone" in out


MEMORY = textwrap.dedent("""
    import sys, numpy as np, torch
    from prisme.data.shards import ShardDataset
    from prisme.data.text import TokenDataset

    def rss_kib():  # the process's own memory: file pages of the memory map are the page cache's, shared
        return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1])

    path, mode = sys.argv[1], sys.argv[2]
    before = rss_kib()
    ds = ShardDataset(path) if mode == "shards" else TokenDataset(np.fromfile(path + "/train.bin", dtype=np.uint16))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ds.batch("train", 16, 64, g)
    print(rss_kib() - before)  # what the dataset and its batches hold, KiB
""")


@pytest.mark.slow
def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """Anonymous (private) resident memory the dataset adds, with 1 MB and 16 MB of prepared text: the same within 8
    MiB for the memory map (its pages are the page cache's); the in-memory dataset of the same tokens (the negative
    control) grows by more than 40 MiB (Linux). In the slow set (four interpreters), which CI runs."""
    peaks = {}
    for name, n_docs in (("small", 1), ("large", 16)):
        src = tmp_path / f"src_{name}"
        src.mkdir()
        for i in range(n_docs):
            (src / f"{i}.txt").write_text(("x" * 99 + "\n") * 10_000)  # 1 MB per document
        prepare(src, tmp_path / name, ByteTokenizer(), val_fraction=0.0)
        for mode in ("shards", "memory"):
            out = subprocess.run([sys.executable, "-c", MEMORY, str(tmp_path / name), mode], capture_output=True,
                                 text=True, check=True)
            peaks[name, mode] = int(out.stdout.split()[-1]) / 1024  # MiB added
    assert peaks["large", "shards"] - peaks["small", "shards"] < 8, peaks
    assert peaks["large", "memory"] - peaks["small", "memory"] > 40, peaks


@pytest.mark.parametrize("case", ["no documents", "bad json", "missing field", "not empty"])
def test_bad_sources_are_named_before_anything_is_written(tmp_path, case):
    src = tmp_path / "src"
    src.mkdir()
    out = tmp_path / "out"
    if case == "no documents":
        (src / "t.csv").write_text("a,b")
        want = "holds no readable document"
    elif case == "bad json":
        (src / "d.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
        want = r"d\.jsonl, line 2: not valid JSON"
    elif case == "missing field":
        (src / "d.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
        want = r"d\.jsonl, line 2: no text field 'text'"
    else:
        (src / "a.txt").write_text("text")
        out.mkdir()
        (out / "x").write_text("keep me")
        want = "not empty"
    with pytest.raises(ValueError, match=want):
        prepare(src, out, ByteTokenizer())
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == [] and (not out.exists() or [p.name for p in out.iterdir()] == ["x"])


def test_a_saved_hugging_face_dataset_is_read(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": ROWS}).save_to_disk(str(tmp_path / "hf"))
    m = prepare(tmp_path / "hf", tmp_path / "data", ByteTokenizer(), text_field="body", val_fraction=0.0)
    assert m["documents"]["train"] == 3 and m["tokens"]["train"] == sum(len(r) + 1 for r in ROWS)
