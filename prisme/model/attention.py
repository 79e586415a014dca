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
hold the current objects. Blocks, attention and MLP are still called as modules, so their hooks fire.

Options (`PrismeConfig.key_shift`, `attn_window`): with a key shift each layer's cache also keeps every row's last
normed attention input `prev` `[B, d]`, the shifted input of the row's next position. With a window W shorter than
the cache's capacity the K/V buffers are a ring of R = W slots, `[B, nkv, R, hd]`: position p lives in slot p mod R,
so decode memory and time follow W, not T. Which position a slot holds follows from the row's length alone
(`ring_positions`). A one-token step writes its key first and then attends to the R slots (they then hold exactly
its window); a longer chunk attends to the ring's old keys and its own new ones side by side (`CacheStep.concat`,
R + C keys under a band mask) and then writes its last R positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


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


@dataclass(slots=True)
class CacheStep:
    """Where one chunk goes in the cache and what it attends to; built once per forward, shared by all layers."""

    input_pos: torch.Tensor | None  # [C] shared or [B, C] per row; None for one token at a shared offset (unread)
    start: int | None  # the shared first slot as a host int (slice writes), None for per-row positions
    valid: torch.Tensor | None  # [B, C]: False marks right padding (not written); None = all real
    kv_len: int  # keys attended: the first kv_len cached slots
    mask: torch.Tensor | None  # [C, S] or [B, 1, C, S] bool; None = every query sees all kv_len keys
    causal: bool = False  # a chunk from position 0 with kv_len == C: SDPA's causal kernel, which skips the masked half
    slots: torch.Tensor | None = None  # [C] or [B, C]: the slots the chunk's K/V go to (a ring); None = input_pos
    concat: bool = False  # attend to the kv_len cached slots and the chunk's own K/V (S = kv_len + C), then write
    write: torch.Tensor | None = None  # with concat, [B, C]: the entries written (each row's last R real positions);
    #   None = the chunk's last min(C, R) positions of every row
    last: torch.Tensor | None = None  # key shift, ragged chunk: [B] each row's last real token (its next `prev`)
    moved: torch.Tensor | None = None  # ... and [B, 1] whether the row has one (a row without keeps its `prev`)
    order: torch.Tensor | None = None  # with concat, a chunk longer than the window at a shared offset 0 or >= R: the
    #   old slots in position order (empty at offset 0), so that old and new keys are one run of positions and the
    #   band is attended in blocks (`window_attention`, O(C W)) instead of under a [C, R + C] mask


class LayerKVCache:
    """Preallocated keys/values of one layer, `[B, nkv, S_cap, hd]` (S_cap = T_max, or the ring's R slots), written in
    place by slot index; with a key shift also each row's last normed input `prev` `[B, d]` (zero in an empty row)."""

    def __init__(self, batch_size: int, n_kv_head: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None, shift_dim: int = 0):
        shape = (batch_size, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.prev = torch.zeros(batch_size, shift_dim, dtype=dtype, device=device) if shift_dim else None  # [B, d]

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v `[B, nkv, C, hd]` at positions start..start+C-1 of every row."""
        self.k.narrow(2, start, k.shape[2]).copy_(k)
        self.v.narrow(2, start, v.shape[2]).copy_(v)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               valid: torch.Tensor | None = None) -> None:
        """Write k, v `[B, nkv, C, hd]` at `input_pos` (`[C]` shared or `[B, C]` per row).

        Entries with `valid[b, c] == False` (right padding of a ragged chunk) are not written.
        """
        if input_pos.dim() == 1:  # shared positions: no host read, so a fixed-shape step compiles (model.compiled)
            self.k.index_copy_(2, input_pos, k.to(self.k.dtype))
            self.v.index_copy_(2, input_pos, v.to(self.v.dtype))
            return
        B = k.shape[0]
        rows = torch.arange(B, device=k.device).unsqueeze(1).expand_as(input_pos)  # [B, C]
        k_rows, v_rows = k.transpose(1, 2), v.transpose(1, 2)  # [B, C, nkv, hd]
        if valid is not None:
            rows, pos, k_rows, v_rows = rows[valid], input_pos[valid], k_rows[valid], v_rows[valid]
        else:
            pos = input_pos
        self.k[rows, :, pos] = k_rows.to(self.k.dtype)  # under autocast the projections are bf16, the cache not
        self.v[rows, :, pos] = v_rows.to(self.v.dtype)

    def write_ring(self, step: CacheStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """After a `concat` step: write the chunk's K/V `[B, nkv, C, hd]` that the ring keeps (`step.write`, or every
        row's last min(C, R) positions) at their slots `step.slots`; each slot is written at most once."""
        if step.write is None:  # shared positions, all real
            m = min(k.shape[2], self.k.shape[2])
            idx = step.slots[-m:]  # [m] distinct slots
            self.k.index_copy_(2, idx, k[:, :, -m:].to(self.k.dtype))
            self.v.index_copy_(2, idx, v[:, :, -m:].to(self.v.dtype))
            return
        slots = step.slots.expand(step.write.shape)  # [B, C]
        rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1).expand_as(slots)[step.write]  # [N]
        self.k[rows, :, slots[step.write]] = k.transpose(1, 2)[step.write].to(self.k.dtype)
        self.v[rows, :, slots[step.write]] = v.transpose(1, 2)[step.write].to(self.v.dtype)

    def shift_input(self, x: torch.Tensor) -> torch.Tensor:
        """The key shift's input of a chunk: normed x `[B, C, d]` -> n(x_{t-1}) `[B, C, d]`, each row's `prev` first.
        With C == 1 a view of `prev`: project it before `shift_update` moves `prev` on."""
        prev = self.prev.unsqueeze(1).to(x.dtype)  # [B, 1, d]
        return prev if x.shape[1] == 1 else torch.cat([prev, x[:, :-1]], dim=1)  # [B, C, d]

    def shift_update(self, x: torch.Tensor, step: CacheStep) -> None:
        """`prev` <- each row's normed input x `[B, C, d]` at its last real position (rows without one keep theirs)."""
        if step.last is None:
            self.prev.copy_(x[:, -1])
            return
        at = step.last.view(-1, 1, 1).expand(-1, 1, x.shape[-1])  # [B, 1, d]
        self.prev.copy_(torch.where(step.moved, x.gather(1, at).squeeze(1).to(self.prev.dtype), self.prev))

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()
        if self.prev is not None:
            self.prev.zero_()

    @property
    def nbytes(self) -> int:
        kv = self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
        return kv + (0 if self.prev is None else self.prev.numel() * self.prev.element_size())


@dataclass(frozen=True)
class CacheShape:
    """What a backbone's decode cache holds per row: `n_layer` layers of `n_kv_head` heads of `head_dim`.

    window: the attention window W (None: none). Shorter than the cache's `max_len`, it makes every layer's K/V a ring
    of `slots` = W entries (position p in slot p mod W); else `slots` = max_len and slot p holds position p.
    shift_dim: d with a key shift (each layer keeps `prev` `[B, d]`), 0 without.
    """

    n_layer: int
    n_kv_head: int
    head_dim: int
    window: int | None = None
    shift_dim: int = 0


class KVCache:
    """The backbone's decode cache: one `LayerKVCache` per layer plus each row's length (host-side ints), for
    `batch_size` rows of up to `max_len` positions of the `CacheShape` `shape`."""

    def __init__(self, shape: CacheShape, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        n_layer, n_kv_head, head_dim = shape.n_layer, shape.n_kv_head, shape.head_dim
        window, shift_dim = shape.window, shape.shift_dim
        self.window = window
        self.ring = window is not None and window < max_len
        self.slots = window if self.ring else max_len
        self.layers = [LayerKVCache(batch_size, n_kv_head, self.slots, head_dim, dtype, device, shift_dim)
                       for _ in range(n_layer)]
        self.batch_size = batch_size
        self.max_len = max_len
        self.key_shift = shift_dim > 0
        self.lengths = [0] * batch_size
        self._lengths_t: torch.Tensor | None = None  # the lengths on the device, valid while _lengths_of == lengths
        self._lengths_of: list[int] | None = None

    def lengths_tensor(self, device: torch.device | str) -> torch.Tensor:
        """Each row's length `[B]` (long) on `device`. Uploaded once, then kept on the device as the rows advance
        by equal counts (decoding), so a decode step uploads nothing; a new tensor each time the lengths change."""
        t = self._lengths_t
        if t is None or self._lengths_of != self.lengths or t.device != torch.device(device):
            t = self._lengths_t = torch.tensor(self.lengths, dtype=torch.long, device=device)
            self._lengths_of = list(self.lengths)
        return t

    def _set_lengths(self, lengths: list[int], device_update: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """New host lengths; the device copy follows by `device_update` (a device op, no upload) or is dropped."""
        if self._lengths_t is not None and self._lengths_of == self.lengths and device_update is not None:
            self._lengths_t, self._lengths_of = device_update(self._lengths_t), list(lengths)
        else:
            self._lengths_t = self._lengths_of = None
        self.lengths = lengths

    def reset(self) -> None:
        """Forget every row's content (lengths to 0; buffers zeroed so stale keys can never leak)."""
        self._set_lengths([0] * self.batch_size, torch.zeros_like)
        for layer in self.layers:
            layer.reset()

    def set_lengths(self, lengths: list[int]) -> None:
        """Every row's length set as given (at most the capacity), the buffers left as they are: the caller vouches
        for what they hold (`DecodeState.fill_synthetic`)."""
        if len(lengths) != self.batch_size or any(not 0 <= n <= self.max_len for n in lengths):
            raise ValueError(f"set_lengths needs one length in [0, {self.max_len}] per row ({self.batch_size}), "
                             f"got {list(lengths)}")
        self._set_lengths([int(n) for n in lengths], None)

    def advance(self, n_new: list[int]) -> None:
        """Row b now holds `n_new[b]` more positions (their K/V were just written)."""
        if len(n_new) != self.batch_size:
            raise ValueError(f"advance needs one count per row ({self.batch_size}), got {len(n_new)}")
        lengths = [length + int(n) for length, n in zip(self.lengths, n_new)]
        if min(n_new, default=0) < 0 or max(lengths, default=0) > self.max_len:
            raise ValueError(f"cannot advance lengths {self.lengths} by {list(n_new)} within capacity {self.max_len}")
        same = len(set(n_new)) == 1
        self._set_lengths(lengths, (lambda t: t + int(n_new[0])) if same else None)

    def truncate(self, length: int) -> None:
        """Every row keeps its first `length` positions (at most its own length). The buffers past it are left as
        they are: a later step overwrites position `length` first, and no read reaches past a row's length.

        Only where that is exact: a key shift keeps each row's last normed input alone, so it truncates to 0 or to
        the rows' own length only; a ring truncates row b of length L_b iff no slot that a later query would read
        was overwritten, min(L_b - R, length) <= max(0, length - W + 1) (it never wrapped, or by at most one
        position past the cut with R = W). Else a ValueError, the cache unchanged."""
        if not 0 <= length <= min(self.lengths, default=0):
            raise ValueError(f"can only truncate to a length in [0, {min(self.lengths, default=0)}], got {length}")
        if length > 0 and self.key_shift and any(n != length for n in self.lengths):
            raise ValueError(f"a key-shift cache keeps each row's last position's input only: it truncates to 0 or "
                             f"to the rows' length, not from {self.lengths} to {length}")
        if length > 0 and self.ring:
            R, W = self.slots, self.window
            bad = [n for n in self.lengths if min(n - R, length) > max(0, length - W + 1)]
            if bad:
                raise ValueError(f"a sliding-window cache keeps the last {R} positions of each row: rows of "
                                 f"{bad[0]} positions cannot go back to {length} exactly (rewind at most one "
                                 f"position once the window is full)")
        if length == 0 and self.key_shift:  # position 0 reads a zero shift
            for layer in self.layers:
                layer.prev.zero_()
        self._set_lengths([length] * self.batch_size, lambda t: torch.full_like(t, length))

    @property
    def nbytes(self) -> int:
        """Exact payload bytes of the preallocated buffers (K/V, and the key shift's `prev`)."""
        return sum(layer.nbytes for layer in self.layers)

    def bytes_per_token(self) -> int:
        """K/V bytes one cached position (slot) of one row occupies, over all layers."""
        return sum(lay.k.numel() * lay.k.element_size() * 2 for lay in self.layers) // (self.batch_size * self.slots)


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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: LayerKVCache | None = None, step: CacheStep | None = None) -> torch.Tensor:
        """x `[B, C, d]` -> `[B, C, d]`.

        Args:
            rope: cos, sin from `rope_tables` at the chunk's positions, `[C, 1, hd]` or `[B, C, 1, hd]`; None = no
                rotation (gpt2).
            cache: None for causal attention within x (positions 0..C-1); else k, v are written where `step` says
                and the queries attend to the first `step.kv_len` cached slots under `step.mask` (with
                `step.concat`, to those and the chunk's own k, v, written afterwards).
        """
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
