"""`DecodeState`: incremental decoding with the workspace (SPEC §4); generation on top of it is
`prisme.decoding.generate`.

Notation: B rows, C new tokens per row in one call (a chunk), Q query positions whose workspace runs, R actions per
position, T_max the state's capacity, V vocab, d backbone width, w workspace width.

A `DecodeState` (allocated by `PrismeModel.new_decode_state`) owns the backbone's KV cache, the source bank's cache
(`bank`: `prisme.model.bank.BankCache`, its entries or token ids, as its `DecodeOptions` say) and each row's length.
Every new position takes the same path as in the parallel `forward_policy`: one backbone step with the cache; its bank
entry appended (only new positions are projected); then its own workspace, run by the decode plan that
`prisme.model.plans.choose` picks for the call (its policy, its query count, the state's execution options), each
plan the model's own methods on the new positions against the cache. Reusing those methods is what makes decoding
exact: forced-token decoding in chunks of any size gives, in float64, the logits (to ~1e-12) and action traces of one
teacher-forced `forward_policy` call (tests/test_generate.py). A model with a copy head (`cfg.copy_head`) keeps its
token ids and the match lengths of each row's last position (`prisme.model.bank.suffix`) for it.

Ragged batches: rows are right-padded and carry their own lengths; `n_new[b]` says how many of a chunk's C tokens of
row b are real. Outputs at padding positions are unspecified (`StepOutput.valid` marks the real ones); rows with no
new token take no part in the workspace.

Every public entry point checks its whole input before it touches the state: a ValueError leaves the state as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from prisme.checks import is_int
from prisme.model.backbone import check_tokens
from prisme.model.bank import BankCache
from prisme.model.bank.suffix import query_lengths, step_lengths
from prisme.model.outputs import CopyInputs, StepOutput, Streams
from prisme.model.plans import DecodePlan, choose, editor_run, static_run
from prisme.model.policy import Controller, Forced, StepPolicy, check_policy
from prisme.options import DecodeOptions, ExecutionOptions

LOGITS_MODES = ("last", "all", "none")


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
        execution: how the editor runs (`prisme.options.ExecutionOptions`: eager or compiled, the slot K/V cache;
            default: the model's `execution`), so one model decodes either way; resolved once
            (`prisme.model.plans.editor_run`).
    """

    def __init__(self, model: nn.Module, batch_size: int, max_len: int | None = None,
                 dtype: torch.dtype | None = None, bank: bool | None = None, options: DecodeOptions | None = None,
                 execution: ExecutionOptions | None = None):
        cfg = model.cfg
        param = model.backbone.tok_emb.weight
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
        execution = model.execution if execution is None else execution
        if not isinstance(execution, ExecutionOptions):
            raise ValueError(f"execution must be a prisme.options.ExecutionOptions (or None: the model's), got "
                             f"{type(execution).__name__}")
        if execution.compile != "off" and not cfg.use_workspace:
            raise ValueError("compiling the editor needs a model with a workspace (use_workspace=True)")
        self.execution = execution
        self.run = editor_run(model, execution) if cfg.use_workspace else None
        self.static_run = None if self.run is None else static_run(self.run, execution)
        self._plans: dict[tuple[int, int], tuple[object, StepPolicy, DecodePlan]] = {}  # per policy object and Q
        self.model = model
        self.cfg = cfg
        self.cache = model.backbone.new_cache(batch_size, max_len, param.dtype)
        self.batch_size = batch_size
        self.max_len = self.cache.max_len
        self.has_bank = bank
        reads_ids = cfg.router and (cfg.router_ngram > 0 or cfg.router_token)  # the router's features read the ids
        reads_ids = reads_ids or cfg.copy_head  # ... and the copy head does
        self.bank = BankCache(model.bank, batch_size, self.max_len, param, reads_ids, options) if bank else None
        long = dict(dtype=torch.long, device=param.device)
        self.ids = (self.bank.ids if self.bank is not None and self.bank.ids is not None else
                    torch.zeros(batch_size, self.max_len, **long) if cfg.copy_head else None)  # [B, T_max]
        self.copy_row = torch.zeros(batch_size, self.max_len, dtype=torch.uint8, device=param.device) \
            if cfg.copy_head else None  # [B, T_max]: the match lengths of each row's last position
        self._copy_at: int | None = None  # the position copy_row belongs to (rows aligned), None: not kept

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
        self._copy_at = None
        if self.bank is not None:
            self.bank.forget_grams()
        if length == 0 and self.bank is not None:
            self.bank.forget_shift()
        return self

    def reset(self) -> None:
        """Forget every row (lengths to 0; buffers zeroed so stale entries can never leak)."""
        self.cache.reset()
        self._copy_at = None
        if self.bank is not None:
            self.bank.reset()
        if self.ids is not None:
            self.ids.zero_()

    @torch.no_grad()
    def fill_synthetic(self, length: int, generator: torch.Generator | None = None, draw: bool = True
                       ) -> DecodeState:
        """Every row holds `length` positions of random content (keys, values, bank entries or ids, shift memories,
        the router's ids), without a prefill: for timing a decode step at a long context, whose cost does not depend
        on the values (`prisme bench long`); a copy head's kept row of match lengths too, so the next step takes the
        one-row recurrence a decode does. Not a model's state: nothing it then decodes means anything. `draw=False`
        keeps what the buffers hold and only sets the lengths (to time again from the same length: a step's writes
        land past it). Returns the state."""
        if not is_int(length) or not 0 <= length < self.max_len:
            raise ValueError(f"fill_synthetic: length must be an int in [0, {self.max_len - 1}] (a step needs room), "
                             f"got {length!r}")
        V = self.cfg.vocab_size
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"fill_synthetic: generator must be a torch.Generator or None, got "
                             f"{type(generator).__name__}")
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
            if self.ids is not None and (bank is None or self.ids is not bank.ids):
                ids(self.ids)
            if self.copy_row is not None:  # the last position's match lengths: short, as random ids give
                self.copy_row.copy_(torch.randint(0, 3, self.copy_row.shape, generator=generator).to(torch.uint8))
        if bank is not None:
            bank.forget_grams()
        self._copy_at = length - 1 if self.copy_row is not None and length > 0 else None  # the next step recurs
        self.cache.set_lengths([length] * self.batch_size)
        return self

    # ------------------------------------------------------------------ public steps
    @torch.inference_mode()
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
        return self._step(tokens, n_new, *self._check_policy(B, C, policy))

    @torch.inference_mode()
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
        ws, plan = self._check_policy(B, Q, policy)
        chunks = [(i, min(chunk, T - i)) for i in range(0, T, chunk)]
        n_new = [[min(max(n - i, 0), c) for n in lengths] for i, c in chunks]  # real tokens of each chunk per row
        if logits == "all":  # each chunk its own queries: its plan for its count
            outs = [self._step(tokens[:, i:i + c], n, ws.narrow(i, c), choose(self, ws.narrow(i, c), c))
                    for (i, c), n in zip(chunks, n_new)]
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
        return self._workspace(st.index(torch.arange(B, device=dev).unsqueeze(1), last), pos, None, None, ws, plan)

    # ------------------------------------------------------------------ internals (inputs already checked)
    def _step(self, tokens: torch.Tensor, n_new: list[int], ws: StepPolicy, plan: DecodePlan) -> StepOutput:
        B, C = tokens.shape
        start = self.lengths
        dev = tokens.device
        aligned = len(set(start)) == 1  # every row at the same offset: the positions from the host's ints
        if aligned and C == 1:  # a decode step: one position per row, one call
            pos = torch.full((B, 1), start[0], device=dev)
        elif aligned:
            pos = (torch.arange(C, device=dev) + start[0]).expand(B, C)  # [B, C]
        else:  # rows at different offsets: from the lengths kept on the device (no upload)
            pos = self.cache.lengths_tensor(dev).unsqueeze(1) + torch.arange(C, device=dev)  # [B, C]
        st = self._advance(tokens, n_new)  # H [B, C, d] and the source streams
        if all(n == C for n in n_new):
            return self._workspace(st, pos, None, None, ws, plan)
        valid = torch.arange(C, device=dev) < torch.tensor(n_new, device=dev)[:, None]  # [B, C]: padding is not real
        keep = [b for b in range(B) if n_new[b] > 0]
        return self._workspace(st, pos, valid, keep, ws, plan)

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
        if self.ids is not None and (self.bank is None or self.bank.ids is None):  # the copy head's own ids
            if start_t is None:
                self.ids.narrow(1, start[0], C).copy_(tokens)
            else:
                for b in range(B):
                    self.ids[b, start[b]:start[b] + n_new[b]] = tokens[b, :n_new[b]]
        return st

    def _workspace(self, st: Streams, pos: torch.Tensor, valid: torch.Tensor | None, keep: list[int] | None,
                   ws: StepPolicy, plan: DecodePlan) -> StepOutput:
        """Run `plan` for the queries `st` (H `[B, Q, d]`, ...) at absolute positions `pos` `[B, Q]` against the
        cached bank; valid `[B, Q]` marks real queries (None: all are), keep lists the rows that have one (None: all
        do)."""
        return plan.run(self, st, pos, valid, keep, ws)

    def copy_inputs(self, pos: torch.Tensor, rows: torch.Tensor | None = None) -> CopyInputs | None:
        """What the copy head reads of queries at `pos` `[b, Q]` of `rows` `[b]` (None: every row), their positions
        already appended: the match lengths of each against its row's context (`suffix.step_lengths` from the kept
        row of its last position where rows are aligned and one position is new, else `suffix.query_lengths`), the
        token after each position, their positions; None without a copy head."""
        if self.copy_row is None:
            return None
        lengths = self.lengths
        Tb = max(lengths) if rows is None else int(self.cache.lengths_tensor(pos.device)[rows].max())
        ids = self.ids.narrow(1, 0, Tb) if rows is None else self.ids.narrow(1, 0, Tb).index_select(0, rows)
        t = lengths[0] - 1
        one = rows is None and pos.shape[1] == 1 and min(lengths) == max(lengths)  # a step of aligned rows
        if one and (self._copy_at == t - 1 or t == 0):  # the recurrence from the last position's row
            L = step_lengths(self.copy_row.narrow(1, 0, max(t - 1, 0)), ids, t).unsqueeze(1)  # [B, 1, t]
            L = torch.nn.functional.pad(L, (0, Tb - t))  # [B, 1, Tb]: 0 at j >= t
        else:
            L = query_lengths(ids, pos.clamp(max=Tb - 1))  # [b, Q, Tb]
        if one:  # kept for the next step's recurrence
            self.copy_row.narrow(1, 0, t).copy_(L[:, 0, :t])
        self._copy_at = t if one else None
        nxt = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=0)  # [b, Tb]
        return CopyInputs(L, nxt, pos)

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

    def _check_policy(self, B: int, Q: int, policy: Controller | Forced | None) -> tuple[StepPolicy, DecodePlan]:
        """The call's policy checked against this model (`check_policy`) and this state, and its plan
        (`plans.choose`), for Q query positions per row: once per policy object and Q, then kept (a decode loop pays
        no check and no choice per step)."""
        key = (id(policy), Q)
        kept = self._plans.get(key)
        if kept is not None and kept[0] is policy and (not isinstance(policy, Forced) or policy.actions.shape[0] == B):
            return kept[1], kept[2]
        if isinstance(policy, Forced) and policy.actions.dim() == 3 and policy.actions.shape[-1] > 0 \
                and (not self.cfg.use_workspace or not self.has_bank):
            raise ValueError("forced actions need a workspace model and a DecodeState with a source bank")
        ws = check_policy(self.model, policy, (B, Q))
        if ws.n_steps > 0 and not self.has_bank:
            raise ValueError("this DecodeState was allocated without a source bank (bank=False): max_budget must be 0")
        plan = choose(self, ws, Q)
        if not isinstance(policy, Forced):  # forced actions are data of one call: checked again at the next
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = (policy, ws, plan)
        return ws, plan
