"""ValueController: prices each candidate action from target-free features, and `select` picks one or STOP.

Notation: N positions, M slots, A actions, w width, F = 4w + M + A + r_max + 1 features.

Per step, a shared state MLP `[F -> 2w -> w]` (SiLU) maps the features
    f = [z, mean_m S, mean_m (S - S0), max_m S, slot_edits (M counts), taken (A, 0/1), one_hot(step, r_max),
         remaining / budget]
to phi `[w]`. One shared `w x w` projection W_act maps each action's slot summary (the mean of its slots' current
states) to h_a `[w]`. Then, with no matmul:
    value_a = <phi[:w/2], h_a[:w/2]> + b_v[a]             (predicted drop of this position's next-token loss)
    risk_a  = softplus(<phi[w/2:], h_a[w/2:]> + b_r[a])   (predicted absolute error of value_a)

The controller sees no target and never executes a candidate edit. With `cfg.optimised`, W_act projects the M
slots once and the pair summaries are averaged afterwards (linearity): M w^2 instead of A w^2 per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.checks import is_number
from prisme.config import PrismeConfig


def argmax_or_stop(score: torch.Tensor, stop_action: int, by_mean: bool = False) -> torch.Tensor:
    """The selection rule of the controller and the router: argmax over the actions of `score` `[..., A]`, or
    `stop_action` where the best score (the mean score with `by_mean`) does not beat STOP's 0 (ties go to STOP)."""
    best, idx = score.max(dim=-1)
    if by_mean:
        best = score.mean(dim=-1)
    return torch.where(best > 0, idx, stop_action)


def slot_summaries(X: torch.Tensor) -> torch.Tensor:
    """`[..., M, w]` -> `[..., A, w]`: each action's mean slot (singles, then pairs (2j, 2j+1)); no matmul."""
    return torch.cat([X, 0.5 * (X[..., 0::2, :] + X[..., 1::2, :])], dim=-2)


class BankMatch(nn.Module):
    """How well a position's controller query matches its context in the causal bank (`cfg.controller_bank`): a
    retrieval confidence read before any edit. q_c = W_bank z_c; s_j = q_c . K_j / sqrt(w) over the keys j < t the
    position may read (its own entry, which every position trivially matches, is left out); returns
    [max_j s_j, log mean_j exp s_j] `[..., 2]`, zeros where no earlier key exists. No edit runs, no target is read."""

    def __init__(self, cfg: PrismeConfig):
        super().__init__()
        self.scale = cfg.w ** -0.5
        self.W_bank = nn.Linear(cfg.w, cfg.w, bias=False)

    def forward(self, zc: torch.Tensor, K: torch.Tensor, bank_mask: torch.Tensor) -> torch.Tensor:
        """zc `[B, Tq, w]`, K `[B, Tb, w]`, bank_mask `[B, Tq, Tb]` bool -> `[B, Tq, 2]`."""
        q = self.W_bank(zc)  # [B, Tq, w]
        s = (q @ K.transpose(1, 2)) * self.scale  # [B, Tq, Tb]
        n = bank_mask.sum(-1, keepdim=True)  # [B, Tq, 1] readable keys: a prefix 0..t, so t = n - 1
        earlier = bank_mask & (torch.arange(K.shape[1], device=K.device) < n - 1)  # [B, Tq, Tb] keys j < t
        s = s.masked_fill(~earlier, float("-inf"))
        none = n.squeeze(-1) <= 1  # [B, Tq] position 0 of its row: nothing earlier to match
        top = s.amax(-1).masked_fill(none, 0.0)
        lme = (torch.logsumexp(s, -1) - (n.squeeze(-1) - 1).clamp(min=1).to(s.dtype).log()).masked_fill(none, 0.0)
        return torch.stack([top, lme], dim=-1)


class BackboneEntropy(nn.Module):
    """The entropy of the backbone's own next-token distribution at each position, / log V (`cfg.controller_entropy`):
    `[..., 1]` in [0, 1]. It runs the LM head on H (no target is read)."""

    def forward(self, H: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        logp = torch.log_softmax(head(H).float(), dim=-1)  # [..., V]
        ent = -(logp.exp() * logp).sum(-1, keepdim=True)  # [..., 1]
        return (ent / math.log(logp.shape[-1])).to(H.dtype)


@dataclass
class ControllerOutput:
    value: torch.Tensor  # [..., A]
    risk: torch.Tensor  # [..., A], >= 0


class ValueController(nn.Module):
    def __init__(self, cfg: PrismeConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.w
        self.mlp = nn.Sequential(nn.Linear(cfg.controller_features, 2 * w), nn.SiLU(), nn.Linear(2 * w, w))
        self.W_act = nn.Linear(w, w, bias=False)
        self.b_v = nn.Parameter(torch.zeros(cfg.n_actions))
        self.b_r = nn.Parameter(torch.zeros(cfg.n_actions))
        if cfg.controller_bank:
            self.bank_match = BankMatch(cfg)
        if cfg.controller_entropy:
            self.entropy = BackboneEntropy()

    def features(self, z: torch.Tensor, S: torch.Tensor, S0: torch.Tensor, edits: torch.Tensor,
                 taken: torch.Tensor, step: torch.Tensor, budget: torch.Tensor,
                 match: torch.Tensor | None = None) -> torch.Tensor:
        """Target-free features `[..., F]`; remaining = budget - step - 1, as the editor defines it. `match`: the
        position features `[..., n_position_features]` (bank match, backbone entropy) where the config has them."""
        remaining = (budget - step - 1).to(S.dtype) / budget.to(S.dtype)
        parts = [z, S.mean(-2), (S - S0).mean(-2), S.amax(-2), edits.to(S.dtype), taken.to(S.dtype),
                 F.one_hot(step, self.cfg.r_max).to(S.dtype), remaining.unsqueeze(-1)]
        if self.cfg.n_position_features:
            if match is None or match.shape[-1] != self.cfg.n_position_features:
                raise ValueError(f"this controller reads {self.cfg.n_position_features} position features (bank "
                                 f"match, backbone entropy): pass them (model.controller_inputs)")
            parts.append(match.to(S.dtype))
        return torch.cat(parts, dim=-1)

    def forward(self, z: torch.Tensor, S: torch.Tensor, S0: torch.Tensor, edits: torch.Tensor, taken: torch.Tensor,
                step: torch.Tensor, budget: torch.Tensor, match: torch.Tensor | None = None) -> ControllerOutput:
        """Score every action at every position.

        Args:
            z: `[..., w]`; S, S0: `[..., M, w]`; edits: `[..., M]` edit counts per slot; taken: `[..., A]` bool,
            actions already taken at this position; step: `[...]` long in [0, r_max); budget: `[...]` long >= 1;
            match: `[..., 2]` the position's `BankMatch` features (with `cfg.controller_bank` only).
        """
        phi = self.mlp(self.features(z, S, S0, edits, taken, step, budget, match))  # [..., w]
        if self.cfg.optimised:
            h = slot_summaries(self.W_act(S))  # [..., A, w]
        else:
            h = self.W_act(slot_summaries(S))  # [..., A, w]
        half = self.cfg.w // 2
        phi = phi.unsqueeze(-2)  # [..., 1, w]
        value = (h[..., :half] * phi[..., :half]).sum(-1) + self.b_v  # [..., A]
        risk = F.softplus((h[..., half:] * phi[..., half:]).sum(-1) + self.b_r)
        return ControllerOutput(value=value, risk=risk)

    def select(self, preds: ControllerOutput, cost: torch.Tensor, lambda_cost: float = 0.0,
               kappa_risk: float = 0.0) -> torch.Tensor:
        """argmax_a value - lambda cost - kappa risk, or STOP when no score beats STOP's 0 (ties go to STOP).

        With `cfg.controller_select="mean"` the STOP decision compares the mean score over the A actions with 0
        instead of the best one (the max of A noisy estimates is biased up, so the seed's rule edits where the noise
        is largest); the action taken is still the argmax.

        cost `[A]` is the action's price (the cost model's `action_cost_proxy`); lambda_cost, kappa_risk the policy's
        prices (a model's rollout fills in its default price, `PrismeModel.default_price`). Returns `[...]` long.
        """
        for name, v in (("lambda_cost", lambda_cost), ("kappa_risk", kappa_risk)):
            if not is_number(v) or v < 0:  # NaN or inf would silently turn every action into STOP
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        lam, kap = float(lambda_cost), float(kappa_risk)
        score = preds.value - lam * cost - kap * preds.risk  # [..., A]
        # edit or STOP by the best score, or ("mean") by the action-averaged one: no winner's curse
        return argmax_or_stop(score, self.cfg.stop_action, by_mean=self.cfg.controller_select == "mean")
