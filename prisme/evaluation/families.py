"""The evaluation's policies by name (the command line's and the studies' vocabulary, `POLICY_FAMILIES`), with the
settings they share (`PolicySettings`), built by `standard_policies`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prisme.evaluation.policies import (
    BackboneRows,
    ControllerRows,
    DenseRows,
    FixedRows,
    OracleRows,
    Policy,
    RandomRows,
    ReferenceRows,
    RouterRows,
    _controller_budget,
)
from prisme.model.prisme import PrismeModel

# ---------------------------------------------------------------------------------------------------------- by name
POLICY_FAMILIES = ("backbone", "matched", "fixed", "random", "dense", "controller", "router", "oracle")  # the CLI's
BY_NAME = {"backbone": BackboneRows, "fixed": FixedRows, "random": RandomRows, "dense": DenseRows,
           "controller": ControllerRows, "router": RouterRows, "oracle": OracleRows}


@dataclass(frozen=True)
class PolicySettings:
    """The settings `standard_policies` gives its families' policies. Checked here, once: prices and the risk
    aversion (a budget against the model, and the oracle's positions, where a policy is made)."""

    budgets: Sequence[int] | None = None  # n of the fixed / random n x k rows and the dense rows (default: BUDGETS
    #   up to r_max)
    ks: Sequence[int] = (1, 2)  # slots per action of the fixed / random rows
    lambdas: Sequence[float] | None = None  # the controller's prices (default: `default_lambdas` on the first batch)
    oracle_lambdas: Sequence[float] | None = None  # the oracle's prices (default: lambdas)
    oracle_positions: int | None = 16  # labelled positions per sequence the oracle samples (None: all)
    controller_budget: int | None = None  # max_budget of the controller, equal-edits and oracle rows (default r_max)
    kappa_risk: float | None = None  # the controller's risk aversion (default: the model's default price)

    def __post_init__(self) -> None:
        kappa = self.kappa_risk
        if kappa is not None and (isinstance(kappa, bool) or not isinstance(kappa, (int, float))
                                  or not math.isfinite(kappa) or kappa < 0):
            raise ValueError(f"kappa_risk must be a finite number >= 0, got {kappa!r}")
        for what, lams in (("lambdas", self.lambdas), ("oracle_lambdas", self.oracle_lambdas)):
            if lams is not None and (not list(lams) or any(isinstance(x, bool) or not isinstance(x, (int, float))
                                                           or not math.isfinite(x) or x < 0 for x in lams)):
                raise ValueError(f"{what} must be a non-empty list of finite floats >= 0, got {lams!r}")


def standard_policies(model: PrismeModel, families: Sequence[str] | None = None,
                      settings: PolicySettings | None = None, *, matched: PrismeModel | None = None,
                      references: dict[str, PrismeModel] | None = None) -> list[Policy]:
    """The policies of the named `families` (`POLICY_FAMILIES`; default: all that apply), each with `settings`
    (`PolicySettings`; default: its defaults). matched: the "backbone+matched" row's model (family "matched");
    references: other backbones scored alone, one row each named by its key, after the backbone and matched rows.
    """
    if not isinstance(model, PrismeModel):
        raise ValueError(f"model must be a PrismeModel, got {type(model).__name__}")
    if families is None:
        names = ["backbone"] + (["matched"] if matched is not None else [])
        if model.cfg.use_workspace:  # a router model's deployed rows are the router's (budget 1), another's the
            #   controller's
            skip = "controller" if model.cfg.router else "router"
            names += [f for f in POLICY_FAMILIES if BY_NAME.get(f, Policy).needs_workspace and f != skip]
    else:
        names = list(dict.fromkeys([families] if isinstance(families, str) else families))
        unknown = [p for p in names if p not in POLICY_FAMILIES]
        if unknown:
            raise ValueError(f"unknown policy name(s) {unknown}; choose from {list(POLICY_FAMILIES)}")
        if not names:
            raise ValueError(f"policies is empty; name at least one of {list(POLICY_FAMILIES)} (or None for all)")
        ws = [f for f in names if BY_NAME.get(f, Policy).needs_workspace]
        if ws and not model.cfg.use_workspace:
            raise ValueError(f"this model has no workspace (use_workspace=False): policies {ws} need one")
        if "matched" in names and matched is None:
            raise ValueError("policy 'matched' needs matched_backbone (a model whose backbone is evaluated alone)")
    if matched is not None and not isinstance(matched, PrismeModel):
        raise ValueError(f"matched_backbone must be a PrismeModel, got {type(matched).__name__}")
    s = settings if settings is not None else PolicySettings()
    _controller_budget(model, s.controller_budget)
    oracle_prices = s.oracle_lambdas if s.oracle_lambdas is not None else s.lambdas  # None: the controller's grid
    oracle_prices = None if oracle_prices is None else list(oracle_prices)
    made = {
        "backbone": lambda: BackboneRows(),
        "matched": lambda: ReferenceRows("backbone+matched", matched, matched=True),
        "fixed": lambda: FixedRows(s.budgets, s.ks),
        "random": lambda: RandomRows(s.budgets, s.ks),
        "dense": lambda: DenseRows(s.budgets),
        "controller": lambda: ControllerRows(None if s.lambdas is None else list(s.lambdas), s.controller_budget,
                                         s.kappa_risk),
        "router": lambda: RouterRows(None if s.lambdas is None else list(s.lambdas), s.kappa_risk),
        "oracle": lambda: OracleRows(oracle_prices, s.oracle_positions, s.controller_budget),
    }
    out = [made[f]() for f in names]
    at = max([0] + [i + 1 for i, p in enumerate(out) if isinstance(p, (BackboneRows, ReferenceRows))][:1]
             + [i + 1 for i, p in enumerate(out) if isinstance(p, ReferenceRows)])
    out[at:at] = [ReferenceRows(name, ref) for name, ref in (references or {}).items()]
    return out
