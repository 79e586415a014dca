"""`prisme bench workspace --profile`: where the workspace's decode time goes, by ATen op and by method."""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter_ns
from typing import Any

import torch

from prisme.bench.workspace_paths import VARIANTS, SplitTimer, _decode, _paths, make_sequence
from prisme.model.prisme import PrismeModel


# ------------------------------------------------------------------------------------------------------------- profile
def profile_workspace(models: dict[str, PrismeModel], batch: int, P: int, N: int,
                      variants: Sequence[str] = VARIANTS, top: int = 15, seed: int = 42) -> dict[str, Any]:
    """Where the workspace's time goes, per workspace row x model: the top ops by self CPU time over N decode steps,
    excluding everything under the backbone and head wrappers (per op: calls and microseconds per decode step), the
    time inside each workspace method, and the number of ATen calls Python dispatched. Profiled times include the
    profiler's own per-op overhead: read shares and call counts, and the unprofiled table for absolute times."""
    from torch.profiler import ProfilerActivity, profile

    cfg = models["opt"].cfg
    dev = next(models["opt"].parameters()).device
    seq = make_sequence(cfg.vocab_size, batch, P + N, seed, dev)
    prompt, new = seq[:, :P], seq[:, P:]
    paths = _paths(models, batch, P, N, prompt, variants=variants)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    out: dict[str, Any] = {"batch": batch, "decode_steps": N, "preset": cfg.name, "variants": list(variants),
                           "rows": {}}
    excluded = {"prisme::backbone", "prisme::head"}
    methods = {f"prisme::{SplitTimer.label_of(o, m)}" for o, m in SplitTimer._WORKSPACE_METHODS}
    with SplitTimer(list(models.values()), label=True), torch.inference_mode():
        for p in paths:
            p.state.rewind(P)
            _decode(p, new[:, :1])  # warm
            p.state.rewind(P)
            with profile(activities=activities) as prof:
                t0 = perf_counter_ns()
                _decode(p, new)
                wall_us = (perf_counter_ns() - t0) / 1e3
            agg: dict[str, list[float]] = {}
            by_method: dict[str, float] = {}
            n_ops = 0
            for e in prof.events():
                if _under(e, excluded):
                    continue
                if e.name in methods:  # its own time: the head called inside the readout is not the workspace's
                    key = e.name.removeprefix("prisme::")
                    by_method[key] = by_method.get(key, 0.0) + (e.cpu_time_total - _time_in(e, excluded)) / N
                    continue
                if e.name.startswith("prisme::"):
                    continue
                a = agg.setdefault(e.name, [0, 0.0])
                a[0] += 1
                a[1] += e.self_cpu_time_total
                if e.name.startswith("aten::") and _top_level_aten(e):
                    n_ops += 1
            ranked = sorted(agg.items(), key=lambda kv: -kv[1][1])
            self_total = sum(v[1] for v in agg.values())
            n_actions = sum(p.counts) / batch
            out["rows"][p.name] = {
                "wall_us_per_step_profiled": wall_us / N,
                "workspace_methods_us_per_step": by_method,
                "self_us_per_step_outside_backbone": self_total / N,
                "top_level_aten_calls_per_step": n_ops / N,
                "mean_actions_per_position": n_actions,
                "top": [{"op": k, "calls_per_step": v[0] / N, "self_us_per_step": v[1] / N,
                         "us_per_call": v[1] / max(v[0], 1), "share": v[1] / max(self_total, 1e-9)}
                        for k, v in ranked[:top]],
            }
    return out


def _under(e: Any, names: set[str]) -> bool:
    while e is not None:
        if e.name in names:
            return True
        e = e.cpu_parent
    return False


def _time_in(e: Any, names: set[str]) -> float:
    """Total CPU time of the ranges named in `names` nested anywhere under event `e`."""
    return sum(c.cpu_time_total if c.name in names else _time_in(c, names) for c in e.cpu_children)


def _top_level_aten(e: Any) -> bool:
    """An aten op not called from inside another aten op (what Python dispatched)."""
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return False
        p = p.cpu_parent
    return True
