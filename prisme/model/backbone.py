"""The transformer backbone: tokens -> residual stream H (before the final norm), and head(H) -> logits.

Two families in one file, switched by `cfg.family`:
  * llama (PRISME default): RMSNorm, RoPE, GQA, SwiGLU, no biases, head tied to the token embedding;
  * gpt2 (seed 001's toy): LayerNorm with bias, learned absolute positions, biased linears, GELU MLP 4x, untied head.

Notation: B batch, C tokens in this call, d width, V vocab, T_max positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme import checks
from prisme.checks import is_int
from prisme.config import PrismeConfig
from prisme.model import attention as attn
from prisme.model.attention import CausalSelfAttention, RMSNorm, linear
from prisme.model.kv_cache import CacheShape, CacheStep, KVCache, LayerKVCache

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def check_tokens(tokens: torch.Tensor, vocab_size: int, what: str = "tokens") -> None:
    """ValueError unless `tokens` is a non-empty `[B, C]` integer tensor with ids in [0, vocab_size)."""
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dtype not in _INT_DTYPES:
        raise ValueError(f"{what} must be an integer tensor (torch.long), got dtype {tokens.dtype}")
    if tokens.dim() != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"{what} must have shape [B, T] with B, T >= 1, got {tuple(tokens.shape)}")
    if not tokens.is_cpu and not checks.DEVICE_VALUE_CHECKS:  # no host sync per forward (see checks)
        return
    if tokens.numel() <= 1024:  # decode-sized: one host copy beats a reduction kernel and two syncs
        rows = tokens.tolist()
        lo, hi = min(map(min, rows)), max(map(max, rows))
    else:
        lo, hi = (int(t) for t in torch.aminmax(tokens))
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{what} ids must lie in [0, {vocab_size}), got min {lo} and max {hi}")


def make_norm(cfg: PrismeConfig, dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=cfg.norm_eps) if cfg.family == "gpt2" else RMSNorm(dim, cfg.norm_eps)


_SPELLED_OUT = (torch.float32, torch.float64)  # the dtypes torch's CPU rms_norm computes in their own precision


def apply_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` in functional form with registry reads (see `prisme.attention` on decode overhead).

    An RMSNorm without autograd (decoding, evaluation) of a float32 or float64 tensor on the CPU is spelled out,
    x * rsqrt(sum(x * x) / d + eps) * g: the ops torch.rms_norm's CPU composite runs (its mean is the sum divided
    by d), so the same bits (tests/test_attention_cache.py), without its two copies and with d and eps kept as
    tensors (`_norm_scalars`): ~12 us a call less in a decode step at d = 256. Not while torch.compile traces: a
    compiled graph fuses the norm anyway, and it would replay the kept tensors' store at every call, so that the
    next graph's guard on them fails and it recompiles."""
    p = norm._parameters
    if isinstance(norm, nn.LayerNorm):
        return torch.layer_norm(x, norm.normalized_shape, p["weight"], p["bias"], norm.eps)
    if x.dtype in _SPELLED_OUT and x.is_cpu and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        d, eps = _norm_scalars(norm, x)
        return x * (x * x).sum(-1, keepdim=True).div_(d).add_(eps).rsqrt_() * p["weight"]
    return torch.rms_norm(x, (x.shape[-1],), p["weight"], norm.eps)


def _norm_scalars(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d and eps as 0-dim tensors of x's dtype, kept on the norm (a Python number in an in-place op is wrapped and
    cast at every call: ~1.3 us each in a decode step); the same values, so the same bits."""
    key = (x.dtype, x.device, x.shape[-1], norm.eps)
    kept = norm.__dict__.get("_spelled_scalars")  # (not a module attribute: never in a state dict)
    if kept is None or kept[0] != key:
        with torch.inference_mode(False):  # plain tensors: usable in and out of inference mode
            kept = (key, torch.tensor(float(x.shape[-1]), dtype=x.dtype, device=x.device),
                    torch.tensor(norm.eps, dtype=x.dtype, device=x.device))
        norm.__dict__["_spelled_scalars"] = kept
    return kept[1], kept[2]


class MLP(nn.Module):
    """SwiGLU (llama, fused gate/up projection `w13`) or GELU 4x (gpt2)."""

    def __init__(self, cfg: PrismeConfig):
        super().__init__()
        self.swiglu = cfg.family == "llama"
        h = cfg.ffn_hidden
        self.w13 = nn.Linear(cfg.d_model, 2 * h if self.swiglu else h, bias=cfg.use_bias)
        self.w2 = nn.Linear(h, cfg.d_model, bias=cfg.use_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        children = self._modules
        h = linear(x, children["w13"])  # [B, C, 2h] or [B, C, h]
        if self.swiglu:
            a, b = h.chunk(2, dim=-1)
            h = F.silu(a) * b  # [B, C, h]
        else:
            h = F.gelu(h, approximate="tanh")
        return linear(h, children["w2"])


class Block(nn.Module):
    def __init__(self, cfg: PrismeConfig):
        super().__init__()
        self.norm1 = make_norm(cfg, cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.use_bias, cfg.family == "llama",
                                        cfg.key_shift, cfg.attn_window)
        self.norm2 = make_norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: LayerKVCache | None = None, step: CacheStep | None = None) -> torch.Tensor:
        children = self._modules
        x = x + children["attn"](apply_norm(children["norm1"], x), rope, cache, step)
        return x + children["mlp"](apply_norm(children["norm2"], x))


class Backbone(nn.Module):
    def __init__(self, cfg: PrismeConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.family == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = make_norm(cfg, cfg.d_model)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.family == "llama":
            cos, sin = attn.rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
            self.register_buffer("rope_cos", cos.float(), persistent=False)  # [T_max, hd]
            self.register_buffer("rope_sin", sin.float(), persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                scale = 1 / math.sqrt(2 * self.cfg.n_layer) if name.endswith(("wo.weight", "w2.weight")) else 1.0
                nn.init.normal_(p, std=std * scale)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def _apply(self, fn, *args, **kwargs):
        """Recompute the RoPE tables after every move or cast: exact in float64, valid after `to_empty`."""
        out = super()._apply(fn, *args, **kwargs)
        if self.rope_cos is not None:
            cos, sin = attn.rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
            self.rope_cos = cos.to(device=self.rope_cos.device, dtype=self.rope_cos.dtype)
            self.rope_sin = sin.to(device=self.rope_sin.device, dtype=self.rope_sin.dtype)
        return out

    # ------------------------------------------------------------------ caches
    def new_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """Allocate a `KVCache` for `batch_size` rows of up to `max_len` (default T_max) positions (with
        `attn_window` W < max_len, a ring of W slots per row; with `key_shift`, each row's last normed input)."""
        max_len = self.cfg.max_seq_len if max_len is None else max_len
        if not (1 <= max_len <= self.cfg.max_seq_len):
            raise ValueError(f"cache max_len must be in [1, T_max={self.cfg.max_seq_len}], got {max_len}")
        if batch_size < 1:
            raise ValueError(f"cache batch_size must be >= 1, got {batch_size}")
        p = self.tok_emb.weight
        cfg = self.cfg
        shift = cfg.d_model if cfg.key_shift else 0
        shape = CacheShape(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, cfg.attn_window, shift)
        return KVCache(shape, batch_size, max_len, dtype=dtype or p.dtype, device=p.device)

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                n_new: list[int] | None = None) -> torch.Tensor:
        """Residual stream after the last block, before the final norm.

        Args:
            tokens: `[B, C]` token ids.
            cache: None for a parallel pass over positions 0..C-1; else the chunk is appended after each row's
                cached length, its K/V written into the cache, and the cache lengths advanced.
            n_new: with a cache, how many of the C tokens of each row are real (right-padded ragged chunk);
                default all C.
        Returns:
            H `[B, C, d]`.
        """
        return self.streams(tokens, cache, n_new)[0]

    def streams(self, tokens: torch.Tensor, cache: KVCache | None = None, n_new: list[int] | None = None,
                layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`forward`, also returning the residual stream after `layers` blocks (0 = the embeddings, with learned
        positions for gpt2) as `{layer: [B, C, d]}`; layer n_layer is H itself. Same arguments as `forward`."""
        for layer in layers:
            if not 0 <= layer <= self.cfg.n_layer:
                raise ValueError(f"layers must lie in [0, n_layer={self.cfg.n_layer}], got {layer}")
        check_tokens(tokens, self.cfg.vocab_size)
        B, C = tokens.shape
        T_max = self.cfg.max_seq_len
        if cache is None:
            if C > T_max:
                raise ValueError(f"sequence of {C} tokens is longer than T_max={T_max}")
            return self._blocks(tokens, 0, layers=layers)
        valid, n_new = self._check_chunk(cache, B, C, n_new)
        pos, step = self._cache_step(cache, B, C, valid, n_new, tokens.device)
        H, kept = self._blocks(tokens, pos, cache, step, layers)
        cache.advance(n_new)
        return H, kept

    def _cache_step(self, cache: KVCache, B: int, C: int, valid: torch.Tensor | None, n_new: list[int],
                    device: torch.device) -> tuple[int | torch.Tensor, CacheStep]:
        """Where a checked chunk of C tokens goes in `cache` and what its queries attend to (`CacheStep`), and the
        positions `_blocks` embeds it at: the shared offset (int) or per-row positions `[B, C]`."""
        # chunk_positions, chunk_start and causal_mask are looked up on the module on purpose: `faults` patches them.
        ragged = len(set(cache.lengths)) > 1
        if C == 1 and valid is None and not ragged:  # a decode step: the slot and the keys follow from the offset
            start = attn.chunk_start(cache.lengths)  # (a ring's R slots hold exactly the window once it is full)
            return start, CacheStep(None, start % cache.slots, None, min(start + 1, cache.slots), None)
        input_pos = attn.chunk_positions(cache.lengths, C, device,
                                         cache.lengths_tensor(device) if ragged else None)  # [C] or [B, C]
        if valid is not None and input_pos.dim() == 1:
            input_pos = input_pos.expand(B, C)
        shift = {}
        if cache.key_shift and valid is not None:  # each row's last real token is its next shifted input
            n_t = torch.tensor(n_new, device=device)  # [B]
            shift = dict(last=(n_t - 1).clamp(min=0), moved=(n_t > 0).unsqueeze(1))
        T_max = self.cfg.max_seq_len
        pos = input_pos.clamp(max=T_max - 1) if input_pos.dim() == 2 else None  # padding may lie past T_max
        R = cache.slots
        if cache.ring and max(cache.lengths) + C > R:  # the ring has wrapped, or will within this chunk
            return self._ring_step(cache, input_pos, valid, n_new, pos, shift)
        kv_len = min(max(cache.lengths) + C, R)
        if input_pos.dim() == 1:  # every row at the same offset: slice reads and writes
            start = attn.chunk_start(cache.lengths)  # from the host's lengths: no device read
            causal = start == 0 and kv_len == C > 1  # a prompt into an empty cache: no mask tensor needed
            mask = None if causal else attn.causal_mask(input_pos, kv_len)  # (C > 1: one token returned above)
            return start, CacheStep(input_pos, start, None, kv_len, mask, causal, **shift)
        return pos, CacheStep(input_pos, None, valid, kv_len, attn.causal_mask(input_pos, kv_len), **shift)

    def _ring_step(self, cache: KVCache, input_pos: torch.Tensor, valid: torch.Tensor | None, n_new: list[int],
                   pos: torch.Tensor | None, shift: dict) -> tuple[int | torch.Tensor, CacheStep]:
        """`_cache_step` on a sliding-window ring of R = W slots that is (or becomes) full. One token per row: written
        to slot p mod R first, then the R slots are exactly its window (mask: slot i <= p while a row has not
        wrapped). A longer chunk: the R old slots (positions from the lengths, `ring_positions`) and the chunk's own
        keys side by side under the band mask, and only each row's last R real positions written."""
        R, W, C = cache.slots, cache.window, input_pos.shape[-1]
        slots = input_pos % R  # [C] or [B, C]
        if C == 1:  # per-row positions (one token at a shared offset is `_cache_step`'s first case)
            return pos, CacheStep(input_pos, None, valid, R, attn.causal_mask(input_pos, R), slots=slots, **shift)
        device = input_pos.device
        if input_pos.dim() == 1:
            start = attn.chunk_start(cache.lengths)
            held = attn.ring_positions(start, R, device)  # [R]
            if C > W and (start == 0 or start >= R):  # one run of positions: the band in blocks, no [C, R + C] mask
                order = held.argsort() if start else held.new_zeros(0)
                return start, CacheStep(input_pos, None, None, R, None, slots=slots, concat=True, order=order, **shift)
            keys = torch.cat([held, input_pos])  # [R + C]
            return start, CacheStep(input_pos, None, None, R, attn.band_mask(input_pos, keys, W), slots=slots,
                                    concat=True, **shift)
        old = attn.ring_positions(cache.lengths_tensor(device), R)  # [B, R]
        keys = torch.cat([old, input_pos], dim=1)  # [B, R + C]
        n_t = torch.tensor(n_new, device=device).unsqueeze(1)  # [B, 1]
        offsets = torch.arange(C, device=device)  # [C]
        write = (offsets < n_t) & (offsets >= n_t - R)  # [B, C]: each row's last R real positions
        return pos, CacheStep(input_pos, None, valid, R, attn.band_mask(input_pos, keys, W), slots=slots,
                              concat=True, write=write, **shift)

    def prefill(self, tokens: torch.Tensor, cache: KVCache, chunk_size: int | None = None) -> torch.Tensor:
        """Append `tokens` `[B, T]` to `cache` in chunks of `chunk_size` (default: one chunk); returns H `[B, T, d]`.

        Everything is checked before the first chunk is written: on a ValueError the cache is unchanged.
        """
        check_tokens(tokens, self.cfg.vocab_size)
        B, T = tokens.shape
        chunk_size = T if chunk_size is None else chunk_size
        if not is_int(chunk_size) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self._check_chunk(cache, B, T, None)
        return torch.cat([self(tokens[:, i:i + chunk_size], cache) for i in range(0, T, chunk_size)], dim=1)

    def _check_chunk(self, cache: KVCache, B: int, C: int,
                     n_new: list[int] | None) -> tuple[torch.Tensor | None, list[int]]:
        """ValueError unless the chunk fits every row; returns the `[B, C]` valid mask (None: all real) and n_new."""
        if B != cache.batch_size:
            raise ValueError(f"batch of {B} rows does not match the cache's {cache.batch_size} rows")
        if cache.key_shift != self.cfg.key_shift or (cache.window is None) != (self.cfg.attn_window is None):
            raise ValueError(f"the cache (key shift {cache.key_shift}, window {cache.window}) was not made for this "
                             f"backbone (key_shift={self.cfg.key_shift}, attn_window={self.cfg.attn_window}): "
                             f"allocate it with new_cache")
        if n_new is None:  # every row takes the whole chunk (decoding): one capacity check
            longest = max(cache.lengths)
            if longest + C <= cache.max_len:
                return None, [C] * B
            n_new = [C] * B
        n_new = [int(n) for n in n_new]
        if len(n_new) != B or any(n < 0 or n > C for n in n_new):
            raise ValueError(f"n_new must give, for each of the {B} rows, a count in [0, {C}], got {n_new}")
        for b, (length, n) in enumerate(zip(cache.lengths, n_new)):
            if length + n > cache.max_len:
                raise ValueError(f"row {b}: {length} cached + {n} new tokens exceeds the cache capacity "
                                 f"{cache.max_len} (T_max={self.cfg.max_seq_len})")
        if all(n == C for n in n_new):
            return None, n_new
        device = cache.layers[0].k.device
        valid = torch.arange(C, device=device) < torch.tensor(n_new, device=device).unsqueeze(1)  # [B, C]
        return valid, n_new

    def _blocks(self, tokens: torch.Tensor, pos: int | torch.Tensor, cache: KVCache | None = None,
                step: CacheStep | None = None,
                layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Embed and run the blocks. `pos`: the shared offset of the chunk (int) or per-row positions `[B, C]`.
        Returns H and the streams after each of `layers` blocks."""
        C = tokens.shape[1]
        children, buffers = self._modules, self._buffers  # registry reads: see `prisme.attention` on decode overhead
        if step is not None and step.input_pos is None:  # one token per row at a shared offset: `Block` in 2-D
            return self._one_token(tokens, pos, cache, step, layers)
        x = torch.embedding(children["tok_emb"]._parameters["weight"], tokens)  # [B, C, d]
        pos_emb, rope = children.get("pos_emb"), None
        if pos_emb is not None:
            table = pos_emb._parameters["weight"]  # [T_max, d]
            x = x + (table[pos:pos + C] if isinstance(pos, int) else F.embedding(pos, table))  # [C | B, C, d]
        elif isinstance(pos, int):
            cos, sin = buffers["rope_cos"][pos:pos + C], buffers["rope_sin"][pos:pos + C]  # [C, hd]
            rope = (cos.unsqueeze(1), sin.unsqueeze(1))  # [C, 1, hd]
        else:
            rope = (buffers["rope_cos"][pos].unsqueeze(2), buffers["rope_sin"][pos].unsqueeze(2))  # [B, C, 1, hd]
        blocks = children["blocks"]
        caches = [None] * len(blocks) if cache is None else cache.layers
        kept = {0: x} if 0 in layers else {}
        for i, (block, layer_cache) in enumerate(zip(blocks, caches)):
            x = block(x, rope, layer_cache, step)
            if i + 1 in layers:
                kept[i + 1] = x
        return x, kept

    def _one_token(self, tokens: torch.Tensor, pos: int, cache: KVCache, step: CacheStep,
                   layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`_blocks` of a decode step, one token per row at the shared position `pos`: the blocks run on `[B, d]`
        (`CausalSelfAttention.one_token`), the same products as the chunk path; H and the kept streams `[B, 1, d]`."""
        children, buffers = self._modules, self._buffers
        x = torch.embedding(children["tok_emb"]._parameters["weight"], tokens.view(-1))  # [B, d]
        pos_emb, rope = children.get("pos_emb"), None
        if pos_emb is not None:
            x = x + pos_emb._parameters["weight"][pos]
        else:
            rope = (buffers["rope_cos"][pos], buffers["rope_sin"][pos])  # [hd] each
        kept = {0: x.unsqueeze(1)} if 0 in layers else {}
        for i, (block, layer_cache) in enumerate(zip(children["blocks"], cache.layers)):
            x = block(x, rope, layer_cache, step)
            if i + 1 in layers:
                kept[i + 1] = x.unsqueeze(1)
        return x.unsqueeze(1), kept

    def head(self, H: torch.Tensor) -> torch.Tensor:
        """logits `[..., V]` = lm_head(final_norm(H))."""
        return self.logits(self.final_norm(H))

    def final_norm(self, H: torch.Tensor) -> torch.Tensor:
        """The final norm of H `[..., d]`: what the head projects (a router's decision can read it too)."""
        return apply_norm(self._modules["norm"], H)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """lm_head(h) `[..., V]` of a normed stream h (`final_norm`); `head(H)` is `logits(final_norm(H))`, bitwise."""
        children = self._modules
        lm_head = children.get("lm_head")
        return F.linear(h, children["tok_emb"]._parameters["weight"]) if lm_head is None else linear(h, lm_head)

    def num_parameters(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
            if self.lm_head is not None:
                n -= self.lm_head.weight.numel()
        return n
