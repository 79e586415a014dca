"""An evaluation's report: one row per policy (loss, paired intervals against the backbone, the matched backbone
and the equal-edits baseline, ops, edits), the Pareto front, the table, the JSON document and the plot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prisme.evaluation.policies import ROW_KINDS
from prisme.io import json_safe
from prisme.stats import N_BOOT, lower_envelope


# ---------------------------------------------------------------------------------------------------------- results
@dataclass
class EvalRow:
    """One policy's validation loss and measured compute."""

    policy: str
    loss: float  # mean next-token cross-entropy over labelled targets (nats)
    ops_per_token: float  # mean ops per position, by the model's own accounting (`cfg.optimised`)
    relative_ops: float  # total ops / backbone-only ops of the same positions
    accuracy: float | None  # argmax accuracy on labelled targets (MQAR), else None
    deployable: bool  # False for the oracle (it reads the targets)
    family: str = ""
    delta_loss: float = 0.0  # loss - backbone loss on the same positions
    baseline_loss: float = 0.0  # backbone loss on the same positions
    mean_edits: float = 0.0  # non-STOP actions per position
    edited_fraction: float = 0.0  # positions with at least one edit
    controller_steps: float = 0.0  # controller evaluations per position (charged, for the oracle)
    ops_per_token_alt: float = 0.0  # the other accounting (seed <-> optimised)
    relative_ops_alt: float = 0.0
    lambda_cost: float | None = None  # controller / oracle price of compute
    budget: int | None = None  # n for forced rows, max_budget for controller / oracle rows
    n_positions: int = 0  # positions the ops cover
    n_targets: int = 0  # labelled targets the loss covers
    # paired differences on the same targets (loss of this row minus the reference's, nats per token), each
    # {mean, lo, hi, n_sequences, n_tokens} with a 95% bootstrap interval over sequences
    delta_vs_backbone: dict[str, Any] | None = None
    delta_vs_matched: dict[str, Any] | None = None  # with a matched backbone
    delta_vs_equal_edits: dict[str, Any] | None = None  # controller rows: minus their equal-edits baseline
    delta_vs_reference: dict[str, Any] | None = None  # minus the evaluation's reference row (`EvalOptions.reference`)
    verdict_vs_reference: str | None = None
    verdict_vs_backbone: str | None = None  # "beats" | "ties" | "loses", from the interval
    verdict_vs_matched: str | None = None
    verdict_vs_equal_edits: str | None = None
    tokens_per_s: float = 0.0  # positions per second of this policy's forwards during the evaluation
    equal_edits_of: str | None = None  # equal_edits rows: the controller row they match
    untrained: list[str] | None = None  # parts this policy runs that no stage trained (then not deployable)
    # this row's loss minus the dense frontier's interpolated at its ops (linear in log ops between the two
    # neighbouring frontier points, the nearest beyond the ends), per sequence on the same targets; its "at" names the
    # frontier rows and their weights
    frontier_gap: dict[str, Any] | None = None
    verdict_vs_frontier: str | None = None
    scored_edit_share: float | None = None  # the share of its edits at scored targets (MQAR: the queries)
    slices: dict[str, Any] | None = None  # per AR slice (`evaluation.slices`): loss, gain, share of gain, edits


OPTIONAL = ("delta_vs_reference", "verdict_vs_reference")  # row fields a document holds only where an evaluation
#   set them (`EvalOptions.reference`)


@dataclass
class EvalReport:
    """Every policy's row plus what is needed to reproduce the run."""

    rows: list[EvalRow]
    config: dict[str, Any]
    dataset: str
    n_tokens: int  # labelled targets scored by each full-position policy
    n_positions: int  # positions evaluated by each full-position policy
    batch_size: int
    seq_len: int
    n_batches: int
    accounting: str  # "optimised" or "seed": the accounting of `ops_per_token`
    lambdas: list[float]
    oracle_positions: int | None
    seed: int
    environment: dict[str, Any] = field(default_factory=dict)
    n_sequences: int = 0  # sequences every full-position row scored (the bootstrap's resampling unit)
    split: str = "val"
    bootstrap_samples: int = N_BOOT
    bootstrap_seed: int = 0
    oracle_targets: int | None = None  # labelled positions the oracle rows saw (it is subsampled)
    frontier: list[str] | None = None  # the rows that make the dense frontier (its lower envelope), by ops

    @property
    def alt_accounting(self) -> str:
        return "seed" if self.accounting == "optimised" else "optimised"

    def row(self, policy: str) -> EvalRow:
        """The row named `policy` (ValueError if there is none)."""
        for r in self.rows:
            if r.policy == policy:
                return r
        raise ValueError(f"no row named {policy!r}; rows: {[r.policy for r in self.rows]}")

    def table(self) -> str:
        """A fixed-width table for humans, one row per policy: loss, the paired differences to the backbone and the
        matched backbone with their 95% intervals and verdicts, ops, edits, throughput."""
        has_m = any(r.delta_vs_matched for r in self.rows)
        ci = lambda d: "-" if not d else f"{d['mean']:+.4f} [{d['lo']:+.4f},{d['hi']:+.4f}]"  # noqa: E731
        head = (f"{'policy':<30}{'loss':>8}  {'vs backbone [95% CI]':<28} " + (f"{'vs matched [95% CI]':<28} " if has_m
                                                                               else "")
                + f"{'rel ops':>8}{'edits':>7}{'acc':>7}{'tok/s':>9}  deployable")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            acc = "-" if r.accuracy is None else f"{r.accuracy:.3f}"
            dep = "yes" if r.deployable else (f"no (untrained {'+'.join(r.untrained)})" if r.untrained
                                              else "no (upper bound)")
            own = ROW_KINDS[r.family].own_reference if r.family in ROW_KINDS else None  # itself: no verdict
            vb = ci(r.delta_vs_backbone) + ("" if not r.verdict_vs_backbone or own == "delta_vs_backbone"
                                            else f" {r.verdict_vs_backbone}")
            vm = ci(r.delta_vs_matched) + ("" if not r.verdict_vs_matched or own == "delta_vs_matched"
                                           else f" {r.verdict_vs_matched}")
            # a difference with its verdict takes 31 characters: the space after each keeps it apart from the next
            lines.append(f"{r.policy:<30}{r.loss:>8.4f}  {vb:<28} " + (f"{vm:<28} " if has_m else "")
                         + f"{r.relative_ops:>8.3f}{r.mean_edits:>7.2f}{acc:>7}{r.tokens_per_s:>9.0f}  {dep}")
            if r.delta_vs_equal_edits:
                lines.append(f"{'':<4}controller - equal_edits: {ci(r.delta_vs_equal_edits)} "
                             f"{r.verdict_vs_equal_edits}")
            if r.frontier_gap:
                lines.append(f"{'':<4}minus the dense frontier at {r.relative_ops:.2f}x: {ci(r.frontier_gap)} "
                             f"{r.verdict_vs_frontier}")
        foot = (f"{self.dataset}; {self.split} split, {self.n_batches} batches x {self.batch_size} x {self.seq_len} = "
                f"{self.n_sequences} sequences, {self.n_tokens} scored targets; differences are this row's loss minus "
                f"the reference's on the same targets (nats/token), 95% bootstrap over sequences "
                f"({self.bootstrap_samples} resamples, seed {self.bootstrap_seed}); ops in the {self.accounting} "
                f"accounting")
        if self.frontier:
            foot += f"; dense frontier: {', '.join(self.frontier)} (interpolated in log ops)"
        if any(ROW_KINDS[r.family].sampled for r in self.rows if r.family in ROW_KINDS):
            per = "all" if self.oracle_positions is None else self.oracle_positions
            foot += (f"; oracle rows: {per} sampled positions per sequence ({self.oracle_targets} in all), compared "
                     f"on those positions")
        lines.append(foot)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable document (strict JSON: no NaN or infinity)."""
        doc = {k: v for k, v in asdict(self).items() if k != "rows"}
        doc["alt_accounting"] = self.alt_accounting
        doc["rows"] = [{k: v for k, v in asdict(r).items() if k not in OPTIONAL or v is not None} for r in self.rows]
        return json_safe(doc)

    def plot(self, path: str | Path) -> None:
        """Loss difference to the backbone versus relative ops (PNG, log ops axis): one marker per family with its
        95% paired interval as an error bar, the deployable Pareto front, zero (the backbone) and the matched
        backbone's difference. The oracle's points are its difference on its own sampled positions (hollow)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
        for fam, kind in ROW_KINDS.items():
            rows = [r for r in self.rows if r.family == fam and r.delta_vs_backbone]
            if not rows:
                continue
            xs = [r.relative_ops for r in rows]
            ys = [r.delta_vs_backbone["mean"] for r in rows]
            err = [[y - r.delta_vs_backbone["lo"] for y, r in zip(ys, rows)],
                   [r.delta_vs_backbone["hi"] - y for y, r in zip(ys, rows)]]
            marker, color = kind.marker, kind.color
            hollow = kind.sampled
            ax.errorbar(xs, ys, yerr=err, fmt=marker, color=color, ms=6, capsize=2, lw=1,
                        mfc="none" if hollow else color,
                        label=f"{fam} (not deployable; on its sampled positions)" if hollow else fam)
        front = [r for r in pareto_front(self.rows) if r.delta_vs_backbone]
        if front:  # a staircase from the cheapest row, held to the right edge
            x_max = max(r.relative_ops for r in self.rows)
            xs = [r.relative_ops for r in front] + [x_max]
            ys = [r.delta_vs_backbone["mean"] for r in front] + [front[-1].delta_vs_backbone["mean"]]
            ax.step(xs, ys, where="post", color="k", lw=1, alpha=0.5, label="Pareto front (deployable)")
        ax.axhline(0.0, color="gray", ls="--", lw=1, label="backbone only")
        ax.set_xscale("log")
        ax.set_xlabel(f"ops per token / backbone only ({self.accounting} accounting, log scale)")
        ax.set_ylabel("loss minus the backbone's (nats / token), 95% CI")
        ax.set_title(f"{self.config.get('name', '?')}: {self.split} split, {self.n_sequences} sequences")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
        plt.close(fig)


def pareto_front(rows: Sequence[EvalRow]) -> list[EvalRow]:
    """Deployable rows not dominated in (relative ops, loss), sorted by ops: each is strictly better in loss than
    every cheaper-or-equal one."""
    dep = [r for r in rows if r.deployable]
    return [dep[i] for i in lower_envelope([(r.relative_ops, r.loss) for r in dep])]


