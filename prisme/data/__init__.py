"""Data: tokenizers (`tokenizers`), text corpora and token datasets with an on-disk cache (`text`), and the MQAR
synthetic recall task (`mqar`)."""

from __future__ import annotations

from prisme.data.mqar import MQARConfig, MQARDataset, make_mqar_batch, mqar_accuracy
from prisme.data.text import (
    EMBEDDED_CORPUS,
    EMBEDDED_CORPUS_PATH,
    EMBEDDED_TEXTS,
    HELD_OUT_TEXT,
    IGNORE_INDEX,
    TEXT_SUFFIXES,
    TokenDataset,
    load_text,
    token_cache_path,
)
from prisme.data.tokenizers import BPETokenizer, ByteTokenizer, Tokenizer, get_tokenizer

__all__ = [
    "Tokenizer", "ByteTokenizer", "BPETokenizer", "get_tokenizer", "IGNORE_INDEX", "EMBEDDED_CORPUS",
    "EMBEDDED_CORPUS_PATH", "HELD_OUT_TEXT", "EMBEDDED_TEXTS", "TEXT_SUFFIXES", "load_text", "token_cache_path",
    "TokenDataset", "MQARConfig", "make_mqar_batch", "mqar_accuracy", "MQARDataset"
]
