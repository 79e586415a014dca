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
masks. With `cfg.optimised`, the slot K/V of sub-block (b) are kept in a `SlotKV` cache and recomputed only for
the slots an action changed (the seed's accounting recomputes all M slots in every block); DENSE actions, which
change every slot, take the seed's path and leave the cache stale for that position.

Contracts: slots outside the action are bitwise unchanged; S, K, V and the bank mask are never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import RMSNorm
from .config import PrismeConfig
from .workspace import action_groups


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
    """What one editor call did: how many positions it edited and the mean gate of each block."""

    n_positions: int
    gate_mean: list[torch.Tensor]  # per block, scalar (empty when nothing was edited)
    slot_kv: SlotKV | None = None


class BankView:
    """The causal bank seen by N active positions, packed per batch row so attention reads K, V in place.

    Row b's active positions get ranks 0..n_b-1; queries are laid out `[B, N_max, k]`, so each row attends to its
    own bank with a `[B, 1, N_max k, Tb]` mask. Padding ranks attend to key 0 only (never all-masked: no NaN).
    """

    def __init__(self, K: torch.Tensor, V: torch.Tensor, bank_mask: torch.Tensor, b_idx: torch.Tensor,
                 t_idx: torch.Tensor, n_heads: int):
        B, Tb, w = K.shape
        self.B, self.w, self.nh = B, w, n_heads
        self.K = K.view(B, Tb, n_heads, w // n_heads).transpose(1, 2)  # [B, nh, Tb, hd]
        self.V = V.view(B, Tb, n_heads, w // n_heads).transpose(1, 2)
        counts = torch.bincount(b_idx, minlength=B)  # [B]
        self.n_max = int(counts.max())
        self.full = bool(b_idx.numel() == B * self.n_max)  # every row has n_max positions, in order
        self.b_idx = b_idx
        self.rank = torch.arange(b_idx.numel(), device=K.device) - (torch.cumsum(counts, 0) - counts)[b_idx]
        masks = bank_mask[b_idx, t_idx]  # [N, Tb]
        if self.full:
            self.mask = masks.view(B, self.n_max, Tb)
        else:
            self.mask = torch.zeros(B, self.n_max, Tb, dtype=torch.bool, device=K.device)
            self.mask[:, :, 0] = True
            self.mask[b_idx, self.rank] = masks

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """q `[N, k, w]` -> attention output `[N, k, w]` over each position's causal bank."""
        N, k, w = q.shape
        B, n = self.B, self.n_max
        if self.full:
            qp = q.reshape(B, n, k, w)
        else:
            qp = q.new_zeros(B, n, k, w).index_put((self.b_idx, self.rank), q)
        qp = qp.view(B, n * k, self.nh, w // self.nh).transpose(1, 2)  # [B, nh, n k, hd]
        mask = self.mask.unsqueeze(2).expand(B, n, k, self.mask.shape[-1]).reshape(B, 1, n * k, -1)
        y = F.scaled_dot_product_attention(qp, self.K, self.V, attn_mask=mask)  # [B, nh, n k, hd]
        y = y.transpose(1, 2).reshape(B, n, k, w)
        return y.reshape(N, k, w) if self.full else y[self.b_idx, self.rank]


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

    def slot_keys_values(self, X: torch.Tensor) -> torch.Tensor:
        """Keys | values `[..., 2w]` of slot states X `[..., w]` (no step conditioning: cacheable)."""
        return self.slot_kv(self.norm_slot(X))

    def forward(self, x: torch.Tensor, step: torch.Tensor, remaining: torch.Tensor, bank: BankView,
                slot_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[N, k, w]` chosen slots; step, remaining `[N]`; slot_kv `[N, M, 2w]` -> (x_out `[N, k, w]`, gate)."""
        e = (self.step_emb(step) + self.rem_emb(remaining)).unsqueeze(1)  # [N, 1, w]
        hx = self.norm_src(x)  # [N, k, w]
        h = x + self.src_o(bank.attend(self.src_q(hx + e)))
        h = h + self.slot_o(_slot_attention(self.slot_q(self.norm_slot(h) + e), slot_kv, self.n_heads))
        a, b = self.w13(self.norm_ffn(h) + e).chunk(2, dim=-1)
        h = h + self.w2(F.silu(a) * b)
        g = torch.sigmoid(self.gate(hx))  # [N, k, 1]
        return x + g * (h - x), g.squeeze(-1)


class SparseEditor(nn.Module):
    def __init__(self, cfg: PrismeConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(EditorBlock(cfg) for _ in range(cfg.n_edit_blocks))
        group, slots, sizes = action_groups(cfg)
        self.register_buffer("act_group", group, persistent=False)  # [A+2]
        self.register_buffer("act_slots", slots, persistent=False)  # [A+2, M]
        self.group_sizes = sizes

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
        group = self.act_group[action]  # [B, Tq]
        if not bool((group >= 0).any()):
            return S, EditInfo(0, [], slot_kv)
        dense_group = len(self.group_sizes) - 1
        if slot_kv is not None:  # DENSE rewrites every slot: no cache to reuse, and it goes stale
            slot_kv = self._fill_slot_kv(S, slot_kv, (group >= 0) & (group != dense_group))
        S_new = S.clone()
        kv_new = None if slot_kv is None else list(slot_kv.kv)
        gates: list[list[torch.Tensor]] = [[] for _ in self.blocks]
        n_pos = 0
        for g_id, k in enumerate(self.group_sizes):
            b_idx, t_idx = torch.nonzero(group == g_id, as_tuple=True)  # [N], [N]
            if b_idx.numel() == 0:
                continue
            n_pos += b_idx.numel()
            slots = self.act_slots[action[b_idx, t_idx], :k]  # [N, k]
            rows = torch.arange(b_idx.numel(), device=S.device).unsqueeze(1)  # [N, 1]
            bi, ti = b_idx.unsqueeze(1), t_idx.unsqueeze(1)
            x = S[bi, ti, slots]  # [N, k, w]
            st, rem = step[b_idx, t_idx], remaining[b_idx, t_idx]  # [N]
            bank = BankView(K, V, bank_mask, b_idx, t_idx, self.cfg.n_ws_heads)
            cached = slot_kv is not None and g_id != dense_group
            S_pos = None if cached else S[b_idx, t_idx]  # [N, M, w]
            for i, blk in enumerate(self.blocks):
                if not cached:  # seed accounting: K/V of all M slots at the block's input
                    kv = blk.slot_keys_values(S_pos.index_put((rows, slots), x))  # [N, M, 2w]
                else:  # cached K/V of the untouched slots; recompute only the action's slots (none at block 0)
                    kv = slot_kv.kv[i][b_idx, t_idx]  # [N, M, 2w]
                    if i > 0:
                        kv = kv.index_put((rows, slots), blk.slot_keys_values(x))
                x, g = blk(x, st, rem, bank, kv)
                gates[i].append(g.flatten())
            S_new[bi, ti, slots] = x
            if cached:
                for i, blk in enumerate(self.blocks):
                    kv_new[i] = kv_new[i].index_put((bi, ti, slots), blk.slot_keys_values(x))
        out_kv = None if slot_kv is None else SlotKV(kv_new, slot_kv.ready & (group != dense_group))
        return S_new, EditInfo(n_pos, [torch.cat(g).mean() for g in gates], out_kv)

    def _fill_slot_kv(self, S: torch.Tensor, cache: SlotKV, active: torch.Tensor) -> SlotKV:
        """Compute all M slots' K/V for active positions that do not have them yet."""
        todo = active & ~cache.ready
        if not bool(todo.any()):
            return cache
        b_idx, t_idx = torch.nonzero(todo, as_tuple=True)
        S_pos = S[b_idx, t_idx]  # [N, M, w]
        kv = [c.index_put((b_idx, t_idx), blk.slot_keys_values(S_pos)) for c, blk in zip(cache.kv, self.blocks)]
        return SlotKV(kv, cache.ready | todo)
