"""PRISME: language models with an adaptive, sparse, per-token workspace."""

from .config import PRESETS, PrismeConfig

__all__ = ["PRESETS", "PrismeConfig"]
__version__ = "0.1.0"
