"""The cost of actual traces (SPEC §6): ops of evaluated or generated positions under the actions they took, each
position at its own context, priced by the analytic terms of `prisme.costs.analytic`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from prisme.config import PrismeConfig
from prisme.costs.analytic import components, finish_row, token_ops
from prisme.costs.bank import bank_ops
from prisme.options import PROJECTED, DecodeOptions


@dataclass
class TraceCost:
    """Ops of a batch of generated/evaluated positions under an actual action trace."""

    total_ops: float  # summed over positions
    n_positions: int
    backbone_ops: float  # what the backbone alone would have cost on the same positions
    by_component: dict[str, float] = field(default_factory=dict)  # summed over positions

    @property
    def ops_per_token(self) -> float:
        return self.total_ops / max(self.n_positions, 1)

    @property
    def relative(self) -> float:
        """Total ops over the backbone-only ops of the same positions."""
        return self.total_ops / max(self.backbone_ops, 1.0)

    @property
    def per_token_by_component(self) -> dict[str, float]:
        return {c: v / max(self.n_positions, 1) for c, v in self.by_component.items()}


def trace_cost(cfg: PrismeConfig, actions: Any, contexts: Any, controller_steps: Any = None,
               optimised: bool | str = False, router: bool = False, decode: DecodeOptions = PROJECTED) -> TraceCost:
    """Cost of actual traces by SPEC §6's rules.

    Args:
        actions: `[N, R]` (or `[..., R]` matching `contexts`) action ids per position (STOP = A, absorbing: steps
            after the first STOP are not charged; DENSE = A + 1); None or R == 0 for the backbone alone.
        contexts: `[N]` context length of each position: t + 1 (its own keys).
        controller_steps: `[N]` controller evaluations per position (None or zeros for forced policies).
        router: the trace is a routed policy's (`cfg.router`): every position pays the router and the bank projection
            (the router decided step 0 there), and the controller only its own steps.
        decode: the options of the decode state that runs it (`prisme.costs.bank.bank_ops`: the bank's terms).
    Rules: a position with n >= 1 actions pays them, its controller steps (`min(n + 1, budget)` under the
    controller), the bank projection and the readout; one the controller stopped at once pays the bank projection
    and one controller step, no readout; forced policies pay no controller (an all-STOP forced position still pays
    the bank projection: later positions read its bank entry); R == 0 or None is the backbone alone.
    """
    ctx_t = torch.as_tensor(contexts).flatten()
    if ctx_t.is_floating_point() and not bool((ctx_t == ctx_t.round()).all()):
        raise ValueError("contexts must hold integer context lengths")
    ctx_t = ctx_t.long().cpu()
    N = int(ctx_t.numel())
    kinds_t = None  # [N, R] per step: slots of the action (1, 2), -1 for DENSE, 0 from the first STOP on
    if actions is not None:
        a = torch.as_tensor(actions)
        if a.dim() == 0 or (a.shape[:-1].numel() != N):
            raise ValueError(f"actions must be [N, R] with N = {N} positions (as contexts), got {tuple(a.shape)}")
        if a.shape[-1] > 0:
            kinds_t = _kinds(cfg, a.reshape(N, a.shape[-1]).long().cpu())
    steps_t = torch.zeros(N, dtype=torch.long) if controller_steps is None else \
        torch.as_tensor(controller_steps).flatten().long().cpu()
    if steps_t.numel() != N or bool((steps_t < 0).any()):
        raise ValueError(f"controller_steps must be [N] = [{N}] counts >= 0, got {steps_t.numel()} entries")
    comps = components(cfg)
    comp = dict.fromkeys(comps, 0.0)
    base = 0.0
    # positions with the same (context, action kinds, controller steps) cost the same: price each distinct one once
    cols = [ctx_t.unsqueeze(1), steps_t.unsqueeze(1)] + ([kinds_t] if kinds_t is not None else [])
    keys, counts = distinct_rows(torch.cat(cols, 1))
    for key, count in zip(keys.tolist(), counts.tolist()):
        T, n_steps, kinds = int(key[0]), int(key[1]), [k for k in key[2:] if k != 0]
        ks = [cfg.n_slots if k == -1 else k for k in kinds]
        row = token_ops(cfg, T, ks, controller_steps=n_steps, optimised=optimised, dense=[k == -1 for k in kinds],
                        router=router and kinds_t is not None, decode=decode)
        if kinds_t is not None and not ks and n_steps == 0 and not router:  # forced, all STOP: the bank still runs
            row = finish_row({**row, **bank_ops(cfg, T, decode=decode)}, cfg)
        for c in comps:
            comp[c] += row[c] * count
        base += row["backbone"] * count
    return TraceCost(total_ops=sum(comp.values()), n_positions=N, backbone_ops=base, by_component=comp)


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of an integer matrix `[N, C]` (sorted) and how often each occurs: `torch.unique(dim=0)`'s
    answer, computed by packing each row into one int64 (mixed radix over the columns' ranges) and a 1-D unique,
    which is many times faster; `unique(dim=0)` itself when the ranges do not fit in 62 bits."""
    if rows.numel() == 0:
        return torch.unique(rows, dim=0, return_counts=True)
    lo, hi = rows.amin(0), rows.amax(0)
    radix = (hi - lo + 1).tolist()
    if math.prod(radix) >= 2**62:
        return torch.unique(rows, dim=0, return_counts=True)
    packed = torch.zeros(rows.shape[0], dtype=torch.long)
    for c, r in enumerate(radix):  # the first column most significant: the same order as unique(dim=0)
        packed = packed * r + (rows[:, c] - lo[c])
    keys, counts = torch.unique(packed, return_counts=True)
    out = torch.empty(keys.shape[0], rows.shape[1], dtype=rows.dtype)
    for c in range(rows.shape[1] - 1, -1, -1):
        out[:, c] = keys % radix[c] + lo[c]
        keys = keys // radix[c]
    return out, counts


def _kinds(cfg: PrismeConfig, acts: torch.Tensor) -> torch.Tensor:
    """`[N, R]` action ids -> per step the slots it edits (1 or 2), -1 for DENSE, and 0 from the first STOP on
    (STOP is absorbing: later steps are never charged). ValueError for an id that is not an edit or STOP."""
    stop, dense, A, M = cfg.stop_action, cfg.dense_action, cfg.n_actions, cfg.n_slots
    after = torch.cumsum((acts == stop).long(), dim=-1) > 0  # [N, R] at or after the first STOP
    bad = ~after & ((acts < 0) | (acts >= A)) & (acts != dense)
    if bool(bad.any()):
        a = int(acts[bad][0])
        raise ValueError(f"action id {a} is not an edit (valid: [0, {A}) or DENSE={dense})")
    kinds = torch.where(acts == dense, -1, torch.where(acts < M, 1, 2))
    return kinds.masked_fill(after, 0)


def position_ops(cfg: PrismeConfig, context: int, actions: list[int] | None, controller_steps: int = 0,
                 optimised: bool | str = False, router: bool = False, decode: DecodeOptions = PROJECTED) -> int:
    """`trace_cost(cfg, [actions], [context], [controller_steps], optimised, router, decode).total_ops` of one
    position, from Python ints (no tensor work: what generation prices once per token)."""
    stop, dense_id, A, M = cfg.stop_action, cfg.dense_action, cfg.n_actions, cfg.n_slots
    ks: list[int] = []
    dense: list[bool] = []
    for a in actions or ():
        if a == stop:
            break
        if a != dense_id and not 0 <= a < A:
            raise ValueError(f"action id {a} is not an edit (valid: [0, {A}) or DENSE={dense_id})")
        ks.append(M if a == dense_id else 1 if a < M else 2)
        dense.append(a == dense_id)
    traced = bool(actions)
    row = token_ops(cfg, context, ks, controller_steps=controller_steps, optimised=optimised, dense=dense,
                    router=router and traced, decode=decode)
    if traced and not ks and controller_steps == 0 and not router:  # forced, all STOP: the bank still runs
        row = finish_row({**row, **bank_ops(cfg, context, decode=decode)}, cfg)
    return int(row["total"])


def run_cost(model: Any, actions: Any, contexts: Any, steps: Any = None, routed: bool | None = None,
             decode: DecodeOptions | None = None, execution: Any = None, cfg: PrismeConfig | None = None) -> TraceCost:
    """The cost of a trace as `model` ran it, the one place that assembles it: `trace_cost` of its config (or `cfg`,
    e.g. a reference model's), in the cost model's column of the editor as it ran (`execution`, an
    `ExecutionOptions`; None: the model's), with the bank as the decode state kept it (`decode`; None: the model's
    default options), and the router deciding step 0 where the model has one (`routed`; None: `cfg.router` and a
    trace was given). actions `[N, R]` (None: the bypass), contexts `[N]`, steps `[N]`: as in `trace_cost`."""
    cfg = model.cfg if cfg is None else cfg
    execution = model.execution if execution is None else execution
    routed = (cfg.router and actions is not None) if routed is None else routed
    return trace_cost(cfg, actions, contexts, steps, execution.column(cfg.optimised), routed,
                      model.decode_options if decode is None else decode)


class TokenPricer:
    """`position_ops` of generated positions (what `prisme.generate` reports per token) in a decode state with options
    `decode`, memoised on (bypass, options, the model's cost column, context, trace, controller steps) per model and
    config (they depend on nothing else), so that later calls price a token by one dict lookup. `max_budget == 0`
    prices the bypass (the backbone alone)."""

    MAX_MEMO = 1 << 16  # entries kept per model (contexts x traces seen); cleared when full

    def __init__(self, model: Any, max_budget: int, decode: DecodeOptions = PROJECTED, execution: Any = None):
        self.cfg, self.bypass, self.decode = model.cfg, max_budget == 0, decode
        execution = model.execution if execution is None else execution
        self.column = execution.column(model.cfg.optimised)  # the cost model's column of what it runs
        cfg, memo = model.__dict__.get("_position_ops_memo", (None, None))
        if cfg is not model.cfg or len(memo) > self.MAX_MEMO:
            memo = {}
            object.__setattr__(model, "_position_ops_memo", (model.cfg, memo))  # not in a state dict
        self.memo: dict[tuple, int] = memo

    def __call__(self, context: int, actions: list[int], steps: int) -> int:
        key = (self.bypass, self.decode, self.column, context, tuple(actions), steps)
        ops = self.memo.get(key)
        if ops is None:  # `trace_cost` of the one position, from its ints
            ops = self.memo[key] = position_ops(self.cfg, context, None if self.bypass else actions, steps,
                                                self.column, self.cfg.router, self.decode)
        return ops
