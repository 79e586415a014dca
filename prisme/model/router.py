"""Router: decides, per position and before any workspace work, whether the workspace runs and its first action.

Notation: B rows, Tq query positions, Tb bank positions, d backbone width, n = `cfg.router_ngram`, A actions.

The value controller costs about as much per step as a small backbone and runs at every position, including the
many where it then stops; a router makes "do nothing" nearly free (Mixture-of-Depths decides with one d-vector per
token). Its features are target-free and causal:

    f_t = [norm(H_t), seen_t]                                    (d + 1; d with router_ngram = 0)
    seen_t = 1 if the n tokens ending at t occurred earlier in the context (ending at some i < t), else 0
    value_a = W_v f_t + b_v (+ U[x_t, a] with router_token)      (A: the predicted drop of the position's loss)

`router_token` adds a learned value per action of the current token x_t (a [V, A] table, zero at init: one lookup
and A adds), for a stream that says little of which token it is at (a backbone whose residual stream is dominated by
one direction: the linear head on norm(H) cannot tell a filler from a key there, `docs/recall.md`).

`seen` is the training-free cue of an induction head, of prompt-lookup decoding and of the associative-recall slices
of Zoology: the current n-gram was seen before, followed by something the workspace can read in the bank. It costs
n T comparisons of token ids and no weights; the head costs 2 (d + 1) A (`prisme.costs.analytic.router_ops`).
`DecodeState` keeps the token ids for it. `select` takes the argmax of value_a - lambda cost_a, or STOP when no
score beats 0 (ties go to STOP), as the controller's rule does. The `router` training stage regresses the head on
the oracle's true loss drops at step 0 (`prisme.training.oracle_objectives.RouterObjective`); deployed, it reads no
target.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.config import PrismeConfig
from prisme.model.attention import RMSNorm
from prisme.model.bank.tables import version_counter
from prisme.model.controller import argmax_or_stop


def ngram_seen(ids: torch.Tensor, pos: torch.Tensor, n: int) -> torch.Tensor:
    """Whether the n tokens ending at each query position occurred earlier in its row.

    Args:
        ids: `[B, Tb]` token ids of the context (positions past a row's length are never read: i < pos).
        pos: `[B, Q]` absolute query positions (< Tb).
        n: n-gram length >= 1.
    Returns:
        `[B, Q]` bool: some i < pos with ids[i - m] == ids[pos - m] for m = 0..n-1 (and i >= n - 1, pos >= n - 1).
    """
    B, Tb = ids.shape
    idx = torch.arange(Tb, device=ids.device)
    hit = pos.unsqueeze(-1) > idx  # [B, Q, Tb]: earlier positions only
    for m in range(n):
        qm = (pos - m).clamp(min=0)  # [B, Q]
        q_tok = ids.gather(1, qm)  # [B, Q]
        k_tok = torch.cat([ids.new_full((B, m), -1), ids[:, :Tb - m]], dim=1) if m else ids  # [B, Tb]: ids[i - m]
        hit = hit & (k_tok.unsqueeze(1) == q_tok.unsqueeze(-1)) & (pos - m >= 0).unsqueeze(-1)
    return hit.any(-1)


def ngram_seen_at(ids: torch.Tensor, p: int, n: int) -> torch.Tensor:
    """`ngram_seen` of one query position `p` shared by every row (a decode step of rows of one length): `[B, 1]`,
    the same answer from the n windows of earlier positions alone (no `[B, Q, Tb]` mask; 2n + 2 calls instead of
    about 6n + 5).

    Args:
        ids: `[B, Tb]` token ids, Tb > p (positions past p are never read).
        p: the query position, an int >= 0.
        n: n-gram length >= 1.
    """
    L = p - n + 1  # candidate end positions i = n-1 .. p-1
    if L <= 0:
        return torch.zeros(ids.shape[0], 1, dtype=torch.bool, device=ids.device)
    hit = None
    for m in range(n):
        eq = ids.narrow(1, n - 1 - m, L) == ids.narrow(1, p - m, 1)  # [B, L]: ids[i - m] == ids[p - m]
        hit = eq if hit is None else hit & eq
    return hit.any(-1, keepdim=True)


class Router(nn.Module):
    def __init__(self, cfg: PrismeConfig):
        super().__init__()
        self.cfg = cfg
        self.ngram = cfg.router_ngram
        self.head = nn.Linear(cfg.d_model + (1 if self.ngram > 0 else 0), cfg.n_actions)
        if cfg.router_token:
            self.token_value = nn.Embedding(cfg.vocab_size, cfg.n_actions)  # U [V, A]
            nn.init.zeros_(self.token_value.weight)

    def forward(self, H: torch.Tensor, seen: torch.Tensor | None, tok: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted loss drop of each action at step 0, `[B, Tq, A]`.

        Args:
            H: `[B, Tq, d]` residual stream at the queries.
            seen: `[B, Tq]` bool (`ngram_seen`), None with router_ngram = 0.
            tok: `[B, Tq]` the token at each query (`PrismeModel.router_tok`), None without router_token.
        """
        f = F.rms_norm(H, (H.shape[-1],), eps=self.cfg.norm_eps)  # [B, Tq, d]
        if self.ngram > 0:
            self._check_seen(seen)
            f = torch.cat([f, seen.unsqueeze(-1).to(f.dtype)], dim=-1)  # [B, Tq, d + 1]
        value = self.head(f)
        return value if not self.cfg.router_token else value + self._token_value(tok)  # [B, Tq, A]

    def _token_value(self, tok: torch.Tensor | None) -> torch.Tensor:
        return self.token_value(self._token_ids(tok))  # [B, Tq, A]

    @staticmethod
    def _token_ids(tok: torch.Tensor | None) -> torch.Tensor:
        if tok is None:
            raise ValueError("this router reads the token at each position (router_token): pass the token ids "
                             "(model.streams keeps them)")
        return tok

    def select(self, value: torch.Tensor, cost: torch.Tensor, lambda_cost: float) -> torch.Tensor:
        """argmax_a value_a - lambda cost_a `[...]`, or STOP (A) where no score beats 0 (ties go to STOP)."""
        return argmax_or_stop(value - float(lambda_cost) * cost, self.cfg.stop_action)  # score [..., A]

    def decide(self, H: torch.Tensor, seen: torch.Tensor | None, cost: torch.Tensor, lambda_cost: float,
               normed: tuple[torch.Tensor, nn.Module] | None = None, tok: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`select(forward(H, seen), cost, lambda_cost)` in fewer calls, for a decode step: (the best action, whether
        it beats STOP) `[B, Tq]` each, the rule's `where` left to the positions that fire (the max of `scores`)."""
        best, action = self.scores(H, seen, cost, lambda_cost, normed, tok).max(dim=-1)
        return action, best > 0

    def scores(self, H: torch.Tensor, seen: torch.Tensor | None, cost: torch.Tensor, lambda_cost: float,
               normed: tuple[torch.Tensor, nn.Module] | None = None, tok: torch.Tensor | None = None) -> torch.Tensor:
        """The scores value_a - lambda cost_a `[B, Tq, A]` that `select` reads (a position fires iff its best score is
        > 0). The price is folded into the bias (b - lambda cost, and b - lambda cost + the n-gram column, kept per
        price and weights) and each position's bias is picked by its n-gram feature, so the step is a select and one
        matrix product: the same scores as `forward` to rounding (the terms are summed in another order).

        normed: (h, norm), h = norm(H) the backbone's final norm, which the step computes for its logits anyway. Where
        that norm is an RMSNorm of this router's eps whose gain g has no zero entry, norm(H) without gain is h / g:
        the head's columns are divided by g once (kept with the folded bias) and h is read instead of a second norm
        of H. Otherwise (a LayerNorm, another eps, a zero gain) H is normed here, as `forward` does."""
        gain = (normed[1]._parameters["weight"] if normed is not None and _plain_rms_norm(normed[1], self.cfg.norm_eps)
                else None)
        Wt, b0, b1, shared = self._folded(cost, float(lambda_cost), gain)[4]
        f = normed[0] if shared else F.rms_norm(H, (H.shape[-1],), eps=self.cfg.norm_eps)  # [B, Tq, d]
        if b1 is not None:
            self._check_seen(seen)
            bias = torch.where(seen.reshape(-1, 1), b1, b0)  # [B Tq, A]
        else:
            bias = b0  # [A]
        if self.cfg.router_token:
            table = self._modules["token_value"]._parameters["weight"]  # [V, A]
            bias = bias + F.embedding(self._token_ids(tok).reshape(-1), table)  # [B Tq, A]
        return torch.addmm(bias, f.reshape(-1, f.shape[-1]), Wt).view(*f.shape[:-1], -1)  # [B, Tq, A]

    def _check_seen(self, seen: torch.Tensor | None) -> None:
        if seen is None:
            raise ValueError(f"this router reads whether the last {self.ngram} tokens were seen before: pass the "
                             f"token ids (model.streams keeps them)")

    def _folded(self, cost: torch.Tensor, lam: float, gain: torch.Tensor | None) -> tuple:
        """(W `[A, d]`, the n-gram column `[A]` or None, b - lam cost `[A]`, whether W is divided by `gain`, and what
        `scores` reads: (W^T `[d, A]` contiguous, b - lam cost, b - lam cost + the n-gram column or None, the
        same flag)), rebuilt when the price, the cost vector or a weight changes (identity, storage and version
        counter: an in-place update or a move rebuilds). W is divided by a given gain `[d]` unless some entry of it
        is 0."""
        head = self._modules["head"]._parameters  # (registry reads: this runs at every decode step)
        w, b = head["weight"], head["bias"]
        key = (lam, version_counter(w), version_counter(b), w.data_ptr(), cost.data_ptr(), version_counter(cost),
               None if gain is None else (gain.data_ptr(), version_counter(gain)))
        cached = self.__dict__.get("_folded_cache")
        if (cached is not None and cached[0] is w and cached[1] is cost and cached[2] is gain
                and cached[3] == key):
            return cached[4]
        with torch.no_grad():
            d = self.cfg.d_model
            W = w[:, :d].contiguous()
            shared = gain is not None and bool((gain != 0).all())  # a host read, once per fold
            W = W / gain if shared else W
            u = w[:, d].clone() if self.ngram > 0 else None
            b0 = b - lam * cost
            out = (W, u, b0, shared, (W.t().contiguous(), b0, None if u is None else b0 + u, shared))
        self.__dict__["_folded_cache"] = (w, cost, gain, key, out)  # not a module attribute: never in a state dict
        return out


def _plain_rms_norm(norm: nn.Module, eps: float) -> bool:
    """Whether `norm` is the backbone's RMSNorm (a gain, no bias) at `eps`."""
    return isinstance(norm, RMSNorm) and norm.eps == eps


def router_features(cfg: PrismeConfig, ids: torch.Tensor | None, pos: torch.Tensor | int,
                    seen: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What the router reads of the context besides norm(H), for queries at positions `pos` `[B, Q]` in the token
    ids `ids` `[B, Tb]` (an int: one position shared by every row, `[B, 1]`): whether the query's n-gram occurred
    earlier (`ngram_seen`, `ngram_seen_at`, or `seen` where the caller knows it; None without `cfg.router_ngram`) and
    the token at the query (None without `cfg.router_token`). Both None for a model without a router."""
    if not cfg.router:
        return None, None
    if ids is None and (cfg.router_ngram or cfg.router_token):
        raise ValueError("this model's router reads the token ids: pass model.streams(tokens), not a tensor")
    tok = None
    if not cfg.router_ngram:
        seen = None
    elif seen is None:
        seen = ngram_seen_at(ids, pos, cfg.router_ngram) if isinstance(pos, int) else ngram_seen(ids, pos,
                                                                                                cfg.router_ngram)
    if cfg.router_token:
        tok = ids.narrow(1, pos, 1) if isinstance(pos, int) else ids.gather(1, pos)
    return seen, tok
