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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from prisme.data.text import IGNORE_INDEX

AR_SLICES = ("ar_hit", "seen_miss", "other")
WINDOW_SLICES = ("ar_hit_in_window", "ar_hit_beyond_window", "seen_miss", "other")


def slice_names(window: int | None) -> tuple[str, ...]:
    """The slices of `ar_slice_labels` (`AR_SLICES`), or with a window `WINDOW_SLICES`, in label order."""
    return AR_SLICES if window is None else WINDOW_SLICES


def ar_slice_labels(x: torch.Tensor, y: torch.Tensor, n: int, window: int | None = None) -> torch.Tensor:
    """Each position's slice `[B, T]`: 0 AR hit, 1 seen miss, 2 other, -1 where there is no target; with a `window`
    W: 0 AR hit within the window, 1 AR hit beyond it, 2 seen miss, 3 other (module docstring)."""
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
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"slices: the window must be an int >= 1, got {window!r}")
        inside = t[None, :] - n + 1 >= t[:, None] - window + 1  # [t, j]: j's n-gram starts inside t's window
        near = (hits & inside).any(-1)
        labels = torch.where(near, 0, torch.where(hit, 1, torch.where(earlier.any(-1), 2, 3)))
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
