"""What exact resume needs around the stage loop: the RNG streams' state, dropping metrics rows past the
checkpoint, and a SIGINT that finishes the step and saves."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from prisme import checkpoint as ckpt
from prisme.io import write_text_atomic


def _rng_state(gens: dict[str, torch.Generator]) -> dict[str, str]:
    out = {k: ckpt.encode_rng(g.get_state()) for k, g in gens.items()}
    out["torch"] = ckpt.encode_rng(torch.get_rng_state())
    return out


def _set_rng_state(gens: dict[str, torch.Generator], state: dict[str, str]) -> None:
    for k, g in gens.items():
        if k not in state:
            raise ValueError(f"checkpoint RNG state lacks generator {k!r}; it cannot be resumed exactly")
        g.set_state(ckpt.decode_rng(state[k]))
    if "torch" in state:
        torch.set_rng_state(ckpt.decode_rng(state["torch"]))


@contextlib.contextmanager
def _graceful_sigint() -> Iterator[dict[str, bool]]:
    """First Ctrl-C sets a flag the loop checks at the next step boundary; a second one raises at once."""
    flag = {"stop": False}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True

    signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _drop_rows_after(path: Path, step: int) -> None:
    """Forget metrics rows logged after `step` (the resumed checkpoint): the resumed run logs them again. A torn
    last line (a kill in the middle of an append) is dropped with a note; a torn line elsewhere is an error naming
    the file and line."""
    if not path.exists():
        return
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    keep = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                print(f"note: {path}: dropped a torn last line (an interrupted append): {line[:60]!r}",
                      file=sys.stderr)
                continue
            raise ValueError(f"{path} line {i + 1} is not JSON ({line[:60]!r}); fix or remove that line to resume")\
                from None
        if row.get("step", 0) <= step:
            keep.append(line)
    if len(keep) != len(lines):
        write_text_atomic(path, "".join(line + "\n" for line in keep))


def _accumulate(acc: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> None:
    for k, v in stats.items():
        v = v.detach().double().cpu()
        acc[k] = acc[k] + v if k in acc else v
