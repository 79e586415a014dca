"""The workspace's two rollouts over every query position of an encoded context, each taking the checked policy
(`prisme.model.policy.StepPolicy`): forced actions (STOP absorbing) and the deployed controller (with the router at
step 0 on a router model). `rollout` runs the one the policy asks for; `PrismeModel.run_workspace` runs it and reads
out, and the decode plans call it with the router's decision already taken (`first`). `run` says how the editor's
passes run (`prisme.model.editor.EditorRun`; None: the model's own).

Notation: B rows, Tq query positions, M slots, A actions, R steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.model.editor import EditorRun
from prisme.model.outputs import EncodedContext, Rollout
from prisme.model.policy import StepPolicy
from prisme.model.workspace import absorb_stop


def rollout(model: nn.Module, ctx: EncodedContext, ws: StepPolicy, run: EditorRun | None = None,
            first: torch.Tensor | None = None) -> Rollout:
    """The rollout `ws` asks for: its forced actions, or its controller (`first`: the router's step 0, taken)."""
    if ws.actions is not None:
        return rollout_forced(model, ctx, ws, run)
    return rollout_policy(model, ctx, ws, run, first)


def rollout_forced(model: nn.Module, ctx: EncodedContext, ws: StepPolicy, run: EditorRun | None = None) -> Rollout:
    """Apply the forced actions `ws.actions` `[B, Tq, R]` (STOP absorbing); their budget `[B, Tq]` drives
    `remaining`."""
    cfg = model.cfg
    B, Tq, R = ws.actions.shape
    actions = absorb_stop(ws.actions, cfg.stop_action)
    budget = ws.budget if ws.budget is not None else torch.full((B, Tq), R, dtype=torch.long,
                                                                 device=actions.device)
    S, slot_kv = ctx.S0, model.new_slot_kv(ctx.S0, run)
    infos = []
    for r in range(R):
        S, info = model.apply_action(S, ctx, actions[:, :, r], r, (budget - r - 1).clamp(min=0), slot_kv, run)
        slot_kv = info.slot_kv
        infos.append(info)
    n_edits = (actions != cfg.stop_action).sum(-1)
    return Rollout(S, actions, n_edits, torch.zeros_like(n_edits), infos)


def rollout_policy(model: nn.Module, ctx: EncodedContext, ws: StepPolicy, run: EditorRun | None = None,
                   first: torch.Tensor | None = None,
                   on_step: Callable[[int, torch.Tensor], None] | None = None) -> Rollout:
    """Run the controller loop at every position in parallel: score, select, edit, until STOP or the budget
    (`ws.max_budget`, at its price `ws.lambda_cost`, `ws.kappa_risk` and cost vector `ws.cost`).

    With `cfg.router`, the router decides step 0 at every position (an action or STOP) and the controller runs
    only at the positions still editing from step 1 on; `controller_steps` counts the controller's evaluations.
    `first` `[B, Tq]`: the router's step-0 decision, already taken (decoding: `prisme.model.plans`).
    `on_step(r, actions)`: called with each step's actions `[B, Tq]`.
    """
    cfg = model.cfg
    max_budget, cost, lambda_cost, kappa_risk = ws.max_budget, ws.cost, ws.lambda_cost, ws.kappa_risk
    B, Tq = ctx.z.shape[:2]
    dev = ctx.z.device
    stop = cfg.stop_action
    S, slot_kv = ctx.S0, model.new_slot_kv(ctx.S0, run)
    stopped = torch.zeros(B, Tq, dtype=torch.bool, device=dev)
    edits = torch.zeros(B, Tq, cfg.n_slots, dtype=torch.long, device=dev)
    taken = torch.zeros(B, Tq, cfg.n_actions, dtype=torch.bool, device=dev)
    trace = torch.full((B, Tq, max_budget), stop, dtype=torch.long, device=dev)
    ctrl_steps = torch.zeros(B, Tq, dtype=torch.long, device=dev)
    budget = torch.full((B, Tq), max_budget, dtype=torch.long, device=dev)
    routed = cfg.router
    if routed and first is None:  # step 0: the router at every position, nothing else
        first = model.router.select(model.router_values(ctx), cost, lambda_cost)  # [B, Tq]
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
        S, info = model.apply_action(S, ctx, a, r, max_budget - r - 1, slot_kv, run)
        slot_kv = info.slot_kv
        infos.append(info)
        if r + 1 < max_budget:  # what the controller reads at the next step (the last step has none)
            edits = edits + model.action_slot_counts[a]
            taken = taken | F.one_hot(a, cfg.dense_action + 1)[..., : cfg.n_actions].bool()
    n_edits = (trace != stop).sum(-1)
    return Rollout(S, trace, n_edits, ctrl_steps, infos)
