"""Incremental decoding with the workspace: `DecodeState`, sampling, batched generation (SPEC §4).

Notation: B rows, C new tokens per row in one call (a chunk), Q query positions whose workspace runs, R actions per
position, T_max the state's capacity, V vocab, d backbone width, w workspace width.

A `DecodeState` (allocated by `PrismeModel.new_decode_state`) owns the backbone's KV cache, the source bank K/V
`[B, T_max, w]` and each row's length. Every new position takes the same path as in the parallel `forward_policy`:
one backbone step with the cache; its bank entry appended (only new positions are projected); then its own
workspace, run by the model's own methods on an `EncodedContext` whose queries are the new positions and whose bank
is the cache (`rollout_policy`, or `rollout_forced` for forced actions, then `logits_from_state`). Reusing those
methods is what makes decoding exact: forced-token decoding in chunks of any size gives, in float64, the logits
(to ~1e-12) and action traces of one teacher-forced `forward_policy` call (tests/test_generate.py).

Ragged batches: rows are right-padded and carry their own lengths; `n_new[b]` says how many of a chunk's C tokens of
row b are real. Outputs at padding positions are unspecified (`StepOutput.valid` marks the real ones); rows with no
new token take no part in the workspace.

Every public entry point checks its whole input before it touches the state: a ValueError leaves the state as it was.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .backbone import check_tokens
from .checks import is_int, is_number
from .costs import trace_cost
from .model import EncodedContext, PrismeModel, Streams

LOGITS_MODES = ("last", "all", "none")


@dataclass
class StepOutput:
    """What one `decode_step` (or `prefill`) computed for its Q query positions per row."""

    logits: torch.Tensor | None  # [B, Q, V]; None for prefill(logits="none")
    actions: torch.Tensor  # [B, Q, R] applied actions, STOP-absorbed (STOP at padding); R = 0 on the bypass
    n_edits: torch.Tensor  # [B, Q] non-STOP actions per position
    controller_steps: torch.Tensor  # [B, Q] controller evaluations per position (0 for forced actions)
    positions: torch.Tensor  # [B, Q] absolute position of each query (its context is position + 1)
    valid: torch.Tensor  # [B, Q] bool: real positions (False at right padding)


@dataclass
class _Workspace:
    """Checked workspace arguments of one call: a controller policy (max_budget >= 0) or forced actions."""

    max_budget: int = 0
    lambda_cost: float | None = None
    kappa_risk: float | None = None
    cost: torch.Tensor | None = None  # [A]
    actions: torch.Tensor | None = None  # [B, Q, R] forced
    budget: torch.Tensor | None = None  # [B, Q] forced budgets

    @property
    def n_steps(self) -> int:
        return self.max_budget if self.actions is None else self.actions.shape[-1]

    def narrow(self, start: int, length: int) -> _Workspace:
        """The same arguments for query positions start..start+length-1 (forced actions are per position)."""
        if self.actions is None:
            return self
        return _Workspace(actions=self.actions[:, start:start + length], budget=self.budget[:, start:start + length])

    def rows(self, idx: torch.Tensor) -> _Workspace:
        if self.actions is None:
            return self
        return _Workspace(actions=self.actions[idx], budget=self.budget[idx])


class DecodeState:
    """Backbone KV cache + source bank K/V + per-row lengths for incremental decoding; allocate with
    `model.new_decode_state(batch_size, max_len, dtype)`.

    Args:
        model: the `PrismeModel` whose weights decode (the state holds a reference, not a copy).
        batch_size: rows B.
        max_len: capacity T_max per row (default: the model's `max_seq_len`).
        dtype: must be the model's parameter dtype (default); convert the model with `model.to(dtype)` first.
        bank: keep the source bank (default: the model has a workspace). A state without one decodes with the
            backbone alone (`max_budget=0`) and pays nothing for the bank, as the cost model's budget-0 row assumes.
    """

    def __init__(self, model: PrismeModel, batch_size: int, max_len: int | None = None,
                 dtype: torch.dtype | None = None, bank: bool | None = None):
        cfg = model.cfg
        param = model.backbone.tok_emb.weight
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int)):
            raise ValueError(f"max_len must be an int or None, got {max_len!r}")
        if dtype is not None and dtype != param.dtype:
            raise ValueError(f"DecodeState dtype {dtype} differs from the model's {param.dtype}: convert the model "
                             f"with model.to({dtype}) instead")
        bank = cfg.use_workspace if bank is None else bool(bank)
        if bank and not cfg.use_workspace:
            raise ValueError("this model has no workspace (use_workspace=False): a source bank cannot be kept")
        self.model = model
        self.cfg = cfg
        self.cache = model.backbone.new_cache(batch_size, max_len, param.dtype)
        self.batch_size = batch_size
        self.max_len = self.cache.max_len
        self.has_bank = bank
        self.K = param.new_zeros(batch_size, self.max_len, cfg.w) if bank else None  # [B, T_max, w]
        self.V = param.new_zeros(batch_size, self.max_len, cfg.w) if bank else None  # [B, T_max, w]
        # bank_shift: each bank term's normed stream at each row's last position, read by the next key
        n_shift = len(cfg.bank_terms) if bank and cfg.bank_shift else 0
        self.prev = [param.new_zeros(batch_size, cfg.d_model) for _ in range(n_shift)]  # [B, d] each

    # ------------------------------------------------------------------ bookkeeping
    @property
    def lengths(self) -> list[int]:
        """Positions held by each row."""
        return list(self.cache.lengths)

    @property
    def nbytes(self) -> int:
        """Exact payload bytes of the backbone K/V cache and the source bank."""
        bank = 0 if self.K is None else 2 * self.K.numel() * self.K.element_size()
        bank += sum(p.numel() * p.element_size() for p in self.prev)
        return self.cache.nbytes + bank

    def reset(self) -> None:
        """Forget every row (lengths to 0; buffers zeroed so stale entries can never leak)."""
        self.cache.reset()
        if self.K is not None:
            self.K.zero_()
            self.V.zero_()
        for p in self.prev:
            p.zero_()

    # ------------------------------------------------------------------ public steps
    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, n_new: Sequence[int] | None = None, max_budget: int = 0,
                    lambda_cost: float | None = None, kappa_risk: float | None = None,
                    cost: torch.Tensor | None = None, actions: torch.Tensor | None = None,
                    budget: int | torch.Tensor | None = None) -> StepOutput:
        """Append one chunk to every row and run each new position's workspace.

        Args:
            tokens: `[B, C]` (or `[B]`: C = 1) ids, right-padded where `n_new[b] < C`.
            n_new: real tokens per row (default C); a row with 0 takes no part in this step.
            max_budget, lambda_cost, kappa_risk, cost: the controller policy, as in `forward_policy`
                (`max_budget=0`: the backbone alone, bitwise).
            actions: `[B, C, R]` forced actions instead of the controller (STOP absorbing, DENSE allowed, R <= r_max),
                with `budget` (int or `[B, C]`, default R) as in `PrismeModel.forward`.
        Returns:
            `StepOutput` with logits `[B, C, V]` and the action trace `[B, C, R]`.
        """
        if isinstance(tokens, torch.Tensor) and tokens.dim() == 1:
            tokens = tokens.unsqueeze(1)  # [B, 1]
        check_tokens(tokens, self.cfg.vocab_size)
        B, C = tokens.shape
        self._check_rows(B)
        n_new = self._check_n_new(n_new, C)
        self._check_capacity(n_new)
        ws = self._check_workspace(B, C, max_budget, lambda_cost, kappa_risk, cost, actions, budget)
        return self._step(tokens, n_new, ws)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: Sequence[int] | torch.Tensor | None = None,
                chunk_size: int | None = None, logits: str = "last", max_budget: int = 0,
                lambda_cost: float | None = None, kappa_risk: float | None = None, cost: torch.Tensor | None = None,
                actions: torch.Tensor | None = None, budget: int | torch.Tensor | None = None) -> StepOutput:
        """Append prompts `[B, T]` (right-padded; row b has `lengths[b]` real tokens, max(lengths) == T).

        Args:
            chunk_size: backbone chunk size (default T: one chunk).
            logits: where the workspace runs and logits are returned:
                "last": each row's last prompt position (Q = 1), the logits the first sampled token needs;
                "all": every position (Q = T; the same as `decode_step` over the chunks);
                "none": nowhere (fill the caches only).
            max_budget, lambda_cost, kappa_risk, cost, actions, budget: as in `decode_step`, for the Q query
                positions (forced `actions` are `[B, Q, R]`).
        """
        check_tokens(tokens, self.cfg.vocab_size)
        B, T = tokens.shape
        self._check_rows(B)
        lengths = self._check_lengths(lengths, B, T)
        chunk = T if chunk_size is None else chunk_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {LOGITS_MODES}, got {logits!r}")
        self._check_capacity(lengths)
        Q = {"all": T, "last": 1, "none": 0}[logits]
        if logits == "none" and (max_budget != 0 or actions is not None):
            raise ValueError('prefill(logits="none") runs no workspace: max_budget must be 0 and actions None')
        ws = self._check_workspace(B, Q, max_budget, lambda_cost, kappa_risk, cost, actions, budget)
        chunks = [(i, min(chunk, T - i)) for i in range(0, T, chunk)]
        n_new = [[min(max(n - i, 0), c) for n in lengths] for i, c in chunks]  # real tokens of each chunk per row
        if logits == "all":
            outs = [self._step(tokens[:, i:i + c], n, ws.narrow(i, c)) for (i, c), n in zip(chunks, n_new)]
            return StepOutput(logits=torch.cat([o.logits for o in outs], 1),
                              **{f: torch.cat([getattr(o, f) for o in outs], 1)
                                 for f in ("actions", "n_edits", "controller_steps", "positions", "valid")})
        start = self.lengths
        parts = [self._advance(tokens[:, i:i + c], n) for (i, c), n in zip(chunks, n_new)]
        dev = parts[0].H.device
        pos = torch.tensor([s + L - 1 for s, L in zip(start, lengths)], device=dev).unsqueeze(1)  # [B, 1]
        if logits == "none":
            empty = pos[:, :0]
            return StepOutput(logits=None, actions=empty.unsqueeze(-1), n_edits=empty, controller_steps=empty,
                              positions=empty, valid=empty.bool())
        st = Streams(torch.cat([p.H for p in parts], 1), {k: torch.cat([p.src[k] for p in parts], 1)
                                                           for k in parts[0].src})  # [B, T, d] each
        last = (torch.tensor(lengths, device=dev) - 1).unsqueeze(1)  # [B, 1]
        return self._workspace(st.index(torch.arange(B, device=dev).unsqueeze(1), last), pos, None, None, ws)

    # ------------------------------------------------------------------ internals (inputs already checked)
    def _step(self, tokens: torch.Tensor, n_new: list[int], ws: _Workspace) -> StepOutput:
        B, C = tokens.shape
        start = self.lengths
        st = self._advance(tokens, n_new)  # H [B, C, d] and the source streams
        offsets = torch.arange(C, device=tokens.device)  # [C]
        pos = torch.tensor(start, device=tokens.device).unsqueeze(1) + offsets  # [B, C]
        if all(n == C for n in n_new):
            return self._workspace(st, pos, None, None, ws)
        valid = offsets < torch.tensor(n_new, device=tokens.device)[:, None]  # [B, C]
        keep = [b for b in range(B) if n_new[b] > 0]
        return self._workspace(st, pos, valid, keep, ws)

    def _advance(self, tokens: torch.Tensor, n_new: list[int]) -> Streams:
        """Backbone step with the cache, then append the new positions' bank entries. Returns their streams
        (H `[B, C, d]` and the workspace's source streams)."""
        B, C = tokens.shape
        start = self.lengths
        st = self.model.streams(tokens, self.cache, n_new)  # H [B, C, d]
        H = st.H
        if self.K is not None:
            hs = self.model.bank_inputs(st)  # [B, C, d] per bank term: only the new positions are projected
            K, V = self.model.bank_from_inputs(hs, self.prev if self.prev else None)  # [B, C, w] each
            if self.prev:  # the shift's memory: each row's last real position (padding is never read)
                n_t = torch.tensor(n_new, device=H.device)
                moved = (n_t > 0).unsqueeze(1)  # [B, 1]
                last = (n_t - 1).clamp(min=0).view(B, 1, 1).expand(B, 1, H.shape[-1])  # [B, 1, d]
                for p, h in zip(self.prev, hs):
                    p.copy_(torch.where(moved, h.gather(1, last).squeeze(1).to(p.dtype), p))
            if len(set(start)) == 1 and all(n == C for n in n_new):
                self.K.narrow(1, start[0], C).copy_(K)
                self.V.narrow(1, start[0], C).copy_(V)
            else:
                valid = torch.arange(C, device=H.device) < torch.tensor(n_new, device=H.device)[:, None]  # [B, C]
                rows, cols = valid.nonzero(as_tuple=True)  # real tokens only: padding is never written
                at = cols + torch.tensor(start, device=H.device)[rows]  # their absolute positions
                self.K[rows, at] = K[rows, cols]
                self.V[rows, at] = V[rows, cols]
        return st

    def _workspace(self, st: Streams, pos: torch.Tensor, valid: torch.Tensor | None, keep: list[int] | None,
                   ws: _Workspace) -> StepOutput:
        """Run the workspace of queries `st` (H `[B, Q, d]`, ...) at absolute positions `pos` `[B, Q]` against the
        cached bank.

        valid `[B, Q]` marks real queries (None: all are); keep lists the rows that have one (None: all do).
        """
        model, cfg = self.model, self.cfg
        H = st.H
        B, Q = pos.shape
        dev = H.device
        valid_t = torch.ones(B, Q, dtype=torch.bool, device=dev) if valid is None else valid
        R = ws.n_steps
        if R == 0:  # the bypass: the backbone alone, bitwise
            zeros = torch.zeros(B, Q, dtype=torch.long, device=dev)
            return StepOutput(logits=model.backbone.head(H), actions=zeros.unsqueeze(-1)[..., :0], n_edits=zeros,
                              controller_steps=zeros, positions=pos, valid=valid_t)
        lengths = self.lengths
        if keep is not None and len(keep) == 0:  # no row has a new position
            zeros = torch.zeros(B, Q, dtype=torch.long, device=dev)
            stop = torch.full((B, Q, R), cfg.stop_action, dtype=torch.long, device=dev)
            return StepOutput(logits=model.backbone.head(H), actions=stop, n_edits=zeros, controller_steps=zeros,
                              positions=pos, valid=valid_t)
        Tb = max(lengths) if keep is None else max(lengths[b] for b in keep)
        compiled = getattr(model.editor, "compiled", None)
        if Q == 1 and compiled is not None and compiled.static_decode:  # fixed shapes: the bank at its capacity
            Tb = self.K.shape[1]  # (the mask hides every key past a row's length)
        keep = None if keep is None or len(keep) == B else torch.tensor(keep, dtype=torch.long, device=dev)
        sub = (lambda x: x) if keep is None else (lambda x: x[keep])
        st_q = st if keep is None else Streams(H[keep], {k: v[keep] for k, v in st.src.items()})
        H_q, pos_q, valid_q = st_q.H, sub(pos), sub(valid_t)
        bank_len = sub(torch.tensor(lengths, device=dev))  # [b]
        K, V = sub(self.K.narrow(1, 0, Tb)), sub(self.V.narrow(1, 0, Tb))  # [b, Tb, w]
        z, S0 = model.query_state(st_q)  # [b, Q, w], [b, Q, M, w]
        mask = model.bank_mask(H_q.shape[0], Q, Tb, pos_q, bank_len, dev)  # [b, Q, Tb]
        ctx = EncodedContext(H=H_q, K=K, V=V, z=z, bank_mask=mask, S0=S0, ctrl_in=model.controller_stream(st_q))
        if ws.actions is not None:
            w_sub = ws.rows(keep) if keep is not None else ws
            roll = model.rollout_forced(ctx, w_sub.actions, w_sub.budget)
        else:
            roll = model.rollout_policy(ctx, ws.max_budget, ws.cost, ws.lambda_cost, ws.kappa_risk)
        trace, n_edits, steps = roll.actions, roll.n_edits, roll.controller_steps
        if valid is not None:  # padding queries ran along (per-position independent); their results are dropped
            trace = trace.masked_fill(~valid_q.unsqueeze(-1), cfg.stop_action)
            n_edits, steps = n_edits.masked_fill(~valid_q, 0), steps.masked_fill(~valid_q, 0)
        logits, _ = model.logits_from_state(roll.S, ctx, n_edits > 0)  # [b, Q, V]
        if keep is not None:
            full = model.backbone.head(H)  # rows without a new position: their padding's backbone logits
            logits = full.index_copy(0, keep, logits)
            trace = torch.full((B, Q, R), cfg.stop_action, dtype=torch.long, device=dev).index_copy(0, keep, trace)
            n_edits = torch.zeros(B, Q, dtype=torch.long, device=dev).index_copy(0, keep, n_edits)
            steps = torch.zeros(B, Q, dtype=torch.long, device=dev).index_copy(0, keep, steps)
        return StepOutput(logits=logits, actions=trace, n_edits=n_edits, controller_steps=steps, positions=pos,
                          valid=valid_t)

    # ------------------------------------------------------------------ input checks (no state is touched)
    def _check_rows(self, B: int) -> None:
        if B != self.batch_size:
            raise ValueError(f"batch of {B} rows does not match the DecodeState's {self.batch_size} rows")

    def _check_n_new(self, n_new: Sequence[int] | None, C: int) -> list[int]:
        if n_new is None:
            return [C] * self.batch_size
        if isinstance(n_new, torch.Tensor):
            n_new = n_new.tolist()
        n_new = list(n_new)
        if len(n_new) != self.batch_size or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= C
                                                for n in n_new):
            raise ValueError(f"n_new must give, for each of the {self.batch_size} rows, an int in [0, {C}], "
                             f"got {n_new}")
        return n_new

    def _check_lengths(self, lengths: Sequence[int] | torch.Tensor | None, B: int, T: int) -> list[int]:
        if lengths is None:
            return [T] * B
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()
        lengths = list(lengths)
        if len(lengths) != B or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= T
                                    for n in lengths):
            raise ValueError(f"lengths must give, for each of the {B} rows, an int in [1, {T}], got {lengths}")
        if max(lengths) != T:
            raise ValueError(f"tokens must be right-padded to the longest row: max(lengths)={max(lengths)} != T={T}")
        return lengths

    def _check_capacity(self, n_new: list[int]) -> None:
        for b, (length, n) in enumerate(zip(self.lengths, n_new)):
            if length + n > self.max_len:
                raise ValueError(f"DecodeState capacity exceeded: row {b} holds {length} positions and {n} more would "
                                 f"pass its max_len={self.max_len} (allocate a larger state, or reset() it)")

    def _check_workspace(self, B: int, Q: int, max_budget: int, lambda_cost: float | None,
                         kappa_risk: float | None, cost: torch.Tensor | None, actions: torch.Tensor | None,
                         budget: int | torch.Tensor | None) -> _Workspace:
        model, cfg = self.model, self.cfg
        if actions is not None:
            if max_budget != 0 or lambda_cost is not None or kappa_risk is not None or cost is not None:
                raise ValueError("give either forced actions or controller arguments (max_budget, lambda_cost, "
                                 "kappa_risk, cost), not both")
            if not isinstance(actions, torch.Tensor) or actions.dim() != 3 or tuple(actions.shape[:2]) != (B, Q):
                shape = tuple(actions.shape) if isinstance(actions, torch.Tensor) else type(actions).__name__
                raise ValueError(f"forced actions must have shape [B, Q, R] = [{B}, {Q}, R], got {shape}")
            if actions.shape[-1] == 0:
                return _Workspace()
            if not cfg.use_workspace or not self.has_bank:
                raise ValueError("forced actions need a workspace model and a DecodeState with a source bank")
            if budget is not None and torch.is_tensor(budget):
                budget = budget.to(actions.device)
            shape_only = torch.zeros(B, Q, dtype=torch.long, device=actions.device)
            budget = model._check_forced(shape_only, actions, budget)  # ids, R <= r_max, budgets in [1, r_max]
            return _Workspace(actions=actions.long(), budget=budget)
        if budget is not None:
            raise ValueError("budget applies to forced actions; the controller's budget is max_budget")
        if isinstance(max_budget, bool) or not isinstance(max_budget, int) or max_budget < 0:
            raise ValueError(f"max_budget must be an int >= 0, got {max_budget!r}")
        if max_budget > cfg.r_max:
            raise ValueError(f"max_budget={max_budget} exceeds r_max={cfg.r_max}")
        _check_price("lambda_cost", lambda_cost)
        _check_price("kappa_risk", kappa_risk)
        if max_budget == 0:
            return _Workspace()
        if not cfg.use_workspace:
            raise ValueError("this model has no workspace (use_workspace=False): max_budget must be 0")
        if not self.has_bank:
            raise ValueError("this DecodeState was allocated without a source bank (bank=False): max_budget must be 0")
        return _Workspace(max_budget=max_budget, lambda_cost=lambda_cost, kappa_risk=kappa_risk,
                          cost=model._check_cost(cost))


def _check_price(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 (or None for the config's default), got {value!r}")


# ====================================================================== sampling
def check_sampling(temperature: Any, top_k: Any, top_p: Any) -> None:
    """ValueError unless temperature is a finite number >= 0, top_k None or an int >= 1, top_p None or in (0, 1]."""
    if not is_number(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (not is_number(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")


def sample_logits(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens `[N]` from logits `[N, V]`.

    temperature 0 is greedy (argmax); otherwise softmax(logits / temperature), restricted to the `top_k` largest
    logits and then to the smallest set of tokens whose probability reaches `top_p` (nucleus), sampled with
    `generator` (same generator state -> same sample).
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [N, V]
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p  # the mass before this token already reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)  # [N, V]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ====================================================================== generation
@dataclass
class Calibration:
    """The lambda found for a target cost and what it achieved on the calibration pass (prompts, teacher-forced)."""

    target_cost: float
    lambda_cost: float
    relative_cost: float  # achieved mean relative cost on the prompts
    evaluations: int  # forward_policy passes used


@dataclass
class GenerationEvent:
    """One generation step: the token each row produced (None for rows already finished)."""

    step: int  # index of the new token within each row (0 = first generated token)
    tokens: list[int | None]  # [B]
    positions: list[int | None]  # [B] the position whose logits produced the token (its context is position + 1)
    actions: torch.Tensor  # [B, R] that position's action trace (STOP rows for finished rows)
    n_edits: list[int | None]  # [B]
    controller_steps: list[int | None]  # [B]
    ops: list[int | None]  # [B] analytic ops of that position (costs.trace_cost, own context)
    finished: list[bool]  # [B] the row is done after this step (stop token or max_new_tokens)


@dataclass
class GenerationOutput:
    """Generated tokens per row with each token's action trace and analytic cost."""

    tokens: list[list[int]]  # new tokens per row (a stop token that ended the row is included)
    prompt_lengths: list[int]
    actions: list[torch.Tensor]  # per row [n_b, R]
    n_edits: list[list[int]]
    controller_steps: list[list[int]]
    ops: list[list[int]]  # per token, with each position's own context
    relative_cost: float  # total ops / backbone-only ops over every generated token (1.0 = the backbone alone)
    lambda_cost: float  # the controller's price of compute that was used
    finish_reasons: list[str]  # "stop" or "length"
    calibration: Calibration | None = None


@dataclass
class _Run:
    """A fully checked generation request."""

    model: PrismeModel
    tokens: torch.Tensor  # [B, P] right-padded prompts
    lengths: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None
    stop_tokens: frozenset[int]
    max_budget: int
    lambda_cost: float
    kappa_risk: float | None
    calibration: Calibration | None
    prefill_chunk_size: int | None


def generate(model: PrismeModel, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_tokens: Sequence[int] = (), max_budget: int = 0, lambda_cost: float | None = None,
             kappa_risk: float | None = None, target_cost: float | None = None, stream: bool = False,
             prefill_chunk_size: int | None = None) -> GenerationOutput | Iterator[GenerationEvent]:
    """Generate up to `max_new_tokens` per prompt with the workspace under the controller.

    Args:
        prompts: token ids per row (lists of different lengths are batched right-padded), or a `[B, P]` / `[P]`
            tensor.
        temperature, top_k, top_p, seed: sampling (temperature 0 = greedy). Each row samples with its own generator
            seeded from (seed, row index): same seed -> same sample, whatever the other rows do.
        stop_tokens: a row ends after producing one of these (it is kept in the output).
        max_budget, lambda_cost, kappa_risk: the controller's budget and prices (max_budget=0: the backbone alone).
        target_cost: a target mean relative cost per token (ops / backbone-only ops, >= 1); lambda_cost is then found
            by bisection on a teacher-forced calibration pass over the prompts (`calibrate_lambda`).
        stream: return an iterator of per-step `GenerationEvent`s instead of the finished `GenerationOutput`.
        prefill_chunk_size: backbone chunk size of the prompt prefill (default: one chunk).

    All arguments are checked (and lambda calibrated) before anything runs; bad input is a ValueError.
    """
    run = _prepare(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, max_budget,
                   lambda_cost, kappa_risk, target_cost, prefill_chunk_size)
    return _events(run) if stream else _collect(run)


def generate_stream(model: PrismeModel, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int,
                    **kwargs) -> Iterator[GenerationEvent]:
    """`generate(..., stream=True)`: checks everything now, then yields one `GenerationEvent` per step."""
    return generate(model, prompts, max_new_tokens, stream=True, **kwargs)


def calibrate_lambda(model: PrismeModel, prompts: Sequence[Sequence[int]] | torch.Tensor, max_budget: int,
                     target_cost: float, kappa_risk: float | None = None, rel_tol: float = 1e-3,
                     max_evals: int = 40) -> Calibration:
    """Find lambda_cost whose controller spends `target_cost` (mean ops / backbone-only ops) on the prompts.

    One teacher-forced `forward_policy` pass per probe; the cost of its traces is `costs.trace_cost` with each
    position's own context. Cost falls (stepwise) as lambda grows: lambda is bracketed on a log grid, then bisected
    until the cost is within `rel_tol` of the target or the bracket collapses; the closest probe wins.
    """
    tokens, lengths = _pad_prompts(prompts, model.cfg.vocab_size)
    tokens = tokens.to(model.backbone.tok_emb.weight.device)
    return _calibrate(model, tokens, lengths, max_budget, target_cost, kappa_risk, rel_tol, max_evals)


@torch.no_grad()
def _calibrate(model: PrismeModel, tokens: torch.Tensor, lengths: list[int], max_budget: int, target_cost: float,
               kappa_risk: float | None, rel_tol: float = 1e-3, max_evals: int = 40) -> Calibration:
    cfg = model.cfg
    if max_budget < 1 or not cfg.use_workspace:
        raise ValueError("target_cost needs a workspace model and max_budget >= 1")
    if isinstance(target_cost, bool) or not isinstance(target_cost, (int, float)) or not math.isfinite(target_cost):
        raise ValueError(f"target_cost must be a finite number, got {target_cost!r}")
    B, P = tokens.shape
    valid = torch.arange(P, device=tokens.device) < torch.tensor(lengths, device=tokens.device)[:, None]  # [B, P]
    contexts = (torch.arange(P, device=tokens.device) + 1).expand(B, P)[valid]  # [N]
    N = contexts.numel()
    stop_all = torch.full((N, max_budget), cfg.stop_action, dtype=torch.long)
    floor = trace_cost(cfg, stop_all, contexts, torch.ones(N, dtype=torch.long), cfg.optimised).relative
    if target_cost < floor * (1 - rel_tol):
        raise ValueError(f"target_cost={target_cost} is below the cheapest controller policy's cost {floor:.6f} "
                         f"(every position stopping at once); use max_budget=0 for the backbone alone")
    probes: list[tuple[float, float]] = []

    def cost_at(lam: float) -> float:
        out = model.forward_policy(tokens, max_budget, lambda_cost=lam, kappa_risk=kappa_risk)
        rel = trace_cost(cfg, out.actions[valid], contexts, out.controller_steps[valid], cfg.optimised).relative
        probes.append((lam, rel))
        return rel

    def close(c: float) -> bool:
        return abs(c - target_cost) <= rel_tol * target_cost

    lo, hi = 0.0, None
    if cost_at(0.0) > target_cost and not close(probes[-1][1]):
        for lam in (10.0 ** k for k in range(-6, 13)):  # bracket: cost(lo) > target >= cost(hi)
            c = cost_at(lam)
            if c <= target_cost or close(c):
                hi = lam
                break
            lo = lam
        while hi is not None and len(probes) < max_evals and not close(probes[-1][1]) and hi - lo > 1e-6 * hi:
            mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
            if cost_at(mid) > target_cost:
                lo = mid
            else:
                hi = mid
    lam, rel = min(probes, key=lambda p: (abs(p[1] - target_cost), p[0]))
    return Calibration(target_cost=float(target_cost), lambda_cost=lam, relative_cost=rel, evaluations=len(probes))


def _pad_prompts(prompts: Sequence[Sequence[int]] | torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, list[int]]:
    """Right-padded `[B, P]` ids (padding 0) and each row's length; ValueError for empty or out-of-range prompts."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts.unsqueeze(0)
        if prompts.dim() != 2:
            raise ValueError(f"a prompt tensor must have shape [B, P] or [P], got {tuple(prompts.shape)}")
        check_tokens(prompts, vocab_size, "prompt")
        return prompts.long(), [prompts.shape[1]] * prompts.shape[0]
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists (or a [B, P] tensor)")
    rows = []
    for b, row in enumerate(prompts):
        row = row.tolist() if isinstance(row, torch.Tensor) else row
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) == 0:
            raise ValueError(f"prompt {b} is empty or not a list of token ids; encode text with a tokenizer first")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in row):
            raise ValueError(f"prompt {b} must hold int token ids")
        lo, hi = min(row), max(row)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompt {b}: ids must lie in [0, {vocab_size}), got min {lo} and max {hi}")
        rows.append(list(row))
    P = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (P - len(r)) for r in rows], dtype=torch.long)  # [B, P]
    return tokens, [len(r) for r in rows]


def _prepare(model: PrismeModel, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, max_budget,
             lambda_cost, kappa_risk, target_cost, prefill_chunk_size) -> _Run:
    cfg = model.cfg
    tokens, lengths = _pad_prompts(prompts, cfg.vocab_size)
    tokens = tokens.to(model.backbone.tok_emb.weight.device)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if max(lengths) + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"the longest prompt ({max(lengths)} tokens) + max_new_tokens={max_new_tokens} exceeds "
                         f"T_max={cfg.max_seq_len}, the cache capacity")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    stops = list(stop_tokens)
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < cfg.vocab_size for t in stops):
        raise ValueError(f"stop_tokens must be ids in [0, {cfg.vocab_size}), got {stops}")
    if isinstance(max_budget, bool) or not isinstance(max_budget, int) or max_budget < 0:
        raise ValueError(f"max_budget must be an int >= 0, got {max_budget!r}")
    if max_budget > cfg.r_max:
        raise ValueError(f"max_budget={max_budget} exceeds r_max={cfg.r_max}")
    if max_budget > 0 and not cfg.use_workspace:
        raise ValueError("this model has no workspace (use_workspace=False): max_budget must be 0")
    _check_price("lambda_cost", lambda_cost)
    _check_price("kappa_risk", kappa_risk)
    if prefill_chunk_size is not None and (isinstance(prefill_chunk_size, bool)
                                           or not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1):
        raise ValueError(f"prefill_chunk_size must be a positive int or None, got {prefill_chunk_size!r}")
    calibration = None
    if target_cost is not None:
        if lambda_cost is not None:
            raise ValueError("give lambda_cost or target_cost, not both")
        calibration = _calibrate(model, tokens, lengths, max_budget, target_cost, kappa_risk)
        lambda_cost = calibration.lambda_cost
    lam = float(cfg.lambda_cost if lambda_cost is None else lambda_cost)
    return _Run(model, tokens, lengths, max_new_tokens, float(temperature), top_k, top_p, seed, frozenset(stops),
                max_budget, lam, kappa_risk, calibration, prefill_chunk_size)


def _row_seed(seed: int, row: int) -> int:
    """A 63-bit seed for one row's sampler, distinct for every (seed, row) pair in practice."""
    return (seed * 0x9E3779B97F4A7C15 + row * 0xBF58476D1CE4E5B9 + 1) % 2**63


class _OpsOf:
    """Analytic ops of one generated position, memoised on (context, trace, controller steps)."""

    def __init__(self, model: PrismeModel, max_budget: int):
        self.cfg, self.max_budget = model.cfg, max_budget
        self.memo: dict[tuple, int] = {}

    def __call__(self, context: int, actions: list[int], steps: int) -> int:
        key = (context, tuple(actions), steps)
        if key not in self.memo:
            acts = None if self.max_budget == 0 else [actions]
            self.memo[key] = int(trace_cost(self.cfg, acts, [context], [steps], self.cfg.optimised).total_ops)
        return self.memo[key]


@torch.no_grad()
def _events(run: _Run) -> Iterator[GenerationEvent]:
    model, cfg = run.model, run.model.cfg
    B = len(run.lengths)
    dev = run.tokens.device
    gens = None
    if run.temperature > 0:  # one generator per row: a row's samples do not depend on the others or on their stops
        base = random.SystemRandom().randrange(2**62) if run.seed is None else run.seed
        gens = [torch.Generator(device=dev).manual_seed(_row_seed(base, b)) for b in range(B)]
    state = model.new_decode_state(B, max_len=max(run.lengths) + run.max_new_tokens - 1,
                                   bank=run.max_budget > 0)
    policy = dict(max_budget=run.max_budget, lambda_cost=run.lambda_cost, kappa_risk=run.kappa_risk)
    out = state.prefill(run.tokens, run.lengths, run.prefill_chunk_size, logits="last", **policy)
    ops_of = _OpsOf(model, run.max_budget)
    done = [False] * B
    last = [0] * B
    for step in range(run.max_new_tokens):
        if step > 0:
            feed = torch.tensor([[t] for t in last], dtype=torch.long, device=dev)  # [B, 1]
            out = state.decode_step(feed, [0 if d else 1 for d in done], **policy)
        active = [b for b in range(B) if not done[b]]
        if gens is None:
            new = out.logits[active, -1].argmax(-1).tolist()
        else:
            new = [int(sample_logits(out.logits[b:b + 1, -1], run.temperature, run.top_k, run.top_p, gens[b]))
                   for b in active]
        acts = out.actions[:, -1]  # [B, R]
        acts_l, pos_l = acts.tolist(), out.positions[:, -1].tolist()
        n_l, s_l = out.n_edits[:, -1].tolist(), out.controller_steps[:, -1].tolist()
        ev = GenerationEvent(step=step, tokens=[None] * B, positions=[None] * B,
                             actions=acts.masked_fill(torch.tensor(done, device=dev)[:, None], cfg.stop_action),
                             n_edits=[None] * B, controller_steps=[None] * B, ops=[None] * B, finished=[True] * B)
        for b, tok in zip(active, new):
            last[b] = tok
            done[b] = tok in run.stop_tokens or step == run.max_new_tokens - 1
            ev.tokens[b], ev.positions[b], ev.n_edits[b], ev.controller_steps[b] = tok, pos_l[b], n_l[b], s_l[b]
            ev.ops[b] = ops_of(pos_l[b] + 1, acts_l[b], s_l[b])
            ev.finished[b] = done[b]
        yield ev
        if all(done):
            return


def _collect(run: _Run) -> GenerationOutput:
    cfg = run.model.cfg
    B = len(run.lengths)
    toks: list[list[int]] = [[] for _ in range(B)]
    acts: list[list[torch.Tensor]] = [[] for _ in range(B)]
    n_edits: list[list[int]] = [[] for _ in range(B)]
    steps: list[list[int]] = [[] for _ in range(B)]
    ops: list[list[int]] = [[] for _ in range(B)]
    contexts: list[list[int]] = [[] for _ in range(B)]
    reasons = ["length"] * B
    for ev in _events(run):
        for b in range(B):
            if ev.tokens[b] is None:
                continue
            toks[b].append(ev.tokens[b])
            acts[b].append(ev.actions[b])
            n_edits[b].append(ev.n_edits[b])
            steps[b].append(ev.controller_steps[b])
            ops[b].append(ev.ops[b])
            contexts[b].append(ev.positions[b] + 1)
            if ev.tokens[b] in run.stop_tokens:
                reasons[b] = "stop"
    actions = [torch.stack(a) for a in acts]  # [n_b, R] each
    flat = None if run.max_budget == 0 else torch.cat(actions)
    cost = trace_cost(cfg, flat, [c for row in contexts for c in row], [s for row in steps for s in row],
                      cfg.optimised)
    return GenerationOutput(tokens=toks, prompt_lengths=list(run.lengths), actions=actions, n_edits=n_edits,
                            controller_steps=steps, ops=ops, relative_cost=cost.relative, lambda_cost=run.lambda_cost,
                            finish_reasons=reasons, calibration=run.calibration)


# ====================================================================== command line
def main(args: argparse.Namespace) -> int:
    """`prisme generate`: load a model (checkpoint, or a preset with random weights), generate, print the text."""
    from .checkpoint import find_model_checkpoint, load_model
    from .config import PrismeConfig
    from .data import BPETokenizer, ByteTokenizer

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = getattr(args, "device", None) or "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r} requested but CUDA is not available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")
    tokenizer = ByteTokenizer() if args.tokenizer == "byte" else BPETokenizer.load(args.tokenizer)
    if args.checkpoint is not None:
        path = find_model_checkpoint(args.checkpoint)
        if str(path) != str(args.checkpoint):
            print(f"note: using {path}", file=sys.stderr)
        model, _meta = load_model(path, map_location=device)
    else:
        torch.manual_seed(0 if args.seed is None else args.seed)
        model = PrismeModel(PrismeConfig.from_name(args.preset))
        print(f"note: preset {args.preset!r} with random weights (pass --checkpoint for a trained model)",
              file=sys.stderr)
    model = model.to(device).eval()
    from .compile import maybe_compile

    maybe_compile(model, getattr(args, "compile", None))
    ids_mode = getattr(args, "prompt_ids", None) is not None
    if not ids_mode and tokenizer.vocab_size > model.cfg.vocab_size:
        what = "the byte tokenizer" if args.tokenizer == "byte" else f"tokenizer {args.tokenizer}"
        raise ValueError(f"{what} has {tokenizer.vocab_size} ids but the model's vocab_size is {model.cfg.vocab_size}: "
                         f"use a model with vocab_size >= {tokenizer.vocab_size} (e.g. --preset demo), another "
                         f"--tokenizer, or --prompt-ids")
    if ids_mode:
        try:
            prompt = [int(v) for v in args.prompt_ids.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        if not prompt:
            raise ValueError("--prompt-ids lists no token id")
        decode = lambda ids: " " + " ".join(str(i) for i in ids)  # noqa: E731
        args.prompt = ",".join(str(i) for i in prompt)
    else:
        prompt = tokenizer.encode(args.prompt)
        decode = tokenizer.decode
    out = generate(model, [prompt], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, max_budget=args.budget, lambda_cost=args.lambda_cost,
                   kappa_risk=args.kappa_risk, target_cost=args.target_cost)
    print(args.prompt + decode(out.tokens[0]))
    cal = "" if out.calibration is None else (f", calibrated on the prompt to {out.calibration.relative_cost:.4f} "
                                              f"(target {out.calibration.target_cost})")
    print(f"[{len(out.tokens[0])} tokens, budget {args.budget}, lambda {out.lambda_cost:.6g}{cal}; "
          f"mean relative cost {out.relative_cost:.4f} x the backbone]", file=sys.stderr)
    if args.show_edits:
        from .workspace import slots_of_action

        stop, cfg = model.cfg.stop_action, model.cfg
        legend = ", ".join(f"{a}={'+'.join(map(str, slots_of_action(cfg, a)))}" for a in range(cfg.n_actions))
        print(f"legend: edits = actions applied at that position; steps = controller evaluations (the edits plus "
              f"the STOP that ended them, at most the budget); actions = the action ids, each editing the slots "
              f"{legend} (STOP={stop})")
        print(f"{'pos':>5}  {'token':<8}{'edits':>6}{'steps':>6}  actions")
        for i, tok in enumerate(out.tokens[0]):
            acts = [a for a in out.actions[0][i].tolist() if a != stop]
            print(f"{len(prompt) + i:>5}  {decode([tok]).strip() if ids_mode else repr(decode([tok])):<8}"
                  f"{out.n_edits[0][i]:>6}"
                  f"{out.controller_steps[0][i]:>6}  {'#' * out.n_edits[0][i]:<{max(args.budget, 1)}} {acts}")
    return 0

