"""Paired statistics for comparisons on the same tokens: a bootstrap over sequences, and verdicts from intervals.

A comparison of a policy with a reference scored on the same tokens is paired: each sequence s contributes the policy's
summed loss a_s, the reference's b_s and its scored token count n_s. The estimate is the token-weighted mean difference
(sum_s a_s - sum_s b_s) / sum_s n_s (nats per token, policy minus reference); its 95% interval is the percentile
bootstrap over sequences (resample S sequences with replacement, `n_boot` times, from a seeded generator). Sequences
are the resampling unit because tokens within one are correlated.

A verdict follows from the interval, never from the point estimate: "beats" when its upper bound is below 0 (the
policy's loss is lower), "loses" when its lower bound is above 0, "ties" otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from prisme.checks import is_int

N_BOOT = 1000
LEVEL = 0.95


def check_bootstrap_args(n_boot: Any, seed: Any) -> None:
    """ValueError unless `n_boot` is an int >= 1 and `seed` an int >= 0 (bools are neither)."""
    if not is_int(n_boot) or n_boot < 1:
        raise ValueError(f"bootstrap samples must be a positive integer, got {n_boot!r}")
    if not is_int(seed) or seed < 0:
        raise ValueError(f"bootstrap seed must be an integer >= 0, got {seed!r}")


@dataclass(frozen=True)
class PairedDelta:
    """A paired mean difference (policy minus reference, nats per token) with its bootstrap interval."""

    mean: float
    lo: float
    hi: float
    n_sequences: int
    n_tokens: int

    @property
    def verdict(self) -> str:
        return verdict(self.lo, self.hi)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def fmt(self, digits: int = 4) -> str:
        """`+0.0012 [-0.0003, +0.0027]`."""
        return f"{self.mean:+.{digits}f} [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]"


def verdict(lo: float, hi: float) -> str:
    """"beats" if hi < 0, "loses" if lo > 0, else "ties" (a lower loss is better). An interval that is zero to
    rounding (|lo|, |hi| <= 1e-9: a policy that changed nothing) ties."""
    if max(abs(lo), abs(hi)) <= 1e-9:
        return "ties"
    if hi < 0:
        return "beats"
    if lo > 0:
        return "loses"
    return "ties"


def paired_bootstrap(a: Sequence[float] | torch.Tensor, b: Sequence[float] | torch.Tensor,
                     n: Sequence[float] | torch.Tensor, n_boot: int = N_BOOT, seed: int = 0,
                     level: float = LEVEL) -> PairedDelta:
    """Token-weighted mean of a - b over sequences with a percentile bootstrap interval.

    Args:
        a, b: `[S]` per-sequence summed losses of the policy and the reference on the same tokens.
        n: `[S]` scored tokens per sequence (sequences with none are dropped).
        n_boot: bootstrap resamples; seed: their generator's seed; level: interval coverage (default 0.95).
    """
    check_bootstrap_args(n_boot, seed)
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    a, b, n = (torch.as_tensor(v, dtype=torch.float64).flatten() for v in (a, b, n))
    if not (a.shape == b.shape == n.shape):
        raise ValueError(f"a, b and n must have one entry per sequence, got {a.shape}, {b.shape}, {n.shape}")
    keep = n > 0
    a, b, n = a[keep], b[keep], n[keep]
    S = int(n.numel())
    if S == 0:
        raise ValueError("paired_bootstrap: no sequence has a scored token")
    d = a - b  # [S]
    mean = float(d.sum() / n.sum())
    if S == 1:
        return PairedDelta(mean, mean, mean, 1, int(n.sum()))
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, S, (n_boot, S), generator=g)  # [n_boot, S]
    stats = d[idx].sum(1) / n[idx].sum(1)  # [n_boot]
    q = torch.tensor([(1 - level) / 2, 1 - (1 - level) / 2], dtype=torch.float64)
    lo, hi = (float(v) for v in torch.quantile(stats, q))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("paired_bootstrap: non-finite losses")
    return PairedDelta(mean, lo, hi, S, int(n.sum()))


def lower_envelope(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the (ops, loss) points on the lower-left envelope, sorted by ops: each has a lower loss than every
    point at fewer or equal ops (a point dominated by a cheaper, better one is not on a frontier)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    keep: list[int] = []
    for i in order:
        if not keep or points[i][1] < points[keep[-1]][1]:
            keep.append(i)
    return keep


def log_interpolation_weights(xs: Sequence[float], x: float) -> dict[int, float]:
    """Weights on the points `xs` (positive, increasing) that interpolate at `x` linearly in log x between its two
    neighbours; beyond either end, the nearest point alone. The weights are >= 0 and sum to 1."""
    if not xs or any(v <= 0 for v in xs) or any(b <= a for a, b in zip(xs, xs[1:])) or not x > 0:
        raise ValueError(f"need increasing positive points and x > 0, got {list(xs)} and {x}")
    if x <= xs[0]:
        return {0: 1.0}
    if x >= xs[-1]:
        return {len(xs) - 1: 1.0}
    i = next(k for k in range(len(xs) - 1) if xs[k] <= x <= xs[k + 1])
    a = (math.log(x) - math.log(xs[i])) / (math.log(xs[i + 1]) - math.log(xs[i]))
    return {i: 1.0 - a, i + 1: a}


def gap_to_frontier(seq_loss: torch.Tensor, seq_n: torch.Tensor, frontier: dict[str, tuple[float, torch.Tensor]],
                    ops: float, n_boot: int = N_BOOT, seed: int = 0) -> dict[str, Any]:
    """A row's per-sequence loss `[S]` minus the frontier's at `ops`: `frontier` maps each envelope point (increasing
    ops) to (its ops, its per-sequence loss `[S]` on the same tokens), interpolated linearly in log ops
    (`log_interpolation_weights`). Returns the paired interval's dict with its `verdict` and the weights (`at`)."""
    names = list(frontier)
    w = log_interpolation_weights([frontier[n][0] for n in names], ops)
    ref = sum(wt * frontier[names[i]][1] for i, wt in w.items())
    d = paired_bootstrap(seq_loss, ref, seq_n, n_boot, seed)
    return d.to_dict() | {"verdict": d.verdict, "at": {names[i]: wt for i, wt in w.items()}}
