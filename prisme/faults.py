"""Deliberate bugs, for negative controls.

A correctness check is only worth something if it can fail. Each context manager here breaks one mechanism the
way a real bug would; tests and `prisme bench` run their equivalence checks under it and assert that the error
becomes large. Never used outside those checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import attention


@contextlib.contextmanager
def reset_positions() -> Iterator[None]:
    """Every chunk is placed at positions 0..C-1, as if the cache forgot how long each row already is."""
    original = attention.chunk_positions

    def broken(lengths: list[int], n_tokens: int, device: torch.device) -> torch.Tensor:
        return original([0] * len(lengths), n_tokens, device)

    attention.chunk_positions = broken
    try:
        yield
    finally:
        attention.chunk_positions = original


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
