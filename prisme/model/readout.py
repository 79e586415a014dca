"""DifferentialReadout: the workspace's correction to the residual stream, zero until something is edited.

Notation: N positions, M slots, w width, d backbone width.

    q = W_q z,   r(S) = softmax(q . W_r(S)^T / sqrt(w)) . S   (attention read over the M slots)
    delta = U (r(S) - r(S0))                                  (U: w -> d, zero-initialised)

With `cfg.optimised` the key projection is folded into the query (q . W_r s = (W_r^T q) . s), so the M slots of
each state are never projected: 2 w^2 ops instead of 2 M w^2 per state. Both paths compute the same function.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from prisme.config import PrismeConfig
from prisme.model.attention import linear


class DifferentialReadout(nn.Module):
    def __init__(self, cfg: PrismeConfig):
        super().__init__()
        self.optimised = cfg.optimised
        self.scale = 1.0 / math.sqrt(cfg.w)
        self.W_q = nn.Linear(cfg.w, cfg.w, bias=False)
        self.W_r = nn.Linear(cfg.w, cfg.w, bias=False)
        self.U = nn.Linear(cfg.w, cfg.d_model, bias=False)
        nn.init.zeros_(self.U.weight)

    def read(self, q: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        """Attention read r(S) `[N, w]` of slots S `[N, M, w]`; q `[N, w]` is W_q z, or W_r^T W_q z if optimised."""
        keys = S if self.optimised else linear(S, self._modules["W_r"])  # [N, M, w]
        att = torch.softmax((keys @ q.unsqueeze(-1)).squeeze(-1) * self.scale, dim=-1)  # [N, M]
        return (att.unsqueeze(1) @ S).squeeze(1)  # [N, w]

    def forward(self, S: torch.Tensor, S0: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """S, S0 `[N, M, w]`, z `[N, w]` -> delta `[N, d]` (leaf layers in functional form: `prisme.model.attention`)
        """
        c = self._modules
        q = linear(z, c["W_q"])  # [N, w]
        if self.optimised:
            q = q @ c["W_r"]._parameters["weight"]  # [N, w]: scores q . W_r s = (W_r^T q) . s
        return linear(self.read(q, S) - self.read(q, S0), c["U"])

    def edited(self, S: torch.Tensor, S0: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """`forward` for a decode step's edited rows (S, S0 `[N, M, w]`, z `[N, w]`): both reads as one batched read
        of the two states side by side (the same numbers: each row's scores, softmax and sum are computed alone)."""
        c = self._modules
        q = linear(z, c["W_q"])  # [N, w]
        if self.optimised:
            q = q @ c["W_r"]._parameters["weight"]  # [N, w]
        X = torch.stack((S, S0), 1)  # [N, 2, M, w]
        keys = X if self.optimised else linear(X, c["W_r"])
        att = torch.softmax((keys @ q[:, None, :, None]).squeeze(-1) * self.scale, dim=-1)  # [N, 2, M]
        r = (att.unsqueeze(2) @ X).squeeze(2)  # [N, 2, w]
        return linear(r[:, 0] - r[:, 1], c["U"])
