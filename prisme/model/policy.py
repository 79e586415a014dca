"""What the workspace runs, as one typed argument: the deployed policy (`Controller`: the controller, and on a
router model the router at step 0) or forced actions (`Forced`), each checked when it is made; `BACKBONE` is the
bypass. A controller given no price runs at its model's default (`Price`: 0.0 unless the model was loaded from a
checkpoint whose config set one). A decode state checks a policy against its model once per call (`StepPolicy`, what
its paths read). Also what a routed decode step reads of the decode state that calls it (`DecodeRows`).

Notation: B rows, Q query positions per row, R action steps, A actions.

    state.decode_step(tokens, policy=Controller(max_budget=1, lambda_cost=0.02))
    state.prefill(prompt, logits="all", policy=Forced(actions, budget=2))
    generate(model, prompts, 16, policy=Controller(8, target_cost=1.5))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn

from prisme.checks import check_price, is_int, is_number
from prisme.config import PrismeConfig
from prisme.model.attention import KVCache
from prisme.model.bank import BankCache
from prisme.options import DecodeOptions


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
            if not is_number(self.target_cost):
                raise ValueError(f"target_cost must be a finite number, got {self.target_cost!r}")


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
    """Checked workspace arguments of one call: a controller policy (max_budget >= 0; 0 is the bypass) or forced
    actions with their budgets."""

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


class DecodeRows(Protocol):
    """What a routed decode step (`prisme.model.routed`) reads of the `prisme.model.state.DecodeState` calling it."""

    model: nn.Module  # the PrismeModel
    cfg: PrismeConfig
    cache: KVCache  # the backbone's
    bank: BankCache
    options: DecodeOptions

    @property
    def lengths(self) -> list[int]: ...
