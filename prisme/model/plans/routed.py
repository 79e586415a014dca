"""The routed plan: a router model's controller policy (`cfg.router`), the router deciding first and the workspace
running where it fired; and the router's decision itself (`router_scores`), which the "budget1" plan shares.

Notation: B rows, Q query positions per row, N positions where the router fired, Tb bank positions, R steps, A
actions, d backbone width.

Per step it computes, at every position, only what the decision reads: the router's scores on norm(H) and its n-gram
feature at the policy's price (`Router.scores`, reading the backbone's final norm of H, which the logits need anyway),
and one host read of their best (the decision is data: the work that follows has that shape). A step where no
position fires returns the model's output of H (`head(H)` bitwise without a copy head) and an all-STOP trace: no
query state, bank gather, mask, editor or readout. Where some fire, their N positions are gathered as N rows of one
query each (their bank rows, their mask where a row's bank is shorter than the longest, their query state) and run
the model's own rollout with the router's decision as step 0; their corrections are added to H at those positions and
the output runs once over every position (an unedited position's logits are the unedited output's, bitwise). Every
position's workspace is independent of the others', so this is the computation `forward_policy` does at those
positions (tests/test_generate.py holds decoding to it in float64).
"""

from __future__ import annotations

import torch

from prisme.model.editor import EditorRun
from prisme.model.outputs import StepOutput, Streams
from prisme.model.plans.base import DecodePlan, DecodeRows
from prisme.model.policy import StepPolicy
from prisme.model.rollout import rollout_policy


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
    scores = mods["router"].scores(st.H, seen, ws.cost, ws.lambda_cost, shared, tok)  # [B, Q, A]
    if valid is not None:
        scores = scores.masked_fill(~valid.unsqueeze(-1), -1.0)
    return scores, seen, tok


def output_of(state: DecodeRows, H: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, edited: bool) -> torch.Tensor:
    """The step's logits `[B, Q, V]`: the model's output of H (with the fired rows' corrections where `edited`); an
    unedited step without a copy head reuses the final norm h it computed for the router (`head(H)`, bitwise)."""
    model = state.model
    copy_in = state.copy_inputs(pos)
    if copy_in is None and not edited:
        return model.backbone.logits(h)
    return model.output(H, copy_in)


class Routed(DecodePlan):
    """The router first, `rollout_policy` where it fired (module docstring), with the state's editor run."""

    name = "routed"

    def __init__(self, run: EditorRun):
        self.editor_run = run

    def run(self, state, st, pos, valid, keep, ws):
        model, cfg = state.model, state.cfg
        H = st.H
        B, Q = pos.shape
        dev, R = H.device, ws.n_steps
        valid_t = torch.ones(B, Q, dtype=torch.bool, device=dev) if valid is None else valid
        h = model.backbone.final_norm(H)  # [B, Q, d]: the head's input, which the router's decision reads too
        scores, seen, tok = router_scores(state, st, pos, valid, ws, h)
        trace = torch.full((B, Q, R), cfg.stop_action, dtype=torch.long, device=dev)
        n_edits = steps = torch.zeros(B, Q, dtype=torch.long, device=dev)  # replaced, never written, where some fire
        top, best = scores.max(dim=-1)  # [B, Q] each
        b, t = torch.nonzero(top > 0, as_tuple=True)  # [N]: the step's one host read
        N = b.numel()
        if N == 0:  # every position that does not edit: the unedited output
            return StepOutput(logits=output_of(state, H, h, pos, False), actions=trace, n_edits=n_edits,
                              controller_steps=steps, positions=pos, valid=valid_t)
        Tb = max(state.lengths)
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
        roll = rollout_policy(model, ctx, ws, self.editor_run, first=one(best))  # each fires: its best is step 0
        delta = model.readout(roll.S[:, 0], S0[:, 0], z[:, 0]).to(H.dtype)  # [N, d]: each of them edited
        H_edit = H.index_put((b, t), H[b, t] + delta)  # (its step 0 is an edit); the output runs once
        trace, n_edits, steps = put(trace, roll.actions), put(n_edits, roll.n_edits), put(steps, roll.controller_steps)
        return StepOutput(logits=output_of(state, H_edit, h, pos, True), actions=trace, n_edits=n_edits,
                          controller_steps=steps, positions=pos, valid=valid_t)
