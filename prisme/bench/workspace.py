"""`prisme bench workspace`: what the workspace costs in time per generated token, next to what it costs in ops.

Notation: B rows, P prompt tokens, N decoded tokens per row, n forced actions per position (n_b for row b),
k slots per action, M slots, T = position + 1 the context of a decoded position.

Protocol (SPEC §7, "same protocol for the workspace"), per preset and batch size, on a seeded, untrained model
(presets demo and prisme_103m by default; torch threads 1 for demo, 2 for prisme_103m, unless given):
  * rows: seed 000's five rows (`costs.SEED_ROWS`) as forced action traces through `DecodeState.decode_step(...,
    actions=...)`: backbone only (a state without a source bank, no actions), 4 single-slot actions (slots 0..3),
    4 pair actions, 8 pair actions (pairs repeat when M/2 < 8) and 8 DENSE actions (all M slots; "dense16" at M=16);
  * batch 1: every decoded position takes the row's n actions. Batch B > 1 (ragged budgets): row b takes
    n_b = ceil((b + 1) n / B) actions and then STOP, with budget n_b, so rows stop at different steps and the editor
    gathers fewer positions at later steps (8 pairs at B = 8: 1, 2, ..., 8 actions);
  * models: the same weights run as `cfg.optimised=True` ("opt": folded readout; the default editor, which
    recomputes every slot's K/V), with the slot K/V cache on too ("opt_kv": `cfg.slot_kv_cache=True`) and as
    `cfg.optimised=False` ("seed": seed 000's accounting), so each saving of the optimised column shows in time. The
    readout's U (zero at init, which would hide every edit from the logits) gets random weights, so the checks see
    the workspace;
  * timing: `bench.time_paths` (warmups, repeats, perf_counter_ns, inference_mode, gc off, path order rotated over
    every row x model of a batch size); one sample = N forced decode steps on a state prefilled once (untimed) and
    rewound to P before each run (`rewind`: exact, checked); the backbone step and LM head are timed apart inside
    the decode step by wrappers installed by this module (`SplitTimer`; the library is not changed), so
    workspace time = total - backbone - head: everything the workspace adds (bank entries, slot state, mask,
    editor rollout, readout, forced-action checks, bookkeeping); `workspace_modules` is the part spent inside the
    model's workspace methods;
  * analytic: `costs.trace_cost` of the very traces decoded, at each position's own context T = P + i + 1, in both
    columns (seed and optimised); the ratio to backbone only, the workspace's share of the backbone's ops, and the
    target figure: (workspace time / backbone time) / (workspace ops / backbone ops), which is 1 when the workspace
    runs at the backbone's achieved FLOP/s (target: <= 1.15 at batch 8 for every row);
  * measured matmul ops: `costs.OpsCounter` on one decode step per row (what actually ran, e.g. padded bank
    attention), next to the analytic workspace ops of that step;
  * checks, before anything is timed: a rewound state decodes bit-identically to a fresh one; the timing wrappers
    change no logit; the optimised and seed models agree; negative controls (rewinding one position short, changing
    the forced slots) must move the logits;
  * profile (`--profile`): `torch.profiler` over the decode steps of every workspace row x model of the last preset
    at its largest batch, ops under the backbone and head wrappers excluded: the workspace's top ATen ops by self
    time with calls per decode step, the time inside each workspace method, and the ATen calls Python dispatched.

Output: a table for humans, then one JSON document (with `prisme.io.environment`'s block), the last thing on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from time import perf_counter_ns
from typing import Any

import torch

from prisme.bench.harness import emit, parse_ints, percentiles, time_paths, torch_threads
from prisme.config import PrismeConfig
from prisme.costs.analytic import BACKBONE, COMPONENTS, SEED_ROWS, trace_cost
from prisme.costs.counting import OpsCounter
from prisme.io import environment
from prisme.model.prisme import PrismeModel
from prisme.model.state import DecodeState
from prisme.stats import paired_bootstrap

ROWS = tuple(SEED_ROWS)  # backbone_only, 4_actions_k1, 4_actions_k2, 8_actions_k2, 8_actions_dense16
VARIANTS = ("opt", "opt_kv", "seed")  # cfg.optimised True (slot K/V cache off / on) / False, same weights
COMPILED = "compiled"  # with --compile: the seed model with its editor under torch.compile (prisme.compile)
PATHS = {"-": "backbone only (no source bank, no workspace)",
         "opt": "eager editor, every slot's K/V recomputed in every block; folded readout (cfg.optimised=True, the "
                "default: slot_kv_cache=False)",
         "opt_kv": "eager editor with the slot K/V cache, folded readout (cfg.optimised=True, slot_kv_cache=True)",
         "seed": "eager editor, every slot's K/V recomputed in every block (cfg.optimised=False)",
         COMPILED: "compiled editor: fixed-shape decode graphs, every row padded in, the bank at capacity; seed "
                   "accounting (cfg.optimised=False)"}
DEFAULT_PRESETS = ("demo", "prisme_103m")
DEFAULT_THREADS = {"prisme_103m": 2, "prisme_459m": 2}  # other presets: 1
TARGET_SHARE_RATIO = 1.15  # workspace time share <= 1.15 x its analytic ops share, at batch 8
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 5e-2}  # optimised vs seed logits
NEGATIVE_CONTROL_MIN = 1e-3
OPTIMISED_SLOWDOWN_MAX = 0.03  # an optimised model's decode step may be at most 3% slower than the seed model's ...
OPTIMISED_TIME_SHARE_MIN = 0.5  # ... and must save at least half of its op saving in time (batch 8)
WORKSPACE_COMPONENTS = tuple(c for c in COMPONENTS if c not in BACKBONE)


# --------------------------------------------------------------------------------------------------------------- model
def build_models(cfg: PrismeConfig, seed: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", compile: bool = False) -> dict[str, PrismeModel]:
    """The same seeded, untrained weights as `{"opt": cfg.optimised=True, "opt_kv": ... and cfg.slot_kv_cache=True,
    "seed": cfg.optimised=False}`, eval mode.

    The readout's U (zero-initialised) gets N(0, init_std) weights, so edits reach the logits. The global RNG is
    left alone.
    """
    if not cfg.use_workspace:
        raise ValueError(f"preset {cfg.name!r} has no workspace (use_workspace=False): nothing to benchmark")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        opt = PrismeModel(cfg.replace(optimised=True))
        torch.nn.init.normal_(opt.readout.U.weight, std=cfg.init_std)
        ref = PrismeModel(cfg.replace(optimised=False))
        kv = PrismeModel(cfg.replace(optimised=True, slot_kv_cache=True))
    ref.load_state_dict(opt.state_dict())
    kv.load_state_dict(opt.state_dict())
    models = {v: m.to(device=device, dtype=dtype).eval() for v, m in (("opt", opt), ("opt_kv", kv), ("seed", ref))}
    if compile:  # the seed accounting (every slot's K/V recomputed, in one graph per action group), compiled
        from prisme.model.compiled import compile_editor

        comp = PrismeModel(cfg.replace(optimised=False))
        comp.load_state_dict(opt.state_dict())
        models[COMPILED] = comp.to(device=device, dtype=dtype).eval()
        compile_editor(models[COMPILED], strict=True)
    return models


def row_plan(cfg: PrismeConfig, row: str, batch: int) -> tuple[torch.Tensor | None, list[int]]:
    """Forced actions `[B, n]` of one seed-000 row (STOP after row b's n_b actions) and each row's n_b.

    Batch 1: n_b = n. Batch B > 1: n_b = ceil((b + 1) n / B), so rows stop at different steps.
    Returns (None, [0] * B) for backbone_only.
    """
    if row not in SEED_ROWS:
        raise ValueError(f"unknown row {row!r}; choose from {ROWS}")
    n, k = SEED_ROWS[row]
    if n == 0:
        return None, [0] * batch
    if n > cfg.r_max:
        raise ValueError(f"row {row!r} needs {n} actions but preset {cfg.name!r} has r_max={cfg.r_max}")
    M = cfg.n_slots
    if row.endswith("dense16"):
        ids = [cfg.dense_action] * n
    elif k == 1:
        ids = [i % M for i in range(n)]  # slots 0, 1, 2, ...
    else:
        ids = [M + i % (M // 2) for i in range(n)]  # pairs (0,1), (2,3), ... repeating when M/2 < n
    counts = [n] * batch if batch == 1 else [math.ceil((b + 1) * n / batch) for b in range(batch)]
    acts = torch.full((batch, n), cfg.stop_action, dtype=torch.long)
    for b, n_b in enumerate(counts):
        acts[b, :n_b] = torch.tensor(ids[:n_b])
    return acts, counts


def rewind(state: DecodeState, length: int) -> DecodeState:
    """Roll every row of `state` back to `length` positions, in place; returns it.

    Exact: the next step writes its K/V and bank entry at position `length` and every later read is masked to
    positions <= its own, so entries left past `length` are never read (checked by `workspace_checks`).
    """
    if not 0 <= length <= min(state.lengths):
        raise ValueError(f"can only rewind to a length in [0, {min(state.lengths)}], got {length}")
    state.cache.lengths = [length] * state.batch_size
    return state


# --------------------------------------------------------------------------------------------------------- split timer
class SplitTimer:
    """Times the backbone step, the LM head and the workspace methods inside `decode_step`, without changing them.

    Installs instance-attribute wrappers on each model (removed on exit): `backbone.streams`, `backbone.head`, and the
    workspace methods `bank_inputs`, `bank_from_inputs`, `query_state`, `bank_mask`, `rollout_forced`,
    `logits_from_state` (the head
    called inside the readout counts as head). On CUDA each wrapper synchronises before and after. With `label`, each
    wrapped call also opens a `torch.profiler.record_function("prisme::<backbone|head|method name>")` range.

        with SplitTimer(models) as st:
            st.reset(); ...; st.ns  # {"backbone": ns, "head": ns, "workspace_modules": ns}
    """

    SECTIONS = ("backbone", "head", "workspace_modules")
    _WORKSPACE_METHODS = ("bank_inputs", "bank_from_inputs", "query_state", "bank_mask", "rollout_forced",
                          "logits_from_state")

    def __init__(self, models: Sequence[PrismeModel], label: bool = False):
        self.models = list(models)
        self.label = label
        self.ns = dict.fromkeys(self.SECTIONS, 0)
        self._sync: Callable[[], None] = lambda: None
        self._depth = 0

    def reset(self) -> None:
        self.ns = dict.fromkeys(self.SECTIONS, 0)

    def _wrap(self, fn: Callable[..., Any], section: str, name: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            label = torch.profiler.record_function(f"prisme::{name}") if self.label else contextlib.nullcontext()
            ws = section == "workspace_modules"
            if ws and self._depth > 0:  # nested workspace call (none today): already timed by the outer one
                return fn(*args, **kwargs)
            self._sync()
            t0 = perf_counter_ns()
            if ws:
                self._depth += 1
                head_before = self.ns["head"]
            try:
                with label:
                    out = fn(*args, **kwargs)
                self._sync()
            finally:
                dt = perf_counter_ns() - t0
                if ws:
                    self._depth -= 1
                    dt -= self.ns["head"] - head_before
            self.ns[section] += dt
            return out

        return timed

    def __enter__(self) -> SplitTimer:
        if any(p.is_cuda for m in self.models for p in m.parameters()):
            self._sync = torch.cuda.synchronize
        for m in self.models:
            m.backbone.streams = self._wrap(m.backbone.streams, "backbone", "backbone")
            m.backbone.head = self._wrap(m.backbone.head, "head", "head")
            for name in self._WORKSPACE_METHODS:
                if hasattr(m, name):
                    setattr(m, name, self._wrap(getattr(m, name), "workspace_modules", name))
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in self.models:
            for name in ("streams", "head"):
                m.backbone.__dict__.pop(name, None)
            for name in self._WORKSPACE_METHODS:
                m.__dict__.pop(name, None)


# ------------------------------------------------------------------------------------------------------------- results
@dataclass
class RowResult:
    """One row x model at one batch size. Times are per decode step (B tokens) unless named per token."""

    row: str
    variant: str  # "opt", "opt_kv", "seed" or "compiled"; "-" for backbone_only (no workspace: the same for all)
    path: str  # what ran (`PATHS`); the analytic columns price it
    batch: int
    actions_per_row: list[int]  # n_b
    samples_ms: list[float]  # per run of N steps
    step_ms_p50: float
    step_ms_p95: float
    token_us_p50: float  # step p50 / B
    ratio_to_backbone_only: float  # step p50 / backbone_only step p50
    backbone_ms: float  # p50 per step of the backbone step + LM head inside this row's decode steps
    workspace_ms: float  # p50 per step of total - backbone - head: everything the workspace adds
    workspace_modules_ms: float  # p50 per step inside the model's workspace methods
    workspace_token_us: float  # workspace_ms / B
    analytic_ops_per_token: float  # this model's column
    analytic_backbone_ops_per_token: float
    analytic_workspace_ops_per_token: float
    analytic_ratio_seed: float  # total / backbone of the decoded traces, seed column
    analytic_ratio_optimised: float  # the same, optimised column
    backbone_pooled_ms: float  # p50 per step of the backbone + head over every row of this batch (same work)
    workspace_time_share: float  # workspace_ms / backbone_pooled_ms
    workspace_ops_share: float  # analytic workspace ops / backbone ops (this model's column)
    share_ratio: float | None  # time share / ops share (target <= 1.15 at batch 8); None for backbone_only
    workspace_gflops: float | None  # analytic workspace ops per second of workspace time
    backbone_gflops: float
    measured_workspace_matmul_ops_per_token: float  # OpsCounter, first decode step
    analytic_workspace_ops_first_step: float  # trace_cost of that step
    split_samples_ms: dict[str, list[float]] = field(default_factory=dict)  # per run: backbone, head, modules


def _analytic(cfg: PrismeConfig, acts: torch.Tensor | None, batch: int, P: int, N: int,
              optimised: bool, steps: int | None = None) -> tuple[float, float]:
    """(total, backbone) ops per token of decoding N tokens (or the first `steps`) at contexts P + 1 ... P + N."""
    n_steps = N if steps is None else steps
    contexts = [P + i + 1 for _ in range(batch) for i in range(n_steps)]  # row-major: row b, step i
    traces = None if acts is None else acts.repeat_interleave(n_steps, dim=0)  # [B N, n]
    tc = trace_cost(cfg, traces, contexts, None, optimised)
    return tc.total_ops / tc.n_positions, tc.backbone_ops / tc.n_positions


def _measured_workspace_ops(model: PrismeModel, state: DecodeState, P: int, token: torch.Tensor,
                            acts: torch.Tensor | None, budget: torch.Tensor | None) -> float:
    """Matmul ops per token of the workspace components in one decode step, counted by `OpsCounter`."""
    rewind(state, P)
    with torch.inference_mode(), OpsCounter(model) as oc:
        state.decode_step(token, actions=acts, budget=budget)
    return sum(oc.by_component[c] for c in (*WORKSPACE_COMPONENTS, "untagged")) / token.shape[0]


# -------------------------------------------------------------------------------------------------------- one preset
@dataclass
class _Path:
    name: str
    model: PrismeModel
    row: str
    variant: str
    acts: torch.Tensor | None  # [B, 1, n] on the device
    budget: torch.Tensor | None  # [B, 1]
    counts: list[int]
    state: DecodeState


def _paths(models: dict[str, PrismeModel], batch: int, P: int, N: int, prompt: torch.Tensor,
           variants: Sequence[str] = ("-", *VARIANTS, COMPILED)) -> list[_Path]:
    """Every row x model (of `variants`; "-" = backbone_only) at one batch size.

    Paths of the same model share one state prefilled with the prompt `[B, P]` (untimed), which every run rewinds
    to P; backbone_only gets a state without a source bank.
    """
    cfg = models["opt"].cfg
    dev = prompt.device
    states: dict[tuple[str, bool], DecodeState] = {}
    out = []
    for row in ROWS:
        acts, counts = row_plan(cfg, row, batch)
        for variant in ("-",) if acts is None else [v for v in (*VARIANTS, COMPILED) if v in models]:
            if variant not in variants:
                continue
            model_name = "opt" if variant == "-" else variant
            key = (model_name, acts is not None)
            if key not in states:
                states[key] = models[model_name].new_decode_state(batch, max_len=P + N, bank=acts is not None)
                with torch.inference_mode():
                    states[key].prefill(prompt, logits="none")
            budget = None if acts is None else torch.tensor(counts, device=dev).unsqueeze(1)  # [B, 1]
            a = None if acts is None else acts.to(dev).unsqueeze(1)  # [B, 1, n]
            name = row if acts is None else f"{variant}/{row}"
            out.append(_Path(name, models[model_name], row, variant, a, budget, counts, states[key]))
    return out


def _decode(path: _Path, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Forced decode of `tokens` `[B, N]`, one step at a time, with the path's actions; logits `[B, 1, V]` per step."""
    return [path.state.decode_step(tokens[:, i:i + 1], actions=path.acts, budget=path.budget).logits
            for i in range(tokens.shape[1])]


def workspace_checks(models: dict[str, PrismeModel], batch: int, P: int, seed: int = 42) -> dict[str, float]:
    """Max |logit| differences that make the timing meaningful (on the 4-pair row, 2 decode steps):

    rewind_vs_fresh (0 expected), timer_transparency (0 expected), optimised_vs_seed and slot_kv_cache_vs_seed
    (<= TOLERANCE), and the
    negative controls rewind_short (rewound to P - 1) and other_slots (the 4-single-slot row instead) (large).
    """
    cfg = models["opt"].cfg
    dev = next(models["opt"].parameters()).device
    seq = make_sequence(cfg.vocab_size, batch, P + 2, seed, dev)
    prompt, new = seq[:, :P], seq[:, P:]
    with torch.inference_mode():
        paths = {p.name: p for p in _paths(models, batch, P, 2, prompt, variants=(*VARIANTS, COMPILED))}
        k2 = paths["opt/4_actions_k2"]
        fresh = torch.cat(_decode(k2, new), 1)  # [B, 2, V], on the freshly prefilled state
        _decode(rewind_path(k2, P), (new + 1) % cfg.vocab_size)  # other tokens written past P
        again = torch.cat(_decode(rewind_path(k2, P), new), 1)
        with SplitTimer(list(models.values())):
            timed = torch.cat(_decode(rewind_path(k2, P), new), 1)
        seed_model = torch.cat(_decode(paths["seed/4_actions_k2"], new), 1)
        cached = torch.cat(_decode(paths["opt_kv/4_actions_k2"], new), 1)
        compiled = (torch.cat(_decode(paths[f"{COMPILED}/4_actions_k2"], new), 1)
                    if f"{COMPILED}/4_actions_k2" in paths else None)
        other = torch.cat(_decode(rewind_path(paths["opt/4_actions_k1"], P), new), 1)
        short = torch.cat(_decode(rewind_path(k2, P - 1), new), 1)

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).abs().max())

    out = {"rewind_vs_fresh": err(again, fresh), "timer_transparency": err(timed, fresh),
           "optimised_vs_seed": err(seed_model, fresh), "slot_kv_cache_vs_seed": err(cached, seed_model),
           "negative_rewind_short": err(short, fresh),
           "negative_other_slots": err(other, fresh)}
    if compiled is not None:
        out["compiled_vs_seed"] = err(compiled, seed_model)
    return out


def rewind_path(path: _Path, length: int) -> _Path:
    """`rewind` the path's state to `length` positions; returns the path (for chaining into `_decode`)."""
    rewind(path.state, length)
    return path


def make_sequence(vocab_size: int, batch: int, length: int, seed: int, device: str | torch.device) -> torch.Tensor:
    """Predetermined token ids `[batch, length]` from a private generator, on `device`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=g).to(device)


def time_batch(models: dict[str, PrismeModel], batch: int, P: int, N: int, warmups: int, repeats: int,
               seed: int = 42) -> list[RowResult]:
    """Time every row x model at one batch size (order rotated over all of them); see the module docstring."""
    cfg = models["opt"].cfg
    dev = next(models["opt"].parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    seq = make_sequence(cfg.vocab_size, batch, P + N, seed, dev)
    prompt, new = seq[:, :P], seq[:, P:]
    paths = _paths(models, batch, P, N, prompt)
    measured = {p.name: _measured_workspace_ops(p.model, p.state, P, new[:, :1], p.acts, p.budget) for p in paths
                if p.variant != COMPILED}
    for p in paths:  # the compiled graph runs the seed model's ops (counted eagerly: a dispatch mode cannot see in)
        if p.variant == COMPILED:
            measured[p.name] = measured[f"seed/{p.row}"]
    splits: dict[str, list[dict[str, int]]] = {p.name: [] for p in paths}
    with SplitTimer(list(models.values())) as st:
        def setup(p: _Path) -> Callable[[], _Path]:
            def go() -> _Path:
                rewind(p.state, P)
                sync()
                st.reset()
                return p
            return go

        def run(p: _Path) -> None:
            for i in range(N):
                p.state.decode_step(new[:, i:i + 1], actions=p.acts, budget=p.budget)
            sync()
            splits[p.name].append(dict(st.ns))

        samples = time_paths([(p.name, setup(p), run) for p in paths], warmups, repeats)
    base_p50 = percentiles(samples[ROWS[0]])[0]
    split_ms, bb = {}, {}
    for p in paths:
        sp = splits[p.name][warmups:]  # time_paths runs each path warmups + repeats times, in that order
        split_ms[p.name] = {k: [d[k] / 1e6 for d in sp] for k in SplitTimer.SECTIONS}
        bb[p.name] = [(b + h) / N for b, h in zip(split_ms[p.name]["backbone"], split_ms[p.name]["head"])]
    # The backbone does the same work in every row: its pooled p50 is the steadiest denominator for the shares.
    bb_pooled = percentiles([x for v in bb.values() for x in v])[0]
    rows = []
    for p in paths:
        s50, s95 = (x / N for x in percentiles(samples[p.name]))
        ws = [t / N - x for t, x in zip(samples[p.name], bb[p.name])]
        mods = [m / N for m in split_ms[p.name]["workspace_modules"]]
        bb50, ws50, mod50 = (percentiles(x)[0] for x in (bb[p.name], ws, mods))
        pc = p.model.cfg  # the ops of the path that ran: the compiled editor runs the seed's accounting
        acts = None if p.acts is None else p.acts[:, 0]  # [B, n]
        total, backbone = _analytic(pc, acts, batch, P, N, pc.optimised)
        seed_total, _ = _analytic(pc, acts, batch, P, N, False)
        opt_total, _ = _analytic(pc, acts, batch, P, N, True)
        first_total, first_bb = _analytic(pc, acts, batch, P, N, pc.optimised, steps=1)
        ws_ops = total - backbone
        has_ws = p.acts is not None
        rows.append(RowResult(
            row=p.row, variant=p.variant, path=PATHS[p.variant], batch=batch, actions_per_row=p.counts,
            samples_ms=samples[p.name],
            step_ms_p50=s50, step_ms_p95=s95, token_us_p50=1e3 * s50 / batch,
            ratio_to_backbone_only=s50 / (base_p50 / N), backbone_ms=bb50, workspace_ms=ws50,
            workspace_modules_ms=mod50, workspace_token_us=1e3 * ws50 / batch,
            analytic_ops_per_token=total, analytic_backbone_ops_per_token=backbone,
            analytic_workspace_ops_per_token=ws_ops, analytic_ratio_seed=seed_total / backbone,
            analytic_ratio_optimised=opt_total / backbone, backbone_pooled_ms=bb_pooled,
            workspace_time_share=ws50 / bb_pooled, workspace_ops_share=ws_ops / backbone,
            share_ratio=(ws50 / bb_pooled) / (ws_ops / backbone) if has_ws else None,
            workspace_gflops=ws_ops * batch / (ws50 * 1e6) if has_ws else None,
            backbone_gflops=backbone * batch / (bb50 * 1e6),
            measured_workspace_matmul_ops_per_token=measured[p.name],
            analytic_workspace_ops_first_step=first_total - first_bb,
            split_samples_ms={k: [v / N for v in vals] for k, vals in split_ms[p.name].items()}))
    return rows


# ------------------------------------------------------------------------------------------------------------- profile
def profile_workspace(models: dict[str, PrismeModel], batch: int, P: int, N: int,
                      variants: Sequence[str] = VARIANTS, top: int = 15, seed: int = 42) -> dict[str, Any]:
    """Where the workspace's time goes, per workspace row x model: the top ops by self CPU time over N decode steps,
    excluding everything under the backbone and head wrappers (per op: calls and microseconds per decode step), the
    time inside each workspace method, and the number of ATen calls Python dispatched. Profiled times include the
    profiler's own per-op overhead: read shares and call counts, and the unprofiled table for absolute times."""
    from torch.profiler import ProfilerActivity, profile

    cfg = models["opt"].cfg
    dev = next(models["opt"].parameters()).device
    seq = make_sequence(cfg.vocab_size, batch, P + N, seed, dev)
    prompt, new = seq[:, :P], seq[:, P:]
    paths = _paths(models, batch, P, N, prompt, variants=variants)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    out: dict[str, Any] = {"batch": batch, "decode_steps": N, "preset": cfg.name, "variants": list(variants),
                           "rows": {}}
    excluded = {"prisme::backbone", "prisme::head"}
    methods = {f"prisme::{m}" for m in SplitTimer._WORKSPACE_METHODS}
    with SplitTimer(list(models.values()), label=True), torch.inference_mode():
        for p in paths:
            rewind(p.state, P)
            _decode(p, new[:, :1])  # warm
            rewind(p.state, P)
            with profile(activities=activities) as prof:
                t0 = perf_counter_ns()
                _decode(p, new)
                wall_us = (perf_counter_ns() - t0) / 1e3
            agg: dict[str, list[float]] = {}
            by_method: dict[str, float] = {}
            n_ops = 0
            for e in prof.events():
                if _under(e, excluded):
                    continue
                if e.name in methods:  # its own time: the head called inside the readout is not the workspace's
                    key = e.name.removeprefix("prisme::")
                    by_method[key] = by_method.get(key, 0.0) + (e.cpu_time_total - _time_in(e, excluded)) / N
                    continue
                if e.name.startswith("prisme::"):
                    continue
                a = agg.setdefault(e.name, [0, 0.0])
                a[0] += 1
                a[1] += e.self_cpu_time_total
                if e.name.startswith("aten::") and _top_level_aten(e):
                    n_ops += 1
            ranked = sorted(agg.items(), key=lambda kv: -kv[1][1])
            self_total = sum(v[1] for v in agg.values())
            n_actions = sum(p.counts) / batch
            out["rows"][p.name] = {
                "wall_us_per_step_profiled": wall_us / N,
                "workspace_methods_us_per_step": by_method,
                "self_us_per_step_outside_backbone": self_total / N,
                "top_level_aten_calls_per_step": n_ops / N,
                "mean_actions_per_position": n_actions,
                "top": [{"op": k, "calls_per_step": v[0] / N, "self_us_per_step": v[1] / N,
                         "us_per_call": v[1] / max(v[0], 1), "share": v[1] / max(self_total, 1e-9)}
                        for k, v in ranked[:top]],
            }
    return out


def _under(e: Any, names: set[str]) -> bool:
    while e is not None:
        if e.name in names:
            return True
        e = e.cpu_parent
    return False


def _time_in(e: Any, names: set[str]) -> float:
    """Total CPU time of the ranges named in `names` nested anywhere under event `e`."""
    return sum(c.cpu_time_total if c.name in names else _time_in(c, names) for c in e.cpu_children)


def _top_level_aten(e: Any) -> bool:
    """An aten op not called from inside another aten op (what Python dispatched)."""
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return False
        p = p.cpu_parent
    return True


# -------------------------------------------------------------------------------------------------------------- report
def model_facts(model: PrismeModel) -> dict[str, Any]:
    cfg = model.cfg
    return {"preset": cfg.name, "family": cfg.family, "vocab": cfg.vocab_size, "layers": cfg.n_layer,
            "width": cfg.d_model, "heads": cfg.n_head, "kv_heads": cfg.n_kv_head, "w": cfg.w, "slots": cfg.n_slots,
            "edit_blocks": cfg.n_edit_blocks, "editor_hidden": cfg.editor_hidden, "ws_heads": cfg.n_ws_heads,
            "r_max": cfg.r_max, "parameters": model.num_parameters(), "trained": False}


def run_workspace(presets: Sequence[str | PrismeConfig] = DEFAULT_PRESETS, batches: Sequence[int] = (1, 8),
                  prompt_len: int = 128, new_tokens: int = 16, warmups: int = 1, repeats: int = 5,
                  threads: int | None = None, seed: int = 42, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  profile: bool = False, profile_steps: int = 4, compile: bool = False) -> dict[str, Any]:
    """The whole protocol (module docstring) on each preset; returns the JSON document.

    presets: preset names or configs (each needs a workspace and r_max >= 8).
    threads: torch CPU threads for every preset (None: `DEFAULT_THREADS`, else 1).
    """
    if not presets or not batches or any(b < 1 for b in batches):
        raise ValueError(f"need presets and batch sizes >= 1, got {list(presets)} and {list(batches)}")
    if prompt_len < 2 or new_tokens < 1 or warmups < 0 or repeats < 1 or profile_steps < 1:
        raise ValueError(f"need prompt_len >= 2, new_tokens >= 1, warmups >= 0, repeats >= 1 and profile_steps >= 1; "
                         f"got {prompt_len}, {new_tokens}, {warmups}, {repeats}, {profile_steps}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but CUDA is not available")
    cfgs = [p if isinstance(p, PrismeConfig) else PrismeConfig.from_name(p) for p in presets]
    for cfg in cfgs:
        if not cfg.use_workspace:
            raise ValueError(f"preset {cfg.name!r} has no workspace (use_workspace=False)")
        for row in ROWS:
            row_plan(cfg, row, 1)
        if prompt_len + new_tokens > cfg.max_seq_len:
            raise ValueError(f"prompt {prompt_len} + {new_tokens} new tokens exceeds T_max={cfg.max_seq_len} of "
                             f"preset {cfg.name!r}")
    env = environment(dtype=dtype, seed=seed)
    env["device"] = device
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
    results, checks, prof = [], {}, None
    for i, cfg in enumerate(cfgs):
        n_threads = DEFAULT_THREADS.get(cfg.name, 1) if threads is None else threads
        with torch_threads(n_threads):
            models = build_models(cfg, seed, dtype, device, compile=compile)
            checks[cfg.name] = workspace_checks(models, min(2, max(batches)), prompt_len, seed)
            per_batch = [{"batch": b, "rows": [asdict(r) for r in time_batch(models, b, prompt_len, new_tokens,
                                                                             warmups, repeats, seed)]}
                         for b in batches]
            if profile and i == len(cfgs) - 1:  # the last (largest) preset, at its largest batch
                prof = profile_workspace(models, max(batches), prompt_len, profile_steps, seed=seed)
        results.append({"preset": cfg.name, "threads": n_threads, "model": model_facts(models["opt"]),
                        "batches": per_batch})
        del models
    env["threads_by_preset"] = {r["preset"]: r["threads"] for r in results}
    env["threads"] = max(env["threads_by_preset"].values())  # the most any preset used; see threads_by_preset
    tol = TOLERANCE.get(dtype, 1e-4)
    passed = {
        "rewind_and_timers_exact": all(c["rewind_vs_fresh"] == 0 and c["timer_transparency"] == 0
                                       for c in checks.values()),
        f"optimised_vs_seed_le_{tol:g}": all(max(c["optimised_vs_seed"], c["slot_kv_cache_vs_seed"]) <= tol
                                             for c in checks.values()),
        f"compiled_vs_seed_le_{tol:g}": all(c.get("compiled_vs_seed", 0.0) <= tol for c in checks.values()),
        f"negative_controls_ge_{NEGATIVE_CONTROL_MIN:g}": all(
            min(c["negative_rewind_short"], c["negative_other_slots"]) >= NEGATIVE_CONTROL_MIN
            for c in checks.values()),
    }
    passed["passed"] = all(passed.values())
    doc = {
        "scope": "Untrained PRISME models (random init, readout U randomised), synthetic forced tokens and forced "
                 f"action traces; {device} microbenchmark of the workspace's decode cost",
        "environment": env,
        "protocol": {
            "rows": {r: {"actions": SEED_ROWS[r][0], "slots_per_action": SEED_ROWS[r][1]} for r in ROWS},
            "dense_row": "n DENSE actions (id A + 1, all M slots); dense16 at M = 16",
            "models": "same weights as cfg.optimised=True (opt; the slot K/V cache off, the default), with "
                      "cfg.slot_kv_cache=True too (opt_kv) and cfg.optimised=False (seed); with --compile also "
                      "the seed model with its editor compiled (compiled: prisme.compile.compile_editor, analytic "
                      "ops of the seed column, compiled once in the warm-up runs)",
            "batch_gt_1_budgets": "row b takes ceil((b + 1) n / B) actions then STOP (budget = that count)",
            "prompt_tokens": prompt_len, "decoded_tokens": new_tokens, "warmups": warmups, "repeats": repeats,
            "timer": "perf_counter_ns", "gradients": "torch.inference_mode", "path_order": "rotated each repeat",
            "gc": "collected before timing, disabled while timing",
            "sample": "N forced decode steps on a state prefilled once and rewound to P (untimed)",
            "split": "backbone step + LM head timed by wrappers inside decode_step; workspace = total - them",
            "analytic": "costs.trace_cost of the decoded traces at each position's own context T = P + i + 1",
            "share_ratio": "(workspace time / backbone time) / (workspace ops / backbone ops); backbone time = p50 "
                           "of the backbone step + LM head pooled over every row of the batch (identical work)",
            "target": f"share_ratio <= {TARGET_SHARE_RATIO} at batch 8 for every seed-000 row",
            "optimised_vs_seed": "paired geometric-mean time ratio of opt and opt_kv over seed (sample i of each "
                                 "from the same rotation), 95% bootstrap interval; met when its upper end is <= "
                                 f"{1 + OPTIMISED_SLOWDOWN_MAX:g} and 1 - upper end >= {OPTIMISED_TIME_SHARE_MIN:g} x "
                                 "the ops saving, at batch 8",
        },
        "checks": {"by_preset": checks, **passed},
        "presets": results,
        "target": target_summary(results),
        "profile": prof,
    }
    return doc


def target_summary(results: list[dict[str, Any]], batch: int = 8) -> dict[str, Any]:
    """share_ratio of every workspace row x model at `batch`, per preset, and whether it is <= 1.15."""
    out = {}
    for pr in results:
        for bt in pr["batches"]:
            if bt["batch"] != batch:
                continue
            rows = {f"{r['variant']}/{r['row']}": r["share_ratio"] for r in bt["rows"] if r["share_ratio"] is not None}
            out[pr["preset"]] = {"share_ratio": rows, "met": all(v <= TARGET_SHARE_RATIO for v in rows.values()),
                                 "optimised_vs_seed": optimised_vs_seed(bt["rows"])}
    return out


def time_ratio(a: Sequence[float], b: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """Geometric-mean time ratio a / b of paired samples (sample i of both paths comes from the same rotation of
    `time_paths`, so slow spells of the machine cancel) with its 95% bootstrap interval: (ratio, lo, hi)."""
    la, lb = torch.tensor(a, dtype=torch.float64).log(), torch.tensor(b, dtype=torch.float64).log()
    d = paired_bootstrap(la, lb, torch.ones_like(la), seed=seed)
    return math.exp(d.mean), math.exp(d.lo), math.exp(d.hi)


def optimised_vs_seed(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per workspace row, each optimised model ("opt", "opt_kv") against the seed model on the whole decode step:
    the paired time ratio with its 95% interval (`time_ratio`), the fraction of ops the model saves, and verdicts
    that follow from the interval: `not_slower` when its upper end is <= 1.03 (OPTIMISED_SLOWDOWN_MAX), `pays` when
    even that end saves at least half of the op saving (OPTIMISED_TIME_SHARE_MIN); `met` when both hold."""
    by = {(r["row"], r["variant"]): r for r in rows}
    out: dict[str, Any] = {}
    for variant in ("opt", "opt_kv"):
        per_row = {}
        for row in ROWS[1:]:
            o, s = by.get((row, variant)), by.get((row, "seed"))
            if not (o and s):
                continue
            ratio, lo, hi = time_ratio(o["samples_ms"], s["samples_ms"])
            ops_saving = 1 - o["analytic_ops_per_token"] / s["analytic_ops_per_token"]
            not_slower = hi <= 1 + OPTIMISED_SLOWDOWN_MAX
            pays = 1 - hi >= OPTIMISED_TIME_SHARE_MIN * ops_saving
            per_row[row] = {"time_ratio": ratio, "time_ratio_lo": lo, "time_ratio_hi": hi,
                            "time_saving": 1 - ratio, "ops_saving": ops_saving, "not_slower": not_slower,
                            "pays": pays, "met": not_slower and pays}
        if per_row:
            out[variant] = {"rows": per_row, "met": all(v["met"] for v in per_row.values())}
    return out


def format_workspace_table(doc: dict[str, Any]) -> str:
    """The human-readable report: checks, one table per preset x batch, the target, the optimised saving, profile."""
    env = doc["environment"]
    lines = [f"prisme bench workspace: {env['dtype']}, {env['device']}, {env['cpu']}, torch {env['torch']}, "
             f"{doc['protocol']['prompt_tokens']} prompt + {doc['protocol']['decoded_tokens']} decoded tokens, "
             f"p50 over {doc['protocol']['repeats']} repeats", ""]
    for name, c in doc["checks"]["by_preset"].items():
        lines.append(f"checks {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in c.items()))
    lines.append("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in doc["checks"].items()
                                        if k not in ("passed", "by_preset")))
    for pr in doc["presets"]:
        m = pr["model"]
        params = sum(m["parameters"].values())
        for bt in pr["batches"]:
            B = bt["batch"]
            lines += ["", f"{pr['preset']} ({params:,} parameters), {pr['threads']} thread(s), batch {B}"
                      + ("" if B == 1 else ": row b takes ceil((b+1) n / B) actions")]
            lines.append(f"  {'row':<18}{'model':>9}{'ms/step':>9}{'[p95]':>8}{'us/tok':>9}{'x bb':>7}"
                         f"{'ops x (seed/opt)':>17}{'bb ms':>8}{'ws ms':>8}{'mod ms':>8}{'ws us/tok':>10}{'ws/bb t':>8}"
                         f"{'ws/bb ops':>10}{'t/ops':>7}{'ws GF/s':>8}{'bb GF/s':>8}{'matmul/an':>10}")
            for r in bt["rows"]:
                has = r["share_ratio"] is not None
                mm = (r["measured_workspace_matmul_ops_per_token"] / r["analytic_workspace_ops_first_step"]
                      if has and r["analytic_workspace_ops_first_step"] else float("nan"))
                lines.append(
                    f"  {r['row']:<18}{r['variant']:>9}{r['step_ms_p50']:>9.3f}{r['step_ms_p95']:>8.3f}"
                    f"{r['token_us_p50']:>9.1f}{r['ratio_to_backbone_only']:>7.3f}"
                    f"{r['analytic_ratio_seed']:>9.3f}/{r['analytic_ratio_optimised']:<7.3f}"
                    f"{r['backbone_ms']:>8.3f}{r['workspace_ms']:>8.3f}{r['workspace_modules_ms']:>8.3f}"
                    f"{r['workspace_token_us']:>10.1f}"
                    f"{r['workspace_time_share']:>8.3f}{r['workspace_ops_share']:>10.3f}"
                    + (f"{r['share_ratio']:>7.2f}{r['workspace_gflops']:>8.2f}" if has else f"{'-':>7}{'-':>8}")
                    + f"{r['backbone_gflops']:>8.2f}" + (f"{mm:>10.3f}" if has else f"{'-':>10}"))
            if B > 1:
                lines.append("  actions per row: " + "; ".join(
                    f"{r['row']} {r['actions_per_row']}" for r in bt["rows"] if r["variant"] == "opt"))
            by = {(r["row"], r["variant"]): r for r in bt["rows"]}
            saving = []
            for row in ROWS[1:]:
                o, s = by.get((row, "opt")), by.get((row, "seed"))
                if o and s:
                    ops_saving = 1 - o["analytic_workspace_ops_per_token"] / s["analytic_workspace_ops_per_token"]
                    saving.append(f"{row} {s['workspace_ms'] - o['workspace_ms']:+.3f} ms "
                                  f"({1 - o['workspace_ms'] / s['workspace_ms']:.1%}; ops {ops_saving:.1%})")
            lines.append("  optimised saving in workspace time (seed - opt): " + ", ".join(saving))
            cache = []
            for row in ROWS[1:]:
                o, c = by.get((row, "opt")), by.get((row, "opt_kv"))
                if o and c:
                    ops_saving = 1 - c["analytic_workspace_ops_per_token"] / o["analytic_workspace_ops_per_token"]
                    cache.append(f"{row} {o['workspace_ms'] - c['workspace_ms']:+.3f} ms "
                                 f"({1 - c['workspace_ms'] / o['workspace_ms']:.1%}; ops {ops_saving:.1%})")
            if cache:
                lines.append("  slot K/V cache saving in workspace time (opt - opt_kv): " + ", ".join(cache))
            speed = [f"{row} {by[(row, 'seed')]['workspace_ms'] / by[(row, COMPILED)]['workspace_ms']:.2f}x"
                     for row in ROWS[1:] if (row, COMPILED) in by and (row, "seed") in by]
            if speed:
                lines.append("  compiled editor, workspace time seed / compiled: " + ", ".join(speed))
    lines += ["", "columns: ms/step = one decode step of B tokens (p50 [p95]); x bb = / backbone_only;",
              "  ops x = analytic total / backbone of the same traces (seed / optimised column);",
              "  bb ms = backbone step + LM head inside the row's steps; ws ms = total - bb (what the workspace adds);",
              "  mod ms = the part of ws ms inside the model's workspace methods (the rest: decode_step's checks and "
              "bookkeeping);",
              "  ws/bb t = ws ms / bb ms pooled over the batch's rows; t/ops = (ws/bb t) / (ws/bb ops), target <= "
              f"{TARGET_SHARE_RATIO} at batch 8;",
              "  GF/s = analytic ops per second; matmul/an = matmul ops counted on the first step / analytic"]
    for preset, t in doc["target"].items():
        lines.append(f"target at batch 8, {preset}: {'met' if t['met'] else 'NOT met'} ("
                     + ", ".join(f"{k} {v:.2f}" for k, v in t["share_ratio"].items()) + ")")
        for variant, o in t.get("optimised_vs_seed", {}).items():
            verdict = "met" if o["met"] else "NOT met"
            lines.append(f"  {variant} vs seed at batch 8, time ratio [95% interval] (met: <= "
                         f"{1 + OPTIMISED_SLOWDOWN_MAX:g} and a saving >= {OPTIMISED_TIME_SHARE_MIN:.0%} of the op "
                         f"saving, both at the interval's upper end): {verdict}")
            for row, v in o["rows"].items():
                lines.append(f"    {row:<18} x{v['time_ratio']:.3f} [{v['time_ratio_lo']:.3f}, "
                             f"{v['time_ratio_hi']:.3f}] for ops -{v['ops_saving']:.1%}: "
                             f"{'not slower' if v['not_slower'] else 'slower or not shown'}, "
                             f"{'pays' if v['pays'] else 'does not pay (or not shown)'}")
    prof = doc.get("profile")
    if prof:
        lines += ["", f"profile: {prof['preset']}, batch {prof['batch']}, {prof['decode_steps']} decode steps under "
                      "torch.profiler; everything outside the backbone and head, per decode step (profiler overhead "
                      "included: read shares and calls)"]
        for name, p in prof["rows"].items():
            meth = ", ".join(f"{k} {v:.0f}" for k, v in p["workspace_methods_us_per_step"].items())
            lines.append(f"  {name}: {p['top_level_aten_calls_per_step']:.0f} ATen calls/step for "
                         f"{p['mean_actions_per_position']:.2f} actions/position; us/step by method: {meth}")
            for t in p["top"][:8]:
                lines.append(f"    {t['op']:<50}{t['calls_per_step']:>7.1f} calls {t['self_us_per_step']:>9.1f} us"
                             f"{t['us_per_call']:>8.1f} us/call {t['share']:>6.1%}")
    return "\n".join(lines)


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def main(args: argparse.Namespace) -> int:
    """`prisme bench workspace`: print the table, then the JSON document as the last thing on stdout."""
    presets = ("demo",) if args.quick else tuple(p.strip() for p in args.presets.split(",") if p.strip())
    doc = run_workspace(presets=presets, batches=parse_ints(args.batches, "--batches"), prompt_len=args.prompt_len,
                        new_tokens=4 if args.quick else args.new_tokens, warmups=args.warmups,
                        repeats=2 if args.quick else args.repeats, threads=None if args.threads < 0 else args.threads,
                        seed=args.seed, dtype=DTYPES[args.dtype], device=args.device, profile=args.profile,
                        profile_steps=args.profile_steps, compile=getattr(args, "compile", False))
    return emit(doc, format_workspace_table(doc), args.json)
