"""What the model's passes hand each other: the backbone's streams, an encoded context (bank, queries, initial
workspace), a rollout's final workspace and trace, and the forward's output."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prisme.model.editor import EditInfo


@dataclass
class Streams:
    """What the workspace reads of a backbone pass: H and the source streams its bank and query terms name."""

    H: torch.Tensor  # [B, T, d] final residual stream (before the final norm)
    src: dict[str, torch.Tensor]  # {term: [B, T, d]} for every source term ("residual" is H itself)
    ids: torch.Tensor | None = None  # [B, T] the token ids of the pass (the router's n-gram match reads them)

    def index(self, rows: torch.Tensor, pos: torch.Tensor) -> Streams:
        """The streams at `[rows, pos]` (e.g. query positions `[B, P]` with rows `[B, 1]`)."""
        return Streams(self.H[rows, pos], {k: v[rows, pos] for k, v in self.src.items()},
                       None if self.ids is None else self.ids[rows, pos])

    def detach(self) -> Streams:
        return Streams(self.H.detach(), {k: v.detach() for k, v in self.src.items()}, self.ids)


@dataclass
class CopyInputs:
    """What the copy head reads of the context of Tq queries: the common-suffix lengths L `[B, Tq, Tb]` (uint8) of
    each query and context position, the token that followed each context position nxt `[B, Tb]`, and each query's
    absolute position pos `[B, Tq]`."""

    L: torch.Tensor
    nxt: torch.Tensor
    pos: torch.Tensor

    def index(self, rows: torch.Tensor, q: torch.Tensor) -> CopyInputs:
        """The inputs of queries `q` `[B, P]` (rows `[B, 1]`): their lengths and positions; the context is kept."""
        return CopyInputs(self.L[rows, q], self.nxt, self.pos[rows, q])


@dataclass
class EncodedContext:
    """Everything the workspace needs for a batch of query positions. Read-only for the editor."""

    H: torch.Tensor  # [B, Tq, d] backbone residual stream at the query positions
    K: torch.Tensor  # [B, Tb, w] source bank keys
    V: torch.Tensor  # [B, Tb, w] source bank values
    z: torch.Tensor  # [B, Tq, w] query summary
    bank_mask: torch.Tensor  # [B, Tq, Tb] bool: query t may read key j
    S0: torch.Tensor  # [B, Tq, M, w] initial workspace
    ctrl_in: torch.Tensor | None = None  # [B, Tq, d] normed stream the controller projects (cfg.controller_source)
    router_seen: torch.Tensor | None = None  # [B, Tq] bool: the query's n-gram occurred earlier (cfg.router)
    router_tok: torch.Tensor | None = None  # [B, Tq] long: the token at the query (cfg.router_token)
    copy: CopyInputs | None = None  # what the copy head reads of the queries' context (cfg.copy_head)


@dataclass
class Rollout:
    """A workspace run over every query position of a context."""

    S: torch.Tensor  # [B, Tq, M, w] final workspace
    actions: torch.Tensor  # [B, Tq, R] actions applied (STOP-absorbed)
    n_edits: torch.Tensor  # [B, Tq] non-STOP actions per position
    controller_steps: torch.Tensor  # [B, Tq] controller evaluations per position (0 for forced runs)
    infos: list[EditInfo]


@dataclass
class PrismeOutput:
    logits: torch.Tensor  # [B, T, V]
    H: torch.Tensor  # [B, T, d]
    n_edits: torch.Tensor | None = None  # [B, T]; None on the bypass path
    delta: torch.Tensor | None = None  # [B, T, d] readout correction (zero where not edited)
    actions: torch.Tensor | None = None  # [B, T, R] applied actions (policy trace or STOP-absorbed forced)
    controller_steps: torch.Tensor | None = None  # [B, T]
    ctx: EncodedContext | None = None  # with return_state
    S_final: torch.Tensor | None = None  # with return_state
    infos: list[EditInfo] | None = None  # with return_state
