"""Hugging Face `transformers` interop: the PRISME backbone as a `LlamaForCausalLM` / `GPT2LMHeadModel`, and back.

`to_hf(backbone)` returns an HF model whose logits are `backbone.head(backbone(tokens))` (the PRISME bypass logits);
`from_hf(hf_model)` is its inverse, so HF-format weights can be used in PRISME. Both copy the weights. A backbone
with `key_shift` or `attn_window` has no stock HF counterpart: both refuse it with a ValueError naming the option
(`check_hf_backbone`); `prisme export-hf --workspace` (`prisme.hf_full`) exports it exactly, with PRISME's modules.
`transformers` is an optional extra (`pip install 'prisme[hf]'`) and is imported only when a function needs it.

Weight layout (ours -> HF), per block i:
  llama: wqkv `[(nh + 2 nkv) hd, d]` -> q_proj `[nh hd, d]`, k_proj `[nkv hd, d]`, v_proj `[nkv hd, d]` (row split);
         w13 `[2 h, d]` = [gate; up] -> gate_proj, up_proj `[h, d]`; w2 -> down_proj; wo -> o_proj;
         norm1 / norm2 -> input_layernorm / post_attention_layernorm; head tied to the embedding (unless untied).
         Our RoPE uses HF's half-split `rotate_half` convention, so q and k rows need no permutation.
  gpt2:  HF `Conv1D` stores `[in, out]` (x @ W + b), our linears `[out, in]`: every projection is transposed;
         wqkv -> c_attn (both fused [q; k; v]); wo -> attn.c_proj; w13 -> c_fc; w2 -> mlp.c_proj; norm1/2 -> ln_1/2;
         learned positions pos_emb -> wpe; untied lm_head without bias -> lm_head (tie_word_embeddings=False);
         GELU tanh approximation = HF "gelu_pytorch_tanh" (the same function as "gelu_new", same kernel as ours).

Numerics: HF's GPT-2 computes in the model's dtype throughout, so a float64 model matches ours to rounding. HF's
Llama keeps three float32 islands whatever the model dtype: RMSNorm (upcast to float32), RoPE angles (float32) and
the eager attention softmax (float32). `to_hf(..., exact=True)` swaps in dtype-faithful RMSNorm and RoPE modules (same
parameters, same state_dict) so that a float64 Llama computes what PRISME computes; use it with "sdpa" attention for
float64 equivalence checks, and the stock modules (`exact=False`, the default) for export and timing.

`to_hf` writes the full PrismeConfig into the HF config (`prisme_config`, kept by `save_pretrained`), so `from_hf`
restores the name and workspace fields too. Cached decoding with HF: create a `DynamicCache(config=hf.config)` or
`StaticCache(config=hf.config, max_cache_len=...)` and pass it as `**{hf_cache_kwarg(hf): cache}` on every call.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from prisme.config import PrismeConfig, moved_fields
from prisme.model.backbone import Backbone

if TYPE_CHECKING:
    from transformers import PreTrainedModel

INSTALL_HINT = "pip install 'prisme[hf]'"
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
GELU_TANH_ACTS = ("gelu_new", "gelu_pytorch_tanh")  # both are 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))


def hf_available() -> bool:
    """True if `transformers` can be imported (the optional `hf` extra is installed)."""
    try:
        importlib.import_module("transformers")
    except ImportError:
        return False
    return True


def hf_cache_kwarg(hf_model: nn.Module) -> str:
    """The forward keyword that takes a `Cache`: "cache" in newer transformers 5.x, "past_key_values" before."""
    return "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"


def transformers_module() -> ModuleType:
    """The `transformers` module, or an ImportError that says how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError(f"Hugging Face interop needs the optional `transformers` package: {INSTALL_HINT}") from e


# ---------------------------------------------------------------------------------------------- weight tables
@dataclass(frozen=True)
class _Entry:
    """One of our tensors and the HF tensor(s) it becomes: split along dim 0 into `sizes`, each transposed if `t`."""

    ours: str
    hf: tuple[str, ...]
    sizes: tuple[int, ...] | None = None  # row split of a fused weight (None: one HF tensor)
    t: bool = False  # HF Conv1D: [in, out]


def _llama_table(cfg: PrismeConfig) -> list[_Entry]:
    nh, nkv, hd, h = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.ffn_hidden
    table = [_Entry("tok_emb.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.n_layer):
        o, p = f"blocks.{i}.", f"model.layers.{i}."
        table += [
            _Entry(o + "norm1.weight", (p + "input_layernorm.weight",)),
            _Entry(o + "attn.wqkv.weight", tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"),
                   (nh * hd, nkv * hd, nkv * hd)),
            _Entry(o + "attn.wo.weight", (p + "self_attn.o_proj.weight",)),
            _Entry(o + "norm2.weight", (p + "post_attention_layernorm.weight",)),
            _Entry(o + "mlp.w13.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), (h, h)),
            _Entry(o + "mlp.w2.weight", (p + "mlp.down_proj.weight",)),
        ]
    table.append(_Entry("norm.weight", ("model.norm.weight",)))
    table.append(_Entry("tok_emb.weight" if cfg.tie_embeddings else "lm_head.weight", ("lm_head.weight",)))
    return table


def _gpt2_table(cfg: PrismeConfig) -> list[_Entry]:
    table = [_Entry("tok_emb.weight", ("transformer.wte.weight",)),
             _Entry("pos_emb.weight", ("transformer.wpe.weight",))]
    for i in range(cfg.n_layer):
        o, p = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, hf in (("norm1", "ln_1"), ("norm2", "ln_2")):
            table += [_Entry(o + f"{ours}.{x}", (p + f"{hf}.{x}",)) for x in ("weight", "bias")]
        for ours, hf in (("attn.wqkv", "attn.c_attn"), ("attn.wo", "attn.c_proj"),
                         ("mlp.w13", "mlp.c_fc"), ("mlp.w2", "mlp.c_proj")):
            table += [_Entry(o + f"{ours}.weight", (p + f"{hf}.weight",), t=True),
                      _Entry(o + f"{ours}.bias", (p + f"{hf}.bias",))]
    table += [_Entry("norm.weight", ("transformer.ln_f.weight",)), _Entry("norm.bias", ("transformer.ln_f.bias",))]
    table.append(_Entry("tok_emb.weight" if cfg.tie_embeddings else "lm_head.weight", ("lm_head.weight",)))
    return table


def _table(cfg: PrismeConfig) -> list[_Entry]:
    return _llama_table(cfg) if cfg.family == "llama" else _gpt2_table(cfg)


def _check_covers(table: list[_Entry], ours: set[str], hf: set[str]) -> None:
    """The table must name every tensor on both sides: a changed parameter layout fails loudly, not silently."""
    missing_ours = ours - {e.ours for e in table}
    missing_hf = hf - {k for e in table for k in e.hf}
    if missing_ours or missing_hf:
        raise RuntimeError(f"prisme.interop's weight table is out of date: unmapped prisme tensors "
                           f"{sorted(missing_ours)}, unmapped HF tensors {sorted(missing_hf)}")


def to_hf_state_dict(backbone: Backbone) -> dict[str, torch.Tensor]:
    """Our backbone's weights under HF names and layouts (fresh contiguous copies)."""
    sd = backbone.state_dict()
    out: dict[str, torch.Tensor] = {}
    for e in _table(backbone.cfg):
        w = sd[e.ours]
        parts = w.split(list(e.sizes), dim=0) if e.sizes is not None else (w,)
        for name, part in zip(e.hf, parts):
            out[name] = (part.t() if e.t else part).contiguous().clone()
    return out


def from_hf_state_dict(cfg: PrismeConfig, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF weights (names and layouts of `to_hf_state_dict`) as our backbone's state_dict (fresh copies)."""
    out: dict[str, torch.Tensor] = {}
    for e in _table(cfg):
        if e.ours in out:  # tied head: the embedding is already set
            continue
        parts = [hf_sd[k].t() if e.t else hf_sd[k] for k in e.hf]
        out[e.ours] = (torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]).contiguous().clone()
    return out


# ---------------------------------------------------------------------------------------------- configs
def hf_config(cfg: PrismeConfig, attn_implementation: str = "sdpa") -> Any:
    """The `LlamaConfig` / `GPT2Config` describing the same backbone as `cfg` (workspace fields are not exported)."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")
    cfg.validate()
    check_hf_backbone(cfg)
    tf = transformers_module()
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, attn_implementation=attn_implementation)
    if cfg.family == "llama":
        hf_cfg = tf.LlamaConfig(
            hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden, num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head, head_dim=cfg.head_dim,
            hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
            attention_bias=False, mlp_bias=False, attention_dropout=0.0, initializer_range=cfg.init_std, **common)
    else:
        if cfg.n_kv_head != cfg.n_head:
            raise ValueError(f"HF GPT-2 has no grouped-query attention: n_kv_head={cfg.n_kv_head} != "
                             f"n_head={cfg.n_head}")
        hf_cfg = tf.GPT2Config(
            n_embd=cfg.d_model, n_inner=cfg.ffn_hidden, n_layer=cfg.n_layer, n_head=cfg.n_head,
            n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps, activation_function="gelu_pytorch_tanh",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, initializer_range=cfg.init_std,
            **common)
    hf_cfg.prisme_config = cfg.to_dict()  # the full PrismeConfig, so that from_hf restores name and workspace fields
    return hf_cfg


def check_hf_backbone(cfg: PrismeConfig) -> None:
    """ValueError naming the backbone options HF's Llama / GPT-2 do not have (`key_shift`, `attn_window`): such a
    backbone cannot be exported to, or imported from, a stock HF model exactly (`export-hf --workspace` can: it
    ships PRISME's own modules)."""
    options = [f for f, on in (("key_shift", cfg.key_shift), ("attn_window", cfg.attn_window is not None)) if on]
    if options:
        raise ValueError(f"HF {'LlamaForCausalLM' if cfg.family == 'llama' else 'GPT2LMHeadModel'} has no "
                         f"{' and no '.join(options)} ({', '.join(f'{f}={getattr(cfg, f)!r}' for f in options)}): "
                         f"this backbone cannot be exported to or imported from it exactly")


def prisme_config_from_hf(hf_cfg: Any, **overrides: Any) -> PrismeConfig:
    """The `PrismeConfig` of an HF Llama / GPT-2 config; ValueError for features our backbone does not have.

    Backbone fields come from the HF config. The other fields (name, workspace sizes) come from the `prisme_config`
    entry that `to_hf` writes into the HF config (it survives `save_pretrained`), else from PrismeConfig's defaults;
    `overrides` set any field last.
    """
    kind = getattr(hf_cfg, "model_type", None)
    unsupported: list[str] = []
    if kind == "llama":
        rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
        theta = float(rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0)))
        d, nh = hf_cfg.hidden_size, hf_cfg.num_attention_heads
        head_dim = getattr(hf_cfg, "head_dim", None) or d // nh
        for ok, what in ((not hf_cfg.attention_bias, "attention_bias=True"), (not hf_cfg.mlp_bias, "mlp_bias=True"),
                         (hf_cfg.hidden_act == "silu", f"hidden_act={hf_cfg.hidden_act!r} (need 'silu')"),
                         (rope.get("rope_type", "default") == "default", f"rope_type={rope.get('rope_type')!r}"),
                         (head_dim * nh == d, f"head_dim={head_dim} != hidden_size / num_attention_heads")):
            if not ok:
                unsupported.append(what)
        fields = dict(family="llama", d_model=d, n_head=nh, n_kv_head=hf_cfg.num_key_value_heads or nh,
                      ffn_hidden=hf_cfg.intermediate_size, max_seq_len=hf_cfg.max_position_embeddings,
                      rope_theta=theta, norm_eps=float(hf_cfg.rms_norm_eps))
    elif kind == "gpt2":
        for ok, what in ((hf_cfg.activation_function in GELU_TANH_ACTS,
                          f"activation_function={hf_cfg.activation_function!r} (need one of {GELU_TANH_ACTS})"),
                         (hf_cfg.scale_attn_weights, "scale_attn_weights=False"),
                         (not hf_cfg.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=True"),
                         (not hf_cfg.add_cross_attention, "add_cross_attention=True")):
            if not ok:
                unsupported.append(what)
        d = hf_cfg.n_embd
        fields = dict(family="gpt2", d_model=d, n_head=hf_cfg.n_head, n_kv_head=hf_cfg.n_head,
                      ffn_hidden=hf_cfg.n_inner or 4 * d, max_seq_len=hf_cfg.n_positions,
                      norm_eps=float(hf_cfg.layer_norm_epsilon))
    else:
        raise ValueError(f"from_hf supports HF model_type 'llama' and 'gpt2', got {kind!r}")
    if unsupported:
        raise ValueError(f"HF {kind} config uses features the PRISME backbone does not have: {', '.join(unsupported)}")
    fields.update(vocab_size=hf_cfg.vocab_size, n_layer=hf_cfg.num_hidden_layers,
                  tie_embeddings=bool(hf_cfg.tie_word_embeddings), init_std=float(hf_cfg.initializer_range))
    carried = dict(getattr(hf_cfg, "prisme_config", None) or {})  # written by to_hf: name and workspace fields
    carried, _ = moved_fields(carried)  # (an older export's decode options and prices: nothing a backbone reads)
    cfg = PrismeConfig.from_dict({"name": f"hf-{kind}", **carried, **fields, **overrides})
    check_hf_backbone(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------- exact llama modules
@functools.cache
def _exact_llama_modules() -> dict[type[nn.Module], type[nn.Module]]:
    """HF's LlamaRMSNorm / LlamaRotaryEmbedding -> subclasses that compute in the input's dtype, as PRISME does."""
    from transformers.models.llama import modeling_llama as ml

    class ExactRMSNorm(ml.LlamaRMSNorm):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)

    class ExactRotaryEmbedding(ml.LlamaRotaryEmbedding):
        """cos, sin `[B, T, hd]` from float64 angles (as `prisme.attention.rope_tables`), cast to x's dtype."""

        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            theta, hd = self.config.rope_parameters["rope_theta"], 2 * self.inv_freq.shape[0]
            inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=x.device) / hd))  # [hd/2]
            angles = position_ids[..., None].to(torch.float64) * inv_freq  # [B, T, hd/2]
            emb = torch.cat((angles, angles), dim=-1)  # [B, T, hd]
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    return {ml.LlamaRMSNorm: ExactRMSNorm, ml.LlamaRotaryEmbedding: ExactRotaryEmbedding}


def _make_llama_exact(hf: nn.Module) -> None:
    """Swap the class of every stock RMSNorm / rotary module in place: same parameters and state_dict."""
    exact = _exact_llama_modules()
    for module in hf.modules():
        if type(module) in exact:
            module.__class__ = exact[type(module)]


# ---------------------------------------------------------------------------------------------- conversion
def _backbone_of(model: nn.Module) -> Backbone:
    if isinstance(model, Backbone):
        return model
    backbone = getattr(model, "backbone", None)
    if isinstance(backbone, Backbone):
        return backbone
    raise ValueError(f"to_hf expects a prisme Backbone or a model with a `.backbone`, got {type(model).__name__}")


def to_hf(model: nn.Module, attn_implementation: str = "sdpa", exact: bool = False) -> PreTrainedModel:
    """The backbone of `model` (a `Backbone` or `PrismeModel`) as an HF causal LM with a copy of its weights.

    Args:
        model: a `Backbone` or anything with a `.backbone` (a `PrismeModel`: its workspace is not exported, so the
            HF logits are the bypass logits `backbone.head(backbone(tokens))`).
        attn_implementation: "eager" or "sdpa".
        exact: llama only; swap HF's float32 RMSNorm / RoPE for dtype-faithful modules (see the module docstring).
    Returns:
        `LlamaForCausalLM` (family "llama") or `GPT2LMHeadModel` (family "gpt2") in eval mode, on the backbone's
        device and dtype; `hf(tokens).logits` `[B, T, V]` equals `backbone.head(backbone(tokens))`.
    """
    backbone = _backbone_of(model)
    cfg = backbone.cfg
    hf_cfg = hf_config(cfg, attn_implementation)  # validates attn_implementation, imports transformers
    if exact and cfg.family == "llama" and attn_implementation == "eager":
        raise ValueError("exact=True needs attn_implementation='sdpa': HF's eager Llama attention takes its softmax "
                         "in float32")
    tf = transformers_module()
    p = backbone.tok_emb.weight
    hf_cfg.dtype = p.dtype
    cls = tf.LlamaForCausalLM if cfg.family == "llama" else tf.GPT2LMHeadModel
    with torch.device(p.device):
        hf = cls(hf_cfg).to(p.dtype)
    sd = to_hf_state_dict(backbone)
    _check_covers(_table(cfg), set(backbone.state_dict()), set(hf.state_dict()))
    hf.load_state_dict(sd, strict=True)
    if cfg.tie_embeddings and hf.get_output_embeddings().weight is not hf.get_input_embeddings().weight:
        raise RuntimeError("transformers did not tie lm_head to the token embedding")
    if exact and cfg.family == "llama":
        _make_llama_exact(hf)
    return hf.eval()


def from_hf(hf_model: nn.Module, **overrides: Any) -> Backbone:
    """A PRISME `Backbone` with a copy of an HF `LlamaForCausalLM` / `GPT2LMHeadModel`'s weights (inverse of to_hf).

    `overrides` set other PrismeConfig fields (e.g. `name`, workspace sizes). The backbone is in eval mode, on the
    HF model's device and dtype; `backbone.head(backbone(tokens))` equals `hf_model(tokens).logits` `[B, T, V]` (to
    rounding; a stock HF Llama differs at float32 rounding even in float64, see the module docstring).
    """
    hf_cfg = getattr(hf_model, "config", None)
    if hf_cfg is None or not isinstance(hf_model, nn.Module):
        raise ValueError(f"from_hf expects a transformers PreTrainedModel, got {type(hf_model).__name__}")
    cfg = prisme_config_from_hf(hf_cfg, **overrides)
    hf_sd = hf_model.state_dict()
    if "lm_head.weight" not in hf_sd:
        raise ValueError(f"from_hf needs a causal LM with its head ({type(hf_model).__name__} has no lm_head); "
                         f"use LlamaForCausalLM / GPT2LMHeadModel")
    p = hf_model.get_input_embeddings().weight
    backbone = Backbone(cfg).to(device=p.device, dtype=p.dtype)
    _check_covers(_table(cfg), set(backbone.state_dict()), set(hf_sd))
    backbone.load_state_dict(from_hf_state_dict(cfg, hf_sd), strict=True)
    return backbone.eval()


# ---------------------------------------------------------------------------------------------- a self-contained folder
def byte_tokenizer_hf():
    """The byte tokenizer as an HF `tokenizers.Tokenizer`: id b is byte b (GPT-2's byte-to-unicode symbols, no
    merges), so `encode(text).ids == list(text.encode("utf-8"))` and decoding inverts it, for any text."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise ValueError("exporting a tokenizer needs the HF `tokenizers` package: pip install 'prisme[bpe]'") from None
    symbols = pre_tokenizers.ByteLevel.alphabet()  # the 256 symbols, in no particular order
    to_byte = {c: _unicode_to_byte(c) for c in symbols}
    vocab = {c: to_byte[c] for c in symbols}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _unicode_to_byte(c: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to 256 + their rank."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    others = [b for b in range(256) if b not in printable]
    code = ord(c)
    return code if code in printable else others[code - 256]


def export_hf(model: nn.Module, folder: str | Path, tokenizer: Any = "byte") -> Path:
    """Write `model`'s backbone as an HF folder that works on its own: `save_pretrained` weights and config, and the
    tokenizer (`"byte"`, a `prisme.data.BPETokenizer`, or None) as `tokenizer.json` + `tokenizer_config.json`, so that
    `AutoModelForCausalLM.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)` both load it. The byte
    tokenizer has no spare id for special tokens, so byte 0 (NUL) is the model config's bos / eos / pad id; the
    tokenizer declares no special token strings (any string it could use can occur in text, and would then no longer
    encode as its bytes)."""
    PreTrainedTokenizerFast = transformers_module().PreTrainedTokenizerFast

    folder = Path(folder)
    hf = to_hf(model)
    if tokenizer == "byte":
        tok = byte_tokenizer_hf()
        hf.config.bos_token_id = hf.config.eos_token_id = hf.config.pad_token_id = 0
        if getattr(hf, "generation_config", None) is not None:
            hf.generation_config.bos_token_id = hf.generation_config.eos_token_id = 0
            hf.generation_config.pad_token_id = 0
    elif tokenizer is not None:
        tok = tokenizer._tok
    hf.save_pretrained(folder)
    from prisme.io import current_umask

    for weights in folder.glob("*.safetensors"):  # safetensors writes 0600: follow the umask like every other file
        os.chmod(weights, 0o666 & ~current_umask())
    if tokenizer is not None:
        PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    return folder


def export_hf_checkpoint(checkpoint: str | Path, folder: str | Path, tokenizer: str | None = None) -> Path:
    """`export_hf` of a checkpoint (or run / study folder: its most trained stage) with the tokenizer it was trained
    with, which its folder holds; `tokenizer` overrides it: "byte", "none" or a BPE file (or folder)."""
    from prisme.checkpoint import find_model_checkpoint, load_model, load_tokenizer, read_meta
    from prisme.data.tokenizers import ByteTokenizer, describe_tokenizer, tokenizer_named

    path = find_model_checkpoint(checkpoint)
    if tokenizer is None:  # the checkpoint's own (None: a token-id model, exported without a tokenizer)
        tok = load_tokenizer(path)
        tok = "byte" if isinstance(tok, ByteTokenizer) else tok
    else:
        tok = {"byte": "byte", "none": None}.get(tokenizer) if tokenizer in ("byte", "none") \
            else tokenizer_named(tokenizer)
        asked, own = (ByteTokenizer() if tok == "byte" else tok), load_tokenizer(path)
        if asked is not None and read_meta(path).tokenizer is not None and (
                own is None or own.identity != asked.identity):  # the ids would be written as other strings
            raise ValueError(f"--tokenizer {tokenizer} ({describe_tokenizer(asked)}) is not the tokenizer {path} was "
                             f"trained with ({describe_tokenizer(own)}); leave --tokenizer out to export its own")
    return export_hf(load_model(path)[0], folder, tok)

