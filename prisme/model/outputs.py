"""What the model's passes hand each other: the backbone's streams, an encoded context (bank, queries, initial
workspace, the copy head's inputs), an edit's record and slot K/V cache, a rollout's final workspace and trace, the
forward's output and a decode step's."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SlotKV:
    """Per-block slot keys/values `[B, Tq, M, 2w]` of the current workspace, and which positions have them."""

    kv: list[torch.Tensor]
    ready: torch.Tensor  # [B, Tq] bool

    @classmethod
    def empty(cls, S: torch.Tensor, n_blocks: int) -> SlotKV:
        B, Tq, M, w = S.shape
        kv = [S.new_zeros(B, Tq, M, 2 * w) for _ in range(n_blocks)]
        return cls(kv=kv, ready=torch.zeros(B, Tq, dtype=torch.bool, device=S.device))


@dataclass
class EditInfo:
    """What one editor call did: how many positions it edited, and each block's gate values."""

    n_positions: int
    gates: list[list[torch.Tensor]]  # per block: gate values of each action group
    slot_kv: SlotKV | None = None

    @property
    def gate_mean(self) -> list[torch.Tensor]:
        """Per block, the mean gate over every edited slot (empty when nothing was edited)."""
        return [torch.cat([g.flatten() for g in gs]).mean() for gs in self.gates if gs]


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


@dataclass
class StepOutput:
    """What one `DecodeState.decode_step` (or `prefill`) computed for its Q query positions per row."""

    logits: torch.Tensor | None  # [B, Q, V]; None for prefill(logits="none")
    actions: torch.Tensor  # [B, Q, R] applied actions, STOP-absorbed (STOP at padding); R = 0 on the bypass
    n_edits: torch.Tensor  # [B, Q] non-STOP actions per position
    controller_steps: torch.Tensor  # [B, Q] controller evaluations per position (0 for forced actions)
    positions: torch.Tensor  # [B, Q] absolute position of each query (its context is position + 1)
    valid: torch.Tensor  # [B, Q] bool: real positions (False at right padding)
