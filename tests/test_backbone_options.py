"""The backbone options `key_shift` (each key also reads the previous position's normed input) and `attn_window`
(causal sliding window of W positions, a ring of W cache slots), for the dense backbones and PRISME's alike.

* each option against a by-hand reference: an unshifted model whose keys get W_s n(x_{t-1}) added, a full-causal
  model whose attention gets an explicit band mask; each with a negative control (a shift that reads x_t, a window
  off by one);
* cached decoding token by token, chunked prefill (chunks 1, 2, 5), uneven schedules and ragged rows equal the
  parallel forward, with negative controls (a ring one slot short, a shift memory that is not carried, one that
  ignores the ragged rows' own last token); rewinds are exact or refused;
* the ring's memory follows W, not T;
* costs: min(t, W) keys, the key shift's own term, both tied to the FLOPs the real modules run;
* bad input, checkpoints, HF export and compiled decoding refuse what they cannot do exactly;
* a PRISME model with a windowed, shifted backbone decodes exactly like its teacher-forced rollout.
All float64, tiny configs, init_std 0.1 (attention far from uniform: a misplaced key shows in the logits).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model

from prisme import costs
from prisme.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from prisme.config import ADDED_CONFIG_FIELDS, PrismeConfig, complete_config
from prisme.costs.counting import OpsCounter
from prisme.model import attention
from prisme.model.backbone import Backbone
from prisme.model.compiled import compile_decode
from prisme.model.kv_cache import CacheShape, KVCache, LayerKVCache
from prisme.model.policy import Controller, Forced

W = 5
T = 23
OPTIONS = {"shift": dict(key_shift=True), "window": dict(attn_window=W), "both": dict(key_shift=True, attn_window=W),
           "window1": dict(attn_window=1)}
PRESETS = ["tiny", "seed001"]  # llama (RoPE, GQA) and gpt2 (learned positions, biases)


def backbone(preset: str = "tiny", seed: int = 0, **options) -> Backbone:
    torch.manual_seed(seed)
    return Backbone(PrismeConfig.from_name(preset, init_std=0.1, **options)).double().eval()


def tokens(vocab: int, B: int = 2, n: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, n), generator=torch.Generator().manual_seed(seed))


def logits(model: Backbone, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.head(model(x))  # [B, T, V]


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# ---------------------------------------------------------------------- (a) the key shift by hand
def shift_by_hand(monkeypatch, plain: Backbone, W_s: list[torch.Tensor], reads_current: bool = False) -> None:
    """Make `plain` (no key shift) add W_s n(x_{t-1}) to each layer's keys: its fused qkv output, patched."""
    cfg = plain.cfg
    nh, nkv, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    weights = {blk.attn.wqkv: w for blk, w in zip(plain.blocks, W_s)}
    original = attention.linear

    def patched(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
        out = original(x, layer)  # [B, C, (nh + 2 nkv) hd]
        if layer not in weights:
            return out
        prev = x if reads_current else torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)  # [B, C, d]
        k = out[..., nh * hd:(nh + nkv) * hd] + prev @ weights[layer].T  # [B, C, nkv hd]
        return torch.cat([out[..., :nh * hd], k, out[..., (nh + nkv) * hd:]], dim=-1)

    monkeypatch.setattr(attention, "linear", patched)


@pytest.mark.parametrize("preset", PRESETS)
def test_key_shift_equals_an_unshifted_model_with_the_shift_added_by_hand(preset, monkeypatch):
    """k_t = W_k n(x_t) + W_s n(x_{t-1}) (zero at t = 0): the shifted model's logits equal an unshifted model with the
    same weights whose keys get W_s n(x_{t-1}) added by hand (1e-12). Negative control: a shift that reads x_t
    differs; and the shift is visible (the unshifted model differs)."""
    model = backbone(preset, key_shift=True)
    plain = backbone(preset, seed=1)
    W_s = [blk.attn.wk_shift.weight.detach() for blk in model.blocks]
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "wk_shift" not in k})
    x = tokens(model.cfg.vocab_size)
    want = logits(model, x)
    assert err(logits(plain, x), want) > 1e-3
    with monkeypatch.context() as m:
        shift_by_hand(m, plain, W_s)
        assert err(logits(plain, x), want) <= 1e-12
    with monkeypatch.context() as m:
        shift_by_hand(m, plain, W_s, reads_current=True)
        assert err(logits(plain, x), want) > 1e-3


def test_key_shift_layer_shapes_and_init():
    """W_s is one d -> n_kv_head head_dim linear per layer, without bias in both families (the key's own bias covers
    it), drawn like W_k (std init_std); without the option no such parameter exists."""
    for preset in PRESETS:
        model = backbone(preset, key_shift=True)
        cfg = model.cfg
        for blk in model.blocks:
            lin = blk.attn.wk_shift
            assert tuple(lin.weight.shape) == (cfg.n_kv_head * cfg.head_dim, cfg.d_model) and lin.bias is None
        assert 0.05 < float(model.blocks[0].attn.wk_shift.weight.detach().std()) < 0.2
        assert not any("wk_shift" in n for n in backbone(preset).state_dict())


# ---------------------------------------------------------------------- (b) the window against a band mask
def band_by_hand(monkeypatch, window: int) -> None:
    """Every causal SDPA call (a model without a window) runs under an explicit band mask: key j visible to query i
    iff 0 <= i - j < window."""
    original = F.scaled_dot_product_attention

    def patched(q, k, v, attn_mask=None, is_causal=False, **kw):
        if is_causal:
            n = q.shape[-2]
            band = torch.tensor([[0 <= i - j < window for j in range(n)] for i in range(n)])  # [C, C]
            return original(q, k, v, attn_mask=band, **kw)
        return original(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", patched)


@pytest.mark.parametrize("window", [1, 4, 7])
@pytest.mark.parametrize("n", [1, 3, 4, 8, 14, 15, 50])
def test_blocked_window_attention_equals_attention_under_the_band_mask(window, n):
    """`window_attention` (blocks of W, each query reading its block and the previous one) equals SDPA under
    `band_mask` in float64 (1e-12), for lengths shorter than, equal to and not a multiple of W, with grouped kv heads.
    Negative control: the band one wider or one narrower differs (the blocks do not see a key too many or too few)."""
    g = torch.Generator().manual_seed(n * 10 + window)
    q = torch.randn(2, 4, n, 3, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, n, 3, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(n)
    got = attention.window_attention(q, k, v, window, gqa=True)
    for w in (window - 1, window, window + 1):
        if w < 1:
            continue
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=attention.band_mask(pos, pos, w), enable_gqa=True)
        e = err(got, want)
        assert (e <= 1e-12) if w == window or n <= min(w, window) else (e > 1e-6), (w, e)


@pytest.mark.parametrize("window", [1, W, 12])
@pytest.mark.parametrize("preset", PRESETS)
def test_window_equals_full_attention_under_an_explicit_band_mask(preset, window, monkeypatch):
    """attn_window=W: position t attends to keys t-W+1 .. t, as a full-causal model with the same weights under an
    explicit band mask (1e-12). Negative control: bands one wider and one narrower differ; the window binds."""
    model = backbone(preset, attn_window=window)
    full = backbone(preset)
    full.load_state_dict(model.state_dict())
    x = tokens(model.cfg.vocab_size)
    want = logits(model, x)
    assert err(logits(full, x), want) > 1e-3
    for w, close in ((window, True), (window + 1, False), (window - 1, False)):
        if w < 1:
            continue
        with monkeypatch.context() as m:
            band_by_hand(m, w)
            e = err(logits(full, x), want)
        assert (e <= 1e-12) if close else (e > 1e-3), (w, e)


# ---------------------------------------------------------------------- (c) cached and chunked decoding
def cached(model: Backbone, x: torch.Tensor, chunks: int | list[int], cache: KVCache | None = None) -> torch.Tensor:
    cache = model.new_cache(x.shape[0], 30) if cache is None else cache
    sizes = [chunks] * -(-x.shape[1] // chunks) if isinstance(chunks, int) else chunks
    out, i = [], 0
    with torch.no_grad():
        for c in sizes:
            out.append(model.head(model(x[:, i:i + c], cache)))
            i += c
    return torch.cat(out, dim=1)


def ragged(model: Backbone, x: torch.Tensor, lengths: list[int], chunk: int) -> float:
    """Max |logit error| of right-padded rows of `lengths` fed in chunks (n_new per row) vs each row alone."""
    cache = model.new_cache(x.shape[0], 30)
    out = []
    with torch.no_grad():
        for i in range(0, x.shape[1], chunk):
            out.append(model.head(model(x[:, i:i + chunk], cache, [min(max(n - i, 0), chunk) for n in lengths])))
        assert cache.lengths == lengths
        got = torch.cat(out, dim=1)
        return max(err(got[b, :n], logits(model, x[b:b + 1, :n])[0]) for b, n in enumerate(lengths))


def prompt_then_steps(model: Backbone, x: torch.Tensor, prompt: list[int], steps: int = 10) -> float:
    """Max |logit error| of a ragged prompt (one right-padded chunk), then one token per row (the rows at different
    offsets), vs each row alone."""
    cache = model.new_cache(x.shape[0], 30)
    with torch.no_grad():
        model(x[:, :max(prompt)], cache, prompt)
        got = torch.cat([model.head(model(torch.stack([x[b, n + s] for b, n in enumerate(prompt)]).unsqueeze(1),
                                          cache)) for s in range(steps)], dim=1)  # [B, steps, V]
    return max(err(got[b], logits(model, x[b:b + 1, :n + steps])[0, n:]) for b, n in enumerate(prompt))


@pytest.mark.parametrize("chunk", [1, 2, 5])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("preset", PRESETS)
def test_cached_decoding_equals_the_parallel_forward(preset, option, chunk):
    """Token by token (chunk 1) and chunked prefill (2, 5) through the cache give the parallel logits (1e-12), at a
    shared length and for ragged rows (lengths 23, 11, 17, right-padded)."""
    model = backbone(preset, **OPTIONS[option])
    x = tokens(model.cfg.vocab_size, B=3)
    assert err(cached(model, x, chunk), logits(model, x)) <= 1e-12
    assert ragged(model, x, [23, 11, 17], chunk) <= 1e-12


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("preset", PRESETS)
def test_uneven_schedules_and_ragged_decode_steps_equal_the_parallel_forward(preset, option):
    """A mixed schedule (a prompt longer than the window, single steps, chunks again) and a ragged prompt followed by
    one token per row (rows at different offsets in the ring) give the parallel logits."""
    model = backbone(preset, **OPTIONS[option])
    x = tokens(model.cfg.vocab_size)
    assert err(cached(model, x, [7, 1, 1, 3, 5, 1, 4, 1]), logits(model, x)) <= 1e-12
    assert prompt_then_steps(model, x, [9, 4]) <= 1e-12


@pytest.mark.parametrize("option", ["window", "both"])
@pytest.mark.parametrize("schedule", [[12, 8, 3], [2, 9, 12], [23]])
def test_chunks_longer_than_the_window_attend_in_blocks_and_equal_the_parallel_forward(option, schedule):
    """A chunk longer than the window at a shared offset 0 or >= W attends to the ring's old slots in position order
    and its own keys in blocks (`CacheStep.order`, no [C, R + C] mask); one at an offset in (0, W) under the mask.
    Both give the parallel logits (1e-12)."""
    model = backbone(**OPTIONS[option])
    x = tokens(model.cfg.vocab_size)
    seen = []
    step = model._ring_step

    def spy(*a, **k):
        out = step(*a, **k)
        seen.append(out[1].order is not None)
        return out

    model._ring_step = spy
    assert err(cached(model, x, schedule), logits(model, x)) <= 1e-12
    assert any(seen)  # the blocked path ran


def test_negative_control_old_slots_out_of_position_order_differ(monkeypatch):
    """Blocked attention over the ring's old slots in slot order instead of position order reads the wrong band."""
    model = backbone(attn_window=W)
    x = tokens(model.cfg.vocab_size)
    monkeypatch.setattr(torch.Tensor, "argsort", lambda self, *a, **k: torch.arange(self.numel()))
    assert err(cached(model, x, [8, 9, 6]), logits(model, x)) > 1e-3


def test_negative_control_a_ring_one_slot_short_differs():
    """A cache that keeps W - 1 positions (a ring one slot short) decodes other logits, token by token and in
    chunks; the right ring agrees."""
    model = backbone(attn_window=W)
    cfg = model.cfg
    x = tokens(cfg.vocab_size)
    want = logits(model, x)
    for chunk in (1, 5):
        short = KVCache(CacheShape(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, window=W - 1), 2, 30, torch.float64)
        assert err(cached(model, x, chunk, short), want) > 1e-3
        assert err(cached(model, x, chunk), want) <= 1e-12


def test_negative_control_a_shift_memory_that_is_not_carried_differs(monkeypatch):
    """A cache that never moves `prev` on (each chunk's first key reads a zero shift) differs in chunks; one that
    takes the chunk's last column instead of each ragged row's last real token differs once ragged rows go on."""
    model = backbone(key_shift=True)
    x = tokens(model.cfg.vocab_size, B=3)
    with monkeypatch.context() as m:
        m.setattr(LayerKVCache, "shift_update", lambda self, x, step: None)
        assert err(cached(model, x, 5), logits(model, x)) > 1e-3
    with monkeypatch.context() as m:
        m.setattr(LayerKVCache, "shift_update", lambda self, x, step: self.prev.copy_(x[:, -1]))
        assert err(cached(model, x, 5), logits(model, x)) <= 1e-12
        assert prompt_then_steps(model, x, [9, 4, 6]) > 1e-3
    assert prompt_then_steps(model, x, [9, 4, 6]) <= 1e-12


def test_a_key_shift_cache_reset_or_truncated_to_zero_starts_from_a_zero_shift():
    """reset() and truncate(0) clear `prev`: the next sequence decodes as in a fresh cache."""
    model = backbone(key_shift=True, attn_window=W)
    x, y = tokens(model.cfg.vocab_size), tokens(model.cfg.vocab_size, seed=2)
    for forget in (KVCache.reset, lambda c: c.truncate(0)):
        cache = model.new_cache(2, 30)
        cached(model, x, 5, cache)
        forget(cache)
        assert err(cached(model, y, 3, cache), logits(model, y)) <= 1e-12


def cut_vs_fresh(model: Backbone, x: torch.Tensor, n: int, back: int, force: bool = False) -> float:
    """|H error| of decoding x[back:back + 6] after other tokens' n positions truncated to `back` (`force`: by
    setting the lengths, past truncate's checks) vs after those tokens' first `back` positions in a fresh cache."""
    other = (x + 1) % model.cfg.vocab_size
    cut, fresh = model.new_cache(2, 30), model.new_cache(2, 30)
    cached(model, other[:, :n], 1, cut)
    if force:
        cut.lengths = [back] * 2
    else:
        cut.truncate(back)
    cached(model, other[:, :back], back, fresh)
    with torch.no_grad():
        return err(model(x[:, back:back + 6], cut), model(x[:, back:back + 6], fresh))


def test_truncate_is_exact_where_it_can_be_and_refused_elsewhere():
    """A ring truncates exactly before it wraps and by one position after (the slot overwritten held a position
    no later query reads); further back is a ValueError, lengths unchanged, and forcing it would be inexact (the
    negative control). A key-shift cache truncates to 0 (prev cleared) or to its own length only."""
    model = backbone(attn_window=W)
    x = tokens(model.cfg.vocab_size)
    for n, back in ((4, 1), (5, 3), (12, 11)):
        assert cut_vs_fresh(model, x, n, back) <= 1e-12, (n, back)
    cache = model.new_cache(2, 30)
    cached(model, x[:, :12], 1, cache)
    with pytest.raises(ValueError, match="sliding-window"):
        cache.truncate(10)
    assert cache.lengths == [12, 12]
    assert cut_vs_fresh(model, x, 12, 10, force=True) > 1e-3
    shifted_model = backbone(key_shift=True)
    shifted = shifted_model.new_cache(2, 30)
    cached(shifted_model, x[:, :6], 2, shifted)
    with pytest.raises(ValueError, match="key-shift"):
        shifted.truncate(5)
    assert shifted.lengths == [6, 6]
    shifted.truncate(6)
    shifted.truncate(0)
    assert shifted.lengths == [0, 0] and all(float(layer.prev.abs().max()) == 0 for layer in shifted.layers)


# ---------------------------------------------------------------------- (d) the ring's memory follows W
@pytest.mark.parametrize("preset", PRESETS)
def test_the_window_cache_holds_w_slots_whatever_its_capacity(preset):
    """With W < capacity every layer's K/V is `[B, nkv, W, hd]`: the same bytes for 16 or 64 positions; a key shift
    adds `prev` `[B, d]` per layer; without a window the buffers follow the capacity. A window as long as the
    capacity is a plain cache."""
    cfg = backbone(preset, attn_window=W).cfg
    per_slot = cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * 8  # float64 K and V of one position, all layers
    for max_len in (16, 64):
        cache = backbone(preset, attn_window=W).new_cache(3, max_len)
        assert cache.ring and cache.slots == W and cache.max_len == max_len
        assert all(tuple(layer.k.shape) == (3, cfg.n_kv_head, W, cfg.head_dim) == tuple(layer.v.shape)
                   for layer in cache.layers)
        assert cache.nbytes == 3 * W * per_slot and cache.bytes_per_token() == per_slot
        both = backbone(preset, attn_window=W, key_shift=True).new_cache(3, max_len)
        assert both.nbytes - cache.nbytes == cfg.n_layer * 3 * cfg.d_model * 8
        assert backbone(preset).new_cache(3, max_len).nbytes == 3 * max_len * per_slot
    wide = backbone(preset, attn_window=16).new_cache(3, 16)
    assert not wide.ring and wide.slots == 16


# ---------------------------------------------------------------------- (e) costs
def decode_ops(model: Backbone, T_ctx: int) -> dict[str, int]:
    """Matmul ops `OpsCounter` counts for one new token at context T_ctx (the prefix cached uncounted)."""
    x = tokens(model.cfg.vocab_size, B=1, n=T_ctx, seed=3)
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        model(x[:, :-1], cache)
        with OpsCounter(model) as oc:
            model.head(model(x[:, -1:], cache))
    return oc.by_component


def mismatch(measured: dict[str, int], analytic: dict[str, int], cfg: PrismeConfig) -> dict[str, tuple]:
    """{component: (measured, analytic)} where they differ (`backbone_linear` gets its norm/bias allowance)."""
    out = {}
    for c in set(measured) | set(analytic):
        m = measured.get(c, 0) + (costs.backbone_linear_allowance(cfg) if c == "backbone_linear" else 0)
        if m != analytic.get(c, 0) and not (c == "untagged" and m == 0):
            out[c] = (m, analytic.get(c, 0))
    return out


@pytest.mark.parametrize("T_ctx", [3, W, 11, 40])
@pytest.mark.parametrize("option", ["shift", "window", "both"])
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_step_flops_tie_to_the_backbone_terms(preset, option, T_ctx):
    """One cached decode step at context t: the counted matmul ops equal backbone_linear (minus the allowance),
    backbone_attention at min(t, W) keys, backbone_key_shift (2 L d nkv hd) and lm_head, term by term."""
    model = backbone(preset, **OPTIONS[option])
    cfg = model.cfg
    analytic = costs.backbone_ops(cfg, T_ctx)
    assert mismatch(decode_ops(model, T_ctx), analytic, cfg) == {}
    keys = min(T_ctx, W) if cfg.attn_window else T_ctx
    assert analytic["backbone_attention"] == cfg.n_layer * 4 * keys * cfg.d_model
    assert analytic.get("backbone_key_shift", 0) == (2 * cfg.n_layer * cfg.d_model * cfg.n_kv_head * cfg.head_dim
                                                      if cfg.key_shift else 0)
    plain = costs.backbone_ops(PrismeConfig.from_name(preset, init_std=0.1), T_ctx)
    assert analytic["backbone_linear"] == plain["backbone_linear"] and analytic["lm_head"] == plain["lm_head"]


def test_negative_controls_the_tie_sees_full_attention_and_a_missing_shift_term(monkeypatch):
    """A cost model that prices T keys instead of min(T, W) fails the tie on backbone_attention; one that forgets
    the key shift's term fails it on backbone_key_shift."""
    model = backbone(**OPTIONS["both"])
    cfg = model.cfg
    measured = decode_ops(model, 11)
    assert mismatch(measured, costs.backbone_ops(cfg, 11), cfg) == {}
    with monkeypatch.context() as m:
        m.setattr(costs.analytic, "attended_keys", lambda cfg, T: T)
        assert set(mismatch(measured, costs.backbone_ops(cfg, 11), cfg)) == {"backbone_attention"}
    no_shift = {k: v for k, v in costs.backbone_ops(cfg, 11).items() if k != "backbone_key_shift"}
    assert set(mismatch(measured, no_shift, cfg)) == {"backbone_key_shift"}


def test_cost_rows_parameters_and_traces_with_the_options():
    """The shift is its own backbone term (after backbone_attention) counted in `backbone`, never in
    `backbone_linear`; parameter counts equal numel; trace_cost charges each position min(t + 1, W) keys; the seed's
    configs keep seed 000's ten terms."""
    cfg = PrismeConfig.from_name("tiny", key_shift=True, attn_window=8)
    row = costs.token_ops(cfg, 20, [1, 2])
    assert list(row)[:4] == ["backbone_linear", "backbone_attention", "backbone_key_shift", "lm_head"]
    assert row["backbone"] == sum(row.get(c, 0) for c in costs.BACKBONE_TERMS)
    assert row["total"] == row["backbone"] + row["workspace"]
    assert "backbone_key_shift" not in costs.token_ops(PrismeConfig.from_name("tiny"), 20)
    for c in (cfg, PrismeConfig.from_name("seed001", key_shift=True)):
        with torch.device("meta"):
            from prisme.model.prisme import PrismeModel
            model = PrismeModel(c)
        assert model.num_parameters()["backbone"] == costs.backbone_params(c)
        assert model.backbone.num_parameters(non_embedding=True) == costs.backbone_params(c, non_embedding=True)
    contexts = list(range(1, 21))
    tc = costs.trace_cost(cfg, None, contexts)
    assert tc.by_component["backbone_attention"] == cfg.n_layer * 4 * cfg.d_model * sum(min(t, 8) for t in contexts)
    assert tc.by_component["backbone_key_shift"] == 20 * row["backbone_key_shift"] and tc.relative == 1.0
    assert costs.backbone_ops(cfg, 64) == costs.backbone_ops(cfg, 8) != costs.backbone_ops(
        cfg.replace(attn_window=None), 64)  # the backbone's price stops growing at W; the bank's does not
    assert costs.token_ops(cfg, 64, [1])["editor_source_attn"] > costs.token_ops(cfg, 8, [1])["editor_source_attn"]


# ---------------------------------------------------------------------- (f) bad input
@pytest.mark.parametrize("field,value", [
    ("attn_window", 0), ("attn_window", -3), ("attn_window", 65), ("attn_window", True), ("attn_window", 2.5),
    ("attn_window", "8"), ("key_shift", 1), ("key_shift", "yes"), ("key_shift", None)])
def test_bad_option_values_are_value_errors_naming_the_field(field, value):
    """attn_window must be None or an int in [1, max_seq_len] (64 for tiny); key_shift a bool."""
    with pytest.raises(ValueError, match=field):
        PrismeConfig.from_name("tiny", **{field: value})
    assert PrismeConfig.from_name("tiny", attn_window=64).attn_window == 64


def test_hf_export_and_import_refuse_the_options_by_name():
    """A stock HF Llama / GPT-2 has neither option: to_hf and from_hf(..., option) are ValueErrors naming it (before
    anything is converted or written)."""
    pytest.importorskip("transformers")
    from prisme.interop import export_hf, from_hf, to_hf

    for preset in PRESETS:
        for option in ("key_shift", "attn_window"):
            with pytest.raises(ValueError, match=option):
                to_hf(backbone(preset, **{option: True if option == "key_shift" else W}))
    hf = to_hf(backbone())
    with pytest.raises(ValueError, match="attn_window"):
        from_hf(hf, attn_window=W)
    with pytest.raises(ValueError, match="key_shift"):
        export_hf(backbone(key_shift=True), "/nonexistent/never-written")


def test_a_cache_made_for_other_options_is_refused():
    """A cache without the shift memory (or a ring) for a backbone that needs one, and the reverse: ValueError, the
    cache untouched."""
    x = tokens(64, B=2, n=4)
    for model, other in ((backbone(key_shift=True), backbone()), (backbone(attn_window=W), backbone()),
                         (backbone(), backbone(key_shift=True, attn_window=W))):
        cache = other.new_cache(2, 30)
        with pytest.raises(ValueError, match="new_cache"):
            model(x, cache)
        assert cache.lengths == [0, 0]


def test_compiled_decoding_supports_the_shift_and_refuses_a_window():
    """compile_decode's fixed-shape step and prompt step (run eagerly here) carry the key shift exactly; a window
    shorter than the cache is a ValueError naming it (a window as long as the cache is a plain cache)."""
    model = backbone(key_shift=True)
    x = tokens(model.cfg.vocab_size)
    dec = compile_decode(model, 2, 30, mode=None, prefill_mode=None)
    with torch.no_grad():
        got = [dec.prefill(x[:, :7])] + [dec.step(x[:, i:i + 1]) for i in range(7, T)]
        dec.reset()
        again = dec.prefill(x[:, :7])
    want = logits(model, x)
    assert err(torch.stack(got, 1), want[:, 6:]) <= 1e-12 and err(again, want[:, 6]) <= 1e-12
    with pytest.raises(ValueError, match="attn_window"):
        compile_decode(backbone(attn_window=W), 2, 30, mode=None, prefill_mode=None)
    compile_decode(backbone(attn_window=30), 2, 30, mode=None, prefill_mode=None)


# ---------------------------------------------------------------------- (g) checkpoints
@pytest.mark.parametrize("option", [dict(key_shift=True), dict(attn_window=W)], ids=["key_shift", "attn_window"])
def test_a_checkpoint_loads_only_into_a_config_with_the_same_options(option, tmp_path):
    """Saved with the config; loading under a config without the option (or a checkpoint without it under a
    config with it) is a ValueError naming the field; rebasing onto another backbone option is refused too; a
    config.json without the new fields (an older checkpoint) reads them as off."""
    from prisme.model.prisme import PrismeModel
    from prisme.rebase import rebase

    (field,) = option
    with_cfg, without_cfg = PrismeConfig.from_name("tiny", **option), PrismeConfig.from_name("tiny")
    for cfg, other in ((with_cfg, without_cfg), (without_cfg, with_cfg)):
        torch.manual_seed(0)
        path = save_checkpoint(tmp_path / f"{field}-{getattr(cfg, field)}", PrismeModel(cfg),
                               TrainingState(stage="backbone", step=1))
        model, meta = load_checkpoint(path, expected_config=cfg)
        assert getattr(meta.config, field) == getattr(cfg, field)
        with pytest.raises(ValueError, match=field):
            load_checkpoint(path, expected_config=other)
        with pytest.raises(ValueError, match=field):
            rebase(path, other, tmp_path / "rebased", seed=0)
    d = complete_config({k: v for k, v in without_cfg.to_dict().items() if k not in ("key_shift", "attn_window")})
    assert d["key_shift"] is False and d["attn_window"] is None and {"key_shift", "attn_window"} <= set(
        ADDED_CONFIG_FIELDS)


def test_weights_with_a_key_shift_do_not_fit_a_config_edited_to_drop_it(tmp_path):
    """A key-shift checkpoint whose config.json claims key_shift=false fails with the weights' ValueError."""
    import json

    from prisme.model.prisme import PrismeModel

    path = save_checkpoint(tmp_path / "ck", PrismeModel(PrismeConfig.from_name("tiny", key_shift=True)),
                           TrainingState(stage="backbone", step=1))
    d = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**d, "key_shift": False}))
    with pytest.raises(ValueError, match="wk_shift"):
        load_checkpoint(path)


# ---------------------------------------------------------------------- PRISME's workspace on a windowed backbone
BUDGET = 3


@pytest.fixture(scope="module")
def prisme64():
    """A PRISME model (workspace on) whose backbone has a window of 8 and a key shift; a 24-position state is a
    ring of 8 slots while the bank keeps all 24."""
    return tiny_model(0, ws_init="seed", attn_window=8, key_shift=True)


@pytest.mark.parametrize("lengths", [[19], [19, 11, 15]], ids=["batch1", "ragged"])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_prisme_decoding_with_a_windowed_shifted_backbone_equals_forward_policy(prisme64, chunk, lengths):
    """DecodeState in chunks of 1, 2, 5 (rows right-padded) gives forward_policy's logits (1e-12) and identical
    action traces, edit counts and controller steps; forced actions give forward's logits."""
    model = prisme64
    x = tokens(model.cfg.vocab_size, B=len(lengths), n=max(lengths))
    refs = [model.forward_policy(x[b:b + 1, :n], BUDGET, lambda_cost=0.0) for b, n in enumerate(lengths)]
    state = model.new_decode_state(len(lengths), max_len=24)
    assert state.cache.ring and state.cache.layers[0].k.shape[2] == 8 and state.bank.K.shape[1] == 24
    forced = torch.randint(0, model.cfg.dense_action + 1, (len(lengths), max(lengths), 2),
                           generator=torch.Generator().manual_seed(4))
    forced_state = model.new_decode_state(len(lengths), max_len=24)
    outs, forced_outs = [], []
    for i in range(0, max(lengths), chunk):
        n_new = [min(max(n - i, 0), chunk) for n in lengths]
        outs.append(state.decode_step(x[:, i:i + chunk], n_new, policy=Controller(max_budget=BUDGET, lambda_cost=0.0)))
        forced_outs.append(forced_state.decode_step(x[:, i:i + chunk], n_new, policy=Forced(forced[:, i:i + chunk])))
    got = {f: torch.cat([getattr(o, f) for o in outs], 1) for f in ("logits", "actions", "n_edits",
                                                                      "controller_steps")}
    got_forced = torch.cat([o.logits for o in forced_outs], 1)
    edits = 0
    for b, (n, ref) in enumerate(zip(lengths, refs)):
        assert err(got["logits"][b, :n], ref.logits[0]) <= 1e-12
        for f in ("actions", "n_edits", "controller_steps"):
            assert torch.equal(got[f][b, :n], getattr(ref, f)[0]), f
        edits += int((ref.n_edits > 0).sum())
        with torch.no_grad():
            want = model(x[b:b + 1, :n], forced[b:b + 1, :n]).logits[0]
        assert err(got_forced[b, :n], want) <= 1e-12
    assert 0 < edits < sum(lengths)  # the controller edits at some positions and stops at others


def test_decode_state_rewinds_exactly_or_refuses(prisme64):
    """DecodeState.rewind: a key-shift backbone rewinds to 0 (then decodes as a fresh state) and refuses an earlier
    non-zero length, the state unchanged; the same rule now holds for a shifted bank (`bank_shift`), whose memory
    also keeps the last position only."""
    model = prisme64
    x = tokens(model.cfg.vocab_size, B=1, n=14)
    state = model.new_decode_state(1, max_len=24)
    state.decode_step(x[:, :10], policy=Controller(max_budget=BUDGET))
    with pytest.raises(ValueError, match="key-shift"):
        state.rewind(6)
    assert state.lengths == [10]
    fresh = model.new_decode_state(1, max_len=24).decode_step(x, policy=Controller(max_budget=BUDGET)).logits
    assert err(state.rewind(0).decode_step(x, policy=Controller(max_budget=BUDGET)).logits, fresh) <= 1e-12
    banked = tiny_model(0, ws_init="seed", bank_shift=True)
    bstate = banked.new_decode_state(1, max_len=24)
    bstate.decode_step(x[:, :10], policy=Controller(max_budget=BUDGET))
    with pytest.raises(ValueError, match="bank shift"):
        bstate.rewind(6)
    fresh = banked.new_decode_state(1, max_len=24).decode_step(x, policy=Controller(max_budget=BUDGET)).logits
    assert err(bstate.rewind(0).decode_step(x, policy=Controller(max_budget=BUDGET)).logits, fresh) <= 1e-12
