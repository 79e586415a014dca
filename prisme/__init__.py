"""PRISME: language models with an adaptive, sparse, per-token workspace.

The public face: `fit` (your data -> a trained model, every stage of a recipe), `load` (a checkpoint with its
tokenizer: text in, text out with `generate_text` or its `.generate`), `PrismeConfig` (and `PRESETS`), `PrismeModel`,
`load_model` (a checkpoint folder -> (model, meta)), `generate` (token ids), and what a call runs: the policies
`Controller` and `Forced`, the `Sampling` of generation, a decode state's `DecodeOptions` and the editor's
`ExecutionOptions`. The model, checkpoint, generation and training modules load on first use, so `import prisme`
stays light. docs/python.md shows each.
"""

from __future__ import annotations

from typing import Any

from prisme.config import PRESETS, PrismeConfig
from prisme.options import DecodeOptions, ExecutionOptions

__all__ = ["PRESETS", "Controller", "DecodeOptions", "ExecutionOptions", "Forced", "GenerationOutput", "PrismeConfig",
           "PrismeModel", "Sampling", "TextOutput", "fit", "generate", "generate_text", "load", "load_model"]
__version__ = "0.2.0.dev0"  # the one version: pyproject.toml reads it (CHANGELOG: 0.2.0, unreleased)

_LAZY = {"PrismeModel": "prisme.model.prisme", "load_model": "prisme.checkpoint",
         "generate": "prisme.decoding.generate", "Controller": "prisme.model.policy", "Forced": "prisme.model.policy",
         "Sampling": "prisme.decoding.sampling", "GenerationOutput": "prisme.decoding.generate",
         "load": "prisme.decoding.text", "generate_text": "prisme.decoding.text", "TextOutput": "prisme.decoding.text",
         "fit": "prisme.studies.fit"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'prisme' has no attribute {name!r}")
