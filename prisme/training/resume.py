"""What a run folder needs around the stage loop: the model a stage starts from (`load_start`: fresh, resumed or
`init_from`), one process at a time (`RunLock`), the RNG streams' state, dropping metrics rows past the checkpoint,
and a SIGINT or SIGTERM that finishes the step and saves."""

from __future__ import annotations

import binascii
import contextlib
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from prisme import checkpoint as ckpt
from prisme.io import write_text_atomic
from prisme.training.config import RESUME_FREE

if TYPE_CHECKING:
    from torch import nn

    from prisme.config import PrismeConfig
    from prisme.training.config import StageConfig


def rng_state(gens: dict[str, torch.Generator]) -> dict[str, str]:
    out = {k: ckpt.encode_rng(g.get_state()) for k, g in gens.items()}
    out["torch"] = ckpt.encode_rng(torch.get_rng_state())
    return out


def restore_rng_state(gens: dict[str, torch.Generator], state: dict[str, str], source: Path | str = "checkpoint") \
        -> None:
    """Set the generators from a checkpoint's `rng` entry (read from `source`, which errors name)."""
    for k in gens:
        if k not in state:
            raise ValueError(f"{source}: its RNG state lacks generator {k!r}; the run cannot be resumed exactly")
    try:
        for k, g in gens.items():
            g.set_state(ckpt.decode_rng(state[k]))
        if "torch" in state:
            torch.set_rng_state(ckpt.decode_rng(state["torch"]))
    except (RuntimeError, TypeError, ValueError, binascii.Error) as e:
        raise ValueError(f"{source}: its `rng` entry is corrupt ({e}); the run cannot be resumed exactly (restore "
                         f"the file, or start from the weights with init_from)") from None


STOP_SIGNALS = ("SIGINT", "SIGTERM")  # Ctrl-C, and what schedulers and `timeout` send


@contextlib.contextmanager
def graceful_sigint() -> Iterator[dict[str, Any]]:
    """The first SIGINT or SIGTERM sets a flag the loop checks at the next step boundary (`flag["signal"]` names it);
    a second one raises KeyboardInterrupt at once (a save already under way is atomic: the previous checkpoint
    stays intact)."""
    flag: dict[str, Any] = {"stop": False, "signal": None}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    sigs = [getattr(signal, name) for name in STOP_SIGNALS]
    previous = {s: signal.getsignal(s) for s in sigs}

    def handler(signum, frame):
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"], flag["signal"] = True, signal.Signals(signum).name

    for s in sigs:
        signal.signal(s, handler)
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def load_start(model_cfg: PrismeConfig | None, scfg: StageConfig) -> tuple[nn.Module, ckpt.CheckpointMeta | None]:
    """The model this stage starts from, and the checkpoint it came from (validated; nothing written yet)."""
    from prisme.model.prisme import PrismeModel

    out = Path(scfg.out_dir)
    if scfg.resume:
        ckpt.clean_stale_temps(out)  # what a killed save left behind
        found = ckpt.latest_checkpoint(out)
        if found is None:
            raise ValueError(f"resume=True but {out} holds no checkpoint ({out / ckpt.LATEST} is missing); "
                             f"start the stage without --resume")
        model, meta = ckpt.load_checkpoint(found, expected_config=model_cfg, load_optimizer=True)
        check_resumable(meta, scfg, out)
        return model, meta
    check_fresh_run(out, scfg.overwrite)
    spec = scfg.spec
    if scfg.init_from is None:
        if not scfg.may_start_fresh or (not spec.is_first and model_cfg is None):
            prev = spec.previous
            raise ValueError(f"stage {scfg.stage!r} starts from the {prev!r} stage's checkpoint, and init_from is not "
                             f"set: run `prisme train --stage {prev}` first and pass its out_dir (or a ckpt_* folder) "
                             f"as init_from / --init-from")
        if model_cfg is None:
            raise ValueError(f"a fresh {scfg.stage} stage needs a model config (a preset or a PrismeConfig)")
        torch.manual_seed(scfg.seed)
        return PrismeModel(model_cfg), None
    try:
        model, meta = ckpt.load_checkpoint(scfg.init_from, expected_config=model_cfg, load_optimizer=False)
    except ValueError as e:
        prev = spec.previous or spec.name  # the first stage: a checkpoint of its own
        raise ValueError(f"stage {scfg.stage!r} cannot start from init_from={scfg.init_from!r}: {e}. Run "
                         f"`prisme train --stage {prev}` first, or point init_from at its out_dir") from None
    if not spec.accepts(meta.stage):
        raise ValueError(f"stage {scfg.stage!r} needs a checkpoint of stage {spec.previous!r} (or its own), "
                         f"but {meta.path} is a {meta.stage!r} checkpoint")
    return model, meta


class RunLock:
    """An exclusive lock on a run folder (`.prisme-run.lock`, `fcntl.flock`): one process trains into it at a time.

    The kernel releases the lock when its holder exits, however it exits, so a dead holder never blocks a later run.
    The lock file records the holder's pid, which the error of a second process names. A folder the lock created
    and that holds nothing else when it is released (a run that stopped on bad input) is removed again.
    """

    NAME = ".prisme-run.lock"

    def __init__(self, out: Path):
        import fcntl
        import os

        from prisme.io import write_error

        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"the run folder {self.out} is a file, not a folder: pass another --out")
        self.created = not self.out.exists()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file on the way, a read-only folder: named, with what to do
            raise write_error(e, self.out) from e
        self.path = self.out / self.NAME
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise ValueError(f"{self.out} is in use by {holder}: two runs must not write one run folder; wait for "
                             f"it to finish, or pass another --out") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"process {os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        import os

        if self.fd is None:
            return
        os.close(self.fd)  # closing the descriptor releases the flock
        self.fd = None
        if self.created and [p.name for p in self.out.iterdir()] == [self.NAME]:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.out.rmdir()


def drop_rows_after(path: Path, step: int) -> None:
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


def accumulate(acc: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> None:
    """Sum statistics in float64 where they are (no host read: `stats_to_host` reads them all at once)."""
    for k, v in stats.items():
        v = v.detach().double()
        acc[k] = acc[k] + v if k in acc else v


def check_fresh_run(out: Path, overwrite: bool) -> None:
    """ValueError when a fresh run would write into a folder that holds a run (and `overwrite` was not asked)."""
    held = run_contents(out)
    if held and not overwrite:
        raise ValueError(f"{out} already holds a run ({', '.join(held)}); pass --resume (resume=True) to continue it, "
                         f"--overwrite (overwrite=True) to replace it, or choose another out_dir")


def run_contents(out: Path) -> list[str]:
    """What of a run a folder holds (checkpoints, the latest pointer, metrics), whatever state `latest` is in."""
    if not out.is_dir():
        return []
    names = sorted(p.name for p in out.iterdir() if p.name.startswith("ckpt_") or p.name in (ckpt.LATEST,
                                                                                          "metrics.jsonl"))
    return names[:3] + ([f"... {len(names) - 3} more"] if len(names) > 3 else [])


def clear_run(out: Path) -> None:
    """`overwrite`: remove a previous run's checkpoints, pointer, metrics, stage config and tensorboard events."""
    import shutil

    for p in out.iterdir():
        if p.name.startswith("ckpt_") or p.name.startswith(".ckpt_") or p.name == "tb":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        elif p.name in (ckpt.LATEST, "metrics.jsonl", "stage_config.json"):
            p.unlink()


def check_resumable(meta: ckpt.CheckpointMeta, scfg: StageConfig, out: Path) -> None:
    """ValueError unless the checkpoint `meta` (the latest of run folder `out`) can be continued exactly by `scfg`:
    it has optimizer state, it is of the same stage, the schedule and every setting outside `RESUME_FREE` match."""
    found = meta.path
    if meta.optimizer_state is None:
        raise ValueError(f"{found} has no {ckpt.OPTIMIZER}; it cannot be resumed (use it as init_from instead)")
    if not scfg.spec.owns(meta.stage):
        raise ValueError(f"{found} is a {meta.stage!r} checkpoint; cannot resume it as stage {scfg.stage!r}")
    saved = meta.stage_config.get("steps")
    if saved is not None and saved != scfg.steps and not scfg.reschedule:
        raise ValueError(f"resume asks for steps={scfg.steps} but {found} was trained toward steps={saved}: the "
                         f"learning-rate schedule (warm-up, then cosine to the last step) would change under it; "
                         f"pass --steps {saved} to continue exactly, or --reschedule to accept the new schedule")
    if scfg.steps < meta.step:
        raise ValueError(f"resume asks for steps={scfg.steps} but {found} is already at step {meta.step}")
    check_resume_settings(meta.stage_config, scfg.to_dict(), out)


def check_resume_settings(saved: dict[str, Any], asked: dict[str, Any], out: Path) -> None:
    """ValueError naming every setting (outside `RESUME_FREE`) in which a resume would not continue the saved run,
    with the run's value and the asked one."""

    changed = {k: (saved[k], v) for k, v in asked.items() if k not in RESUME_FREE and k in saved and saved[k] != v}
    if changed:
        shown = "; ".join(f"{k}: the run has {a!r}, asked {b!r}" for k, (a, b) in changed.items())
        raise ValueError(f"resume would not continue the run in {out}: {shown}. Leave these settings as the run has "
                         f"them (`prisme train --resume --out {out}` reads them from its stage_config.json), or start "
                         f"a new run")
