"""A training stage's compute: its analytic training ops (`stage_compute`) and the wall time its own log records
(`logged_training_s`).

Convention (docs/costs.md, "Training ops"): ops come from the analytic cost model (`prisme.costs`, one multiply-add =
2 ops; the editor on its reference path, which training runs: no slot K/V cache under autograd; the controller and
readout as the config runs them, `cfg.optimised`). A stage's ops are steps x batch_size x its ops per
sequence, and a sequence's ops are the sum over the parts its objective runs of the part's forward ops times

* 3 (`TRAINED`) where the part's weights train: the forward, and the backward's two products (the gradients of the
  input and of the weights);
* 2 (`THROUGH`) where the part is frozen but a gradient passes through it to something that trains;
* 1 (`NO_GRAD`) where it runs without gradient: a frozen backbone under the workspace or router stage, the oracle's
  candidate edits.

Each part is priced where the objective runs it: the backbone and the bank's entries at every position; the workspace
stage's editor, readout and head at the labelled positions (MQAR: the queries; text: every position) with the mean
of its random budgets and actions; the oracle stages' candidate edits at the labelled positions among their sampled
ones, the behaviour action at the others, and the trained head (controller or router) at every sampled one. A part
that reads the bank is priced at the mean context of the positions it runs at (its ops are affine in the context).
Not counted: the optimizer, validation passes, the value-scale calibration batch, and what the cost model leaves out
(norms, softmax, activations, embedding lookups).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

import torch

from prisme.config import PrismeConfig
from prisme.costs.analytic import (
    BACKBONE_TERMS,
    action_editor_ops,
    attended_keys,
    backbone_ops,
    controller_bank_ops,
    controller_entropy_ops,
    controller_input_ops,
    controller_step_ops,
    copy_head_ops,
    readout_ops,
    router_ops,
)
from prisme.costs.bank import bank_projection_ops, bank_shift_ops
from prisme.costs.traces import trace_cost
from prisme.data.mqar import MQARConfig, make_mqar_batch
from prisme.data.text import IGNORE_INDEX
from prisme.model.workspace import action_group_size
from prisme.training.config import StageConfig
from prisme.training.curves import read_metrics
from prisme.training.objectives import BackboneObjective, CopyObjective, WorkspaceObjective
from prisme.training.oracle_objectives import ControllerObjective, RouterObjective

TRAINED, THROUGH, NO_GRAD = 3, 2, 1  # forward-ops multipliers (the module docstring)
LABEL_ROWS = 256  # MQAR sequences drawn (fixed seed) to find where a stage's labels lie


@dataclass(frozen=True)
class Labels:
    """Where a stage's sequences carry a label: of `seq_len` positions, `per_row` labelled ones on average, at mean
    context `context` (t + 1)."""

    seq_len: int
    per_row: float
    context: float

    @property
    def unlabelled_context(self) -> float:
        """The mean context of an unlabelled position (0 when every position has a label)."""
        T, n = self.seq_len, self.per_row
        return (T * (T + 1) / 2 - n * self.context) / (T - n) if T > n else 0.0


def stage_labels(cfg: PrismeConfig, scfg: StageConfig) -> Labels:
    """Where `scfg`'s sequences carry labels: MQAR, measured on `LABEL_ROWS` sequences of the stage's own task (a
    fixed seed); a text dataset, every position of its sequence length."""
    if scfg.dataset == "mqar":
        task = {**scfg.mqar, **({"seq_len": scfg.seq_len} if scfg.seq_len is not None else {})}
        _, y = make_mqar_batch(MQARConfig(**task), LABEL_ROWS, torch.Generator().manual_seed(0))  # [R, T]
        labelled = y != IGNORE_INDEX  # [R, T]
        contexts = (torch.arange(y.shape[1]) + 1).expand_as(y)[labelled]  # [n]
        return Labels(y.shape[1], float(labelled.sum(1).double().mean()), float(contexts.double().mean()))
    T = scfg.seq_len or cfg.max_seq_len
    return Labels(T, float(T), (T + 1) / 2)


@dataclass(frozen=True)
class StageCompute:
    """One stage's analytic training compute: `parts` maps each part it runs to (multiplier, forward ops per
    sequence); `ops` = steps x batch_size x the sum of multiplier x forward ops."""

    stage: str
    steps: int
    batch_size: int
    seq_len: int
    parts: dict[str, tuple[int, float]]

    @property
    def ops_per_sequence(self) -> float:
        return sum(m * f for m, f in self.parts.values())

    @property
    def ops(self) -> float:
        return self.steps * self.batch_size * self.ops_per_sequence


# ---------------------------------------------------------------------------------------------- forward ops
def backbone_forward(cfg: PrismeConfig, T: int) -> float:
    """The backbone's blocks (linears, causal attention, a key shift) over positions 1..T, without the head."""
    row = backbone_ops(cfg, 1)
    per_token = row["backbone_linear"] + row.get("backbone_key_shift", 0)
    keys = sum(attended_keys(cfg, t) for t in range(1, T + 1))
    return float(T * per_token + cfg.n_layer * 4 * cfg.d_model * keys)


def head_ops(cfg: PrismeConfig) -> int:
    """The LM head on one position (d -> V)."""
    return 2 * cfg.d_model * cfg.vocab_size


def bank_forward(cfg: PrismeConfig, T: int, queries: float) -> float:
    """The bank's K and V (and token shift) of positions 1..T, and z at `queries` positions."""
    return float(bank_projection_ops(cfg, T, query=False) + bank_shift_ops(cfg, T)
                 + queries * bank_projection_ops(cfg, 0, query=True))


def action_sizes(cfg: PrismeConfig) -> list[int]:
    """Slots each action id edits: M singles, then the pairs (`prisme.model.workspace.action_table`'s order)."""
    return [1] * cfg.n_slots + [2] * (cfg.n_actions - cfg.n_slots)


def editor_forward(cfg: PrismeConfig, k: int, context: float, dense: bool = False) -> float:
    """The editor's forward ops of one action of k slots at (mean) context `context`."""
    return float(sum(action_editor_ops(cfg, k, context, dense=dense).values()))


def mean_action(cfg: PrismeConfig, context: float, p_dense: float = 0.0) -> float:
    """The editor's forward ops of one action drawn uniformly from the A actions (DENSE with probability `p_dense`)."""
    sparse = fmean(editor_forward(cfg, k, context) for k in action_sizes(cfg))
    return (1 - p_dense) * sparse + p_dense * editor_forward(cfg, cfg.n_slots, context, dense=True)


# ------------------------------------------------------------------------------------------------ the stages
def _backbone_stage(cfg: PrismeConfig, s: StageConfig, lab: Labels) -> dict[str, tuple[int, float]]:
    """Next-token CE of the backbone (the exact bypass): blocks and head at every position, all trained."""
    T = lab.seq_len
    return {"backbone": (TRAINED, backbone_forward(cfg, T) + T * head_ops(cfg))}


def _workspace_stage(cfg: PrismeConfig, s: StageConfig, lab: Labels) -> dict[str, tuple[int, float]]:
    """Forced random actions at the labelled positions (budgets uniform in [min_budget, max_budget])."""
    T, n, c = lab.seq_len, lab.per_row, lab.context
    n = min(n, s.workspace_positions) if s.workspace_positions else n  # the positions drawn (same mean context)
    joins = s.backbone_joins
    budgets = range(s.min_budget, (s.max_budget or cfg.r_max) + 1)
    blocks = TRAINED if joins and s.backbone_trains == "all" else THROUGH if joins else NO_GRAD
    parts = {"backbone": (blocks, backbone_forward(cfg, T)),
             "bank": (TRAINED, bank_forward(cfg, T, n)),
             "editor": (TRAINED, n * fmean(budgets) * mean_action(cfg, c, s.p_dense)),
             "readout": (TRAINED, n * fmean(b >= 1 for b in budgets) * readout_ops(cfg, cfg.optimised)),
             "head": (TRAINED if joins and s.workspace_grad_to_backbone else THROUGH, n * head_ops(cfg)),
             "backbone_reference": (NO_GRAD, n * head_ops(cfg))}  # the logged backbone-only loss
    if joins and s.backbone_aux_weight > 0:  # the backbone's own LM loss
        parts["backbone_head"] = (TRAINED, T * head_ops(cfg))
    if s.deep_supervision > 0:  # the logits after every step but the last
        later = sum(fmean(b > r + 1 for b in budgets) for r in range(budgets[-1] - 1))
        parts["deep_supervision_head"] = (THROUGH, n * (budgets[-1] - 1) * head_ops(cfg))
        parts["deep_supervision_readout"] = (TRAINED, n * later * readout_ops(cfg, cfg.optimised))
    if s.prev_token_probe_weight > 0:
        parts["prev_token_probe"] = (TRAINED, (T - 1) * head_ops(cfg))
    return parts


def _oracle_stage(cfg: PrismeConfig, s: StageConfig, lab: Labels, steps: float,
                  head: Callable[[float], float]) -> dict[str, tuple[int, float]]:
    """The oracle's rollout (`ControllerObjective.oracle_rollout`) at P = min(oracle_positions, T) sampled positions,
    the labelled ones first: `steps` states, each with every candidate action executed (no gradient) and the trained
    value head (`head(context)`: its forward ops at one position) at every sampled position."""
    T, A = lab.seq_len, cfg.n_actions
    P = min(s.oracle_positions, T)
    labelled = min(lab.per_row, P)
    other = P - labelled
    c_all = (labelled * lab.context + other * lab.unlabelled_context) / P
    zero = s.unlabelled_value == "zero" and other > 0  # candidates at the labelled positions alone
    n_cand, c_cand = (labelled, lab.context) if zero else (P, c_all)
    readout = readout_ops(cfg, cfg.optimised)
    candidates = n_cand * (sum(editor_forward(cfg, k, c_cand) for k in action_sizes(cfg)) + A * readout)
    parts = {"backbone": (NO_GRAD, backbone_forward(cfg, T)),
             "bank": (NO_GRAD, bank_forward(cfg, T, P)),
             "head": (NO_GRAD, P * head_ops(cfg)),  # the loss before any edit
             "candidates": (NO_GRAD, steps * (candidates + P * A * head_ops(cfg))),
             "value_head": (TRAINED, steps * P * head(c_all))}
    if zero:  # the behaviour action itself where there is no label
        parts["behaviour"] = (NO_GRAD, steps * other * mean_action(cfg, lab.unlabelled_context))
    return parts


def _controller_stage(cfg: PrismeConfig, s: StageConfig, lab: Labels) -> dict[str, tuple[int, float]]:
    """The controller regressed on the oracle: one budget per batch, uniform in [1, max_budget]."""
    def head(c: float) -> float:
        source = controller_input_ops(cfg) if cfg.controller_source is not None else 0
        step = controller_step_ops(cfg, cfg.optimised)
        return step + controller_entropy_ops(cfg) + controller_bank_ops(cfg, c) + source

    return _oracle_stage(cfg, s, lab, fmean(range(1, (s.max_budget or cfg.r_max) + 1)), head)


def _router_stage(cfg: PrismeConfig, s: StageConfig, lab: Labels) -> dict[str, tuple[int, float]]:
    """The router regressed on the oracle at step 0: one state per position."""
    return _oracle_stage(cfg, s, lab, 1.0, lambda c: router_ops(cfg, c))


def _copy_stage(cfg: PrismeConfig, s: StageConfig, lab: Labels) -> dict[str, tuple[int, float]]:
    """The copy head at every position (its lookups and gate, `costs.analytic.copy_head_ops`) on the backbone's
    output: the backbone and its head frozen (no gradient reaches them: the mix reads their output), or trained with
    it (joint)."""
    T = lab.seq_len
    joins = TRAINED if s.backbone_joins else NO_GRAD
    return {"backbone": (joins, backbone_forward(cfg, T)), "head": (joins, T * head_ops(cfg)),
            "copy_head": (TRAINED, float(sum(copy_head_ops(cfg, t) for t in range(1, T + 1))))}


STAGE_PARTS = {BackboneObjective: _backbone_stage, WorkspaceObjective: _workspace_stage,
               ControllerObjective: _controller_stage, RouterObjective: _router_stage,
               CopyObjective: _copy_stage}  # by the stage's objective


def stage_compute(cfg: PrismeConfig, scfg: StageConfig) -> StageCompute:
    """The analytic training compute of stage `scfg` on model `cfg` (the module docstring's convention)."""
    lab = stage_labels(cfg, scfg)
    parts = STAGE_PARTS[scfg.spec.objective](cfg, scfg, lab)
    return StageCompute(scfg.stage, scfg.steps, scfg.batch_size, lab.seq_len, parts)


def training_record(runs: list[tuple[PrismeConfig, StageConfig, str | Path]], threads: int) -> dict[str, object]:
    """A model's training compute, the record both studies keep: per stage in order (its model config, stage config
    and run folder) its name, steps, batch size, sequence length, analytic ops (`stage_compute`) and the wall time its
    log records (`logged_training_s`); `training_ops` their sum, `training_s` the logged seconds (None where a stage
    has no log), `threads` and `training_core_s` = training_s x threads."""
    stages = []
    for cfg, scfg, folder in runs:
        comp = stage_compute(cfg, scfg)
        stages.append({"stage": scfg.stage, "steps": scfg.steps, "batch_size": scfg.batch_size,
                       "seq_len": comp.seq_len, "ops": comp.ops, "training_s": logged_training_s(folder)})
    seconds = [st["training_s"] for st in stages]
    total = None if None in seconds else sum(seconds)
    return {"training_ops": sum(st["ops"] for st in stages), "training_stages": stages, "training_s": total,
            "threads": threads, "training_core_s": None if total is None else total * threads}


def logged_training_s(run: str | Path) -> float | None:
    """The wall time a stage's run folder records having trained: its metrics.jsonl's `time_s` (from the start of
    `train_stage` to each logged step) at the last step of each session, summed over the sessions of a resumed run
    (a session's clock starts again at 0). None without a log or a timed row."""
    try:
        rows = read_metrics(run)
    except ValueError:
        return None
    total, last = 0.0, None
    for r in rows:
        t = r.get("time_s")
        if r.get("split", "train") != "train" or not isinstance(t, (int, float)) or not math.isfinite(t):
            continue
        if last is not None and t < last:  # a resumed session
            total += last
        last = float(t)
    return None if last is None else total + last


# ------------------------------------------------------------------------------ one step as it ran (`bench train`)
def workspace_stage_step(cfg: PrismeConfig, extra: dict[str, torch.Tensor], y: torch.Tensor,
                        deep_supervision: float) -> float:
    """Analytic ops of one workspace-stage step as it ran (the module's convention) for its sampled actions
    `[B, T, R]` and budgets (`prisme bench train` prices its timed steps with it)."""
    acts, budget = extra["actions"], extra["budget"]
    B, T, R = acts.shape
    labelled = y != IGNORE_INDEX  # [B, T]
    P = max(1, int(labelled.sum(1).max()))  # query positions per row (all T on text)
    ctx = (torch.arange(T) + 1).expand(B, T)
    tc = trace_cost(cfg, acts[labelled], ctx[labelled])  # the forced traces, seed accounting
    ws = sum(v for k, v in tc.by_component.items() if k not in BACKBONE_TERMS)  # bank projections, editor, readout
    head = head_ops(cfg)  # one position
    ops = NO_GRAD * B * backbone_forward(cfg, T) + TRAINED * ws
    ops += (THROUGH + NO_GRAD) * head * B * P  # the final logits, and the backbone's own (the logged reference)
    if deep_supervision > 0:  # logits after every step but the last: the head on all queries, the readout where more
        n_ds = sum(int((labelled & (budget > r + 1)).sum()) for r in range(R - 1))
        ops += (R - 1) * THROUGH * head * B * P + TRAINED * readout_ops(cfg) * n_ds
    return float(ops)


def controller_stage_step(cfg: PrismeConfig, objective: Any, extra: dict[str, torch.Tensor], y: torch.Tensor) -> float:
    """Analytic ops of one controller-stage step as it ran (the module's convention): the oracle's behaviour rollout
    at the sampled positions, all A candidate edits at every state (x 1), and the controller's forward at every state
    (x 3)."""
    B, T = y.shape
    A = cfg.n_actions
    b = int(extra["budget"][0])
    pos, valid = objective.positions(y, extra["scores"])  # [B, P]
    P = pos.shape[1]
    head = head_ops(cfg)
    d, w = cfg.d_model, cfg.w
    ops = NO_GRAD * B * backbone_forward(cfg, T)
    ops += NO_GRAD * B * T * (2 * len(cfg.bank_terms) * 2 * d * w + bank_shift_ops(cfg))  # K, V at every position
    ops += NO_GRAD * B * P * len(cfg.query_terms) * 2 * d * w  # z at the sampled positions
    ops += NO_GRAD * head * B * P  # the loss before any edit
    sizes = action_group_size(cfg).tolist()  # [A]
    zero = objective.unlabelled_zero and not bool(valid.all())
    cand = valid if zero else torch.ones_like(valid)  # positions whose A candidates run
    ctrl = controller_step_ops(cfg)
    if cfg.controller_source is not None:
        ctrl += controller_input_ops(cfg)
    if cfg.controller_entropy:
        ctrl += controller_entropy_ops(cfg)
    for r in range(b):
        for p_len in (pos[cand] + 1).tolist():  # context of each candidate position
            ops += NO_GRAD * sum(sum(action_editor_ops(cfg, k, p_len).values()) for k in sizes)
        ops += NO_GRAD * (A * int(cand.sum()) * readout_ops(cfg) + head * B * P * A)
        ops += TRAINED * B * P * ctrl
        if cfg.controller_bank:
            ops += TRAINED * sum(controller_bank_ops(cfg, t) for t in (pos + 1).flatten().tolist())
        if zero:  # the behaviour action at unlabelled positions
            rand = extra["random_action"][:, :P, r]
            for p_len, a in zip((pos[~valid] + 1).tolist(), rand[~valid].tolist()):
                ops += NO_GRAD * sum(action_editor_ops(cfg, sizes[a], p_len).values())
    return float(ops)
