"""Zoology-style slices of the scored positions: where an n-gram lookup could supply the target, and where not.

A labelled position t (target y_t, the token after x_t) is an **AR hit** when the n tokens ending at it occurred
earlier in the window and were followed there by y_t; a **seen miss** when they occurred earlier but were always
followed by another token; **other** otherwise (including the first n - 1 positions). Each row of an evaluation
(`evaluate_policies(..., slices=n)`) reports, per slice, its loss, its gain over the backbone and that gain's share of
the row's whole gain, and its edits per position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from prisme.data.text import IGNORE_INDEX

AR_SLICES = ("ar_hit", "seen_miss", "other")


def ar_slice_labels(x: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    """Each position's slice `[B, T]`: 0 AR hit, 1 seen miss, 2 other, -1 where there is no target."""
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
    hit = (earlier & (nxt[:, None, :] == y[:, :, None])).any(-1)
    labels = torch.where(hit, 0, torch.where(earlier.any(-1), 1, 2))
    return labels.masked_fill(y == IGNORE_INDEX, -1)


@dataclass
class SliceSums:
    """One row's sums per slice: its CE, the backbone's CE on the same targets, targets, and edits."""

    stop_action: int | None = None
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    base: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    n: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    edits: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    traced: bool = False

    def add(self, labels: torch.Tensor, ce: torch.Tensor, base_ce: torch.Tensor | None) -> None:
        """Labels, CE and the backbone's CE `[B, T]` (CE 0 where there is no target)."""
        lab = labels.flatten().cpu()
        keep = lab >= 0
        idx = lab[keep]
        self.loss += torch.zeros(3, dtype=torch.float64).index_add_(0, idx, ce.flatten().cpu().double()[keep])
        self.n += torch.bincount(idx, minlength=3).double()
        if base_ce is not None:
            self.base += torch.zeros(3, dtype=torch.float64).index_add_(0, idx,
                                                                        base_ce.flatten().cpu().double()[keep])

    def add_edits(self, labels: torch.Tensor, actions: torch.Tensor) -> None:
        """A full-position trace `[B, T, R]`: its edits per scored position, by slice."""
        lab = labels.flatten().cpu()
        keep = lab >= 0
        n_edits = (actions != self.stop_action).sum(-1).flatten().cpu().double()[keep]
        self.edits += torch.zeros(3, dtype=torch.float64).index_add_(0, lab[keep], n_edits)
        self.traced = True

    def report(self) -> dict[str, Any]:
        """Per slice: share of the targets, loss, gain over the backbone (nats/token), share of the row's whole gain
        (summed over tokens), edits per position (None for a row without a trace)."""
        gain = self.base - self.loss  # summed over the slice's targets
        total = float(gain.sum())
        out = {}
        for i, name in enumerate(AR_SLICES):
            n = float(self.n[i])
            out[name] = {"share_of_targets": n / max(float(self.n.sum()), 1.0),
                         "loss": float(self.loss[i]) / n if n else None,
                         "gain_over_backbone": float(gain[i]) / n if n else None,
                         "share_of_gain": float(gain[i]) / total if total else None,
                         "edits_per_position": float(self.edits[i]) / n if n and self.traced else None}
        return out
