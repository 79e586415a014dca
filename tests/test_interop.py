"""HF transformers interop: `to_hf` / `from_hf` reproduce the PRISME backbone's logits, cached decode and weights.

Every parameter of the test backbones (norm gains and biases included) is random and O(1)-scaled, so each entry of
the weight table moves the logits; each check has a negative control with a deliberate converter bug.
"""

from __future__ import annotations

import importlib
import re
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import assert_close  # noqa: E402

import prisme.interop  # noqa: E402
from prisme.config import PrismeConfig  # noqa: E402
from prisme.interop import from_hf, hf_available, hf_cache_kwarg, to_hf  # noqa: E402
from prisme.model.backbone import Backbone  # noqa: E402
from prisme.model.prisme import PrismeModel  # noqa: E402

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}  # max |logit difference|; logits are O(5)
BUG_MIN = 1e-2  # a converter bug must move the logits by more than this
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
PRESETS = pytest.mark.parametrize("preset", ["tiny", "seed001"])  # llama, gpt2


def randomise_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter O(1)-scale random values: matrices ~ N(0, 1.2^2 / fan_in), gains ~ 1 + N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g).to(p.dtype)
            if p.dim() >= 2:
                p.copy_(noise * 1.2 / p.shape[-1] ** 0.5)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(1 + 0.1 * noise)
    return module


def make_backbone(preset: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> Backbone:
    torch.manual_seed(seed)
    return randomise_(Backbone(PrismeConfig.from_name(preset)), seed).to(dtype).eval()


def convert(backbone: Backbone, attn: str = "sdpa") -> torch.nn.Module:
    """to_hf, exact RoPE/RMSNorm for a float64 Llama (stock HF Llama computes those in float32)."""
    exact = backbone.cfg.family == "llama" and backbone.tok_emb.weight.dtype == torch.float64
    return to_hf(backbone, attn, exact=exact)


def tokens_for(backbone: Backbone, B: int, T: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, backbone.cfg.vocab_size, (B, T), generator=g)  # [B, T]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@torch.no_grad()
def prisme_logits(backbone: Backbone, tokens: torch.Tensor) -> torch.Tensor:
    return backbone.head(backbone(tokens))  # [B, T, V]


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return hf(tokens).logits  # [B, T, V]


@torch.no_grad()
def prisme_forced_decode(backbone: Backbone, tokens: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """Prefill tokens[:, :n_prompt] into a KVCache, then feed the rest one at a time; next-token logits [B, n, V]."""
    B, T = tokens.shape
    cache = backbone.new_cache(B, T)
    out = [backbone.head(backbone.prefill(tokens[:, :n_prompt], cache)[:, -1])]
    out += [backbone.head(backbone(tokens[:, t:t + 1], cache)[:, -1]) for t in range(n_prompt, T)]
    return torch.stack(out, dim=1)  # [B, T - n_prompt + 1, V]


@torch.no_grad()
def hf_forced_decode(hf: torch.nn.Module, tokens: torch.Tensor, n_prompt: int, cache_kind: str,
                     pos_shift: int = 0) -> torch.Tensor:
    """The same with HF's own cache (dynamic or static); `pos_shift` offsets the decode positions (a planted bug)."""
    B, T = tokens.shape
    if cache_kind == "static":
        cache = transformers.StaticCache(config=hf.config, max_cache_len=T + pos_shift)
    else:
        cache = transformers.DynamicCache(config=hf.config)
    kw = {hf_cache_kwarg(hf): cache, "use_cache": True}
    out = [hf(tokens[:, :n_prompt], **kw).logits[:, -1]]
    for t in range(n_prompt, T):
        position_ids = torch.full((B, 1), t + pos_shift)  # [B, 1]
        out.append(hf(tokens[:, t:t + 1], position_ids=position_ids, **kw).logits[:, -1])
    return torch.stack(out, dim=1)  # [B, T - n_prompt + 1, V]


@torch.no_grad()
def prisme_greedy(backbone: Backbone, prompt: torch.Tensor, n_new: int) -> torch.Tensor:
    """Greedy continuation `[B, n_new]` with the backbone's KVCache."""
    B, T = prompt.shape
    cache = backbone.new_cache(B, T + n_new)
    h = backbone.prefill(prompt, cache)[:, -1]  # [B, d]
    new = []
    for _ in range(n_new):
        new.append(backbone.head(h).argmax(-1, keepdim=True))  # [B, 1]
        h = backbone(new[-1], cache)[:, -1]
    return torch.cat(new, dim=1)


def weight_mismatches(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of state_dict entries that are not bitwise equal (or exist on one side only)."""
    sa, sb = a.state_dict(), b.state_dict()
    return sorted(set(sa) ^ set(sb)) + [k for k in sa if k in sb and not (
        sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]))]


# ------------------------------------------------------------------------------------------------ converter bugs
def bug_transpose_attn_c_proj(hf: torch.nn.Module) -> None:
    w = hf.transformer.h[0].attn.c_proj.weight  # Conv1D [in, out], square: a missed transpose still loads
    w.copy_(w.t().clone())


def bug_head_from_embedding(hf: torch.nn.Module) -> None:
    hf.lm_head.weight.copy_(hf.transformer.wte.weight)  # untied head loaded from the embedding


def bug_swap_gate_up(hf: torch.nn.Module) -> None:
    mlp = hf.model.layers[0].mlp
    gate = mlp.gate_proj.weight.clone()
    mlp.gate_proj.weight.copy_(mlp.up_proj.weight)
    mlp.up_proj.weight.copy_(gate)


def bug_swap_k_v(hf: torch.nn.Module) -> None:
    attn = hf.model.layers[0].self_attn
    k = attn.k_proj.weight.clone()
    attn.k_proj.weight.copy_(attn.v_proj.weight)
    attn.v_proj.weight.copy_(k)


def bug_interleaved_rope_permute(hf: torch.nn.Module) -> None:
    """Meta->HF's q/k row permutation applied to weights that are already in HF's half-split convention."""
    attn, cfg = hf.model.layers[0].self_attn, hf.config
    for w, heads in ((attn.q_proj.weight, cfg.num_attention_heads), (attn.k_proj.weight, cfg.num_key_value_heads)):
        hd = w.shape[0] // heads
        w.copy_(w.view(heads, hd // 2, 2, -1).transpose(1, 2).reshape(w.shape).clone())


BUGS = {"tiny": [bug_swap_gate_up, bug_swap_k_v, bug_interleaved_rope_permute],
        "seed001": [bug_transpose_attn_c_proj, bug_head_from_embedding]}
BUG_CASES = [(preset, bug) for preset, bugs in BUGS.items() for bug in bugs]


# ------------------------------------------------------------------------------------------------ tests
# HF's eager Llama takes its softmax in float32 whatever the dtype: float64 + eager Llama is checked to float32
# rounding in test_stock_hf_llama_float64_agrees_to_float32_rounding instead.
LOGIT_CASES = [(p, d, a) for p in ("tiny", "seed001") for d in (torch.float64, torch.float32) for a in ("eager", "sdpa")
               if not (p == "tiny" and d == torch.float64 and a == "eager")]


@pytest.mark.parametrize("preset,dtype,attn", LOGIT_CASES, ids=[f"{p}-{str(d)[6:]}-{a}" for p, d, a in LOGIT_CASES])
def test_hf_logits_equal_prisme_logits(preset: str, dtype: torch.dtype, attn: str) -> None:
    """HF's logits on a random batch equal the backbone's (float64 <= 1e-10, float32 <= 1e-5)."""
    bb = make_backbone(preset, dtype)
    hf = convert(bb, attn)
    assert type(hf).__name__ == ("LlamaForCausalLM" if preset == "tiny" else "GPT2LMHeadModel")
    assert hf.lm_head.weight.dtype == dtype
    x = tokens_for(bb, 3, bb.cfg.max_seq_len if preset == "tiny" else 96)
    ref = prisme_logits(bb, x)
    assert ref.abs().max() > 1.0  # logits are O(1): the tolerances below are meaningful
    assert_close(hf_logits(hf, x), ref, TOL[dtype], "HF vs prisme logits")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_stock_hf_llama_float64_agrees_to_float32_rounding(attn: str) -> None:
    """Unmodified HF Llama in float64 (float32 RMSNorm/RoPE/eager softmax inside) agrees with ours to 1e-5."""
    bb = make_backbone("tiny", torch.float64)
    x = tokens_for(bb, 2, bb.cfg.max_seq_len)
    assert_close(hf_logits(to_hf(bb, attn, exact=False), x), prisme_logits(bb, x), 1e-5, "stock HF vs prisme")


def test_to_hf_of_prisme_model_gives_bypass_logits() -> None:
    """to_hf(PrismeModel) exports the backbone: HF logits equal the model's bypass (no-edit) logits."""
    torch.manual_seed(0)
    model = randomise_(PrismeModel(PrismeConfig.from_name("tiny"))).double().eval()
    x = tokens_for(model.backbone, 2, 24)
    with torch.no_grad():
        ref = model(x).logits  # [B, T, V]
    assert_close(hf_logits(to_hf(model, exact=True), x), ref, TOL[torch.float64], "HF vs prisme bypass logits")


@pytest.mark.parametrize("preset,bug", BUG_CASES, ids=[f"{p}-{b.__name__}" for p, b in BUG_CASES])
def test_converter_bug_is_caught_by_logits_check(preset: str, bug) -> None:
    """Negative control: a planted converter bug (one weight mis-mapped) moves the HF logits by more than 1e-2."""
    bb = make_backbone(preset, torch.float64)
    hf = convert(bb)
    x = tokens_for(bb, 2, 32)
    assert_close(hf_logits(hf, x), prisme_logits(bb, x), TOL[torch.float64], "before the bug")
    with torch.no_grad():
        bug(hf)
    err = max_diff(hf_logits(hf, x), prisme_logits(bb, x))
    assert err > BUG_MIN, f"{bug.__name__} went unnoticed: max |HF - prisme| = {err:.3e}"


@PRESETS
@DTYPES
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_hf_cached_forced_decode_equals_prisme_cached_decode(preset: str, dtype: torch.dtype,
                                                             cache_kind: str) -> None:
    """Prefill + one-token steps through HF's cache give the same next-token logits as through our KVCache."""
    bb = make_backbone(preset, dtype)
    hf = convert(bb)
    x = tokens_for(bb, 2, 20)
    ref = prisme_forced_decode(bb, x, n_prompt=12)  # [B, 9, V]
    assert_close(hf_forced_decode(hf, x, 12, cache_kind), ref, TOL[dtype], "HF vs prisme cached decode")
    # negative control: decode positions off by one (RoPE angle / learned position) must be caught
    err_bug = max_diff(hf_forced_decode(hf, x, 12, cache_kind, pos_shift=1)[:, 1:], ref[:, 1:])
    assert err_bug > BUG_MIN, f"shifted decode positions went unnoticed: {err_bug:.3e}"


@PRESETS
@pytest.mark.parametrize("cache_implementation", [None, "static"], ids=["dynamic", "static"])
def test_hf_greedy_generate_equals_prisme_greedy(preset: str, cache_implementation: str | None) -> None:
    """`generate(do_sample=False)` emits the same tokens as greedy decoding with our KVCache (float64)."""
    bb = make_backbone(preset, torch.float64)
    hf = convert(bb)
    prompt = tokens_for(bb, 2, 10)
    n_new = 12
    ref = prisme_greedy(bb, prompt, n_new)  # [B, n_new]
    assert len(set(ref.flatten().tolist())) > 2  # a non-degenerate continuation

    def generate(model: torch.nn.Module) -> torch.Tensor:
        out = model.generate(prompt, do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                             cache_implementation=cache_implementation)
        return out[:, prompt.shape[1]:]

    assert torch.equal(generate(hf), ref)
    with torch.no_grad():  # negative control: a converter bug changes the greedy continuation
        (bug_swap_gate_up if preset == "tiny" else bug_transpose_attn_c_proj)(hf)
    assert not torch.equal(generate(hf), ref)


@PRESETS
@DTYPES
def test_from_hf_of_to_hf_is_bitwise_identity(preset: str, dtype: torch.dtype) -> None:
    """from_hf(to_hf(backbone)) has bitwise-equal weights, the same dtype and the same PrismeConfig."""
    bb = make_backbone(preset, dtype)
    hf = to_hf(bb)
    back = from_hf(hf)
    assert weight_mismatches(back, bb) == []
    assert back.cfg == bb.cfg
    assert not any(p.data_ptr() == q.data_ptr() for p in back.parameters() for q in hf.parameters())  # copies
    with torch.no_grad():  # negative control: one changed element is reported by name
        hf.lm_head.weight[0, 0] += 1e-3
    assert weight_mismatches(from_hf(hf), bb) == ["tok_emb.weight" if bb.cfg.tie_embeddings else "lm_head.weight"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_initialised_model_round_trips_through_prisme(family: str) -> None:
    """An HF-initialised model (GQA Llama / tied GPT-2) survives to_hf(from_hf(hf)) bitwise and keeps its logits."""
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                       num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=40,
                                       rms_norm_eps=1e-6, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 500.0})
        hf = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=50, n_embd=48, n_layer=2, n_head=3, n_positions=40, n_inner=100)
        hf = transformers.GPT2LMHeadModel(cfg)  # tie_word_embeddings=True by default
    hf = randomise_(hf).double().eval()
    bb = from_hf(hf, name="from-hf")
    assert bb.cfg.tie_embeddings == (family == "gpt2") and bb.cfg.name == "from-hf"
    again = to_hf(bb)
    assert weight_mismatches(again, hf) == []
    x = tokens_for(bb, 2, 40)
    assert_close(prisme_logits(bb, x), hf_logits(convert(bb), x), TOL[torch.float64], "prisme vs HF logits")


@PRESETS
def test_save_pretrained_checkpoint_loads_back_into_prisme(preset: str, tmp_path) -> None:
    """to_hf -> save_pretrained -> AutoModelForCausalLM.from_pretrained -> from_hf keeps weights and config."""
    bb = make_backbone(preset, torch.float32)
    to_hf(bb).save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    back = from_hf(hf)
    assert weight_mismatches(back, bb) == []
    assert back.cfg == bb.cfg


def test_bad_inputs_raise_value_error() -> None:
    """Unsupported settings and objects raise ValueError naming the problem, before any conversion."""
    bb = make_backbone("tiny")
    with pytest.raises(ValueError, match="attn_implementation"):
        to_hf(bb, "flash_attention_2")
    with pytest.raises(ValueError, match="exact=True needs"):
        to_hf(bb, "eager", exact=True)
    with pytest.raises(ValueError, match="Backbone"):
        to_hf(torch.nn.Linear(2, 2))
    gqa_gpt2 = Backbone(PrismeConfig.from_name("seed001", n_kv_head=2))
    with pytest.raises(ValueError, match="grouped-query"):
        to_hf(gqa_gpt2)
    llama = to_hf(bb)
    with pytest.raises(ValueError, match="no lm_head"):
        from_hf(llama.model)
    with pytest.raises(ValueError, match="attention_bias"):
        from_hf(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            attention_bias=True)))
    with pytest.raises(ValueError, match="activation_function"):
        from_hf(transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=16, n_embd=16, n_layer=1, n_head=2, activation_function="relu")))
    with pytest.raises(ValueError, match="model_type"):
        from_hf(transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)))


def test_without_transformers_import_works_and_errors_name_the_extra(monkeypatch) -> None:
    """With transformers unimportable, prisme.interop still imports, hf_available() is False and to_hf says how to
    install the extra."""
    assert hf_available()
    bb = make_backbone("tiny")
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    try:
        module = importlib.reload(prisme.interop)  # the module's own code runs without transformers
        assert not module.hf_available()
        with pytest.raises(ImportError, match=re.escape("pip install 'prisme[hf]'")):
            module.to_hf(bb)
    finally:
        monkeypatch.undo()
        importlib.reload(prisme.interop)
    assert prisme.interop.hf_available()
