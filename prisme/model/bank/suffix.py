"""Exact suffix matches: for every position, how far the tokens ending there agree with those ending at each earlier
position, and what followed the earlier ones. The copy read's keys (`prisme.model.copy`) need no learning.

Notation: B rows, T positions, t a query position, j an earlier position (j < t), x the token ids, cap the longest
length counted (`MAX_MATCH`).

    L[t, j] = the largest m <= cap with x[t - i] == x[j - i] for i = 0 .. m - 1      (0 for j >= t)

so position j "matches" t over L[t, j] tokens and proposes x[j + 1], the token that followed it (j + 1 <= t: it is in
the context). The lengths follow one recurrence along each diagonal, L[t, j] = [x_t == x_j] (1 + L[t-1, j-1]), which
is what a decode step updates: one comparison and one add per earlier position (`step_lengths`), no weights, the
cost of the router's n-gram cue (`prisme.model.router`).

Distance. A match of an n-gram ending at j lies d = t - j + n positions back (the window that holds it whole: the
convention of `prisme.evaluation.slices`); `far_from(t, j, W, n)` is d > W.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prisme.config import MAX_MATCH  # the longest common suffix counted (longer ones read as this)


def match_lengths(ids: torch.Tensor, cap: int = MAX_MATCH) -> torch.Tensor:
    """The common-suffix lengths `L` `[B, T, T]` (uint8) of every query t and earlier position j (module docstring);
    0 where j >= t.

    Args:
        ids: `[B, T]` token ids.
        cap: the longest length counted, 1..255.
    """
    if ids.dim() != 2:
        raise ValueError(f"match_lengths: ids must be [B, T], got shape {tuple(ids.shape)}")
    if not 1 <= cap <= 255:
        raise ValueError(f"match_lengths: cap must lie in [1, 255], got {cap}")
    B, T = ids.shape
    eq = ids[:, :, None] == ids[:, None, :]  # [B, T, T]: x_t == x_j
    eq &= torch.ones(T, T, dtype=torch.bool, device=ids.device).tril(-1)  # j < t only
    L = eq.to(torch.uint8)  # [B, T, T]
    alive = eq.clone()
    for i in range(1, min(cap, T)):
        alive[:, i:, i:] &= eq[:, :-i, :-i]  # x_{t-i} == x_{j-i} as well
        alive[:, :i] = False
        alive[:, :, :i] = False
        if not bool(alive.any()):
            break
        L += alive
    return L


def step_lengths(prev: torch.Tensor, ids: torch.Tensor, t: int, cap: int = MAX_MATCH) -> torch.Tensor:
    """The lengths of query t `[B, t]` from those of query t - 1 (`prev` `[B, t - 1]`, ignored at t = 0) and the ids
    `[B, >= t + 1]`: L[t, j] = [x_t == x_j] min(1 + L[t-1, j-1], cap) for j < t (j = 0: [x_t == x_0])."""
    eq = ids[:, :t] == ids[:, t:t + 1]  # [B, t]
    L = torch.ones_like(eq, dtype=torch.uint8)
    if t > 1:
        L[:, 1:] += prev[:, :t - 1].clamp(max=cap - 1)
    return L * eq


def query_lengths(ids: torch.Tensor, pos: torch.Tensor, cap: int = MAX_MATCH) -> torch.Tensor:
    """The lengths `[B, Q, Tb]` (uint8) of queries at `pos` `[B, Q]` against every position of their rows' contexts
    `ids` `[B, Tb]` (0 for j >= the query's position): `match_lengths(ids)[rows, pos]` without the other queries'
    rows (a decode step's queries; a chunk's)."""
    B, Tb = ids.shape
    j = torch.arange(Tb, device=ids.device)
    alive = (ids.unsqueeze(1) == ids.gather(1, pos).unsqueeze(-1)) & (j < pos.unsqueeze(-1))  # [B, Q, Tb]
    L = alive.to(torch.uint8)
    for m in range(1, min(cap, Tb)):
        if not bool(alive.any()):
            break
        before = F.pad(ids, (m, 0), value=-1)[:, :Tb]  # [B, Tb]: x[j - m] (-1 before position 0)
        q = ids.gather(1, (pos - m).clamp(min=0)).masked_fill(pos < m, -2)  # [B, Q]: x[t - m] (none before 0)
        alive &= before.unsqueeze(1) == q.unsqueeze(-1)
        L += alive
    return L


@dataclass(frozen=True)
class LongestMatch:
    """Each query's longest match among the positions a rule allows (`longest_match`), `[B, T]` each.

    length: its length (0: no position matches); source: the most recent j of that length (-1: none); copy: x[j + 1],
    the token it proposes (-1: none); count: how many allowed positions match at that length."""

    length: torch.Tensor
    source: torch.Tensor
    copy: torch.Tensor
    count: torch.Tensor


def allowed(T: int, beyond: int | None, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """`[T, T]` bool: the pairs (t, j < t) a read may copy from, every earlier position, or with `beyond` = W those
    whose n-gram lies beyond a W-position window, t - j + n > W."""
    t = torch.arange(T, device=device)
    ok = t[None, :] < t[:, None]
    if beyond is not None:
        ok &= (t[:, None] - t[None, :] + n) > beyond
    return ok


def longest_match(L: torch.Tensor, ids: torch.Tensor, min_len: int = 1, beyond: int | None = None, n: int = 4
                  ) -> LongestMatch:
    """The longest match of each query (at least `min_len` tokens) among the earlier positions, or with `beyond` = W
    those whose n-gram lies beyond a W-position window (`allowed`); ties go to the most recent position.

    Args:
        L: `[B, T, T]` lengths (`match_lengths`); ids: `[B, T]` the token ids they were computed from.
    """
    B, T = ids.shape
    Lm = L.masked_fill(~allowed(T, beyond, n, ids.device), 0) if beyond is not None else L  # [B, T, T]
    length = Lm.max(-1).values.long()  # [B, T]
    best = (Lm == length.to(Lm.dtype)[..., None]) & (length[..., None] > 0)  # [B, T, T]
    count = best.sum(-1)  # [B, T]
    src = T - 1 - best.flip(-1).to(torch.uint8).argmax(-1)  # [B, T]: the largest j of that length
    found = length >= min_len
    nxt = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-1)  # [B, T]: x[j + 1]
    source = torch.where(found, src, -1)
    copy = torch.where(found, nxt.gather(1, src), -1)
    return LongestMatch(torch.where(found, length, 0), source, copy, torch.where(found, count, 0))
