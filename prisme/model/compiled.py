"""Decode speed: a compiled decode step for the backbone (gpt-fast style), a compiled prefill, and the [in, out]
weight layout that speeds up the eager path.

The eager cached path (`Backbone.forward(tokens, cache)`) is written for per-call overhead: it slices the cache to the
keys seen so far, so every step has a new shape. A compiler wants one graph for every step, so `decode_step` keeps
all shapes fixed:
  * the chunk's positions are a tensor `input_pos` `[C]` (every row at the same offset), never a host int;
  * K/V are written with `index_copy_` at `input_pos` (`LayerKVCache.update`), and the queries attend to the cache's
    whole capacity `[B, nkv, T_cap, hd]` under the causal mask `keys <= input_pos` `[C, T_cap]`; positions past the
    current length are masked out, so the logits equal the eager path's (which reads only the first kv_len keys).
`prefill_step` fills an empty cache with a prompt: positions 0..P-1, attention within the prompt only; its length is
marked dynamic, so one graph serves every prompt length. Both reuse the backbone's own blocks (`Backbone._blocks`), so
the compiled and eager paths cannot drift apart.

`compile_decode(backbone, batch_size)` returns a `CompiledDecoder` that holds one preallocated `KVCache` and both
steps, by default `step` under `torch.compile(mode="max-autotune-no-cudagraphs")` and `prefill` under the default
mode. With `freeze=True` (the default) Inductor's freezing turns the weights into constants, so that it can prepack
them and use its own CPU GEMM kernels: that is what brings a batch-1 step to the memory-bandwidth floor. Frozen
weights are read at the first call: a decoder does not see later changes to the backbone's parameters.

`in_out_layout_(backbone)` stores the weights that `F.linear` reads as [in, out] in memory, same shapes and values:
batch-1 eager steps and compiled steps stream them faster (see its docstring).

Notation: B batch, C tokens in a call, P prompt length, T_cap the cache's capacity, V vocab, d width.
"""

from __future__ import annotations

import contextlib
import itertools
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from prisme.model import attention as attn
from prisme.model.backbone import Backbone, check_tokens
from prisme.model.kv_cache import CacheStep, KVCache

DEFAULT_MODE = "max-autotune-no-cudagraphs"
CUDA_MODE = "max-autotune"  # on CUDA the step also runs as a CUDA graph: one launch instead of one per kernel


def step_mode(mode: str | None, device: torch.device) -> str | None:
    """The compile mode of the one-token step on `device`: the default becomes `CUDA_MODE` on CUDA, where the step's
    inputs live at fixed addresses (the preallocated cache, one token buffer, one position tensor per step)."""
    return CUDA_MODE if mode == DEFAULT_MODE and device.type == "cuda" else mode


def uses_cuda_graphs(mode: str | None) -> bool:
    """Whether Inductor replays the step as a CUDA graph (its outputs are overwritten by the next replay)."""
    return mode is not None and "cudagraphs" not in mode and mode in ("max-autotune", "reduce-overhead")
QUIET = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}  # no autotune tables
_serial = itertools.count()
_graphs = torch._dynamo.utils.counters["stats"]  # "unique_graphs": graphs compiled in this process


def in_out_layout_(backbone: Backbone) -> Backbone:
    """Store every matrix that `F.linear` reads as [in, out] in memory; the `[out, in]` parameter becomes a view of it.

    Shapes, values, state_dict keys and the modules' code are unchanged, only strides: (1, out) instead of (in, 1).
    F.linear then hands MKL a plain [in, out] matrix rather than a transposed one (HF's GPT-2 `Conv1D` stores [in, out]
    too). Measured on prisme_103m, 2 threads (`prisme bench vs-hf`, one run each): eager batch-1 decode 24.5 -> 21.1 ms
    a step, but eager batch 8 36.5 -> 44.6 ms (MKL's batch-8 product prefers the transposed operand); compiled steps
    (frozen weights keep this layout) 13.7 -> 11.3 ms at batch 1 and 25.9 -> 20.1 ms at batch 8. The logits agree to
    rounding (the products sum in another order). Token embeddings that are not the head keep contiguous rows for the
    lookup; a tied head is re-laid out (its lookup then reads one strided row per token). Meant for inference:
    state_dict tensors become non-contiguous (`prisme.checkpoint` makes them contiguous when saving).
    """
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            lookup_only = name == "pos_emb.weight" or (name == "tok_emb.weight" and backbone.lm_head is not None)
            if p.dim() == 2 and not lookup_only:
                p.data = p.data.t().contiguous().t()  # [out, in] view of an [in, out] buffer
    return backbone


def decode_step(backbone: Backbone, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One fixed-shape cached step: logits of each row's last token.

    Args:
        tokens: `[B, C]` token ids, every row at the same positions.
        input_pos: `[C]` int64 absolute positions of the chunk (a tensor, so that one graph serves every step).
        cache: a `KVCache` with B rows; its K/V are written at `input_pos` (its host-side `lengths` are not touched).
    Returns:
        logits `[B, V]` of position `input_pos[-1]`.
    """
    B, C = tokens.shape
    mask = attn.causal_mask(input_pos, cache.max_len)  # [C, T_cap]: key j visible to the query at p iff j <= p
    step = CacheStep(input_pos, None, None, cache.max_len, mask)
    H, _ = backbone._blocks(tokens, input_pos.expand(B, C), cache, step)  # [B, C, d]
    return backbone.head(H[:, -1])  # [B, V]


def prefill_step(backbone: Backbone, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """A prompt into an empty cache: tokens `[B, P]` at positions 0..P-1, K/V written there; logits `[B, V]` of the
    last position. Attention reads the P prompt keys only, as the eager `Backbone.forward` does."""
    P = tokens.shape[1]
    input_pos = torch.arange(P, device=tokens.device)  # [P]
    step = CacheStep(input_pos, 0, None, P, None, causal=True)  # SDPA's causal kernel over the P prompt keys
    H, _ = backbone._blocks(tokens, 0, cache, step)  # [B, P, d]
    return backbone.head(H[:, -1])  # [B, V]


def own_code(fn: types.FunctionType) -> types.FunctionType:
    """A copy of `fn` with a code object of its own.

    torch.compile keeps its graphs, and its limit of 8 graphs, per code object. A closure made in a loop shares one
    code object, so without this every decoder of a process (and step with prefill) would count against one limit,
    and the 9th graph would silently run eagerly.
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_serial)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def compile_options(mode: str | None, cpp_wrapper: bool = False) -> dict[str, Any]:
    """Inductor options of `mode` (e.g. max_autotune), with autotuning's tables not printed.

    `cpp_wrapper`: the graph's kernels are called from one generated C++ function instead of Python (~10 µs less
    per call of the seed001 step, measured), at the price of a longer compilation."""
    from torch._inductor import list_mode_options

    return {**list_mode_options(mode or "default"), "cpp_wrapper": cpp_wrapper, **QUIET}


class FrozenCompile:
    """`torch.compile(fn, mode)` whose first call, the one that compiles, runs with Inductor's freezing on.

    Freezing must be on in the global Inductor config while Dynamo and AOTAutograd trace: passed in `options` it
    only reaches Inductor's own passes, the weights stay graph inputs, and the seed001 step takes ~110 µs instead of
    ~67 µs (measured). `config.patch` costs ~20 µs, too much for every step, so only the first call patches. A later
    recompilation (inputs whose sizes or strides the first call did not cover) would compile without freezing:
    correct, only slower; `CompiledDecoder` feeds fixed-layout inputs so that it does not happen, and a warning says
    if it does.
    """

    def __init__(self, fn: types.FunctionType, mode: str, dynamic: bool | None, freeze: bool,
                 cpp_wrapper: bool = False, math_attention: bool = False):
        options = compile_options(mode, cpp_wrapper)
        self.compiled = torch.compile(own_code(fn), fullgraph=True, dynamic=dynamic, options=options)
        self.freeze = freeze
        self.math_attention = math_attention  # trace SDPA as matmul + softmax (SDPBackend.MATH), fused by Inductor
        self.called = False

    def __call__(self, *args: Any) -> torch.Tensor:
        if self.called:
            graphs = _graphs["unique_graphs"]
            out = self.compiled(*args)
            if _graphs["unique_graphs"] != graphs:
                warnings.warn("prisme.model.compiled: a decoder recompiled after its first call, without Inductor "
                              "freezing (new input sizes or strides); it stays correct but runs slower", stacklevel=3)
            return out
        from torch._inductor import config
        from torch.nn.attention import SDPBackend, sdpa_kernel

        math = sdpa_kernel(SDPBackend.MATH) if self.math_attention else contextlib.nullcontext()
        with config.patch(freezing=self.freeze), math:
            out = self.compiled(*args)
        self.called = True
        return out


@dataclass
class CompiledDecoder:
    """A backbone's decode loop on one preallocated cache: `prefill` a prompt into it, then `step` one token at a time.

    Every row has the same length (a batch decoded in lockstep). `reset` empties the cache for the next prompt.
    """

    backbone: Backbone
    cache: KVCache
    mode: str | None  # torch.compile mode of `step`; None = the same fixed-shape step, run eagerly
    prefill_mode: str | None  # torch.compile mode of `prefill`; None = eager
    freeze: bool
    _step: Callable[[torch.Tensor, torch.Tensor, KVCache], torch.Tensor]
    _prefill: Callable[[torch.Tensor, KVCache], torch.Tensor]
    _positions: list[torch.Tensor] = field(default_factory=list)  # [1] per position: no allocation per step
    _tokens: torch.Tensor | None = None  # [B, 1]: every step's input in one layout (a compiled step guards on strides)

    def __post_init__(self) -> None:
        device = self.cache.layers[0].k.device
        self._positions = list(torch.arange(self.cache.max_len, device=device).split(1))
        self._tokens = torch.zeros(self.cache.batch_size, 1, dtype=torch.long, device=device)

    @property
    def length(self) -> int:
        """Positions in the cache (the same for every row)."""
        return self.cache.lengths[0]

    def reset(self) -> None:
        """Forget the cached sequence (the buffers are kept: positions past the length are never read)."""
        self.cache.truncate(0)

    def _check(self, tokens: torch.Tensor) -> None:
        check_tokens(tokens, self.backbone.cfg.vocab_size)
        B, C = tokens.shape
        if B != self.cache.batch_size:
            raise ValueError(f"batch of {B} rows does not match the decoder's {self.cache.batch_size} rows")
        if self.length + C > self.cache.max_len:
            raise ValueError(f"{self.length} cached + {C} new tokens exceeds the decoder's capacity "
                             f"{self.cache.max_len}")

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """A prompt `[B, P]` into the empty cache (call `reset` first to reuse a decoder); logits `[B, V]` of its
        last position."""
        self._check(tokens)
        if self.length:
            raise ValueError(f"prefill needs an empty decoder, this one holds {self.length} positions: call reset()")
        if self.prefill_mode is not None:  # canonical strides, and one graph for every prompt length where possible
            tokens = tokens.to(torch.long, memory_format=torch.contiguous_format, copy=True)  # [B, P]
            torch._dynamo.maybe_mark_dynamic(tokens, 1)
        logits = self._prefill(tokens, self.cache)  # [B, V]
        self.cache.advance([tokens.shape[1]] * tokens.shape[0])
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row `[B, 1]` appended; its logits `[B, V]`."""
        cache = self.cache
        if not isinstance(tokens, torch.Tensor) or tokens.shape != (cache.batch_size, 1):
            raise ValueError(f"step takes one token per row, shape [{cache.batch_size}, 1], got "
                             f"{getattr(tokens, 'shape', tokens)}")
        start = cache.lengths[0]
        if start >= cache.max_len:
            raise ValueError(f"the decoder is full: {start} positions of {cache.max_len}")
        check_tokens(tokens, self.backbone.cfg.vocab_size)  # shape only on CUDA: no host read per step
        logits = self._step(self._tokens.copy_(tokens), self._positions[start], cache)  # [B, V]
        cache.advance([1] * cache.batch_size)
        return logits.clone() if uses_cuda_graphs(self.mode) else logits  # a graph's output is its next replay's


def compile_decode(backbone: Backbone, batch_size: int, max_len: int | None = None, mode: str | None = DEFAULT_MODE,
                   prefill_mode: str | None = "default", freeze: bool = True, cpp_wrapper: bool = False,
                   math_attention: bool = False) -> CompiledDecoder:
    """A `CompiledDecoder` for `backbone` with a `batch_size` x `max_len` cache (default T_max).

    Args:
        mode: `torch.compile` mode of the one-token step (static shapes); None = run `decode_step` eagerly. The
            default is `CUDA_MODE` (CUDA graphs; each step's logits cloned out of the graph) on CUDA.
        prefill_mode: `torch.compile` mode of the prompt step (dynamic length); None = run `prefill_step` eagerly.
        freeze: Inductor freezing: weights become constants (read at the first call), which Inductor's own CPU GEMM
            kernels need. Compiled calls must run under `torch.no_grad()` or `torch.inference_mode()`.
        cpp_wrapper: the step's kernels called from generated C++ rather than Python (see `compile_options`):
            worth it for a small model, whose step is a few tens of µs; it adds seconds of compilation.
        math_attention: trace the step's attention as matmul + masked softmax (`SDPBackend.MATH`) instead of the
            CPU flash kernel, so that Inductor fuses it with its neighbours: for a small model (seed001: 71 -> 58 µs
            a step, measured), not a large batch (prisme_103m, batch 8: 37.5 -> 42.8 ms).
    A key-shift backbone (`key_shift`) compiles as any other: its cache's `prev` is updated in place. A sliding
    window shorter than the cache (`attn_window`) is a ValueError: decode it eagerly.
    Each compiled callable compiles at its first call: ~10 s for seed001, 15-90 s for prisme_103m with max-autotune
    on 2 cores (Inductor's graph cache does not apply to frozen graphs; its autotuning and kernel caches do).
    """
    if (mode is not None or prefill_mode is not None) and backbone.training:
        raise ValueError("compile_decode needs a backbone in eval mode (call backbone.eval())")
    cache = backbone.new_cache(batch_size, max_len)
    if cache.ring:  # TODO: the ring's slots and band mask in the fixed-shape step and the dynamic-length prefill
        raise ValueError(f"compile_decode does not support attn_window={backbone.cfg.attn_window} shorter than the "
                         f"cache ({cache.max_len} positions): decode a sliding-window backbone eagerly "
                         f"(Backbone.forward with a cache, or DecodeState)")
    mode = step_mode(mode, cache.layers[0].k.device)

    def fixed_step(tokens: torch.Tensor, input_pos: torch.Tensor, kv: KVCache) -> torch.Tensor:
        return decode_step(backbone, tokens, input_pos, kv)

    def prompt_step(tokens: torch.Tensor, kv: KVCache) -> torch.Tensor:
        return prefill_step(backbone, tokens, kv)

    step = fixed_step if mode is None else FrozenCompile(fixed_step, mode, False, freeze, cpp_wrapper, math_attention)
    prefill = prompt_step if prefill_mode is None else FrozenCompile(prompt_step, prefill_mode, None, freeze)
    return CompiledDecoder(backbone, cache, mode, prefill_mode, freeze, step, prefill)
