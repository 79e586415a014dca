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
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from .checkpoint import write_bytes_atomic

if TYPE_CHECKING:  # pragma: no cover
    from tokenizers import Tokenizer as HFTokenizer

IGNORE_INDEX = -100
EMBEDDED_CORPUS = "austen"
EMBEDDED_CORPUS_PATH = Path(__file__).parent / "corpora" / "austen.txt.xz"
HELD_OUT_TEXT = "devils_dictionary"  # Bierce, The Devil's Dictionary (public domain): another author and genre
EMBEDDED_TEXTS = {EMBEDDED_CORPUS: EMBEDDED_CORPUS_PATH,
                  HELD_OUT_TEXT: Path(__file__).parent / "corpora" / "devils_dictionary.txt.xz"}
TEXT_SUFFIXES = (".txt", ".md")
_CACHE_FORMAT = "prisme-token-cache-v1"


# ----------------------------------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------------------------------


class Tokenizer(Protocol):
    """What the rest of the code needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def identity(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab_size 256, lossless on any text."""

    vocab_size: int = 256
    identity: str = "byte-utf8-v1"

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Inverse of ``encode``; invalid byte sequences become U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _split_for_encoding(text: str, chunk_chars: int) -> list[str]:
    """Split ``text`` into chunks of about ``chunk_chars`` chars, cutting only just before a newline that follows a
    non-whitespace character.

    Every whitespace run then stays whole inside one chunk and no other pre-token of the byte-level (GPT-2 style)
    regex can span the cut, so encoding the chunks separately and concatenating gives exactly the tokens of encoding
    the whole text. (Cutting *after* a newline would not: ``\\s+(?!\\S)`` matches a trailing run differently at the
    end of a string.)
    """
    chunks: list[str] = []
    start = 0
    n = len(text)
    while n - start > chunk_chars:
        cut = start + chunk_chars
        while cut < n and not (text[cut] == "\n" and not text[cut - 1].isspace()):
            cut += 1
        if cut >= n:
            break
        chunks.append(text[start:cut])
        start = cut
    chunks.append(text[start:])
    return chunks


def _need_tokenizers() -> None:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ValueError("BPE tokenizers need the HF `tokenizers` package: pip install 'prisme[bpe]'") from None


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) backed by HF ``tokenizers``; lossless round-trip, no special tokens."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer

    @classmethod
    def train(cls, text: str, vocab_size: int, chunk_chars: int = 1 << 16) -> BPETokenizer:
        """Train on ``text`` up to ``vocab_size`` tokens (>= 257: the 256 byte symbols come first)."""
        _need_tokenizers()
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size <= 256:
            raise ValueError(f"BPE vocab_size must be > 256 (the byte alphabet), got {vocab_size}")
        if not text:
            raise ValueError("cannot train a BPE tokenizer on empty text")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[],
        )
        tok.train_from_iterator(_split_for_encoding(text, chunk_chars), trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """Load a tokenizer written by ``save``."""
        _need_tokenizers()
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"BPE tokenizer file {path} does not exist; train one with `prisme tokenizer train` "
                             f"(or BPETokenizer.train) and save it")
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception types
            raise ValueError(f"{path} is not a tokenizer file written by `prisme tokenizer train` / HF tokenizers "
                             f"({type(e).__name__}: {str(e)[:120]})") from None

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as HF JSON (atomically)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, self._tok.to_str().encode("utf-8"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def identity(self) -> str:
        return "bpe-" + hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()

    def encode(self, text: str, chunk_chars: int = 1 << 16) -> list[int]:
        """Token ids of ``text``; long texts are encoded in parallel chunks (same result as one call)."""
        chunks = _split_for_encoding(text, chunk_chars)
        if len(chunks) == 1:
            return self._tok.encode(text).ids
        ids: list[int] = []
        for enc in self._tok.encode_batch(chunks):
            ids.extend(enc.ids)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Inverse of ``encode``."""
        return self._tok.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


def get_tokenizer(
    kind: str = "byte", *, text: str | None = None, vocab_size: int = 4096, path: str | Path | None = None
) -> ByteTokenizer | BPETokenizer:
    """Make a tokenizer. ``kind="byte"``: ByteTokenizer. ``kind="bpe"``: load ``path`` if it exists, otherwise
    train on ``text`` with ``vocab_size`` (and save to ``path`` if given)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        if path is not None and Path(path).is_file():
            return BPETokenizer.load(path)
        if text is None:
            raise ValueError("get_tokenizer('bpe') needs `text` to train on (or `path` to an existing tokenizer)")
        tok = BPETokenizer.train(text, vocab_size)
        if path is not None:
            tok.save(path)
        return tok
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'byte' or 'bpe'")


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


def _read_text_file(path: Path) -> str:
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
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ValueError(
                f"folder {path} holds no {'/'.join('*' + s for s in TEXT_SUFFIXES)} files; add text files to it, "
                f"or pass a file, or None/{EMBEDDED_CORPUS!r} for the embedded corpus"
            )
        text = "\n\n".join(_read_text_file(p) for p in files)
    elif path.is_file():
        text = _read_text_file(path)
    else:
        raise ValueError(
            f"corpus path {path} does not exist; pass a UTF-8 text file, a folder of *.txt/*.md files, "
            f"or None/{EMBEDDED_CORPUS!r} for the embedded corpus"
        )
    if not text.strip():
        raise ValueError(f"corpus at {path} is empty (no non-whitespace text)")
    return text


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


def _check_split(split: str) -> str:
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

    def split_tokens(self, split: str) -> torch.Tensor:
        """The 1-D int32 token stream of ``split`` (``"train"`` or ``"val"``)."""
        return self.train_tokens if _check_split(split) == "train" else self.val_tokens

    def n_tokens(self, split: str) -> int:
        """Number of tokens in ``split``."""
        return int(self.split_tokens(split).numel())

    def _checked(self, split: str, seq_len: int) -> torch.Tensor:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        toks = self.split_tokens(split)
        if toks.numel() < seq_len + 1:
            raise ValueError(
                f"corpus too small for seq_len={seq_len}: the {_check_split(split)} split has {toks.numel()} tokens "
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


# ----------------------------------------------------------------------------------------------------------------------
# MQAR: multi-query associative recall (Zoology, Arora et al. 2023)
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MQARConfig:
    """Multi-query associative recall.

    Layout of one sequence of length ``seq_len`` (token 0 is the pad/filler):

    * positions ``0 .. 2*n_pairs-1``: ``n_pairs`` pairs ``k_1 v_1 k_2 v_2 ...``; keys are distinct and drawn from
      ``[1, V/2)``, values from ``[V/2, V)`` (``V/2`` = ``vocab_size // 2``);
    * after that, from position ``q0 = max(2*n_pairs, query_min_pos)``: ``n_queries`` (default ``n_pairs``) queries
      of distinct context keys, each occupying two positions ``p, p+1``: the key at ``p``, and at ``p+1`` filler (the
      default, as in Zoology) or, with ``echo_value=True``, the value itself; ``p = q0 + 2*s`` for a slot ``s`` in
      ``[0, (seq_len - q0) // 2)``. Slots are sampled without replacement with probability ``∝ (s+1)^(power_a - 1)``
      exactly as Zoology does (small ``power_a`` → most queries close to the context, a long tail far away);
    * everything else is filler: 0 by default, or (``random_filler=True``) uniform random keys from ``[1, V/2)``.

    Labels: ``y[p] = value`` at each query key position ``p``, ``IGNORE_INDEX`` everywhere else (the pair section too).

    Why filler after the query: with the echo, every answered value is visible to later queries, and a model with no
    recall at all scores about half the queries by guessing among the values not yet answered (chance 1/N, 1/(N-1),
    ..., 1 by query order). Without it a model that cannot look a key up sits at ~1/N.
    """

    vocab_size: int = 64
    seq_len: int = 32
    n_pairs: int = 4
    query_min_pos: int = 8
    power_a: float = 0.01
    n_queries: int | None = None
    random_filler: bool = False
    echo_value: bool = False  # True: x[p+1] is the queried value (a key -> value stream; leaks answers, see above)

    @property
    def key_range(self) -> tuple[int, int]:
        """Half-open range of key ids."""
        return 1, self.vocab_size // 2

    @property
    def value_range(self) -> tuple[int, int]:
        """Half-open range of value ids."""
        return self.vocab_size // 2, self.vocab_size

    @property
    def query_start(self) -> int:
        return max(2 * self.n_pairs, self.query_min_pos)

    @property
    def n_query_slots(self) -> int:
        return max(0, (self.seq_len - self.query_start) // 2)

    @property
    def num_queries(self) -> int:
        return self.n_pairs if self.n_queries is None else self.n_queries

    def validate(self) -> None:
        """Raise ``ValueError`` if the layout does not fit."""
        k_lo, k_hi = self.key_range
        v_lo, v_hi = self.value_range
        from .checks import check_fields

        check_fields(self, "MQARConfig.")
        if self.n_pairs < 1:
            raise ValueError(f"n_pairs must be >= 1, got {self.n_pairs}")
        if k_hi - k_lo < self.n_pairs or v_hi - v_lo < self.n_pairs:
            raise ValueError(
                f"vocab_size={self.vocab_size} too small for {self.n_pairs} distinct keys in [1, {k_hi}) "
                f"and values in [{v_lo}, {v_hi})"
            )
        if not 1 <= self.num_queries <= self.n_pairs:
            raise ValueError(f"n_queries must be in [1, n_pairs={self.n_pairs}], got {self.num_queries}")
        if self.n_query_slots < self.num_queries:
            raise ValueError(
                f"seq_len={self.seq_len} too short: {self.num_queries} queries need {2 * self.num_queries} positions "
                f"after position {self.query_start}"
            )
        if self.power_a <= 0:
            raise ValueError(f"power_a must be > 0, got {self.power_a}")


def _sample_distinct(lo: int, hi: int, k: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """``[B, k]`` distinct ints from ``[lo, hi)`` per row, uniformly."""
    return torch.rand(batch_size, hi - lo, generator=generator).argsort(dim=1)[:, :k] + lo


def make_mqar_batch(cfg: MQARConfig, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One MQAR batch (layout in ``MQARConfig``): ``x`` ``[B, T]`` long, ``y`` ``[B, T]`` long with -100 = ignore."""
    cfg.validate()
    B, T, N, Q = batch_size, cfg.seq_len, cfg.n_pairs, cfg.num_queries
    keys = _sample_distinct(*cfg.key_range, N, B, generator)  # [B, N]
    values = _sample_distinct(*cfg.value_range, N, B, generator)  # [B, N]

    if cfg.random_filler:
        x = torch.randint(cfg.key_range[0], cfg.key_range[1], (B, T), generator=generator)  # [B, T]
    else:
        x = torch.zeros(B, T, dtype=torch.long)  # [B, T]
    y = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)  # [B, T]
    x[:, 0 : 2 * N : 2] = keys
    x[:, 1 : 2 * N : 2] = values

    S = cfg.n_query_slots
    slot_w = torch.arange(1, S + 1, dtype=torch.float64) ** (cfg.power_a - 1.0)  # [S]
    slots = torch.multinomial(slot_w.expand(B, S), Q, replacement=False, generator=generator)  # [B, Q]
    pos = cfg.query_start + 2 * slots  # [B, Q]
    which = _sample_distinct(0, N, Q, B, generator)  # [B, Q] index of the queried pair
    q_keys = keys.gather(1, which)  # [B, Q]
    q_vals = values.gather(1, which)  # [B, Q]
    x.scatter_(1, pos, q_keys)
    if cfg.echo_value:
        x.scatter_(1, pos + 1, q_vals)
    y.scatter_(1, pos, q_vals)
    return x, y


def mqar_accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of labelled positions (``y != -100``) where ``argmax(logits)`` equals ``y``.

    ``logits`` ``[B, T, V]``, ``y`` ``[B, T]``.
    """
    mask = y != IGNORE_INDEX  # [B, T]
    n = int(mask.sum())
    if n == 0:
        raise ValueError("mqar_accuracy: no labelled positions (all labels are -100)")
    pred = logits.argmax(dim=-1)  # [B, T]
    return float((pred[mask] == y[mask]).sum()) / n


class MQARDataset:
    """MQAR with the ``TokenDataset`` batch interface.

    ``batch("train", ...)`` draws from the caller's generator; ``batch("val", ...)`` ignores it and always uses a
    generator seeded with ``val_seed`` (so validation batches are fixed). ``iter_eval`` yields ``n_eval_batches``
    (or ``max_batches``) batches from a fixed seed per split. A ``seq_len`` different from ``cfg.seq_len`` is applied
    to the config for that call.
    """

    def __init__(
        self,
        cfg: MQARConfig | None = None,
        val_seed: int = 12345,
        train_eval_seed: int = 54321,
        n_eval_batches: int = 8,
    ) -> None:
        self.cfg = cfg if cfg is not None else MQARConfig()
        self.cfg.validate()
        self.val_seed = val_seed
        self.train_eval_seed = train_eval_seed
        self.n_eval_batches = n_eval_batches

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def _cfg_for(self, seq_len: int | None) -> MQARConfig:
        if seq_len is None or seq_len == self.cfg.seq_len:
            return self.cfg
        return replace(self.cfg, seq_len=seq_len)

    def batch(
        self, split: str, batch_size: int, seq_len: int | None, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` ``[B, T]``; fixed for ``split="val"``, drawn from ``generator`` for ``"train"``."""
        if _check_split(split) == "val":
            generator = torch.Generator().manual_seed(self.val_seed)
        elif generator is None:
            raise ValueError("MQARDataset.batch('train', ...) needs a torch.Generator")
        return make_mqar_batch(self._cfg_for(seq_len), batch_size, generator)

    def iter_eval(
        self, split: str, batch_size: int, seq_len: int | None = None, max_batches: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic evaluation batches ``(x, y)`` ``[B, T]`` from a fixed per-split seed."""
        seed = self.val_seed if _check_split(split) == "val" else self.train_eval_seed
        g = torch.Generator().manual_seed(seed)
        cfg = self._cfg_for(seq_len)
        n = self.n_eval_batches if max_batches is None else max_batches
        for _ in range(n):
            yield make_mqar_batch(cfg, batch_size, g)

    def __repr__(self) -> str:
        return f"MQARDataset({self.cfg})"
