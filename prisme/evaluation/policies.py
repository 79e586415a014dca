"""The policies an evaluation compares (SPEC §5): backbone, matched backbone, fixed, random and dense action plans,
the controller at each price with its equal-edits baseline, and the oracle; their forced action tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prisme.checks import is_int
from prisme.config import PrismeConfig
from prisme.data.text import IGNORE_INDEX
from prisme.model.prisme import PrismeModel

POLICY_FAMILIES = ("backbone", "matched", "fixed", "random", "dense", "controller", "oracle")
ROW_FAMILIES = (*POLICY_FAMILIES, "equal_edits", "reference")  # equal_edits rows come with the controller's;
#   reference rows are other backbones scored on the same targets (`references`, e.g. one layer deeper)
WORKSPACE_FAMILIES = ("fixed", "random", "dense", "controller", "oracle")
BUDGETS = (1, 2, 4, 8)
LAMBDA_QUANTILES = (0.25, 0.5, 0.75, 0.95)


# ---------------------------------------------------------------------------------------------------------- policies
@dataclass(frozen=True)
class _Policy:
    name: str
    family: str
    n: int = 0  # actions (forced) or max budget (controller / oracle)
    k: int = 0  # 1 (slots), 2 (pairs), M (dense)
    lam: float | None = None
    of: str | None = None  # equal_edits: the controller row whose mean edits it matches


def _fmt_lambda(lam: float) -> str:
    return "0" if lam == 0 else f"{lam:.3g}"


def forced_actions(cfg: PrismeConfig, family: str, n: int, k: int, shape: tuple[int, int],
                   generator: torch.Generator | None = None, device: torch.device | None = None) -> torch.Tensor:
    """Forced actions `[B, T, n]` of a fixed / random / dense policy.

    fixed: step r edits slot r mod M (k = 1) or pair M + (r mod M/2) (k = 2) at every position; random: uniform
    slots or pairs from `generator`; dense: DENSE (A+1) at every step.
    """
    B, T = shape
    M, A = cfg.n_slots, cfg.n_actions
    steps = torch.arange(n)
    if family == "fixed":
        row = steps % M if k == 1 else M + steps % (M // 2)  # [n]
        acts = row.view(1, 1, n).expand(B, T, n)
    elif family == "random":
        lo, hi = (0, M) if k == 1 else (M, A)
        acts = torch.randint(lo, hi, (B, T, n), generator=generator)
    elif family == "dense":
        acts = torch.full((B, T, n), cfg.dense_action)
    else:
        raise ValueError(f"forced_actions: unknown family {family!r}; expected fixed, random or dense")
    return acts.to(device=device, dtype=torch.long).contiguous()


def _plan(model: PrismeModel, families: Sequence[str], lambdas: Sequence[float],
          budgets: Sequence[int] | None = None, oracle_lambdas: Sequence[float] | None = None,
          ks: Sequence[int] = (1, 2), controller_budget: int | None = None) -> list[_Policy]:
    cfg = model.cfg
    R = cfg.r_max if controller_budget is None else controller_budget
    if not is_int(R) or not 1 <= R <= cfg.r_max:
        raise ValueError(f"controller_budget must be an int in [1, r_max={cfg.r_max}], got {R!r}")
    ns = [n for n in (BUDGETS if budgets is None else budgets) if n <= cfg.r_max]
    out: list[_Policy] = []
    for fam in families:
        if fam == "backbone":
            out.append(_Policy("backbone", fam))
        elif fam == "matched":
            out.append(_Policy("backbone+matched", fam))
        elif fam in ("fixed", "random"):
            out += [_Policy(f"{fam}_{n}xk{k}", fam, n, k) for k in ks for n in ns]
        elif fam == "dense":
            out += [_Policy(f"dense_{n}", fam, n, cfg.n_slots) for n in ns]
        elif fam in ("controller", "oracle"):
            for lam in (oracle_lambdas if fam == "oracle" and oracle_lambdas is not None else lambdas):
                name = f"{fam}(lambda={_fmt_lambda(lam)})"
                out.append(_Policy(name, fam, R, 0, float(lam)))
                if fam == "controller":  # right after it: uniform allocation of the same mean number of edits
                    out.append(_Policy(f"equal_edits(lambda={_fmt_lambda(lam)})", "equal_edits", R, 1,
                                       float(lam), of=name))
    return out


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
