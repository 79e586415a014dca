"""The oracle's shared pieces: the one next-token cross-entropy helper, and the candidate step that executes every
action at every query position at once and reads each candidate's true loss (it reads the targets: used by the
evaluation's greedy oracle and by the controller stage's regression targets, never by a deployed controller).

Notation: B rows, P query positions, A candidate actions, M slots, w width, V vocab.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from prisme.data.text import IGNORE_INDEX
from prisme.model.outputs import EncodedContext


def token_ce(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "none", float32: bool = False
             ) -> torch.Tensor:
    """Next-token cross-entropy of logits `[..., V]` against targets `[...]`, -100 (IGNORE_INDEX) unscored: per
    position `[...]` (0 where unscored) with `reduction="none"`, else their sum. Half-precision logits are upcast to
    float32; float64 is kept (evaluation compares in it), unless `float32` (the training losses' convention)."""
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    if float32 or flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    ce = F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction=reduction)
    return ce.view(targets.shape) if reduction == "none" else ce


def repeat_queries(ctx: EncodedContext, A: int) -> EncodedContext:
    """`ctx` with each of its P query positions repeated A times (`[B, P A, ...]`, candidate a of position p at
    index p A + a), sharing the bank: the layout `candidate_losses` runs on."""
    def rep(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(A, dim=1)

    return dataclasses.replace(ctx, H=rep(ctx.H), z=rep(ctx.z), S0=rep(ctx.S0), bank_mask=rep(ctx.bank_mask),
                               ctrl_in=None, router_seen=None if ctx.router_seen is None else rep(ctx.router_seen),
                               router_tok=None if ctx.router_tok is None else rep(ctx.router_tok),
                               copy=None if ctx.copy is None else dataclasses.replace(ctx.copy, L=rep(ctx.copy.L),
                                                                                      pos=rep(ctx.copy.pos)))


def candidate_losses(model: torch.nn.Module, S: torch.Tensor, ctx_c: EncodedContext, actions: torch.Tensor,
                     at: tuple[int, int | torch.Tensor], targets: torch.Tensor, edited: torch.Tensor | None = None,
                     float32: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply candidate `actions` `[B, P A]` to the workspace S `[B, P, M, w]` (each position's state repeated A
    times) on the repeated context `ctx_c` (`repeat_queries`) at `at` = (step, remaining budget), and score each
    against `targets` `[B, P]`.

    `edited` `[B, P A]` marks the candidates whose logits go through the readout (default: all); `float32` as in
    `token_ce`. Returns
    (S_c `[B, P A, M, w]`, logits_c `[B, P A, V]`, loss_c `[B, P, A]`).
    """
    B, P = targets.shape
    A = actions.shape[1] // P
    S_c, _ = model.apply_action(S.repeat_interleave(A, dim=1), ctx_c, actions, *at)
    logits_c, _ = model.logits_from_state(S_c, ctx_c, edited)
    loss_c = token_ce(logits_c, targets.repeat_interleave(A, dim=1), float32=float32).view(B, P, A)
    return S_c, logits_c, loss_c
