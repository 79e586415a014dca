"""What a workspace call runs, checked once: a controller policy or forced actions (`StepPolicy`), and what a routed
decode step reads of the decode state that calls it (`DecodeRows`).

Notation: B rows, Q query positions per row, R action steps, A actions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn

from prisme.config import PrismeConfig
from prisme.model.attention import KVCache
from prisme.model.bank import BankCache


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

    @property
    def lengths(self) -> list[int]: ...
