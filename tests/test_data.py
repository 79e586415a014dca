from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prisme.data.mqar import MQARConfig, MQARDataset, make_mqar_batch, mqar_accuracy
from prisme.data.text import IGNORE_INDEX, TokenDataset, load_text, token_cache_path
from prisme.data.tokenizers import BPETokenizer, ByteTokenizer, _split_for_encoding, get_tokenizer

SMALL_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife.\nHowever little known the feelings or views of such a man may be on his first "
    "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families.\n"
    "\n\n\nCHAPTER  II\n  \n"
) * 20 + "Café — naïve façade, 日本語, emoji 🎉.\n"


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(SMALL_TEXT, vocab_size=300)


# ---------------------------------------------------------------------------------------------------------- tokenizers


def test_byte_roundtrip_non_ascii():
    """Byte tokenizer encodes to UTF-8 bytes and decodes back exactly, including non-ASCII text."""
    tok = ByteTokenizer()
    s = "Émma — 日本 🎉"
    ids = tok.encode(s)
    assert ids == list(s.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids) and tok.vocab_size == 256
    assert tok.decode(ids) == s
    assert tok.decode([0xFF]) == "\ufffd"


def test_bpe_roundtrip_and_save_load(bpe: BPETokenizer, tmp_path: Path):
    """BPE round-trips text exactly, compresses vs bytes, and a saved/loaded copy encodes identically."""
    assert 256 < bpe.vocab_size <= 300
    ids = bpe.encode(SMALL_TEXT)
    assert bpe.decode(ids) == SMALL_TEXT
    assert len(ids) < len(SMALL_TEXT.encode("utf-8")) * 0.8
    assert max(ids) < bpe.vocab_size
    path = tmp_path / "tok.json"
    bpe.save(path)
    loaded = BPETokenizer.load(path)
    assert loaded.encode(SMALL_TEXT) == ids
    assert loaded.identity == bpe.identity and loaded.vocab_size == bpe.vocab_size
    assert get_tokenizer("bpe", path=path).encode("a truth") == bpe.encode("a truth")


def test_bpe_chunked_encoding_matches_whole(bpe: BPETokenizer):
    """Encoding in newline-aligned chunks yields exactly the tokens of encoding the whole text at once."""
    chunks = _split_for_encoding(SMALL_TEXT, 100)
    assert len(chunks) > 5 and "".join(chunks) == SMALL_TEXT
    assert bpe.encode(SMALL_TEXT, chunk_chars=100) == bpe.encode(SMALL_TEXT, chunk_chars=10**9)


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet="ab \n\t.'é", max_size=60), chunk_chars=st.integers(1, 12))
def test_split_for_encoding_preserves_pretokens(text: str, chunk_chars: int):
    """Chunk cuts never change byte-level pre-tokenization: pre-tokens of the chunks concatenate to the whole's."""
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    chunks = _split_for_encoding(text, chunk_chars)
    assert "".join(chunks) == text
    whole = [p for p, _ in pre.pre_tokenize_str(text)]
    parts = [p for c in chunks for p, _ in pre.pre_tokenize_str(c)]
    assert parts == whole


def test_get_tokenizer_errors():
    """Unknown tokenizer kinds and BPE without text or path raise ValueError."""
    assert isinstance(get_tokenizer(), ByteTokenizer)
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        get_tokenizer("wordpiece")
    with pytest.raises(ValueError, match="needs `text`"):
        get_tokenizer("bpe")


# ---------------------------------------------------------------------------------------------------------- load_text


def test_embedded_corpus_loads():
    """The embedded Austen corpus loads via None and 'austen', starts with EMMA and is about 4 MB."""
    text = load_text(None)
    assert text.startswith("EMMA")
    assert load_text("austen") is text
    assert 3_900_000 < len(text.encode("utf-8")) < 4_100_000
    assert "Emma Woodhouse, handsome, clever, and rich" in text[:2000]


def test_load_file_and_folder(tmp_path: Path):
    """A file is read as-is; a folder concatenates its *.txt/*.md files in name order with blank lines."""
    (tmp_path / "b.md").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first é", encoding="utf-8")
    (tmp_path / "c.csv").write_text("ignored", encoding="utf-8")
    assert load_text(tmp_path / "a.txt") == "first é"
    assert load_text(str(tmp_path)) == "first é\n\nsecond"


def test_load_text_errors(tmp_path: Path):
    """Missing paths, empty folders, empty files and invalid UTF-8 raise ValueError naming the problem."""
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="does not exist") as e:
        load_text(missing)
    assert str(missing) in str(e.value)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match=r"no \*\.txt/\*\.md files"):
        load_text(empty_dir)
    (tmp_path / "blank.txt").write_text("  \n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        load_text(tmp_path / "blank.txt")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe bytes")
    with pytest.raises(ValueError, match="not valid UTF-8") as e:
        load_text(bad)
    assert "bad.txt" in str(e.value)


# ------------------------------------------------------------------------------------------------------ TokenDataset


def test_split_deterministic_and_contiguous():
    """The last val_fraction of the stream is validation, train+val equals the full stream, and it is repeatable."""
    tok = ByteTokenizer()
    text = SMALL_TEXT
    ds = TokenDataset.from_text(text, tok, val_fraction=0.1)
    full = torch.tensor(tok.encode(text), dtype=torch.int32)
    assert torch.equal(torch.cat([ds.train_tokens, ds.val_tokens]), full)
    assert ds.n_tokens("val") == int(len(full) * 0.1)
    assert ds.n_tokens("train") + ds.n_tokens("val") == len(full)
    ds2 = TokenDataset.from_text(text, tok, val_fraction=0.1)
    assert torch.equal(ds2.val_tokens, ds.val_tokens)
    assert tok.decode(ds.val_tokens.tolist()) == text.encode("utf-8")[-ds.n_tokens("val") :].decode("utf-8", "replace")


def test_token_cache_created_and_reused(bpe: BPETokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The first load writes a uint16 .npy cache; a second load reads it without encoding and gives equal tokens."""
    ds1 = TokenDataset.from_text(SMALL_TEXT, bpe, cache_dir=tmp_path, name="small")
    path = token_cache_path(tmp_path, SMALL_TEXT, bpe, name="small")
    assert path.is_file() and path.name.startswith("small-")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp files left behind
    arr = np.load(path)
    assert arr.dtype == np.uint16 and arr.tolist() == bpe.encode(SMALL_TEXT)

    def boom(*args, **kwargs):
        raise AssertionError("encode must not be called when the cache exists")

    monkeypatch.setattr(bpe, "encode", boom)
    ds2 = TokenDataset.from_text(SMALL_TEXT, bpe, cache_dir=tmp_path, name="small")
    assert torch.equal(ds1.tokens, ds2.tokens)
    # a different tokenizer (bytes) gets a different cache key
    assert token_cache_path(tmp_path, SMALL_TEXT, ByteTokenizer(), name="small") != path


def test_batch_shift_and_reproducible():
    """batch() targets are inputs shifted by one, windows come from the split, and equal seeds give equal batches."""
    tok = ByteTokenizer()
    ds = TokenDataset.from_text(SMALL_TEXT, tok, val_fraction=0.2)
    x, y = ds.batch("train", 8, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    train = bytes(ds.train_tokens.tolist())
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        assert bytes(row_x + row_y[-1:]) in train
    x2, y2 = ds.batch("train", 8, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = ds.batch("train", 8, 16, torch.Generator().manual_seed(1))
    assert not torch.equal(x, x3)


def test_iter_eval_covers_split_in_order():
    """iter_eval yields non-overlapping windows that tile the split in order, with max_batches respected."""
    ds = TokenDataset(np.arange(103), val_fraction=0.0)
    batches = list(ds.iter_eval("train", batch_size=4, seq_len=10))
    xs = torch.cat([b[0] for b in batches])
    ys = torch.cat([b[1] for b in batches])
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]
    assert torch.equal(xs.reshape(-1), torch.arange(100))
    assert torch.equal(ys.reshape(-1), torch.arange(1, 101))
    assert len(list(ds.iter_eval("train", 4, 10, max_batches=2))) == 2
    assert ds.n_eval_windows("train", 10) == 10


def test_too_small_corpus_raises():
    """A split shorter than seq_len + 1 raises ValueError stating the seq_len and the token count."""
    ds = TokenDataset.from_text("hello world, tiny", ByteTokenizer(), val_fraction=0.25)
    assert ds.n_tokens("val") == 4
    with pytest.raises(ValueError, match=r"too small for seq_len=8.*val split has 4 tokens"):
        ds.batch("val", 2, 8, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"too small for seq_len=64.*train split has 13 tokens"):
        next(ds.iter_eval("train", 2, 64))
    with pytest.raises(ValueError, match="unknown split"):
        ds.n_tokens("test")


# ---------------------------------------------------------------------------------------------------------- MQAR


def _check_mqar(cfg: MQARConfig, x: torch.Tensor, y: torch.Tensor) -> int:
    """Check every MQAR invariant on a batch; return the number of labelled positions."""
    half, V, N = cfg.vocab_size // 2, cfg.vocab_size, cfg.n_pairs
    n_labels = 0
    for xb, yb in zip(x.tolist(), y.tolist(), strict=True):
        keys, vals = xb[0 : 2 * N : 2], xb[1 : 2 * N : 2]
        assert all(1 <= k < half for k in keys) and len(set(keys)) == N
        assert all(half <= v < V for v in vals)
        kv = dict(zip(keys, vals, strict=True))
        labelled = [t for t, lab in enumerate(yb) if lab != IGNORE_INDEX]
        assert len(labelled) == cfg.num_queries
        assert len({xb[t] for t in labelled}) == cfg.num_queries  # distinct keys queried
        for t in labelled:
            assert t >= max(cfg.query_min_pos, 2 * N)
            assert yb[t] == kv[xb[t]]  # label = the value paired with this key in the context
            if cfg.echo_value:
                assert xb[t + 1] == yb[t]  # the value token follows the query key
            else:  # filler follows the query key: no value appears after the pairs
                assert xb[t + 1] not in vals and (cfg.random_filler or xb[t + 1] == 0)
        n_labels += len(labelled)
    return n_labels


def test_mqar_structure():
    """Keys lie in the lower half, values in the upper half, each query is labelled with its pair's value, -100 else."""
    cfg = MQARConfig(vocab_size=64, seq_len=32, n_pairs=4, query_min_pos=8)
    x, y = make_mqar_batch(cfg, 64, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (64, 32) and x.dtype == y.dtype == torch.long
    assert _check_mqar(cfg, x, y) == 64 * 4
    # filler (everything after the pairs but the query keys) is 0 by default
    filler = y == IGNORE_INDEX
    filler[:, : 2 * cfg.n_pairs] = False
    assert int(x[filler].abs().sum()) == 0
    # the echo layout: the queried value follows each query key, and nothing else changes
    echo = MQARConfig(vocab_size=64, seq_len=32, n_pairs=4, query_min_pos=8, echo_value=True)
    xe, ye = make_mqar_batch(echo, 64, torch.Generator().manual_seed(0))
    assert _check_mqar(echo, xe, ye) == 64 * 4 and torch.equal(ye, y)
    after = torch.roll(y != IGNORE_INDEX, 1, dims=1)
    assert torch.equal(xe[after], y[torch.roll(after, -1, dims=1)]) and torch.equal(xe[~after], x[~after])
    x2, y2 = make_mqar_batch(cfg, 64, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_mqar_variants_and_power_law():
    """Random filler, fewer queries and a later query_min_pos keep the invariants; small power_a favours near slots."""
    cfg = MQARConfig(vocab_size=128, seq_len=64, n_pairs=6, query_min_pos=20, n_queries=3, random_filler=True)
    x, y = make_mqar_batch(cfg, 32, torch.Generator().manual_seed(3))
    assert _check_mqar(cfg, x, y) == 32 * 3
    cfg = MQARConfig(vocab_size=64, seq_len=128, n_pairs=2, query_min_pos=4, power_a=0.01)
    _, y = make_mqar_batch(cfg, 2000, torch.Generator().manual_seed(0))
    pos = (y != IGNORE_INDEX).nonzero()[:, 1].float()
    slots = (pos - cfg.query_start) / 2
    assert float((slots < cfg.n_query_slots / 2).float().mean()) > 0.6  # uniform would be 0.5
    with pytest.raises(ValueError, match="too short"):
        MQARConfig(seq_len=12, n_pairs=4).validate()


def test_mqar_accuracy_oracle_and_controls():
    """Oracle logits score 1.0; uniform logits and logits pointing at the key score 0.0."""
    cfg = MQARConfig()
    x, y = make_mqar_batch(cfg, 16, torch.Generator().manual_seed(1))
    V = cfg.vocab_size
    oracle = torch.nn.functional.one_hot(y.clamp(min=0), V).float()
    assert mqar_accuracy(oracle, y) == 1.0
    wrong = torch.nn.functional.one_hot(x, V).float()  # predicts the current token (the key) instead of its value
    assert mqar_accuracy(wrong, y) == 0.0
    assert mqar_accuracy(torch.zeros(16, cfg.seq_len, V), y) == 0.0  # ties -> argmax 0, never a value
    rand = torch.randn(16, cfg.seq_len, V, generator=torch.Generator().manual_seed(0))
    assert mqar_accuracy(rand, y) < 0.2
    with pytest.raises(ValueError):
        mqar_accuracy(oracle, torch.full_like(y, IGNORE_INDEX))


def test_mqar_dataset_interface():
    """MQARDataset val batches are fixed regardless of the generator; train batches follow it; iter_eval repeats."""
    ds = MQARDataset(MQARConfig(), n_eval_batches=3)
    v1 = ds.batch("val", 8, 32, torch.Generator().manual_seed(0))
    v2 = ds.batch("val", 8, 32, torch.Generator().manual_seed(99))
    assert torch.equal(v1[0], v2[0]) and torch.equal(v1[1], v2[1])
    t1 = ds.batch("train", 8, 32, torch.Generator().manual_seed(0))
    t2 = ds.batch("train", 8, 32, torch.Generator().manual_seed(99))
    assert not torch.equal(t1[0], t2[0])
    e1 = list(ds.iter_eval("val", 8))
    e2 = list(ds.iter_eval("val", 8))
    assert len(e1) == 3 and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(e1, e2, strict=True)
    )
    x, y = ds.batch("train", 4, 48, torch.Generator().manual_seed(0))
    assert x.shape == (4, 48) and _check_mqar(MQARConfig(seq_len=48), x, y) == 16
