"""Evaluation: validation loss against measured ops per token, for every policy of SPEC §5.

Notation: B batch, T positions, V vocab, M slots, A controller actions (STOP = A, DENSE = A+1), R steps, P oracle
positions per sequence, n actions per position, k slots per action.

Policies (one `EvalRow` each; `family` in parentheses):
  * backbone only (`backbone`): `model(tokens)`, the exact bypass;
  * backbone + matched tokens (`matched`): another model's backbone alone (one trained on as many extra tokens as
    the workspace stage used), so that "the workspace helps" is not just "more training";
  * fixed n x k1 / n x k2 (`fixed`), n in {1, 2, 4, 8} and n <= r_max: step r edits slot r mod M, or pair
    M + (r mod M/2); forced through `model(tokens, actions)`, no controller;
  * random n x k (`random`): uniform single slots or pairs; batch i draws from a generator seeded with seed + i
    (common random numbers across random rows);
  * dense (`dense`): n DENSE actions;
  * controller at several lambda (`controller`): `model.forward_policy(tokens, r_max, lambda_cost=lambda)`;
  * greedy oracle (`oracle`, not deployable): at each step execute every candidate action, keep the largest true
    loss drop, STOP when none beats lambda * cost. It reads the targets, so it is an upper-bound probe on a subsample
    of labelled positions, never a policy one could deploy.

Measurement (SPEC §6): loss is the mean next-token cross-entropy over labelled targets (-100 ignored), accuracy the
argmax hit rate on them (MQAR only). Ops come from the actual traces through `costs.trace_cost`: each position pays
at its own context t + 1; forced policies pay no controller; the controller pays the steps it took; the oracle is
charged min(n + 1, budget) controller steps, as if a controller had chosen its trace. Ops cover every position of
the evaluated sequences (each one is a generated token, labelled or not); the oracle's cover its sampled positions.
`relative_ops` divides by the backbone alone on the same positions. Both accountings are reported: `ops_per_token`
is the model's own (`cfg.optimised`), `ops_per_token_alt` the other one (seed <-> optimised).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from prisme.checks import is_int
from prisme.config import PrismeConfig
from prisme.costs.traces import TraceCost, trace_cost
from prisme.data.mqar import MQARDataset
from prisme.data.text import IGNORE_INDEX, TokenDataset
from prisme.devices import synchronize, upload
from prisme.evaluation.oracle import greedy_oracle
from prisme.evaluation.policies import (
    POLICY_FAMILIES,
    WORKSPACE_FAMILIES,
    _plan,
    _Policy,
    default_lambdas,
    forced_actions,
    sample_positions,
    thinned_actions,
)
from prisme.evaluation.report import EvalReport, EvalRow
from prisme.evaluation.slices import SliceSums, ar_slice_labels
from prisme.io import environment
from prisme.model.oracle import token_ce
from prisme.model.prisme import PrismeModel
from prisme.stats import (
    N_BOOT,
    PairedDelta,
    check_bootstrap_args,
    gap_to_frontier,
    lower_envelope,
    paired_bootstrap,
)


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

    def cost(self, cfg: PrismeConfig, optimised: bool) -> TraceCost:
        ctx = torch.cat(self.contexts)
        acts = torch.cat(self.actions) if self.actions else None
        steps = torch.cat(self.steps) if self.steps else None
        return trace_cost(cfg, acts, ctx, steps, optimised=optimised, router=self.routed)


def _check_inputs(model, dataset, policies, batch_size, seq_len, max_batches, matched_backbone, lambdas,
                  oracle_positions) -> tuple[list[str], int]:
    if not isinstance(model, PrismeModel):
        raise ValueError(f"model must be a PrismeModel, got {type(model).__name__}")
    cfg = model.cfg
    if dataset is None or not hasattr(dataset, "iter_eval"):
        raise ValueError(f"dataset must provide iter_eval(split, batch_size, seq_len, max_batches), got {dataset!r}")
    for name, v in (("batch_size", batch_size), ("max_batches", max_batches)):
        if v is None and name == "max_batches":
            continue
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if seq_len is None:
        seq_len = dataset.cfg.seq_len if isinstance(dataset, MQARDataset) else cfg.max_seq_len
    if not is_int(seq_len) or not 1 <= seq_len <= cfg.max_seq_len:
        raise ValueError(f"seq_len must be an int in [1, max_seq_len={cfg.max_seq_len}], got {seq_len!r}")
    vocab = getattr(dataset, "vocab_size", None)
    if vocab is not None and vocab > cfg.vocab_size:
        raise ValueError(f"dataset vocab_size={vocab} exceeds the model's vocab_size={cfg.vocab_size}")
    if policies is None:
        families = ["backbone"] + (["matched"] if matched_backbone is not None else [])
        if cfg.use_workspace:
            families += [f for f in POLICY_FAMILIES if f in WORKSPACE_FAMILIES]
    else:
        if isinstance(policies, str):
            policies = [policies]
        families = list(dict.fromkeys(policies))
        unknown = [p for p in families if p not in POLICY_FAMILIES]
        if unknown:
            raise ValueError(f"unknown policy name(s) {unknown}; choose from {list(POLICY_FAMILIES)}")
        if not families:
            raise ValueError(f"policies is empty; name at least one of {list(POLICY_FAMILIES)} (or None for all)")
        if not cfg.use_workspace and any(f in WORKSPACE_FAMILIES for f in families):
            raise ValueError(f"this model has no workspace (use_workspace=False): policies "
                             f"{[f for f in families if f in WORKSPACE_FAMILIES]} need one")
        if "matched" in families and matched_backbone is None:
            raise ValueError("policy 'matched' needs matched_backbone (a model whose backbone is evaluated alone)")
    if matched_backbone is not None:
        if not isinstance(matched_backbone, PrismeModel):
            raise ValueError(f"matched_backbone must be a PrismeModel, got {type(matched_backbone).__name__}")
        if matched_backbone.cfg.vocab_size != cfg.vocab_size:
            raise ValueError(f"matched_backbone vocab_size={matched_backbone.cfg.vocab_size} differs from the "
                             f"model's {cfg.vocab_size}")
        if seq_len > matched_backbone.cfg.max_seq_len:
            raise ValueError(f"seq_len={seq_len} exceeds matched_backbone max_seq_len="
                             f"{matched_backbone.cfg.max_seq_len}")
    if lambdas is not None:
        lambdas = list(lambdas)
        if not lambdas or any(not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 for x in lambdas):
            raise ValueError(f"lambdas must be a non-empty list of finite floats >= 0, got {lambdas!r}")
    if oracle_positions is not None and (not is_int(oracle_positions)
                                         or oracle_positions < 1):
        raise ValueError(f"oracle_positions must be an int >= 1 or None (all labelled positions), got "
                         f"{oracle_positions!r}")
    return families, seq_len


def evaluate_policies(model: PrismeModel, dataset: TokenDataset | MQARDataset, policies: Sequence[str] | None = None,
                      *, batch_size: int = 16, seq_len: int | None = None, max_batches: int | None = 8,
                      matched_backbone: PrismeModel | None = None, lambdas: Sequence[float] | None = None,
                      oracle_positions: int | None = 16, seed: int = 0, progress: bool = False,
                      bootstrap_samples: int = N_BOOT, bootstrap_seed: int = 0,
                      split: str = "val", references: dict[str, PrismeModel] | None = None,
                      budgets: Sequence[int] | None = None, ks: Sequence[int] = (1, 2),
                      oracle_lambdas: Sequence[float] | None = None,
                      controller_budget: int | None = None, kappa_risk: float | None = None,
                      frontier: Sequence[str] | None = None, slices: int | None = None) -> EvalReport:
    """Evaluate every policy on the validation split of `dataset` (`split`; a held-out text holds all its tokens there).

    Args:
        model: the model; evaluated in eval mode under no_grad, its mode restored afterwards.
        dataset: a `TokenDataset` or `MQARDataset` (anything with `iter_eval(split, B, T, max_batches)`).
        policies: families to run (`POLICY_FAMILIES`; default: all that apply). `matched` needs `matched_backbone`.
        batch_size, seq_len, max_batches: evaluation windows (seq_len default: the MQAR length or T_max).
        matched_backbone: a model whose backbone alone is the "backbone + matched tokens" baseline.
        lambdas: controller and oracle prices of compute (default: `default_lambdas` on the first batch).
        oracle_positions: labelled positions per sequence the oracle samples (None: all).
        seed: random policies, the equal-edits thinning and oracle subsampling.
        bootstrap_samples, bootstrap_seed: the paired intervals' resamples and seed (`prisme.stats`).
        budgets: n of the fixed / random n x k rows and the dense rows (default 1, 2, 4, 8 up to r_max).
        ks: slots per action of the fixed / random rows (1: single slots, 2: pairs).
        oracle_lambdas: the oracle rows' prices (default: `lambdas`).
        controller_budget: max_budget of the controller, equal-edits and oracle rows (default r_max; pass the budget
            the workspace and controller were trained for).
        kappa_risk: the controller rows' risk aversion (default: the config's `kappa_risk`).
        references: other models whose backbone alone is scored on the same targets, one row each (family
            "reference", named by its key; e.g. a deeper backbone trained on the same tokens), after the matched row.
        frontier: the rows ("backbone", "backbone+matched", reference names) that make the dense frontier: every
            other row scored on the same targets gets its `frontier_gap` (its lower envelope, interpolated in log ops).
        slices: n-gram length of the AR-hit / seen-miss / other slices (`evaluation.slices`); None: no slices.
    Returns:
        `EvalReport` with one `EvalRow` per policy, families in the order of `policies` (default: as in
        `POLICY_FAMILIES`).
    """
    check_bootstrap_args(bootstrap_samples, bootstrap_seed)
    if kappa_risk is not None and (isinstance(kappa_risk, bool) or not isinstance(kappa_risk, (int, float))
                                   or not math.isfinite(kappa_risk) or kappa_risk < 0):
        raise ValueError(f"kappa_risk must be a finite number >= 0, got {kappa_risk!r}")
    families, seq_len = _check_inputs(model, dataset, policies, batch_size, seq_len, max_batches, matched_backbone,
                                      lambdas, oracle_positions)
    batches = list(dataset.iter_eval(split, batch_size, seq_len, max_batches))
    if not batches or all(x.numel() == 0 for x, _ in batches):
        raise ValueError(f"dataset {dataset!r} yielded no validation batches")
    if not any(bool((y != IGNORE_INDEX).any()) for _, y in batches):
        raise ValueError(f"dataset {dataset!r}: no labelled targets in the validation batches (all -100)")
    cfg = model.cfg
    device = next(model.parameters()).device
    was_training = model.training
    m_training = matched_backbone.training if matched_backbone is not None else False
    model.eval()
    if matched_backbone is not None:
        matched_backbone.eval()
    try:
        with torch.no_grad():
            if lambdas is None and ("controller" in families or "oracle" in families):
                lambdas = default_lambdas(model, batches[0][0].to(device), budget=controller_budget)
            plan = _plan(model, families, [float(x) for x in (lambdas or [0.0])], budgets,
                         None if oracle_lambdas is None else [float(x) for x in oracle_lambdas], ks,
                         controller_budget)
            refs = dict(references or {})
            for name, ref in refs.items():
                if not isinstance(ref, PrismeModel) or ref.cfg.vocab_size != cfg.vocab_size:
                    raise ValueError(f"reference {name!r} must be a PrismeModel with vocab_size={cfg.vocab_size}")
                ref.eval()
            at = next((i + 1 for i, q in enumerate(plan) if q.family in ("backbone", "matched")), 0)
            at = max([at] + [i + 1 for i, q in enumerate(plan) if q.family == "matched"])
            plan[at:at] = [_Policy(name, "reference") for name in refs]
            unknown = sorted(set(frontier or ()) - {q.name for q in plan if q.family in ("backbone", "matched",
                                                                                          "reference")})
            if unknown:
                raise ValueError(f"frontier rows {unknown} are not backbone-only rows of this evaluation")
            accs = {p.name: _Acc(slices=None if slices is None else SliceSums(cfg.stop_action)) for p in plan}
            _run_batches(model, plan, accs, batches, device, matched_backbone, oracle_positions, seed, progress,
                         refs, kappa_risk, slices)
    finally:
        model.train(was_training)
        if matched_backbone is not None:
            matched_backbone.train(m_training)
    rows = _finish_rows(model, plan, accs, matched_backbone, isinstance(dataset, MQARDataset), bootstrap_samples,
                        bootstrap_seed, refs)
    envelope = frontier_gaps(rows, accs, list(frontier or ()), bootstrap_samples, bootstrap_seed)
    n_tok = sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)
    oracle_seen = next((r.n_targets for r in rows if r.family == "oracle"), None)
    return EvalReport(rows=rows, config=cfg.to_dict(), dataset=repr(dataset), n_tokens=n_tok,
                      n_positions=sum(x.numel() for x, _ in batches), batch_size=batch_size, seq_len=seq_len,
                      n_batches=len(batches), accounting="optimised" if cfg.optimised else "seed",
                      lambdas=[float(x) for x in (lambdas or [])], oracle_positions=oracle_positions, seed=seed,
                      environment=environment(model), n_sequences=sum(x.shape[0] for x, _ in batches),
                      split=split, bootstrap_samples=bootstrap_samples, bootstrap_seed=bootstrap_seed,
                      oracle_targets=oracle_seen, frontier=envelope or None)


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


ENCODED_FAMILIES = ("fixed", "random", "dense", "equal_edits", "controller")  # rows that share the batch's encoding


def _run_batches(model, plan, accs, batches, device, matched_backbone, oracle_positions, seed, progress,
                 refs=None, kappa_risk=None, slice_n=None) -> None:
    cfg = model.cfg
    it = batches
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(batches, desc="eval", unit="batch")
    g_oracle = torch.Generator().manual_seed(seed)
    clock = lambda: synchronize(device) or time.perf_counter()  # noqa: E731 - a row's time includes its device work
    for bi, (x, y) in enumerate(it):
        x, y = upload(x, device), upload(y, device)
        B, T = x.shape
        if slice_n is not None:
            labels = ar_slice_labels(x, y, slice_n)
            for acc in accs.values():
                acc.slice_labels = labels
        contexts = torch.arange(1, T + 1).expand(B, T)  # [B, T] each position's own context t + 1
        t0 = clock()  # with workspace rows the batch is encoded once (H and the bank), shared by all of them
        ctx = model.encode(x) if any(p.family in ENCODED_FAMILIES for p in plan) else None
        H = model.backbone(x) if ctx is None else ctx.H
        base_logits = model.backbone.head(H)  # [B, T, V] the backbone alone: every row's baseline
        t_base = t_enc = clock() - t0  # charged to every workspace row (and the backbone row, bank included)
        base_ce = token_ce(base_logits, y)  # [B, T]
        matched_ce, t_matched = None, 0.0
        if matched_backbone is not None:  # its CE on the same targets: every row's second reference
            t0 = clock()
            m_logits = matched_backbone(x.to(next(matched_backbone.parameters()).device)).logits.to(device)
            t_matched = clock() - t0
            matched_ce = token_ce(m_logits, y)
        g_random = torch.Generator().manual_seed(seed + bi)
        rand_state = g_random.get_state()
        oracle_pos = None
        edits_seen: dict[str, float] = {}  # controller row -> its mean edits per position on this batch
        for p in plan:
            acc = accs[p.name]
            t0 = clock()
            if p.family == "backbone":
                acc.add_loss(base_logits, y, base_ce, matched_ce)
                acc.add_trace(None, contexts, None)
                acc.time_s += t_base
            elif p.family == "matched":
                acc.add_loss(m_logits, y, base_ce, matched_ce)
                acc.add_trace(None, contexts, None)
                acc.time_s += t_matched
            elif p.family == "reference":
                ref = refs[p.name]
                logits = ref(x.to(next(ref.parameters()).device)).logits.to(device)
                acc.time_s += clock() - t0
                acc.add_loss(logits, y, base_ce, matched_ce)
                acc.add_trace(None, contexts, None)
            elif p.family in ("fixed", "random", "dense", "equal_edits"):
                if p.family == "random":
                    g_random.set_state(rand_state)  # common random numbers: each random row starts from seed + bi
                if p.family == "equal_edits":  # the controller's mean edits, spread uniformly over positions
                    g_thin = torch.Generator().manual_seed(seed + 7919 * (bi + 1))
                    acts = thinned_actions(cfg, edits_seen[p.of], p.n, (B, T), g_thin, device)
                else:
                    acts = forced_actions(cfg, p.family, p.n, p.k, (B, T), g_random, device)  # [B, T, n]
                out = model(x, acts, ctx=ctx)
                acc.time_s += clock() - t0 + t_enc
                acc.add_loss(out.logits, y, base_ce, matched_ce)
                acc.add_trace(out.actions, contexts, None)
            elif p.family == "controller":
                out = model.forward_policy(x, max_budget=p.n, lambda_cost=p.lam, kappa_risk=kappa_risk, ctx=ctx)
                acc.time_s += clock() - t0 + t_enc
                acc.add_loss(out.logits, y, base_ce, matched_ce)
                acc.add_trace(out.actions, contexts, out.controller_steps)
                acc.routed = cfg.router  # the router decided step 0 of this policy's traces
                edits_seen[p.name] = float(out.n_edits.double().mean())
            elif p.family == "oracle":
                if oracle_pos is None:  # the same positions for every oracle row of this batch
                    oracle_pos = sample_positions(y, oracle_positions, g_oracle)
                rows, pos = oracle_pos  # [B'], [B', P]
                if rows.numel() == 0:
                    continue
                res = greedy_oracle(model, x[rows], y[rows], pos, p.n, p.lam)
                acc.time_s += clock() - t0
                yq = y[rows].gather(1, pos)  # [B', P]
                m_q = None if matched_ce is None else matched_ce[rows].gather(1, pos)
                acc.add_loss(res.logits, yq, res.base_loss, m_q)
                steps = torch.clamp(res.n_edits + 1, max=p.n)  # as if a controller had chosen the trace
                acc.add_trace(res.actions, pos + 1, steps)
            acc.n_timed += B * T if p.family != "oracle" else int(pos.numel())


def _finish_rows(model, plan, accs, matched_backbone, mqar: bool, n_boot: int = N_BOOT,
                 boot_seed: int = 0, refs=None) -> list[EvalRow]:
    cfg = model.cfg
    rows = []
    for p in plan:
        acc = accs[p.name]
        if acc.n_targets == 0:
            continue
        loss = acc.loss_sum / acc.n_targets
        if not math.isfinite(loss):
            raise ValueError(f"policy {p.name}: non-finite validation loss {loss}")
        own_cfg = matched_backbone.cfg if p.family == "matched" else refs[p.name].cfg if p.family == "reference" \
            else cfg
        own = acc.cost(own_cfg, cfg.optimised)
        alt = acc.cost(own_cfg, not cfg.optimised)
        if p.family in ("matched", "reference"):  # relative to this model's backbone on the same positions
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
            accuracy=acc.n_correct / acc.n_targets if mqar else None, deployable=p.family != "oracle",
            family=p.family, delta_loss=loss - baseline, baseline_loss=baseline,
            mean_edits=float(n_edits.mean()), edited_fraction=float((n_edits > 0).double().mean()),
            controller_steps=steps, ops_per_token_alt=alt.ops_per_token, relative_ops_alt=rel_alt,
            lambda_cost=p.lam, budget=p.n if p.n else None, n_positions=own.n_positions, n_targets=acc.n_targets,
            tokens_per_s=acc.n_timed / acc.time_s if acc.time_s > 0 else 0.0, equal_edits_of=p.of,
            slices=acc.slices.report() if acc.slices is not None and p.family != "oracle" else None))
        row = rows[-1]
        if acc.seq_base:
            d = acc.paired(acc.seq_base, n_boot, boot_seed)
            row.delta_vs_backbone, row.verdict_vs_backbone = d.to_dict(), d.verdict
        if acc.seq_matched:
            d = acc.paired(acc.seq_matched, n_boot, boot_seed)
            row.delta_vs_matched, row.verdict_vs_matched = d.to_dict(), d.verdict
    by = {r.policy: r for r in rows}
    for p in plan:  # controller minus its equal-edits baseline, on the same targets
        if p.family == "equal_edits" and p.name in by and p.of in by:
            d = accs[p.of].paired(accs[p.name].seq_loss, n_boot, boot_seed)
            by[p.of].delta_vs_equal_edits, by[p.of].verdict_vs_equal_edits = d.to_dict(), d.verdict
    return rows
