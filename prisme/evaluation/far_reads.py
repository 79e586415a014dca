"""Far reads that need no training, scored as rows beside a model: the exact-copy reference and the continuous cache.

Notation: B rows, T positions, V vocab, G the reference's gates (one per match-length bucket).

**Exact-copy reference** (`ExactCopy`): the next token is the one that followed the most recent earlier occurrence of
the longest common suffix of at least `MIN_LEN` tokens (`prisme.model.bank.suffix.longest_match`), among every
earlier position (`far=None`) or those whose n-gram lies beyond a W-position window (`far=W`: what a local model
cannot see); the model's probability of each target is mixed with it, p = (1 - g) p + g [y = copy], with one gate
per length bucket (`LENGTH_BUCKETS`: 4, 5, 6, 7-8, 9-12, 13-16, 17-24, 25-31, 32 and over: 9 gates) fitted by
maximum likelihood on one text (`fit`, validation) and applied unchanged to another (held-out). A gate that sees
the match length alone: the untrained reference a learned read has to beat (`prisme.model.copy`).

**Continuous cache** (`ContinuousCache`, Grave et al. 2017): p_cache(b) proportional to the sum over earlier positions
j beyond the window with x_j = b of exp(theta h_t . h_{j-1}) (h: the final-normed residual stream, rms 1), mixed in by
a fitted lambda where any such j exists. On a frozen backbone it says whether the stream already holds a key that
finds the right far position: a real share means the keys are adequate and the output path is what fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from prisme.model.bank.suffix import longest_match, match_lengths

MIN_LEN = 4  # the reference's shortest match
LENGTH_BUCKETS = (4, 5, 6, 7, 9, 13, 17, 25, 32)  # lower edges of the gate buckets (tokens): 4, 5, 6, 7-8, ..., 32+
GATE_GRID = 1000  # gate values tried per bucket, in [0, 0.999]


def length_bucket(length: torch.Tensor) -> torch.Tensor:
    """The gate bucket of each match length `[...]`: 0 for no match (< MIN_LEN), else 1 + the bucket's index."""
    edges = torch.tensor(LENGTH_BUCKETS, device=length.device)
    return torch.where(length >= MIN_LEN, torch.bucketize(length, edges, right=True), 0)


def fit_gate(p: torch.Tensor, hit: torch.Tensor) -> float:
    """The gate g in [0, 0.999] that maximises sum log((1 - g) p + g hit) over positions (p: the model's probability
    of each target, hit: whether the copy is the target), by a grid of `GATE_GRID` values; 0 for no position."""
    if p.numel() == 0:
        return 0.0
    g = torch.linspace(0, 0.999, GATE_GRID, dtype=torch.float64)  # [G]
    ll = torch.log((1 - g[:, None]) * p.double()[None] + g[:, None] * hit.double()[None] + 1e-300).sum(1)
    return float(g[int(ll.argmax())])


@dataclass
class ExactCopy:
    """The exact-copy reference (module docstring): `far` = W reads matches beyond a W-position window only (None:
    every earlier one); `gates` `[G + 1]` per length bucket (bucket 0, no match: 0), set by `fit`."""

    far: int | None = None
    gates: torch.Tensor = field(default_factory=lambda: torch.zeros(len(LENGTH_BUCKETS) + 1))

    def match(self, x: torch.Tensor, L: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(each position's length bucket, the token the longest match proposes, -1 for none) `[B, T]` each;
        `L`: `match_lengths(x)` when the caller has it."""
        lm = longest_match(match_lengths(x) if L is None else L, x, MIN_LEN, self.far, MIN_LEN)
        return length_bucket(lm.length), lm.copy

    def fit(self, p: torch.Tensor, bucket: torch.Tensor, copy: torch.Tensor, y: torch.Tensor) -> ExactCopy:
        """Fit the gates on positions where the model gave each target `y` probability `p` (flat tensors of the same
        shape, with `match`'s bucket and copy); returns self."""
        hit = (copy == y).to(torch.float64)
        self.gates = torch.tensor([0.0] + [fit_gate(p[bucket == b], hit[bucket == b])
                                           for b in range(1, len(LENGTH_BUCKETS) + 1)], dtype=torch.float64)
        return self

    def mix(self, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The mixed distribution's log-probabilities `[B, T, V]` of a model's `logits` on the tokens `x` `[B, T]`:
        log((1 - g) softmax(logits) + g onehot(copy)) where a gate is open, the logits bitwise elsewhere."""
        bucket, copy = self.match(x)
        g = self.gates.to(logits.device, logits.dtype)[bucket]  # [B, T]
        p = torch.softmax(logits, -1) * (1 - g).unsqueeze(-1)
        p = p.scatter_add(-1, copy.clamp(min=0).unsqueeze(-1), (g * (copy >= 0)).unsqueeze(-1))
        return torch.where((g > 0).unsqueeze(-1), torch.log(p + torch.finfo(p.dtype).tiny), logits)

    def nll(self, logp_y: torch.Tensor, bucket: torch.Tensor, copy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """-log((1 - g) p + g [y = copy]) `[...]` from the model's log-probability of each target `logp_y`."""
        g = self.gates.to(logp_y.device, torch.float64)[bucket]
        p = logp_y.double().exp()
        return -torch.log((1 - g) * p + g * (copy == y).double() + 1e-300)


CACHE_THETAS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # the continuous cache's inverse temperatures tried
CACHE_LAMBDAS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)  # and its mixing weights


@dataclass
class ContinuousCache:
    """The continuous cache on a frozen residual stream (module docstring): theta and lambda set by `fit`, the window
    W whose outside it reads (None: every earlier position)."""

    far: int | None = None
    theta: float = 1.0
    lam: float = 0.0

    def cache_prob(self, h: torch.Tensor, x: torch.Tensor, y: torch.Tensor, theta: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(p_cache(y_t), whether position t has any cache entry) `[B, T]` each; h `[B, T, d]` the normed stream."""
        B, T, d = h.shape
        t = torch.arange(T, device=h.device)
        prev = F.pad(h[:, :-1], (0, 0, 1, 0))  # [B, T, d]: entry j's key h_{j-1} (0 at j = 0, which is never read)
        ok = (t[None, :] < t[:, None]) & (t[None, :] >= 1)  # [T, T]: j < t, j >= 1
        if self.far is not None:
            ok &= (t[:, None] - t[None, :] + 1) > self.far  # the key's position j - 1 lies beyond the window
        s = theta * (h @ prev.transpose(1, 2)) / math.sqrt(d)  # [B, T, T]
        s = s.masked_fill(~ok, float("-inf"))
        has = ok.any(-1).expand(B, T)
        w = torch.softmax(s.masked_fill(~has[..., None], 0.0), -1).masked_fill(~ok, 0.0)  # [B, T, T]
        return (w * (x[:, None, :] == y[:, :, None])).sum(-1), has

    def fit(self, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> ContinuousCache:
        """theta and lambda maximising the likelihood of `batches` of (h, x, y, log p_model(y)) (grids
        `CACHE_THETAS` x `CACHE_LAMBDAS`); returns self."""
        best = (-math.inf, 1.0, 0.0)
        for theta in CACHE_THETAS:
            parts = [(self.cache_prob(h, x, y, theta), lp) for h, x, y, lp in batches]
            for lam in CACHE_LAMBDAS:
                ll = sum(float(self._mix(lp, pc, has, lam).sum()) for (pc, has), lp in parts)
                if ll > best[0]:
                    best = (ll, theta, lam)
        self.theta, self.lam = best[1], best[2]
        return self

    @staticmethod
    def _mix(logp_y: torch.Tensor, pc: torch.Tensor, has: torch.Tensor, lam: float) -> torch.Tensor:
        lam_t = lam * has.double()
        return torch.log((1 - lam_t) * logp_y.double().exp() + lam_t * pc.double() + 1e-300)

    def nll(self, h: torch.Tensor, x: torch.Tensor, y: torch.Tensor, logp_y: torch.Tensor) -> torch.Tensor:
        """-log of the mixed probability of each target `[B, T]`."""
        pc, has = self.cache_prob(h, x, y, self.theta)
        return -self._mix(logp_y, pc, has, self.lam)
