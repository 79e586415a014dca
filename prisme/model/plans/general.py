"""The general plan (forced actions, a controller without a router) and the static one (the same on a compiled
editor's fixed shapes): the model's own pipeline (`PrismeModel.run_workspace`) over the rows that have a new position,
reading the state's bank.

Notation: B rows, b rows with a new position, Q query positions per row, Tb bank positions read, R steps.
"""

from __future__ import annotations

import torch

from prisme.model.editor import EditorRun
from prisme.model.outputs import StepOutput, Streams
from prisme.model.plans.base import DecodePlan, unedited


class General(DecodePlan):
    """`rollout_*` over the kept rows with `run` (`capacity`: the bank read at the state's capacity, the mask hiding
    every key past a row's length: the "static" plan, fixed shapes for a compiled editor's graphs)."""

    def __init__(self, run: EditorRun, capacity: bool = False):
        self.editor_run, self.capacity = run, capacity
        self.name = "static" if capacity else "general"

    def run(self, state, st, pos, valid, keep, ws):
        model = state.model
        H = st.H
        B, Q = pos.shape
        dev = H.device
        R = ws.n_steps
        if keep is not None and len(keep) == 0:  # no row has a new position
            return unedited(state, H, pos, valid, R)
        lengths = state.lengths
        Tb = state.max_len if self.capacity else max(lengths) if keep is None else max(lengths[b] for b in keep)
        rows = None if keep is None or len(keep) == B else torch.tensor(keep, dtype=torch.long, device=dev)
        sub = (lambda x: x) if rows is None else (lambda x: x[rows])
        st_q = st if rows is None else Streams(H[rows], {k: v[rows] for k, v in st.src.items()},
                                               None if st.ids is None else st.ids[rows])
        pos_q = sub(pos)
        bank_len = sub(state.cache.lengths_tensor(dev))  # [b]
        K, V = state.bank.view(Tb, rows)  # [b, Tb, w] each
        mask = model.bank_mask(st_q.H.shape[0], Q, Tb, pos_q, bank_len, dev)  # [b, Q, Tb]
        ids = state.bank.ids
        ids_q = None if ids is None else sub(ids.narrow(1, 0, Tb))  # [b, Tb]
        router_in = (None, None) if ids_q is None else model.router_inputs(ids_q, pos_q)
        ctx = model.context(st_q, K, V, mask, model.query_state(st_q, state.options), router_in)
        ctx.copy = state.copy_inputs(pos_q, rows)
        logits, _, roll = model.run_workspace(ctx, ws.rows(rows) if rows is not None else ws,
                                              None if valid is None else sub(valid), self.editor_run)  # [b, Q, V]
        trace, n_edits, steps = roll.actions, roll.n_edits, roll.controller_steps
        if rows is not None:  # rows without a new position: their padding's unedited output
            full = unedited(state, H, pos, valid, R)
            return StepOutput(logits=full.logits.index_copy(0, rows, logits),
                              actions=full.actions.index_copy(0, rows, trace),
                              n_edits=full.n_edits.index_copy(0, rows, n_edits),
                              controller_steps=full.controller_steps.index_copy(0, rows, steps), positions=pos,
                              valid=full.valid)
        return StepOutput(logits=logits, actions=trace, n_edits=n_edits, controller_steps=steps, positions=pos,
                          valid=torch.ones(B, Q, dtype=torch.bool, device=dev) if valid is None else valid)
