"""Tokenizers: UTF-8 bytes (`ByteTokenizer`, lossless on any text) and a byte-level BPE (`BPETokenizer`, needs the
optional `tokenizers` package), behind the `Tokenizer` protocol the rest of the code uses."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from prisme.io import write_bytes_atomic

if TYPE_CHECKING:  # pragma: no cover
    from tokenizers import Tokenizer as HFTokenizer

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
        reachable = 256 + len(text.encode("utf-8")) // 2  # each merge joins a pair seen at least twice
        if vocab_size > reachable:  # checked before the trainer allocates for vocab_size ids
            raise ValueError(f"vocab_size={vocab_size}: the text ({len(text):,} characters) yields at most "
                             f"{reachable:,} tokens (the 256 bytes, then merges of pairs seen at least twice); ask "
                             f"for fewer or train on more text")
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
        got = tok.get_vocab_size()
        if got < vocab_size:
            fix = f"ask for vocab_size <= {got} or train on more text" if got > 256 else "train on more text"
            raise ValueError(f"vocab_size={vocab_size}: the text ({len(text):,} characters) yields only {got} "
                             f"tokens (merges of pairs seen at least twice); {fix}")
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """Load a tokenizer written by ``save``."""
        _need_tokenizers()
        from tokenizers import Tokenizer

        path = Path(path)
        if path.is_dir():
            if not (path / "tokenizer.json").is_file():
                raise ValueError(f"tokenizer path {path} is a folder with no tokenizer.json in it; pass the tokenizer "
                                 f"file written by `prisme tokenizer train`")
            path = path / "tokenizer.json"
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


def tokenizer_named(name: str | Path) -> ByteTokenizer | BPETokenizer:
    """What a `--tokenizer` option names: "byte", or a saved BPE (its file, or a folder holding tokenizer.json)."""
    return ByteTokenizer() if str(name) == "byte" else BPETokenizer.load(name)


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


def tokenizer_identity(tok: Tokenizer | None) -> str:
    """A tokenizer's identity (what two tokenizers must share to mean the same strings by the same ids); "none" for
    token-id data (MQAR)."""
    return "none" if tok is None else tok.identity


def describe_tokenizer(tok: Tokenizer | None) -> str:
    """A tokenizer for an error message: the byte tokenizer, a BPE with its size and the start of its identity (two
    BPEs of one size differ there), or no text tokenizer."""
    if tok is None:
        return "no text tokenizer (token ids)"
    if isinstance(tok, BPETokenizer):
        return f"BPETokenizer of {tok.vocab_size} ids, identity {tok.identity[:16]}"
    return f"ByteTokenizer ({tok.identity})"


# ----------------------------------------------------------------------------------------------------------------------
# The tokenizer a checkpoint records
# ----------------------------------------------------------------------------------------------------------------------
TOKENIZER_FILE = "tokenizer.json"  # a BPE's HF JSON inside a checkpoint folder


def tokenizer_record(tok: ByteTokenizer | BPETokenizer | None) -> tuple[dict[str, str], bytes | None]:
    """What a checkpoint's state.json says of its tokenizer, and the file to write beside it (a BPE's JSON):
    {"kind": "byte"}, {"kind": "bpe", "file": "tokenizer.json", "identity": ...} or {"kind": "none"} (token ids,
    e.g. MQAR)."""
    if tok is None:
        return {"kind": "none"}, None
    if isinstance(tok, ByteTokenizer):
        return {"kind": "byte"}, None
    if isinstance(tok, BPETokenizer):
        return {"kind": "bpe", "file": TOKENIZER_FILE, "identity": tok.identity}, tok._tok.to_str().encode("utf-8")
    raise ValueError(f"a checkpoint can record a ByteTokenizer, a BPETokenizer or None, got {type(tok).__name__}")


def tokenizer_from_record(record: dict[str, str], folder: Path) -> ByteTokenizer | BPETokenizer | None:
    """The tokenizer `tokenizer_record` described, read from checkpoint `folder`; ValueError naming the file when the
    BPE's file is missing or is not the one recorded."""
    kind = record.get("kind")
    if kind == "none":
        return None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        path = Path(folder) / record.get("file", TOKENIZER_FILE)
        if not path.is_file():
            raise ValueError(f"{path} is missing: the checkpoint was trained with a BPE tokenizer saved there; "
                             f"restore the file")
        tok = BPETokenizer.load(path)
        if record.get("identity") and tok.identity != record["identity"]:
            raise ValueError(f"{path} is not the tokenizer this checkpoint was trained with (its identity differs "
                             f"from the one recorded in state.json); restore the file")
        return tok
    raise ValueError(f"unknown tokenizer record {record!r} in {folder}; the checkpoint is corrupt")
