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
    recomputes every slot's K/V), with the slot K/V cache on too ("opt_kv": `ExecutionOptions(slot_kv_cache=True)`)
    and as `cfg.optimised=False` ("seed": seed 000's accounting), so each saving of the optimised column shows in
    time. The readout's U (zero at init, which would hide every edit from the logits) gets random weights, so the
    checks see the workspace;
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from prisme.bench.harness import emit, model_facts, parse_ints, parse_names, percentiles, time_paths, torch_threads
from prisme.bench.workspace_paths import (
    COMPILED,
    PATHS,
    ROWS,
    VARIANTS,
    SplitTimer,
    _decode,
    _Path,
    _paths,
    build_models,
    make_sequence,
    rewind_path,
    row_plan,
)
from prisme.bench.workspace_profile import profile_workspace
from prisme.bench.workspace_report import (
    OPTIMISED_SLOWDOWN_MAX,
    OPTIMISED_TIME_SHARE_MIN,
    TARGET_SHARE_RATIO,
    format_workspace_table,
    target_summary,
)
from prisme.config import PrismeConfig
from prisme.costs.analytic import BACKBONE, COMPONENTS, SEED_ROWS
from prisme.costs.counting import OpsCounter
from prisme.costs.traces import trace_cost
from prisme.io import environment
from prisme.model.policy import Forced
from prisme.model.prisme import PrismeModel
from prisme.model.state import DecodeState

DEFAULT_PRESETS = ("demo", "prisme_103m")
DEFAULT_THREADS = {"prisme_103m": 2, "prisme_459m": 2}  # other presets: 1
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 5e-2}  # optimised vs seed logits
NEGATIVE_CONTROL_MIN = 1e-3
WORKSPACE_COMPONENTS = tuple(c for c in COMPONENTS if c not in BACKBONE)


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
              optimised: bool | str, steps: int | None = None) -> tuple[float, float]:
    """(total, backbone) ops per token of decoding N tokens (or the first `steps`) at contexts P + 1 ... P + N."""
    n_steps = N if steps is None else steps
    contexts = [P + i + 1 for _ in range(batch) for i in range(n_steps)]  # row-major: row b, step i
    traces = None if acts is None else acts.repeat_interleave(n_steps, dim=0)  # [B N, n]
    tc = trace_cost(cfg, traces, contexts, None, optimised)
    return tc.total_ops / tc.n_positions, tc.backbone_ops / tc.n_positions


def _measured_workspace_ops(model: PrismeModel, state: DecodeState, P: int, token: torch.Tensor,
                            acts: torch.Tensor | None, budget: torch.Tensor | None) -> float:
    """Matmul ops per token of the workspace components in one decode step, counted by `OpsCounter`."""
    state.rewind(P)
    with torch.inference_mode(), OpsCounter(model) as oc:
        state.decode_step(token, policy=None if acts is None else Forced(acts, budget=budget))
    return sum(oc.by_component[c] for c in (*WORKSPACE_COMPONENTS, "untagged")) / token.shape[0]


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
                p.state.rewind(P)
                sync()
                st.reset()
                return p
            return go

        def run(p: _Path) -> None:
            for i in range(N):
                p.state.decode_step(new[:, i:i + 1], policy=None if p.acts is None else Forced(p.acts, p.budget))
            sync()
            splits[p.name].append(dict(st.ns))

        samples = time_paths([(p.name, setup(p), run) for p in paths], warmups, repeats, dev)
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
        column = p.model.execution.column  # the cost model's column, as the path's editor runs
        total, backbone = _analytic(pc, acts, batch, P, N, column(pc.optimised))
        seed_total, _ = _analytic(pc, acts, batch, P, N, False)
        opt_total, _ = _analytic(pc, acts, batch, P, N, column(True))
        first_total, first_bb = _analytic(pc, acts, batch, P, N, column(pc.optimised), steps=1)
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


# -------------------------------------------------------------------------------------------------------------- report
@dataclass(frozen=True)
class WorkspaceBenchOptions:
    """How `run_workspace` times its presets. Checked here, once: the lengths and counts (the batch sizes with the
    presets, and the lengths against each preset's T_max, in `run_workspace`)."""

    batches: Sequence[int] = (1, 8)  # batch sizes (B > 1: ragged budgets)
    prompt_len: int = 128  # prompt tokens, prefilled untimed
    new_tokens: int = 16  # forced decode steps per timed sample
    warmups: int = 1  # untimed repeats before timing
    repeats: int = 5  # timed repeats per row x model
    threads: int | None = None  # torch CPU threads for every preset (None: `DEFAULT_THREADS`, else 1)
    seed: int = 42  # weights, tokens and action traces
    dtype: torch.dtype = torch.float32  # of the timed models
    device: str = "cpu"  # cpu or cuda
    profile: bool = False  # profile the workspace's ATen ops (last preset, largest batch)
    profile_steps: int = 4  # decode steps per profiled row
    compile: bool = False  # also time the seed model with its editor under torch.compile (variant "compiled")

    def __post_init__(self) -> None:
        if (self.prompt_len < 2 or self.new_tokens < 1 or self.warmups < 0 or self.repeats < 1
                or self.profile_steps < 1):
            raise ValueError(f"need prompt_len >= 2, new_tokens >= 1, warmups >= 0, repeats >= 1 and profile_steps "
                             f">= 1; got {self.prompt_len}, {self.new_tokens}, {self.warmups}, {self.repeats}, "
                             f"{self.profile_steps}")


def run_workspace(presets: Sequence[str | PrismeConfig] = DEFAULT_PRESETS,
                  options: WorkspaceBenchOptions | None = None) -> dict[str, Any]:
    """The whole protocol (module docstring) on each preset (`options`: default `WorkspaceBenchOptions()`); returns
    the JSON document.

    presets: preset names or configs (each needs a workspace and r_max >= 8).
    """
    o = options if options is not None else WorkspaceBenchOptions()
    if not presets or not o.batches or any(b < 1 for b in o.batches):
        raise ValueError(f"need presets and batch sizes >= 1, got {list(presets)} and {list(o.batches)}")
    if o.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but CUDA is not available")
    cfgs = [p if isinstance(p, PrismeConfig) else PrismeConfig.from_name(p) for p in presets]
    for cfg in cfgs:
        if not cfg.use_workspace:
            raise ValueError(f"preset {cfg.name!r} has no workspace (use_workspace=False)")
        for row in ROWS:
            row_plan(cfg, row, 1)
        if o.prompt_len + o.new_tokens > cfg.max_seq_len:
            raise ValueError(f"prompt {o.prompt_len} + {o.new_tokens} new tokens exceeds T_max={cfg.max_seq_len} of "
                             f"preset {cfg.name!r}")
    env = environment(dtype=o.dtype, seed=o.seed)
    env["device"] = o.device
    if o.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(o.device))
        env["cuda"] = torch.version.cuda
    results, checks, prof = [], {}, None
    for i, cfg in enumerate(cfgs):
        n_threads = DEFAULT_THREADS.get(cfg.name, 1) if o.threads is None else o.threads
        with torch_threads(n_threads):
            models = build_models(cfg, o.seed, o.dtype, o.device, compile=o.compile)
            checks[cfg.name] = workspace_checks(models, min(2, max(o.batches)), o.prompt_len, o.seed)
            per_batch = [{"batch": b, "rows": [asdict(r) for r in time_batch(models, b, o.prompt_len, o.new_tokens,
                                                                             o.warmups, o.repeats, o.seed)]}
                         for b in o.batches]
            if o.profile and i == len(cfgs) - 1:  # the last (largest) preset, at its largest batch
                prof = profile_workspace(models, max(o.batches), o.prompt_len, o.profile_steps, seed=o.seed)
        results.append({"preset": cfg.name, "threads": n_threads, "model": model_facts(models["opt"]),
                        "batches": per_batch})
        del models
    env["threads_by_preset"] = {r["preset"]: r["threads"] for r in results}
    env["threads"] = max(env["threads_by_preset"].values())  # the most any preset used; see threads_by_preset
    tol = TOLERANCE.get(o.dtype, 1e-4)
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
                 f"action traces; {o.device} microbenchmark of the workspace's decode cost",
        "environment": env,
        "protocol": {
            "rows": {r: {"actions": SEED_ROWS[r][0], "slots_per_action": SEED_ROWS[r][1]} for r in ROWS},
            "dense_row": "n DENSE actions (id A + 1, all M slots); dense16 at M = 16",
            "models": "same weights as cfg.optimised=True (opt; the slot K/V cache off, the default), with "
                      "ExecutionOptions(slot_kv_cache=True) too (opt_kv) and cfg.optimised=False (seed); with "
                      "--compile also the seed model with its editor compiled (compiled: "
                      "prisme.model.compiled.compile_editor, "
                      "analytic ops of the seed column, compiled once in the warm-up runs)",
            "batch_gt_1_budgets": "row b takes ceil((b + 1) n / B) actions then STOP (budget = that count)",
            "prompt_tokens": o.prompt_len, "decoded_tokens": o.new_tokens, "warmups": o.warmups, "repeats": o.repeats,
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


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def main(args: argparse.Namespace) -> int:
    """`prisme bench workspace`: print the table, then the JSON document as the last thing on stdout."""
    presets = ("demo",) if args.quick else parse_names(args.presets, "--presets")
    options = WorkspaceBenchOptions(batches=parse_ints(args.batches, "--batches"), prompt_len=args.prompt_len,
                                    new_tokens=4 if args.quick else args.new_tokens, warmups=args.warmups,
                                    repeats=2 if args.quick else args.repeats,
                                    threads=None if args.threads < 0 else args.threads, seed=args.seed,
                                    dtype=DTYPES[args.dtype], device=args.device, profile=args.profile,
                                    profile_steps=args.profile_steps, compile=getattr(args, "compile", False))
    doc = run_workspace(presets, options)
    return emit(doc, format_workspace_table(doc), args.json)
