"""`DecodeState`: incremental decoding with the workspace (SPEC §4); generation on top of it is
`prisme.decoding.generate`.

Notation: B rows, C new tokens per row in one call (a chunk), Q query positions whose workspace runs, R actions per
position, T_max the state's capacity, V vocab, d backbone width, w workspace width.

A `DecodeState` (allocated by `PrismeModel.new_decode_state`) owns the backbone's KV cache, the source bank's cache
(`bank`: `prisme.model.bank.BankCache`, its entries or token ids, as its `DecodeOptions` say) and each row's length.
Every new position takes the same path as in the parallel `forward_policy`: one backbone step with the cache; its bank
entry appended (only new positions are projected); then its own workspace, run by the model's own methods on an
`EncodedContext` whose queries are the new positions and whose bank is the cache (`rollout_policy`, or
`rollout_forced` for forced actions, then `logits_from_state`). Reusing those methods is what makes decoding exact:
forced-token decoding in chunks of any size gives, in float64, the logits (to ~1e-12) and action traces of one
teacher-forced `forward_policy` call (tests/test_generate.py).

Ragged batches: rows are right-padded and carry their own lengths; `n_new[b]` says how many of a chunk's C tokens of
row b are real. Outputs at padding positions are unspecified (`StepOutput.valid` marks the real ones); rows with no
new token take no part in the workspace.

Every public entry point checks its whole input before it touches the state: a ValueError leaves the state as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from prisme.checks import check_max_budget, is_int
from prisme.model.backbone import check_tokens
from prisme.model.bank import BankCache
from prisme.model.outputs import Streams
from prisme.model.policy import Controller, Forced, StepPolicy
from prisme.model.routed import decode_plan, routed_workspace
from prisme.model.workspace import check_cost, check_forced
from prisme.options import DecodeOptions

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
        options: how the bank is kept and served (`prisme.options.DecodeOptions`; default: the model's
            `decode_options`), checked against the model.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_len: int | None = None,
                 dtype: torch.dtype | None = None, bank: bool | None = None, options: DecodeOptions | None = None):
        cfg = model.cfg
        param = model.backbone.tok_emb.weight
        if cfg.copy_head:
            raise ValueError("decoding a model with a copy head (copy_head=True) is not supported yet: score it with "
                             "model(tokens) or forward_policy")
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if max_len is not None and not is_int(max_len):
            raise ValueError(f"max_len must be an int or None, got {max_len!r}")
        if dtype is not None and dtype != param.dtype:
            raise ValueError(f"DecodeState dtype {dtype} differs from the model's {param.dtype}: convert the model "
                             f"with model.to({dtype}) instead")
        bank = cfg.use_workspace if bank is None else bool(bank)
        if bank and not cfg.use_workspace:
            raise ValueError("this model has no workspace (use_workspace=False): a source bank cannot be kept")
        options = model.decode_options if options is None else options
        if not isinstance(options, DecodeOptions):
            raise ValueError(f"options must be a prisme.options.DecodeOptions (or None: the model's), got "
                             f"{type(options).__name__}")
        self.options = options.check(cfg)
        self.model = model
        self.cfg = cfg
        self.cache = model.backbone.new_cache(batch_size, max_len, param.dtype)
        self.batch_size = batch_size
        self.max_len = self.cache.max_len
        self.has_bank = bank
        reads_ids = cfg.router and (cfg.router_ngram > 0 or cfg.router_token)  # the router's features read the ids
        self.bank = BankCache(model.bank, batch_size, self.max_len, param, reads_ids, options) if bank else None

    # ------------------------------------------------------------------ bookkeeping
    @property
    def lengths(self) -> list[int]:
        """Positions held by each row."""
        return list(self.cache.lengths)

    @property
    def nbytes(self) -> int:
        """Exact payload bytes of the backbone K/V cache and the source bank."""
        return self.cache.nbytes + (0 if self.bank is None else self.bank.nbytes)

    def rewind(self, length: int) -> DecodeState:
        """Roll every row back to its first `length` positions, in place; returns the state.

        Exact: the next step writes its K/V and bank entry at position `length` and every later read is masked to
        positions <= its own, so entries left past `length` are never read (`prisme bench workspace` checks that a
        rewound state decodes bit-identically to a fresh one). Shift memories hold each row's last position only:
        with `bank_shift` (or the backbone's `key_shift`) a state rewinds to 0 or to its rows' own length; a
        sliding-window backbone keeps its last W positions (`KVCache.truncate`). Anything else is a ValueError that
        leaves the state as it was."""
        if not is_int(length) or not 0 <= length <= min(self.lengths):
            raise ValueError(f"can only rewind to a length in [0, {min(self.lengths)}], got {length!r}")
        if self.bank is not None and self.bank.prev and 0 < length and any(n != length for n in self.lengths):
            raise ValueError(f"the bank shift keeps each row's last position only: this state rewinds to 0 or to its "
                             f"rows' length, not from {self.lengths} to {length}")
        self.cache.truncate(length)
        if self.bank is not None:
            self.bank.forget_grams()
        if length == 0 and self.bank is not None:
            self.bank.forget_shift()
        return self

    def reset(self) -> None:
        """Forget every row (lengths to 0; buffers zeroed so stale entries can never leak)."""
        self.cache.reset()
        if self.bank is not None:
            self.bank.reset()

    @torch.no_grad()
    def fill_synthetic(self, length: int, generator: torch.Generator | None = None, draw: bool = True
                       ) -> DecodeState:
        """Every row holds `length` positions of random content (keys, values, bank entries or ids, shift memories,
        the router's ids), without a prefill: for timing a decode step at a long context, whose cost does not depend
        on the values (`prisme bench long`). Not a model's state: nothing it then decodes means anything. `draw=False`
        keeps what the buffers hold and only sets the lengths (to time again from the same length: a step's writes
        land past it). Returns the state."""
        if not is_int(length) or not 0 <= length < self.max_len:
            raise ValueError(f"fill_synthetic: length must be an int in [0, {self.max_len - 1}] (a step needs room), "
                             f"got {length!r}")
        V = self.cfg.vocab_size
        normal = lambda t: t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype))  # noqa: E731 (CPU generator)
        ids = lambda t: t.copy_(torch.randint(0, V, t.shape, generator=generator))  # noqa: E731
        bank = self.bank
        if draw:
            for t in [t for layer in self.cache.layers for t in (layer.k, layer.v, layer.prev) if t is not None]:
                normal(t)
            for t in [] if bank is None else ([bank.KV] if bank.KV is not None else []) + list(bank.prev):
                (normal if t.is_floating_point() else ids)(t)
            if bank is not None and bank.ids is not None:
                ids(bank.ids)
        if bank is not None:
            bank.forget_grams()
        self.cache.set_lengths([length] * self.batch_size)
        return self

    # ------------------------------------------------------------------ public steps
    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, n_new: Sequence[int] | None = None,
                    policy: Controller | Forced | None = None) -> StepOutput:
        """Append one chunk to every row and run each new position's workspace.

        Args:
            tokens: `[B, C]` (or `[B]`: C = 1) ids, right-padded where `n_new[b] < C`.
            n_new: real tokens per row (default C); a row with 0 takes no part in this step.
            policy: what the workspace runs at the new positions (`prisme.model.policy`): a `Controller` (as in
                `forward_policy`), `Forced` actions `[B, C, R]` (as in `PrismeModel.forward`), or None / `BACKBONE`:
                the backbone alone, bitwise.
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
        return self._step(tokens, n_new, self._check_policy(B, C, policy))

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: Sequence[int] | torch.Tensor | None = None,
                chunk_size: int | None = None, logits: str = "last",
                policy: Controller | Forced | None = None) -> StepOutput:
        """Append prompts `[B, T]` (right-padded; row b has `lengths[b]` real tokens, max(lengths) == T).

        Args:
            chunk_size: backbone chunk size (default T: one chunk).
            logits: where the workspace runs and logits are returned:
                "last": each row's last prompt position (Q = 1), the logits the first sampled token needs;
                "all": every position (Q = T; the same as `decode_step` over the chunks);
                "none": nowhere (fill the caches only).
            policy: as in `decode_step`, for the Q query positions (`Forced` actions are `[B, Q, R]`).
        """
        check_tokens(tokens, self.cfg.vocab_size)
        B, T = tokens.shape
        self._check_rows(B)
        lengths = self._check_lengths(lengths, B, T)
        chunk = T if chunk_size is None else chunk_size
        if not is_int(chunk) or chunk < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {LOGITS_MODES}, got {logits!r}")
        self._check_capacity(lengths)
        Q = {"all": T, "last": 1, "none": 0}[logits]
        if logits == "none" and policy is not None and not (isinstance(policy, Controller) and policy.max_budget == 0):
            raise ValueError('prefill(logits="none") runs no workspace: its policy must be None (the backbone alone)')
        ws = self._check_policy(B, Q, policy)
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
                                                           for k in parts[0].src},
                     tokens)  # [B, T, d] each
        last = (torch.tensor(lengths, device=dev) - 1).unsqueeze(1)  # [B, 1]
        return self._workspace(st.index(torch.arange(B, device=dev).unsqueeze(1), last), pos, None, None, ws)

    # ------------------------------------------------------------------ internals (inputs already checked)
    def _step(self, tokens: torch.Tensor, n_new: list[int], ws: StepPolicy) -> StepOutput:
        B, C = tokens.shape
        start = self.lengths
        offsets = torch.arange(C, device=tokens.device)  # [C]
        if len(set(start)) == 1:  # every row at the same offset: the positions from the host's ints
            pos = (offsets + start[0]).expand(B, C)  # [B, C]
        else:  # from the lengths kept on the device: no upload
            pos = self.cache.lengths_tensor(tokens.device).unsqueeze(1) + offsets  # [B, C]
        st = self._advance(tokens, n_new)  # H [B, C, d] and the source streams
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
        full = all(n == C for n in n_new)
        start_t = None if len(set(start)) == 1 and full else self.cache.lengths_tensor(tokens.device)
        st = self.model.streams(tokens, self.cache, n_new)  # H [B, C, d]
        if self.has_bank:
            self.bank.append(st, tokens, n_new, start, start_t)
        return st

    def _workspace(self, st: Streams, pos: torch.Tensor, valid: torch.Tensor | None, keep: list[int] | None,
                   ws: StepPolicy) -> StepOutput:
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
        plan = decode_plan(model, ws, Q)
        if plan == "bypass":  # the backbone alone, bitwise
            zeros = torch.zeros(B, Q, dtype=torch.long, device=dev)
            return StepOutput(logits=model.backbone.head(H), actions=zeros.unsqueeze(-1)[..., :0], n_edits=zeros,
                              controller_steps=zeros, positions=pos, valid=valid_t)
        if plan in ("budget1", "routed"):
            return StepOutput(**routed_workspace(self, st, pos, valid, ws, valid_t))
        lengths = self.lengths
        if keep is not None and len(keep) == 0:  # no row has a new position
            zeros = torch.zeros(B, Q, dtype=torch.long, device=dev)
            stop = torch.full((B, Q, R), cfg.stop_action, dtype=torch.long, device=dev)
            return StepOutput(logits=model.backbone.head(H), actions=stop, n_edits=zeros, controller_steps=zeros,
                              positions=pos, valid=valid_t)
        Tb = max(lengths) if keep is None else max(lengths[b] for b in keep)
        if plan == "static":  # fixed shapes: the bank at its capacity (the mask hides every key past a row's length)
            Tb = self.max_len
        keep = None if keep is None or len(keep) == B else torch.tensor(keep, dtype=torch.long, device=dev)
        sub = (lambda x: x) if keep is None else (lambda x: x[keep])
        st_q = st if keep is None else Streams(H[keep], {k: v[keep] for k, v in st.src.items()},
                                               None if st.ids is None else st.ids[keep])
        H_q, pos_q, valid_q = st_q.H, sub(pos), sub(valid_t)
        bank_len = sub(self.cache.lengths_tensor(dev))  # [b]
        K, V = self.bank.view(Tb, keep)  # [b, Tb, w] each
        mask = model.bank_mask(H_q.shape[0], Q, Tb, pos_q, bank_len, dev)  # [b, Q, Tb]
        ids = self.bank.ids
        ids_q = None if ids is None else sub(ids.narrow(1, 0, Tb))  # [b, Tb]
        router_in = (None, None) if ids_q is None else model.router_inputs(ids_q, pos_q)
        ctx = model.context(st_q, K, V, mask, model.query_state(st_q, self.options), router_in)
        logits, _, roll = model.run_workspace(ctx, ws.rows(keep) if keep is not None else ws,
                                              None if valid is None else valid_q)  # [b, Q, V]
        trace, n_edits, steps = roll.actions, roll.n_edits, roll.controller_steps
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
        if len(n_new) != self.batch_size or any(not is_int(n) or not 0 <= n <= C
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
        if len(lengths) != B or any(not is_int(n) or not 1 <= n <= T
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

    def _check_policy(self, B: int, Q: int, policy: Controller | Forced | None) -> StepPolicy:
        """The call's policy checked against this model and state for Q query positions per row."""
        model, cfg = self.model, self.cfg
        if policy is None:
            return StepPolicy()
        if isinstance(policy, Forced):
            actions, budget = policy.actions, policy.budget
            if tuple(actions.shape[:2]) != (B, Q):
                raise ValueError(f"forced actions must have shape [B, Q, R] = [{B}, {Q}, R], got "
                                 f"{tuple(actions.shape)}")
            if actions.shape[-1] == 0:
                return StepPolicy()
            if not cfg.use_workspace or not self.has_bank:
                raise ValueError("forced actions need a workspace model and a DecodeState with a source bank")
            if budget is not None and torch.is_tensor(budget):
                budget = budget.to(actions.device)
            shape_only = torch.zeros(B, Q, dtype=torch.long, device=actions.device)
            budget = check_forced(cfg, shape_only, actions, budget)  # ids, R <= r_max, budgets in [1, r_max]
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
        if not self.has_bank:
            raise ValueError("this DecodeState was allocated without a source bank (bank=False): max_budget must be 0")
        lam, kap = model.default_price.fill(policy.lambda_cost, policy.kappa_risk)
        return StepPolicy(max_budget=policy.max_budget, lambda_cost=lam, kappa_risk=kap,
                          cost=check_cost(policy.cost, model.action_cost))
