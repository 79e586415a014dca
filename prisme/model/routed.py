"""The decode step of a routed policy (`cfg.router`): the router decides first, the workspace runs where it fired.

Notation: B rows, Q query positions per row, N positions where the router fired, Tb bank positions, R steps.

`DecodeState` calls `routed_workspace` for every controller policy of a router model (not for forced actions, nor
for a compiled editor's fixed-shape decode of a budget over 1). Per step it computes, at every position, only what
the decision reads: the router's scores on norm(H) and its n-gram feature at the policy's price (`Router.scores`,
reading the backbone's final norm of H, which the logits need anyway), and one host read of their best (the decision
is data: the work that follows has that shape). A step where no position fires returns the backbone's logits,
`head(H)` bitwise, and an all-STOP trace: no query state, bank gather, mask, editor or readout. Where some fire,
their N positions are gathered as N rows of one query each (their bank rows, their mask where a row's bank is
shorter than the longest, their query state) and edited: at budget 1 (the deployed policy) by `budget1_step` through
`SparseEditor.edit_rows` (with a compiled editor, on fixed-shape graphs: `prisme.model.fired`), otherwise by the
model's own `rollout_policy` with the router's decision as step 0. Their corrections are added to H at those
positions and the head runs once over every position (an unedited position's logits are `head(H)`'s, bitwise). Every
position's workspace is independent of the others', so this is the computation `forward_policy` does at those
positions (tests/test_generate.py holds decoding to it in float64).
"""

from __future__ import annotations

import torch

from prisme.model.fired import fired_deltas
from prisme.model.outputs import Streams
from prisme.model.policy import DecodeRows, StepPolicy


def router_scores(state: DecodeRows, st: Streams, pos: torch.Tensor, valid: torch.Tensor | None,
                  ws: StepPolicy, normed: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The router's scores of every action at every query `[B, Q, A]` (`Router.scores`), and its n-gram feature and
    the token it read `[B, Q]` (None where it reads none). A query fires iff its best score is > 0, with its first
    best action as step 0 (padding's scores are -1: it never fires); `normed` is the backbone's final norm of `st.H`
    where the step has it (the decision reads it instead of norming H again)."""
    model = state.model
    seen = tok = None
    kept = state.bank.ids
    if kept is not None:
        lengths = state.lengths
        if pos.shape[1] == 1 and valid is None and min(lengths) == max(lengths):  # one new position, rows aligned
            ids, at = kept, lengths[0] - 1  # [B, 1] each below
            seen = state.bank.seen_last(lengths[0])  # from the n-gram table (None: it keeps none)
        else:
            Tb = max(lengths)
            ids, at = kept.narrow(1, 0, Tb), pos.clamp(max=Tb - 1)  # [B, Q] each below (padding: dropped)
        seen, tok = model.router_inputs(ids, at, seen)
    mods = model._modules  # (registry reads: this runs at every decode step)
    shared = None if normed is None else (normed, mods["backbone"]._modules["norm"])
    scores = mods["router"].scores(st.H, seen, ws.cost, ws.lambda_cost, shared, tok)  # [B, Q, A]: the price checked
    #   with the policy, the model's default filled in
    if valid is not None:
        scores = scores.masked_fill(~valid.unsqueeze(-1), -1.0)
    return scores, seen, tok


def fired_positions(fires: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, query indices) `[N]` where the router fired: the step's one host read."""
    return torch.nonzero(fires, as_tuple=True)


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


PLANS = ("bypass", "budget1", "routed", "static", "general")
"""How a decode call's workspace runs (`decode_plan`)."""


def decode_plan(model, ws: StepPolicy, Q: int) -> str:
    """The execution plan of a decode call's workspace (Q query positions per row), chosen here and nowhere else:

        bypass: no step at all (the backbone alone): head(H), bitwise;
        budget1: a router model's deployed policy (budget 1: the router's action and nothing after it), one query
            per row, without a slot K/V cache: `budget1_step`, on the eager editor (`SparseEditor.edit_rows`) or a
            compiled one's fixed-shape graphs of the fired rows (`prisme.model.fired`; with `static_decode`);
        routed: any other controller policy of a router model: the router first, `rollout_policy` where it fired;
        static: the compiled editor's fixed-shape decode (one query per row) of any other policy: every row
            padded in, the bank read at its capacity;
        general: the rest (forced actions, a controller without a router): `rollout_*` over the kept rows.

    Every plan computes what `forward_policy` (or `forward`, for forced actions) computes at those positions."""
    if ws.n_steps == 0:
        return "bypass"
    editor = model.editor  # its execution options: compiled or not, with or without a slot K/V cache
    compiled = editor.compiled is not None
    static = compiled and editor.execution.static_decode
    if ws.actions is None and model.cfg.router:
        if Q == 1 and ws.max_budget == 1 and not editor.slot_kv_cache and static == compiled:
            return "budget1"
        if not static:
            return "routed"
    return "static" if Q == 1 and static else "general"


def budget1_step(state: DecodeRows, st: Streams, scores: torch.Tensor, trace: torch.Tensor, n_edits: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The rows of a decode step (one query each) where the router fired at budget 1: each edits with its best
    action at step 0 with no budget left, then reads out; what `rollout_policy` (its step 0 taken) and
    `logits_from_state` compute for them, in few calls (`SparseEditor.edit_rows`). Returns (H with the fired rows'
    corrections added, or None where none fired; trace, n_edits with the fired rows written (`n_edits` `[B, 1]`
    zeros))."""
    model = state.model
    groups = fired_groups(scores, model.editor.group_of)
    if not groups:
        return None, trace, n_edits
    rows = [r for _, rs, _ in groups for r in rs]
    b, a = torch.tensor([rows, [x for _, _, acts in groups for x in acts]], dtype=torch.long,
                        device=scores.device)  # [N] each: the rows sorted by action group, their actions
    spans, at = [], 0
    for g, rs, _ in groups:
        spans.append((g, at, at + len(rs)))
        at += len(rs)
    if model.editor.compiled is not None:  # the compiled editor's fixed-shape graphs (`prisme.model.fired`)
        delta = fired_deltas(state, st, b, a, spans).to(st.H.dtype)  # [N, d]
    else:
        one = lambda x: x.index_select(0, b)  # noqa: E731  [B, 1, ...] -> [N, 1, ...]
        st_n = Streams(one(st.H), {k: one(v) for k, v in st.src.items()}, None if st.ids is None else one(st.ids))
        lengths = state.lengths
        Tb = max(lengths)
        read = state.bank.read(Tb, b, model.cfg.n_ws_heads)  # an EntryRead ([N, Tb, w] K and V), or an IdRead
        z, S0 = model.query_state(st_n, state.options)  # [N, 1, w], [N, 1, M, w]
        mask = None if all(lengths[r] == Tb for r in rows) else (  # None: each row reads its whole bank
            torch.arange(Tb, device=b.device) < state.cache.lengths_tensor(b.device)[b].unsqueeze(1))  # [N, Tb]
        S = model.editor.edit_rows(S0[:, 0], read, mask, a, spans, step=0, remaining=0)  # [N, M, w]
        delta = model.readout.edited(S, S0[:, 0], z[:, 0]).to(st.H.dtype)  # [N, d]
    n_edits = n_edits.index_fill(0, b, 1)
    return st.H.index_add(0, b, delta.unsqueeze(1)), trace.index_copy(0, b, a.view(-1, 1, 1)), n_edits


def routed_workspace(state: DecodeRows, st: Streams, pos: torch.Tensor, valid: torch.Tensor | None,
                     ws: StepPolicy, valid_t: torch.Tensor) -> dict[str, torch.Tensor]:
    """`DecodeState._workspace` for a router model's policy, plan "budget1" or "routed" (`decode_plan`; see the
    module docstring); valid `[B, Q]` marks real queries (None: all are), `valid_t` is that mask with None made
    all-True. Returns the fields of its `StepOutput`."""
    model, cfg = state.model, state.cfg
    H = st.H
    B, Q = pos.shape
    dev, R, stop = H.device, ws.n_steps, cfg.stop_action
    h = model.backbone.final_norm(H)  # [B, Q, d]: the head's input, which the router's decision reads too
    scores, seen, tok = router_scores(state, st, pos, valid, ws, h)
    trace = torch.full((B, Q, R), stop, dtype=torch.long, device=dev)
    n_edits = steps = torch.zeros(B, Q, dtype=torch.long, device=dev)  # replaced, never written, where some fire
    if decode_plan(model, ws, Q) == "budget1":  # the deployed decode step
        H_edit, trace, n_edits = budget1_step(state, st, scores, trace, n_edits)
        return dict(logits=model.backbone.logits(h) if H_edit is None else model.backbone.head(H_edit),
                    actions=trace, n_edits=n_edits, controller_steps=steps, positions=pos, valid=valid_t)
    top, best = scores.max(dim=-1)  # [B, Q] each
    fires = top > 0
    b, t = fired_positions(fires)  # [N]
    N = b.numel()
    if N == 0:  # every position that does not edit: bitwise head(H)
        return dict(logits=model.backbone.logits(h), actions=trace, n_edits=n_edits, controller_steps=steps,
                    positions=pos, valid=valid_t)
    lengths = state.lengths
    Tb = max(lengths)
    if Q == 1:  # a decode step: whole rows, one gather and one scatter per field
        one = lambda x: x.index_select(0, b)  # noqa: E731  [B, 1, ...] -> [N, 1, ...]
        put = lambda x, new: x.index_copy(0, b, new)  # noqa: E731
    else:
        one = lambda x: x[b, t].unsqueeze(1)  # noqa: E731  [B, Q, ...] -> [N, 1, ...]
        put = lambda x, new: x.index_put((b, t), new[:, 0])  # noqa: E731
    st_n = Streams(one(H), {k: one(v) for k, v in st.src.items()}, None if st.ids is None else one(st.ids))
    pos_n = one(pos)  # [N, 1]
    K, V = state.bank.view(Tb, b)  # [N, Tb, w] each
    z, S0 = model.query_state(st_n, state.options)  # [N, 1, w], [N, 1, M, w]
    mask = model.bank_mask(N, 1, Tb, pos_n, state.cache.lengths_tensor(dev)[b], dev)  # [N, 1, Tb]
    ctx = model.context(st_n, K, V, mask, (z, S0), (None if seen is None else one(seen),
                                                    None if tok is None else one(tok)))
    roll = model.rollout_policy(ctx, ws.max_budget, ws.cost, ws.lambda_cost, ws.kappa_risk,
                                first=one(best))  # every one of them fires: its best action is step 0
    delta = model.readout(roll.S[:, 0], S0[:, 0], z[:, 0]).to(H.dtype)  # [N, d]: each of them edited
    H_edit = H.index_put((b, t), H[b, t] + delta)  # (its step 0 is an edit); the head runs once per position
    trace, n_edits, steps = put(trace, roll.actions), put(n_edits, roll.n_edits), put(steps, roll.controller_steps)
    return dict(logits=model.backbone.head(H_edit), actions=trace, n_edits=n_edits, controller_steps=steps,
                positions=pos, valid=valid_t)
