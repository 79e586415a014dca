"""How a decode call's workspace runs: one `DecodePlan` per call, chosen here and nowhere else (`choose`), from the
checked policy (`prisme.model.policy.StepPolicy`), the call's query count and the decode state's execution options
(`prisme.options.ExecutionOptions`: `editor_run` resolves them once per state).

    plan        what it runs                                                          module
    bypass      no step at all (budget 0): the head, bitwise                          base
    general     forced actions, or a controller without a router: the rollout over    general
                the rows that have a new position
    static      the same with a compiled editor on fixed shapes (one query per row,  general
                the bank read at its capacity)
    routed      a router model's controller policy: the router first, the rollout    routed
                where it fired
    budget1     a router model's deployed policy (budget 1, one query per row, no     budget1
                slot K/V cache): the fired rows edited in few calls, through the
                eager reader or the compiled editor's fixed-shape graphs

Every plan computes what `forward_policy` (or `forward`, for forced actions) computes at those positions
(tests/test_generate.py, test_fired_rows.py hold each to it in float64). The execution flags (`compile`,
`static_decode`, `slot_kv_cache`) are read here and by the classes that own them, nowhere else
(tests/test_layout.py counts).
"""

from __future__ import annotations

import torch.nn as nn

from prisme.model.compiled_editor import editor_for
from prisme.model.editor import EditorRun
from prisme.model.plans.base import BYPASS, DecodePlan, DecodeRows
from prisme.model.plans.budget1 import Budget1
from prisme.model.plans.general import General
from prisme.model.plans.routed import Routed
from prisme.model.policy import StepPolicy
from prisme.options import ExecutionOptions

__all__ = ["DecodePlan", "DecodeRows", "PLANS", "choose", "editor_run", "static_run"]

PLANS = ("bypass", "budget1", "routed", "static", "general")
"""The plans' names (`DecodePlan.name`)."""


def editor_run(model: nn.Module, execution: ExecutionOptions) -> EditorRun:
    """How `model`'s editor runs under `execution`: compiled (`prisme.model.compiled_editor.editor_for`: one
    `CompiledEditor` per distinct options, kept on the model, so a second decode state with them compiles nothing
    new; where torch.compile cannot work, one warning and the eager editor, or a ValueError for "strict") or eager,
    with the optimised editor's slot K/V cache where the options keep one."""
    runs = model.__dict__.setdefault("_editor_runs", {})  # (not a module attribute: never in a state dict)
    run = runs.get(execution)
    if run is None:
        run = runs[execution] = EditorRun(editor_for(execution), model.cfg.optimised and execution.slot_kv_cache)
    return run


def static_run(run: EditorRun, execution: ExecutionOptions) -> EditorRun | None:
    """The run of the "static" plan (a compiled editor's fixed-shape decode step), or None where `execution` runs
    none (eager, or `static_decode` off)."""
    if run.compiled is None or not execution.static_decode:
        return None
    return EditorRun(run.compiled, slot_kv=False, static=True)


def choose(state: DecodeRows, ws: StepPolicy, Q: int) -> DecodePlan:
    """The plan of a decode call of `state` running `ws` at Q query positions per row (module docstring)."""
    if ws.n_steps == 0:
        return BYPASS
    run, static = state.run, state.static_run
    if ws.actions is None and state.cfg.router:
        if Q == 1 and ws.max_budget == 1 and not run.slot_kv and (static is None) == (run.compiled is None):
            return Budget1(run.compiled)
        if static is None:
            return Routed(run)
    return General(static, capacity=True) if Q == 1 and static is not None else General(run)
