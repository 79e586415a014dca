"""The whole model in transformers (`prisme export-hf --workspace`): a folder that
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` loads with `prisme` installed, workspace,
controller and router included, plus its tokenizer and a model card (README.md).

The folder holds `config.json` (`model_type` "prisme", `auto_map` to the two code files, the PrismeConfig fields and
the exported decoding policy), `model.safetensors` (PRISME's own state dict under `prisme.`), `configuration_prisme.py`
and `modeling_prisme.py` (thin wrappers over `prisme.model.prisme.PrismeModel`: the same modules, so the same logits),
the tokenizer files, and the card. The weights file also records (in its safetensors metadata) the config entries it
was exported with; loading compares them with `config.json` and the weights with the model they build (`check_export`,
called by the folder's `from_pretrained`): an edited or missing entry, a truncated file or a weight the model does not
have is a ValueError naming it. `forward` gives each row of a padded batch (`attention_mask`, left or right padding)
what that row gets alone (`rows_alone`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from prisme.checkpoint import find_model_checkpoint, load_model, load_tokenizer, read_meta, trained_groups
from prisme.data.tokenizers import ByteTokenizer
from prisme.interop import byte_tokenizer_hf, transformers_module
from prisme.io import PACKAGE_DIR, current_umask, write_json_atomic, write_text_atomic

REMOTE = PACKAGE_DIR / "hf_remote"  # the two code files, shipped as package data (.tmpl: not modules of prisme)
WEIGHTS = "model.safetensors"
RECORD = "prisme_export"  # the weights' metadata entry: the config.json entries they were exported with


def export_hf_full(checkpoint: str | Path, folder: str | Path, max_budget: int | None = None,
                   lambda_cost: float | None = None) -> Path:
    """Write `checkpoint`'s whole model to `folder` (see the module docstring). The exported policy runs the
    controller at `max_budget` (default: the largest budget its stages trained, 0 when no workspace was trained)
    and `lambda_cost` (default: the model's default price, and its kappa_risk with it)."""
    transformers_module()  # an ImportError naming the extra, before anything is written
    path = find_model_checkpoint(checkpoint)
    model, meta = load_model(path)
    cfg = model.cfg
    trained = trained_groups(read_meta(path))
    if max_budget is None:  # the largest budget the controller or router stage trained (its max_budget; None: r_max)
        trained_budget = meta.stage_config.get("max_budget")
        max_budget = (cfg.r_max if trained_budget is None else trained_budget) if "controller" in trained \
            or "router" in trained else 0
    if not isinstance(max_budget, int) or not 0 <= max_budget <= cfg.r_max:
        raise ValueError(f"max_budget must be an int in [0, r_max={cfg.r_max}], got {max_budget!r}")
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{folder} already exists and is not empty; pass another --out")
    folder.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    lam, kap = model.default_price.fill(lambda_cost, None)
    policy = {"max_budget": max_budget, "lambda_cost": lam, "kappa_risk": kap}
    recorded = {"prisme": cfg.to_dict(), "policy": policy, "vocab_size": cfg.vocab_size}
    save_file({f"prisme.{k}": v.detach().contiguous() for k, v in model.state_dict().items()},
              str(folder / WEIGHTS), metadata={"format": "pt", RECORD: json.dumps(recorded, sort_keys=True)})
    os.chmod(folder / WEIGHTS, 0o666 & ~current_umask())  # safetensors writes 0600: follow the umask as other files
    for name in ("configuration_prisme.py", "modeling_prisme.py"):
        shutil.copyfile(REMOTE / f"{name}.tmpl", folder / name)
    hf_cfg = {"model_type": "prisme", "architectures": ["PrismeForCausalLM"], "prisme": cfg.to_dict(),
              "policy": policy, "vocab_size": cfg.vocab_size, "torch_dtype": str(next(model.parameters()).dtype)[6:],
              "auto_map": {"AutoConfig": "configuration_prisme.PrismeHFConfig",
                           "AutoModelForCausalLM": "modeling_prisme.PrismeForCausalLM"},
              "use_cache": False, "tie_word_embeddings": False}
    tok = load_tokenizer(path)
    if tok is not None:
        fast = transformers_module().PreTrainedTokenizerFast(
            tokenizer_object=byte_tokenizer_hf() if isinstance(tok, ByteTokenizer) else tok._tok)
        fast.save_pretrained(folder)
        if isinstance(tok, ByteTokenizer):  # NUL is the byte vocabulary's bos / eos / pad (see interop.export_hf)
            hf_cfg.update(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    write_json_atomic(hf_cfg, folder / "config.json")
    write_text_atomic(folder / "README.md", model_card(path, meta, policy, trained))
    return folder


def check_export(folder: str | Path, config: Any = None, weights: str | Path | None = None) -> None:
    """ValueError, one line naming the file and each entry, unless the folder's `config.json` (and `config`, the
    config object being loaded, if given) holds exactly the entries the weights were exported with (`RECORD`), and
    the weights file is whole. `weights`: the weights file when it is not `folder/model.safetensors` (a download)."""
    from safetensors import safe_open

    folder = Path(folder)
    weights = Path(weights) if weights is not None else folder / WEIGHTS
    if not weights.is_file():
        raise ValueError(f"{weights} is missing: the export's weights; export the checkpoint again")
    try:
        with safe_open(str(weights), "pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{weights} is truncated or corrupt ({e}); export the checkpoint again") from None
    if RECORD not in meta:
        raise ValueError(f"{weights} records no PRISME config (no {RECORD!r} metadata): it was not written by "
                         f"`prisme export-hf --workspace`; export the checkpoint again")
    recorded = json.loads(meta[RECORD])
    try:
        raw = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{folder / 'config.json'} is not readable JSON ({e})") from None
    sources = [(str(folder / "config.json"), raw)] if raw is not None else []
    if config is not None:  # the config object being loaded (edited in Python, or passed as config=...)
        sources.append(("the config passed to from_pretrained", {k: getattr(config, k) for k in recorded
                                                                  if hasattr(config, k)}))
    for where, got in sources:
        whole = [k for k, v in recorded.items() if isinstance(v, dict) and not isinstance(got.get(k), dict)]
        want = _flat({k: v for k, v in recorded.items() if k not in whole})
        have = _flat({k: got[k] for k in recorded if k in got and k not in whole})
        wrong = [f"{k} is missing (exported as an object of {len(recorded[k])} fields)" for k in whole]
        wrong += [f"{k} is missing (exported: {v!r})" if k not in have else f"{k} is {have[k]!r} (exported: {v!r})"
                  for k, v in want.items() if k not in have or have[k] != v]
        wrong += [f"{k} was not exported" for k in have if k not in want]
        if wrong:
            raise ValueError(f"{where} is not the config these weights were exported with: {'; '.join(wrong)} "
                             f"(recorded in {weights}); restore it or export the checkpoint again")


def _flat(entries: dict[str, Any]) -> dict[str, Any]:
    """{"prisme": {"n_layer": 2}, "vocab_size": 256} -> {"prisme.n_layer": 2, "vocab_size": 256}."""
    out: dict[str, Any] = {}
    for key, v in entries.items():
        if isinstance(v, dict):
            out.update({f"{key}.{k}": x for k, x in v.items()})
        else:
            out[key] = v
    return out


def check_loaded(info: dict[str, Any], where: str) -> None:
    """ValueError naming the weights that `from_pretrained`'s loading info says do not fit the model."""
    parts = [f"{k.replace('_', ' ')} {sorted(map(str, v))[:5]}" for k in ("missing_keys", "unexpected_keys",
                                                                         "mismatched_keys") if (v := info.get(k))]
    if parts:
        raise ValueError(f"{where} does not fit the model its config builds ({'; '.join(parts)}); export the "
                         f"checkpoint again")


def rows_alone(run: Any, input_ids: Any, attention_mask: Any = None, actions: Any = None) -> Any:
    """`run(ids, actions)`'s logits `[B, T, V]` with each row given only its unmasked tokens (`attention_mask`
    `[B, T]`: 1 = a token, 0 = padding, left, right or between), so that a padded row gets what it gets alone. A
    padded position repeats the logits of the row's last token before it (zeros before its first): after right
    padding the batch's last position holds the row's next-token logits, as `generate` reads them. Without a mask,
    or a mask of ones, one batched call."""
    if attention_mask is None or bool(attention_mask.bool().all()):
        return run(input_ids, actions)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got "
                         f"{tuple(attention_mask.shape)}")
    keep = attention_mask.bool()
    out = None
    for b in range(input_ids.shape[0]):
        if not bool(keep[b].any()):
            continue
        logits = run(input_ids[b, keep[b]][None], None if actions is None else actions[b, keep[b]][None])[0]
        if out is None:
            out = logits.new_zeros((*input_ids.shape, logits.shape[-1]))
        last = keep[b].long().cumsum(0) - 1  # [T] the row's last token at or before each position (-1: none yet)
        out[b, last >= 0] = logits[last[last >= 0]]
    if out is None:
        raise ValueError("attention_mask masks every token of every row")
    return out


def model_card(path: Path, meta: Any, policy: dict[str, Any], trained: set[str]) -> str:
    """The folder's README.md: what the model is, how it was trained, what it costs, how to load it."""
    from prisme.costs.analytic import backbone_ops

    cfg = meta.config
    ops = sum(backbone_ops(cfg, cfg.max_seq_len).values())
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in (meta.metrics or {}).items() if isinstance(v, float)) or "-"
    sc = meta.stage_config or {}
    return f"""---
library_name: transformers
tags: [prisme, adaptive-computation]
---

# {cfg.name} (PRISME, stage `{meta.stage}`, step {meta.step})

A PRISME language model: a {cfg.family} backbone ({cfg.n_layer} layers, d = {cfg.d_model}) with a sparse per-token
workspace ({cfg.n_slots} slots of width {cfg.w}) that a value controller edits under a compute price. Exported with
`prisme export-hf --workspace` from `{path}`.

- Parameter groups trained: {", ".join(sorted(trained)) or "none"}.
- Training: stage `{meta.stage}`, {meta.step} steps, dataset `{sc.get("dataset", "?")}`,
  batch {sc.get("batch_size", "?")}, sequence {sc.get("seq_len", "?")}, lr {sc.get("lr", "?")},
  seed {sc.get("seed", "?")}.
- Last recorded metrics: {metrics}.
- Exported policy: the controller at budget {policy["max_budget"]}, price {policy["lambda_cost"]}, risk aversion
  {policy["kappa_risk"]} (budget 0 = the backbone alone, bitwise).
- Cost: the backbone alone costs {ops:,.0f} ops per token at context {cfg.max_seq_len} (PRISME's analytic cost model);
  every edit adds the editor's and readout's ops: `prisme costs --preset ...` and `prisme eval` give the table and
  each policy's loss with paired 95% intervals.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer   # pip install prisme (its modules run the model)
model = AutoModelForCausalLM.from_pretrained(".", trust_remote_code=True)
logits = model(input_ids).logits                               # the exported policy
logits = model(input_ids, max_budget=0).logits                 # the backbone alone
```
"""
