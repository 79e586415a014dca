"""Your own data: documents (a folder searched recursively for `.txt` / `.md` / `.py` / `.jsonl` and the suffixes
`extensions` names, hidden files and `__pycache__` left out; one file; or a Hugging Face
`datasets` dataset saved on disk) prepared once into token files read through a memory map (`prisme data prepare`),
and `ShardDataset`, which trains on them with memory that does not grow with the corpus.

A prepared folder holds `train.bin` and `val.bin` (raw little-endian uint16 tokens when the vocabulary fits, else
uint32), `manifest.json` (the tokenizer, documents and tokens per split, the split rule, the end-of-document id,
the sources read and skipped) and, for a BPE, its `tokenizer.json`. Documents are split whole: a seeded shuffle of
the documents puts `val_fraction` of them (at least one when there are two or more) in validation. An
end-of-document token follows every document: the tokenizer's encoding of the NUL byte (id 0 for the byte
tokenizer; text almost never holds one). Preparing streams one document at a time and writes into a temporary folder
renamed into place at the end: a failure leaves nothing half-written.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prisme.data.text import TEXT_SUFFIXES, TokenDataset, check_split, read_text_file
from prisme.data.tokenizers import TOKENIZER_FILE, ByteTokenizer, tokenizer_from_record, tokenizer_record
from prisme.io import fsync_dir, write_json_atomic

FORMAT = "prisme-tokens-v1"
MANIFEST = "manifest.json"
SOURCE_SUFFIXES = (".py",)  # source files read as documents by default (others: `extensions`, `--ext`)
DOC_SUFFIXES = (*TEXT_SUFFIXES, *SOURCE_SUFFIXES, ".jsonl")


def is_prepared(path: str | Path) -> bool:
    """Whether `path` is a folder written by `prepare` (it holds a manifest)."""
    return (Path(path) / MANIFEST).is_file()


# ------------------------------------------------------------------------------------------------------- documents
def _is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def suffixes(extensions: Sequence[str] = ()) -> tuple[str, ...]:
    """The file suffixes read as documents: `DOC_SUFFIXES` and `extensions` ("js" or ".js"); ValueError for an empty
    or odd one."""
    extra = []
    for e in extensions:
        if not isinstance(e, str) or not e.strip(".") or "/" in e or " " in e:
            raise ValueError(f"an extension is a file suffix such as js or .js, got {e!r}")
        extra.append(e if e.startswith(".") else f".{e}")
    return tuple(dict.fromkeys((*DOC_SUFFIXES, *extra)))


def _handles(src: Path, text_field: str, extensions: Sequence[str] = ()) -> tuple[list[tuple[str, Any]], list[str]]:
    """Every document of `src` as a cheap handle ((file, None) or (file, line) or ("hf", row)), in a fixed order, and
    the files skipped (another suffix than `suffixes(extensions)`, hidden files and `__pycache__`); ValueError naming
    the file and line of a `.jsonl` line that is not JSON or lacks the field."""
    if _is_hf_dataset(src):
        ds = _load_hf(src)
        if text_field not in ds.column_names:
            raise ValueError(f"dataset {src} has no column {text_field!r} (columns: {ds.column_names}); pass "
                             f"--text-field")
        return [("hf", i) for i in range(len(ds))], []
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file() and not any(
        part.startswith(".") or part == "__pycache__" for part in p.relative_to(src).parts))
    handles, skipped = [], []
    known = suffixes(extensions)
    for f in files:
        if f.suffix not in known:
            skipped.append(str(f))
            continue
        if f.suffix != ".jsonl":
            handles.append((str(f), None))
            continue
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                handles.append((str(f), n))
                _jsonl_text(line, text_field, f, n)  # checked now, before anything is written
    return handles, skipped


def _jsonl_text(line: str, field: str, f: Path | str, n: int) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}, line {n}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get(field), str):
        raise ValueError(f"{f}, line {n}: no text field {field!r} (pass --text-field to name another)")
    return row[field]


def _load_hf(src: Path):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{src} is a Hugging Face dataset; reading it needs `datasets`: pip install "
                         f"'prisme[data]'") from None
    ds = datasets.load_from_disk(str(src))
    if isinstance(ds, datasets.DatasetDict):  # every split, in name order: the split here is PRISME's own
        ds = datasets.concatenate_datasets([ds[k] for k in sorted(ds)])
    return ds


def _documents(src: Path, handles: list[tuple[str, Any]], text_field: str) -> Iterator[str]:
    """The documents' texts in handle order, one at a time (a `.jsonl` file is read once, line by line)."""
    hf = _load_hf(src) if handles and handles[0][0] == "hf" else None
    open_file, fh, lines = None, None, None
    try:
        for name, where in handles:
            if hf is not None:
                yield hf[where][text_field]
            elif where is None:
                text = read_text_file(Path(name))  # a ValueError naming the file when it is not UTF-8
                if "\x00" in text:
                    raise ValueError(f"{name} holds a NUL byte: not a text file (the NUL byte ends each document); "
                                     f"remove it, or leave its suffix out")
                yield text
            else:
                if open_file != name:  # the next .jsonl file: its lines in order, the previous one closed
                    if fh is not None:
                        fh.close()
                    fh = open(name, encoding="utf-8")  # noqa: SIM115
                    open_file, lines = name, enumerate(fh, 1)
                for n, line in lines:
                    if n == where:
                        yield _jsonl_text(line, text_field, name, n)
                        break
    finally:
        if fh is not None:
            fh.close()


# --------------------------------------------------------------------------------------------------------- prepare
def prepare(src: str | Path, out: str | Path, tokenizer: Any = None, text_field: str = "text",
            val_fraction: float = 0.1, seed: int = 0, extensions: Sequence[str] = ()) -> dict[str, Any]:
    """Tokenize the documents of `src` into `out` (see the module docstring; `extensions`: suffixes read besides
    `DOC_SUFFIXES`); returns the manifest."""
    src, out = Path(src), Path(out)
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    if not src.exists():
        raise ValueError(f"data source {src} does not exist")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} already exists and is not empty; pass another --out")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    handles, skipped = _handles(src, text_field, extensions)
    if not handles:
        raise ValueError(f"{src} holds no readable document ({'/'.join('*' + s for s in suffixes(extensions))} files, "
                         f"or a saved Hugging Face dataset): name other suffixes with --ext (e.g. --ext js,ts)")
    if val_fraction > 0 and len(handles) < 2:
        raise ValueError(f"{src} holds one document: documents are split whole, so a validation split needs two or "
                         f"more (split the text into several files, or train on the text itself: --dataset {src})")
    order = list(range(len(handles)))
    random.Random(seed).shuffle(order)
    n_val = 0 if val_fraction == 0 else min(len(handles) - 1, max(1, round(len(handles) * val_fraction)))
    val = set(order[:n_val])
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    eod = tok.encode("\x00")
    if len(eod) != 1:
        raise ValueError(f"the tokenizer encodes the NUL byte as {len(eod)} tokens; the end-of-document token must be "
                         f"one")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    counts = {"train": [0, 0], "val": [0, 0]}  # documents, tokens
    try:
        files = {s: open(tmp / f"{s}.bin", "wb") for s in ("train", "val")}  # noqa: SIM115
        try:
            for i, text in enumerate(_documents(src, handles, text_field)):
                split = "val" if i in val else "train"
                ids = np.asarray(tok.encode(text) + eod, dtype=np.int64)
                if ids.size and ids.max() >= tok.vocab_size:
                    raise ValueError(f"the tokenizer produced id {int(ids.max())} >= its vocab_size")
                files[split].write(ids.astype(dtype).tobytes())
                counts[split][0] += 1
                counts[split][1] += int(ids.size)
        finally:
            for f in files.values():
                f.flush()
                os.fsync(f.fileno())
                f.close()
        record, blob = tokenizer_record(tok)
        if blob is not None:
            (tmp / TOKENIZER_FILE).write_bytes(blob)
        manifest = {"format": FORMAT, "dtype": np.dtype(dtype).name, "tokenizer": record, "eod_id": int(eod[0]),
                    "vocab_size": tok.vocab_size, "files": {"train": "train.bin", "val": "val.bin"},
                    "documents": {s: c[0] for s, c in counts.items()}, "tokens": {s: c[1] for s, c in counts.items()},
                    "split": {"rule": "whole documents; a seeded shuffle of the documents puts val_fraction of them "
                                      "(at least one of two or more) in val", "seed": seed,
                              "val_fraction": val_fraction},
                    "source": str(src), "text_field": text_field, "suffixes": list(suffixes(extensions)),
                    "skipped": skipped}
        write_json_atomic(manifest, tmp / MANIFEST)
        fsync_dir(tmp)
        if out.exists():  # an empty folder (checked above)
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def folder_text(src: str | Path, extensions: Sequence[str] = (), text_field: str = "text") -> str:
    """Every document `prepare` would read from `src` (a folder, a file, or a saved dataset), joined by blank lines:
    what a tokenizer trains on (`prisme tokenizer train --corpus FOLDER`); ValueError where there is none."""
    src = Path(src)
    handles, _ = _handles(src, text_field, extensions)
    if not handles:
        raise ValueError(f"{src} holds no readable document ({'/'.join('*' + s for s in suffixes(extensions))} files, "
                         f"or a saved Hugging Face dataset): name other suffixes with --ext (e.g. --ext js,ts)")
    return "\n\n".join(_documents(src, handles, text_field))


# --------------------------------------------------------------------------------------------------------- dataset
class ShardDataset(TokenDataset):
    """A prepared folder as a `TokenDataset`: the same sampling (random windows from the same generator calls) and
    evaluation windows, read from memory-mapped token files instead of a tensor in memory."""

    def __init__(self, path: str | Path):  # noqa: D107 - TokenDataset's constructor builds from a tensor instead
        path = Path(path)
        m = read_manifest(path)
        self.path, self.manifest = path, m
        self.tokenizer = tokenizer_from_record(m["tokenizer"], path)
        self.vocab_size = int(m["vocab_size"])
        self._np = {}
        for split in ("train", "val"):
            f = path / m["files"][split]
            n = f.stat().st_size // np.dtype(m["dtype"]).itemsize
            self._np[split] = np.memmap(f, dtype=m["dtype"], mode="r") if n else np.zeros(0, dtype=m["dtype"])
            mm = getattr(self._np[split], "_mmap", None)
            if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                mm.madvise(mmap.MADV_RANDOM)  # random windows: no read-ahead of the pages around each one
        self.val_fraction = float(m["split"]["val_fraction"])

    def split_tokens(self, split: str) -> _Lazy:
        """The split's token file, indexed lazily (`TokenDataset.batch` / `iter_eval` read only their windows)."""
        return _Lazy(self._np[check_split(split)])


def read_manifest(path: Path) -> dict[str, Any]:
    """A prepared folder's manifest, checked against its token files; ValueError naming the file and what is wrong
    (a missing or mistyped entry, a missing token file, one whose size is not the manifest's count of whole tokens)."""
    where = path / MANIFEST
    again = f"prepare the folder again (prisme data prepare SOURCE --out {path})"
    try:
        m = json.loads(where.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where} is not a readable manifest ({e}); {again}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{where}: format {m.get('format') if isinstance(m, dict) else None!r} is not {FORMAT!r}; "
                         f"{again}")
    shapes = {"dtype": str, "tokenizer": dict, "vocab_size": int, "files": dict, "tokens": dict, "split": dict}
    for key, kind in shapes.items():
        if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
            raise ValueError(f"{where} has no {key!r} entry (or not a {kind.__name__}); {again}")
    if m["dtype"] not in ("uint16", "uint32"):
        raise ValueError(f"{where}: dtype {m['dtype']!r} is not uint16 or uint32; {again}")
    vf = m["split"].get("val_fraction")
    if not isinstance(vf, (int, float)) or isinstance(vf, bool) or not 0 <= vf < 1:
        raise ValueError(f"{where}: its 'split' entry has no val_fraction in [0, 1); {again}")
    size = np.dtype(m["dtype"]).itemsize
    for split in ("train", "val"):
        name, count = m["files"].get(split), m["tokens"].get(split)
        if not isinstance(name, str) or not isinstance(count, int):
            raise ValueError(f"{where}: 'files' and 'tokens' must name the {split} split's file and tokens; {again}")
        f = path / name
        if not f.is_file():
            raise ValueError(f"{f} is missing (the {split} split's tokens, named in {where}); {again}")
        got = f.stat().st_size
        if got != count * size:
            raise ValueError(f"{f} holds {got:,} bytes, but {where} records {count:,} {m['dtype']} tokens "
                             f"({count * size:,} bytes): the file is truncated or from another preparation; {again}")
    return m


class _Lazy:
    """A 1-D memory-mapped token file that `TokenDataset` indexes like a tensor: `.numel()`, and `[idx]` with a
    tensor of positions returning an int64 tensor (only those tokens are read)."""

    def __init__(self, arr: np.ndarray):
        self.arr = arr

    def numel(self) -> int:
        return int(self.arr.shape[0])

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.arr[idx.numpy()].astype(np.int64))
