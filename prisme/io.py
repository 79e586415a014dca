"""Files and facts: atomic writes (fsync'd), JSON helpers, and the environment block every report records.

A reader of any file PRISME writes sees the old version or the new one, never a torn one: each write goes to a
temporary file in the same folder, is flushed and fsync'd, then `os.replace`d over the target.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import platform
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

PACKAGE_DIR = Path(__file__).resolve().parent  # prisme/: the embedded corpora and reference reports ship inside
CONFIG_DIR = PACKAGE_DIR / "configs"  # the recipes (prisme/configs/*.json), shipped as package data


# ------------------------------------------------------------------------------------------------------- atomic writes
def write_file(path: Path, data: bytes) -> None:
    """Write `data` to a fresh file and fsync it (no rename: for files inside a folder that is renamed into place)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a folder's entries durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def check_output_file(path: str | Path | None, option: str) -> None:
    """Before any long work: `path` (an output file, None = none) is not empty, not a folder, and its folder exists
    or can be made and is writable; else a ValueError naming `option` and the path."""
    if path is None:
        return
    if not str(path).strip():
        raise ValueError(f"{option} is empty: give a file path")
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{option} {p} is a folder; give a file path")
    _check_creatable(p.parent, option, p)


def check_output_folder(path: str | Path | None, option: str) -> None:
    """Before any long work: `path` (an output folder, None = the command's default) is not empty, not a file, and it
    exists or can be made in a writable folder; else a ValueError naming `option` and the path."""
    if path is None:
        return
    if not str(path).strip():
        raise ValueError(f"{option} is empty: give a folder path")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{option} {p} is a file, not a folder: give a folder path (made if missing)")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(f"{option} {p}: the folder is not writable; give another folder")
        return
    _check_creatable(p.parent, option, p)


def _check_creatable(parent: Path, option: str, p: Path) -> None:
    """`parent` (of the output `p`) exists or can be made: its nearest existing ancestor is a writable folder."""
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {p}: {parent} is a file, not a folder; give a path in a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {p}: cannot write into {parent} (read-only); give a path in a writable folder")
    try:  # what the atomic writers do there: a temporary file beside the target (the permission bits can pass where
        #   the filesystem refuses, e.g. /proc, or a read-only mount seen by root)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".prisme-check-"):
            pass
    except OSError as e:
        raise ValueError(f"{option} {p}: cannot write a file in {parent} ({e.strerror or e}); give a path in a "
                         f"writable folder") from None


def write_error(e: OSError, path: str | Path) -> OSError:
    """`e` (raised while writing `path`) as an OSError of the same errno (and class) whose message names the path and
    what to do: a full disk or a file-size limit, a read-only or missing folder, a file where a folder should be.
    Errors of `write(2)` and `fsync(2)` carry no path of their own (`[Errno 27] File too large`)."""
    why = e.strerror or str(e)
    advice = {errno.ENOSPC: "free space on that disk, or write elsewhere",
              errno.EFBIG: "the file is over the file-size limit (ulimit -f, or the filesystem's): raise it, or "
                           "write elsewhere",
              errno.EDQUOT: "the disk quota is used up: free space, or write elsewhere",
              errno.EROFS: "the filesystem is read-only: write elsewhere",
              errno.EACCES: "the folder is not writable: write elsewhere",
              errno.EPERM: "the folder is not writable: write elsewhere",
              errno.ENOTDIR: "a part of the path is a file, not a folder: give another path",
              errno.EEXIST: "a part of the path is a file, not a folder: give another path",
              errno.EISDIR: "the path is a folder: give a file path",
              errno.EBUSY: "the path is busy (a mount point or a folder?): give another file path"}.get(
                  e.errno, "check the path, or write elsewhere")
    msg = f"could not write {path} ({why}): {advice}"
    return OSError(e.errno, msg) if e.errno else OSError(msg)


def current_umask() -> int:
    """The process umask (read without changing it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` atomically: a reader sees the old file or the new one, never a torn one. An
    OSError names the path and what to do (`write_error`)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise write_error(e, path) from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600 files
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):  # a full disk, a file-size limit, ...: the message names the path (the old file
            raise write_error(e, path) from e  # is intact)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8) atomically (`write_bytes_atomic`)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(doc: Any, path: str | Path, **dumps: Any) -> None:
    """Write `doc` as indented JSON (plus a newline) atomically; `dumps` go to `json.dumps`."""
    write_text_atomic(path, json.dumps(doc, indent=2, **dumps) + "\n")


# -------------------------------------------------------------------------------------------------------------- JSON
def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"the key {k!r} appears twice (JSON keeps only the last; remove one)")
        seen[k] = v
    return seen


def loads_config(text: str) -> Any:
    """`json.loads` for files a person writes (configs): a key given twice is a ValueError naming it, not a silent
    last-one-wins."""
    return json.loads(text, object_pairs_hook=_no_duplicate_keys)


def json_default(o: Any) -> Any:
    """`json.dumps(default=...)` for what state files hold: paths, tensors, tuples."""
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"cannot store {type(o).__name__} in JSON")


def json_safe(x: Any) -> Any:
    """A copy of `x` that strict JSON accepts: non-finite floats become None, numpy scalars Python ones."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (np.integer, np.floating)):
        return json_safe(x.item())
    return x


# ------------------------------------------------------------------------------------------------------- environment
def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else whatever `platform` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment(model: torch.nn.Module | None = None, dtype: torch.dtype | None = None,
                seed: int | None = None) -> dict[str, Any]:
    """The facts a result depends on, in seed 001's layout: versions, platform, CPU, threads, time; the device and
    dtype of `model`'s parameters (or `dtype` on the CPU), the GPU's name on CUDA, and `seed` when given."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "device": "cpu",
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "executed_at_utc": datetime.now(timezone.utc).isoformat(),
    }
    if model is not None:
        p = next(model.parameters())
        env["device"], env["dtype"] = str(p.device), str(p.dtype).removeprefix("torch.")
        if p.device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(p.device)
    if seed is not None:
        env["seed"] = seed
    return env
