"""The named corpora (`data.corpora`): the shipped texts and their licences, the split by whole files, files, folders
and prepared folders, and the AR-hit statistic against a plain search."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from prisme.data.corpora import (
    CORPORA,
    CORPORA_DIR,
    ar_hit_fraction,
    corpus_names,
    pack_documents,
    resolve_corpus,
    split_documents,
    unpack_documents,
)
from prisme.data.shards import ShardDataset, prepare
from prisme.data.text import TokenDataset, load_text
from prisme.data.tokenizers import ByteTokenizer


def test_every_embedded_corpus_ships_with_its_licence_and_its_manifest_matches_its_bytes():
    """Each name loads; the code corpora's text has the manifest's size and sha256, one document per listed file;
    each licence file is beside it; an alias names the same corpus."""
    assert set(corpus_names()) == {"austen", "bierce", "python-stdlib", "click", "pyparsing", "devils_dictionary"}
    assert resolve_corpus("devils_dictionary") is CORPORA["bierce"]
    assert resolve_corpus(None) is CORPORA["austen"]
    for name, manifest in (("python-stdlib", "python_stdlib.json"), ("click", "click.json"),
                           ("pyparsing", "pyparsing.json")):
        c = CORPORA[name]
        m = json.loads((CORPORA_DIR / manifest).read_text())
        data = c.text().encode("utf-8")
        assert (len(data), hashlib.sha256(data).hexdigest()) == (m["bytes"], m["sha256"])
        assert [n for n, _ in c.documents()] == list(m["file_list"]) and m["licence"] == c.licence
        assert (CORPORA_DIR / c.licence_file).is_file() and c.by_files
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in (CORPORA_DIR / "LICENSE-python-stdlib.txt").read_text()
    assert "Redistribution and use" in (CORPORA_DIR / "LICENSE-click.txt").read_text()


def test_austen_through_the_registry_is_the_same_bytes_and_the_same_split():
    """The registry's Austen is `load_text("austen")`, and its dataset the contiguous split the studies use."""
    c = resolve_corpus("austen")
    assert c.text() == load_text("austen") and not c.by_files and c.record()["split"] == "contiguous"
    ds, ref = c.dataset(), TokenDataset.from_text(load_text("austen"), ByteTokenizer(), val_fraction=0.1)
    assert ds.split_index == ref.split_index and torch.equal(ds.tokens, ref.tokens)
    assert resolve_corpus("bierce").text() == load_text("devils_dictionary")


def test_the_code_corpus_splits_by_whole_files_and_the_held_out_code_is_another_project():
    """python-stdlib's validation is whole files (about 10 % of the bytes, the same files every time), its token
    split lies exactly at a file header; click shares no file and no `import click` with it."""
    c = resolve_corpus("python-stdlib")
    train, val = c.split()
    assert c.split() == (train, val) and len(train) + len(val) == len(c.documents())
    assert not {n for n, _ in train} & {n for n, _ in val}
    share = sum(len(t) for _, t in val) / len(c.text())
    assert 0.1 <= share < 0.2
    ds = c.dataset()
    assert ByteTokenizer().decode(ds.val_tokens[:6].tolist()) == "# ==> "
    assert ds.n_tokens("train") == sum(len(t.encode()) for _, t in train)
    click = resolve_corpus("click")
    assert not {n for n, _ in click.documents()} & {n for n, _ in c.documents()}
    assert "import click" not in c.text() and "click" in click.text()
    pp = resolve_corpus("pyparsing")  # the second held-out project: no file and no import in common either
    assert not {n for n, _ in pp.documents()} & {n for n, _ in c.documents()}
    assert "import pyparsing" not in c.text() and "from pyparsing" not in c.text() and "pyparsing" in pp.text()
    held = click.held_out(seq_len=1024)
    assert held.n_tokens("train") == 0 and held.n_tokens("val") == len(click.text().encode())


def test_pack_and_unpack_are_inverse_and_a_header_like_line_is_refused():
    """Files packed with their headers unpack to the same files; a text holding a header line cannot be packed."""
    docs = [("a.py", "x = 1\n"), ("sub/b.py", "def f():\n    return 2")]  # the second lacks its last newline
    text = pack_documents(docs)
    assert text == "# ==> a.py <==\nx = 1\n# ==> sub/b.py <==\ndef f():\n    return 2\n"
    back = unpack_documents(text)
    assert [n for n, _ in back] == ["a.py", "sub/b.py"] and "".join(t for _, t in back) == text
    assert pack_documents(back, headed=True) == text
    with pytest.raises(ValueError, match="file header"):
        pack_documents([("c.py", "# ==> evil.py <==\n")])
    with pytest.raises(ValueError, match="starts with a file header"):
        unpack_documents("no header\n")


def test_split_by_files_moves_shuffled_files_to_validation_until_they_hold_the_fraction():
    """The rule by hand: files in name order, shuffled by `random.Random(seed)`, taken until their bytes reach the
    fraction; at least one file each side. Negative control: another seed picks other files."""
    docs = [(f"f{i:02d}", "x" * (10 + i)) for i in range(20)]
    train, val = split_documents(list(reversed(docs)), 0.25, seed=3)
    order = list(range(20))
    random.Random(3).shuffle(order)
    want, got = set(), 0
    for i in order:
        if want and got >= 0.25 * sum(10 + k for k in range(20)):
            break
        want.add(i)
        got += 10 + i
    assert [n for n, _ in val] == [f"f{i:02d}" for i in sorted(want)]
    assert [n for n, _ in train] == [f"f{i:02d}" for i in range(20) if i not in want]
    assert split_documents(docs, 0.25, seed=4)[1] != val
    assert len(split_documents(docs[:2], 0.99)[0]) == 1 and len(split_documents(docs[:2], 0.01)[1]) == 1
    with pytest.raises(ValueError, match="two or more"):
        split_documents(docs[:1])
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        split_documents(docs, 0.0)


def test_a_folder_is_read_recursively_and_split_by_whole_files(tmp_path: Path):
    """Every file under a folder (hidden ones and __pycache__ skipped), headed by its path, split by files; a file
    is one text split contiguously; bad input names the problem."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / ".git").mkdir()
    (tmp_path / "pkg" / "__pycache__").mkdir()
    for i in range(6):
        (tmp_path / "pkg" / ("sub" if i % 2 else "") / f"m{i}.py").write_text(f"def f{i}():\n    return {i}\n" * 40)
    (tmp_path / "pkg" / ".git" / "HEAD").write_text("ref: main\n")
    (tmp_path / "pkg" / "__pycache__" / "m0.pyc").write_bytes(b"\x00\xff")
    c = resolve_corpus(tmp_path / "pkg")
    assert c.kind == "folder" and c.by_files
    names = [n for n, _ in c.documents()]
    assert names == sorted(["m0.py", "m2.py", "m4.py", "sub/m1.py", "sub/m3.py", "sub/m5.py"])
    train, val = c.split(0.2)
    ds = c.dataset(val_fraction=0.2)
    assert ByteTokenizer().decode(ds.val_tokens.tolist()) == "".join(t for _, t in val)
    one = tmp_path / "one.txt"
    one.write_text("abc " * 100)
    f = resolve_corpus(one)
    assert f.kind == "file" and f.dataset().split_index == TokenDataset.from_text("abc " * 100, ByteTokenizer()
                                                                                 ).split_index
    (tmp_path / "pkg" / "latin.py").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="latin.py is not valid UTF-8"):
        resolve_corpus(tmp_path / "pkg").documents()
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "d.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError, match="prisme data prepare"):
        resolve_corpus(tmp_path / "json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no file"):
        resolve_corpus(tmp_path / "empty")
    with pytest.raises(ValueError, match="unknown corpus 'austin'.*austen, bierce, python-stdlib, click, pyparsing"):
        resolve_corpus("austin")


def test_a_prepared_folder_keeps_its_own_split_and_scores_whole_as_held_out(tmp_path: Path):
    """A folder written by `prisme data prepare` is its `ShardDataset`; as held-out text every token is scored."""
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(4):
        (src / f"d{i}.txt").write_text(f"document {i} " * 30)
    prepare(src, tmp_path / "prep", val_fraction=0.25)
    c = resolve_corpus(str(tmp_path / "prep"))
    ds = c.dataset()
    assert c.kind == "prepared" and isinstance(ds, ShardDataset)
    held = c.held_out(seq_len=16)
    assert held.n_tokens("val") == ds.n_tokens("train") + ds.n_tokens("val") and held.n_tokens("train") == 0
    assert c.record()["kind"] == "prepared" and "sha256" not in c.record()
    with pytest.raises(ValueError, match="tokens, not text"):
        c.text()


def _ar_hits_by_hand(tokens: list[int], window: int, n: int, own: bool = False) -> float:
    """A plain search: position t of each window is a hit when some j < t (`own`: j <= t) ends the same n tokens
    and the token after j is t's target."""
    hits, n_win = 0, (len(tokens) - 1) // window
    for w in range(n_win):
        x, y = tokens[w * window:(w + 1) * window], tokens[w * window + 1:(w + 1) * window + 1]
        for t in range(n - 1, window):
            js = range(n - 1, t + 1 if own else t)
            hits += any(x[j - n + 1:j + 1] == x[t - n + 1:t + 1] and j + 1 < window and x[j + 1] == y[t] for j in js)
    return hits / (n_win * window)


@pytest.mark.parametrize("n, window, k, scale", [(1, 16, 4, 1), (2, 24, 3, 1), (4, 32, 2, 1), (4, 20, 3, 20_000)])
def test_ar_hit_fraction_equals_a_plain_search_and_the_slices(n, window, k, scale):
    """The share of AR hits per window against a plain search and `evaluation.slices`' labels (a vocabulary too big
    to pack the n-gram into one integer included). Negative control: counting a position's own n-gram as earlier."""
    from prisme.evaluation.slices import ar_slice_labels

    g = np.random.default_rng(n)
    toks = (g.integers(0, k, size=window * 5 + 3) * scale).tolist()
    got = ar_hit_fraction(toks, window, n)
    assert got == pytest.approx(_ar_hits_by_hand(toks, window, n), abs=1e-12) and 0 < got < 1
    assert got != pytest.approx(_ar_hits_by_hand(toks, window, n, own=True), abs=1e-12)
    t = torch.tensor(toks[:window * 5 + 1])
    x, y = t[:-1].view(5, window), t[1:].view(5, window)
    assert got == pytest.approx(float((ar_slice_labels(x, y, n) == 0).double().mean()), abs=1e-12)
    with pytest.raises(ValueError, match="more than one window"):
        ar_hit_fraction(toks[:window], window, n)
