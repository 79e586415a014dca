"""Device helpers every layer may use: synchronising the right device, timing without a sync inside the timed region,
the one rotated timing loop (`time_paths`: every benchmark's and study's timed comparison), TF32 as an explicit
opt-in, and host-to-device copies that do not block the host.

On the CPU each helper is the plain thing (no sync, `perf_counter_ns`, `.to(device)`), so CPU results and timings are
unchanged; on CUDA they do what a correct GPU measurement or input pipeline needs.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on `device` (CUDA, MPS); a no-op on the CPU or for None."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":  # pragma: no cover - no MPS machine in CI
        torch.mps.synchronize()


class Stopwatch:
    """Elapsed time of a region on `device`: CUDA events on CUDA (recorded in the stream, read after the region: no
    synchronisation inside it), `perf_counter_ns` elsewhere (after synchronising other devices before the start).

        sw = Stopwatch(device); sw.start(); work(); ms = sw.stop()
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self._t0 = 0
        self._events: tuple | None = None

    def start(self) -> None:
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            synchronize(self.device)
            self._t0 = perf_counter_ns()

    def stop(self) -> float:
        """Milliseconds since `start` (on CUDA: waits for the end event, after the region)."""
        if self.cuda:
            start, end = self._events
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        synchronize(self.device)
        return (perf_counter_ns() - self._t0) / 1e6


TimedPath = tuple[str, Callable[[], Any], Callable[[Any], Any]]  # (name, setup() -> state, run(state)), run is timed


@dataclass(frozen=True)
class Timed:
    """What a path's `run` may return instead of being timed whole: its own measurement `ms` (e.g. per step of a
    loop it runs) and a value to keep (`time_paths(..., outputs=...)`)."""

    ms: float
    value: Any = None


def time_paths(paths: Sequence[TimedPath], warmups: int, repeats: int, device: torch.device | str | None = None,
               inference: bool = True, outputs: dict[str, Any] | None = None) -> dict[str, list[float]]:
    """Run every path `warmups` untimed then `repeats` timed times, order rotated each repeat, gc off while timing;
    samples in ms per path.

    Each sample is the stopwatch's (`Stopwatch` on `device`: CUDA events there, `perf_counter_ns` elsewhere) around
    `run(setup())`, `setup` untimed, or the `Timed.ms` that run returns. `inference`: under `torch.inference_mode`
    (False: training steps, which need autograd). `outputs`: each path's last `Timed.value`, or last return value."""
    if warmups < 0 or repeats < 1:
        raise ValueError(f"need warmups >= 0 and repeats >= 1, got {warmups} and {repeats}")
    samples: dict[str, list[float]] = {name: [] for name, _, _ in paths}
    n = len(paths)
    watch = Stopwatch(device)
    gc_was_enabled = gc.isenabled()
    with torch.inference_mode() if inference else contextlib.nullcontext():
        try:
            for r in range(warmups + repeats):
                if r == warmups:
                    gc.collect()
                    gc.disable()
                for name, setup, run in (paths[(r + i) % n] for i in range(n)):
                    state = setup()
                    watch.start()
                    out = run(state)
                    ms = watch.stop()
                    if isinstance(out, Timed):
                        ms, out = out.ms, out.value
                    if outputs is not None:
                        outputs[name] = out
                    if r >= warmups:
                        samples[name].append(ms)
        finally:
            if gc_was_enabled:
                gc.enable()
    return samples


def set_tf32(enabled: bool) -> None:
    """TF32 matmuls and convolutions on Ampere and later GPUs (10 bits of mantissa instead of 23; about 2-8x the
    float32 matmul rate). Off by default in PRISME, as in PyTorch: results differ from float32 at ~1e-3 relative."""
    if not isinstance(enabled, bool):
        raise ValueError(f"tf32 must be True or False, got {enabled!r}")
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: on CUDA through pinned memory and a non-blocking copy (the host goes on preparing the next
    batch while it transfers); elsewhere a plain `.to(device)`."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def spread(i: int) -> str:
    """The device of a study's i-th worker task: round-robin over the CUDA devices when there are several (every
    worker on cuda:0 would leave the others idle), else "auto" (the stage's own choice)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"cuda:{i % n}" if n > 1 else "auto"


# ------------------------------------------------------------------------------------------------------------- memory
def available_memory(device: torch.device | str | None = None) -> int | None:
    """Bytes a command can still allocate on `device`: a GPU's free memory; on the CPU the least of the kernel's
    MemAvailable and what the process's cgroup (a container's limit) has left. None where neither can be read."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    found = []
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            found.append(int(limit) - int(open("/sys/fs/cgroup/memory.current").read()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_fits(need: int, what: str, advice: str, device: torch.device | str | None = None,
               available: int | None = None) -> None:
    """A ValueError naming `what` needs `need` bytes and `advice` (the option to change) when the device has less
    left (`available_memory`, or `available` given); nothing where the memory cannot be read."""
    have = available_memory(device) if available is None else available
    if have is not None and need > have:
        raise ValueError(f"{what} needs about {need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB this "
                         f"machine has free: {advice}")
