"""Zoology-style slices of the scored positions: where an n-gram lookup could supply the target, and where not.

A labelled position t (target y_t, the token after x_t) is an **AR hit** when the n tokens ending at it occurred
earlier in the window and were followed there by y_t; a **seen miss** when they occurred earlier but were always
followed by another token; **other** otherwise (including the first n - 1 positions). Each row of an evaluation
(`evaluate_policies(..., slices=n)`) reports, per slice, its loss, its gain over the backbone and that gain's share of
the row's whole gain, and its edits per position.

With an attention window W (`slice_labels(..., window=W)`), AR hits split by where the earlier occurrence lies:
**within the window** when some occurrence followed by y_t lies whole inside positions t - W + 1 .. t (its n tokens
and the token after them: what a local model attending to W positions can copy), **beyond it** when every such
occurrence starts earlier (what only a model that reads farther back can copy).

**Copy distance.** An occurrence whose n-gram ends at j < t lies d = t - j + n positions back: the window a model
needs to see it whole, from its first token to t. An AR hit's distance is its nearest occurrence's (the smallest d).
With bucket edges (`window=(W, e_1, .., e_k)`, increasing) the AR hits split by that distance: within the window
(d <= W, "ar_hit_in_window"), then one slice per bucket e_{i-1} < d <= e_i ("ar_hit_<lo>_<hi>"), then d > e_k
("ar_hit_beyond_<e_k>"); `window=W` is the one-edge case ("ar_hit_beyond_window"). Every slice after the first
AR-hit slice is beyond the window (`beyond_window_names`; `merge_slices` adds their reports into one).

**Capture** (`capture`): the loss a PRISME row removes on the beyond-window slice relative to its own backbone, as a
share of what a global-attention model removes there relative to its window twin (the same model with PRISME's
window). Undefined (None, with the reason) where the global model removes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from prisme.checks import is_int
from prisme.data.text import IGNORE_INDEX
from prisme.stats import LEVEL, N_BOOT, check_bootstrap_args

AR_SLICES = ("ar_hit", "seen_miss", "other")
WINDOW_SLICES = ("ar_hit_in_window", "ar_hit_beyond_window", "seen_miss", "other")


def slice_edges(window: int | Sequence[int] | None) -> tuple[int, ...] | None:
    """A window W or bucket edges (W, e_1, ..) as a tuple of ints (None stays None); ValueError unless every edge is
    an int >= 1 and they increase."""
    if window is None:
        return None
    edges = (window,) if is_int(window) else tuple(window) if isinstance(window, (tuple, list)) else ()
    if not edges or not all(is_int(e) and e >= 1 for e in edges) or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"slices: the window must be an int >= 1, or increasing bucket edges (window, e_1, ..) of "
                         f"ints >= 1, got {window!r}")
    return edges


def slice_names(window: int | Sequence[int] | None) -> tuple[str, ...]:
    """The slices of `ar_slice_labels` in label order: `AR_SLICES`; with a window `WINDOW_SLICES`; with bucket edges
    (W, e_1, .., e_k) the AR hits in the window, each bucket, beyond e_k, then the seen misses and the rest."""
    edges = slice_edges(window)
    if edges is None:
        return AR_SLICES
    if len(edges) == 1:
        return WINDOW_SLICES
    buckets = tuple(f"ar_hit_{lo}_{hi}" for lo, hi in zip(edges, edges[1:]))
    return ("ar_hit_in_window", *buckets, f"ar_hit_beyond_{edges[-1]}", "seen_miss", "other")


def beyond_window_names(names: Sequence[str]) -> tuple[str, ...]:
    """The slices (of `slice_names`) whose AR hits lie beyond the window: every AR-hit slice after the first."""
    hits = [k for k in names if k.startswith("ar_hit")]
    return tuple(hits[1:]) if "ar_hit_in_window" in hits else ()


def ar_slice_labels(x: torch.Tensor, y: torch.Tensor, n: int, window: int | Sequence[int] | None = None
                    ) -> torch.Tensor:
    """Each position's slice `[B, T]`: 0 AR hit, 1 seen miss, 2 other, -1 where there is no target; with a `window`
    W: 0 AR hit within the window, 1 AR hit beyond it, 2 seen miss, 3 other; with bucket edges (W, e_1, .., e_k):
    0 within the window, i for e_{i-1} < d <= e_i, k + 1 beyond e_k, then seen miss and other (module docstring)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"slices: the n-gram length must be an int >= 1, got {n!r}")
    B, T = x.shape
    x = x.long()
    gram = torch.zeros(B, T, dtype=torch.float64, device=x.device)  # the n-gram ending at t as one exact number
    base = float(int(x.max()) + 1) if x.numel() else 1.0
    for k in range(n):
        gram = gram * base + torch.nn.functional.pad(x, (k, 0), value=0)[:, :T].double()
    t = torch.arange(T, device=x.device)
    gram = torch.where(t >= n - 1, gram, -1.0 - t.double())  # incomplete n-grams match nothing
    if n * math.log2(base) >= 53:  # beyond float64's exact integers: compare the n tokens themselves
        win = torch.stack([torch.nn.functional.pad(x, (k, 0), value=-1)[:, :T] for k in range(n)], -1)  # [B, T, n]
        same = (win[:, :, None] == win[:, None, :]).all(-1) & (t >= n - 1)[None, :, None]
    else:
        same = gram[:, :, None] == gram[:, None, :]  # [B, t, j]
    earlier = same & (t[None, :] < t[:, None])  # j < t
    nxt = torch.nn.functional.pad(x[:, 1:], (0, 1), value=-1)  # [B, T] the token after j, inside the window
    hits = earlier & (nxt[:, None, :] == y[:, :, None])  # [B, t, j]
    hit = hits.any(-1)
    if window is None:
        labels = torch.where(hit, 0, torch.where(earlier.any(-1), 1, 2))
    else:
        edges = torch.tensor(slice_edges(window), device=x.device)
        last = T - 1 - hits.flip(-1).to(torch.uint8).argmax(-1)  # [B, T] the nearest hit's j (any j where none)
        bucket = torch.bucketize(t - last + n, edges)  # [B, T] the copy distance's bucket: d <= W -> 0
        k = len(edges)
        labels = torch.where(hit, bucket, torch.where(earlier.any(-1), k + 1, k + 2))
    return labels.masked_fill(y == IGNORE_INDEX, -1)


@dataclass
class SliceSums:
    """One row's sums per slice (`names`): its CE, the backbone's CE on the same targets, targets, and edits."""

    stop_action: int | None = None
    names: tuple[str, ...] = AR_SLICES
    loss: torch.Tensor = field(init=False)
    base: torch.Tensor = field(init=False)
    n: torch.Tensor = field(init=False)
    edits: torch.Tensor = field(init=False)
    traced: bool = False

    def __post_init__(self) -> None:
        k = len(self.names)
        self.loss, self.base, self.n, self.edits = (torch.zeros(k, dtype=torch.float64) for _ in range(4))

    def add(self, labels: torch.Tensor, ce: torch.Tensor, base_ce: torch.Tensor | None) -> None:
        """Labels, CE and the backbone's CE `[B, T]` (CE 0 where there is no target)."""
        lab = labels.flatten().cpu()
        keep = lab >= 0
        idx = lab[keep]
        k = len(self.names)
        self.loss += torch.zeros(k, dtype=torch.float64).index_add_(0, idx, ce.flatten().cpu().double()[keep])
        self.n += torch.bincount(idx, minlength=k).double()
        if base_ce is not None:
            self.base += torch.zeros(k, dtype=torch.float64).index_add_(0, idx,
                                                                        base_ce.flatten().cpu().double()[keep])

    def add_edits(self, labels: torch.Tensor, actions: torch.Tensor) -> None:
        """A full-position trace `[B, T, R]`: its edits per scored position, by slice."""
        lab = labels.flatten().cpu()
        keep = lab >= 0
        n_edits = (actions != self.stop_action).sum(-1).flatten().cpu().double()[keep]
        self.edits += torch.zeros(len(self.names), dtype=torch.float64).index_add_(0, lab[keep], n_edits)
        self.traced = True

    def report(self) -> dict[str, Any]:
        """Per slice: share of the targets, loss, gain over the backbone (nats/token), share of the row's whole gain
        (summed over tokens), edits per position (None for a row without a trace)."""
        gain = self.base - self.loss  # summed over the slice's targets
        total = float(gain.sum())
        out = {}
        for i, name in enumerate(self.names):
            n = float(self.n[i])
            out[name] = {"share_of_targets": n / max(float(self.n.sum()), 1.0),
                         "loss": float(self.loss[i]) / n if n else None,
                         "gain_over_backbone": float(gain[i]) / n if n else None,
                         "share_of_gain": float(gain[i]) / total if total else None,
                         "edits_per_position": float(self.edits[i]) / n if n and self.traced else None}
        return out


def merge_slices(report: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """Several slices of one row's `SliceSums.report()` as one: their share of the targets, and their loss and gain
    over the backbone weighted by their targets (None where they hold no target or a slice has none)."""
    share = sum(report[k]["share_of_targets"] for k in names)
    out: dict[str, Any] = {"share_of_targets": share}
    for key in ("loss", "gain_over_backbone"):
        held = [k for k in names if report[k]["share_of_targets"] > 0]
        vals = [report[k][key] for k in held]
        out[key] = (sum(report[k]["share_of_targets"] * v for k, v in zip(held, vals)) / share
                    if held and all(v is not None for v in vals) else None)
    return out


@dataclass(frozen=True)
class Capture:
    """A row's capture of the far-copy gain (module docstring), nats per token on the beyond-window slice.

    removed: its backbone's loss minus the row's; global_removed: the window twin's loss minus the global model's;
    value: removed / global_removed, None (with `undefined`, the reason) where the global model removes nothing."""

    removed: float
    global_removed: float
    value: float | None
    undefined: str | None = None
    lo: float | None = None  # a bootstrap interval over sequences (`capture_interval`), where one was computed
    hi: float | None = None

    def fmt(self) -> str:
        """`37.5%`, `37.5% [20.1%, 51.0%]`, or `undefined`."""
        if self.value is None:
            return "undefined"
        ci = f" [{self.lo:.1%}, {self.hi:.1%}]" if self.lo is not None and self.hi is not None else ""
        return f"{self.value:.1%}{ci}"


NOTHING_REMOVED = 1e-9  # a global model whose gain over its window twin is at most this removes nothing


def capture(row: float, backbone: float, global_model: float, window_twin: float) -> Capture:
    """Capture from the four losses on the beyond-window slice (nats per token): a PRISME row and its own backbone,
    a global-attention model and its window twin. Undefined where the twin's loss minus the global's is <= 1e-9."""
    removed, global_removed = backbone - row, window_twin - global_model
    if not all(math.isfinite(v) for v in (removed, global_removed)):
        raise ValueError(f"capture: losses must be finite, got row={row}, backbone={backbone}, "
                         f"global={global_model}, window twin={window_twin}")
    if global_removed <= NOTHING_REMOVED:
        return Capture(removed, global_removed, None, f"the global model removes nothing beyond the window "
                                                      f"(window twin minus global = {global_removed:+.4f})")
    return Capture(removed, global_removed, removed / global_removed)


def capture_interval(row: Any, backbone: Any, global_model: Any, window_twin: Any, n: Any, n_boot: int = N_BOOT,
                     seed: int = 0, level: float = LEVEL) -> Capture:
    """Capture with a percentile bootstrap interval over sequences, all four models scored on the same targets.

    Args:
        row, backbone, global_model, window_twin: `[S]` each sequence's summed loss on the beyond-window slice.
        n: `[S]` each sequence's targets in that slice (sequences with none are dropped).
    The estimate is sum(backbone - row) / sum(window_twin - global) (the token-weighted means' ratio); the interval
    resamples sequences (`stats.paired_bootstrap`'s scheme) and is left undefined (lo = hi = None) when a resample's
    global model removes nothing."""
    check_bootstrap_args(n_boot, seed)
    vals = [torch.as_tensor(v, dtype=torch.float64).flatten() for v in (row, backbone, global_model, window_twin, n)]
    if len({v.shape for v in vals}) != 1:
        raise ValueError(f"capture_interval: one entry per sequence in every input, got {[v.shape for v in vals]}")
    keep = vals[4] > 0
    r, b, g, w, cnt = (v[keep] for v in vals)
    if cnt.numel() == 0:
        raise ValueError("capture_interval: no sequence has a target in the slice")
    tot = float(cnt.sum())
    point = capture(float(r.sum()) / tot, float(b.sum()) / tot, float(g.sum()) / tot, float(w.sum()) / tot)
    if point.value is None:
        return point
    idx = torch.randint(0, cnt.numel(), (n_boot, cnt.numel()), generator=torch.Generator().manual_seed(seed))
    num, den = (b - r)[idx].sum(1), (w - g)[idx].sum(1)  # [n_boot]
    if bool((den <= NOTHING_REMOVED * cnt[idx].sum(1)).any()):
        return Capture(point.removed, point.global_removed, point.value, None)
    q = torch.tensor([(1 - level) / 2, 1 - (1 - level) / 2], dtype=torch.float64)
    lo, hi = (float(v) for v in torch.quantile(num / den, q))
    return Capture(point.removed, point.global_removed, point.value, None, lo, hi)
