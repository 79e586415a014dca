"""The text study's texts: the training corpus (`--corpus`, its train / validation split) and the held-out text
(`--held-out`), each chosen by name, file or folder (`data.corpora.resolve_corpus`), read as bytes; the checks that
they hold what the study scores before anything trains, and what the study's document records of them."""

from __future__ import annotations

import sys
from typing import Any

from prisme.data.corpora import resolve_corpus
from prisme.data.text import TokenDataset
from prisme.data.tokenizers import ByteTokenizer
from prisme.studies.text_setup import TextStudyConfig
from prisme.training.config import StageConfig

VAL_FRACTION = 0.1  # the validation split's share of a contiguous corpus (one split by whole files keeps its own)


def training_data(corpus: str) -> TokenDataset:
    """The corpus the study trains on, with its validation split: Austen's is the tail 10 % of its bytes, a code
    corpus's the files `corpora.split_documents` holds out (the texts are read once per process: `load_text` and the
    packed corpora keep them)."""
    return resolve_corpus(corpus).dataset(ByteTokenizer(), val_fraction=VAL_FRACTION)


def held_out_data(held_out: str, seq_len: int) -> TokenDataset:
    """The held-out text, all of it in the "val" split, in windows of `seq_len`."""
    return resolve_corpus(held_out).held_out(seq_len, ByteTokenizer())


def held_out_bytes(held_out: str) -> int:
    """The held-out text's length in bytes (tokens of a prepared folder); a missing or empty text is a ValueError."""
    c = resolve_corpus(held_out)
    if c.kind == "prepared":
        return held_out_data(held_out, 1).n_tokens("val")
    return len(c.text().encode("utf-8"))


def corpus_records(cfg: TextStudyConfig) -> dict[str, Any]:
    """What the document records of its texts (`Corpus.record`: name, kind, licence, split rule, bytes, sha256)."""
    return {"train": resolve_corpus(cfg.corpus).record(), "held_out": resolve_corpus(cfg.held_out).record()}


def check_inputs(cfg: TextStudyConfig, stages: dict[str, StageConfig]) -> None:
    """Every text the study reads, before anything trains: the held-out text exists and holds at least one evaluation
    window (+ 1 target); the corpus's training and validation splits each hold one window, and the validation split
    the `val_batches` asked for; a ValueError naming the option."""
    T = cfg.eval_window or stages["workspace"].seq_len
    shorter = "--context" if cfg.context is not None else "--window"
    n = held_out_bytes(cfg.held_out)
    if n < T + 1:
        raise ValueError(f"text study: --held-out {cfg.held_out} holds {n:,} bytes, fewer than one evaluation window "
                         f"of {T:,} bytes + 1 target: pass a longer text, or a shorter {shorter}")
    train, held = corpus_records(cfg).values()
    if cfg.held_out == cfg.corpus or train.get("sha256") is not None and train.get("sha256") == held.get("sha256"):
        print(f"note: --held-out {cfg.held_out} is the training text (--corpus {cfg.corpus}): its scores are not held "
              f"out (the model trained on most of it); pass another text to --held-out", file=sys.stderr)
    data = training_data(cfg.corpus)
    n_train, n_val = data.n_tokens("train"), data.n_tokens("val")
    if min(n_train, n_val) < T + 1:
        raise ValueError(f"text study: --corpus {cfg.corpus}: its training split holds {n_train:,} bytes and its "
                         f"validation split {n_val:,}; each needs one window of {T:,} bytes + 1 target: pass a longer "
                         f"corpus, or a shorter {shorter}")
    batch = cfg.context_eval_batch_size if cfg.context is not None else cfg.eval_batch_size
    have = -(-data.n_eval_windows("val", T) // batch)
    if cfg.val_batches is not None and cfg.val_batches > have:
        raise ValueError(f"text study: --val-batches {cfg.val_batches} is more than the validation split holds "
                         f"({have} batches of {batch} x {T} bytes): pass --val-batches {have} or less, or all")


def stage_bytes(stages: dict[str, Any]) -> dict[str, int]:
    """Each run's training bytes (steps x batch x length) from one seed's stage configs (as dicts or configs)."""
    get = lambda s, k: s[k] if isinstance(s, dict) else getattr(s, k)  # noqa: E731
    return {k: get(s, "steps") * get(s, "batch_size") * get(s, "seq_len") for k, s in stages.items()}
