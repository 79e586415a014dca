"""Attention, norms, rotary embeddings and the preallocated KV cache.

Notation: B batch, C new tokens in this call (a chunk), T_max cache capacity, S keys attended (kv_len),
nh query heads, nkv key/value heads, hd head dim, d model width.

Positions: `input_pos` is either a shared `[C]` tensor (every row at the same offset: the fast path, written with
slices) or a per-row `[B, C]` tensor (ragged batches: each row carries its own length). A query at position p sees
cached keys 0..p of its own row.

Speed: a CPU decode step of a small model is bound by per-call overhead, not by FLOPs: about 1 µs per aten op,
1.3 µs per `nn.Module.__call__` and 0.5 µs per `nn.Module.__getattr__` (every `self.child` or `self.weight`) in
torch 2.13. So the backbone describes a chunk once per forward (`CacheStep`: positions, start, mask) and every layer
reuses it; a shared-offset chunk is written with one `narrow().copy_()` per tensor; RoPE rotates q and k together
with full-width tables (4 ops); leaf layers (linears, norms, embeddings) are applied in functional form, and hot
paths read children and parameters from the registries (`self._modules[...]`, `._parameters[...]`), which always
hold the current objects. Blocks, attention and MLP are still called as modules, so their hooks fire. A decode step
(one token per row at a shared offset, the common case) runs the blocks on `[B, d]` rows
(`CausalSelfAttention.one_token`, `Backbone._one_token`): no chunk bookkeeping, the same products.

Options (`PrismeConfig.key_shift`, `attn_window`): with a key shift each layer's cache also keeps every row's last
normed attention input `prev` `[B, d]`, the shifted input of the row's next position. With a window W shorter than
the cache's capacity the K/V buffers are a ring of R = W slots, `[B, nkv, R, hd]`: position p lives in slot p mod R,
so decode memory and time follow W, not T. Which position a slot holds follows from the row's length alone
(`ring_positions`). A one-token step writes its key first and then attends to the R slots (they then hold exactly
its window); a longer chunk attends to the ring's old keys and its own new ones side by side (`CacheStep.concat`,
R + C keys under a band mask) and then writes its last R positions.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.model.kv_cache import CacheStep, LayerKVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """`layer(x)` for an `nn.Linear`, in functional form with registry reads (see the module docstring)."""
    p = layer._parameters
    return F.linear(x, p["weight"], p["bias"])


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[max_len, head_dim]` in float64, laid out for `apply_rope` (HF Llama's half-split convention).

    With angles `a` `[max_len, hd/2]`: cos = [cos a, cos a] and sin = [-sin a, sin a], so that
    rope(x) = x * cos + roll(x, hd/2) * sin = [x1 cos a - x2 sin a, x2 cos a + x1 sin a].
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # [hd/2]
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # [T_max, hd/2]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [T_max, hd] each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[..., hd]` (e.g. `[B, C, heads, hd]`); cos/sin from `rope_tables`, broadcastable to x (`[C, 1, hd]`).
    Computed in x's dtype: under bf16 autocast the float32 tables would otherwise promote q and k to float32."""
    return x * cos.to(x.dtype) + x.roll(x.shape[-1] // 2, dims=-1) * sin.to(x.dtype)


def causal_mask(input_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean attention mask: query at absolute position p sees keys j <= p.

    input_pos `[C]` -> `[C, kv_len]`; `[B, C]` -> `[B, 1, C, kv_len]`.
    """
    keys = torch.arange(kv_len, device=input_pos.device)  # [S]
    mask = keys <= input_pos.unsqueeze(-1)  # [..., C, S]
    return mask if input_pos.dim() == 1 else mask.unsqueeze(1)


def chunk_positions(lengths: list[int], n_tokens: int, device: torch.device,
                    lengths_t: torch.Tensor | None = None) -> torch.Tensor:
    """Absolute positions of a new chunk: shared `[C]` if every row has the same length, else `[B, C]`.

    lengths_t: the same lengths already on `device` (`KVCache.lengths_tensor`): per-row positions without an upload."""
    if len(set(lengths)) == 1:
        return torch.arange(lengths[0], lengths[0] + n_tokens, device=device)  # [C]
    offsets = torch.arange(n_tokens, device=device)  # [C]
    if lengths_t is None:
        lengths_t = torch.tensor(lengths, device=device)
    return lengths_t.unsqueeze(1) + offsets  # [B, C]


def band_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Query at position p sees a key at position j iff 0 <= j <= p and (with a window W) j > p - W.

    q_pos `[C]` and k_pos `[S]` -> `[C, S]`; q_pos `[B, C]` and k_pos `[B, S]` -> `[B, 1, C, S]`. A key position < 0
    marks an empty slot."""
    q, k = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)  # [..., C, 1], [..., 1, S]
    mask = (k <= q) & (k >= 0)
    if window is not None:
        mask &= k > q - window
    return mask if q_pos.dim() == 1 else mask.unsqueeze(1)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, gqa: bool = False) -> torch.Tensor:
    """Causal sliding-window attention over a whole sequence in blocks: q `[B, nh, C, hd]`, k, v `[B, nkv, C, hd]` ->
    `[B, nh, C, hd]`, equal to attention under `band_mask(pos, pos, window)` at O(C W) instead of O(C^2).

    The positions are cut into blocks of W (the last padded); the queries of block b attend to the keys of blocks b - 1
    and b (2W keys, of which a query at offset i sees offsets i + 1 .. i + W: exactly its window), block 0's first half
    masked."""
    B, nh, C, hd = q.shape
    W = window
    nb = -(-C // W)
    pad = nb * W - C

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [B, h, C, hd] -> [B, nb, h, W, hd]
        x = F.pad(x, (0, 0, 0, pad)) if pad else x
        return x.view(x.shape[0], x.shape[1], nb, W, hd).transpose(1, 2)

    def with_previous(x: torch.Tensor) -> torch.Tensor:  # [B, nb, h, W, hd] -> [B, nb, h, 2W, hd]
        return torch.cat([F.pad(x[:, :-1], (0, 0, 0, 0, 0, 0, 1, 0)), x], dim=3)

    i = torch.arange(W, device=q.device).unsqueeze(1)  # [W, 1] query offset
    j = torch.arange(2 * W, device=q.device).unsqueeze(0)  # [1, 2W] key offset from the previous block's start
    mask = ((j > i) & (j <= i + W)).expand(nb, 1, W, 2 * W).clone()  # [nb, 1, W, 2W]
    mask[0, :, :, :W] = False  # block 0 has no previous block
    y = F.scaled_dot_product_attention(blocks(q), with_previous(blocks(k)), with_previous(blocks(v)), attn_mask=mask,
                                       enable_gqa=gqa)  # [B, nb, nh, W, hd]
    return y.transpose(1, 2).reshape(B, nh, nb * W, hd)[:, :, :C]


def ring_positions(lengths: torch.Tensor | int, slots: int, device: torch.device | None = None) -> torch.Tensor:
    """The position each slot of a ring of `slots` holds in a row of `lengths` positions: the largest q < length
    with q = i (mod slots), or a negative number where there is none. lengths: an int -> `[R]`; `[B]` -> `[B, R]`."""
    i = torch.arange(slots, device=device if device is not None else getattr(lengths, "device", None))  # [R]
    if not isinstance(lengths, torch.Tensor):
        return i + slots * torch.div(lengths - 1 - i, slots, rounding_mode="floor")  # [R]
    last = lengths.unsqueeze(1) - 1  # [B, 1]
    return i + slots * torch.div(last - i, slots, rounding_mode="floor")  # [B, R]


def chunk_start(lengths: list[int]) -> int:
    """The shared offset of a chunk whose rows all hold the same number of positions (a host int: no device read)."""
    return lengths[0]


def _heads_first(x: torch.Tensor, B: int, C: int, heads: int, hd: int) -> torch.Tensor:
    """`[B, C, heads * hd]` (or `[B, C, heads, hd]`) -> `[B, heads, C, hd]`; one view when C == 1 (decode)."""
    if C == 1:
        return x.view(B, heads, 1, hd)
    return x.view(B, C, heads, hd).transpose(1, 2)


class CausalSelfAttention(nn.Module):
    """Multi-head attention with GQA (llama) or plain MHA with biases (gpt2); fused qkv projection.

    key_shift: a second key projection `wk_shift` (d -> nkv hd, no bias: the key's own bias already covers it) of the
    previous position's normed input, added to the key before RoPE. window: causal sliding window of W positions.
    """

    def __init__(self, d_model: int, n_head: int, n_kv_head: int, bias: bool, use_rope: bool,
                 key_shift: bool = False, window: int | None = None):
        super().__init__()
        self.n_head, self.n_kv_head = n_head, n_kv_head
        self.head_dim = d_model // n_head
        self.use_rope = use_rope
        self.window = window
        self.wqkv = nn.Linear(d_model, (n_head + 2 * n_kv_head) * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_head * self.head_dim, d_model, bias=bias)
        if key_shift:  # called as a module (its hooks fire: the cost counter tags it); absent without the option
            self.wk_shift = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)

    def one_token(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, cache: LayerKVCache,
                  step: CacheStep) -> torch.Tensor:
        """`forward` of a decode step, one token per row at a shared offset (`step.input_pos` None, its slot
        `step.start`): x `[B, d]` -> `[B, d]`, the same products in fewer calls; rope: the position's cos, sin `[hd]`.
        The key shift's projection runs in functional form (the cost counter tags it by its weight)."""
        B = x.shape[0]
        nh, nkv, hd = self.n_head, self.n_kv_head, self.head_dim
        children = self._modules
        qkv = linear(x, children["wqkv"])  # [B, (nh + 2 nkv) hd]
        shift = children.get("wk_shift")
        if shift is not None:  # k += W_s n(x_{t-1}), then `prev` moves on to this position's input
            qkv.narrow(-1, nh * hd, nkv * hd).add_(linear(cache.prev.to(x.dtype), shift))
            cache.prev.copy_(x)
        n = (nh + nkv) * hd
        qk = qkv[:, :n].view(B, nh + nkv, hd)  # q and k heads
        if rope is not None:
            qk = apply_rope(qk, *rope)
        slot, S = step.start, step.kv_len
        cache.k.select(2, slot).copy_(qk[:, nh:])
        cache.v.select(2, slot).copy_(qkv[:, n:].view(B, nkv, hd))
        k_all, v_all = cache.k, cache.v
        if S < k_all.shape[2]:
            k_all, v_all = k_all.narrow(2, 0, S), v_all.narrow(2, 0, S)  # [B, nkv, S, hd]
        y = F.scaled_dot_product_attention(qk[:, :nh].unsqueeze(2), k_all, v_all, enable_gqa=nh != nkv)
        return linear(y.view(B, nh * hd), children["wo"])  # [B, d]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: LayerKVCache | None = None, step: CacheStep | None = None) -> torch.Tensor:
        """x `[B, C, d]` -> `[B, C, d]`; a decode step (`step.input_pos` None: one token per row at a shared offset)
        runs `one_token` on x `[B, d]`.

        Args:
            rope: cos, sin from `rope_tables` at the chunk's positions, `[C, 1, hd]` or `[B, C, 1, hd]` (`[hd]` in a
                decode step); None = no rotation (gpt2).
            cache: None for causal attention within x (positions 0..C-1); else k, v are written where `step` says
                and the queries attend to the first `step.kv_len` cached slots under `step.mask` (with
                `step.concat`, to those and the chunk's own k, v, written afterwards).
        """
        if step is not None and step.input_pos is None:  # a decode step: x `[B, d]`, one token per row
            return self.one_token(x, rope, cache, step)
        B, C, _ = x.shape
        nh, nkv, hd = self.n_head, self.n_kv_head, self.head_dim
        children = self._modules
        qkv = linear(x, children["wqkv"])  # [B, C, (nh + 2 nkv) hd]
        shift = children.get("wk_shift")
        if shift is not None:  # k_t += W_s n(x_{t-1}); zero before position 0
            prev = F.pad(x[:, :-1], (0, 0, 1, 0)) if cache is None else cache.shift_input(x)  # [B, C, d]
            qkv.narrow(-1, nh * hd, nkv * hd).add_(shift(prev))  # the keys' columns of [B, C, (nh + 2 nkv) hd]
            if cache is not None:
                cache.shift_update(x, step)
        if rope is not None:  # rotate q and k in one call
            qk = apply_rope(qkv[..., :(nh + nkv) * hd].view(B, C, nh + nkv, hd), *rope)  # [B, C, nh + nkv, hd]
            q, k = torch.split_with_sizes(_heads_first(qk, B, C, nh + nkv, hd), (nh, nkv), 1)  # [B, nh | nkv, C, hd]
            v = _heads_first(qkv[..., (nh + nkv) * hd:], B, C, nkv, hd)  # [B, nkv, C, hd]
        else:
            heads = _heads_first(qkv, B, C, nh + 2 * nkv, hd)  # [B, nh + 2 nkv, C, hd]
            q, k, v = torch.split_with_sizes(heads, (nh, nkv, nkv), 1)  # [B, nh | nkv, C, hd]
        gqa = nh != nkv
        if cache is None:
            if self.window is None or C <= self.window:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # [B, nh, C, hd]
            else:
                y = window_attention(q, k, v, self.window, gqa)  # [B, nh, C, hd]
        elif step.concat and step.order is not None:  # a long chunk: old slots by position, then its own keys
            R = step.order.numel()
            k_all = torch.cat([cache.k.index_select(2, step.order).to(k.dtype), k], dim=2)  # [B, nkv, R + C, hd]
            v_all = torch.cat([cache.v.index_select(2, step.order).to(v.dtype), v], dim=2)
            y = window_attention(F.pad(q, (0, 0, R, 0)), k_all, v_all, self.window, gqa)[:, :, R:]  # [B, nh, C, hd]
            cache.write_ring(step, k, v)
        elif step.concat:  # a chunk on a ring: its window spans old slots and its own keys
            k_all = torch.cat([cache.k.to(k.dtype), k], dim=2)  # [B, nkv, R + C, hd]
            v_all = torch.cat([cache.v.to(v.dtype), v], dim=2)
            y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=step.mask, enable_gqa=gqa)
            cache.write_ring(step, k, v)
        else:
            if step.start is not None:
                cache.write(step.start, k, v)
            else:
                cache.update(step.input_pos if step.slots is None else step.slots, k, v, step.valid)
            if step.causal:  # the chunk is the whole cache so far: causal attention within it
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                k_all, v_all = cache.k.narrow(2, 0, step.kv_len), cache.v.narrow(2, 0, step.kv_len)  # [B, nkv, S, hd]
                y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=step.mask, enable_gqa=gqa)
        y = y.view(B, C, nh * hd) if C == 1 else y.transpose(1, 2).reshape(B, C, nh * hd)  # [B, C, d]
        return linear(y, children["wo"])
