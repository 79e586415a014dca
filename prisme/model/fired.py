"""The deployed decode step's fired rows on fixed shapes, one graph per action group (what the "budget1" plan with a
compiled reader runs: `prisme.model.plans.budget1`).

Notation: B rows, N rows where the router fired, n of them in one action group (k slots per action), nb that count
padded, Tb the longest bank, Tp that length padded, M slots, w width, d backbone width.

At budget 1 a fired row gathers its streams, forms its query (z and S0), reads its bank, runs the editor's blocks
on its action's k slots and reads out. Eager, that is over a hundred small ATen calls per row, each a few
microseconds of dispatch at the recall and demo widths, so the step costs far more time than its ops
(docs/benchmarks.md). With a compiled editor (`ExecutionOptions(compile="auto" | "strict")` with `static_decode`:
the default of a compiled editor), the plan runs all of that for the rows of each action group as one graph
(`fired_path`, `CompiledEditor.fired`), compiled without dynamic sizes (no guard on a size, kernels called from
generated C++); only the router's decision (one host read) and adding the corrections to H stay outside:

    rows: n padded to nb = the next power of two (at most B), by repeating the group's last row;
    bank: Tb padded to Tp = the next power of two (at least `BANK_FLOOR`, at most the state's capacity), under a
          mask that hides every key past each row's length (the bank buffers are zeros there, never NaN);

one graph per (action group, nb, Tp, how the bank is read: `BankCache.read_kind`), so at most groups x log2(B) x
log2(capacity) x 2 graphs, each compiled at its first call (a few seconds on a CPU). The graph reads the state's
buffers and the bank's tables as inputs (they are data, not constants: a new decode state or new weights need no new
graph). The padded rows' outputs are dropped, and each row's numbers are those of the eager step
(`PrismeModel.query_state`, `BankCache.read`, `editor.edit_group`, `DifferentialReadout.edited`) up to the
compiler's order of summation (tests/test_fired_rows.py, float64). The read is the one the eager step takes at Tb, so
the cost model prices both plans alike; padding is time spent, never ops charged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from prisme.model.bank.read import RowRead, read_rows
from prisme.model.bank.source import SourceBank
from prisme.model.bank.tables import decoded_query
from prisme.model.editor import edit_group
from prisme.model.outputs import Streams
from prisme.model.workspace import init_workspace
from prisme.options import DecodeOptions

BANK_FLOOR = 64
"""The shortest padded bank of a fired-rows graph (fewer graphs at short contexts, where the keys cost little)."""


def bucket(n: int, floor: int, cap: int) -> int:
    """n padded to the next power of two, at least `floor`, at most `cap` (n <= cap)."""
    return min(cap, max(floor, 1 << (n - 1).bit_length()))


def key_mask(lengths: torch.Tensor, Tp: int) -> torch.Tensor:
    """`[nb, Tp]`: True where a row's key exists (position < its bank's length `lengths` `[nb]`)."""
    return torch.arange(Tp, device=lengths.device) < lengths.unsqueeze(1)


class FiredModules(NamedTuple):
    """What a fired-rows graph reads of the model (its weights are the graph's inputs, not constants)."""

    bank: SourceBank
    blocks: nn.ModuleList  # the editor's
    readout: nn.Module
    slot_embed: torch.Tensor  # [M, w]
    act_slots: torch.Tensor  # [A + 2, M] the editor's slot table
    options: DecodeOptions  # the decode state's


class StepStreams(NamedTuple):
    """A decode step's streams: H `[B, 1, d]`, the source streams by term, the token ids `[B, 1]` (or None)."""

    H: torch.Tensor
    src: dict[str, torch.Tensor]
    ids: torch.Tensor | None


def fired_pass(blocks: torch.nn.ModuleList, readout: torch.nn.Module, S0: torch.Tensor, z: torch.Tensor,
               slots: torch.Tensor, read: RowRead) -> torch.Tensor:
    """The correction `[n, d]` of rows that each take one action at step 0 with no budget left: the editor's blocks
    on slots `[n, k]` of S0 `[n, M, w]`, reading the bank through `read`, then the readout against S0 with queries z
    `[n, w]`: what the eager step computes in `editor.edit_group` and `DifferentialReadout.edited`."""
    S = edit_group(blocks, S0, slots, read, [blk.step_embedding(0, 0) for blk in blocks])
    return type(readout).edited(readout, S, S0, z)  # (the class's: a timer or counter wrapping the instance's
    #   method is Python a graph cannot hold)


def fired_path(mods: FiredModules, streams: StepStreams, rows: torch.Tensor, acts: torch.Tensor,
               lengths: torch.Tensor, kept: torch.Tensor, tabs: dict[str, torch.Tensor] | None,
               shape: tuple[int, int, str]) -> torch.Tensor:
    """The corrections `[nb, d]` of one action group's fired rows, from the step's streams to the readout: the rows'
    streams gathered, their query z and S0 (`PrismeModel.query_state`), their bank read (`BankCache.read`), the
    editor's blocks and the readout (`fired_pass`). A pure function of tensors (what `CompiledEditor.fired`
    compiles): mods, streams: the model's modules and the step's streams; rows, acts `[nb]`;
    lengths `[B]` each row's bank length; kept the cache's buffer (`BankCache.kept`), tabs its tables or None;
    shape = (slots per action k, padded bank Tp, `BankCache.read_kind`)."""
    bank, blocks, readout, slot_embed, act_slots, options = mods
    H, src, ids = streams
    k, Tp, kind = shape
    one = lambda x: x.index_select(0, rows)  # noqa: E731  [B, 1, ...] -> [nb, 1, ...]
    st = Streams(one(H), {name: one(v) for name, v in src.items()}, None if ids is None else one(ids))
    z = decoded_query(bank, options, st, tabs)[:, 0]  # [nb, w]
    read = read_rows(bank, kind, kept, rows, Tp, bank.cfg.n_ws_heads, tabs)
    read.mask = key_mask(lengths.index_select(0, rows), Tp)
    return fired_pass(blocks, readout, init_workspace(slot_embed, z), z, act_slots[acts, :k], read)
