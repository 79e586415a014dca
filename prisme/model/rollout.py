"""The workspace's two rollouts over every query position of an encoded context: forced actions (STOP absorbing) and
the deployed controller (with the router at step 0 on a router model). `PrismeModel.run_workspace` runs one of them and
reads out; training, evaluation and every decode plan reach them through it or call them with the router's decision
already taken (`first`).

Notation: B rows, Tq query positions, M slots, A actions, R steps.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.checks import check_number
from prisme.model.outputs import EncodedContext, Rollout
from prisme.model.workspace import absorb_stop


def rollout_forced(model: nn.Module, ctx: EncodedContext, actions: torch.Tensor,
                   budget: torch.Tensor | None = None) -> Rollout:
    """Apply forced actions `[B, Tq, R]` (STOP absorbing); budget `[B, Tq]` (default R) drives `remaining`."""
    cfg = model.cfg
    B, Tq, R = actions.shape
    actions = absorb_stop(actions, cfg.stop_action)
    if budget is None:
        budget = torch.full((B, Tq), R, dtype=torch.long, device=actions.device)
    S, slot_kv = ctx.S0, model.new_slot_kv(ctx.S0)
    infos = []
    for r in range(R):
        a = actions[:, :, r]
        S, info = model.apply_action(S, ctx, a, r, (budget - r - 1).clamp(min=0), slot_kv)
        slot_kv = info.slot_kv
        infos.append(info)
    n_edits = (actions != cfg.stop_action).sum(-1)
    return Rollout(S, actions, n_edits, torch.zeros_like(n_edits), infos)


def rollout_policy(model: nn.Module, ctx: EncodedContext, max_budget: int, cost: torch.Tensor,
                   lambda_cost: float | None = None, kappa_risk: float | None = None,
                   on_step: object | None = None, first: torch.Tensor | None = None) -> Rollout:
    """Run the controller loop at every position in parallel: score, select, edit, until STOP or the budget.

    With `cfg.router`, the router decides step 0 at every position (an action or STOP) and the controller runs
    only at the positions still editing from step 1 on; `controller_steps` counts the controller's evaluations.
    `first` `[B, Tq]`: the router's step-0 decision, already taken (decoding: `prisme.model.routed`).
    """
    cfg = model.cfg
    B, Tq = ctx.z.shape[:2]
    dev = ctx.z.device
    stop = cfg.stop_action
    S, slot_kv = ctx.S0, model.new_slot_kv(ctx.S0)
    stopped = torch.zeros(B, Tq, dtype=torch.bool, device=dev)
    edits = torch.zeros(B, Tq, cfg.n_slots, dtype=torch.long, device=dev)
    taken = torch.zeros(B, Tq, cfg.n_actions, dtype=torch.bool, device=dev)
    trace = torch.full((B, Tq, max_budget), stop, dtype=torch.long, device=dev)
    ctrl_steps = torch.zeros(B, Tq, dtype=torch.long, device=dev)
    budget = torch.full((B, Tq), max_budget, dtype=torch.long, device=dev)
    routed = cfg.router
    lambda_cost, kappa_risk = model.default_price.fill(lambda_cost, kappa_risk)
    if routed and first is None:  # step 0: the router at every position, nothing else
        lam = check_number("lambda_cost", lambda_cost, lo=0)
        first = model.router.select(model.router_values(ctx), cost, lam)  # [B, Tq]
    infos = []
    zc = match = None
    for r in range(max_budget):
        if routed and r == 0:
            a = first
        else:
            b, t = torch.nonzero(~stopped, as_tuple=True)  # only positions still deciding
            if b.numel() == 0:
                break
            if zc is None:  # [B, Tq, w], [B, Tq, 2] or None: read once, where the controller runs at all
                zc, match = model.controller_inputs(ctx)
            step = torch.full_like(b, r)
            preds = model.controller(zc[b, t], S[b, t], ctx.S0[b, t], edits[b, t], taken[b, t], step,
                                    budget[b, t], None if match is None else match[b, t])
            chosen = model.controller.select(preds, cost, lambda_cost, kappa_risk)  # [N]
            a = torch.full((B, Tq), stop, dtype=torch.long, device=dev).index_put((b, t), chosen)
            ctrl_steps[b, t] += 1
        trace[:, :, r] = a
        if r + 1 < max_budget:
            stopped = stopped | (a == stop)
        if on_step is not None:
            on_step(r, a)
        S, info = model.apply_action(S, ctx, a, r, max_budget - r - 1, slot_kv)
        slot_kv = info.slot_kv
        infos.append(info)
        if r + 1 < max_budget:  # what the controller reads at the next step (the last step has none)
            edits = edits + model.action_slot_counts[a]
            taken = taken | F.one_hot(a, cfg.dense_action + 1)[..., : cfg.n_actions].bool()
    n_edits = (trace != stop).sum(-1)
    return Rollout(S, trace, n_edits, ctrl_steps, infos)
