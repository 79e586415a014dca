"""Evaluation: validation loss (or query accuracy) against measured ops per token, for every policy of SPEC §5.

`evaluate_policies(model, data, policies, options)` runs each policy's rows (`prisme.evaluation.policies`: one class
per family) on every batch's shared encoding (`prisme.evaluation.batch.Batch`) and scores them with the options'
scorer: next-token loss on every labelled target (`NextTokenLoss`, text) or the query positions (`QueryAccuracy`,
MQAR: forced edits run there only).

Measurement (SPEC §6): loss is the mean next-token cross-entropy over scored targets (-100 ignored), accuracy the
argmax hit rate on them. Ops come from the actual traces through `costs.trace_cost`: each position pays at its own
context t + 1; forced policies pay no controller; the controller pays the steps it took; the oracle is charged
min(n + 1, budget) controller steps, as if a controller had chosen its trace. Ops cover every position of the
evaluated sequences (each one is a generated token, labelled or not); the oracle's cover its sampled positions
(every position with `every_position`). `relative_ops` divides by the backbone alone on the same positions. Both
accountings are reported: `ops_per_token` is the model's own (`cfg.optimised`), `ops_per_token_alt` the other one.
Every row gets its paired difference to the backbone; with a matched `ReferenceRows`, to it too; every row scored on
the frontier's targets gets its gap to the dense frontier (`EvalOptions.frontier`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from prisme.checks import is_int
from prisme.config import PrismeConfig
from prisme.costs.traces import TraceCost, trace_cost
from prisme.data.mqar import MQARDataset
from prisme.data.text import IGNORE_INDEX
from prisme.devices import synchronize, upload
from prisme.evaluation.batch import Batch, NextTokenLoss, Outcome, QueryAccuracy
from prisme.evaluation.families import standard_policies
from prisme.evaluation.policies import (
    ROW_KINDS,
    ControllerRows,
    OracleRows,
    Policy,
    ReferenceRows,
    Row,
)
from prisme.evaluation.report import EvalReport, EvalRow
from prisme.evaluation.slices import SliceSums, ar_slice_labels, slice_edges, slice_names
from prisme.io import environment
from prisme.model.oracle import token_ce
from prisme.model.prisme import PrismeModel
from prisme.options import PROJECTED, DecodeOptions
from prisme.stats import (
    N_BOOT,
    PairedDelta,
    check_bootstrap_args,
    gap_to_frontier,
    lower_envelope,
    paired_bootstrap,
)

__all__ = ["EvalOptions", "evaluate_policies", "frontier_gaps", "NextTokenLoss", "QueryAccuracy"]


@dataclass(frozen=True)
class EvalOptions:
    """How an evaluation runs (the policies say what it runs)."""

    batch_size: int = 16  # evaluation windows (a dataset's `iter_eval`; ignored for a list of batches)
    seq_len: int | None = None  # default: the MQAR length or the model's T_max
    max_batches: int | None = 8  # None: the whole split
    split: str = "val"  # a held-out text holds all its tokens there
    seed: int = 0  # random rows' common random numbers, the equal-edits thinning, the oracle's positions
    progress: bool = False  # a tqdm bar over batches
    bootstrap_samples: int = N_BOOT  # the paired intervals' resamples and seed (`prisme.stats`)
    bootstrap_seed: int = 0
    frontier: Sequence[str] | None = None  # backbone-only rows that make the dense frontier (their lower envelope)
    reference: str | None = None  # a row every other row scored on its targets is compared with, paired
    #   (`EvalRow.delta_vs_reference`: e.g. the untrained exact-copy reference)
    slices: int | None = None  # n-gram length of the AR-hit / seen-miss / other slices (`evaluation.slices`)
    slices_window: int | tuple[int, ...] | None = None  # split AR hits into within / beyond an attention window of
    #   this many positions, or with bucket edges (window, e_1, ..) by copy distance too (`evaluation.slices`)
    scorer: NextTokenLoss = field(default_factory=NextTokenLoss)  # `NextTokenLoss()` or `QueryAccuracy()`

    def replace(self, **changes: Any) -> EvalOptions:
        return replace(self, **changes)


# ---------------------------------------------------------------------------------------------------------- the run
@dataclass
class _Acc:
    """Accumulates one row over batches."""

    loss_sum: float = 0.0
    n_targets: int = 0
    n_correct: int = 0
    base_loss_sum: float = 0.0
    actions: list[torch.Tensor] = field(default_factory=list)  # [N, R] each
    contexts: list[torch.Tensor] = field(default_factory=list)  # [N] each
    steps: list[torch.Tensor] = field(default_factory=list)  # [N] each
    seq_loss: list[torch.Tensor] = field(default_factory=list)  # [B] summed CE per sequence, each batch
    seq_n: list[torch.Tensor] = field(default_factory=list)  # [B] scored targets per sequence
    seq_base: list[torch.Tensor] = field(default_factory=list)  # [B] the backbone's summed CE on the same targets
    seq_matched: list[torch.Tensor] = field(default_factory=list)  # [B] the matched backbone's, when there is one
    time_s: float = 0.0  # wall time of this policy's forwards
    n_timed: int = 0  # positions those forwards covered
    routed: bool = False  # the traces are a routed policy's (the router decided step 0 at every position)
    slices: SliceSums | None = None  # per AR slice (`slices=n`), with the batch's labels in slice_labels
    slice_labels: torch.Tensor | None = None
    edits_all: int = 0  # edits over every position of full-position traces
    edits_scored: int = 0  # of them, at scored targets

    def add_loss(self, logits: torch.Tensor, y: torch.Tensor, base_ce: torch.Tensor | None = None,
                 matched_ce: torch.Tensor | None = None) -> None:
        """Add a batch: logits `[B, T, V]`, targets `[B, T]`, the references' per-position CE `[B, T]` on them."""
        mask = y != IGNORE_INDEX
        ce = token_ce(logits, y).double().masked_fill(~mask, 0.0)  # [B, T]
        self.loss_sum += float(ce.sum())
        self.n_targets += int(mask.sum())
        self.n_correct += int((logits.argmax(-1)[mask] == y[mask]).sum())
        if self.slices is not None and self.slice_labels is not None and self.slice_labels.shape == y.shape:
            self.slices.add(self.slice_labels, ce, None if base_ce is None else base_ce.double().masked_fill(~mask, 0))
        self.seq_loss.append(ce.sum(-1).cpu())
        self.seq_n.append(mask.sum(-1).cpu().double())
        if base_ce is not None:
            base = base_ce.double().masked_fill(~mask, 0.0)
            self.base_loss_sum += float(base.sum())
            self.seq_base.append(base.sum(-1).cpu())
        if matched_ce is not None:
            self.seq_matched.append(matched_ce.double().masked_fill(~mask, 0.0).sum(-1).cpu())

    def paired(self, other: list[torch.Tensor], n_boot: int, seed: int) -> PairedDelta:
        """This row minus a reference (per-sequence sums on the same targets), with its bootstrap interval."""
        return paired_bootstrap(torch.cat(self.seq_loss), torch.cat(other), torch.cat(self.seq_n), n_boot, seed)

    def add_trace(self, actions: torch.Tensor | None, contexts: torch.Tensor, steps: torch.Tensor | None) -> None:
        N = contexts.numel()
        self.contexts.append(contexts.reshape(N).cpu())
        if actions is not None:
            self.actions.append(actions.reshape(N, -1).cpu())
            if self.slices is not None and self.slice_labels is not None and actions.dim() == 3 \
                    and actions.shape[:2] == self.slice_labels.shape:
                self.slices.add_edits(self.slice_labels, actions)
        if steps is not None:
            self.steps.append(steps.reshape(N).cpu())

    def cost(self, cfg: PrismeConfig, optimised: bool, decode: DecodeOptions = PROJECTED) -> TraceCost:
        """The row's traces priced by `cfg`'s cost model, as a decode state with options `decode` runs them."""
        ctx = torch.cat(self.contexts)
        acts = torch.cat(self.actions) if self.actions else None
        steps = torch.cat(self.steps) if self.steps else None
        return trace_cost(cfg, acts, ctx, steps, optimised, self.routed, decode)


def _check_options(model: PrismeModel, data: Any, options: EvalOptions) -> int:
    """Validate the options against the model and the data; returns seq_len."""
    if not isinstance(model, PrismeModel):
        raise ValueError(f"model must be a PrismeModel, got {type(model).__name__}")
    if not isinstance(options, EvalOptions):
        raise ValueError(f"options must be an EvalOptions, got {type(options).__name__}")
    cfg = model.cfg
    if data is None or not (hasattr(data, "iter_eval") or isinstance(data, (list, tuple))):
        raise ValueError(f"data must provide iter_eval(split, batch_size, seq_len, max_batches) or be a list of "
                         f"(x, y) batches, got {data!r}")
    if not is_int(options.batch_size) or options.batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {options.batch_size!r}")
    if options.max_batches is not None and (not is_int(options.max_batches) or options.max_batches < 1):
        raise ValueError(f"max_batches must be an int >= 1, got {options.max_batches!r}")
    seq_len = options.seq_len
    if seq_len is None:
        seq_len = data.cfg.seq_len if isinstance(data, MQARDataset) else cfg.max_seq_len
    if not is_int(seq_len) or not 1 <= seq_len <= cfg.max_seq_len:
        raise ValueError(f"seq_len must be an int in [1, max_seq_len={cfg.max_seq_len}], got {seq_len!r}")
    vocab = getattr(data, "vocab_size", None)
    if vocab is not None and vocab > cfg.vocab_size:
        raise ValueError(f"dataset vocab_size={vocab} exceeds the model's vocab_size={cfg.vocab_size}")
    check_bootstrap_args(options.bootstrap_samples, options.bootstrap_seed)
    if options.slices is not None and (not is_int(options.slices) or not 1 <= options.slices <= seq_len):
        raise ValueError(f"slices must be an n-gram length in [1, seq_len={seq_len}] (a longer one matches nothing "
                         f"in a window), got {options.slices!r}")
    if options.slices_window is not None:
        try:
            slice_edges(options.slices_window)
            ok = options.slices is not None
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"slices_window must be an int >= 1 (an attention window) or increasing bucket edges "
                             f"(window, e_1, ..) of ints >= 1, and goes with slices (an n-gram length), got "
                             f"{options.slices_window!r} with slices={options.slices!r}")
    if not isinstance(options.scorer, NextTokenLoss):
        raise ValueError(f"scorer must be NextTokenLoss() or QueryAccuracy(), got {options.scorer!r}")
    return seq_len


def evaluate_policies(model: PrismeModel, data: Any, policies: Sequence[Policy | str] | None = None,
                      options: EvalOptions | None = None) -> EvalReport:
    """Evaluate every row of `policies` on `data`.

    Args:
        model: the model; evaluated in eval mode under no_grad, its mode restored afterwards (and the references').
        data: a `TokenDataset` or `MQARDataset` (anything with `iter_eval(split, B, T, max_batches)`), or a list of
            (x, y) batches `[B, T]` each.
        policies: `Policy` objects (`prisme.evaluation.policies`), or family names with their defaults
            (`standard_policies`); None: every family that applies to the model.
        options: `EvalOptions` (batch size, windows, seeds, bootstrap, frontier rows, slices, scorer).
    Returns:
        `EvalReport` with one `EvalRow` per planned row, in the order of `policies`.
    """
    options = EvalOptions() if options is None else options
    seq_len = _check_options(model, data, options)
    if policies is None or all(isinstance(p, str) for p in ([policies] if isinstance(policies, str) else policies)):
        policies = standard_policies(model, [policies] if isinstance(policies, str) else policies)
    policies = list(policies)
    if not policies or not all(isinstance(p, Policy) for p in policies):
        raise ValueError(f"policies must be a non-empty list of Policy objects or family names, got {policies!r}")
    for p in policies:
        p.check(model, seq_len)
    batches = _batches(data, options, seq_len)
    cfg = model.cfg
    device = next(model.parameters()).device
    others = [m for p in policies for m in p.models()]
    modes = [(m, m.training) for m in [model, *others]]
    for m, _ in modes:
        m.eval()
    try:
        with torch.no_grad():
            first = upload(batches[0][0], device)
            for p in policies:
                p.planned = tuple(p.plan(model, first))
            plan = [row for p in policies for row in p.planned]
            names = [r.name for r in plan]
            if len(set(names)) != len(names):
                raise ValueError(f"two rows share a name: {sorted({n for n in names if names.count(n) > 1})} (a "
                                 f"reference may not take a policy row's name)")
            dense_rows = {r.name for r in plan if r.kind.backbone_only}
            unknown = sorted(set(options.frontier or ()) - dense_rows)
            if unknown:
                raise ValueError(f"frontier rows {unknown} are not backbone-only rows of this evaluation")
            names = slice_names(options.slices_window)
            accs = {r.name: _Acc(slices=None if options.slices is None else SliceSums(cfg.stop_action, names))
                    for r in plan}
            _run_batches(model, plan, accs, batches, device, options)
    finally:
        for m, was in modes:
            m.train(was)
    with_accuracy = options.scorer.at_queries or isinstance(data, MQARDataset)
    rows = _finish_rows(model, plan, accs, options, with_accuracy)
    envelope = frontier_gaps(rows, accs, list(options.frontier or ()), options.bootstrap_samples,
                             options.bootstrap_seed)
    n_tok = sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)
    oracle = next((p for p in policies if isinstance(p, OracleRows)), None)
    priced = [p for p in policies if isinstance(p, (ControllerRows, OracleRows))]
    prices = [r.lam for r in priced[0].planned if r.policy is priced[0]] if priced else []  # the first priced grid
    return EvalReport(rows=rows, config=cfg.to_dict(), dataset=repr(data) if hasattr(data, "iter_eval") else
                      f"{len(batches)} given batches", n_tokens=n_tok,
                      n_positions=sum(x.numel() for x, _ in batches), batch_size=options.batch_size, seq_len=seq_len,
                      n_batches=len(batches), accounting="optimised" if cfg.optimised else "seed",
                      lambdas=prices,
                      oracle_positions=None if oracle is None else oracle.positions, seed=options.seed,
                      environment=environment(model), n_sequences=sum(x.shape[0] for x, _ in batches),
                      split=options.split, bootstrap_samples=options.bootstrap_samples,
                      bootstrap_seed=options.bootstrap_seed,
                      oracle_targets=next((r.n_targets for r in rows if ROW_KINDS[r.family].sampled), None),
                      frontier=envelope or None)


def _batches(data: Any, options: EvalOptions, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(data, "iter_eval"):
        batches = list(data.iter_eval(options.split, options.batch_size, seq_len, options.max_batches))
    else:
        batches = list(data)
    if not batches or all(x.numel() == 0 for x, _ in batches):
        raise ValueError(f"dataset {data!r} yielded no validation batches")
    if not any(bool((y != IGNORE_INDEX).any()) for _, y in batches):
        raise ValueError(f"dataset {data!r}: no labelled targets in the validation batches (all -100)")
    return batches


def frontier_gaps(rows: list[EvalRow], accs: dict[str, _Acc], frontier: list[str], n_boot: int,
                  boot_seed: int) -> list[str]:
    """Set `frontier_gap` on every row that is not a frontier row and was scored on the frontier's targets (not the
    oracle's sampled positions): its per-sequence loss minus the frontier's, interpolated in log ops between the two
    frontier rows around its ops. The frontier is the lower envelope of the named rows; returns its row names."""
    by = {r.policy: r for r in rows}
    named = [n for n in frontier if n in by]
    if not named:
        return []
    env = [named[i] for i in lower_envelope([(by[n].relative_ops, by[n].loss) for n in named])]
    points = {n: (by[n].relative_ops, torch.cat(accs[n].seq_loss)) for n in env}
    for r in rows:
        if r.policy in frontier or r.n_targets != by[env[0]].n_targets:
            continue
        gap = gap_to_frontier(torch.cat(accs[r.policy].seq_loss), torch.cat(accs[r.policy].seq_n), points,
                              r.relative_ops, n_boot, boot_seed)
        r.verdict_vs_frontier = gap.pop("verdict")
        r.frontier_gap = gap
    return env


def _run_batches(model: PrismeModel, plan: list[Row], accs: dict[str, _Acc],
                 batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 options: EvalOptions) -> None:
    it = batches
    if options.progress:
        from tqdm.auto import tqdm

        it = tqdm(batches, desc="eval", unit="batch")
    shared: dict[str, Any] = {}  # what lives across batches: the oracle's generator, the random rows' streams
    matched = next((r for r in plan if isinstance(r.policy, ReferenceRows) and r.policy.matched), None)
    clock = lambda: synchronize(device) or time.perf_counter()  # noqa: E731 - a row's time includes its device work
    for bi, (x, y) in enumerate(it):
        x, y = upload(x, device), upload(y, device)
        B, T = x.shape
        batch = Batch(model, x, y, bi, options.seed, options.scorer, shared)
        if options.slices is not None:
            labels = ar_slice_labels(x, y, options.slices, options.slices_window)
            for acc in accs.values():
                acc.slice_labels = labels
        contexts = torch.arange(1, T + 1).expand(B, T)  # [B, T] each position's own context t + 1
        t0 = clock()  # with workspace rows the batch is encoded once (H and the bank), shared by all of them
        if any(r.policy.shares_encoding and r.policy.needs_workspace for r in plan):
            batch.ctx  # noqa: B018 - encode now, so that its time is charged to the rows that share it
        base_ce = token_ce(batch.base_logits, y)  # [B, T]
        t_enc = clock() - t0
        matched_ce = None
        if matched is not None:  # its CE on the same targets: every row's second reference (its row's time)
            t0 = clock()
            matched_ce = token_ce(matched.policy.logits(batch), y)
            accs[matched.name].time_s += clock() - t0
        for row in plan:
            acc = accs[row.name]
            t0 = clock()
            out = row.policy.run(row, batch)
            if out is None:
                continue
            acc.time_s += clock() - t0 + (t_enc if row.policy.shares_encoding else 0.0)
            _add(acc, out, batch, base_ce, matched_ce, contexts)
            if out.mean_edits is not None:
                batch.mean_edits[row.name] = out.mean_edits


def _add(acc: _Acc, out: Outcome, batch: Batch, base_ce: torch.Tensor, matched_ce: torch.Tensor | None,
         contexts: torch.Tensor) -> None:
    """Add one row's outcome on one batch to its accumulator."""
    y = batch.y
    stop = batch.model.cfg.stop_action
    if out.at is None:
        acc.add_loss(out.logits, y, base_ce, matched_ce)
        acc.n_timed += y.numel()
    else:
        rows, pos = out.at
        r = rows if rows.dim() == 2 else rows.unsqueeze(1)
        b_ce = base_ce[r, pos] if out.base_ce is None else out.base_ce
        acc.add_loss(out.logits, y[r, pos], b_ce, None if matched_ce is None else matched_ce[r, pos])
        acc.n_timed += pos.numel()
    ctx = contexts if out.contexts is None else out.contexts
    acc.add_trace(out.actions, ctx, out.steps)
    acc.routed = acc.routed or out.routed
    if out.actions is not None and out.contexts is None and out.actions.shape[:2] == y.shape:
        n = (out.actions != stop).sum(-1)  # [B, T] edits per position
        acc.edits_all += int(n.sum())
        acc.edits_scored += int(n[y != IGNORE_INDEX].sum())


def _finish_rows(model: PrismeModel, plan: list[Row], accs: dict[str, _Acc], options: EvalOptions,
                 with_accuracy: bool) -> list[EvalRow]:
    cfg = model.cfg
    n_boot, boot_seed = options.bootstrap_samples, options.bootstrap_seed
    rows = []
    for p in plan:
        acc = accs[p.name]
        if acc.n_targets == 0:
            continue
        loss = acc.loss_sum / acc.n_targets
        if not math.isfinite(loss):
            raise ValueError(f"policy {p.name}: non-finite validation loss {loss}")
        own_cfg = p.policy.priced_by(model)
        decode = model.decode_options if own_cfg is cfg else PROJECTED  # as this model decodes
        own = acc.cost(own_cfg, model.execution.column(cfg.optimised), decode)
        alt = acc.cost(own_cfg, model.execution.column(not cfg.optimised), decode)
        if own_cfg is not cfg:  # another model: relative to this model's backbone on the same positions
            base_ops = acc.cost(cfg, cfg.optimised).backbone_ops
            rel, rel_alt = own.total_ops / base_ops, alt.total_ops / base_ops
        else:
            rel, rel_alt = own.relative, alt.relative
        if acc.actions:
            acts = torch.cat(acc.actions)
            n_edits = (acts != cfg.stop_action).sum(-1).double()
        else:
            n_edits = torch.zeros(own.n_positions, dtype=torch.float64)
        steps = torch.cat(acc.steps).double().mean().item() if acc.steps else 0.0
        baseline = acc.base_loss_sum / acc.n_targets
        rows.append(EvalRow(
            policy=p.name, loss=loss, ops_per_token=own.ops_per_token, relative_ops=rel,
            accuracy=acc.n_correct / acc.n_targets if with_accuracy else None, deployable=not p.kind.sampled,
            family=p.family, delta_loss=loss - baseline, baseline_loss=baseline,
            mean_edits=float(n_edits.mean()), edited_fraction=float((n_edits > 0).double().mean()),
            controller_steps=steps, ops_per_token_alt=alt.ops_per_token, relative_ops_alt=rel_alt,
            lambda_cost=p.lam, budget=p.n if p.n else None, n_positions=own.n_positions, n_targets=acc.n_targets,
            tokens_per_s=acc.n_timed / acc.time_s if acc.time_s > 0 else 0.0, equal_edits_of=p.of,
            scored_edit_share=acc.edits_scored / acc.edits_all if acc.edits_all else None,
            slices=acc.slices.report() if acc.slices is not None and not p.kind.sampled else None))
        row = rows[-1]
        if acc.seq_base:
            d = acc.paired(acc.seq_base, n_boot, boot_seed)
            row.delta_vs_backbone, row.verdict_vs_backbone = d.to_dict(), d.verdict
        if acc.seq_matched:
            d = acc.paired(acc.seq_matched, n_boot, boot_seed)
            row.delta_vs_matched, row.verdict_vs_matched = d.to_dict(), d.verdict
    by = {r.policy: r for r in rows}
    ref = options.reference
    if ref is not None and ref in by:  # every row minus the reference row, on the same targets
        for r in rows:
            if r.policy != ref and r.n_targets == by[ref].n_targets:
                d = accs[r.policy].paired(accs[ref].seq_loss, n_boot, boot_seed)
                r.delta_vs_reference, r.verdict_vs_reference = d.to_dict() | {"reference": ref}, d.verdict
    for p in plan:  # controller minus its equal-edits baseline, on the same targets
        if p.of is not None and p.name in by and p.of in by:
            d = accs[p.of].paired(accs[p.name].seq_loss, n_boot, boot_seed)
            by[p.of].delta_vs_equal_edits, by[p.of].verdict_vs_equal_edits = d.to_dict(), d.verdict
    return rows
