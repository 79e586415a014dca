"""SparseEditor: rewrites only the slots of the chosen action, at the positions that chose one.

Notation: B batch, Tq query positions, Tb bank positions, M slots, w width, N active positions of one action
group, k slots per action of that group (1, 2 or M for DENSE), nh = w / ws_head_dim heads of hd.

For each action, each of the `n_edit_blocks` blocks updates the action's k slots x `[N, k, w]`:
  (a) cross-attention from the slots to the causal bank K, V (queries and outputs projected, K/V read as they are),
  (b) attention over all M slots of the position (keys/values of every slot at the block's input),
  (c) a SwiGLU FFN w -> h_e -> w,
each pre-norm and residual, with step and remaining-budget embeddings added to each normed input, and one scalar
gate per block: g = sigmoid(w_g . norm(x_in) + b_g), x_out = x_in + g (x - x_in).

Work follows the edits: the editor gathers the chosen slots of active positions, never computes every slot and
masks. Where the model's `ExecutionOptions` keep a slot K/V cache (`slot_kv_cache`, with `cfg.optimised`:
`SparseEditor.slot_kv_cache`), the slot K/V of sub-block (b) are kept in a `SlotKV` cache and recomputed only for the
slots an action changed (the seed's accounting, the default, recomputes all M slots in every block: on CPU the cache's
extra gathers and scatters cost more time than its projections save); DENSE actions, which change every slot, take
the seed's path and leave the cache stale for that position.

Contracts: slots outside the action are bitwise unchanged; S, K, V and the bank mask are never written.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.config import PrismeConfig
from prisme.model.attention import RMSNorm, linear
from prisme.model.backbone import apply_norm
from prisme.model.workspace import action_groups, group_first_actions
from prisme.options import EAGER, ExecutionOptions


@dataclass
class SlotKV:
    """Per-block slot keys/values `[B, Tq, M, 2w]` of the current workspace, and which positions have them."""

    kv: list[torch.Tensor]
    ready: torch.Tensor  # [B, Tq] bool

    @classmethod
    def empty(cls, S: torch.Tensor, n_blocks: int) -> SlotKV:
        B, Tq, M, w = S.shape
        kv = [S.new_zeros(B, Tq, M, 2 * w) for _ in range(n_blocks)]
        return cls(kv=kv, ready=torch.zeros(B, Tq, dtype=torch.bool, device=S.device))


@dataclass
class EditInfo:
    """What one editor call did: how many positions it edited, and each block's gate values."""

    n_positions: int
    gates: list[list[torch.Tensor]]  # per block: gate values of each action group
    slot_kv: SlotKV | None = None

    @property
    def gate_mean(self) -> list[torch.Tensor]:
        """Per block, the mean gate over every edited slot (empty when nothing was edited)."""
        return [torch.cat([g.flatten() for g in gs]).mean() for gs in self.gates if gs]


class BankView:
    """The causal bank seen by N active positions, packed per batch row so attention reads K, V in place.

    Row b's active positions get ranks 0..n_b-1; queries are laid out `[B, N_max, k]`, so each row attends to its
    own bank with a `[B, 1, N_max k, Tb]` mask. Padding ranks attend to key 0 only (never all-masked: no NaN).
    """

    def __init__(self, K: torch.Tensor, V: torch.Tensor, bank_mask: torch.Tensor, b_idx: torch.Tensor,
                 t_idx: torch.Tensor, n_heads: int, k: int):
        B, Tb, w = K.shape
        self.B, self.w, self.nh, self.k = B, w, n_heads, k
        self.K = K.view(B, Tb, n_heads, w // n_heads).transpose(1, 2)  # [B, nh, Tb, hd]
        self.V = V.view(B, Tb, n_heads, w // n_heads).transpose(1, 2)
        N = b_idx.numel()
        masks = bank_mask[b_idx, t_idx]  # [N, Tb]
        if bank_mask.shape[1] == 1:  # one query per row (decoding): rows are positions
            self.n_max, self.full = 1, N == B
            self.rank = torch.zeros_like(b_idx)
        else:
            counts = torch.bincount(b_idx, minlength=B)  # [B]
            self.n_max = int(counts.max())
            self.full = N == B * self.n_max  # every row has n_max positions, in order
            self.rank = torch.arange(N, device=K.device) - (torch.cumsum(counts, 0) - counts)[b_idx]
        self.b_idx = b_idx
        if self.full:
            mask = masks.view(B, self.n_max, Tb)
        else:
            mask = torch.zeros(B, self.n_max, Tb, dtype=torch.bool, device=K.device)
            mask[:, :, 0] = True
            mask[b_idx, self.rank] = masks
        self.mask = mask.unsqueeze(2).expand(B, self.n_max, k, Tb).reshape(B, 1, self.n_max * k, Tb)

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The tensors `bank_attend` reads: (K, V `[B, nh, Tb, hd]`, mask `[B, 1, N_max k, Tb]`, b_idx, rank `[N]`)."""
        return self.K, self.V, self.mask, self.b_idx, self.rank

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """q `[N, k, w]` -> attention output `[N, k, w]` over each position's causal bank."""
        return bank_attend(q, *self.parts(), self.full)


def bank_attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor, b_idx: torch.Tensor,
                rank: torch.Tensor, full: bool) -> torch.Tensor:
    """`BankView.attend` from its parts (every size read from a shape, so one compiled graph serves all of them); a
    mask of None (with `full`, one query per row) reads every key."""
    N, k, w = q.shape
    B, nh = K.shape[0], K.shape[1]
    n = 1 if mask is None else mask.shape[2] // k
    if full:
        qp = q.reshape(B, n * k, nh, w // nh)
    else:
        qp = q.new_zeros(B, n, k, w).index_put((b_idx, rank), q).view(B, n * k, nh, w // nh)
    y = F.scaled_dot_product_attention(qp.transpose(1, 2), K, V, attn_mask=mask)  # [B, nh, nk, hd]
    y = y.transpose(1, 2).reshape(B, n, k, w)
    return y.view(N, k, w) if full else y[b_idx, rank]


class EntryRead:
    """The editor's attention over the banks of N rows as entries K, V `[N, Tb, w]`, each row one query (a decode
    step's fired rows: `SparseEditor.edit_rows`). `rows(i, j, mask)` is the same read for rows i..j-1, each reading
    the keys `mask` `[j - i, Tb]` allows (None: all); `attend(q)` is `bank_attend` over them. A bank kept as ids and
    read through its tables (`prisme.model.bank.tables.IdRead`) answers the same two calls."""

    def __init__(self, K: torch.Tensor, V: torch.Tensor, n_heads: int):
        N, Tb, w = K.shape
        self.K = K.view(N, Tb, n_heads, w // n_heads).transpose(1, 2)  # [N, nh, Tb, hd]
        self.V = V.view(N, Tb, n_heads, w // n_heads).transpose(1, 2)
        self.mask: torch.Tensor | None = None

    def rows(self, i: int, j: int, mask: torch.Tensor | None) -> EntryRead:
        out = copy.copy(self)
        out.K, out.V, out.mask = self.K[i:j], self.V[i:j], mask
        return out

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """q `[n, k, w]` -> attention output `[n, k, w]` over each row's bank (`BankView.attend`'s contract)."""
        n, k, _ = q.shape
        m = None if self.mask is None else self.mask.view(n, 1, 1, -1).expand(n, 1, k, self.mask.shape[-1])
        return bank_attend(q, self.K, self.V, m, None, None, True)  # full: every row one query, in order


class _Bank:
    """`BankView`'s attention from its parts (what a compiled group pass builds inside its graph)."""

    def __init__(self, parts: tuple[torch.Tensor, ...], full: bool):
        self._parts, self.full = parts, full

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        return bank_attend(q, *self._parts, self.full)


def blocks_pass(blocks: nn.ModuleList, x: torch.Tensor, st: torch.Tensor | None, rem: torch.Tensor | None,
                S_pos: torch.Tensor, slots: torch.Tensor, bank_read: tuple[tuple[torch.Tensor, ...], bool],
                e: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One action group through every editor block, seed accounting: each block reads the K/V of all M slots of the
    position at its input (S_pos `[N, M, w]` with the group's slots `[N, k]` replaced by x `[N, k, w]`) and the bank
    through `bank_read` = (`BankView.parts()`, `BankView.full`), or an object with their `attend` (an `EntryRead` or
    an `IdRead`, in eager decoding). `e`: each block's step embeddings' sum given instead of st, rem
    (`EditorBlock.step_embedding`, rows that share a step).

    A pure function of tensors (and the bool `full`), so that `prisme.model.compiled.compile_editor` can compile it; the
    eager editor runs the very same function. Returns (x_out `[N, k, w]`, gates: one `[N, k, 1]` per block).
    """
    rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1)  # [N, 1]
    bank = bank_read if hasattr(bank_read, "attend") else _Bank(*bank_read)  # (a reader: eager decoding only)
    gates = []
    for i, blk in enumerate(blocks):  # block 0's input is S_pos itself (x holds its slots)
        kv = blk.slot_keys_values(S_pos if i == 0 else S_pos.index_put((rows, slots), x.to(S_pos.dtype)))  # [N, M, 2w]
        x, g = blk(x, st, rem, bank, kv, None if e is None else e[i])
        gates.append(g)
    return x, gates


def edit_group(blocks: nn.ModuleList, S: torch.Tensor, slots: torch.Tensor, read: Any, e: list[torch.Tensor]
               ) -> torch.Tensor:
    """Rows that each take one action of the same group (each row one query): `blocks_pass` on their slots `[n, k]`
    of S `[n, M, w]`, reading the bank through `read` (an `EntryRead` or an `IdRead`) with the shared step embeddings
    `e`; returns S with those slots rewritten (S is not modified). `SparseEditor.edit_rows` runs it per group, and a
    compiled editor's fired-rows graph inside its graph (`prisme.model.fired`)."""
    rows = torch.arange(S.shape[0], device=S.device).unsqueeze(1)  # [n, 1]
    x, _ = blocks_pass(blocks, S[rows, slots], None, None, S, slots, read, e)
    return S.index_put((rows, slots), x.to(S.dtype))


def _index_put_fn():
    """Without autograd the slot K/V cache is written in place (the rollouts never reuse an older cache); with it,
    out of place, so that earlier versions stay valid for the backward pass."""
    if torch.is_grad_enabled():
        return lambda t, idx, v: t.index_put(idx, v.to(t.dtype))
    return lambda t, idx, v: t.index_put_(idx, v.to(t.dtype))


def _slot_attention(q: torch.Tensor, kv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q `[N, k, w]` attends over kv `[N, M, 2w]` (keys | values) of its own position -> `[N, k, w]`."""
    N, k, w = q.shape
    hd = w // n_heads
    keys, values = kv.chunk(2, dim=-1)  # [N, M, w] each
    qh = q.view(N, k, n_heads, hd).transpose(1, 2)  # [N, nh, k, hd]
    kh = keys.reshape(N, -1, n_heads, hd).transpose(1, 2)  # [N, nh, M, hd]
    vh = values.reshape(N, -1, n_heads, hd).transpose(1, 2)
    y = F.scaled_dot_product_attention(qh, kh, vh)  # [N, nh, k, hd]
    return y.transpose(1, 2).reshape(N, k, w)


class EditorBlock(nn.Module):
    def __init__(self, cfg: PrismeConfig):
        super().__init__()
        w, h = cfg.w, cfg.editor_hidden
        self.n_heads = cfg.n_ws_heads
        self.norm_src = RMSNorm(w, cfg.norm_eps)
        self.src_q = nn.Linear(w, w, bias=False)
        self.src_o = nn.Linear(w, w, bias=False)
        self.norm_slot = RMSNorm(w, cfg.norm_eps)
        self.slot_q = nn.Linear(w, w, bias=False)
        self.slot_kv = nn.Linear(w, 2 * w, bias=False)
        self.slot_o = nn.Linear(w, w, bias=False)
        self.norm_ffn = RMSNorm(w, cfg.norm_eps)
        self.w13 = nn.Linear(w, 2 * h, bias=False)
        self.w2 = nn.Linear(h, w, bias=False)
        self.gate = nn.Linear(w, 1, bias=True)
        self.step_emb = nn.Embedding(cfg.r_max, w)
        self.rem_emb = nn.Embedding(cfg.r_max, w)

    def step_embedding(self, step: int, remaining: int) -> torch.Tensor:
        """The step and remaining-budget embeddings' sum `[w]` of one (step, remaining) pair: what `forward` adds to
        each normed input of rows that share it (the same numbers, broadcast)."""
        c = self._modules
        return c["step_emb"]._parameters["weight"][step] + c["rem_emb"]._parameters["weight"][remaining]

    def slot_keys_values(self, X: torch.Tensor) -> torch.Tensor:
        """Keys | values `[..., 2w]` of slot states X `[..., w]` (no step conditioning: cacheable)."""
        c = self._modules
        return linear(apply_norm(c["norm_slot"], X), c["slot_kv"])

    def bank_attention(self, x: torch.Tensor, step: torch.Tensor, remaining: torch.Tensor, K: torch.Tensor,
                       bank_mask: torch.Tensor) -> torch.Tensor:
        """Diagnostics: the cross-attention weights `[B, nh, Tq, Tb]` sub-block (a) gives a slot state x `[B, Tq, w]`
        at step/remaining `[B, Tq]` over the bank K `[B, Tb, w]` (the same scores as `forward`'s attention)."""
        B, Tq, w = x.shape
        hd = w // self.n_heads
        e = self.step_emb(step) + self.rem_emb(remaining)  # [B, Tq, w]
        q = self.src_q(self.norm_src(x) + e).view(B, Tq, self.n_heads, hd).transpose(1, 2)  # [B, nh, Tq, hd]
        k = K.view(B, K.shape[1], self.n_heads, hd).transpose(1, 2)  # [B, nh, Tb, hd]
        scores = (q @ k.transpose(-1, -2)) * hd ** -0.5  # [B, nh, Tq, Tb]
        return scores.masked_fill(~bank_mask.unsqueeze(1), float("-inf")).softmax(-1)

    def forward(self, x: torch.Tensor, step: torch.Tensor | None, remaining: torch.Tensor | None,
                bank: BankView | _Bank, slot_kv: torch.Tensor, e: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[N, k, w]` chosen slots; step, remaining `[N]`; slot_kv `[N, M, 2w]` -> (x_out, gate `[N, k, 1]`).
        `e`: the step embeddings' sum given instead (`step_embedding`: `[w]`, shared by every row; step and
        remaining are then not read).

        Leaf layers in functional form with registry reads, as the backbone's (a decode step's edit is bound by
        per-call overhead: `prisme.model.attention`)."""
        c = self._modules
        if e is None:
            e = (F.embedding(step, c["step_emb"]._parameters["weight"])
                 + F.embedding(remaining, c["rem_emb"]._parameters["weight"])).unsqueeze(1)  # [N, 1, w]
        hx = apply_norm(c["norm_src"], x)  # [N, k, w]
        h = x + linear(bank.attend(linear(hx + e, c["src_q"])), c["src_o"])
        q = linear(apply_norm(c["norm_slot"], h) + e, c["slot_q"])
        h = h + linear(_slot_attention(q, slot_kv, self.n_heads), c["slot_o"])
        a, b = linear(apply_norm(c["norm_ffn"], h) + e, c["w13"]).chunk(2, dim=-1)
        h = h + linear(F.silu(a) * b, c["w2"])
        g = torch.sigmoid(linear(hx, c["gate"]))  # [N, k, 1]
        return torch.lerp(x, h.to(x.dtype), g.to(x.dtype)), g  # x + g (h - x); casts only under autocast


class SparseEditor(nn.Module):
    def __init__(self, cfg: PrismeConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(EditorBlock(cfg) for _ in range(cfg.n_edit_blocks))
        group, slots, sizes = action_groups(cfg)
        self.register_buffer("act_group", group, persistent=False)  # [A+2]
        with torch.device("cpu"):  # (also when the model is built on the meta device)
            self.group_of = action_groups(cfg)[0].tolist()  # the same on the host: a decode step groups there
        self.register_buffer("act_slots", slots, persistent=False)  # [A+2, M]
        self.group_sizes = sizes
        self.group_first = group_first_actions(cfg)
        self.execution: ExecutionOptions = EAGER  # how it runs (`set_execution`)
        self.compiled = None  # the compiled `blocks_pass` they ask for (`prisme.model.compiled.editor_for`), or None

    def set_execution(self, execution: ExecutionOptions, compiled: Any = None) -> None:
        """Run as `execution` says, with `compiled` (a `prisme.model.compiled.CompiledEditor`, what its `compile`
        built: `PrismeModel.set_execution`) or None (eager)."""
        self.execution, self.compiled = execution, compiled

    @property
    def slot_kv_cache(self) -> bool:
        """Whether edits keep a slot K/V cache (`PrismeModel.new_slot_kv`): the optimised editor with the option on.
        A compiled editor recomputes every slot's K/V and reads none."""
        return self.cfg.optimised and self.execution.slot_kv_cache

    def _apply(self, fn, *args, **kwargs):  # the tables are derived from the config: valid after `to_empty` too
        out = super()._apply(fn, *args, **kwargs)
        group, slots, _ = action_groups(self.cfg)
        self.act_group, self.act_slots = group.to(self.act_group.device), slots.to(self.act_slots.device)
        return out

    def forward(self, S: torch.Tensor, K: torch.Tensor, V: torch.Tensor, bank_mask: torch.Tensor,
                action: torch.Tensor, step: torch.Tensor, remaining: torch.Tensor,
                slot_kv: SlotKV | None = None) -> tuple[torch.Tensor, EditInfo]:
        """Apply one action per position.

        Args:
            S: `[B, Tq, M, w]` workspace before the action (never modified).
            K, V: `[B, Tb, w]` bank; bank_mask: `[B, Tq, Tb]` bool, True where query t may read key j.
            action: `[B, Tq]` ids in [0, A+1]; STOP positions are left untouched.
            step, remaining: `[B, Tq]` in [0, r_max).
            slot_kv: slot K/V cache (optimised path) or None (recompute all M slots' K/V in every block).
        Returns:
            (S_new `[B, Tq, M, w]`, EditInfo); S_new is S itself when no position edits.
        """
        if self.compiled is not None:  # the compiled pass recomputes every slot's K/V: no cache is read or kept
            slot_kv = None
        group = self.act_group[action]  # [B, Tq]
        counts = torch.bincount(group.flatten() + 1, minlength=len(self.group_sizes) + 1).tolist()  # STOP first
        if sum(counts[1:]) == 0:
            return S, EditInfo(0, [], slot_kv)
        dense_group = len(self.group_sizes) - 1
        if self.compiled is not None and self.execution.static_decode and bank_mask.shape[1] == 1 and S.shape[1] == 1:
            return self._padded_forward(S, (K, V, bank_mask), action, step, remaining, (group, counts))
        if slot_kv is not None and sum(counts[1:-1]):  # DENSE rewrites every slot: no cache to reuse
            slot_kv = self._fill_slot_kv(S, slot_kv, (group >= 0) & (group != dense_group))
        S_new = S.clone()
        kv_new = None if slot_kv is None else list(slot_kv.kv)
        put = _index_put_fn()
        gates: list[list[torch.Tensor]] = [[] for _ in self.blocks]
        for g_id, k in enumerate(self.group_sizes):
            if counts[g_id + 1] == 0:
                continue
            b_idx, t_idx = torch.nonzero(group == g_id, as_tuple=True)  # [N], [N]
            slots = self.act_slots[action[b_idx, t_idx], :k]  # [N, k]
            rows = torch.arange(b_idx.numel(), device=S.device).unsqueeze(1)  # [N, 1]
            bi, ti = b_idx.unsqueeze(1), t_idx.unsqueeze(1)
            x = S[bi, ti, slots]  # [N, k, w]
            st, rem = step[b_idx, t_idx], remaining[b_idx, t_idx]  # [N]
            bank = BankView(K, V, bank_mask, b_idx, t_idx, self.cfg.n_ws_heads, k)
            cached = slot_kv is not None and g_id != dense_group
            if not cached:  # seed accounting: K/V of all M slots at each block's input
                run = blocks_pass if self.compiled is None else self.compiled
                x, gs = run(self.blocks, x, st, rem, S[b_idx, t_idx], slots, (bank.parts(), bank.full))
                for i, g in enumerate(gs):
                    gates[i].append(g)
            else:  # cached K/V of the untouched slots; recompute only the action's slots (none at block 0)
                for i, blk in enumerate(self.blocks):
                    kv = slot_kv.kv[i][b_idx, t_idx]  # [N, M, 2w]
                    if i > 0:
                        kv = kv.index_put((rows, slots), blk.slot_keys_values(x).to(kv.dtype))
                    x, g = blk(x, st, rem, bank, kv)
                    gates[i].append(g)
            S_new[bi, ti, slots] = x.to(S_new.dtype)  # (autocast computes x in lower precision)
            if cached:
                for i, blk in enumerate(self.blocks):
                    kv_new[i] = put(kv_new[i], (bi, ti, slots), blk.slot_keys_values(x))
        out_kv = None
        if slot_kv is not None:
            out_kv = SlotKV(kv_new, slot_kv.ready & (group != dense_group) if counts[-1] else slot_kv.ready)
        return S_new, EditInfo(sum(counts[1:]), gates, out_kv)

    def edit_rows(self, S: torch.Tensor, read: Any, mask: torch.Tensor | None, action: torch.Tensor,
                  spans: list[tuple[int, int, int]], step: int, remaining: int) -> torch.Tensor:
        """One action per row, each row one query (a decode step's fired positions): what `forward` computes for
        them, without its bookkeeping (no group count or search, no bank packing, no gate record). Eager, seed
        accounting (no slot K/V cache).

        Args:
            S: `[N, M, w]` each row's workspace; read: what it reads of its bank, an `EntryRead` (entries `[N, Tb, w]`)
                or an `IdRead` (a bank kept as ids, read through its tables: `BankCache.read`); mask: `[N, Tb]` the
                keys each row may read (None: all of them).
            action: `[N]` non-STOP action ids, rows sorted by action group; spans: (group, first row, end row) of
                each group present.
            step, remaining: the step and remaining-budget embeddings' indices (the same for every row).
        Returns:
            S_new `[N, M, w]` (S is not modified).
        """
        e = [blk.step_embedding(step, remaining) for blk in self.blocks]  # [w] per block, shared by the rows
        out = []
        for g_id, i, j in spans:
            slots = self.act_slots[action[i:j], :self.group_sizes[g_id]]  # [n, k]
            out.append(edit_group(self.blocks, S[i:j], slots, read.rows(i, j, None if mask is None else mask[i:j]), e))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _padded_forward(self, S: torch.Tensor, bank: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                        action: torch.Tensor, step: torch.Tensor, remaining: torch.Tensor,
                        groups: tuple[torch.Tensor, list[int]]) -> tuple[torch.Tensor, EditInfo]:
        """A decode step (one query per row, Tq = 1) on the compiled editor's fixed-shape graphs: every action group
        present runs on all B rows (rows of other groups, or that STOP, run along on the group's first action's
        slots) against the whole bank (K, V `[B, Tb, w]`, its mask `[B, 1, Tb]`; the decode state passes its
        capacity, so Tb is fixed), and only the rows that took an action of the group are written (`groups`: each
        row's action group `[B, 1]` and the count per group, STOP first). Outputs of the other rows are dropped, so
        idle rows and untouched slots stay bitwise unchanged. Seed accounting (no slot K/V cache)."""
        K, V, bank_mask = bank
        group, counts = groups
        B, _, M, w = S.shape
        Tb = K.shape[1]
        nh = self.cfg.n_ws_heads
        Kh = K.view(B, Tb, nh, w // nh).transpose(1, 2)  # [B, nh, Tb, hd]
        Vh = V.view(B, Tb, nh, w // nh).transpose(1, 2)
        rows = torch.arange(B, device=S.device)
        zero = torch.zeros_like(rows)
        S_pos = S[:, 0]  # [B, M, w]
        S_new = S.clone()
        gates: list[list[torch.Tensor]] = [[] for _ in self.blocks]
        for g_id, k in enumerate(self.group_sizes):
            if counts[g_id + 1] == 0:
                continue
            mine = group[:, 0] == g_id  # [B]
            slots = self.act_slots[torch.where(mine, action[:, 0], self.group_first[g_id]), :k]  # [B, k]
            x = S_pos[rows.unsqueeze(1), slots]  # [B, k, w]
            mask = bank_mask.view(B, 1, 1, Tb).expand(B, 1, k, Tb)  # [B, 1, k, Tb]
            x, gs = self.compiled.static(k, self.blocks, x, step[:, 0], remaining[:, 0], S_pos, slots,
                                         ((Kh, Vh, mask, rows, zero), True))
            b_act = torch.nonzero(mine).squeeze(1)  # [N]
            S_new[b_act.unsqueeze(1), 0, slots[b_act]] = x[b_act].to(S_new.dtype)
            for i, g in enumerate(gs):
                gates[i].append(g[b_act])
        return S_new, EditInfo(sum(counts[1:]), gates, None)

    def _fill_slot_kv(self, S: torch.Tensor, cache: SlotKV, active: torch.Tensor) -> SlotKV:
        """Compute all M slots' K/V for active positions that do not have them yet."""
        todo = active & ~cache.ready
        if not bool(todo.any()):
            return cache
        b_idx, t_idx = torch.nonzero(todo, as_tuple=True)
        S_pos = S[b_idx, t_idx]  # [N, M, w]
        put = _index_put_fn()
        kv = [put(c, (b_idx, t_idx), blk.slot_keys_values(S_pos)) for c, blk in zip(cache.kv, self.blocks)]
        return SlotKV(kv, cache.ready | todo)
