"""What the policies draw: the equal-edits baseline's thinned actions, the oracle's sampled positions, and the
controller's default grid of prices."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from prisme.config import PrismeConfig
from prisme.data.text import IGNORE_INDEX
from prisme.model.prisme import PrismeModel

LAMBDA_QUANTILES = (0.25, 0.5, 0.75, 0.95)


def thinned_actions(cfg: PrismeConfig, mean_edits: float, max_n: int, shape: tuple[int, int],
                    generator: torch.Generator, device: torch.device | None = None) -> torch.Tensor:
    """The equal-edits baseline `[B, T, max_n]`: fixed round-robin single-slot edits, thinned per position at random
    (seeded) to `mean_edits` per position on average: each position gets floor(m) or floor(m) + 1 edits (the latter
    with probability m - floor(m)), so the same edit count is spread uniformly instead of allocated."""
    B, T = shape
    m = min(max(float(mean_edits), 0.0), float(max_n))
    base = int(math.floor(m))
    n = base + (torch.rand(B, T, generator=generator) < (m - base)).long()  # [B, T] edits per position
    steps = torch.arange(max_n)
    acts = (steps % cfg.n_slots).view(1, 1, max_n).expand(B, T, max_n)
    acts = torch.where(steps.view(1, 1, max_n) < n.unsqueeze(-1), acts, torch.full_like(acts, cfg.stop_action))
    return acts.to(device=device, dtype=torch.long).contiguous()


def sample_positions(targets: torch.Tensor, n: int | None, generator: torch.Generator) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """P labelled positions per row, uniformly without replacement, sorted: (rows `[B']`, positions `[B', P]`).

    P = min(n, fewest labelled targets in a row); rows with no labelled target are dropped. n=None: all of them.
    """
    mask = targets != IGNORE_INDEX  # [B, T]
    counts = mask.sum(-1)  # [B]
    rows = torch.nonzero(counts > 0).flatten()
    if rows.numel() == 0:
        return rows, targets.new_zeros(0, 0)
    P = int(counts[rows].min()) if n is None else min(n, int(counts[rows].min()))
    weights = mask[rows].double().cpu()
    pos = torch.multinomial(weights, P, replacement=False, generator=generator)  # [B', P]
    return rows, pos.sort(dim=-1).values.to(targets.device)


@torch.no_grad()
def default_lambdas(model: PrismeModel, tokens: torch.Tensor, quantiles: Sequence[float] = LAMBDA_QUANTILES,
                    cost: torch.Tensor | None = None, budget: int | None = None) -> list[float]:
    """A lambda grid from 0 (edit whenever some value is positive) to where few positions still edit.

    At step 0 a position edits iff some action has value_a - lambda * cost_a > 0, i.e. lambda < lambda* =
    max_a value_a / cost_a (the price is the `action_cost` proxy). The grid is 0 plus quantiles of lambda* over the
    positions of `tokens` `[B, T]` that would edit at lambda = 0, rounded to 3 significant digits. `budget`: the
    controller's max_budget (default r_max), which its features see.
    """
    cfg = model.cfg
    budget = cfg.r_max if budget is None else budget
    cost = model.action_cost if cost is None else cost
    ctx = model.encode(tokens)
    B, T = tokens.shape
    dev = tokens.device
    zc, match = model.controller_inputs(ctx)
    preds = model.controller(zc, ctx.S0, ctx.S0, torch.zeros(B, T, cfg.n_slots, dtype=torch.long, device=dev),
                             torch.zeros(B, T, cfg.n_actions, dtype=torch.bool, device=dev),
                             torch.zeros(B, T, dtype=torch.long, device=dev),
                             torch.full((B, T), budget, dtype=torch.long, device=dev), match)
    lam_star = (preds.value / cost).amax(-1).flatten().double()  # [B*T]
    lam_star = lam_star[lam_star > 0]
    grid = [0.0]
    if lam_star.numel():
        qs = torch.quantile(lam_star.cpu(), torch.tensor(list(quantiles), dtype=torch.float64))
        grid += [float(f"{float(q):.3g}") for q in qs]
    return sorted(set(grid))
