"""Sampling the next token from logits: greedy, temperature, top-k and top-p, from an explicit generator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prisme.checks import is_int, is_number


# ====================================================================== sampling
@dataclass(frozen=True)
class Sampling:
    """How `generate` picks each next token, checked when made: temperature 0 is greedy; otherwise softmax(logits /
    temperature) restricted to the `top_k` largest and then to the `top_p` nucleus. Each row samples with its own
    generator seeded from (seed, row index): the same seed gives the same sample, whatever the other rows do (None:
    a fresh seed)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**62):
            raise ValueError(f"seed must be None or an int in [0, 2**62), got {self.seed!r}")



def check_sampling(temperature: Any, top_k: Any, top_p: Any) -> None:
    """ValueError unless temperature is a finite number >= 0, top_k None or an int >= 1, top_p None or in (0, 1]."""
    if not is_number(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if 0 < temperature < 1e-4:  # logits / 1e-300 overflow to inf: use 0 for greedy
        raise ValueError(f"temperature must be 0 (greedy) or >= 1e-4, got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (not is_number(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")


GREEDY = Sampling()
"""Greedy decoding (temperature 0), generate's default."""


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
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # bf16/fp16: sample in fp32
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
