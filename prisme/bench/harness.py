"""The timing harness every benchmark shares (a leaf): rotated timing of named paths with warmups and gc off
(`time_paths`, from `prisme.devices`, where the studies reach it too), percentiles, peak Python memory, peak tensor
memory, torch thread counts, seeded models and tokens, and table-then-JSON output."""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from prisme.checks import integer, parse_list
from prisme.config import PrismeConfig
from prisme.devices import Timed, TimedPath, time_paths

__all__ = ["Timed", "TimedPath", "time_paths", "percentiles", "tracemalloc_peak"]  # (and the helpers below)
from prisme.io import json_safe, write_json_atomic
from prisme.model.backbone import Backbone

DTYPES = {"float32": torch.float32, "float64": torch.float64}



# ------------------------------------------------------------------------------------------------------------- harness
def percentiles(samples_ms: Sequence[float]) -> tuple[float, float]:
    """(p50, p95) with linear interpolation (numpy's default, as in seed 001)."""
    p50, p95 = np.percentile(np.asarray(samples_ms, dtype=np.float64), [50, 95])
    return float(p50), float(p95)


def tracemalloc_peak(setup: Callable[[], Any], run: Callable[[Any], Any]) -> int:
    """Peak bytes Python's allocator held above its starting point during one `run` (setup not counted)."""
    was_tracing = tracemalloc.is_tracing()
    with torch.inference_mode():
        state = setup()
        gc.collect()
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            run(state)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            if not was_tracing:
                tracemalloc.stop()
    return peak - base


UNCOUNTED_FREE = "allocated before the profiling started"  # the CPU allocator's warning: a free it cannot count


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """The process's stderr (file descriptor 2: what C++ code writes too) captured into the yielded list of lines while
    the block runs, and restored after it."""
    import os
    import tempfile

    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines += tmp.read().decode(errors="replace").splitlines()


def peak_memory(run: Callable[[], Any], device: torch.device, setup: Callable[[], Any] | None = None) -> int:
    """The most tensor memory `run()` held at once beyond what was held before it, in bytes (`setup()`, run first and
    not counted, does what must happen before: e.g. set a decode state's lengths). On CUDA the caching allocator's
    peak (`max_memory_allocated`); on the CPU the running sum of every tensor allocation and free in order, as
    `torch.profiler` records them with `profile_memory` (what its memory timeline reads): exact for tensors, blind to
    Python objects. The profiler's own lines on stderr are dropped; a free of memory allocated before the profile (which
    the running sum cannot count, so that it would read high) is a RuntimeError: free such memory in `setup`. The
    profiler slows the run; time it apart."""
    if setup is not None:
        setup()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with captured_stderr() as lines, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    if any(UNCOUNTED_FREE in line for line in lines):
        raise RuntimeError("peak_memory: the run freed memory allocated before it, which the profiler cannot count "
                           "(the peak would read high): free it in setup")
    for line in lines:  # what is not the profiler's own start/stop chatter goes on to stderr
        if "profiler_st" not in line:
            print(line, file=sys.stderr)
    held = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        held += nbytes
        peak = max(peak, held)
    return peak


def emit(doc: dict, table: str, json_path: str | None = None) -> int:
    """Print a benchmark's table, write its JSON document if asked, print the document last; exit status 0 when
    every check passed, else 1. The document is strict JSON: a non-finite number is written as null and fails the
    checks (`checks.finite: false`), since a verdict over a NaN timing is no verdict."""
    try:
        text = json.dumps(doc, indent=2, allow_nan=False)
    except ValueError:  # NaN or infinity somewhere in the document
        doc = json_safe(doc)
        doc["checks"] = {**doc["checks"], "finite": False, "passed": False}
        text = json.dumps(doc, indent=2, allow_nan=False)
    print(table)
    if json_path:
        write_json_atomic(doc, json_path, allow_nan=False)
        print(f"wrote {json_path}")
    print()
    print(text)
    sys.stdout.flush()
    return 0 if doc["checks"]["passed"] else 1


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with `n` torch CPU threads (n < 1: leave as is), restoring the previous setting after."""
    before = torch.get_num_threads()
    if n >= 1:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------------------------- model
def build_model(cfg: PrismeConfig, seed: int, dtype: torch.dtype = torch.float32) -> Backbone:
    """A seeded, untrained backbone in eval mode (same weights for every dtype; the global RNG is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Backbone(cfg)
    return model.to(dtype).eval()


def bench_device(name: str | torch.device | None) -> torch.device:
    """`--device` of a bench: "cpu" (default) or "cuda[:N]"; ValueError naming the option when CUDA is absent."""
    try:
        device = torch.device(name or "cpu")
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: a benchmark runs on cpu or cuda[:N], got {str(name)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def make_tokens(vocab_size: int, batch: int, length: int, seed: int) -> torch.Tensor:
    """Predetermined token ids `[batch, length]` from a private generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=g)


def model_facts(model: torch.nn.Module) -> dict[str, Any]:
    """What a benchmark's JSON records about the model it timed (a `Backbone` or a `PrismeModel`): the backbone's
    shape, and for a model with a workspace the workspace's (width, slots, editor blocks and hidden size, heads,
    r_max); untrained (random) weights."""
    cfg = model.cfg
    facts = {
        "preset": cfg.name,
        "family": cfg.family,
        "vocab": cfg.vocab_size,
        "layers": cfg.n_layer,
        "width": cfg.d_model,
        "heads": cfg.n_head,
        "kv_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "max_positions": cfg.max_seq_len,
        "parameters": model.num_parameters(),
        "trained": False,
        "position_encoding": "learned absolute" if cfg.family == "gpt2" else "rope",
    }
    if hasattr(model, "editor"):
        facts.update(w=cfg.w, slots=cfg.n_slots, edit_blocks=cfg.n_edit_blocks, editor_hidden=cfg.editor_hidden,
                     ws_heads=cfg.n_ws_heads, r_max=cfg.r_max)
    return facts


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    """Comma-separated positive integers (a CLI list such as --prompts or --batches), or a ValueError naming `flag`
    (`checks.parse_list`: an empty list or entry is an error)."""
    return tuple(parse_list(text, flag, integer(1), example="1,8"))


def parse_names(text: str, flag: str) -> tuple[str, ...]:
    """Comma-separated names (a CLI list such as --presets or --shapes), each once; a ValueError naming `flag` for an
    empty list or entry (`checks.parse_list`)."""
    return tuple(parse_list(text, flag, distinct=True))
