"""`prisme bench vs-hf`'s paths: our backbone and its HF copy with the same weights (`Pair`, `build_pair`), and what
each decode and prefill path runs (`decode_paths`, `prefill_paths`); `vs_hf` checks and times them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from prisme.bench import harness
from prisme.bench.harness import TimedPath
from prisme.config import PrismeConfig
from prisme.interop import hf_cache_kwarg, to_hf
from prisme.model.backbone import Backbone
from prisme.model.compiled import CompiledDecoder, in_out_layout_


@dataclass
class Pair:
    """One shape: our backbone and its HF copy with the same weights."""

    backbone: Backbone
    hf: nn.Module
    threads: int
    device: torch.device = torch.device("cpu")  # where both models, the tokens and the timers run

    def __post_init__(self) -> None:
        self.cache_kw = hf_cache_kwarg(self.hf)  # looked up once: inspect.signature is slow next to a decode step

    @property
    def cfg(self) -> PrismeConfig:
        return self.backbone.cfg

    def hf_call(self, tokens: torch.Tensor, cache: Any, **kw: Any) -> torch.Tensor:
        """HF logits `[B, C, V]` for tokens `[B, C]` appended to `cache`."""
        return self.hf(tokens, use_cache=True, **{self.cache_kw: cache}, **kw).logits

    def new_hf_cache(self, kind: str, max_len: int) -> Any:
        import transformers

        if kind == "static":
            return transformers.StaticCache(config=self.hf.config, max_cache_len=max_len)
        return transformers.DynamicCache(config=self.hf.config)


@dataclass
class DecodePath:
    """One way to decode: `start()` prefills the prompt into a fresh cache (untimed); `step(state, i)` appends new
    token i and returns its logits `[B, V]`."""

    name: str
    start: Callable[[], Any]
    step: Callable[[Any, int], torch.Tensor]

    def timed(self, n: int) -> TimedPath:
        step = self.step

        def run(state: Any) -> None:
            for i in range(n):
                step(state, i)

        return self.name, self.start, run

    def logits(self, n: int) -> torch.Tensor:
        """Logits `[B, n, V]` of the n forced tokens."""
        state = self.start()
        return torch.stack([self.step(state, i) for i in range(n)], dim=1)


def decode_paths(pair: Pair, prompt: torch.Tensor, new: torch.Tensor, decoder: CompiledDecoder | None,
                 pos_shift: int = 0) -> list[DecodePath]:
    """The decode paths for prompt `[B, P]` and forced tokens `[B, N]`; `pos_shift` != 0 plants a bug in HF's
    positions (negative control)."""
    bb, (B, P), N = pair.backbone, prompt.shape, new.shape[1]
    toks = [new[:, i:i + 1] for i in range(N)]  # [B, 1] each
    pos = [torch.full((B, 1), P + i + pos_shift, device=prompt.device) for i in range(N)]  # [B, 1] each

    def hf_start(kind: str) -> Callable[[], Any]:
        def start() -> Any:
            cache = pair.new_hf_cache(kind, P + N)
            pair.hf_call(prompt, cache, logits_to_keep=1)
            return cache
        return start

    def hf_step(cache: Any, i: int) -> torch.Tensor:
        return pair.hf_call(toks[i], cache, position_ids=pos[i])[:, -1]

    def prisme_start() -> Any:
        cache = bb.new_cache(B, P + N)
        bb(prompt, cache)
        return cache

    def prisme_step(cache: Any, i: int) -> torch.Tensor:
        return bb.head(bb(toks[i], cache))[:, -1]

    paths = [DecodePath("hf_dynamic", hf_start("dynamic"), hf_step),
             DecodePath("hf_static", hf_start("static"), hf_step),
             DecodePath("prisme", prisme_start, prisme_step)]
    if decoder is not None:
        def compiled_start() -> CompiledDecoder:
            decoder.reset()
            decoder.prefill(prompt)
            return decoder

        paths.append(DecodePath("compiled", compiled_start, lambda dec, i: dec.step(toks[i])))
    return paths


def prefill_paths(pair: Pair, prompt: torch.Tensor, decoder: CompiledDecoder | None) -> list[TimedPath]:
    """Prompt `[B, P]` into a fresh cache (setup, untimed); each run returns the last position's logits `[B, V]`."""
    bb, (B, P) = pair.backbone, prompt.shape

    def fresh_decoder() -> CompiledDecoder:
        decoder.reset()
        return decoder

    paths: list[TimedPath] = [
        ("hf", lambda: pair.new_hf_cache("dynamic", P), lambda c: pair.hf_call(prompt, c, logits_to_keep=1)[:, -1]),
        ("prisme", lambda: bb.new_cache(B, P), lambda c: bb.head(bb(prompt, c)[:, -1]))]
    if decoder is not None:
        paths.append(("compiled", fresh_decoder, lambda dec: dec.prefill(prompt)))
    return paths


def build_pair(preset: str, seed: int, threads: int, in_out: bool = True, device: str | torch.device = "cpu") -> Pair:
    """A seeded backbone and its HF copy on `device`; `in_out`: our weights then stored [in, out]
    (`compile.in_out_layout_`)."""
    bb = harness.build_model(PrismeConfig.from_name(preset), seed)
    hf = to_hf(bb).to(device)  # contiguous copies, HF's own layouts
    bb = bb.to(device)
    return Pair(in_out_layout_(bb) if in_out else bb, hf, threads, torch.device(device))
