"""`prisme study recall`: the workspace solves associative recall that its one-layer backbone cannot, on every seed,
and the controller spends edits only where they pay.

Task: MQAR without the echo (`MQARConfig`, N = 4 pairs, V = 64, T = 32, filler after each query), accuracy on the
query positions. Phases, each a normal three-stage run whose checkpoints `prisme eval` and `prisme generate` read:

1. controls: the backbone alone, 1 layer (negative; trained for as many steps as stages 1 + 2 together) and 2 layers
   (positive; the same steps);
2. per seed: stage 1 (the 1-layer backbone, short) -> stage 2 (the workspace, backbone frozen) -> stage 3 (the
   controller) -> evaluation;
3. the converged case per seed: the same, with stage 1 trained to its chance plateau first (`converged_backbone_steps`);
4. evaluation of each trained model on `eval_sequences` held-out sequences drawn from its own seed: the backbone,
   fixed n x k1 / n x k2, random, dense, the controller at every lambda of the grid (lambda chosen on a separate
   calibration set: the cheapest one whose calibration accuracy is within `accuracy_tolerance` of the budget-1
   policy's), and the greedy oracle (reads the targets: not deployable); accuracy, mean ops and edits per token over
   all T positions of the actual traces, and the share of the controller's edits on query positions;
5. diagnostics per seed (budget-1 policy, first edit, block 0): cross-attention mass on the queried pair's value,
   gate means at query and other positions, |delta| / |H| at query positions.

The recipe is `configs/recall_*.json` (the three stages and the study's own settings). Forced policies are scored at
the query positions only: a position's workspace reads the bank and its own slots, never another position's, so the
edits elsewhere cannot change a query's logits; their ops are charged at every position of the trace all the same.
Seeds run as separate processes (`jobs`), one torch thread each by default.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prisme.checkpoint import load_model
from prisme.checks import COMPILE_SETTINGS, check_choice
from prisme.config import PrismeConfig
from prisme.costs.analytic import trace_cost
from prisme.data.mqar import MQARConfig, make_mqar_batch
from prisme.data.text import IGNORE_INDEX
from prisme.io import CONFIG_DIR, write_text_atomic
from prisme.training.config import StageConfig, load_run_config
from prisme.training.trainer import train_stage

RECIPE_FILES = {"backbone": "recall_backbone.json", "workspace": "recall_workspace.json",
                "controller": "recall_controller.json", "study": "recall_study.json"}
EVAL_SEED, CALIBRATION_SEED, RANDOM_POLICY_SEED = 100_003, 200_003, 300_007  # + the run's seed
TARGET_ACCURACY = 0.95
CHUNK = 256  # sequences per evaluation forward


# ------------------------------------------------------------------------------------------------------------ config
@dataclass
class RecallStudyConfig:
    """The study's own settings (`configs/recall_study.json`) plus the command line's."""

    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    converged_backbone_steps: int = 600  # stage 1 of the converged case: the backbone trained to its plateau
    eval_sequences: int = 2048  # held-out sequences per model, drawn from the run's own seed
    calibration_sequences: int = 1024  # a separate set: the controller's lambda is chosen there
    lambdas: list[float] = field(default_factory=lambda: [0.0, 0.03, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4])
    accuracy_tolerance: float = 0.02  # the chosen lambda's calibration accuracy >= budget-1's minus this
    control_layers: tuple[int, int] = (1, 2)  # negative and positive control depths
    out_dir: str = "runs/recall"
    jobs: int = 0  # worker processes (0 = one per CPU core, at most one per task)
    threads: int = 1  # torch threads per worker
    quick: bool = False  # one seed, few steps: a smoke run of every phase
    bank_source: str | None = None  # override the recipe's bank source (and query source), e.g. "residual"
    config_dir: str | None = None  # where the recall_*.json recipe lives (default: the project's configs/)
    compile: str = "off"  # the editor under torch.compile in stages 2-3 and the evaluation ("auto" | "strict")

    def validate(self) -> RecallStudyConfig:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"recall study: {msg}")

        need(isinstance(self.seeds, list) and len(self.seeds) > 0, f"seeds must be a non-empty list, got "
             f"{self.seeds!r}")
        need(all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.seeds),
             f"seeds must be integers >= 0, got {self.seeds!r}")
        need(len(set(self.seeds)) == len(self.seeds), f"seeds must be distinct, got {self.seeds!r}")
        for f in ("converged_backbone_steps", "eval_sequences", "calibration_sequences", "threads"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{f} must be an int >= 1, got {v!r}")
        need(isinstance(self.jobs, int) and self.jobs >= 0, f"jobs must be an int >= 0, got {self.jobs!r}")
        need(len(self.lambdas) > 0 and all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0
                                           for x in self.lambdas),
             f"lambdas must be a non-empty list of finite numbers >= 0, got {self.lambdas!r}")
        need(0 <= self.accuracy_tolerance < 1, f"accuracy_tolerance must be in [0, 1), got {self.accuracy_tolerance}")
        check_choice("compile", self.compile, COMPILE_SETTINGS, "recall study: ")
        return self


def parse_seeds(text: str) -> list[int]:
    """`--seeds 0,1,2` -> [0, 1, 2]; ValueError for an empty list, a negative or non-integer entry, or a repeat."""
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise ValueError(f"--seeds must list at least one seed, e.g. 0,1,2; got {text!r}")
    try:
        seeds = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers >= 0, got {text!r}") from None
    if any(s < 0 for s in seeds):
        raise ValueError(f"--seeds must be integers >= 0, got {text!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds lists a seed twice: {text!r}")
    return seeds


@dataclass
class Recipe:
    """The three stages of one run and the model they start from."""

    model: PrismeConfig
    backbone: StageConfig
    workspace: StageConfig
    controller: StageConfig
    mqar: MQARConfig


def load_recipe(cfg: RecallStudyConfig) -> tuple[Recipe, dict[str, Any]]:
    """The recipe `configs/recall_*.json` (or `cfg.config_dir`), with the study's overrides applied."""
    folder = Path(cfg.config_dir) if cfg.config_dir else CONFIG_DIR
    paths = {k: folder / v for k, v in RECIPE_FILES.items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise ValueError(f"the recall recipe is missing {missing}; pass --configs DIR holding "
                         f"{sorted(RECIPE_FILES.values())}")
    model, s1 = load_run_config(paths["backbone"])
    _, s2 = load_run_config(paths["workspace"])
    _, s3 = load_run_config(paths["controller"])
    if model is None:
        raise ValueError(f"{paths['backbone']} must name the model (a 'model' entry)")
    try:
        study = json.loads(paths["study"].read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{paths['study']} is not valid JSON: {e}") from None
    if cfg.bank_source is not None:
        model = model.replace(bank_source=cfg.bank_source, query_source=cfg.bank_source)
    mqar = MQARConfig(**s1.mqar)
    mqar.validate()
    return Recipe(model, s1, s2, s3, mqar), study


def study_config(overrides: dict[str, Any], config_dir: str | None = None) -> RecallStudyConfig:
    """`RecallStudyConfig` from `recall_study.json` (its known fields) updated by `overrides` (the command line)."""
    folder = Path(config_dir) if config_dir else CONFIG_DIR
    path = folder / RECIPE_FILES["study"]
    base: dict[str, Any] = {}
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        known = {f.name for f in dataclasses.fields(RecallStudyConfig)}
        unknown = sorted(set(raw) - known - {"description"})
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {unknown}; known: {sorted(known)}")
        base = {k: v for k, v in raw.items() if k in known}
        if "control_layers" in base:
            base["control_layers"] = tuple(base["control_layers"])
    base.update({k: v for k, v in overrides.items() if v is not None})
    base["config_dir"] = config_dir
    return RecallStudyConfig(**base).validate()


# ------------------------------------------------------------------------------------------------------------ tasks
def _quick(s: StageConfig, steps: int) -> StageConfig:
    return s.replace(steps=steps, warmup=min(s.warmup, max(1, steps // 4)))


def plan_tasks(cfg: RecallStudyConfig, recipe: Recipe) -> list[dict[str, Any]]:
    """Every independent run of the study, longest first (so that parallel workers finish together)."""
    out = Path(cfg.out_dir)
    s1, s2, s3 = recipe.backbone, recipe.workspace, recipe.controller
    conv_steps = cfg.converged_backbone_steps
    if cfg.quick:
        s1, s2, s3, conv_steps = _quick(s1, 12), _quick(s2, 12), _quick(s3, 6), 16
    matched = s1.steps + s2.steps  # the negative control trains as long as stages 1 + 2 together
    tasks = []
    for seed in cfg.seeds:
        tasks.append(dict(kind="converged", seed=seed, folder=str(out / f"converged_seed{seed}"),
                          stages=[s1.replace(steps=conv_steps), s2, s3]))
    for seed in cfg.seeds:
        tasks.append(dict(kind="seed", seed=seed, folder=str(out / f"seed{seed}"), stages=[s1, s2, s3]))
    seed0 = cfg.seeds[0]
    for name, layers in zip(("one_layer", "two_layer"), cfg.control_layers):
        tasks.append(dict(kind="control", name=name, layers=layers, seed=seed0,
                          folder=str(out / f"control_{name}_seed{seed0}"),
                          stages=[s1.replace(steps=matched, warmup=min(s1.warmup, matched))]))
    for t in tasks:
        t["model"] = recipe.model if t["kind"] != "control" else recipe.model.replace(n_layer=t["layers"])
        t["mqar"] = recipe.mqar
        t["study"] = cfg
    order = {"control": 2 if cfg.control_layers[1] > 1 else 0, "converged": 1, "seed": 0}
    return sorted(tasks, key=lambda t: -order[t["kind"]])


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    """Train one task's stages and evaluate the result (runs in a worker process)."""
    cfg: RecallStudyConfig = task["study"]
    torch.set_num_threads(cfg.threads)
    folder = Path(task["folder"])
    names = ("1_backbone", "2_workspace", "3_controller")
    wall: dict[str, float] = {}
    init = None
    results = {}
    for name, s in zip(names, task["stages"]):
        t0 = time.perf_counter()
        s = s.replace(seed=task["seed"], out_dir=str(folder / name), init_from=init, progress=False,
                      compile=cfg.compile)
        res = train_stage(task["model"] if s.stage == "backbone" else None, s)
        wall[s.stage] = time.perf_counter() - t0
        init = str(res.checkpoint)
        results[s.stage] = res
    t0 = time.perf_counter()
    model, _ = load_model(init)
    if task["kind"] != "control":
        from prisme.model.compiled import maybe_compile

        maybe_compile(model, cfg.compile)
    if task["kind"] == "control":
        entry = {"accuracy": evaluate_backbone(model, task["mqar"], EVAL_SEED + task["seed"], cfg.eval_sequences),
                 "layers": task["layers"],
                 "steps": task["stages"][0].steps, "seed": task["seed"], "checkpoint": init}
    else:
        entry = evaluate_run(model, task["mqar"], task["seed"], cfg)
        entry["checkpoint"] = init
        entry["backbone_steps"] = task["stages"][0].steps
    wall["evaluate"] = time.perf_counter() - t0
    entry["wall_s"] = wall
    return {"task": {k: task[k] for k in ("kind", "seed", "folder") if k in task} | {"name": task.get("name")},
            "entry": entry}


# ------------------------------------------------------------------------------------------------------- evaluation
def _batches(mcfg: MQARConfig, n: int, seed: int):
    """`n` sequences from the generator seeded `seed`, in chunks of CHUNK: (x, y) `[b, T]`."""
    g = torch.Generator().manual_seed(seed)
    done = 0
    while done < n:
        b = min(CHUNK, n - done)
        yield make_mqar_batch(mcfg, b, g)
        done += b


def _queries(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows `[b, 1]`, query positions `[b, Q]`) of an MQAR batch (every row has the same number of queries)."""
    lab = y != IGNORE_INDEX
    Q = int(lab.sum(1).max())
    pos = torch.argsort((~lab).to(torch.int8), dim=1, stable=True)[:, :Q]
    return torch.arange(y.shape[0]).unsqueeze(1), pos


@torch.no_grad()
def evaluate_backbone(model: torch.nn.Module, mcfg: MQARConfig, data_seed: int, n_seq: int) -> float:
    """Query accuracy of the backbone alone on `n_seq` sequences drawn from `data_seed`."""
    hit = n = 0
    for x, y in _batches(mcfg, n_seq, data_seed):
        lab = y != IGNORE_INDEX
        pred = model(x).logits.argmax(-1)
        hit += int((pred[lab] == y[lab]).sum())
        n += int(lab.sum())
    return hit / n


def _forced_row(model, mcfg, data_seed, n_seq, name, family, n, k) -> dict[str, Any]:
    """A forced policy: accuracy at the query positions; ops and edits over every position of its trace."""
    cfg = model.cfg
    T = mcfg.seq_len
    g = torch.Generator().manual_seed(RANDOM_POLICY_SEED + data_seed)
    hit = tot = 0
    for x, y in _batches(mcfg, n_seq, data_seed):
        rows, pos = _queries(y)
        st = model.streams(x)
        ctx = model.context_from_H(st, st.index(rows, pos), query_pos=pos)
        acts = _forced_actions(cfg, family, n, k, pos.shape, g)  # [b, Q, n]
        roll = model.rollout_forced(ctx, acts)
        logits, _ = model.logits_from_state(roll.S, ctx, roll.n_edits > 0)
        yq = y[rows, pos]
        hit += int((logits.argmax(-1) == yq).sum())
        tot += yq.numel()
    trace = _forced_actions(cfg, family, n, k, (1, T), torch.Generator().manual_seed(0))  # every position alike
    ops = trace_cost(cfg, trace, torch.arange(1, T + 1), optimised=cfg.optimised)
    return {"policy": name, "family": family, "accuracy": hit / tot, "ops_ratio": ops.relative,
            "edits_per_token": float(n)}


def _forced_actions(cfg: PrismeConfig, family: str, n: int, k: int, shape: tuple[int, int],
                    g: torch.Generator) -> torch.Tensor:
    from prisme.evaluation.policies import forced_actions

    return forced_actions(cfg, family, n, k, shape, g)


def _controller_rows(model, mcfg, data_seed, n_seq, lambdas) -> list[dict[str, Any]]:
    """The controller at each price in `lambdas`: every position decides; accuracy at the queries, ops and edits over
    all positions. Each batch is encoded once and rolled out at every price (what `forward_policy` does per call)."""
    cfg = model.cfg
    T = mcfg.seq_len
    acc = [{"hit": 0, "tot": 0, "edits": 0.0, "edits_q": 0.0, "acts": [], "steps": []} for _ in lambdas]
    for x, y in _batches(mcfg, n_seq, data_seed):
        ctx = model.encode(x)
        lab = y != IGNORE_INDEX
        for a, lam in zip(acc, lambdas):
            roll = model.rollout_policy(ctx, cfg.r_max, model.action_cost, lambda_cost=lam)
            logits, _ = model.logits_from_state(roll.S, ctx, roll.n_edits > 0)
            a["hit"] += int((logits.argmax(-1)[lab] == y[lab]).sum())
            a["tot"] += int(lab.sum())
            a["edits"] += float(roll.n_edits.sum())
            a["edits_q"] += float(roll.n_edits[lab].sum())
            a["acts"].append(roll.actions.reshape(-1, roll.actions.shape[-1]))
            a["steps"].append(roll.controller_steps.reshape(-1))
    contexts = torch.arange(1, T + 1).repeat(n_seq)
    rows = []
    for a, lam in zip(acc, lambdas):
        ops = trace_cost(cfg, torch.cat(a["acts"]), contexts, torch.cat(a["steps"]), optimised=cfg.optimised)
        rows.append({"lambda": float(lam), "accuracy": a["hit"] / a["tot"], "ops_ratio": ops.relative,
                     "edits_per_token": a["edits"] / (n_seq * T),
                     "query_edit_share": a["edits_q"] / a["edits"] if a["edits"] else 0.0})
    return rows


def _oracle_row(model, mcfg, seed, n_seq) -> dict[str, Any]:
    """The greedy oracle at lambda 0 at the query positions (it reads the targets, so it knows where they are and
    stops at once everywhere else); its trace is charged as if a controller had chosen it."""
    from prisme.evaluation.oracle import greedy_oracle

    cfg = model.cfg
    T = mcfg.seq_len
    hit = tot = 0
    edits = 0.0
    acts, steps, ctxs = [], [], []
    for x, y in _batches(mcfg, n_seq, EVAL_SEED + seed):
        rows, pos = _queries(y)
        res = greedy_oracle(model, x, y, pos, cfg.r_max, 0.0)
        yq = y[rows, pos]
        hit += int((res.logits.argmax(-1) == yq).sum())
        tot += yq.numel()
        edits += float(res.n_edits.sum())
        full = torch.full((x.shape[0], T, cfg.r_max), cfg.stop_action)
        full[rows, pos] = res.actions
        n_full = torch.zeros(x.shape[0], T, dtype=torch.long)
        n_full[rows, pos] = res.n_edits
        acts.append(full.reshape(-1, cfg.r_max))
        steps.append(torch.clamp(n_full + 1, max=cfg.r_max).reshape(-1))
        ctxs.append(torch.arange(1, T + 1).repeat(x.shape[0]))
    ops = trace_cost(cfg, torch.cat(acts), torch.cat(ctxs), torch.cat(steps), optimised=cfg.optimised)
    return {"policy": "oracle(lambda=0)", "family": "oracle", "accuracy": hit / tot, "ops_ratio": ops.relative,
            "edits_per_token": edits / (n_seq * T), "deployable": False}


@torch.no_grad()
def diagnostics(model: torch.nn.Module, mcfg: MQARConfig, seed: int, n_seq: int = 256) -> dict[str, float]:
    """Budget-1 policy (slot 0 at every position), first edit, editor block 0: the cross-attention mass on the queried
    pair's value (mean over heads and query positions), the gate at query and at other positions, and
    |delta| / |H| at query positions."""
    x, y = make_mqar_batch(mcfg, n_seq, torch.Generator().manual_seed(EVAL_SEED + seed))
    lab = y != IGNORE_INDEX
    B, T = x.shape
    out = model(x, torch.zeros(B, T, 1, dtype=torch.long), return_state=True)
    ctx, blk = out.ctx, model.editor.blocks[0]
    step = torch.zeros(B, T, dtype=torch.long)
    att = blk.bank_attention(ctx.S0[:, :, 0], step, step, ctx.K, ctx.bank_mask)  # [B, nh, T, Tb]
    b, t = lab.nonzero(as_tuple=True)
    keys = x[:, 0:2 * mcfg.n_pairs:2]  # [B, N] the pairs' keys
    j = (keys[b] == x[b, t].unsqueeze(1)).float().argmax(1)  # which pair each query asks for
    xattn = att[b, :, t, 2 * j + 1].mean()
    gate = out.infos[0].gates[0][0].view(B, T)  # block 0, singles: every position, in (b, t) order
    delta = out.delta.norm(dim=-1) / ctx.H.norm(dim=-1).clamp(min=1e-12)
    return {"xattn_correct_value": float(xattn), "gate_query": float(gate[lab].mean()),
            "gate_other": float(gate[~lab].mean()), "delta_over_H": float(delta[lab].mean())}


@torch.no_grad()
def evaluate_run(model: torch.nn.Module, mcfg: MQARConfig, seed: int, cfg: RecallStudyConfig) -> dict[str, Any]:
    """One trained workspace model: every policy's row, the controller at its calibrated lambda, diagnostics."""
    mc = model.cfg
    n_eval, data = cfg.eval_sequences, EVAL_SEED + seed
    ns = [n for n in (1, 2, 4) if n <= mc.r_max]
    fixed = [{"policy": "backbone", "family": "backbone", "accuracy": evaluate_backbone(model, mcfg, data, n_eval),
              "ops_ratio": 1.0, "edits_per_token": 0.0}]
    fixed += [_forced_row(model, mcfg, data, n_eval, f"fixed_{n}xk{k}", "fixed", n, k) for k in (1, 2) for n in ns]
    fixed += [_forced_row(model, mcfg, data, n_eval, f"random_{n}xk1", "random", n, 1) for n in ns[:2]]
    fixed += [_forced_row(model, mcfg, data, n_eval, "dense_1", "dense", 1, mc.n_slots)]
    lambdas = sorted({float(v) for v in cfg.lambdas})
    calib = _controller_rows(model, mcfg, CALIBRATION_SEED + seed, cfg.calibration_sequences, lambdas)
    budget1_calib = _forced_row(model, mcfg, CALIBRATION_SEED + seed, cfg.calibration_sequences, "fixed_1xk1",
                                "fixed", 1, 1)["accuracy"]
    ok = [r for r in calib if r["accuracy"] >= budget1_calib - cfg.accuracy_tolerance]
    best = min(ok, key=lambda r: r["ops_ratio"]) if ok else max(calib, key=lambda r: r["accuracy"])
    chosen = best["lambda"]
    controllers = _controller_rows(model, mcfg, EVAL_SEED + seed, n_eval, lambdas)
    controller = dict(next(r for r in controllers if r["lambda"] == chosen))
    controller["calibration_accuracy"] = next(r for r in calib if r["lambda"] == chosen)["accuracy"]
    controller["calibration_budget1_accuracy"] = budget1_calib
    oracle = _oracle_row(model, mcfg, seed, min(n_eval, 512))
    entry = {"seed": seed, "budget1_accuracy": next(r for r in fixed if r["policy"] == "fixed_1xk1")["accuracy"],
             **diagnostics(model, mcfg, seed), "fixed": fixed, "controller": controller, "controllers": controllers,
             "oracle": oracle, "bank_source": mc.bank_source, "query_source": mc.query_source,
             "bank_shift": mc.bank_shift}
    entry["success"] = seed_success(entry)
    return entry


def seed_success(entry: dict[str, Any]) -> dict[str, bool]:
    """The issue's bars for one run: the workspace at budget 1, and the controller against every fixed row."""
    c = entry["controller"]
    ws_rows = [r for r in entry["fixed"] if r["family"] != "backbone"]
    passing = [r for r in ws_rows if r["accuracy"] >= TARGET_ACCURACY]
    cheapest = min((r["ops_ratio"] for r in passing), default=math.inf)
    dominated = any(r["ops_ratio"] < c["ops_ratio"] and r["accuracy"] > c["accuracy"] for r in entry["fixed"])
    return {"workspace": entry["budget1_accuracy"] >= TARGET_ACCURACY,
            "controller": bool(c["accuracy"] >= TARGET_ACCURACY and c["edits_per_token"] <= 0.3
                               and c["query_edit_share"] >= 0.8 and c["ops_ratio"] < cheapest and not dominated)}


# ------------------------------------------------------------------------------------------------------------ report
def run_study(cfg: RecallStudyConfig, progress: bool = True) -> dict[str, Any]:
    """Run every task (in `cfg.jobs` worker processes), then assemble the report document."""
    cfg.validate()
    if cfg.quick:
        cfg = dataclasses.replace(cfg, seeds=cfg.seeds[:1], eval_sequences=min(cfg.eval_sequences, 128),
                                  calibration_sequences=min(cfg.calibration_sequences, 128))
    recipe, _ = load_recipe(cfg)
    out = Path(cfg.out_dir)
    for t in plan_tasks(cfg, recipe):  # nothing trains if any run folder is already taken
        for s in ("1_backbone", "2_workspace", "3_controller"):
            if (Path(t["folder"]) / s / "latest").exists():
                raise ValueError(f"{Path(t['folder']) / s} already holds a run; pass another --out or remove it")
    tasks = plan_tasks(cfg, recipe)
    t0 = time.perf_counter()
    jobs = cfg.jobs or (os.cpu_count() or 1)
    jobs = max(1, min(jobs, len(tasks)))
    done: list[dict[str, Any]] = []
    if jobs == 1:
        for t in tasks:
            done.append(run_task(t))
            _progress(progress, done[-1], len(done), len(tasks), t0)
    else:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = [pool.submit(run_task, t) for t in tasks]
            for f in cf.as_completed(futures):
                done.append(f.result())
                _progress(progress, done[-1], len(done), len(tasks), t0)
    doc = assemble(cfg, recipe, done, time.perf_counter() - t0, jobs)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "recall.json", json.dumps(doc, indent=2, allow_nan=False) + "\n")
    plot_accuracy_vs_ops(doc, out / "recall_accuracy_vs_ops.png")
    first = next((s for s in doc["seeds"]), None)
    if first is not None:
        plot_edits(first["controller_checkpoint"], recipe.mqar, first["seed"], first["controller"]["lambda"],
                   out / "recall_edits.png")
    return doc


def _progress(on: bool, res: dict[str, Any], i: int, n: int, t0: float) -> None:
    if not on:
        return
    t, e = res["task"], res["entry"]
    what = t["kind"] if t["kind"] != "control" else f"control {t['name']}"
    acc = e.get("budget1_accuracy", e.get("accuracy"))
    print(f"[{i}/{n} {time.perf_counter() - t0:6.0f} s] {what} seed {t['seed']}: accuracy {acc:.4f}",
          file=sys.stderr, flush=True)


def assemble(cfg: RecallStudyConfig, recipe: Recipe, done: list[dict[str, Any]], total_s: float,
             jobs: int) -> dict[str, Any]:
    """The study's JSON document from the finished tasks."""
    by = {(r["task"]["kind"], r["task"].get("name"), r["task"]["seed"]): r["entry"] for r in done}
    seeds, converged = [], []
    for s in cfg.seeds:
        for kind, dest in (("seed", seeds), ("converged", converged)):
            e = dict(by[(kind, None, s)])
            e["controller_checkpoint"] = e.pop("checkpoint")
            dest.append(e)
    controls = {name: by[("control", name, cfg.seeds[0])] for name in ("one_layer", "two_layer")}
    phases: dict[str, float] = {"backbone": 0.0, "workspace": 0.0, "controller": 0.0, "evaluate": 0.0,
                                "controls": 0.0}
    for r in done:
        for k, v in r["entry"]["wall_s"].items():
            key = "controls" if r["task"]["kind"] == "control" else k
            phases[key] += v
    n = len(seeds)
    ws_ok = sum(e["success"]["workspace"] for e in seeds)
    ctrl_ok = sum(e["success"]["controller"] for e in seeds)
    conv_ok = sum(e["success"]["workspace"] for e in converged)
    conv_ctrl_ok = sum(e["success"]["controller"] for e in converged)
    mc = recipe.model
    doc = {
        "task": dataclasses.asdict(recipe.mqar),
        "model": mc.to_dict(),
        "recipe": {"backbone": recipe.backbone.to_dict(), "workspace": recipe.workspace.to_dict(),
                   "controller": recipe.controller.to_dict(), "converged_backbone_steps": cfg.converged_backbone_steps},
        "study": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("config_dir",)},
        "controls": controls,
        "seeds": seeds,
        "converged": {"bank_source": mc.bank_source, "query_source": mc.query_source, "bank_shift": mc.bank_shift,
                      "backbone_steps": converged[0]["backbone_steps"], "success_rate": conv_ok / n,
                      "controller_success_rate": conv_ctrl_ok / n, "seeds": converged},
        "summary": {"workspace_success": f"{ws_ok}/{n}", "controller_success": f"{ctrl_ok}/{n}",
                    "converged_success": f"{conv_ok}/{n}", "converged_controller_success": f"{conv_ctrl_ok}/{n}",
                    "negative_control_ok": controls["one_layer"]["accuracy"] <= 0.30,
                    "positive_control_ok": controls["two_layer"]["accuracy"] >= TARGET_ACCURACY},
        "wall_s": {"total": total_s, **phases, "jobs": jobs,
                   "note": "phases sum the time of every run in that phase over all workers"},
    }
    return doc


def format_table(doc: dict[str, Any]) -> str:
    """The study's table for humans."""
    c = doc["controls"]
    lines = [f"MQAR N={doc['task']['n_pairs']} V={doc['task']['vocab_size']} T={doc['task']['seq_len']} "
             f"(filler after each query); bank {doc['model']['bank_source']!r}, shift {doc['model']['bank_shift']}, "
             f"query {doc['model']['query_source']!r}, controller source {doc['model']['controller_source']!r}",
             f"controls (backbone alone, {c['one_layer']['steps']} steps, seed {c['one_layer']['seed']}): "
             f"1 layer {c['one_layer']['accuracy']:.4f}, 2 layers {c['two_layer']['accuracy']:.4f}", ""]
    head = (f"{'run':<14}{'budget1':>9}{'xattn':>7}{'gate q/o':>12}{'|d|/|H|':>9}{'lambda':>8}{'ctrl acc':>9}"
            f"{'edits':>7}{'on q':>6}{'ops':>7}{'fix95 ops':>10}  ok")
    lines += [head, "-" * len(head)]
    for label, entries in (("seed", doc["seeds"]), ("converged", doc["converged"]["seeds"])):
        for e in entries:
            k = e["controller"]
            cheapest = min((r["ops_ratio"] for r in e["fixed"] if r["family"] != "backbone"
                            and r["accuracy"] >= TARGET_ACCURACY), default=float("nan"))
            ok = ("W" if e["success"]["workspace"] else "-") + ("C" if e["success"]["controller"] else "-")
            lines.append(f"{label + ' ' + str(e['seed']):<14}{e['budget1_accuracy']:>9.4f}"
                         f"{e['xattn_correct_value']:>7.3f}{e['gate_query']:>6.2f}/{e['gate_other']:<5.2f}"
                         f"{e['delta_over_H']:>9.3f}{k['lambda']:>8.3g}{k['accuracy']:>9.4f}"
                         f"{k['edits_per_token']:>7.3f}{k['query_edit_share']:>6.2f}{k['ops_ratio']:>7.3f}"
                         f"{cheapest:>10.3f}  {ok}")
    s = doc["summary"]
    lines += ["", f"workspace at budget 1 >= 95%: {s['workspace_success']} seeds; controller bars: "
              f"{s['controller_success']}; converged backbone ({doc['converged']['backbone_steps']} stage-1 steps): "
              f"{s['converged_success']} (controller {s['converged_controller_success']})",
              f"negative control <= 30%: {'yes' if s['negative_control_ok'] else 'NO'}; positive control >= 95%: "
              f"{'yes' if s['positive_control_ok'] else 'NO'}; wall {doc['wall_s']['total']:.0f} s "
              f"({doc['wall_s']['jobs']} workers)",
              "ok: W = budget-1 accuracy >= 95%; C = controller >= 95% at <= 0.3 edits/token, >= 80% of edits on "
              "queries, fewer ops than the cheapest fixed row reaching 95%, no fixed row cheaper and better"]
    return "\n".join(lines)


def plot_accuracy_vs_ops(doc: dict[str, Any], path: Path) -> None:
    """Accuracy against ops per token (x the backbone): fixed/random/dense rows, the controller across lambda
    (its chosen lambda ringed), the oracle, per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=120)
    style = {"backbone": ("s", "C0"), "fixed": ("o", "C2"), "random": ("x", "C3"), "dense": ("^", "C4")}
    seen = set()
    for e in doc["seeds"]:
        for r in e["fixed"]:
            m, col = style[r["family"]]
            ax.scatter(r["ops_ratio"], r["accuracy"], marker=m, color=col, s=30, alpha=0.7,
                       label=r["family"] if r["family"] not in seen else None)
            seen.add(r["family"])
        cs = sorted(e["controllers"], key=lambda r: r["ops_ratio"])
        ax.plot([r["ops_ratio"] for r in cs], [r["accuracy"] for r in cs], "-*", color="C5", ms=6, alpha=0.7,
                label="controller (lambda grid)" if "ctrl" not in seen else None)
        seen.add("ctrl")
        k = e["controller"]
        ax.scatter(k["ops_ratio"], k["accuracy"], s=140, facecolors="none", edgecolors="k",
                   label="controller, calibrated lambda" if "chosen" not in seen else None)
        seen.add("chosen")
        o = e["oracle"]
        ax.scatter(o["ops_ratio"], o["accuracy"], marker="P", facecolors="none", edgecolors="C6", s=60,
                   label="oracle (not deployable)" if "oracle" not in seen else None)
        seen.add("oracle")
    ax.axhline(TARGET_ACCURACY, color="gray", ls=":", lw=1)
    ax.axhline(doc["controls"]["two_layer"]["accuracy"], color="C1", ls="--", lw=1, label="2-layer backbone")
    ax.set_xscale("log")
    ax.set_xlabel("ops per token / backbone only (actual traces, all positions)")
    ax.set_ylabel("accuracy on query positions")
    ax.set_title("MQAR: 1-layer backbone + workspace, every seed")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)


@torch.no_grad()
def plot_edits(checkpoint: str, mcfg: MQARConfig, seed: int, lam: float, path: Path) -> None:
    """One held-out sequence under the calibrated controller: positions x steps, coloured by action, queries marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    model, _ = load_model(checkpoint)
    cfg = model.cfg
    x, y = make_mqar_batch(mcfg, 1, torch.Generator().manual_seed(EVAL_SEED + seed))
    out = model.forward_policy(x, cfg.r_max, lambda_cost=lam)
    acts = out.actions[0].T.numpy().astype(float)  # [R, T]
    acts[acts == cfg.stop_action] = np.nan
    T = x.shape[1]
    fig, ax = plt.subplots(figsize=(9, 2.8), dpi=120)
    im = ax.imshow(acts, aspect="auto", cmap="tab10", vmin=0, vmax=max(9, cfg.n_actions - 1), interpolation="nearest")
    q = (y[0] != IGNORE_INDEX).nonzero().flatten().tolist()
    for t in q:
        ax.axvline(t, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(T))
    ax.set_xticklabels([str(v) for v in x[0].tolist()], fontsize=6, rotation=90)
    ax.set_yticks(range(cfg.r_max))
    ax.set_ylabel("step")
    ax.set_xlabel("position (token id); dashed = query; blank = STOP")
    ax.set_title(f"controller edits, lambda={lam:g}: {int(out.n_edits.sum())} edits, "
                 f"{int(out.n_edits[0, q].sum())} on the {len(q)} queries")
    fig.colorbar(im, ax=ax, label="action id (0..M-1 slot, M.. pair)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------- CLI
def main(args: Any) -> int:
    """`prisme study recall`."""
    seeds = parse_seeds(args.seeds) if args.seeds is not None else None
    cfg = study_config({"seeds": seeds, "out_dir": args.out, "jobs": args.jobs, "threads": args.threads,
                        "quick": args.quick, "bank_source": args.bank_source,
                        "compile": getattr(args, "compile", None) or "off"}, args.configs)
    return emit_study(run_study(cfg, progress=not args.no_progress), format_table, args.json)


def emit_study(doc: dict[str, Any], table: Any, json_path: str | None) -> int:
    """A study's report: `table(doc)`, then its JSON document as the last thing on stdout (also written atomically to
    `json_path` when given). Returns 0."""
    print(table(doc))
    text = json.dumps(doc, indent=2, allow_nan=False)
    if json_path:
        write_text_atomic(Path(json_path), text + "\n")
    print(text)
    return 0
