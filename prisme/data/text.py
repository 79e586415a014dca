"""Data: tokenizers, text corpora, token datasets with an on-disk cache, and the MQAR synthetic task.

Conventions used throughout:

* Every batch is a pair ``(x, y)`` of ``torch.long`` tensors of shape ``[B, T]`` where ``y[b, t]`` is the target for
  the token that follows ``x[b, t]``; positions with ``y == IGNORE_INDEX`` (-100) carry no loss.
* Randomness comes only from an explicit ``torch.Generator`` (or a fixed seed), so every batch is reproducible.
* The embedded corpus (Jane Austen's novels, public domain) ships with the package as ``corpora/austen.txt.xz``.
"""

from __future__ import annotations

import hashlib
import io
import lzma
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from prisme.data.tokenizers import Tokenizer
from prisme.io import PACKAGE_DIR, write_bytes_atomic

IGNORE_INDEX = -100
EMBEDDED_CORPUS = "austen"
EMBEDDED_CORPUS_PATH = PACKAGE_DIR / "corpora" / "austen.txt.xz"
HELD_OUT_TEXT = "devils_dictionary"  # Bierce, The Devil's Dictionary (public domain): another author and genre
EMBEDDED_TEXTS = {EMBEDDED_CORPUS: EMBEDDED_CORPUS_PATH,
                  HELD_OUT_TEXT: PACKAGE_DIR / "corpora" / "devils_dictionary.txt.xz"}
TEXT_SUFFIXES = (".txt", ".md")
_CACHE_FORMAT = "prisme-token-cache-v1"


# ----------------------------------------------------------------------------------------------------------------------
# Text loading
# ----------------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _load_embedded(name: str = EMBEDDED_CORPUS) -> str:
    path = EMBEDDED_TEXTS[name]
    with lzma.open(path, "rb") as f:
        return _decode_utf8(f.read(), path)


def _decode_utf8(data: bytes, path: Path) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8 ({e.reason} at byte {e.start}); re-encode it as UTF-8") from None
    return text.removeprefix("\ufeff")


def read_text_file(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".xz":
        data = lzma.decompress(data)
    return _decode_utf8(data, path)


def load_text(source: str | Path | None = None) -> str:
    """Load a corpus as one string.

    ``None`` or ``"austen"``: the embedded corpus; ``"devils_dictionary"``: the embedded held-out text (Bierce). A file:
    read as UTF-8 (``.xz`` files are decompressed). A folder:
    every ``*.txt`` / ``*.md`` file directly inside it (not recursive), sorted by name, joined with ``"\\n\\n"``.
    Raises ``ValueError`` for a missing path, an empty corpus, or a file that is not valid UTF-8.
    """
    if source is None or (isinstance(source, str) and source in EMBEDDED_TEXTS):
        return _load_embedded(source or EMBEDDED_CORPUS)
    path = Path(source)
    check_plain_text(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ValueError(
                f"folder {path} holds no {'/'.join('*' + s for s in TEXT_SUFFIXES)} files; add text files to it, "
                f"or pass a file, or None/{EMBEDDED_CORPUS!r} for the embedded corpus"
            )
        text = "\n\n".join(read_text_file(p) for p in files)
    elif path.is_file():
        text = read_text_file(path)
    else:
        raise ValueError(
            f"corpus path {path} does not exist; pass a UTF-8 text file, a folder of *.txt/*.md files, "
            f"or None/{EMBEDDED_CORPUS!r} for the embedded corpus"
        )
    if not text.strip():
        raise ValueError(f"corpus at {path} is empty (no non-whitespace text)")
    return text


def check_plain_text(path: Path) -> None:
    """ValueError, with the command that reads it, for documents that `prisme data prepare` reads but plain text
    loading would not read as documents: a `.jsonl` file (its JSON would become the text), a saved Hugging Face
    dataset, or a folder with `.jsonl` files or text in its subfolders (only the files directly inside are read)."""
    hf = ("dataset_info.json", "state.json", "dataset_dict.json")
    if path.is_file() and path.suffix == ".jsonl":
        found = [path]
    elif path.is_dir() and any((path / n).is_file() for n in hf):
        found = [path / next(n for n in hf if (path / n).is_file())]
    elif path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and (
            p.suffix == ".jsonl" or (p.suffix in TEXT_SUFFIXES and p.parent != path)))
    else:
        return
    if found:
        shown = ", ".join(str(p) for p in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ValueError(f"{path} holds documents that only `prisme data prepare` reads ({shown}: JSON lines, a saved "
                         f"dataset or text in subfolders); prepare them with `prisme data prepare {path} --out "
                         f"DIR` (--text-field names a JSON field) and pass that folder: --dataset DIR")


# ----------------------------------------------------------------------------------------------------------------------
# Token dataset with cache
# ----------------------------------------------------------------------------------------------------------------------


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    write_bytes_atomic(path, buf.getvalue())


def token_cache_path(cache_dir: str | Path, text: str, tokenizer: Tokenizer, name: str = "corpus") -> Path:
    """Cache file for ``text`` encoded by ``tokenizer``: keyed by sha256(text) and the tokenizer's identity."""
    text_sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    key = hashlib.sha256(f"{_CACHE_FORMAT}|{text_sha}|{tokenizer.identity}".encode()).hexdigest()
    return Path(cache_dir) / f"{name}-{key[:24]}.npy"


def _encode_cached(text: str, tokenizer: Tokenizer, cache_dir: str | Path | None, name: str) -> np.ndarray:
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    path = token_cache_path(cache_dir, text, tokenizer, name) if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            arr = np.load(path, allow_pickle=False)
            if arr.ndim == 1 and arr.dtype == dtype:
                return arr
        except (OSError, ValueError):
            pass  # unreadable or truncated cache: re-encode and overwrite below
    arr = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= tokenizer.vocab_size):
        raise ValueError(f"tokenizer produced ids outside [0, {tokenizer.vocab_size})")
    arr = arr.astype(dtype)
    if path is not None:
        _atomic_save_npy(path, arr)
    return arr


def check_split(split: str) -> str:
    if split in ("train",):
        return "train"
    if split in ("val", "valid", "validation"):
        return "val"
    raise ValueError(f"unknown split {split!r}; expected 'train' or 'val'")


class TokenDataset:
    """A token stream split contiguously: the first ``1 - val_fraction`` is train, the last ``val_fraction`` is val.

    ``tokens`` is the full stream ``[N]`` (int32); ``train_tokens`` / ``val_tokens`` are views into it.
    """

    def __init__(
        self,
        tokens: np.ndarray | torch.Tensor | Sequence[int],
        val_fraction: float = 0.1,
        vocab_size: int | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if isinstance(tokens, torch.Tensor):
            t = tokens.detach().to("cpu", torch.int32).reshape(-1)
        else:
            t = torch.from_numpy(np.asarray(tokens).astype(np.int32, copy=False).reshape(-1))
        if t.numel() == 0:
            raise ValueError("token stream is empty")
        self.tokens = t  # [N]
        n_val = int(t.numel() * val_fraction)
        self.split_index = t.numel() - n_val
        self.train_tokens = t[: self.split_index]  # [N_train]
        self.val_tokens = t[self.split_index :]  # [N_val]
        self.val_fraction = val_fraction
        self.tokenizer = tokenizer
        if vocab_size is None:
            vocab_size = tokenizer.vocab_size if tokenizer is not None else int(t.max()) + 1
        self.vocab_size = vocab_size

    @classmethod
    def held_out(cls, text: str, tokenizer: Tokenizer, seq_len: int, cache_dir: str | Path | None = None,
                 name: str = "held_out") -> TokenDataset:
        """A held-out text: every token in the "val" split (nothing to train on). ValueError if the text is empty or
        shorter than one sequence of `seq_len` (+ 1 target)."""
        if not text or not text.strip():
            raise ValueError(f"held-out text {name!r} is empty")
        arr = _encode_cached(text, tokenizer, cache_dir, name)
        if len(arr) < seq_len + 1:
            raise ValueError(f"held-out text {name!r} has {len(arr)} tokens, fewer than one sequence of {seq_len} "
                             f"(+ 1 target); use a longer text or a smaller --seq-len")
        ds = cls(arr, val_fraction=0.0, vocab_size=tokenizer.vocab_size, tokenizer=tokenizer)
        ds.split_index = 0
        ds.train_tokens, ds.val_tokens = ds.tokens[:0], ds.tokens
        ds.name = name
        return ds

    @classmethod
    def from_text(
        cls,
        text: str,
        tokenizer: Tokenizer,
        val_fraction: float = 0.1,
        cache_dir: str | Path | None = None,
        name: str = "corpus",
    ) -> TokenDataset:
        """Encode ``text`` (reusing ``cache_dir/<name>-<hash>.npy`` when present) and split it."""
        if not text:
            raise ValueError("cannot build a TokenDataset from empty text")
        arr = _encode_cached(text, tokenizer, cache_dir, name)
        return cls(arr, val_fraction=val_fraction, vocab_size=tokenizer.vocab_size, tokenizer=tokenizer)

    @classmethod
    def from_splits(cls, train_text: str, val_text: str, tokenizer: Tokenizer, cache_dir: str | Path | None = None,
                    name: str = "corpus") -> TokenDataset:
        """A corpus already split (by whole files, `data.corpora`): `train_text`'s tokens then `val_text`'s, the split
        exactly between them (each encoded on its own, cached as `<name>-train` / `<name>-val`)."""
        if not train_text or not val_text:
            raise ValueError(f"corpus {name!r}: its {'train' if not train_text else 'val'} split is empty")
        return cls.from_token_splits(_encode_cached(train_text, tokenizer, cache_dir, f"{name}-train"),
                                     _encode_cached(val_text, tokenizer, cache_dir, f"{name}-val"), tokenizer, name)

    @classmethod
    def from_token_splits(cls, train: np.ndarray, val: np.ndarray, tokenizer: Tokenizer,
                          name: str = "corpus") -> TokenDataset:
        """Train tokens `[N_train]` then validation tokens `[N_val]` as one stream split exactly between them."""
        ds = cls(np.concatenate([train, val]), val_fraction=0.0, vocab_size=tokenizer.vocab_size, tokenizer=tokenizer)
        ds.split_index = len(train)
        ds.train_tokens, ds.val_tokens = ds.tokens[:len(train)], ds.tokens[len(train):]
        ds.val_fraction = len(val) / ds.tokens.numel()
        ds.name = name
        return ds

    def split_tokens(self, split: str) -> torch.Tensor:
        """The 1-D int32 token stream of ``split`` (``"train"`` or ``"val"``)."""
        return self.train_tokens if check_split(split) == "train" else self.val_tokens

    def n_tokens(self, split: str) -> int:
        """Number of tokens in ``split``."""
        return int(self.split_tokens(split).numel())

    def _checked(self, split: str, seq_len: int) -> torch.Tensor:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        toks = self.split_tokens(split)
        if toks.numel() < seq_len + 1:
            raise ValueError(
                f"corpus too small for seq_len={seq_len}: the {check_split(split)} split has {toks.numel()} tokens "
                f"but needs at least {seq_len + 1}; use a larger corpus, a smaller seq_len, or another val_fraction"
            )
        return toks

    def batch(
        self, split: str, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: ``x`` ``[B, T]`` long and ``y = x`` shifted left by one ``[B, T]``; uses ``generator``."""
        toks = self._checked(split, seq_len)
        starts = torch.randint(0, toks.numel() - seq_len, (batch_size,), generator=generator)  # [B]
        idx = starts[:, None] + torch.arange(seq_len + 1)  # [B, T+1]
        w = toks[idx].long()  # [B, T+1]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def n_eval_windows(self, split: str, seq_len: int) -> int:
        """Number of non-overlapping windows ``iter_eval`` covers (all of them when ``max_batches`` is None)."""
        return (self._checked(split, seq_len).numel() - 1) // seq_len

    def iter_eval(
        self, split: str, batch_size: int, seq_len: int, max_batches: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic non-overlapping windows in order: window ``i`` has ``x = tokens[i*T : (i+1)*T]`` and
        ``y = tokens[i*T+1 : (i+1)*T+1]``. Yields ``(x, y)`` ``[B, T]``; the last batch may be smaller."""
        toks = self._checked(split, seq_len)
        n_windows = (toks.numel() - 1) // seq_len
        offs = torch.arange(seq_len + 1)
        for bi, lo in enumerate(range(0, n_windows, batch_size)):
            if max_batches is not None and bi >= max_batches:
                return
            starts = torch.arange(lo, min(lo + batch_size, n_windows)) * seq_len  # [B]
            w = toks[starts[:, None] + offs].long()  # [B, T+1]
            yield w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def __repr__(self) -> str:
        return f"TokenDataset(train={self.n_tokens('train')}, val={self.n_tokens('val')}, vocab_size={self.vocab_size})"
