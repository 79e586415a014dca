"""The budget-1 plan: a router model's deployed policy, one query per row. The router decides (`routed.router_scores`);
each row that fired edits with its best action at step 0 with no budget left, then reads out: what `rollout_policy`
(its step 0 taken) and `logits_from_state` compute for it, in few calls. The fired rows are gathered per action group
and edited through a per-row bank reader (`prisme.model.bank.read`: `BankCache.read`), eagerly (`editor.edit_group`)
or, with a compiled editor, on its fixed-shape graphs (`CompiledEditor.fired`: `prisme.model.fired`).

Notation: B rows, N rows where the router fired (n of one action group), Tb the longest bank, M slots, w width, d
backbone width, A actions.
"""

from __future__ import annotations

from typing import Any

import torch

from prisme.model.bank.tables import bank_tables
from prisme.model.editor import edit_group
from prisme.model.fired import BANK_FLOOR, FiredModules, StepStreams, bucket
from prisme.model.outputs import StepOutput, Streams
from prisme.model.plans.base import DecodePlan, DecodeRows
from prisme.model.plans.routed import output_of, router_scores


def fired_groups(scores: torch.Tensor, group_of: list[int]) -> list[tuple[int, list[int], list[int]]]:
    """(action group, its rows, their actions) for each group of the actions the router fired with, in a step with
    one query per row (`scores` `[B, 1, A]`; a row fires iff its best score is > 0, with the first best action;
    `group_of`: each action's group, on the host): one host read of the best scores, and one of the actions where
    some row fired."""
    S = scores.view(scores.shape[0], -1)  # [B, A]
    rows = [r for r, v in enumerate(S.amax(-1).tolist()) if v > 0]
    if not rows:
        return []
    acts = S.argmax(-1).tolist()
    by: dict[int, tuple[list[int], list[int]]] = {}
    for r in rows:
        rs, a = by.setdefault(group_of[acts[r]], ([], []))
        rs.append(r)
        a.append(acts[r])
    return [(g, rs, a) for g, (rs, a) in sorted(by.items())]


def eager_deltas(state: DecodeRows, st: Streams, b: torch.Tensor, a: torch.Tensor,
                 spans: list[tuple[int, int, int]], rows: list[int]) -> torch.Tensor:
    """The corrections `[N, d]` of the fired rows b `[N]` (`rows` on the host) with actions a `[N]` (sorted by action
    group; spans: (group, first, end) of each), eagerly: their query state, their bank read, the editor per group,
    the readout."""
    model = state.model
    editor = model.editor
    one = lambda x: x.index_select(0, b)  # noqa: E731  [B, 1, ...] -> [N, 1, ...]
    st_n = Streams(one(st.H), {k: one(v) for k, v in st.src.items()}, None if st.ids is None else one(st.ids))
    lengths = state.lengths
    Tb = max(lengths)
    read = state.bank.read(Tb, b, model.cfg.n_ws_heads)  # an EntryRead ([N, Tb, w] K and V), or an IdRead
    z, S0 = model.query_state(st_n, state.options)  # [N, 1, w], [N, 1, M, w]
    mask = None if all(lengths[r] == Tb for r in rows) else (  # None: each reads its whole bank
        torch.arange(Tb, device=b.device) < state.cache.lengths_tensor(b.device)[b].unsqueeze(1))  # [N, Tb]
    e = [blk.step_embedding(0, 0) for blk in editor.blocks]  # [w] per block, shared by the rows
    S = S0[:, 0]
    parts = []
    for g_id, i, j in spans:
        slots = editor.act_slots[a[i:j], :editor.group_sizes[g_id]]  # [n, k]
        parts.append(edit_group(editor.blocks, S[i:j], slots, read.rows(i, j, None if mask is None else mask[i:j]),
                                e))
    S = parts[0] if len(parts) == 1 else torch.cat(parts)  # [N, M, w]
    return model.readout.edited(S, S0[:, 0], z[:, 0])  # [N, d]


def compiled_deltas(state: DecodeRows, st: Streams, b: torch.Tensor, a: torch.Tensor,
                    spans: list[tuple[int, int, int]], compiled: Any) -> torch.Tensor:
    """`eager_deltas` on the compiled editor's fixed-shape graphs (`prisme.model.fired`): per action group its rows
    padded to a power of two, the bank to a power of two under a mask."""
    model = state.model
    editor = model.editor
    cache = state.bank
    Tb = max(state.lengths)
    Tp = bucket(Tb, BANK_FLOOR, state.max_len)
    kind = cache.read_kind(Tb)
    tabs = bank_tables(model.bank) if state.options.table_terms else None
    mods = FiredModules(model.bank, editor.blocks, model.readout, model._parameters["slot_embed"], editor.act_slots,
                        state.options)
    streams = StepStreams(st.H, st.src, st.ids)
    lengths = state.cache.lengths_tensor(b.device)
    out = []
    for g, i, j in spans:
        n = j - i
        nb = bucket(n, 1, state.batch_size)
        loc = torch.arange(i, i + nb, device=b.device).clamp_(max=j - 1) if nb > n else slice(i, j)  # [nb]: the
        #   group's rows, its last repeated as padding
        delta = compiled.fired(g, nb, Tp, kind, mods, streams, b[loc], a[loc], lengths, cache.kept, tabs,
                               (editor.group_sizes[g], Tp, kind))
        out.append(delta[:n])
    return out[0] if len(out) == 1 else torch.cat(out)


class Budget1(DecodePlan):
    """The deployed step (module docstring); `compiled`: the compiled editor whose fixed-shape graphs edit the fired
    rows (None: the eager reader)."""

    name = "budget1"

    def __init__(self, compiled: Any = None):
        self.compiled = compiled

    def run(self, state, st, pos, valid, keep, ws):
        model, cfg = state.model, state.cfg
        H = st.H
        B, Q = pos.shape
        dev = H.device
        h = model.backbone.final_norm(H)  # [B, 1, d]: the head's input, which the router's decision reads too
        scores, _, _ = router_scores(state, st, pos, valid, ws, h)
        trace = torch.full((B, Q, 1), cfg.stop_action, dtype=torch.long, device=dev)
        n_edits = torch.zeros(B, Q, dtype=torch.long, device=dev)
        valid_t = torch.ones(B, Q, dtype=torch.bool, device=dev) if valid is None else valid
        groups = fired_groups(scores, model.editor.group_of)
        if not groups:
            return StepOutput(logits=output_of(state, H, h, pos, False), actions=trace, n_edits=n_edits,
                              controller_steps=n_edits, positions=pos, valid=valid_t)
        rows = [r for _, rs, _ in groups for r in rs]
        b, a = torch.tensor([rows, [x for _, _, acts in groups for x in acts]], dtype=torch.long,
                            device=dev)  # [N] each: the rows sorted by action group, their actions
        spans, at = [], 0
        for g, rs, _ in groups:
            spans.append((g, at, at + len(rs)))
            at += len(rs)
        delta = (eager_deltas(state, st, b, a, spans, rows) if self.compiled is None else
                 compiled_deltas(state, st, b, a, spans, self.compiled)).to(H.dtype)  # [N, d]
        H_edit = H.index_add(0, b, delta.unsqueeze(1))
        return StepOutput(logits=output_of(state, H_edit, h, pos, True),
                          actions=trace.index_copy(0, b, a.view(-1, 1, 1)), n_edits=n_edits.index_fill(0, b, 1),
                          controller_steps=torch.zeros_like(n_edits), positions=pos, valid=valid_t)
