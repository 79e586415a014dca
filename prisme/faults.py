"""Deliberate bugs, for negative controls.

A correctness check is only worth something if it can fail. Each context manager here breaks one mechanism the
way a real bug would; tests and `prisme bench` run their equivalence checks under it and assert that the error
becomes large. Never used outside those checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from prisme.model import attention as attention


@contextlib.contextmanager
def reset_positions() -> Iterator[None]:
    """Every chunk is placed at positions 0..C-1, as if the cache forgot how long each row already is."""
    original, original_start = attention.chunk_positions, attention.chunk_start

    def broken(lengths: list[int], n_tokens: int, device: torch.device, lengths_t=None) -> torch.Tensor:
        return original([0] * len(lengths), n_tokens, device)

    attention.chunk_positions, attention.chunk_start = broken, lambda lengths: 0
    try:
        yield
    finally:
        attention.chunk_positions, attention.chunk_start = original, original_start


@contextlib.contextmanager
def unshifted_mask() -> Iterator[None]:
    """The causal mask of a chunk is built from chunk-relative positions (not shifted by the cached length)."""
    original = attention.causal_mask

    def broken(input_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        return original(input_pos - input_pos[..., :1], kv_len)

    attention.causal_mask = broken
    try:
        yield
    finally:
        attention.causal_mask = original


@contextlib.contextmanager
def compiled_editor_unmasked() -> Iterator[None]:
    """Editors compiled inside this block (`prisme.model.compiled_editor.CompiledEditor`) build a graph that ignores
    the bank's causal mask, as a compiled path reading its whole preallocated bank would; the eager editor is
    untouched."""
    from prisme.model import compiled_editor as compile_mod

    def broken(blocks, x, st, rem, S_pos, slots, parts, full):  # noqa: ANN001, ANN202 - packed_pass's signature
        K, V, mask, b_idx, rank = parts
        return compile_mod.packed_pass(blocks, x, st, rem, S_pos, slots, (K, V, torch.ones_like(mask), b_idx, rank),
                                       full)

    original = compile_mod.CompiledEditor.source
    compile_mod.CompiledEditor.source = broken
    try:
        yield
    finally:
        compile_mod.CompiledEditor.source = original


@contextlib.contextmanager
def fired_rows_unmasked() -> Iterator[None]:
    """The compiled deployed step's fired rows (`prisme.model.fired`) read their whole padded bank, the keys past each
    row's length included, as a fixed-shape plan that forgot its mask would."""
    from prisme.model import fired

    original = fired.key_mask
    fired.key_mask = lambda lengths, Tp: torch.ones(lengths.shape[0], Tp, dtype=torch.bool, device=lengths.device)
    try:
        yield
    finally:
        fired.key_mask = original
