"""Named corpora: the texts a study trains and scores on, chosen by name, file or folder, each with its licence.

The embedded corpora ship with the package in `corpora/` (`corpora/README.md` says where each comes from):

=================  ============================================================  ================  ==============
name               what                                                          licence           split
=================  ============================================================  ================  ==============
``austen``         Jane Austen's six novels (the default corpus)                 public domain     contiguous
``bierce``         Ambrose Bierce, *The Devil's Dictionary* (the held-out text)  public domain     contiguous
``python-stdlib``  255 pure-Python files of the CPython 3.11.7 standard library  PSF-2.0           by whole files
``click``          the source of click 8.5.1 (held-out code: not in the stdlib)  BSD-3-Clause      by whole files
``pyparsing``      the source of pyparsing 3.1.4 (a second held-out project)     MIT               by whole files
=================  ============================================================  ================  ==============

``devils_dictionary`` (the text loader's name for ``bierce``) is an alias. A source that is not a name is a path: a
folder written by ``prisme data prepare`` (its tokens and its own split), any other folder (every file under it,
recursively, split by whole files), or a file (one document, split contiguously like Austen).

Split rules. *Contiguous*: the last ``val_fraction`` of the tokens is validation (`TokenDataset.from_text`; Austen's
split, unchanged). *By whole files*: a seeded shuffle of the files (sorted by name, `random.Random(seed)`) moves files
to validation, in shuffled order, until they hold ``val_fraction`` of the bytes (at least one file, and at least one
left to train on); each side keeps name order. A file's document is its text after a one-line header naming it,
``# ==> path <==`` (`pack_documents`): the embedded code corpora are stored that way, and a folder is read that way,
so the model sees where one file ends and the next begins.
"""

from __future__ import annotations

import hashlib
import lzma
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from prisme.data.shards import ShardDataset, is_prepared
from prisme.data.text import EMBEDDED_TEXTS, TokenDataset, check_plain_text, load_text, read_text_file
from prisme.data.tokenizers import ByteTokenizer, Tokenizer
from prisme.io import PACKAGE_DIR

CORPORA_DIR = PACKAGE_DIR / "corpora"
HEADER = re.compile(r"^# ==> (.+) <==\n", re.M)  # a file's first line in a packed corpus
SPLIT_SEED = 0
Document = tuple[str, str]  # (the file's path inside its corpus, its text with the header line)


@dataclass(frozen=True)
class Corpus:
    """A text to train or score on: an embedded corpus (`CORPORA`) or a path (`resolve_corpus`).

    name: the registry name, or the path as given; kind: "embedded", "file", "folder" or "prepared"; path: the
    compressed file, or the user's file or folder; licence: an SPDX id, "public domain", or "unknown" for a user's
    own text; licence_file: its text beside the corpus (embedded only); by_files: split by whole files (else
    contiguously); about: one line on what it is."""

    name: str
    kind: str
    path: Path
    licence: str = "unknown"
    licence_file: str | None = None
    by_files: bool = False
    about: str = ""

    def documents(self) -> list[Document]:
        """Its files as (path, text) in name order: one document for a single text (Austen, a file)."""
        if self.kind == "prepared":
            raise ValueError(f"corpus {self.name!r} is a prepared folder: it holds tokens, not text (use dataset())")
        if self.kind == "folder":
            return _folder_documents(self.path)
        if self.by_files:
            return list(_packed_documents(self.path))
        return [(self.path.name, self.text())]

    def text(self) -> str:
        """The whole text: what `load_text` returns for Austen, Bierce and a file; the packed files, in name order,
        for a folder and the embedded code corpora."""
        if self.kind == "embedded" and not self.by_files:
            return load_text(next(k for k, v in EMBEDDED_TEXTS.items() if v == self.path))
        if self.kind == "file":
            return _nonempty(read_text_file(self.path), self.path)
        return "".join(text for _, text in self.documents())

    def split(self, val_fraction: float = 0.1, seed: int = SPLIT_SEED) -> tuple[list[Document], list[Document]]:
        """(train, validation) documents by whole files (`split_documents`); ValueError for a contiguous corpus."""
        if not self.by_files:
            raise ValueError(f"corpus {self.name!r} is one text, split contiguously (dataset()), not by files")
        return split_documents(self.documents(), val_fraction, seed)

    def dataset(self, tokenizer: Tokenizer | None = None, val_fraction: float = 0.1,
                cache_dir: str | Path | None = None) -> TokenDataset:
        """Its train / validation token stream (the module's split rules; a prepared folder keeps its own split and
        must have been prepared with `tokenizer`). Default tokenizer: bytes."""
        tok = tokenizer or ByteTokenizer()
        if self.kind == "prepared":
            return _check_tokenizer(ShardDataset(self.path), tok, self.name)
        if not self.by_files:
            return TokenDataset.from_text(self.text(), tok, val_fraction=val_fraction, cache_dir=cache_dir,
                                          name=self.slug)
        train, val = self.split(val_fraction)
        return TokenDataset.from_splits("".join(t for _, t in train), "".join(t for _, t in val), tok,
                                        cache_dir=cache_dir, name=self.slug)

    def held_out(self, seq_len: int, tokenizer: Tokenizer | None = None,
                 cache_dir: str | Path | None = None) -> TokenDataset:
        """All of it to score on (nothing to train on): `TokenDataset.held_out`; a prepared folder's two splits."""
        tok = tokenizer or ByteTokenizer()
        if self.kind != "prepared":
            return TokenDataset.held_out(self.text(), tok, seq_len, cache_dir=cache_dir, name=self.slug)
        ds = _check_tokenizer(ShardDataset(self.path), tok, self.name)
        arr = np.concatenate([ds.split_tokens("train").arr, ds.split_tokens("val").arr])
        if len(arr) < seq_len + 1:
            raise ValueError(f"held-out corpus {self.name!r} has {len(arr)} tokens, fewer than one sequence of "
                             f"{seq_len} (+ 1 target)")
        return TokenDataset.from_token_splits(arr[:0], arr, tok, name=self.slug)

    @property
    def slug(self) -> str:
        """A file-name-safe name (token caches, records)."""
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name if self.kind == "embedded" else self.path.name) or "corpus"

    def record(self) -> dict[str, Any]:
        """What a study records of its corpus: name, kind, licence, split rule, and (text corpora) bytes and the
        sha256 of the text."""
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "licence": self.licence,
                               "split": "prepared" if self.kind == "prepared" else
                               "by whole files" if self.by_files else "contiguous"}
        if self.kind != "embedded":
            out["path"] = str(self.path)
        if self.kind != "prepared":
            data = self.text().encode("utf-8")
            out |= {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        return out


CORPORA: dict[str, Corpus] = {c.name: c for c in (
    Corpus("austen", "embedded", EMBEDDED_TEXTS["austen"], "public domain",
           about="Jane Austen's six novels (Project Gutenberg)"),
    Corpus("bierce", "embedded", EMBEDDED_TEXTS["devils_dictionary"], "public domain",
           about="Ambrose Bierce, The Devil's Dictionary (Project Gutenberg): another author and genre"),
    Corpus("python-stdlib", "embedded", CORPORA_DIR / "python_stdlib.txt.xz", "PSF-2.0",
           "LICENSE-python-stdlib.txt", by_files=True,
           about="255 pure-Python files of the CPython 3.11.7 standard library (no tests, no generated tables)"),
    Corpus("click", "embedded", CORPORA_DIR / "click.txt.xz", "BSD-3-Clause", "LICENSE-click.txt", by_files=True,
           about="the source of click 8.5.1 (Pallets): held-out code the standard library does not contain"),
    Corpus("pyparsing", "embedded", CORPORA_DIR / "pyparsing.txt.xz", "MIT", "LICENSE-pyparsing.txt", by_files=True,
           about="the source of pyparsing 3.1.4: a second held-out project (parsing, not command lines)"),
)}
ALIASES = {"devils_dictionary": "bierce"}


def corpus_names() -> list[str]:
    """The embedded corpora's names (`CORPORA`) and their aliases."""
    return [*CORPORA, *ALIASES]


def resolve_corpus(source: str | Path | None = None) -> Corpus:
    """A corpus by name (`corpus_names`; None: Austen) or path: a prepared folder, a folder, or a file.

    ValueError naming the problem and listing the known names: a name that is neither a corpus nor an existing
    path; a folder of documents only `prisme data prepare` reads (`.jsonl`, a saved dataset)."""
    if source is None:
        return CORPORA["austen"]
    if isinstance(source, str) and source in CORPORA:
        return CORPORA[source]
    if isinstance(source, str) and source in ALIASES:
        return CORPORA[ALIASES[source]]
    if not isinstance(source, (str, Path)) or not str(source):
        raise ValueError(f"a corpus is a name ({', '.join(corpus_names())}) or a path, got {source!r}")
    path = Path(source)
    if is_prepared(path):
        return Corpus(str(source), "prepared", path)
    if path.is_dir():
        _check_folder(path)
        return Corpus(str(source), "folder", path, by_files=True, about=f"the files under {path}")
    if path.is_file():
        check_plain_text(path)
        return Corpus(str(source), "file", path, about=f"the text of {path}")
    raise ValueError(f"unknown corpus {str(source)!r}: not a known name ({', '.join(corpus_names())}) and no such "
                     f"file or folder; pass a name, a UTF-8 text file, a folder of text files, or a folder written by "
                     f"`prisme data prepare`")


# ------------------------------------------------------------------------------------------------------- documents
def pack_documents(documents: list[Document] | list[tuple[str, str]], headed: bool = False) -> str:
    """Files as one text: each one's header line `# ==> path <==` then its text, ending in a newline (`headed`: the
    texts already start with their header). ValueError for a path with a newline or a text holding a header line."""
    out = []
    for name, text in documents:
        body = HEADER.sub("", text, count=1) if headed else text
        if "\n" in name or HEADER.search(body) or not name:
            raise ValueError(f"file {name!r} cannot be packed: an empty name or one with a newline, or a line of its "
                             f"own looks like a file header (`# ==> path <==`)")
        out.append(f"# ==> {name} <==\n{body}" + ("" if body.endswith("\n") else "\n"))
    return "".join(out)


def unpack_documents(text: str) -> list[Document]:
    """The inverse of `pack_documents`: (path, text with its header line); ValueError unless the text starts with a
    header."""
    heads = list(HEADER.finditer(text))
    if not heads or heads[0].start() != 0:
        raise ValueError("a packed corpus starts with a file header line `# ==> path <==`")
    ends = [m.start() for m in heads[1:]] + [len(text)]
    return [(m.group(1), text[m.start():end]) for m, end in zip(heads, ends)]


def split_documents(documents: list[Document], val_fraction: float = 0.1,
                    seed: int = SPLIT_SEED) -> tuple[list[Document], list[Document]]:
    """(train, validation) by whole files: a `random.Random(seed)` shuffle of the files in name order moves them to
    validation until they hold `val_fraction` of the bytes (at least one, leaving at least one); both in name order.
    ValueError for fewer than two files or a fraction outside (0, 1)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1) to split by files, got {val_fraction}")
    docs = sorted(documents)
    if len(docs) < 2:
        raise ValueError(f"{len(docs)} file(s): a split by whole files needs two or more (pass a single file itself "
                         f"to split its text contiguously)")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    sizes = [len(t.encode("utf-8")) for _, t in docs]
    goal, got, val = val_fraction * sum(sizes), 0, set()
    for i in order[:-1]:
        if val and got >= goal:
            break
        val.add(i)
        got += sizes[i]
    return [d for i, d in enumerate(docs) if i not in val], [d for i, d in enumerate(docs) if i in val]


@lru_cache(maxsize=4)
def _packed_documents(path: Path) -> tuple[Document, ...]:
    with lzma.open(path, "rb") as f:
        data = f.read()
    return tuple(unpack_documents(data.decode("utf-8")))


def _folder_files(path: Path) -> list[Path]:
    """Every file under `path`, recursively, in name order, skipping hidden files and folders and `__pycache__`."""
    return sorted(p for p in path.rglob("*") if p.is_file() and not any(
        part.startswith(".") or part == "__pycache__" for part in p.relative_to(path).parts))


def _check_folder(path: Path) -> None:
    """ValueError for a folder that `prisme data prepare` reads and plain loading would not: JSON lines or a saved
    Hugging Face dataset (`check_plain_text`'s message), or one with no file at all."""
    files = _folder_files(path)
    if any(p.suffix == ".jsonl" for p in files) or any((path / n).is_file() for n in
                                                      ("dataset_info.json", "state.json", "dataset_dict.json")):
        check_plain_text(path)
    if not files:
        raise ValueError(f"folder {path} holds no file (hidden files and __pycache__ are skipped)")


def _folder_documents(path: Path) -> list[Document]:
    """A folder's files as documents (`pack_documents`' headers, paths relative to the folder); ValueError naming
    the first file that is not UTF-8 text (or holds a NUL byte), and for a folder whose files are all empty."""
    docs = []
    for p in _folder_files(path):
        name = p.relative_to(path).as_posix()
        text = read_text_file(p)  # ValueError naming the file when it is not UTF-8
        if "\x00" in text:
            raise ValueError(f"{p} holds a NUL byte: not a text file; remove it from {path} or prepare the folder "
                             f"with `prisme data prepare`")
        if text.strip():
            docs.append((name, pack_documents([(name, text)])))
    if not docs:
        raise ValueError(f"folder {path} holds no text (every file is empty)")
    return docs


def _nonempty(text: str, path: Path) -> str:
    if not text.strip():
        raise ValueError(f"corpus at {path} is empty (no non-whitespace text)")
    return text


def _check_tokenizer(ds: ShardDataset, tok: Tokenizer, name: str) -> ShardDataset:
    if ds.tokenizer.identity != tok.identity:
        raise ValueError(f"prepared corpus {name!r} was tokenized by {ds.tokenizer.identity}, not by "
                         f"{tok.identity}; prepare it again with the study's tokenizer")
    return ds


# ------------------------------------------------------------------------------------------------------- statistics
def ar_hit_fraction(tokens: np.ndarray | list[int], window: int = 1024, n: int = 4) -> float:
    """The share of predicted tokens, in non-overlapping windows of `window` (as `TokenDataset.iter_eval` scores
    them), that continue an n-gram seen earlier in the window the way it continued there: the AR hits of
    `evaluation.slices` (position t, target y_t: the n tokens ending at t occurred ending at some j < t, and the
    token after j is y_t). Equivalently, the n + 1 tokens from t - n + 1 to the target occurred earlier in the window.
    Every window of `window` targets counts whole (its first n - 1 positions cannot hit)."""
    arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if n < 1 or window < n or len(arr) < window + 1:
        raise ValueError(f"need n >= 1, window >= n and more than one window of tokens, got n={n}, window={window}, "
                         f"{len(arr)} tokens")
    n_win, base = (len(arr) - 1) // window, int(arr.max()) + 1
    packed = (n + 1) * np.log2(base) < 62  # the n + 1 tokens as one exact int64
    repeats = 0
    for i in range(n_win):  # one window: an (n+1)-gram seen before in it is an AR hit
        grams = np.lib.stride_tricks.sliding_window_view(arr[i * window:(i + 1) * window + 1], n + 1)  # [G, n + 1]
        if packed:
            key = np.zeros(len(grams), dtype=np.int64)
            for k in range(n + 1):
                key = key * base + grams[:, k]
            repeats += len(grams) - len(np.unique(key))
        else:
            repeats += len(grams) - len(np.unique(grams, axis=0))
    return float(repeats / (n_win * window))
