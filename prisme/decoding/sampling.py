"""Incremental decoding with the workspace: `DecodeState`, sampling, batched generation (SPEC §4).

Notation: B rows, C new tokens per row in one call (a chunk), Q query positions whose workspace runs, R actions per
position, T_max the state's capacity, V vocab, d backbone width, w workspace width.

A `DecodeState` (allocated by `PrismeModel.new_decode_state`) owns the backbone's KV cache, the source bank K/V
`[B, T_max, w]` and each row's length. Every new position takes the same path as in the parallel `forward_policy`:
one backbone step with the cache; its bank entry appended (only new positions are projected); then its own
workspace, run by the model's own methods on an `EncodedContext` whose queries are the new positions and whose bank
is the cache (`rollout_policy`, or `rollout_forced` for forced actions, then `logits_from_state`). Reusing those
methods is what makes decoding exact: forced-token decoding in chunks of any size gives, in float64, the logits
(to ~1e-12) and action traces of one teacher-forced `forward_policy` call (tests/test_generate.py).

Ragged batches: rows are right-padded and carry their own lengths; `n_new[b]` says how many of a chunk's C tokens of
row b are real. Outputs at padding positions are unspecified (`StepOutput.valid` marks the real ones); rows with no
new token take no part in the workspace.

Every public entry point checks its whole input before it touches the state: a ValueError leaves the state as it was.
"""

from __future__ import annotations

from typing import Any

import torch

from prisme.checks import is_int, is_number


# ====================================================================== sampling
def check_sampling(temperature: Any, top_k: Any, top_p: Any) -> None:
    """ValueError unless temperature is a finite number >= 0, top_k None or an int >= 1, top_p None or in (0, 1]."""
    if not is_number(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (not is_number(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")


def sample_logits(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens `[N]` from logits `[N, V]`.

    temperature 0 is greedy (argmax); otherwise softmax(logits / temperature), restricted to the `top_k` largest
    logits and then to the smallest set of tokens whose probability reaches `top_p` (nucleus), sampled with
    `generator` (same generator state -> same sample).
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [N, V]
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p  # the mass before this token already reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)  # [N, V]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
