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
masks. Where its run keeps a slot K/V cache (`EditorRun.slot_kv`: `ExecutionOptions(slot_kv_cache=True)` with
`cfg.optimised`), the slot K/V of sub-block (b) are kept in a `SlotKV` cache and recomputed only for the
slots an action changed (the seed's accounting, the default, recomputes all M slots in every block: on CPU the cache's
extra gathers and scatters cost more time than its projections save); DENSE actions, which change every slot, take
the seed's path and leave the cache stale for that position.

How a pass runs (eagerly, through a compiled editor's graphs, on a decode step's fixed shapes) is an `EditorRun`:
the model's default, or the one a decode plan passes; the editor itself has one forward and one pass (`blocks_pass`).

Contracts: slots outside the action are bitwise unchanged; S, K, V and the bank mask are never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.config import PrismeConfig
from prisme.model.attention import RMSNorm, linear
from prisme.model.backbone import apply_norm
from prisme.model.bank.read import BankRead, PackedRead
from prisme.model.outputs import EditInfo, EncodedContext, SlotKV
from prisme.model.workspace import action_groups, group_first_actions


def blocks_pass(blocks: nn.ModuleList, x: torch.Tensor, st: torch.Tensor | None, rem: torch.Tensor | None,
                S_pos: torch.Tensor, slots: torch.Tensor, read: BankRead,
                e: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One action group through every editor block, seed accounting: each block reads the K/V of all M slots of the
    position at its input (S_pos `[N, M, w]` with the group's slots `[N, k]` replaced by x `[N, k, w]`) and the bank
    through `read` (`prisme.model.bank.read`: its `attend`). `e`: each block's step embeddings' sum given instead of
    st, rem (`EditorBlock.step_embedding`, rows that share a step).

    The editor's one pass: eager here, and inside the compiled editor's graphs
    (`prisme.model.compiled_editor.CompiledEditor`). Returns (x_out `[N, k, w]`, gates: one `[N, k, 1]` per block).
    """
    rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1)  # [N, 1]
    gates = []
    for i, blk in enumerate(blocks):  # block 0's input is S_pos itself (x holds its slots)
        kv = blk.slot_keys_values(S_pos if i == 0 else S_pos.index_put((rows, slots), x.to(S_pos.dtype)))  # [N, M, 2w]
        x, g = blk(x, st, rem, read, kv, None if e is None else e[i])
        gates.append(g)
    return x, gates


def edit_group(blocks: nn.ModuleList, S: torch.Tensor, slots: torch.Tensor, read: BankRead, e: list[torch.Tensor]
               ) -> torch.Tensor:
    """Rows that each take one action of the same group (each row one query): `blocks_pass` on their slots `[n, k]`
    of S `[n, M, w]`, reading the bank through `read` (a per-row reader: `EntryRead` or `IdRead`) with the shared step
    embeddings `e`; returns S with those slots rewritten (S is not modified). The deployed decode step's fired rows
    run it per action group, eagerly or inside a compiled graph (`prisme.model.plans.budget1`, `prisme.model.fired`)."""
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
                bank: BankRead, slot_kv: torch.Tensor, e: torch.Tensor | None = None
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


@dataclass(frozen=True)
class EditorRun:
    """How the editor's passes run, resolved once from an `prisme.options.ExecutionOptions` (for a model:
    `PrismeModel.set_execution`; for a decode state: `prisme.model.plans.editor_run`): through a compiled editor
    (`compiled`: a `prisme.model.compiled_editor.CompiledEditor`) or eagerly, keeping each position's slot K/V
    (`slot_kv`: the optimised editor's cache) or not, and for a decode step of one query per row on the compiled
    editor's fixed-shape graphs (`static`: the "static" plan's)."""

    compiled: Any = None
    slot_kv: bool = False
    static: bool = False

    @property
    def is_compiled(self) -> bool:
        """Whether its passes run through a compiled editor."""
        return self.compiled is not None


EAGER_RUN = EditorRun()


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
        self.run = EAGER_RUN  # how its passes run unless a call says otherwise (`PrismeModel.set_execution`)

    def _apply(self, fn, *args, **kwargs):  # the tables are derived from the config: valid after `to_empty` too
        out = super()._apply(fn, *args, **kwargs)
        group, slots, _ = action_groups(self.cfg)
        self.act_group, self.act_slots = group.to(self.act_group.device), slots.to(self.act_slots.device)
        return out

    def forward(self, S: torch.Tensor, ctx: EncodedContext, action: torch.Tensor, step: torch.Tensor,
                remaining: torch.Tensor, slot_kv: SlotKV | None = None, run: EditorRun | None = None
                ) -> tuple[torch.Tensor, EditInfo]:
        """Apply one action per position.

        Args:
            S: `[B, Tq, M, w]` workspace before the action (never modified).
            ctx: the positions' context: the bank `ctx.K`, `ctx.V` `[B, Tb, w]` and its mask `ctx.bank_mask`
                `[B, Tq, Tb]` (True where query t may read key j).
            action: `[B, Tq]` ids in [0, A+1]; STOP positions are left untouched.
            step, remaining: `[B, Tq]` in [0, r_max).
            slot_kv: slot K/V cache (optimised path) or None (recompute all M slots' K/V in every block).
            run: how the passes run (None: the editor's own `run`).
        Returns:
            (S_new `[B, Tq, M, w]`, EditInfo); S_new is S itself when no position edits.
        """
        K, V, bank_mask = ctx.K, ctx.V, ctx.bank_mask
        run = self.run if run is None else run
        compiled = run.compiled
        if compiled is not None:  # a compiled pass recomputes every slot's K/V: no cache is read or kept
            slot_kv = None
        group = self.act_group[action]  # [B, Tq]
        counts = torch.bincount(group.flatten() + 1, minlength=len(self.group_sizes) + 1).tolist()  # STOP first
        if sum(counts[1:]) == 0:
            return S, EditInfo(0, [], slot_kv)
        if run.static and bank_mask.shape[1] == 1 and S.shape[1] == 1:  # a decode step on fixed shapes
            return compiled.padded(self, S, (K, V, bank_mask), action, step, remaining, (group, counts))
        dense_group = len(self.group_sizes) - 1
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
            read = PackedRead.of(K, V, bank_mask, b_idx, t_idx, self.cfg.n_ws_heads, k)
            cached = slot_kv is not None and g_id != dense_group
            if not cached:  # seed accounting: K/V of all M slots at each block's input
                x, gs = (blocks_pass if compiled is None else compiled)(self.blocks, x, st, rem, S[b_idx, t_idx],
                                                                        slots, read)
                for i, g in enumerate(gs):
                    gates[i].append(g)
            else:  # cached K/V of the untouched slots; recompute only the action's slots (none at block 0)
                for i, blk in enumerate(self.blocks):
                    kv = slot_kv.kv[i][b_idx, t_idx]  # [N, M, 2w]
                    if i > 0:
                        kv = kv.index_put((rows, slots), blk.slot_keys_values(x).to(kv.dtype))
                    x, g = blk(x, st, rem, read, kv)
                    gates[i].append(g)
            S_new[bi, ti, slots] = x.to(S_new.dtype)  # (autocast computes x in lower precision)
            if cached:
                for i, blk in enumerate(self.blocks):
                    kv_new[i] = put(kv_new[i], (bi, ti, slots), blk.slot_keys_values(x))
        out_kv = None
        if slot_kv is not None:
            out_kv = SlotKV(kv_new, slot_kv.ready & (group != dense_group) if counts[-1] else slot_kv.ready)
        return S_new, EditInfo(sum(counts[1:]), gates, out_kv)

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
