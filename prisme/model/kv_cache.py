"""The backbone's preallocated decode cache (`KVCache`: one `LayerKVCache` per layer and each row's length) and the
description of one chunk's place in it (`CacheStep`), which `prisme.model.attention` reads.

Notation: B batch, C new tokens in this call (a chunk), nkv key/value heads, hd head dim, d model width, R ring slots.

With a window W shorter than the cache's capacity the K/V buffers are a ring of R = W slots: position p lives in slot
p mod R (`attention.ring_positions`). With a key shift each layer also keeps every row's last normed attention input
`prev` `[B, d]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class CacheStep:
    """Where one chunk goes in the cache and what it attends to; built once per forward, shared by all layers."""

    input_pos: torch.Tensor | None  # [C] shared or [B, C] per row; None: a decode step, one token per row at the
    #   shared slot `start` (`CausalSelfAttention.one_token`)
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
