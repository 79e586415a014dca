"""The backbone's KV cache reproduces full recomputation: every chunking, both families, both dtypes, ragged batches.

Tolerances: float64 1e-12 and float32 1e-5 on logits (max |error| over every position, row and vocabulary entry).
Weights use init_std=0.1 so that attention is far from uniform and a misplaced key shows up in the logits.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from conftest import assert_close

from prisme import faults
from prisme.config import PrismeConfig
from prisme.model.attention import CausalSelfAttention, RMSNorm, apply_rope, rope_tables
from prisme.model.backbone import Backbone, apply_norm
from prisme.model.kv_cache import CacheStep, KVCache

FAMILIES = {"tiny": "llama", "seed001": "gpt2"}
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
SEQ_LEN = 23  # 4 full chunks of 5 and a partial one


@functools.cache
def model_for(preset: str, dtype: torch.dtype = torch.float64) -> Backbone:
    """A seeded backbone in eval mode (cached per preset and dtype; tests never modify it)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Backbone(PrismeConfig.from_name(preset, init_std=0.1))
    return model.to(dtype).eval()


def tokens_for(model: Backbone, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (batch, length), generator=g)  # [B, T]


def full_logits(model: Backbone, tokens: torch.Tensor) -> torch.Tensor:
    return model.head(model(tokens))  # [B, T, V]


def cached_logits(model: Backbone, tokens: torch.Tensor, chunks: int | list[int]) -> torch.Tensor:
    """Feed `tokens` through a fresh cache in chunks (one size, or an explicit schedule); logits `[B, T, V]`."""
    cache = model.new_cache(tokens.shape[0], tokens.shape[1])
    if isinstance(chunks, int):
        return model.head(model.prefill(tokens, cache, chunks))
    out, i = [], 0
    for c in chunks:
        out.append(model.head(model(tokens[:, i:i + c], cache)))
        i += c
    assert i == tokens.shape[1] and cache.lengths == [i] * tokens.shape[0]
    return torch.cat(out, dim=1)


# --------------------------------------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("chunk", [1, 2, 5])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_cached_logits_equal_full_recomputation_at_every_position(preset, dtype, batch, chunk):
    """Chunked prefill through the cache gives the full pass's logits at all positions (fp64 1e-12, fp32 1e-5)."""
    model = model_for(preset, dtype)
    tokens = tokens_for(model, batch, SEQ_LEN, seed=batch)
    with torch.inference_mode():
        assert_close(cached_logits(model, tokens, chunk), full_logits(model, tokens), TOL[dtype],
                     f"{preset} ({FAMILIES[preset]}) {dtype} batch {batch} chunk {chunk}")


@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_uneven_chunk_schedule_equals_full_recomputation(preset):
    """Any mix of chunk sizes (prefill, single-token decode, a chunk again) gives the full pass's float64 logits."""
    model = model_for(preset)
    tokens = tokens_for(model, 2, SEQ_LEN)
    with torch.inference_mode():
        assert_close(cached_logits(model, tokens, [7, 1, 1, 3, 5, 1, 4, 1]), full_logits(model, tokens), 1e-12,
                     preset)


@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_ragged_batch_rows_equal_their_single_row_runs(preset):
    """Rows of different lengths (right-padded chunks via n_new), then decode steps, match each row run alone."""
    model = model_for(preset)
    rows = [tokens_for(model, 1, 16, seed=s)[0] for s in (1, 2)]  # row 0: 9-token prompt, row 1: 4-token prompt
    prompt_len, steps = [9, 4], 4
    with torch.inference_mode():
        cache = model.new_cache(2, 16)
        prompt = torch.zeros(2, 9, dtype=torch.long)  # [2, 9], row 1 right-padded with token 0
        prompt[0], prompt[1, :4] = rows[0][:9], rows[1][:4]
        H_prompt = model(prompt, cache, n_new=prompt_len)  # [2, 9, d]
        assert cache.lengths == prompt_len
        H_steps = []
        for s in range(steps):  # each row continues from its own length
            step = torch.stack([rows[0][9 + s], rows[1][4 + s]]).unsqueeze(1)  # [2, 1]
            H_steps.append(model(step, cache))
        assert cache.lengths == [9 + steps, 4 + steps]
        chunk = torch.stack([rows[0][13:16], torch.cat([rows[1][8:10], rows[1][:1]])])  # [2, 3], row 1 padded
        H_chunk = model(chunk, cache, n_new=[3, 2])
        assert cache.lengths == [16, 10]
        for b, (n_prompt, n_total) in enumerate([(9, 16), (4, 10)]):
            alone = model(rows[b][:n_total].unsqueeze(0))[0]  # [n_total, d]
            got = torch.cat([H_prompt[b, :n_prompt], torch.cat(H_steps, dim=1)[b], H_chunk[b, :n_total - n_prompt - 4]])
            assert_close(model.head(got), model.head(alone), 1e-12, f"{preset} row {b}")


def _ragged_decode_error(model: Backbone) -> float:
    """Max |logit error| of a ragged prompt (rows of 9 and 4 tokens) then 4 decode steps vs each row alone."""
    rows = [tokens_for(model, 1, 13, seed=s)[0] for s in (1, 2)]
    with torch.inference_mode():
        cache = model.new_cache(2, 16)
        prompt = torch.zeros(2, 9, dtype=torch.long)
        prompt[0], prompt[1, :4] = rows[0][:9], rows[1][:4]
        model(prompt, cache, n_new=[9, 4])
        steps = torch.cat([model(torch.stack([rows[0][9 + s], rows[1][4 + s]]).unsqueeze(1), cache)
                           for s in range(4)], dim=1)  # [2, 4, d]
        alone = [model(rows[b][:n + 4].unsqueeze(0))[0, n:] for b, n in enumerate((9, 4))]  # [4, d] each
        return max(float((model.head(steps[b]) - model.head(alone[b])).abs().max()) for b in range(2))


def test_the_lengths_kept_on_the_device_follow_the_host_lengths(monkeypatch):
    """`KVCache.lengths_tensor` equals `lengths` after unequal and equal advances, truncate and reset; equal
    advances update it on the device (the same tensor is never re-uploaded). Negative control: a cache whose device
    copy goes stale (it no longer follows an advance) puts decode steps at the wrong positions, which the ragged
    decoding check catches."""
    cache = model_for("tiny").new_cache(3, 16)
    for op in (lambda: cache.advance([2, 5, 0]), lambda: cache.advance([1, 1, 1]), lambda: cache.advance([1, 1, 1]),
               lambda: cache.truncate(2), lambda: cache.advance([3, 3, 3]), cache.reset):
        before = cache.lengths_tensor("cpu")
        op()
        after = cache.lengths_tensor("cpu")
        assert after.tolist() == cache.lengths and before is not after
    uploads = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: uploads.append(a) or real(*a, **k))
    for _ in range(3):
        cache.advance([1, 1, 1])
        assert cache.lengths_tensor("cpu").tolist() == cache.lengths
    assert uploads == []  # followed on the device
    monkeypatch.setattr(torch, "tensor", real)

    model = model_for("tiny")
    assert _ragged_decode_error(model) < 1e-12
    original = KVCache._set_lengths

    def stale(self, lengths, device_update):  # the bug: the device copy is kept as it was
        original(self, lengths, (lambda t: t) if device_update is not None else None)

    monkeypatch.setattr(KVCache, "_set_lengths", stale)
    assert _ragged_decode_error(model) > 1e-2


def test_ragged_padding_is_never_written_to_the_cache():
    """Right-padding of a ragged chunk leaves the cache zero beyond each row's length."""
    model = model_for("tiny")
    with torch.inference_mode():
        cache = model.new_cache(2, 12)
        model(tokens_for(model, 2, 6), cache, n_new=[6, 2])
        for layer in cache.layers:
            assert layer.k[1, :, 2:].abs().max() == 0 and layer.v[1, :, 2:].abs().max() == 0
            assert layer.k[0, :, :6].abs().min() > 0 and layer.k[:, :, 6:].abs().max() == 0


def test_cache_is_preallocated_and_written_in_place():
    """Decoding never reallocates the K/V buffers, and their payload is L x 2 x B x nkv x T_max x hd x 4 bytes."""
    model = model_for("tiny", torch.float32)
    cfg = model.cfg
    cache = model.new_cache(2, 10)
    ptrs = [(layer.k.data_ptr(), layer.v.data_ptr()) for layer in cache.layers]
    with torch.inference_mode():
        model.prefill(tokens_for(model, 2, 10), cache, 3)
    assert [(layer.k.data_ptr(), layer.v.data_ptr()) for layer in cache.layers] == ptrs
    assert tuple(cache.layers[0].k.shape) == (2, cfg.n_kv_head, 10, cfg.head_dim)
    assert cache.nbytes == cfg.n_layer * 2 * 2 * cfg.n_kv_head * 10 * cfg.head_dim * 4
    assert cache.bytes_per_token() == cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * 4


def test_reset_cache_forgets_rows_and_decodes_the_same_again():
    """After reset() the lengths are 0, the buffers zero, and the same tokens give the same logits."""
    model = model_for("seed001")
    tokens = tokens_for(model, 2, 8)
    with torch.inference_mode():
        cache = model.new_cache(2, 8)
        first = model.head(model.prefill(tokens, cache, 3))
        cache.reset()
        assert cache.lengths == [0, 0] and all(layer.k.abs().max() == 0 for layer in cache.layers)
        assert torch.equal(model.head(model.prefill(tokens, cache, 3)), first)


def test_block_hooks_fire_during_cached_decode():
    """Blocks, attention and MLP are still called as modules on the decode path, so their hooks fire."""
    model = model_for("tiny")
    calls = []
    block = model.blocks[0]
    handles = [m.register_forward_hook(lambda mod, args, out, n=name: calls.append(n))
               for name, m in (("block", block), ("attn", block.attn), ("mlp", block.mlp))]
    try:
        with torch.inference_mode():
            cache = model.new_cache(1, 4)
            model.prefill(tokens_for(model, 1, 4), cache, 1)
    finally:
        for h in handles:
            h.remove()
    assert sorted(calls) == sorted(["block", "attn", "mlp"] * 4)


def test_rope_equals_the_half_split_formula_bitwise():
    """apply_rope with the full-width tables equals [x1 cos - x2 sin, x2 cos + x1 sin] exactly."""
    hd, T = 16, 12
    cos, sin = rope_tables(hd, T, 10000.0)  # [T, hd]
    x = torch.randn(2, T, 3, hd, dtype=torch.float64)  # [B, T, heads, hd]
    c, s = cos[:, :hd // 2].unsqueeze(1), sin[:, hd // 2:].unsqueeze(1)  # [T, 1, hd/2]
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    assert torch.equal(apply_rope(x, cos.unsqueeze(1), sin.unsqueeze(1)), expected)
    assert torch.equal(cos[:, :hd // 2], cos[:, hd // 2:]) and torch.equal(sin[:, :hd // 2], -sin[:, hd // 2:])


def one_token_vs_chunk_path(preset: str, options: dict, steps: int = 11) -> list[bool]:
    """Decode the same tokens into two caches of a float32 backbone: one through `Backbone.forward` (a decode step:
    `CausalSelfAttention.one_token` on `[B, d]` rows) and one through the chunk path (the same step given its
    positions, so `_blocks` runs every layer's `[B, C, d]` code); whether H agrees bitwise at each step."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Backbone(PrismeConfig.from_name(preset, init_std=0.1, **options)).eval()
    tokens = tokens_for(model, 2, 3 + steps, seed=1)
    a, b = model.new_cache(2, tokens.shape[1]), model.new_cache(2, tokens.shape[1])
    same = []
    with torch.no_grad():
        model.prefill(tokens[:, :3], a)
        model.prefill(tokens[:, :3], b)
        for t in range(3, 3 + steps):
            tok = tokens[:, t:t + 1]
            H_one = model(tok, a)  # [B, 1, d]
            slot, kv_len = t % b.slots, min(t + 1, b.slots)
            step = CacheStep(torch.tensor([t]), slot, None, kv_len, None)  # input_pos given: the chunk path
            H_chunk, _ = model._blocks(tok, t, b, step)
            b.advance([1, 1])
            same.append(torch.equal(H_one, H_chunk))
    return same


@pytest.mark.parametrize("preset,options", [("tiny", {}), ("tiny", {"key_shift": True, "attn_window": 4}),
                                            ("seed001", {})], ids=["llama", "llama-shift-ring", "gpt2"])
def test_one_token_decode_step_is_the_chunk_path_bitwise(preset, options):
    """A decode step runs the blocks on `[B, d]` rows (`one_token`: fewer calls); its products are the chunk path's,
    so H is bitwise the same in float32 at every step, past a ring's wrap (window 4, 11 steps)."""
    assert all(one_token_vs_chunk_path(preset, options))


# --------------------------------------------------------------------------------------------------- negative controls
@pytest.mark.parametrize("fault", [faults.reset_positions, faults.unshifted_mask], ids=lambda f: f.__name__)
@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_negative_control_broken_cache_is_detected(preset, fault):
    """Under a deliberately broken cache (chunk 5) the cached-vs-full error exceeds 1e-2; leaving it restores 1e-12."""
    model = model_for(preset)
    tokens = tokens_for(model, 2, SEQ_LEN)
    with torch.inference_mode():
        ref = full_logits(model, tokens)
        with fault():
            broken = cached_logits(model, tokens, 5)
        err = float((broken - ref).abs().max())
        assert err > 1e-2, f"{fault.__name__} on {preset}: error {err:.3e} is too small to detect a broken cache"
        assert_close(cached_logits(model, tokens, 5), ref, 1e-12, f"{preset} after {fault.__name__}")


# ----------------------------------------------------------------------------------------------------------- bad input
def _prefilled_cache(model: Backbone):
    cache = model.new_cache(2, 12)
    model(tokens_for(model, 2, 4), cache)
    return cache


BAD_CALLS = {
    "id_equal_to_vocab": lambda m, c: m(torch.full((2, 1), m.cfg.vocab_size), c),
    "negative_id": lambda m, c: m(torch.tensor([[1], [-1]]), c),
    "float_tokens": lambda m, c: m(torch.ones(2, 1), c),
    "bool_tokens": lambda m, c: m(torch.ones(2, 1, dtype=torch.bool), c),
    "one_dim_tokens": lambda m, c: m(torch.ones(2, dtype=torch.long), c),
    "empty_chunk": lambda m, c: m(torch.ones(2, 0, dtype=torch.long), c),
    "list_tokens": lambda m, c: m([[1], [2]], c),
    "prompt_longer_than_cache": lambda m, c: m(torch.ones(2, 9, dtype=torch.long), c),
    "batch_larger_than_cache": lambda m, c: m(torch.ones(3, 1, dtype=torch.long), c),
    "batch_smaller_than_cache": lambda m, c: m(torch.ones(1, 1, dtype=torch.long), c),
    "n_new_wrong_length": lambda m, c: m(torch.ones(2, 2, dtype=torch.long), c, n_new=[2]),
    "n_new_over_chunk": lambda m, c: m(torch.ones(2, 2, dtype=torch.long), c, n_new=[2, 3]),
    "prefill_chunk_zero": lambda m, c: m.prefill(torch.ones(2, 4, dtype=torch.long), c, 0),
    "prefill_chunk_negative": lambda m, c: m.prefill(torch.ones(2, 4, dtype=torch.long), c, -2),
    "prefill_chunk_float": lambda m, c: m.prefill(torch.ones(2, 4, dtype=torch.long), c, 2.0),
    "prefill_past_capacity_in_chunks": lambda m, c: m.prefill(torch.ones(2, 9, dtype=torch.long), c, 2),
    "prefill_bad_id_in_last_chunk": lambda m, c: m.prefill(torch.tensor([[1, 2, 3, 999]] * 2), c, 1),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_bad_input_raises_value_error_before_the_cache_changes(preset, case):
    """Bad tokens, shapes, lengths or chunk sizes raise ValueError and leave lengths and K/V untouched."""
    model = model_for(preset)
    with torch.inference_mode():
        cache = _prefilled_cache(model)
        before = [(layer.k.clone(), layer.v.clone()) for layer in cache.layers]
        with pytest.raises(ValueError):
            BAD_CALLS[case](model, cache)
    assert cache.lengths == [4, 4]
    for (k, v), layer in zip(before, cache.layers):
        assert torch.equal(layer.k, k) and torch.equal(layer.v, v)


def test_full_pass_longer_than_t_max_raises_value_error():
    """A parallel pass over more than T_max tokens is a ValueError, not an index error."""
    model = model_for("tiny")
    with pytest.raises(ValueError, match="T_max"):
        model(torch.zeros(1, model.cfg.max_seq_len + 1, dtype=torch.long))


@pytest.mark.parametrize("batch, max_len", [(0, 4), (1, 0), (1, 65)])
def test_new_cache_rejects_bad_sizes(batch, max_len):
    """new_cache needs batch >= 1 and 1 <= max_len <= T_max (64 for tiny)."""
    with pytest.raises(ValueError):
        model_for("tiny").new_cache(batch, max_len)


def test_kv_cache_owns_its_lengths_and_rejects_impossible_moves():
    """`advance` and `truncate` are the only ways lengths change; moves past the capacity, a negative count, a count
    per row missing, or a truncation past a row's length are ValueErrors that leave the lengths as they were."""
    from prisme.model.kv_cache import CacheShape, KVCache

    cache = KVCache(CacheShape(n_layer=1, n_kv_head=1, head_dim=4), batch_size=2, max_len=8)
    cache.advance([3, 5])
    assert cache.lengths == [3, 5]
    for bad in (lambda: cache.advance([4, 4]), lambda: cache.advance([-1, 0]), lambda: cache.advance([1]),
                lambda: cache.truncate(4)):
        with pytest.raises(ValueError):
            bad()
        assert cache.lengths == [3, 5]
    cache.truncate(2)
    assert cache.lengths == [2, 2]


def test_negative_control_a_decode_step_that_drops_a_key_is_caught(monkeypatch):
    """`one_token` attending to one key fewer than the step says (its last slot) differs from the
    chunk path: the bitwise comparison catches it."""
    original = CausalSelfAttention.one_token

    def short(self, x, rope, cache, step):
        return original(self, x, rope, cache, dataclasses.replace(step, kv_len=max(1, step.kv_len - 1)))

    monkeypatch.setattr(CausalSelfAttention, "one_token", short)
    assert not any(one_token_vs_chunk_path("tiny", {"key_shift": True}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_spelled_out_rms_norm_is_torch_rms_norm_bitwise(dtype):
    """Without autograd `apply_norm` spells an RMSNorm out (fewer copies); at every width and scale tried it gives
    torch.rms_norm's bits, decode-sized rows and whole sequences alike (what keeps decoding bitwise the forward)."""
    g = torch.Generator().manual_seed(0)
    for d in (7, 16, 64, 96, 256, 384, 1000, 1024):
        norm = RMSNorm(d, 1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(d, generator=g, dtype=dtype))
        for shape in ((1, d), (3, 1, d), (2, 37, d)):
            for scale in (1e-3, 1.0, 1e3):
                x = torch.randn(shape, generator=g, dtype=dtype) * scale
                with torch.no_grad():
                    assert torch.equal(apply_norm(norm, x), torch.rms_norm(x, (d,), norm.weight, 1e-5)), (d, shape)


def test_negative_control_a_spelled_out_norm_with_the_mean_as_a_product_is_caught():
    """The same norm with the mean taken as sum * (1 / d) (a natural rewrite) is not bitwise torch.rms_norm at some
    width tried: the comparison above would catch a spelling that drifts."""
    g = torch.Generator().manual_seed(0)
    differs = False
    for d in (7, 96, 384, 1000):
        w = torch.randn(d, generator=g)
        x = torch.randn(3, 1, d, generator=g)
        spelled = x * (x * x).sum(-1, keepdim=True).mul_(1 / d).add_(1e-5).rsqrt_() * w
        differs |= not torch.equal(spelled, torch.rms_norm(x, (d,), w, 1e-5))
    assert differs


def test_spelled_out_norm_follows_a_new_dtype_and_eps():
    """The kept d and eps (`_norm_scalars`) are rebuilt when the same norm meets another dtype, width or eps: still
    torch.rms_norm's bits."""
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        for dtype, eps, d in ((torch.float32, 1e-5, 16), (torch.float64, 1e-5, 16), (torch.float64, 1e-3, 16)):
            norm = norm.to(dtype)
            norm.eps = eps
            x = torch.randn(2, 1, d, dtype=dtype)
            assert torch.equal(apply_norm(norm, x), torch.rms_norm(x, (d,), norm.weight, eps))
            assert norm.__dict__["_spelled_scalars"][2].item() == pytest.approx(eps)


def kept_scalars_across_compiled_calls(calls: int = 3) -> list[int | None]:
    """The id of the norm's kept d and eps after each call of a compiled `apply_norm` (None: never kept)."""
    torch._dynamo.reset()
    norm = RMSNorm(16, 1e-5)
    fn = torch.compile(lambda x: apply_norm(norm, x), backend="eager", fullgraph=True)
    ids = []
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(2, 1, 16)
            assert torch.equal(fn(x), torch.rms_norm(x, (16,), norm.weight, 1e-5))
            kept = norm.__dict__.get("_spelled_scalars")
            ids.append(None if kept is None else id(kept[1]))
    return ids


def test_compiled_norm_leaves_the_kept_scalars_alone():
    """While torch.compile traces, `apply_norm` takes torch.rms_norm: a graph that stored the kept d and eps would
    replay the store at every call, and a decoder's other graph, which guards on those tensors, would recompile
    (tests/test_bench_hf.py counts a compiled decoder's graphs)."""
    assert kept_scalars_across_compiled_calls() == [None, None, None]


def test_negative_control_a_compiled_spelled_out_norm_replaces_its_scalars(monkeypatch):
    """Spelled out inside the graph, the kept tensors are new objects after every call: the check above sees it."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    ids = kept_scalars_across_compiled_calls()
    assert None not in ids and len(set(ids)) == len(ids)
