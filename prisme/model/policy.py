"""What the workspace runs, as one typed argument: the deployed policy (`Controller`: the controller, and on a
router model the router at step 0) or forced actions (`Forced`), each checked when it is made; `BACKBONE` is the
bypass. A controller given no price runs at its model's default (`Price`: 0.0 unless the model was loaded from a
checkpoint whose config set one). Every call checks its policy against its model once (`check_policy` ->
`StepPolicy`, the one form the rollouts and the decode plans read; a decode state keeps it per policy object).

Notation: B rows, Q query positions per row, R action steps, A actions.

    state.decode_step(tokens, policy=Controller(max_budget=1, lambda_cost=0.02))
    state.prefill(prompt, logits="all", policy=Forced(actions, budget=2))
    generate(model, prompts, 16, policy=Controller(8, target_cost=1.5))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from prisme.checks import check_max_budget, check_price, is_int, is_number
from prisme.model.workspace import check_cost, check_forced


@dataclass(frozen=True, eq=False)
class Controller:
    """The deployed policy: at each position the controller edits (on a router model the router decides step 0 and
    the controller runs after it where the router fired) until STOP or `max_budget` steps; `max_budget=0` is the
    backbone alone, bitwise.

    Args:
        max_budget: steps per position, an int in [0, r_max].
        lambda_cost: the price of compute (None: the model's default, `Price`); kappa_risk: the risk aversion (None:
            the model's default).
        cost: `[A]` price of each action (None: the cost model's proxy at `cfg.cost_context`).
        target_cost: generation only: find lambda_cost for this mean relative cost per token (ops / backbone ops)
            on the prompts (`prisme.decoding.generate.calibrate_lambda`), instead of giving it.
    """

    max_budget: int = 0
    lambda_cost: float | None = None
    kappa_risk: float | None = None
    cost: torch.Tensor | None = None
    target_cost: float | None = None

    def __post_init__(self) -> None:
        if not is_int(self.max_budget) or self.max_budget < 0:
            raise ValueError(f"max_budget must be an int >= 0, got {self.max_budget!r}")
        check_price("lambda_cost", self.lambda_cost)
        check_price("kappa_risk", self.kappa_risk)
        if self.cost is not None and not isinstance(self.cost, torch.Tensor):
            raise ValueError(f"cost must be None or an [A] tensor of prices per action, got "
                             f"{type(self.cost).__name__}")
        if self.target_cost is not None:
            if self.lambda_cost is not None:
                raise ValueError("give lambda_cost or target_cost, not both")
            if not is_number(self.target_cost) or self.target_cost < 1:
                raise ValueError(f"target_cost must be a finite number >= 1 (a mean cost per token relative to the "
                                 f"backbone's: 1 is the backbone alone), got {self.target_cost!r}")


@dataclass(frozen=True)
class Price:
    """A model's default prices (`PrismeModel.default_price`): what a controller given none runs at. 0.0 each, unless
    the model was loaded from a checkpoint whose config still held them (`prisme.config.MOVED_CONFIG_FIELDS`)."""

    lambda_cost: float = 0.0
    kappa_risk: float = 0.0

    def __post_init__(self) -> None:
        for name in ("lambda_cost", "kappa_risk"):
            if getattr(self, name) is None:
                raise ValueError(f"a default price is a number: {name} must be a finite number >= 0, got None")
            check_price(name, getattr(self, name))

    def fill(self, lambda_cost: float | None, kappa_risk: float | None) -> tuple[float, float]:
        """(lambda_cost, kappa_risk), each given value or else this default."""
        return (self.lambda_cost if lambda_cost is None else lambda_cost,
                self.kappa_risk if kappa_risk is None else kappa_risk)


@dataclass(frozen=True, eq=False)
class Forced:
    """Forced actions instead of a policy: `actions` `[B, Q, R]` ids in [0, A+1] (STOP = A pads unused steps and is
    absorbing, DENSE = A+1; R <= r_max, R = 0 is the bypass), with each position's `budget` (an int or `[B, Q]` in
    [1, r_max], default R) driving the editor's remaining-budget input."""

    actions: torch.Tensor
    budget: int | torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.actions, torch.Tensor) or self.actions.dim() != 3:
            shape = tuple(self.actions.shape) if isinstance(self.actions, torch.Tensor) else type(self.actions).__name__
            raise ValueError(f"forced actions must be a [B, Q, R] tensor of action ids, got {shape}")


BACKBONE = Controller()
"""The bypass: no workspace step anywhere (the backbone's logits, bitwise)."""
Policy = Controller | Forced


@dataclass
class StepPolicy:
    """A policy checked against its model once (`check_policy`), in the one form every path below the surface reads
    (`forward_policy`, the rollouts, every decode plan): a controller policy (max_budget >= 0, 0 the bypass) with
    its price filled in (the model's default where none was given) and its cost vector checked, or forced actions
    with their budgets."""

    max_budget: int = 0
    lambda_cost: float | None = None
    kappa_risk: float | None = None
    cost: torch.Tensor | None = None  # [A]
    actions: torch.Tensor | None = None  # [B, Q, R] forced
    budget: torch.Tensor | None = None  # [B, Q] forced budgets

    @property
    def n_steps(self) -> int:
        """R: the steps the workspace runs (0: the backbone alone)."""
        return self.max_budget if self.actions is None else self.actions.shape[-1]

    def narrow(self, start: int, length: int) -> StepPolicy:
        """The same arguments for query positions start..start+length-1 (forced actions are per position)."""
        if self.actions is None:
            return self
        return StepPolicy(actions=self.actions[:, start:start + length], budget=self.budget[:, start:start + length])

    def rows(self, idx: torch.Tensor) -> StepPolicy:
        """The same arguments for the rows `idx` `[b]`."""
        if self.actions is None:
            return self
        return StepPolicy(actions=self.actions[idx], budget=self.budget[idx])


def check_policy(model: nn.Module, policy: Controller | Forced | None, shape: tuple[int, int] | None = None,
                 tokens: torch.Tensor | None = None) -> StepPolicy:
    """`policy` checked against `model`, once (the only place a budget is checked and a default price filled in):
    None or a zero budget is the bypass; a `Controller`'s budget must lie in [0, r_max] (0 without a workspace) and
    its cost vector hold A finite prices >= 0 (None: the model's `action_cost`); `Forced` actions `[B, Q, R]` must be
    valid ids with budgets in [1, r_max] for queries of `shape` (B, Q) (or those of `tokens` `[B, Q]`). A
    `target_cost` is found by calibration in generation (`prisme.decoding.generate`), never here. ValueError naming
    what is wrong."""
    cfg = model.cfg
    if policy is None:
        return StepPolicy()
    if isinstance(policy, Forced):
        actions, budget = policy.actions, policy.budget
        if tokens is None:
            if tuple(actions.shape[:2]) != tuple(shape):
                raise ValueError(f"forced actions must have shape [B, Q, R] = [{shape[0]}, {shape[1]}, R], got "
                                 f"{tuple(actions.shape)}")
            if actions.shape[-1] == 0:
                return StepPolicy()
            tokens = torch.zeros(shape, dtype=torch.long, device=actions.device)
        if not cfg.use_workspace and actions.shape[-1] > 0:
            raise ValueError("this model has no workspace (use_workspace=False): forced actions need one")
        if budget is not None and torch.is_tensor(budget):
            budget = budget.to(actions.device)
        budget = check_forced(cfg, tokens, actions, budget)  # ids, R <= r_max, budgets in [1, r_max]
        return StepPolicy(actions=actions.long(), budget=budget)
    if not isinstance(policy, Controller):
        raise ValueError(f"policy must be a prisme.model.policy.Controller or Forced (or None: the backbone "
                         f"alone), got {type(policy).__name__}")
    if policy.target_cost is not None:
        raise ValueError("target_cost is found by calibration in generate(); a decode step takes lambda_cost")
    check_max_budget(policy.max_budget, cfg.r_max)
    if policy.max_budget == 0:
        return StepPolicy()
    check_max_budget(policy.max_budget, cfg.r_max, cfg.use_workspace)
    lam, kap = model.default_price.fill(policy.lambda_cost, policy.kappa_risk)
    return StepPolicy(max_budget=policy.max_budget, lambda_cost=lam, kappa_risk=kap,
                      cost=check_cost(policy.cost, model.action_cost))
