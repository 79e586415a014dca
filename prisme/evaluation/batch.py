"""One evaluation batch, encoded once and shared by every row, what a row returns from it (`Outcome`), and the
scorers that say where rows are scored.

Notation: B batch, T positions, V vocab, Q scored (query) positions per sequence, n actions per position.

Scorers:
  * `NextTokenLoss` (text): every labelled target is scored; forced edits run at every position; the random rows'
    common random numbers restart from `seed + batch index` on every batch.
  * `QueryAccuracy` (MQAR, "query-positions mode"): the labelled targets are the queries (every sequence has the
    same number); forced edits run at the query positions only (a position's workspace reads the bank and its own
    slots, never another position's, so edits elsewhere cannot change a query's logits) and their trace is charged
    at every position all the same; each random row draws from its own stream seeded `seed`, across batches.
Both report loss and accuracy on the scored targets; the controller always decides at every position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from prisme.data.text import IGNORE_INDEX
from prisme.evaluation.actions import sample_positions
from prisme.model.policy import StepPolicy
from prisme.model.rollout import rollout_forced


@dataclass
class Outcome:
    """What one row predicted on one batch and the trace it pays for.

    logits: `[B, T, V]` at every position, or `[B', P, V]` at `at` = (rows `[B', 1]` or `[B']`, positions `[B', P]`).
    actions `[N, R]` / contexts `[N]` / steps `[N]`: the priced trace (contexts default: every position, t + 1).
    base_ce: the backbone's CE at `at` when the row computed it itself (the oracle).
    """

    logits: torch.Tensor
    at: tuple[torch.Tensor, torch.Tensor] | None = None
    actions: torch.Tensor | None = None
    contexts: torch.Tensor | None = None
    steps: torch.Tensor | None = None
    base_ce: torch.Tensor | None = None
    routed: bool = False  # the router decided step 0 of this trace
    mean_edits: float | None = None  # edits per position (the controller's; its equal-edits baseline reads it)


class NextTokenLoss:
    """Score every labelled target; forced edits at every position."""

    name = "next-token loss"
    at_queries = False

    def generator(self, batch: Batch, row_name: str) -> torch.Generator:
        """The random numbers of the row named `row_name` on `batch`."""
        return torch.Generator().manual_seed(batch.seed + batch.index)  # common random numbers: each row alike


class QueryAccuracy(NextTokenLoss):
    """Score the query positions (the labelled targets); forced edits run there only."""

    name = "query accuracy"
    at_queries = True

    def generator(self, batch: Batch, row_name: str) -> torch.Generator:
        streams = batch.shared.setdefault("random_streams", {})
        if row_name not in streams:  # one stream per row over the whole evaluation, each from the same seed
            streams[row_name] = torch.Generator().manual_seed(batch.seed)
        return streams[row_name]


def query_positions(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows `[B, 1]`, query positions `[B, Q]`) of the labelled targets `y` `[B, T]`, in order; ValueError unless
    every row has the same number of them (MQAR)."""
    lab = y != IGNORE_INDEX
    counts = lab.sum(1)
    if bool((counts != counts[0]).any()) or int(counts[0]) == 0:
        raise ValueError("query accuracy needs the same number (>= 1) of labelled targets in every sequence")
    Q = int(counts[0])
    pos = torch.argsort((~lab).to(torch.int8), dim=1, stable=True)[:, :Q]
    return torch.arange(y.shape[0], device=y.device).unsqueeze(1), pos


class Batch:
    """`x`, `y` `[B, T]` and what every row of this batch shares, computed on first use: the source streams, the
    teacher-forced encoding `ctx` (H and the bank), the backbone's logits and CE, the encoding at the query
    positions, the oracle's positions, the controller rows' mean edits."""

    def __init__(self, model: Any, x: torch.Tensor, y: torch.Tensor, index: int, seed: int, scorer: NextTokenLoss,
                 shared: dict[str, Any]):
        self.model, self.x, self.y, self.index, self.seed, self.scorer = model, x, y, index, seed, scorer
        self.shared = shared  # state that lives across batches (the oracle's generator, random streams)
        self.mean_edits: dict[str, float] = {}  # controller row -> its mean edits per position on this batch
        self._memo: dict[Any, Any] = {}

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    @property
    def streams(self):
        return self.memo("streams", lambda: self.model.streams(self.x))

    @property
    def ctx(self):
        """`model.encode(x)`: every position's encoding, shared by the rows that edit at every position."""
        return self.memo("ctx", lambda: self.model.context_from_H(self.streams, self.streams))

    @property
    def H(self) -> torch.Tensor:
        if "ctx" in self._memo:
            return self.ctx.H
        return self.streams.H if self.model.cfg.use_workspace else self.memo("H", lambda: self.model.backbone(self.x))

    @property
    def base_logits(self) -> torch.Tensor:
        """The backbone alone `[B, T, V]`: every row's baseline."""
        return self.memo("base_logits", lambda: self.model.output(self.H, self.copy_in))

    @property
    def copy_in(self):
        """What the model's copy head reads of every position (None without one, `cfg.copy_head`)."""
        if "ctx" in self._memo:
            return self.ctx.copy
        return self.memo("copy_in", lambda: self.model.copy_inputs(self.x))

    def queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.memo("queries", lambda: query_positions(self.y))

    def query_ctx(self):
        """The encoding of the query positions only (the bank over every position)."""
        def make():
            rows, pos = self.queries()
            return self.model.context_from_H(self.streams, self.streams.index(rows, pos), query_pos=pos)
        return self.memo("query_ctx", make)

    def oracle_positions(self, n: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows `[B']`, positions `[B', P]`): `n` sampled labelled positions per sequence, the same for every oracle
        row of this batch (one generator, seeded `seed`, over the evaluation)."""
        g = self.shared.setdefault("oracle_generator", torch.Generator().manual_seed(self.seed))
        return self.memo(("oracle_positions", n), lambda: sample_positions(self.y, n, g))

    def run_forced(self, row_name: str,
                   actions: Callable[[tuple[int, int], torch.Generator], torch.Tensor]) -> Outcome:
        """The forced row named `row_name`: `actions(shape, generator)` `[.., n]` at the positions the scorer edits,
        drawn from the scorer's random numbers for that row."""
        model, g = self.model, self.scorer.generator(self, row_name)
        B, T = self.x.shape
        if not self.scorer.at_queries:
            acts = actions((B, T), g).to(device=self.x.device, dtype=torch.long).contiguous()
            out = model(self.x, acts, ctx=self.ctx)
            return Outcome(out.logits, actions=out.actions)
        rows, pos = self.queries()
        ctx = self.query_ctx()
        acts = actions(tuple(pos.shape), g).to(device=self.x.device, dtype=torch.long).contiguous()  # [B, Q, n]
        roll = rollout_forced(model, ctx, StepPolicy(actions=acts))
        logits, _ = model.logits_from_state(roll.S, ctx, roll.n_edits > 0)
        every = actions((B, T), torch.Generator().manual_seed(0))  # the trace it is charged: every position alike
        return Outcome(logits, at=(rows, pos), actions=every)
