"""The workspace editor under torch.compile: `CompiledEditor`, built from a model's (or a decode state's)
`ExecutionOptions` (`editor_for`), runs the editor's one pass (`editor.blocks_pass`) on dynamic-size graphs, a decode
step's action groups on fixed-shape graphs (`padded`, the "static" plan's) and the deployed step's fired rows
(`fired`: `prisme.model.fired.fired_path`); `compile_editor` / `uncompile_editor` / `maybe_compile` set a model's.

Notation: B rows, N active positions of one action group (k slots each), Tb bank positions, M slots, w width.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from prisme.model.bank.read import PackedRead
from prisme.model.compiled import compile_options, own_code
from prisme.model.editor import EditInfo, blocks_pass
from prisme.model.fired import fired_path
from prisme.options import EDITOR_MODE, MIN_POSITIONS, ExecutionOptions

GraphKey = tuple[str | int | bool, ...]
"""A compiled graph's key: ("static" | "fired", ...sizes, autograd) or (k, full, autograd) of a dynamic one."""


def packed_pass(blocks: Any, x: torch.Tensor, st: torch.Tensor, rem: torch.Tensor, S_pos: torch.Tensor,
                slots: torch.Tensor, parts: tuple[torch.Tensor, ...], full: bool) -> tuple[torch.Tensor, list]:
    """`blocks_pass` reading a `PackedRead` given by its parts (tensors and a bool: what a graph takes)."""
    return blocks_pass(blocks, x, st, rem, S_pos, slots, PackedRead(parts, full))


class CompiledEditor:
    """`editor.blocks_pass` (one action group through every editor block) under `torch.compile`, one compiled
    function per (group size k, bank layout, autograd on/off), each with dynamic sizes (positions N, bank length Tb,
    rows B), so the number of graphs is bounded: at most a few per key, whatever the batch, budget or context; and
    the deployed decode step's fired rows (`fired`: `prisme.model.fired`), one fixed-shape graph per padded size.

    Built from a model's `ExecutionOptions` (`compile`, `compile_mode`, `min_positions`: `editor_for`, which
    `PrismeModel.set_execution` calls); `SparseEditor.forward` then routes every action group through it, on the
    seed-accounting path (each block recomputes the K/V of all M slots of an edited position, inside one graph: the
    slot K/V cache is neither read nor kept). Its first call per key compiles; if that fails (no C++ compiler, an
    unsupported op), the editor falls back to the eager `blocks_pass` for the rest of the process with one warning,
    (groups with fewer than `min_positions` active positions always run eagerly: see `MIN_POSITIONS`)
    or raises `ValueError` when `strict`. A failed graph never produces an output: the call that failed is rerun
    eagerly, so no run is ever half-compiled.
    """

    source: Callable[..., Any] | None = None  # what is compiled (None: `packed_pass`); `prisme.faults` swaps it

    def __init__(self, mode: str | None = EDITOR_MODE, strict: bool = False, min_positions: int = MIN_POSITIONS):
        self.mode, self.strict, self.min_positions = mode, strict, min_positions
        self.cpp_wrapper = False  # the fixed-shape graphs' kernels called from generated C++ (see compile_options)
        self.graphs: dict[GraphKey, Callable[..., Any]] = {}
        self.failed: str | None = None
        self.calls = {"compiled": 0, "eager": 0, "eager_small": 0}  # eager_small: fewer than min_positions

    def _get(self, key: GraphKey) -> Callable[..., Any]:
        fn = self.graphs.get(key)
        if fn is None:
            fired = key[0] == "fired"
            static = fired or key[0] == "static"
            source = fired_path if fired else CompiledEditor.source or packed_pass
            fn = torch.compile(own_code(source), fullgraph=True, dynamic=not static,
                               options=compile_options(self.mode, cpp_wrapper=fired or static and self.cpp_wrapper))
            self.graphs[key] = fn
        return fn

    def __call__(self, blocks: Any, x: torch.Tensor, st: torch.Tensor, rem: torch.Tensor, S_pos: torch.Tensor,
                 slots: torch.Tensor, read: PackedRead) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`blocks_pass` of an action group of the editor's forward (dynamic sizes)."""
        if x.shape[0] < self.min_positions:
            self.calls["eager_small"] += 1
            return blocks_pass(blocks, x, st, rem, S_pos, slots, read)
        return self._call((x.shape[1], read.full, torch.is_grad_enabled()),
                          (blocks, x, st, rem, S_pos, slots, read.parts(), read.full))

    def fired(self, group: int, rows: int, bank: int, kind: str, *args: Any) -> torch.Tensor:
        """`prisme.model.fired.fired_path(*args)`: the deployed step's fired rows of one action group on fixed
        shapes, one graph per (action group, padded rows, padded bank, how the bank is read), its kernels called from
        generated C++ (measured: the editor's part of one fired row of `recall_T32` ~100 us against ~195 us from
        Python, ~300 us eager)."""
        return self._call(("fired", group, rows, bank, kind, torch.is_grad_enabled()), args)

    def padded(self, editor: Any, S: torch.Tensor, bank: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
               action: torch.Tensor, step: torch.Tensor, remaining: torch.Tensor,
               groups: tuple[torch.Tensor, list[int]]) -> tuple[torch.Tensor, EditInfo]:
        """`SparseEditor.forward` for a decode step (one query per row, Tq = 1) on fixed-shape graphs (the "static"
        plan's `EditorRun`): every action group present runs on all B rows (rows of other groups, or that STOP, run
        along on the group's first action's slots) against the whole bank (K, V `[B, Tb, w]`, its mask `[B, 1, Tb]`;
        the decode state passes its capacity, so Tb is fixed), and only the rows that took an action of the group are
        written (`groups`: each row's action group `[B, 1]` and the count per group, STOP first). Outputs of the other
        rows are dropped, so idle rows and untouched slots stay bitwise unchanged. Seed accounting (no slot K/V
        cache); one graph per (k, B, capacity), compiled without dynamic sizes (and so without their per-call cost).
        """
        K, V, bank_mask = bank
        group, counts = groups
        B, _, M, w = S.shape
        Tb = K.shape[1]
        nh = editor.cfg.n_ws_heads
        Kh = K.view(B, Tb, nh, w // nh).transpose(1, 2)  # [B, nh, Tb, hd]
        Vh = V.view(B, Tb, nh, w // nh).transpose(1, 2)
        rows = torch.arange(B, device=S.device)
        zero = torch.zeros_like(rows)
        S_pos = S[:, 0]  # [B, M, w]
        S_new = S.clone()
        gates: list[list[torch.Tensor]] = [[] for _ in editor.blocks]
        for g_id, k in enumerate(editor.group_sizes):
            if counts[g_id + 1] == 0:
                continue
            mine = group[:, 0] == g_id  # [B]
            slots = editor.act_slots[torch.where(mine, action[:, 0], editor.group_first[g_id]), :k]  # [B, k]
            x = S_pos[rows.unsqueeze(1), slots]  # [B, k, w]
            mask = bank_mask.view(B, 1, 1, Tb).expand(B, 1, k, Tb)  # [B, 1, k, Tb]
            x, gs = self._call(("static", k, torch.is_grad_enabled()),
                               (editor.blocks, x, step[:, 0], remaining[:, 0], S_pos, slots,
                                (Kh, Vh, mask, rows, zero), True))
            b_act = torch.nonzero(mine).squeeze(1)  # [N]
            S_new[b_act.unsqueeze(1), 0, slots[b_act]] = x[b_act].to(S_new.dtype)
            for i, g in enumerate(gs):
                gates[i].append(g[b_act])
        return S_new, EditInfo(sum(counts[1:]), gates, None)

    def _call(self, key: GraphKey, args: tuple) -> Any:
        if self.failed is None:
            try:
                if key in self.graphs:
                    out = self._get(key)(*args)
                else:  # its first call compiles: Dynamo traces through the config's cached parse of its source
                    #   terms (a constant here) and says so; nothing to act on
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
                        out = self._get(key)(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: report once, then run eagerly
                self.failed = error_line(e)
                if self.strict:
                    raise ValueError(f"--compile: the editor could not be compiled ({self.failed})") from e
                warnings.warn(f"prisme: compiling the editor failed ({self.failed}); running it eagerly",
                              stacklevel=2)
            else:
                self.calls["compiled"] += 1
                return out
        self.calls["eager"] += 1
        return (fired_path if key[0] == "fired" else packed_pass)(*args)


def error_line(e: BaseException) -> str:
    """`Type: first line of the message` (at most 300 characters): how a compiler failure is reported."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def compiler_available() -> str | None:
    """None if torch.compile's CPU backend can build a kernel here, else why not (checked once, by compiling a tiny
    function)."""
    global _COMPILER_PROBE
    if _COMPILER_PROBE is None:
        try:
            f = torch.compile(own_code(_probe), fullgraph=True)
            with torch.no_grad():
                ok = bool(torch.equal(f(torch.arange(4.0)), _probe(torch.arange(4.0))))
            _COMPILER_PROBE = "" if ok else "a compiled probe gave a wrong result"
        except Exception as e:  # noqa: BLE001
            _COMPILER_PROBE = error_line(e)
    return _COMPILER_PROBE or None


def _probe(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + 1


_COMPILER_PROBE: str | None = None


def editor_for(execution: ExecutionOptions) -> CompiledEditor | None:
    """The `CompiledEditor` that `execution.compile` asks for, or None: "off", or where torch.compile cannot work (no
    C++ compiler, ...): then one warning and the eager editor ("auto"), or a ValueError ("strict")."""
    if execution.compile == "off":
        return None
    why = compiler_available()
    if why is not None:
        if execution.compile == "strict":
            raise ValueError(f"--compile: torch.compile does not work here ({why})")
        warnings.warn(f"prisme: torch.compile does not work here ({why}); the editor runs eagerly", stacklevel=3)
        return None
    return CompiledEditor(execution.compile_mode, execution.compile == "strict", execution.min_positions)


def compile_editor(model: Any, mode: str | None = EDITOR_MODE, strict: bool = False,
                   min_positions: int = MIN_POSITIONS) -> bool:
    """`model.set_execution` with its execution options' `compile` set ("strict" with `strict`, else "auto"): the
    editor under a `CompiledEditor` (see there). Returns True if it compiles here.

    Where torch.compile cannot work (no C++ compiler, ...), prints nothing, leaves the eager editor and returns False
    after one warning; with `strict`, raises `ValueError` instead. `uncompile_editor` undoes it.
    """
    if getattr(model, "editor", None) is None:
        raise ValueError("compile_editor needs a model with a workspace (use_workspace=True)")
    return model.set_execution(replace(model.execution, compile="strict" if strict else "auto", compile_mode=mode,
                                       min_positions=min_positions))


def uncompile_editor(model: Any) -> None:
    """Back to the eager editor (and its slot K/V cache where the model's execution options keep one)."""
    model.set_execution(replace(model.execution, compile="off"))


def maybe_compile(model: Any, how: str | None) -> bool:
    """`compile_editor` as a `compile` setting asks (`checks.COMPILE_SETTINGS`; None or "off": leave the model
    eager); True if the editor is now compiled."""
    if how in (None, "off") or getattr(model, "editor", None) is None:
        return False
    return compile_editor(model, strict=how == "strict")
