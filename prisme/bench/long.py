"""`prisme bench long`: PRISME against dense attention at long contexts and real widths, decode and prefill.

The regime sparse attention is for: models hundreds of dimensions wide, contexts of thousands of positions, where a
dense model's keys and values are the memory each step reads. For each shape (`SHAPES`: a byte-level model of width d
and L layers, head size 64; untrained weights, whose cost does not depend on their values) and context T:

  * `dense`: L layers of global attention (the dense rival); `dense_ks`: the same with the key shift;
  * `backbone`: PRISME's backbone alone (L layers at a 64-position window with the key shift; budget 0, the bank
    still kept, as `bench decode`'s reference step);
  * `routed_off`: PRISME at budget 1 with its router at a price where it never fires;
  * `routed`: the deployed step, at the price where `--edit-rate` of the timed positions edit (the router's own scores
    on those positions: the price between the k-th and (k+1)-th best of their value / cost ratios).

Decode: every path's state is filled synthetically to T - n positions (`DecodeState.fill_synthetic`: a step's cost
does not depend on what the cache holds), then the same n teacher-forced tokens are decoded one step at a time, so
each path runs the same positions and the routed path fires at exactly the positions its price picks. The paths are
rotated each round (one warm-up round), medians reported. Per row: ms per step, tokens/s, ops per token
(`prisme.costs.trace_cost`, each position at its own context and trace), time and ops against the dense row, their
ratio (`t_over_ops`: 1.0 = time follows ops), the decode state's bytes, the peak tensor memory of the path's decode
(the state's bytes and the most the same steps hold beyond it at once, run again under the profiler; the weights not
counted; `harness.peak_memory`), and the edits per token. With `--prefill`,
each model's prefill of a whole T-token prompt at batch 1 (the routed path at its price, logits of the last position).
With `--train`, a training step on one T-token sequence (`train_ms`): each dense model's, PRISME's backbone stage and
its workspace stage at `--train-positions` drawn positions (`StageConfig.workspace_positions`).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from prisme.bench.decode import OFF_PRICE, fire_ratio, seeded_model
from prisme.bench.harness import (
    Timed,
    TimedPath,
    bench_device,
    emit,
    make_tokens,
    peak_memory,
    time_paths,
    torch_threads,
)
from prisme.checks import integer, one_of, parse_list
from prisme.config import PrismeConfig
from prisme.costs import trace_cost
from prisme.devices import check_fits, synchronize
from prisme.model.policy import Controller
from prisme.model.prisme import PrismeModel, decode_state_bytes
from prisme.options import DecodeOptions

SHAPES = {"d256_L2": (256, 2), "d512_L2": (512, 2), "d256_L4": (256, 4), "d64_L2": (64, 2)}  # (width, layers);
#   d64_L2: a smoke shape (tests)
WINDOW = 64  # PRISME's backbone window (the long-context studies')
HEAD_DIM = 64
PATHS = ("dense", "dense_ks", "backbone", "routed_off", "routed")
TARGETS = {"batch1_speedup_T16384": 5.0, "batch8_speedup_T16384": 5.0, "t_over_ops_T16384": 1.5,
           "batch8_speedup_T65536": 15.0, "prefill_speedup_T16384": 3.0, "train_speedup_T16384": 3.0}  # reported


def configs(shape: str, T_max: int, source: str, copy_head: bool = False) -> dict[str, PrismeConfig]:
    """The models of one shape at capacity `T_max`: PRISME (the demo's workspace on a 64-window key-shift backbone of
    the shape's width and depth, with a router; its bank from `source`) and its two dense rivals; with `copy_head`,
    every one of them with the copy head (`prisme.model.copy`, the code recipe's read: the dense rivals get the same
    help)."""
    d, L = SHAPES[shape]
    base = dict(d_model=d, n_layer=L, n_head=d // HEAD_DIM, n_kv_head=d // HEAD_DIM, max_seq_len=T_max,
                cost_context=T_max, **(dict(copy_head=True, copy_stream=16) if copy_head else {}))
    prisme = PrismeConfig.from_name("demo", **base, router=True, attn_window=WINDOW, key_shift=True,
                                    bank_source=source, bank_shift=source == "embedding")
    dense = PrismeConfig.from_name("demo", **base, use_workspace=False)
    return {"prisme": prisme, "dense": dense, "dense_ks": PrismeConfig.from_name("demo", **base, use_workspace=False,
                                                                                   key_shift=True)}


@dataclass(frozen=True)
class Case:
    """One shape at one context and batch: its models, the timed tokens and how many steps decode."""

    shape: str
    context: int
    batch: int
    steps: int
    models: dict[str, PrismeModel]
    tokens: torch.Tensor  # [B, steps]: teacher-forced, the same for every path


def _ratios(model: PrismeModel, state, tokens: torch.Tensor) -> torch.Tensor:
    """The router's best value / cost ratio at each timed position `[B, n]` (a position fires at price lambda iff
    lambda < its ratio; non-positive values never fire: 0), read on the same steps the timed paths run."""
    router, seen = model.router, []
    scores = router.scores

    def record(H, s, cost, lam, normed=None, tok=None):
        value = scores(H, s, cost, 0.0, normed, tok)  # [B, 1, A]: lambda 0 leaves the values
        seen.append(fire_ratio(value, cost))
        return scores(H, s, cost, lam, normed, tok)

    router.scores = record
    start = state.lengths[0]
    try:
        for _ in range(2):  # the second pass reads what every timed pass reads: a ring's slots before `start` and
            #   the shift memories hold the first pass's last positions, as after any timed pass
            seen.clear()
            state.fill_synthetic(start, draw=False)
            for i in range(tokens.shape[1]):
                state.decode_step(tokens[:, i:i + 1], policy=Controller(1, lambda_cost=OFF_PRICE))
    finally:
        del router.scores
    return torch.cat(seen, 1)


def price_for(ratios: torch.Tensor, edit_rate: float) -> tuple[float, int]:
    """(price, fired positions): the price between the k-th and (k+1)-th largest ratio, k = round(rate x positions)
    (at least 1), so exactly k of these positions fire (fewer where fewer have a positive value)."""
    r = ratios.flatten().double().sort(descending=True).values
    k = min(max(1, round(edit_rate * r.numel())), int((r > 0).sum()))
    if k == 0:
        return OFF_PRICE, 0
    below = float(r[k]) if k < r.numel() else 0.0
    return (float(r[k - 1]) + below) / 2, k


def _decode_ms(model: PrismeModel, state, tokens: torch.Tensor, start: int, policy: Controller | None,
               fill: bool = True) -> tuple:
    """ms per step of decoding `tokens` `[B, n]` one step at a time from `start` positions, and the steps' outputs
    (`fill`: set the state back to `start` first; the peak-memory pass does that before its profile)."""
    if fill:
        state.fill_synthetic(start, draw=False)  # filled once (`measure`); the steps' writes lie past it
    outs = []
    synchronize(tokens.device)
    t0 = time.perf_counter_ns()
    for i in range(tokens.shape[1]):
        outs.append(state.decode_step(tokens[:, i:i + 1], policy=policy))
    synchronize(tokens.device)  # (a no-op on the CPU)
    return (time.perf_counter_ns() - t0) / 1e6 / tokens.shape[1], outs


def _peak(model: PrismeModel, state, tokens: torch.Tensor, start: int, policy: Controller | None) -> int:
    """The most tensor memory the steps hold beyond the state (`harness.peak_memory`), after one untimed pass of the
    same steps: what a pass frees of the one before it (a step's cached tables, the last outputs) is freed before the
    profile, which could not count it."""
    def setup() -> None:
        _decode_ms(model, state, tokens, start, policy)
        state.fill_synthetic(start, draw=False)

    return peak_memory(partial(_decode_ms, model, state, tokens, start, policy, False), tokens.device, setup)


def _ops(model: PrismeModel, outs: list, start: int, policy: Controller | None) -> tuple[float, float]:
    """(ops per token, edits per token) of the steps `outs` as their state ran them (`trace_cost`)."""
    B, n = outs[0].actions.shape[0], len(outs)
    ctx = [start + i + 1 for _ in range(B) for i in range(n)]  # own contexts, row-major as below
    if policy is None:
        return trace_cost(model.cfg, None, ctx).ops_per_token, 0.0
    acts = torch.stack([o.actions[:, 0] for o in outs], 1).reshape(B * n, -1).cpu()  # [B n, R]
    steps = torch.stack([o.controller_steps[:, 0] for o in outs], 1).reshape(-1).cpu()
    edits = torch.stack([o.n_edits[:, 0] for o in outs], 1)
    tc = trace_cost(model.cfg, acts, ctx, steps, model.execution.column(model.cfg.optimised), True,
                    model.decode_options)
    return tc.ops_per_token, float((edits > 0).double().mean())


def measure(case: Case, repeats: int, edit_rate: float, seed: int) -> dict[str, Any]:
    """Every path of one case: time, ops, state bytes (module docstring)."""
    B, n, T = case.batch, case.steps, case.context
    start = T - n
    prisme = case.models["prisme"]
    gen = torch.Generator().manual_seed(seed)
    states = {k: case.models[k].new_decode_state(B) for k in ("dense", "dense_ks", "prisme")}
    for s in states.values():
        s.fill_synthetic(start, gen)
    price, fired = price_for(_ratios(prisme, states["prisme"], case.tokens), edit_rate)
    paths = {"dense": ("dense", None), "dense_ks": ("dense_ks", None), "backbone": ("prisme", None),
             "routed_off": ("prisme", Controller(1, lambda_cost=OFF_PRICE)),
             "routed": ("prisme", Controller(1, lambda_cost=price))}
    outs: dict[str, list] = {}

    def path(k: str) -> TimedPath:
        model_key, policy = paths[k]
        return k, lambda: None, lambda _: Timed(*_decode_ms(case.models[model_key], states[model_key], case.tokens,
                                                            start, policy))

    samples = time_paths([path(k) for k in PATHS], 1, repeats, inference=False, outputs=outs)
    rows: dict[str, Any] = {}
    for k in PATHS:
        model_key, policy = paths[k]
        model = case.models[model_key]
        ops, edits = _ops(model, outs[k], start, policy)
        ms = float(np.median(samples[k]))
        rows[k] = {"ms_per_step": ms, "samples_ms": samples[k], "tokens_per_s": B * 1000.0 / ms,
                   "ops_per_token": ops, "edits_per_token": edits, "state_bytes": states[model_key].nbytes,
                   "peak_bytes": states[model_key].nbytes + _peak(model, states[model_key], case.tokens, start, policy)}
    dense = rows["dense"]
    for row in rows.values():
        row["speedup_vs_dense"] = dense["ms_per_step"] / row["ms_per_step"]
        row["ops_vs_dense"] = row["ops_per_token"] / dense["ops_per_token"]
        row["t_over_ops"] = (1 / row["speedup_vs_dense"]) / row["ops_vs_dense"]
    return {"shape": case.shape, "context": T, "batch": B, "steps": n, "price": price, "fired_positions": fired,
            "rows": rows}


def prefill_ms(models: dict[str, PrismeModel], T: int, repeats: int, edit_rate: float, seed: int) -> dict[str, Any]:
    """Each model's prefill of one T-token prompt (batch 1), rotated, medians: dense, dense_ks, PRISME's backbone
    (budget 0) and PRISME at the price where `edit_rate` of the prompt's positions edit (read on the prompt)."""
    prisme = models["prisme"]
    tokens = make_tokens(prisme.cfg.vocab_size, 1, T, seed).to(prisme.backbone.tok_emb.weight.device)
    with torch.no_grad():
        ctx = prisme.encode(tokens)
        value = prisme.router_values(ctx)  # [1, T, A]
    price, fired = price_for(fire_ratio(value, prisme.action_cost), edit_rate)
    paths = {"dense": (models["dense"], None), "dense_ks": (models["dense_ks"], None), "backbone": (prisme, None),
             "routed": (prisme, Controller(1, lambda_cost=price))}
    def path(k: str, m: PrismeModel, policy: Controller | None) -> TimedPath:  # a fresh state each run, untimed
        return k, lambda: m.new_decode_state(1, T), lambda state: state.prefill(tokens, policy=policy)

    samples = time_paths([path(k, m, policy) for k, (m, policy) in paths.items()], 1, repeats, tokens.device,
                         inference=False)
    rows = {k: {"ms": float(np.median(v)), "samples_ms": v} for k, v in samples.items()}
    for row in rows.values():
        row["speedup_vs_dense"] = rows["dense"]["ms"] / row["ms"]
    return {"context": T, "price": price, "fired_positions": fired, "rows": rows}


def _stage_step(model: PrismeModel, stage: str, T: int, seed: int, overrides: dict[str, Any]):
    """One real training step of `stage` (its objective, AdamW, the gradient clipped) on one T-token sequence of random
    bytes with fresh sampled actions each call: a callable."""
    from prisme.bench.train_stages import optimizer_step, stage_optimizer
    from prisme.training.config import StageConfig

    scfg = StageConfig(stage=stage, batch_size=1, seq_len=T, seed=seed, progress=False, **overrides).validate()
    objective = scfg.spec.objective(model, scfg)
    params, opt = stage_optimizer(model, scfg, objective)
    seq = make_tokens(model.cfg.vocab_size, 1, T + 1, seed)
    x, y = seq[:, :-1], seq[:, 1:]
    g = torch.Generator().manual_seed(seed + 1)

    def step() -> None:
        ex = objective.sample(x, y, g)
        optimizer_step(objective, params, opt, (x, y, ex), objective.denominators(x, y, ex))

    return step


def train_ms(cfgs: dict[str, PrismeConfig], T: int, positions: int, repeats: int, seed: int) -> dict[str, Any]:
    """A training step on one T-token sequence (batch 1), rotated, medians: each dense model's (next-token CE, every
    weight), PRISME's backbone stage (its local backbone) and its workspace stage (the demo's recipe: forced actions,
    deep supervision; at `positions` drawn positions, `StageConfig.workspace_positions`); `prisme` is the sum of its
    two stages' steps (one step of each)."""
    from prisme.bench.train_stages import STAGE_RECIPES

    ws = {k: v for k, v in STAGE_RECIPES["workspace"].items() if k not in ("batch_size", "seq_len")}
    steps = {"dense": _stage_step(seeded_model(cfgs["dense"], seed).train(), "backbone", T, seed, {}),
             "dense_ks": _stage_step(seeded_model(cfgs["dense_ks"], seed).train(), "backbone", T, seed, {}),
             "prisme_backbone": _stage_step(seeded_model(cfgs["prisme"], seed).train(), "backbone", T, seed, {}),
             "prisme_workspace": _stage_step(seeded_model(cfgs["prisme"], seed).train(), "workspace", T, seed,
                                             {**ws, "workspace_positions": positions})}
    samples = time_paths([(k, lambda: None, lambda _, f=f: f()) for k, f in steps.items()], 1, repeats,
                         inference=False)  # training steps: autograd on
    rows = {k: {"ms": float(np.median(v)), "samples_ms": v} for k, v in samples.items()}
    rows["prisme"] = {"ms": rows["prisme_backbone"]["ms"] + rows["prisme_workspace"]["ms"], "samples_ms": []}
    for row in rows.values():
        row["speedup_vs_dense"] = rows["dense"]["ms"] / row["ms"]
    return {"context": T, "workspace_positions": positions, "rows": rows}


# ------------------------------------------------------------------------------------------------------------ memory
def memory_needed(shape: str, T: int, B: int, bank_source: str, decode: DecodeOptions, prefill: bool,
                  train: bool, copy_head: bool = False) -> int:
    """What one case holds at once, at least: the three decode states (dense, dense_ks, PRISME) filled to T at batch
    B, plus the synthetic fill's largest temporary (one buffer's worth: a layer's keys); with `--prefill` a T-token
    prompt's logits and residual streams; with `--train` one T-token sequence's activations kept for backward (the
    logits and one residual stream per layer, 4 bytes each)."""
    cfgs = configs(shape, max(T, 2 * WINDOW + 1), bank_source, copy_head)
    d, L = SHAPES[shape]
    need = sum(decode_state_bytes(c, B, T, decode if k == "prisme" else None) for k, c in cfgs.items())
    need += B * T * d * 4  # the fill's randn temporary of one [B, T, d] buffer
    V = cfgs["dense"].vocab_size
    if prefill:
        need += T * (V + d * (L + 1)) * 4
        if copy_head:  # the prompt's match lengths and the pointer's scores and weights, [T, T] each
            need += T * T * (1 + 4 + 4)
    if train:
        need += T * (V + d * (L + 1)) * 4 * 3  # dense, dense_ks and PRISME's stage, one after the other at most twice
    return need


# ------------------------------------------------------------------------------------------------------------ output
def format_table(results: list[dict[str, Any]], prefills: list[dict[str, Any]], trains: list[dict[str, Any]]) -> str:
    lines = [f"{'shape':<9}{'T':>7}{'B':>3}  {'path':<11}{'ms/step':>9}{'tok/s':>9}{'MiB':>8}{'peak':>8}"
             f"{'ops/tok':>11}{'edits':>7}{'x dense':>9}{'ops x':>7}{'t/ops':>7}"]
    lines.append("-" * len(lines[0]))
    for res in results:
        for k, row in res["rows"].items():
            lines.append(f"{res['shape']:<9}{res['context']:>7}{res['batch']:>3}  {k:<11}{row['ms_per_step']:>9.3f}"
                         f"{row['tokens_per_s']:>9.0f}{row['state_bytes'] / 2**20:>8.1f}"
                         f"{row['peak_bytes'] / 2**20:>8.1f}{row['ops_per_token']:>11.3g}"
                         f"{row['edits_per_token']:>7.3f}{row['speedup_vs_dense']:>9.2f}{row['ops_vs_dense']:>7.3f}"
                         f"{row['t_over_ops']:>7.2f}")
    for res in prefills:
        lines.append(f"prefill {res['shape']} T = {res['context']} (batch 1): " + ", ".join(
            f"{k} {row['ms'] / 1000:.2f} s ({row['speedup_vs_dense']:.2f}x dense)" for k, row in res["rows"].items()))
    for res in trains:
        lines.append(f"training step {res['shape']} T = {res['context']} (batch 1, the workspace at "
                     f"{res['workspace_positions']} positions): " + ", ".join(
                         f"{k} {row['ms'] / 1000:.2f} s ({row['speedup_vs_dense']:.2f}x dense)"
                         for k, row in res["rows"].items()))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    names = parse_list(args.shapes, "--shapes", one_of(tuple(SHAPES)), example="d256_L2", distinct=True)
    contexts = tuple(parse_list(args.contexts, "--contexts", integer(1), example="4096,16384", distinct=True))
    batches = tuple(parse_list(args.batches, "--batches", integer(1), example="1,8", distinct=True))
    if not 0 < args.edit_rate < 1:
        raise ValueError(f"--edit-rate must lie in (0, 1), got {args.edit_rate}")
    device = bench_device(args.device)
    if min(contexts) <= WINDOW:
        raise ValueError(f"--contexts {min(contexts)} is too short: PRISME's backbone attends over a {WINDOW}-position "
                         f"window, so a context must be longer than {WINDOW}")
    for B in batches:
        if round(args.edit_rate * B * args.steps) < 1:
            print(f"note: --edit-rate {args.edit_rate:g} of the {B * args.steps} timed positions at batch {B} rounds "
                  f"to none; the routed path fires at 1 (at least one position edits, so its row times an edit)",
                  file=sys.stderr)
    copy = bool(getattr(args, "copy_head", False))
    if args.train and copy:
        raise ValueError("--train times the backbone and workspace stages; with --copy-head leave --train out (the "
                         "copy head trains in its own stage)")
    if args.train and device.type != "cpu":
        raise ValueError(f"--train times training steps on the CPU only, not on --device {device}")
    too_short = [T for T in contexts if T <= args.steps]
    if too_short:
        raise ValueError(f"--contexts {too_short} must be longer than --steps {args.steps} (the timed steps end at T)")
    decode = DecodeOptions(bank_tables=args.bank_source == "embedding",
                           bank_store="ids" if args.bank_source == "embedding" else "entries")
    for shape in names:  # the largest case of each shape, before any model is built at its size
        T, B = max(contexts), max(batches)
        check_fits(memory_needed(shape, T, B, args.bank_source, decode, args.prefill, args.train, copy),
                   f"bench long {shape} at T = {T:,}, batch {B}", "pass shorter --contexts or smaller --batches",
                   device)
    results, prefills, trains = [], [], []
    with torch_threads(args.threads):
        for shape in names:
            for T in contexts:
                cfgs = configs(shape, T, args.bank_source, copy)
                with torch.inference_mode():
                    models = {k: seeded_model(c, args.seed, decode if k == "prisme" else None).to(device)
                              for k, c in cfgs.items()}
                    for B in batches:
                        tokens = make_tokens(256, B, args.steps, args.seed + T + B).to(device)
                        results.append(measure(Case(shape, T, B, args.steps, models, tokens), args.repeats,
                                               args.edit_rate, args.seed))
                    if args.prefill:
                        prefills.append({"shape": shape, **prefill_ms(models, T, args.prefill_repeats,
                                                                      args.edit_rate, args.seed)})
                if args.train:
                    trains.append({"shape": shape, **train_ms(configs(shape, T + 1, args.bank_source, copy), T,
                                                              min(args.train_positions, T), args.train_repeats,
                                                              args.seed)})
    finite = all(math.isfinite(v) for r in results for row in r["rows"].values()
                 for v in (row["ms_per_step"], row["t_over_ops"]))
    doc = {"bench": "long", "environment": {"torch": torch.__version__, "python": platform.python_version(),
                                            "machine": platform.machine(), "processor": platform.processor(),
                                            "threads": torch.get_num_threads() if args.threads < 1 else args.threads,
                                            "device": str(device), "mode": "eager",
                                            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda"
                                            else None},
           "settings": {"shapes": list(names), "contexts": list(contexts), "batches": list(batches),
                        "steps": args.steps, "repeats": args.repeats, "edit_rate": args.edit_rate,
                        "bank_source": args.bank_source, "bank_store": decode.bank_store, "window": WINDOW,
                        "copy_head": copy,
                        "prefill": args.prefill, "train": args.train, "train_positions": args.train_positions,
                        "seed": args.seed},
           "results": results, "prefill": prefills, "train": trains, "targets": TARGETS,
           "checks": {"rows_measured": len(results), "timings_finite": finite, "passed": bool(results) and finite}}
    return emit(doc, format_table(results, prefills, trains), args.json)
