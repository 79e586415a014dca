"""MQAR, the multi-query associative recall task: key-value pairs, then queries whose answers are the values; batches
from an explicit generator (every batch reproducible), and accuracy on the answer positions."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from prisme.data.text import IGNORE_INDEX, check_split

# ----------------------------------------------------------------------------------------------------------------------
# MQAR: multi-query associative recall (Zoology, Arora et al. 2023)
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MQARConfig:
    """Multi-query associative recall.

    Layout of one sequence of length ``seq_len`` (token 0 is the pad/filler):

    * positions ``0 .. 2*n_pairs-1``: ``n_pairs`` pairs ``k_1 v_1 k_2 v_2 ...``; keys are distinct and drawn from
      ``[1, V/2)``, values from ``[V/2, V)`` (``V/2`` = ``vocab_size // 2``);
    * after that, from position ``q0 = max(2*n_pairs, query_min_pos)``: ``n_queries`` (default ``n_pairs``) queries
      of distinct context keys, each occupying two positions ``p, p+1``: the key at ``p``, and at ``p+1`` filler (the
      default, as in Zoology) or, with ``echo_value=True``, the value itself; ``p = q0 + 2*s`` for a slot ``s`` in
      ``[0, (seq_len - q0) // 2)``. Slots are sampled without replacement with probability ``∝ (s+1)^(power_a - 1)``
      exactly as Zoology does (small ``power_a`` → most queries close to the context, a long tail far away);
    * everything else is filler: 0 by default, or (``random_filler=True``) uniform random keys from ``[1, V/2)``.

    Labels: ``y[p] = value`` at each query key position ``p``, ``IGNORE_INDEX`` everywhere else (the pair section too).

    Why filler after the query: with the echo, every answered value is visible to later queries, and a model with no
    recall at all scores about half the queries by guessing among the values not yet answered (chance 1/N, 1/(N-1),
    ..., 1 by query order). Without it a model that cannot look a key up sits at ~1/N.
    """

    vocab_size: int = 64
    seq_len: int = 32
    n_pairs: int = 4
    query_min_pos: int = 8
    power_a: float = 0.01
    n_queries: int | None = None
    random_filler: bool = False
    echo_value: bool = False  # True: x[p+1] is the queried value (a key -> value stream; leaks answers, see above)

    @property
    def key_range(self) -> tuple[int, int]:
        """Half-open range of key ids."""
        return 1, self.vocab_size // 2

    @property
    def value_range(self) -> tuple[int, int]:
        """Half-open range of value ids."""
        return self.vocab_size // 2, self.vocab_size

    @property
    def query_start(self) -> int:
        return max(2 * self.n_pairs, self.query_min_pos)

    @property
    def n_query_slots(self) -> int:
        return max(0, (self.seq_len - self.query_start) // 2)

    @property
    def num_queries(self) -> int:
        return self.n_pairs if self.n_queries is None else self.n_queries

    def validate(self) -> None:
        """Raise ``ValueError`` if the layout does not fit."""
        k_lo, k_hi = self.key_range
        v_lo, v_hi = self.value_range
        from prisme.checks import check_fields

        check_fields(self, "MQARConfig.")
        if self.n_pairs < 1:
            raise ValueError(f"n_pairs must be >= 1, got {self.n_pairs}")
        if k_hi - k_lo < self.n_pairs or v_hi - v_lo < self.n_pairs:
            raise ValueError(
                f"vocab_size={self.vocab_size} too small for {self.n_pairs} distinct keys in [1, {k_hi}) "
                f"and values in [{v_lo}, {v_hi})"
            )
        if not 1 <= self.num_queries <= self.n_pairs:
            raise ValueError(f"n_queries must be in [1, n_pairs={self.n_pairs}], got {self.num_queries}")
        if self.n_query_slots < self.num_queries:
            raise ValueError(
                f"seq_len={self.seq_len} too short: {self.num_queries} queries need {2 * self.num_queries} positions "
                f"after position {self.query_start}"
            )
        if self.power_a <= 0:
            raise ValueError(f"power_a must be > 0, got {self.power_a}")


def _sample_distinct(lo: int, hi: int, k: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """``[B, k]`` distinct ints from ``[lo, hi)`` per row, uniformly."""
    return torch.rand(batch_size, hi - lo, generator=generator).argsort(dim=1)[:, :k] + lo


def make_mqar_batch(cfg: MQARConfig, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One MQAR batch (layout in ``MQARConfig``): ``x`` ``[B, T]`` long, ``y`` ``[B, T]`` long with -100 = ignore."""
    cfg.validate()
    B, T, N, Q = batch_size, cfg.seq_len, cfg.n_pairs, cfg.num_queries
    keys = _sample_distinct(*cfg.key_range, N, B, generator)  # [B, N]
    values = _sample_distinct(*cfg.value_range, N, B, generator)  # [B, N]

    if cfg.random_filler:
        x = torch.randint(cfg.key_range[0], cfg.key_range[1], (B, T), generator=generator)  # [B, T]
    else:
        x = torch.zeros(B, T, dtype=torch.long)  # [B, T]
    y = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)  # [B, T]
    x[:, 0 : 2 * N : 2] = keys
    x[:, 1 : 2 * N : 2] = values

    S = cfg.n_query_slots
    slot_w = torch.arange(1, S + 1, dtype=torch.float64) ** (cfg.power_a - 1.0)  # [S]
    slots = torch.multinomial(slot_w.expand(B, S), Q, replacement=False, generator=generator)  # [B, Q]
    pos = cfg.query_start + 2 * slots  # [B, Q]
    which = _sample_distinct(0, N, Q, B, generator)  # [B, Q] index of the queried pair
    q_keys = keys.gather(1, which)  # [B, Q]
    q_vals = values.gather(1, which)  # [B, Q]
    x.scatter_(1, pos, q_keys)
    if cfg.echo_value:
        x.scatter_(1, pos + 1, q_vals)
    y.scatter_(1, pos, q_vals)
    return x, y


def mqar_accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of labelled positions (``y != -100``) where ``argmax(logits)`` equals ``y``.

    ``logits`` ``[B, T, V]``, ``y`` ``[B, T]``.
    """
    mask = y != IGNORE_INDEX  # [B, T]
    n = int(mask.sum())
    if n == 0:
        raise ValueError("mqar_accuracy: no labelled positions (all labels are -100)")
    pred = logits.argmax(dim=-1)  # [B, T]
    return float((pred[mask] == y[mask]).sum()) / n


class MQARDataset:
    """MQAR with the ``TokenDataset`` batch interface.

    ``batch("train", ...)`` draws from the caller's generator; ``batch("val", ...)`` ignores it and always uses a
    generator seeded with ``val_seed`` (so validation batches are fixed). ``iter_eval`` yields ``n_eval_batches``
    (or ``max_batches``) batches from a fixed seed per split. A ``seq_len`` different from ``cfg.seq_len`` is applied
    to the config for that call.
    """

    def __init__(
        self,
        cfg: MQARConfig | None = None,
        val_seed: int = 12345,
        train_eval_seed: int = 54321,
        n_eval_batches: int = 8,
    ) -> None:
        self.cfg = cfg if cfg is not None else MQARConfig()
        self.cfg.validate()
        self.val_seed = val_seed
        self.train_eval_seed = train_eval_seed
        self.n_eval_batches = n_eval_batches

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def _cfg_for(self, seq_len: int | None) -> MQARConfig:
        if seq_len is None or seq_len == self.cfg.seq_len:
            return self.cfg
        return replace(self.cfg, seq_len=seq_len)

    def batch(
        self, split: str, batch_size: int, seq_len: int | None, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` ``[B, T]``; fixed for ``split="val"``, drawn from ``generator`` for ``"train"``."""
        if check_split(split) == "val":
            generator = torch.Generator().manual_seed(self.val_seed)
        elif generator is None:
            raise ValueError("MQARDataset.batch('train', ...) needs a torch.Generator")
        return make_mqar_batch(self._cfg_for(seq_len), batch_size, generator)

    def iter_eval(
        self, split: str, batch_size: int, seq_len: int | None = None, max_batches: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic evaluation batches ``(x, y)`` ``[B, T]`` from a fixed per-split seed."""
        seed = self.val_seed if check_split(split) == "val" else self.train_eval_seed
        g = torch.Generator().manual_seed(seed)
        cfg = self._cfg_for(seq_len)
        n = self.n_eval_batches if max_batches is None else max_batches
        for _ in range(n):
            yield make_mqar_batch(cfg, batch_size, g)

    def __repr__(self) -> str:
        return f"MQARDataset({self.cfg})"
