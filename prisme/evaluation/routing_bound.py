"""The oracle-routed bound: how close any router on a trained workspace could come to the dense frontier.

A router decides at every position whether the workspace runs, and pays for that decision everywhere (its head and
the bank projection, `costs.traces.trace_cost(router=True)`). The best any router could do at budget 1 is to route
exactly the positions where one edit lowers the true loss most, with the action that lowers it most. The greedy
oracle at budget 1 at every position gives each position's best drop d_t >= 0 (it reads the targets: no deployed
router can know them). Routing the k positions of largest d_t over the whole evaluation is then priced as a routed
trace (the edit at those k positions, nothing elsewhere), and its loss is the backbone's minus those drops.

For each routed fraction k / N the bound reports its ops, its loss and its gap to the dense frontier interpolated at
those ops (linear in log ops between the two neighbouring frontier models, `stats.gap_to_frontier`), with
a paired bootstrap interval over sequences. If every fraction's interval lies above 0, no router on this workspace
(at this price of an edit) can reach the frontier; the smallest gap says by how much it misses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from prisme.costs.traces import trace_cost
from prisme.data.text import IGNORE_INDEX
from prisme.evaluation.oracle import greedy_oracle
from prisme.evaluation.run import EvalOptions
from prisme.model.oracle import token_ce
from prisme.model.prisme import PrismeModel
from prisme.stats import gap_to_frontier, lower_envelope

FRACTIONS = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)  # routed shares of all scored positions


@dataclass
class BoundPoint:
    """Routing the `k` positions of largest oracle drop (`fraction` of `n_positions`)."""

    fraction: float
    k: int
    relative_ops: float  # total ops over the backbone alone's, router and bank projection included
    loss: float  # mean loss per scored target
    gain: float  # the backbone's loss minus this loss
    frontier_gap: dict  # loss minus the frontier's at relative_ops: mean, lo, hi, n_sequences, n_tokens, at


@dataclass
class RoutingBound:
    points: list[BoundPoint]
    frontier: dict[str, float]  # frontier model -> its relative ops (the lower envelope of the references)
    frontier_loss: dict[str, float]
    backbone_loss: float
    n_positions: int
    positive_drop_share: float  # positions where some edit lowers the loss at all

    @property
    def best(self) -> BoundPoint:
        """The fraction whose gap to the frontier is smallest."""
        return min(self.points, key=lambda p: p.frontier_gap["mean"])

    def to_json(self) -> dict:
        return {"points": [asdict(p) for p in self.points], "frontier": self.frontier,
                "frontier_loss": self.frontier_loss, "backbone_loss": self.backbone_loss,
                "n_positions": self.n_positions, "positive_drop_share": self.positive_drop_share,
                "best": asdict(self.best)}

    def table(self) -> str:
        lines = [f"oracle-routed bound (budget 1, the oracle's best action at the k positions of largest drop; "
                 f"{self.n_positions} positions, {self.positive_drop_share:.1%} with any drop > 0)",
                 f"{'routed':>8} {'rel ops':>8} {'loss':>8} {'gain':>8}  minus the dense frontier [95% CI]"]
        for p in self.points:
            g = p.frontier_gap
            lines.append(f"{p.fraction:>8.3f} {p.relative_ops:>8.3f} {p.loss:>8.4f} {p.gain:>+8.4f}  "
                         f"{g['mean']:+.4f} [{g['lo']:+.4f},{g['hi']:+.4f}] {g['verdict']}")
        return "\n".join(lines)


@torch.no_grad()
def oracle_routed_bound(model: PrismeModel, dataset, references: dict[str, PrismeModel],
                        options: EvalOptions | None = None, fractions: Sequence[float] = FRACTIONS) -> RoutingBound:
    """The bound on `dataset`'s evaluation windows (see the module docstring).

    Args:
        model: a PrismeModel with a trained workspace (its router, if it has one, sets the router's price; without
            one, the price of the default router of its config).
        references: backbone-only models scored on the same targets; their lower envelope is the dense frontier.
        options: the windows and intervals, as an evaluation's (`EvalOptions`: its split, batch_size, seq_len (None:
            the model's T_max), max_batches, bootstrap_samples and bootstrap_seed; the rest is not read).
        fractions: routed shares of the scored positions, each in [0, 1].
    """
    o = options if options is not None else EvalOptions()
    if not isinstance(model, PrismeModel) or not model.cfg.use_workspace:
        raise ValueError("oracle_routed_bound needs a PrismeModel with a workspace")
    if not references:
        raise ValueError("oracle_routed_bound needs at least one reference model (the dense frontier)")
    if not fractions or any(not 0.0 <= float(f) <= 1.0 for f in fractions):
        raise ValueError(f"fractions must be shares in [0, 1], got {list(fractions)!r}")
    cfg = model.cfg
    price_cfg = cfg if cfg.router else cfg.replace(router=True)
    T = o.seq_len or cfg.max_seq_len
    dev = next(model.parameters()).device
    was = model.training
    model.eval()
    drops, acts, base, ctxs, seqs, ref_ce = [], [], [], [], [], {n: [] for n in references}
    n_seq = 0
    try:
        for x, y in dataset.iter_eval(o.split, o.batch_size, T, o.max_batches):
            B, Tx = x.shape
            if not bool((y != IGNORE_INDEX).all()):
                raise ValueError("oracle_routed_bound needs windows whose every target is scored")
            x, y = x.to(dev), y.to(dev)
            pos = torch.arange(Tx, device=dev).expand(B, Tx)
            res = greedy_oracle(model, x, y, pos, max_budget=1)
            drops.append((res.base_loss - res.loss).double().flatten().cpu())
            acts.append(res.actions[..., 0].flatten().cpu())
            base.append(res.base_loss.double().flatten().cpu())
            ctxs.append((torch.arange(Tx) + 1).repeat(B))
            seqs.append(torch.arange(n_seq, n_seq + B).repeat_interleave(Tx))
            for n, ref in references.items():
                ref_ce[n].append(token_ce(ref(x).logits, y).double().flatten().cpu())
            n_seq += B
    finally:
        model.train(was)
    if n_seq == 0:
        raise ValueError(f"{dataset!r} has no {o.split} windows of {T} tokens")
    d, a, b, ctx, sq = (torch.cat(v) for v in (drops, acts, base, ctxs, seqs))
    d = d.clamp_min(0.0)  # a STOP (no drop) is 0; rounding never makes routing look better
    N = int(d.numel())
    n_tok = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, sq, torch.ones(N, dtype=torch.float64))

    def per_seq(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_seq, dtype=torch.float64).index_add_(0, sq, v)

    bb_ops = trace_cost(cfg, None, ctx, optimised=cfg.optimised).backbone_ops
    refs = {n: torch.cat(v) for n, v in ref_ce.items()}
    ref_ops = {n: trace_cost(m.cfg, None, ctx, optimised=cfg.optimised).total_ops / bb_ops
               for n, m in references.items()}
    names = list(references)
    env = [names[i] for i in lower_envelope([(ref_ops[n], float(refs[n].mean())) for n in names])]
    envelope = {n: (ref_ops[n], per_seq(refs[n])) for n in env}
    order = torch.argsort(d, descending=True, stable=True)
    stop = torch.full_like(a, cfg.stop_action)
    points = []
    for f in fractions:
        k = int(round(float(f) * N))
        routed = torch.zeros(N, dtype=torch.bool)
        routed[order[:k]] = True
        trace = torch.where(routed, a, stop).unsqueeze(-1)  # [N, 1]
        rel = trace_cost(price_cfg, trace, ctx, optimised=model.execution.column(cfg.optimised), router=True,
                         decode=model.decode_options).total_ops / bb_ops
        loss_pos = b - d * routed
        gap = gap_to_frontier(per_seq(loss_pos), n_tok, envelope, rel, o.bootstrap_samples, o.bootstrap_seed)
        points.append(BoundPoint(fraction=float(f), k=k, relative_ops=rel, loss=float(loss_pos.mean()),
                                 gain=float((d * routed).sum() / N), frontier_gap=gap))
    return RoutingBound(points=points, frontier={n: ref_ops[n] for n in env},
                        frontier_loss={n: float(refs[n].mean()) for n in env}, backbone_loss=float(b.mean()),
                        n_positions=N, positive_drop_share=float((d > 0).double().mean()))
