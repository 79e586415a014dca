"""The whole model in transformers (`prisme export-hf --workspace`): a folder that
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` loads with `prisme` installed, workspace,
controller and router included, plus its tokenizer and a model card (README.md).

The folder holds `config.json` (`model_type` "prisme", `auto_map` to the two code files, the PrismeConfig fields and
the exported decoding policy), `model.safetensors` (PRISME's own state dict under `prisme.`), `configuration_prisme.py`
and `modeling_prisme.py` (thin wrappers over `prisme.model.prisme.PrismeModel`: the same modules, so the same logits),
the tokenizer files, and the card.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from prisme.checkpoint import find_model_checkpoint, load_model, load_tokenizer, read_meta, trained_groups
from prisme.data.tokenizers import ByteTokenizer
from prisme.interop import byte_tokenizer_hf, transformers_module
from prisme.io import PACKAGE_DIR, write_json_atomic, write_text_atomic

REMOTE = PACKAGE_DIR / "hf_remote"  # the two code files, shipped as package data (.tmpl: not modules of prisme)


def export_hf_full(checkpoint: str | Path, folder: str | Path, max_budget: int | None = None,
                   lambda_cost: float | None = None) -> Path:
    """Write `checkpoint`'s whole model to `folder` (see the module docstring). The exported policy runs the
    controller at `max_budget` (default: the largest budget its stages trained, 0 when no workspace was trained)
    and `lambda_cost` (default: the config's)."""
    transformers_module()  # an ImportError naming the extra, before anything is written
    path = find_model_checkpoint(checkpoint)
    model, meta = load_model(path)
    cfg = model.cfg
    trained = trained_groups(read_meta(path))
    if max_budget is None:
        max_budget = int(meta.stage_config.get("max_budget", 0)) if "controller" in trained or "router" in trained \
            else 0
    if not isinstance(max_budget, int) or not 0 <= max_budget <= cfg.r_max:
        raise ValueError(f"max_budget must be an int in [0, r_max={cfg.r_max}], got {max_budget!r}")
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{folder} already exists and is not empty; pass another --out")
    folder.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({f"prisme.{k}": v.detach().contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ("configuration_prisme.py", "modeling_prisme.py"):
        shutil.copyfile(REMOTE / f"{name}.tmpl", folder / name)
    policy = {"max_budget": max_budget, "lambda_cost": cfg.lambda_cost if lambda_cost is None else lambda_cost}
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
- Exported policy: the controller at budget {policy["max_budget"]}, price {policy["lambda_cost"]}
  (budget 0 = the backbone alone, bitwise).
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
