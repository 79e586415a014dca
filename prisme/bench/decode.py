"""`prisme bench decode`: one decode step of a router model by part, time against ops, next to its backbone's step.

For each shape (the recall frontier's winners at T = 32 and at T = 1,024, each PRISME model with its router beside
its dense rival, `shapes`; the `demo` preset with a router; untrained weights) and batch size, greedy
`prisme.generate` runs, interleaved and rotated each repeat, on the same prompts:
  * `backbone`: the PRISME model at budget 0 (its backbone alone: the reference step);
  * `routed_off`: budget 1, the router at a price where it never fires;
  * `routed`: budget 1, at the price where `--edit-rate` of the positions edit (the deployed price of the study's
    winners: 12.5 % at T = 32, 0.76 % (d = 16) and 0.47 % (d = 8) at T = 1,024; `DEPLOYED_EDIT_RATE`), read from
    the router's own scores on the backbone's greedy continuation of the prompts;
  * `dense` (recall shapes): the dense winner alone;
  * with `--compile`, `off_compiled` and `routed_compiled`: the same two policies with the editor under
    `torch.compile` (the deployed step's fired rows as fixed-shape graphs, `prisme.model.fired`; `COMPILED`: the same
    model through its decode state's execution options),
    the backbone and the router eager.
Per path: ms per generated step and tokens/s (the first, which holds the prefill, is not counted), ops per token
(`prisme.costs`, each position at its own context, the traces the run took), the decode state at the whole
sequence (bytes: the K/V cache, a ring of W slots under a window, and the source bank), and the summary figure: time
over the backbone's step divided by ops over the backbone's (`t_over_ops`; 1.0 = time follows ops). One
instrumented run per path splits the step by part (backbone, bank, router, decision, editor, readout; `loop` is the
rest: generate's own loop and the state's bookkeeping), with the ops of each part beside it.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prisme.bench import MIN_NEW_TOKENS
from prisme.bench.harness import Timed, emit, make_tokens, model_facts, parse_ints, time_paths, torch_threads
from prisme.checks import one_of, parse_list
from prisme.config import PrismeConfig
from prisme.costs.traces import run_cost
from prisme.decoding.generate import generate, generate_stream
from prisme.model.policy import Controller
from prisme.model.prisme import PrismeModel
from prisme.model.state import DecodeState
from prisme.options import DecodeOptions, ExecutionOptions, Runtime

PARTS = ("backbone", "bank", "router", "decision", "editor", "readout", "loop")
PART_TERMS = {"backbone": ("backbone_linear", "backbone_attention", "backbone_key_shift"),
              "bank": ("bank_projection", "bank_shift"), "router": ("router",), "decision": (),
              "editor": ("editor_source_attn", "editor_slot_attn", "editor_ffn", "editor_gate", "controller",
                         "controller_input", "controller_bank", "controller_entropy"),
              "readout": ("readout", "lm_head"), "loop": ()}
OFF_PRICE = 1e9  # no score beats it: the router never fires


# ------------------------------------------------------------------------------------------------------------ shapes
RECALL_SHAPES = ("recall_T32", "recall_T1024", "recall_T1024_d8", "recall_d24_w32")
LONG_MEMBER = {"recall_T1024": 16, "recall_T1024_d8": 8}  # the long-context study's member (its backbone width)
SHAPES = (*RECALL_SHAPES, "demo", "tiny")
LONG_PROMPT = 1000  # recall_T1024's default prompt: the steps timed decode at contexts 1,001..1,023


def shapes(names: list[str], tables: bool, seed: int, store: str = "entries"
           ) -> list[tuple[str, PrismeModel, PrismeModel | None]]:
    """(name, PRISME model with a router, dense rival or None) per shape name: recall_T32 (the recall frontier's
    winners at T = 32: PRISME d=16/w=32, dense 1 layer d=8 with the key shift), recall_T1024 (the long-context winners
    at T = 1,024: PRISME d=16/w=32 on a 64-position-window key-shift backbone with a router that reads the token, the
    study's member; dense 1 layer d=16 with the key shift and global attention), recall_T1024_d8 (the same with the
    study's cheapest passing member, d=8), recall_d24_w32 (the winners before the key shift: PRISME d=24/w=32, dense 2
    layers d=24), demo, tiny. A recall shape's PRISME model decodes with its bank served from tables (`tables`) and
    kept as `store` (its `decode_options`)."""
    out = []
    for name in names:
        dense = None
        if name in RECALL_SHAPES:
            from prisme.studies.recall_context import recipe_at
            from prisme.studies.recall_frontier import dense_config, family_config
            from prisme.studies.recall_setup import RecallStudyConfig, family_entry, load_recipe

            study = RecallStudyConfig(frontier=True, contexts=[1024])
            recipe, _ = load_recipe(study)
            if name == "recall_d24_w32":
                cfg, dense_cfg = family_config(recipe, 24, 32), dense_config(recipe, 2, 24)
            elif name == "recall_T32":
                cfg, dense_cfg = family_config(recipe, 16, 32), dense_config(recipe, 1, 8, True)
            else:
                r = recipe_at(study, recipe, 1024)  # the study's member, as its family lists it
                m = next(family_entry(e, "context_family") for e in study.context_family
                         if family_entry(e, "context_family").d == LONG_MEMBER[name])
                cfg = family_config(r, m.d, m.w, m.attn_window, m.key_shift, m.router_token)
                dense_cfg = dense_config(r, 1, 16, True)
            decode = DecodeOptions(bank_tables=tables, bank_store=store)
            dense = seeded_model(dense_cfg, seed)
        elif name in ("demo", "tiny"):
            cfg, decode = PrismeConfig.from_name(name, router=True), None
        else:
            raise ValueError(f"--shapes: unknown shape {name!r} ({', '.join(SHAPES)})")
        out.append((name, seeded_model(cfg, seed, decode), dense))
    return out


DEPLOYED_EDIT_RATE = {"recall_T1024": 0.0076, "recall_T1024_d8": 0.0047}  # the share of positions the study's
#   members edit at their prices on seeds 30-34 (d = 16: 0.62-0.92 %, d = 8: 0.39-0.54 %; their four queries and a
#   few others); 12.5 % for every other shape (T = 32: four queries in 32 positions)


def edit_rate(name: str, given: float | None) -> float:
    """The share of positions the `routed` path's price edits: `given` (--edit-rate), else the shape's own."""
    return given if given is not None else DEPLOYED_EDIT_RATE.get(name, 0.125)


def prompt_length(name: str, given: int | None) -> int:
    """The prompt of shape `name`: `given` (--prompt-len), else 8 (LONG_PROMPT for recall_T1024)."""
    return given if given is not None else LONG_PROMPT if name in LONG_MEMBER else 8


def seeded_model(cfg: PrismeConfig, seed: int, decode: DecodeOptions | None = None) -> PrismeModel:
    """An untrained PRISME model (or dense backbone) of `cfg`, seeded (the global RNG is left alone), in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return PrismeModel(cfg, decode).eval()


@torch.no_grad()
def deployed_price(model: PrismeModel, tokens: torch.Tensor, edit_rate: float, start: int = 0) -> float:
    """The lambda at which the router fires at `edit_rate` of the positions `start..` of `tokens` `[B, T]`: a position
    fires iff lambda < max_a value_a / cost_a over the actions of positive value, so the price is that ratio's
    quantile."""
    ctx = model.encode(tokens)
    ratio = fire_ratio(model.router_values(ctx)[:, start:], model.action_cost).flatten()  # [B (T - start)]
    return float(torch.quantile(ratio.double(), 1 - edit_rate))


def fire_ratio(value: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
    """The price below which each position fires, from the router's values `[..., A]` and the actions' costs `[A]`:
    the best value / cost over the actions of positive value (0 where none has one) `[...]`."""
    return (value / cost).masked_fill(value <= 0, 0).amax(-1)


# ------------------------------------------------------------------------------------------------------------ timing
class PartTimer:
    """Wall time per part of the decode step, from wrappers installed on the model and on the decode modules (an
    outer part's time includes what it calls: nothing is counted twice)."""

    def __init__(self, model: PrismeModel):
        import prisme.model.bank.cache as bank_cache
        import prisme.model.plans.budget1 as budget1
        import prisme.model.plans.routed as routed

        self.ns = dict.fromkeys(PARTS, 0)
        self._active = False
        self._undo: list[Callable[[], None]] = []
        for obj, attr, part in ((model, "streams", "backbone"), (bank_cache, "step_entries", "bank"),
                                (routed, "router_scores", "router"), (budget1, "router_scores", "router"),
                                (budget1, "fired_groups", "decision"), (budget1, "edit_group", "editor"),
                                (model.readout, "forward", "readout"), (model.readout, "edited", "readout"),
                                (bank_cache.BankCache, "view", "bank"), (bank_cache.BankCache, "read", "bank"),
                                (routed, "rollout_policy", "editor"), (model, "query_state", "editor"),
                                (model, "logits_from_state", "readout"),
                                (model.backbone, "head", "readout"), (model.backbone, "final_norm", "readout"),
                                (model.backbone, "logits", "readout")):
            self._patch(obj, attr, part)

    def _patch(self, obj: Any, attr: str, part: str) -> None:
        fn, own = getattr(obj, attr), attr in vars(obj)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._active:
                return fn(*args, **kwargs)
            self._active = True
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[part] += time.perf_counter_ns() - t0
                self._active = False

        setattr(obj, attr, timed)
        self._undo.append((lambda: setattr(obj, attr, fn)) if own else (lambda: delattr(obj, attr)))

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()


def _steps_ms(model: PrismeModel, prompts: torch.Tensor, n_new: int, policy: dict) -> float:
    """Mean ms per generated step after the first (which holds the prefill)."""
    marks = [time.perf_counter_ns()]
    for _ in generate_stream(model, prompts, n_new, **policy):
        marks.append(time.perf_counter_ns())
    return (marks[-1] - marks[2]) / 1e6 / (len(marks) - 3)


COMPILED = Runtime(execution=ExecutionOptions(compile="auto"))
"""`--compile`'s paths: the same model with the editor under `torch.compile` (the deployed step's fired rows as
fixed-shape graphs, `prisme.model.fired`; the router's decision and the backbone stay eager), through the decode
state's execution options (`prisme.options.Runtime`): no copy of the weights."""


@dataclass(frozen=True)
class PlannedShape:
    """One shape as `plan` checked it: its PRISME model with a router, its dense rival (None: none), and the prompt
    and new tokens each of its rows decodes."""

    name: str
    model: PrismeModel
    dense: PrismeModel | None
    prompt_len: int
    new_tokens: int  # `--new-tokens`, or fewer where the shape's T_max leaves less room after its prompt


def measure(shape: PlannedShape, batch: int, repeats: int, edit_rate: float, seed: int,
            compile: bool = False) -> dict[str, Any]:
    """Every path of one shape at one batch size: time, ops, parts (module docstring); with `compile` also
    `off_compiled` and `routed_compiled` (the same model, its editor compiled: `COMPILED`), in the same rotation."""
    name, model, dense, prompt_len, n_new = shape.name, shape.model, shape.dense, shape.prompt_len, shape.new_tokens
    cfg = model.cfg
    prompts = make_tokens(cfg.vocab_size, batch, prompt_len, seed)
    # the price is read on the trajectory decoded: the backbone's greedy tokens, at the positions that generate
    seq = torch.cat([prompts, torch.tensor(generate(model, prompts, n_new).tokens, device=prompts.device)], 1)
    price = deployed_price(model, seq[:, :-1], edit_rate, start=prompt_len - 1)
    paths = {"backbone": (model, {}), "routed_off": (model, dict(policy=Controller(1, lambda_cost=OFF_PRICE))),
             "routed": (model, dict(policy=Controller(1, lambda_cost=price)))}
    if compile:
        paths["off_compiled"] = (model, {**paths["routed_off"][1], "runtime": COMPILED})
        paths["routed_compiled"] = (model, {**paths["routed"][1], "runtime": COMPILED})
    if dense is not None:
        paths["dense"] = (dense, {})
    names = list(paths)
    samples = time_paths([(k, lambda: None, lambda _, m=m, kw=kw: Timed(_steps_ms(m, prompts, n_new, kw)))
                          for k, (m, kw) in paths.items()], 1, repeats, inference=False)
    rows: dict[str, Any] = {}
    for k in names:
        m, policy = paths[k]
        out = generate(m, prompts, n_new, **policy)
        ctx = [p + i for p, row in zip(out.prompt_lengths, out.tokens) for i in range(len(row))]  # own contexts
        rt = policy.get("runtime") or Runtime()
        tc = run_cost(m, torch.cat(out.actions) if "policy" in policy else None, ctx,
                      [s for row in out.controller_steps for s in row], m.cfg.router and "policy" in policy,
                      rt.decode, rt.execution)  # as its decode state ran
        per = tc.per_token_by_component
        timer = PartTimer(m) if m.cfg.use_workspace else None
        try:
            t0 = time.perf_counter_ns()
            _steps_ms(m, prompts, n_new, policy)
            total = time.perf_counter_ns() - t0
        finally:
            if timer is not None:
                timer.close()
        ns = timer.ns if timer is not None else dict.fromkeys(PARTS, 0)
        ns["loop"] = total - sum(ns.values())
        ms = float(np.median(samples[k]))
        rows[k] = {"ms_per_step": ms, "samples_ms": samples[k], "tokens_per_s": batch * 1000.0 / ms,
                   "state_bytes": DecodeState(m, batch, m.cfg.max_seq_len).nbytes,  # K/V cache + bank, whole sequence
                   "ops_per_token": tc.ops_per_token,
                   "edits_per_token": float(np.mean([e > 0 for row in out.n_edits for e in row])),
                   "parts": {p: {"share_of_time": ns[p] / max(total, 1),
                                 "ops_per_token": sum(per.get(c, 0.0) for c in PART_TERMS[p])} for p in PARTS}}
    base = rows["backbone"]
    for row in rows.values():
        row["time_ratio"] = row["ms_per_step"] / base["ms_per_step"]
        row["ops_ratio"] = row["ops_per_token"] / base["ops_per_token"]
        row["t_over_ops"] = row["time_ratio"] / row["ops_ratio"]
    return {"shape": name, "batch": batch, "deployed_price": price, "model": model_facts(model),
            "bank_tables": model.decode_options.bank_tables, "bank_store": model.decode_options.bank_store,
            "rows": rows}


# ------------------------------------------------------------------------------------------------------------ output
def format_table(results: list[dict[str, Any]], verdicts: list[dict[str, Any]] = ()) -> str:
    lines = [f"{'shape':<16}{'B':>3}  {'path':<16}{'ms/step':>8}{'tok/s':>8}{'KiB':>6}{'ops/tok':>9}{'edits':>6}"
             f"{'t x':>6}{'ops x':>6}{'t/ops':>6}  share of time by part (ops x of the backbone step)"]
    lines.append("-" * 146)
    for res in results:
        for k, row in res["rows"].items():
            base = res["rows"]["backbone"]["ops_per_token"]
            parts = "  ".join(f"{p} {v['share_of_time']:.0%}" + (f" ({v['ops_per_token'] / base:.2f})"
                                                                 if v["ops_per_token"] else "")
                              for p, v in row["parts"].items() if v["share_of_time"] > 0.005 or v["ops_per_token"])
            lines.append(f"{res['shape']:<16}{res['batch']:>3}  {k:<16}{row['ms_per_step']:>8.3f}"
                         f"{row['tokens_per_s']:>8.0f}{row['state_bytes'] / 1024:>6.0f}{row['ops_per_token']:>9.0f}"
                         f"{row['edits_per_token']:>6.2f}{row['time_ratio']:>6.2f}"
                         f"{row['ops_ratio']:>6.2f}{row['t_over_ops']:>6.2f}  {parts}")
    word = {True: "met", False: "missed"}
    for v in verdicts:
        lines.append(f"targets, {v['shape']} batch {v['batch']} (t/ops never firing <= 1.25, deployed <= 1.5): eager "
                     f"{word[v['eager']]}" + ("" if v["compiled"] is None else f", compiled {word[v['compiled']]}"))
    return "\n".join(lines)


def plan(args: argparse.Namespace) -> list[PlannedShape]:
    """Every option checked and every shape built before anything is timed: a `PlannedShape` per shape. The new
    tokens are `--new-tokens`, or fewer where a shape's T_max leaves less room after its prompt (a note on stderr says
    so; the JSON records what ran); ValueError naming the option."""
    names = parse_list(args.shapes, "--shapes", one_of(SHAPES), example="recall_T32,demo", distinct=True)
    for option, value, lo in (("--repeats", args.repeats, 1), ("--new-tokens", args.new_tokens, MIN_NEW_TOKENS),
                              ("--prompt-len", args.prompt_len, 1)):
        if value is not None and (not isinstance(value, int) or value < lo):
            raise ValueError(f"{option} must be an integer >= {lo}, got {value!r}")
    if args.edit_rate is not None and not 0 < args.edit_rate < 1:
        raise ValueError(f"--edit-rate must lie in (0, 1), got {args.edit_rate}")
    if args.no_tables and args.bank_store == "ids":
        raise ValueError("--bank-store ids looks the bank up from its tables: it cannot go with --no-tables")
    out = []
    for name, model, dense in shapes(names, not args.no_tables, args.seed, args.bank_store):
        prompt, t_max = prompt_length(name, args.prompt_len), model.cfg.max_seq_len
        room = t_max - prompt
        if room < MIN_NEW_TOKENS:
            raise ValueError(f"{name}: --prompt-len {prompt} leaves {max(room, 0)} of its {t_max} positions for new "
                             f"tokens; the step is timed over at least {MIN_NEW_TOKENS}: pass --prompt-len "
                             f"{t_max - MIN_NEW_TOKENS} or less")
        n_new = min(args.new_tokens, room)
        if n_new < args.new_tokens:
            print(f"note: {name}: --new-tokens {args.new_tokens} is more than its T_max = {t_max} leaves after the "
                  f"{prompt}-token prompt; it decodes {n_new} (recorded in the JSON)", file=sys.stderr, flush=True)
        out.append(PlannedShape(name, model, dense, prompt, n_new))
    return out


def _met(result: dict[str, Any], off: str, routed: str) -> bool:
    """Whether one shape and batch meets both targets on a plan: its never-firing step at t/ops <= 1.25, its deployed
    step at <= 1.5."""
    return result["rows"][off]["t_over_ops"] <= 1.25 and result["rows"][routed]["t_over_ops"] <= 1.5


def main(args: argparse.Namespace) -> int:
    batches = parse_ints(args.batches, "--batches")
    planned = plan(args)
    results = []
    with torch_threads(args.threads), torch.inference_mode():
        for shape in planned:
            for B in batches:
                results.append(measure(shape, B, args.repeats, edit_rate(shape.name, args.edit_rate), args.seed,
                                       args.compile))
    verdicts = [{"shape": r["shape"], "batch": r["batch"], "eager": _met(r, "routed_off", "routed"),
                 "compiled": _met(r, "off_compiled", "routed_compiled") if args.compile else None} for r in results]
    t_ok = [v["eager"] for v in verdicts]
    finite = all(math.isfinite(v) for r in results for row in r["rows"].values()
                  for v in (row["ms_per_step"], row["t_over_ops"]))
    names = [p.name for p in planned]
    doc = {"bench": "decode", "environment": {"torch": torch.__version__, "python": platform.python_version(),
                                              "machine": platform.machine(), "processor": platform.processor(),
                                              "threads": torch.get_num_threads() if args.threads < 1 else args.threads,
                                              "device": "cpu",
                                              "mode": "eager" + (" and compiled editor" if args.compile else "")},
           "settings": {"shapes": names, "batches": list(batches),
                        "prompt_len": {p.name: p.prompt_len for p in planned},
                        "new_tokens": {p.name: p.new_tokens for p in planned}, "new_tokens_asked": args.new_tokens,
                        "repeats": args.repeats, "edit_rate": {n: edit_rate(n, args.edit_rate) for n in names},
                        "bank_tables": not args.no_tables, "bank_store": args.bank_store, "seed": args.seed},
           "results": results,
           "targets": {"routed_off_t_over_ops": 1.25, "routed_t_over_ops": 1.5, "met": bool(t_ok) and all(t_ok),
                       "met_compiled": (bool(verdicts) and all(v["compiled"] for v in verdicts)) if args.compile
                       else None,
                       "by_shape": verdicts},
           # a measurement: the targets are reported, not enforced; the verdict is only from rows it measured
           "checks": {"rows_measured": len(results), "timings_finite": finite, "passed": bool(results) and finite}}
    return emit(doc, format_table(results, verdicts), args.json)
