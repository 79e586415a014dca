"""The deployed decode step's fired rows on fixed shapes: `routed.budget1_step` with a compiled editor.

Notation: B rows, N rows where the router fired, n of them in one action group (k slots per action), nb that count
padded, Tb the longest bank, Tp that length padded, M slots, w width, d backbone width.

At budget 1 a fired row runs the editor's blocks on its action's k slots against its bank, then the readout. Eager,
that is over a hundred small ATen calls per row, each a few microseconds of dispatch at the recall and demo widths,
so the step costs far more time than its ops (docs/benchmarks.md). With the model's editor compiled
(`ExecutionOptions(compile="auto" | "strict")`, `static_decode`: the default of a compiled editor), `fired_deltas`
runs the rows of each action group as one graph, the editor's blocks and the readout together, compiled without
dynamic sizes (no guard on a size, kernels called from generated C++):

    rows: n padded to nb = the next power of two (at most B), by repeating the group's last row;
    bank: Tb padded to Tp = the next power of two (at least `BANK_FLOOR`, at most the state's capacity), under a
          mask that hides every key past each row's length (the bank buffers are zeros there, never NaN);

one graph per (action group, nb, Tp, how the bank is read: entries or ids through the tables), so at most
groups x log2(B) x log2(capacity) graphs, each compiled at its first call (a few seconds on a CPU). The padded
rows' outputs are dropped, and each row's numbers are those of the eager `SparseEditor.edit_rows` and
`DifferentialReadout.edited` up to the compiler's order of summation (tests/test_fired_rows.py, float64). The
read is the one the eager step takes at Tb (`BankCache.read`'s `context`), so the cost model prices both plans alike;
padding is time spent, never ops charged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from prisme.model.editor import blocks_pass
from prisme.model.outputs import Streams
from prisme.model.policy import DecodeRows

BANK_FLOOR = 64
"""The shortest padded bank of a fired-rows graph (fewer graphs at short contexts, where the keys cost little)."""


def bucket(n: int, floor: int, cap: int) -> int:
    """n padded to the next power of two, at least `floor`, at most `cap` (n <= cap)."""
    return min(cap, max(floor, 1 << (n - 1).bit_length()))


def key_mask(lengths: torch.Tensor, Tp: int) -> torch.Tensor:
    """`[nb, Tp]`: True where a row's key exists (position < its bank's length `lengths` `[nb]`)."""
    return torch.arange(Tp, device=lengths.device) < lengths.unsqueeze(1)


class _Read:
    """A bank read inside a graph: `attend(q)` is `fn(q, *parts)` (`EntryRead.parts`, `IdRead.parts`)."""

    def __init__(self, fn: Callable[..., torch.Tensor], parts: tuple[Any, ...]):
        self.fn, self.parts = fn, parts

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        return self.fn(q, *self.parts)


def fired_pass(blocks: torch.nn.ModuleList, readout: torch.nn.Module, S0: torch.Tensor, z: torch.Tensor,
               slots: torch.Tensor, attend: Callable[..., torch.Tensor], parts: tuple[Any, ...]) -> torch.Tensor:
    """The correction `[n, d]` of rows that each take one action at step 0 with no budget left: the editor's blocks
    on slots `[n, k]` of S0 `[n, M, w]`, reading the bank through `attend(q, *parts)`, then the readout against S0
    with queries z `[n, w]`. A pure function of tensors (what `CompiledEditor.fired` compiles); the eager step computes
    the same in `SparseEditor.edit_rows` and `DifferentialReadout.edited`."""
    rows = torch.arange(S0.shape[0], device=S0.device).unsqueeze(1)  # [n, 1]
    e = [blk.step_embedding(0, 0) for blk in blocks]
    x, _ = blocks_pass(blocks, S0[rows, slots], None, None, S0, slots, _Read(attend, parts), e)
    S = S0.index_put((rows, slots), x.to(S0.dtype))
    return type(readout).edited(readout, S, S0, z)  # (the class's: a timer or counter wrapping the instance's
    #   method is Python a graph cannot hold)


def fired_deltas(state: DecodeRows, st_n: Streams, b: torch.Tensor, a: torch.Tensor,
                 spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """The corrections `[N, d]` of a decode step's fired rows (`st_n`: their streams `[N, 1, ...]`; b `[N]` their
    rows, a `[N]` their actions, sorted by action group; spans: (group, first, end) of each group), each group's rows
    on the compiled editor's fixed-shape graphs (module docstring)."""
    model = state.model
    editor = model.editor
    z, S0 = model.query_state(st_n, state.options)  # [N, 1, w], [N, 1, M, w]
    Tb = max(state.lengths)
    Tp = bucket(Tb, BANK_FLOOR, state.max_len)
    lengths = state.cache.lengths_tensor(b.device)
    out = []
    for g, i, j in spans:
        n = j - i
        nb = bucket(n, 1, state.batch_size)
        loc = torch.arange(i, i + nb, device=b.device).clamp_(max=j - 1) if nb > n else torch.arange(
            i, j, device=b.device)  # [nb]: the group's rows, its last repeated as padding
        rows = b.index_select(0, loc)
        read = state.bank.read(Tp, rows, model.cfg.n_ws_heads, context=Tb)
        read.mask = key_mask(lengths.index_select(0, rows), Tp)
        fn, parts = read.parts()
        slots = editor.act_slots[a.index_select(0, loc), :editor.group_sizes[g]]  # [nb, k]
        delta = editor.compiled.fired((g, nb, Tp, fn.__name__), (editor.blocks, model.readout, S0[:, 0][loc],
                                                                 z[:, 0][loc], slots, fn, parts))
        out.append(delta[:n])
    return out[0] if len(out) == 1 else torch.cat(out)
