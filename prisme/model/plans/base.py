"""A decode plan's interface (`DecodePlan.run`), what it reads of the decode state that calls it (`DecodeRows`), and
the bypass plan.

Notation: B rows, Q query positions per row, R steps, V vocab, d backbone width.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn

from prisme.config import PrismeConfig
from prisme.model.bank import BankCache
from prisme.model.editor import EditorRun
from prisme.model.kv_cache import KVCache
from prisme.model.outputs import CopyInputs, StepOutput, Streams
from prisme.model.policy import StepPolicy
from prisme.options import DecodeOptions


class DecodeRows(Protocol):
    """What a plan reads of the `prisme.model.state.DecodeState` that runs it."""

    model: nn.Module  # the PrismeModel
    cfg: PrismeConfig
    cache: KVCache  # the backbone's
    bank: BankCache | None
    options: DecodeOptions
    run: EditorRun  # how the state's editor runs
    static_run: EditorRun | None  # ... on fixed shapes, where its options compile one
    max_len: int
    batch_size: int

    @property
    def lengths(self) -> list[int]: ...

    def copy_inputs(self, pos: torch.Tensor, rows: torch.Tensor | None = None) -> CopyInputs | None: ...


class DecodePlan:
    """One way to run a decode call's workspace (`prisme.model.plans.choose` picks it)."""

    name = ""

    def run(self, state: DecodeRows, st: Streams, pos: torch.Tensor, valid: torch.Tensor | None,
            keep: list[int] | None, ws: StepPolicy) -> StepOutput:
        """The workspace of queries `st` (H `[B, Q, d]`, ...) at absolute positions `pos` `[B, Q]` against the state's
        bank; valid `[B, Q]` marks real queries (None: all are), keep lists the rows that have one (None: all do)."""
        raise NotImplementedError


def unedited(state: DecodeRows, H: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor | None, R: int,
             logits: torch.Tensor | None = None) -> StepOutput:
    """A step where no position edits: the model's output of H (`PrismeModel.output`: the head, and its copy head),
    bitwise, or `logits` where the caller has them, an all-STOP trace of R steps (none on the bypass)."""
    B, Q = pos.shape
    dev = H.device
    zeros = torch.zeros(B, Q, dtype=torch.long, device=dev)
    out = state.model.output(H, state.copy_inputs(pos)) if logits is None else logits
    trace = torch.full((B, Q, R), state.cfg.stop_action, dtype=torch.long, device=dev)
    return StepOutput(logits=out, actions=trace, n_edits=zeros, controller_steps=zeros, positions=pos,
                      valid=torch.ones(B, Q, dtype=torch.bool, device=dev) if valid is None else valid)


class Bypass(DecodePlan):
    """No workspace step (budget 0): the model's output of H, bitwise; an empty trace."""

    name = "bypass"

    def run(self, state, st, pos, valid, keep, ws):
        return unedited(state, st.H, pos, valid, 0)


BYPASS = Bypass()
