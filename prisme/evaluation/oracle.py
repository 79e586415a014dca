"""The greedy oracle: at sampled positions it tries every action, keeps the one whose edit lowers the true loss
most (it reads the targets), and stops when none helps or at lambda's price: an upper bound on allocation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prisme.checks import check_max_budget
from prisme.data.text import IGNORE_INDEX
from prisme.model.oracle import candidate_losses, repeat_queries, token_ce
from prisme.model.prisme import PrismeModel


# ---------------------------------------------------------------------------------------------------------- oracle
@dataclass
class OracleResult:
    """A greedy-oracle run on P positions per sequence."""

    positions: torch.Tensor  # [B, P] query positions t
    actions: torch.Tensor  # [B, P, R] chosen actions (STOP-padded)
    loss: torch.Tensor  # [B, P] loss after the chosen edits
    base_loss: torch.Tensor  # [B, P] backbone-only loss
    logits: torch.Tensor  # [B, P, V] final logits
    n_edits: torch.Tensor  # [B, P]


@torch.no_grad()
def greedy_oracle(model: PrismeModel, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
                  max_budget: int | None = None, lambda_cost: float = 0.0,
                  cost: torch.Tensor | None = None) -> OracleResult:
    """Greedy oracle at the query positions `[B, P]`, vectorised over positions and candidates.

    Each step applies every candidate action `0..A-1` to each still-active position (`model.apply_action` on a
    `[B, P*A]` query layout sharing the bank), reads the true loss of each candidate from `logits_from_state` and
    the targets, and keeps the candidate with the largest `drop - lambda * cost[a]`; a position STOPs (for good) when
    no candidate beats 0 (ties go to STOP, as `ValueController.select`). `remaining = max_budget - step - 1`, as in
    `forward_policy`. Uses the editor's reference path (no slot K/V cache): the same function, recomputed.

    Args:
        tokens, targets: `[B, T]`; targets at `positions` must be labelled (not -100).
        positions: `[B, P]` long query positions.
        max_budget: steps (default r_max); cost: `[A]` (default `model.action_cost`).
    """
    cfg = model.cfg
    R = cfg.r_max if max_budget is None else max_budget
    if not cfg.use_workspace:
        raise ValueError("greedy_oracle needs a model with a workspace (use_workspace=True)")
    if check_max_budget(R, cfg.r_max) < 1:
        raise ValueError(f"max_budget must be an int in [1, r_max={cfg.r_max}], got {R!r}")
    if not math.isfinite(lambda_cost) or lambda_cost < 0:
        raise ValueError(f"lambda_cost must be finite and >= 0, got {lambda_cost}")
    B, T = tokens.shape
    if positions.dim() != 2 or positions.shape[0] != B or positions.numel() == 0:
        raise ValueError(f"positions must be a non-empty [B={B}, P] tensor, got {tuple(positions.shape)}")
    if int(positions.min()) < 0 or int(positions.max()) >= T:
        raise ValueError(f"positions must lie in [0, {T})")
    rows = torch.arange(B, device=tokens.device).unsqueeze(1)  # [B, 1]
    y = targets[rows, positions]  # [B, P]
    if bool((y == IGNORE_INDEX).any()):
        raise ValueError("greedy_oracle: every position must have a labelled target (not -100)")
    cost = model.action_cost if cost is None else torch.as_tensor(cost).to(model.action_cost)
    A, stop, P = cfg.n_actions, cfg.stop_action, positions.shape[1]

    st = model.streams(tokens)  # H [B, T, d] and the source streams
    ctx = model.context_from_H(st, st.index(rows, positions), query_pos=positions)  # Tq = P
    logits = model.output(ctx.H, ctx.copy)  # [B, P, V]
    loss = token_ce(logits, y)  # [B, P]
    base = loss.clone()

    def rep(x: torch.Tensor) -> torch.Tensor:  # [B, P, ...] -> [B, P*A, ...], candidate a at index p*A + a
        return x.repeat_interleave(A, dim=1)

    ctx_c = repeat_queries(ctx, A)
    cand = torch.arange(A, device=tokens.device).repeat(B, P)  # [B, P*A]
    S = ctx.S0  # [B, P, M, w]
    active = torch.ones(B, P, dtype=torch.bool, device=tokens.device)
    trace = torch.full((B, P, R), stop, dtype=torch.long, device=tokens.device)
    p_idx = torch.arange(P, device=tokens.device) * A  # [P]
    for r in range(R):
        if not bool(active.any()):
            break
        act_c = rep(active)  # [B, P*A]
        a_c = torch.where(act_c, cand, torch.full_like(cand, stop))  # stopped positions run nothing
        S_c, logits_c, loss_c = candidate_losses(model, S, ctx_c, a_c, (r, R - r - 1), y, act_c)  # [B, P*A, ...]
        score = (loss.unsqueeze(-1) - loss_c) - lambda_cost * cost  # [B, P, A]
        best, a = score.max(dim=-1)  # [B, P]
        take = active & (best > 0)
        idx = p_idx + a  # [B, P] index of the chosen candidate
        S = torch.where(take[..., None, None], S_c[rows, idx], S)
        logits = torch.where(take[..., None], logits_c[rows, idx], logits)
        loss = torch.where(take, loss_c.gather(-1, a.unsqueeze(-1)).squeeze(-1), loss)
        trace[:, :, r] = torch.where(take, a, torch.full_like(a, stop))
        active = take
    n_edits = (trace != stop).sum(-1)
    return OracleResult(positions=positions, actions=trace, loss=loss, base_loss=base, logits=logits,
                        n_edits=n_edits)
