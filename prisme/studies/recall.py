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

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from prisme.checkpoint import load_model
from prisme.io import write_text_atomic
from prisme.studies.confirm import parse_confirm_seeds, seeds_after
from prisme.studies.pools import pool_options, task_device
from prisme.studies.recall_confirm import (
    confirmation_prune,
    is_fresh,
    plan_confirmation,
    read_recorded,
    recorded_seeds,
    waits_for,
)
from prisme.studies.recall_context import (
    assemble_contexts,
    costlier_than_passing,
    decided_by_running,
    parse_contexts,
    plan_contexts,
    plot_ratio,
    ratio_by_context,
    recipe_at,
)
from prisme.studies.recall_eval import evaluate_backbone, evaluate_run
from prisme.studies.recall_frontier import DenseTask, assemble_frontier, decode_speed, plan_frontier
from prisme.studies.recall_report import (
    assemble,
    emit_study,
    format_table,
    plot_accuracy_vs_ops,
    plot_edits,
    plot_frontier,
    sections,
)
from prisme.studies.recall_setup import (
    EVAL_SEED,
    TARGET_ACCURACY,
    RecallStudyConfig,
    RecallTask,
    Recipe,
    _quick,
    check_document_kind,
    load_recipe,
    own_settings,
    parse_seeds,
    study_config,
)
from prisme.studies.recall_verdict import confirm_study, confirmation_document
from prisme.studies.runner import (
    Task,
    open_study,
    record_study,
    reuse_runs,
    reused_runs,
    run_tasks,
    train_stage_once,
    worker_count,
)


# ------------------------------------------------------------------------------------------------------------ tasks
@dataclass(frozen=True, kw_only=True)
class SeedTask(RecallTask):
    """Stage 1 (the backbone) -> stage 2 (the workspace) -> stage 3 (the controller) on one seed; every policy of the
    trained model scored (`evaluate_run`)."""

    kind: ClassVar[str] = "seed"
    section: ClassVar[str] = "seeds"

    def evaluate(self, model: torch.nn.Module, checkpoint: str) -> dict[str, Any]:
        entry = evaluate_run(model, self.mqar, self.seed, self.study)
        entry["checkpoint"] = checkpoint
        entry["backbone_steps"] = self.stages[0].steps
        return entry


@dataclass(frozen=True, kw_only=True)
class ConvergedTask(SeedTask):
    """The converged case on one seed: the same, with stage 1 trained to its chance plateau first."""

    kind: ClassVar[str] = "converged"
    section: ClassVar[str] = "converged"
    priority: ClassVar[int] = 1


@dataclass(frozen=True, kw_only=True)
class ControlTask(RecallTask):
    """A control: the backbone alone with `layers` layers, trained as long as stages 1 + 2 together; `role` is
    "one_layer" (the negative control) or "two_layer" (the positive one)."""

    kind: ClassVar[str] = "control"
    section: ClassVar[str] = "controls"
    compiles: ClassVar[bool] = False
    role: str
    layers: int

    @property
    def name(self) -> str:
        return self.role

    @property
    def priority(self) -> int:
        return 2 if self.study.control_layers[1] > 1 else 0  # a deeper positive control is a long run

    def evaluate(self, model: torch.nn.Module, checkpoint: str) -> dict[str, Any]:
        return {"accuracy": evaluate_backbone(model, self.mqar, EVAL_SEED + self.seed, self.study.eval_sequences),
                "layers": self.layers, "steps": self.stages[0].steps, "seed": self.seed, "checkpoint": checkpoint}

    def phase(self, stage: str) -> str:
        return "controls"


def plan_tasks(cfg: RecallStudyConfig, recipe: Recipe) -> list[RecallTask]:
    """Every independent run of the study, longest first (so that parallel workers finish together)."""
    out = Path(cfg.out_dir)
    s1, s2, s3 = recipe.backbone, recipe.workspace, recipe.controller
    conv_steps = cfg.converged_backbone_steps
    if cfg.quick:
        s1, s2, s3, conv_steps = _quick(s1, 12), _quick(s2, 12), _quick(s3, 6), 16
    matched = s1.steps + s2.steps  # the negative control trains as long as stages 1 + 2 together
    common = dict(mqar=recipe.mqar, study=cfg)
    tasks: list[RecallTask] = []
    for seed in cfg.seeds if cfg.converged else []:
        tasks.append(ConvergedTask(seed=seed, folder=str(out / f"converged_seed{seed}"), model=recipe.model,
                                   stages=(s1.replace(steps=conv_steps), s2, s3), **common))
    for seed in cfg.seeds:
        tasks.append(SeedTask(seed=seed, folder=str(out / f"seed{seed}"), model=recipe.model, stages=(s1, s2, s3),
                              **common))
    seed0 = cfg.seeds[0]
    for name, layers in zip(("one_layer", "two_layer"), cfg.control_layers):
        tasks.append(ControlTask(role=name, layers=layers, seed=seed0, folder=str(out / f"control_{name}_seed{seed0}"),
                                 model=recipe.model.replace(n_layer=layers),
                                 stages=(s1.replace(steps=matched, warmup=min(s1.warmup, matched)),), **common))
    if cfg.frontier:  # the frontier replaces the controller runs; the controls run as always; then the confirmation
        fresh = plan_confirmation(cfg, recipe, out)  # of a recorded study (`confirm_of`): nothing else trains
        runs = [] if cfg.confirm_of else plan_frontier(cfg, recipe, out) if cfg.contexts is None else \
            plan_contexts(cfg, recipe, out)
        tasks = fresh if cfg.confirm_of else [t for t in tasks if isinstance(t, ControlTask)] + runs + fresh
    return sorted(tasks, key=lambda t: -t.priority)


def run_task(task: RecallTask) -> dict[str, Any]:
    """Train one task's stages and evaluate the result (runs in a worker process)."""
    cfg = task.study
    torch.set_num_threads(cfg.threads)
    folder = Path(task.folder)
    wall: dict[str, float] = {}
    init = None
    results = {}
    for name, s in zip(task.stage_folders(), task.stages):
        if cfg.evaluate_only:  # the earlier run's checkpoint of this stage
            init = str(folder / name)
            continue
        t0 = time.perf_counter()
        s = s.replace(seed=task.seed, out_dir=str(folder / name), init_from=init, progress=False,
                      compile=cfg.compile, device=task.device if s.device == "auto" else s.device)
        res = train_stage_once(task.model if s.spec.is_first else None, s)  # later: the model of init_from
        wall[s.stage] = time.perf_counter() - t0
        init = str(res.checkpoint)
        results[s.stage] = res
    t0 = time.perf_counter()
    model, _ = load_model(init)
    if task.compiles:
        from prisme.model.compiled_editor import maybe_compile

        maybe_compile(model, cfg.compile)
    entry = task.evaluate(model, init)
    wall["evaluate"] = time.perf_counter() - t0
    entry["wall_s"] = wall
    return {"task": task.describe(), "entry": entry}


# ------------------------------------------------------------------------------------------------------------ report
# what changes no run and no score
UNRECORDED = ("out_dir", "jobs", "threads", "config_dir", "evaluate_only", "compile", "reuse", "executor", "address")


def study_settings(cfg: RecallStudyConfig, planned: list[RecallTask]) -> dict[str, Any]:
    """What a recall study scores and trains, as its folder records it (`runner.record_study`) and its document
    (`scored`): its kind, its own settings, each run's stage steps, and each run's model and stage configs."""
    return {"kind": "frontier" if cfg.frontier else "controllers", "quick": cfg.quick,
            "study": {k: v for k, v in dataclasses.asdict(cfg).items()
                      if k not in UNRECORDED and (v or k not in ("confirm_seeds", "confirm_of"))},  # off: as before
            "steps": {Path(t.folder).name: t.stage_steps() for t in planned},
            "runs": {Path(t.folder).name: {"model": t.model.to_dict(), "stages": [s.to_dict() for s in t.stages]}
                     for t in planned}}


def check_rescoring(cfg: RecallStudyConfig, settings: dict[str, Any], planned: list[RecallTask]) -> None:
    """`--evaluate-only`: ValueError unless the study in `cfg.out_dir` was run with these settings (its record, or
    an older folder's recall.json) and each stage's checkpoint is the finished one of its planned stage."""
    from prisme.checkpoint import read_meta
    from prisme.studies.runner import differences, migrated, recorded_study

    out = Path(cfg.out_dir)
    before = recorded_study(out)
    now = json.loads(json.dumps(settings))
    if before is None and (out / "recall.json").is_file():  # a study run before settings were recorded
        old = json.loads((out / "recall.json").read_text()).get("study", {})
        before = {"study": {k: v for k, v in old.items() if k in now["study"]}}
        now = {"study": {k: now["study"][k] for k in before["study"]}}
    if before is not None:
        changed = differences(migrated(before), now)  # (fields added since: at the values it ran with)
        if changed:
            raise ValueError(f"--evaluate-only: the study in {out} was run with other settings "
                             f"({'; '.join(changed[:3])}); re-score it with its own (pass the options it was run with)")
    for t in planned:
        if searched(cfg, t) and not (Path(t.folder) / t.stage_folders()[-1] / "latest").exists():
            continue  # a search did not train it (`costlier_than_passing`)
        for name, s in zip(t.stage_folders(), t.stages):
            folder = Path(t.folder) / name
            if not (folder / "latest").exists():
                raise ValueError(f"--evaluate-only: {folder} holds no checkpoint; run the study with the same "
                                 f"settings (and --out) first")
            meta = read_meta(folder)
            if meta.step != s.steps or meta.metrics.get("interrupted"):
                raise ValueError(f"--evaluate-only: {folder} holds a {s.stage} checkpoint at step {meta.step} "
                                 f"{'(interrupted) ' if meta.metrics.get('interrupted') else ''}but these settings "
                                 f"train {s.steps} steps (quick: {cfg.quick}); pass the settings the study was run "
                                 f"with, or continue it first (--resume)")


def searched(cfg: RecallStudyConfig, t: RecallTask) -> bool:
    """Whether the study may leave run `t` untrained: a dense run under the long-context "cheapest" search, or a run
    of the confirmation pass (trained only where it decides the verdict)."""
    return cfg.contexts is not None and cfg.context_search == "cheapest" and isinstance(t, DenseTask) \
        or is_fresh(cfg, t)


def prepare_study(cfg: RecallStudyConfig, resume: bool = False) -> tuple[RecallStudyConfig, Recipe, list[Task]]:
    """Validate, plan and check every run folder before anything trains; returns (the effective settings, the recipe,
    the tasks for `runner.run_tasks`, each named by its folder). A folder where this study was started with the same
    settings is continued (`runner.open_study`); `resume` asks for one."""
    cfg.validate()
    if cfg.quick:
        cfg = dataclasses.replace(cfg, seeds=cfg.seeds if cfg.confirm_of else cfg.seeds[:1],  # a record's: as run
                                  eval_sequences=min(cfg.eval_sequences, 128),
                                  calibration_sequences=min(cfg.calibration_sequences, 128),
                                  confirm_seeds=cfg.confirm_seeds and cfg.confirm_seeds[:1])
    recipe, _ = load_recipe(cfg)
    planned = plan_tasks(cfg, recipe)
    settings = study_settings(cfg, planned)
    check_document_kind(cfg)
    if cfg.evaluate_only:
        check_rescoring(cfg, settings, planned)
    elif not open_study(cfg.out_dir, settings, resume, "recall study"):
        for t in planned:  # nothing trains if any run folder is already taken (by another study or run)
            for s in t.stage_folders():
                if (Path(t.folder) / s / "latest").exists():
                    raise ValueError(f"{Path(t.folder) / s} already holds a run; pass another --out or remove it")
    after = waits_for(cfg, planned, [t.folder for t in planned])  # the confirmation's runs wait for the verdict
    tasks = [Task(t.folder, run_task, (dataclasses.replace(t, device=task_device(cfg.executor, i)),),  # over GPUs
                  after=after.get(t.folder, ())) for i, t in enumerate(planned)]
    return cfg, recipe, tasks


def finish_study(cfg: RecallStudyConfig, recipe: Recipe, results: dict[str, Any], tasks: list[Task],
                 total_s: float, jobs: int) -> dict[str, Any]:
    """The document from the finished tasks (`results` by task name), written with its plots to the study folder."""
    done = [(study_task(t), results[t.name]["entry"]) for t in tasks if t.name in results]  # a search skips some
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_document_kind(cfg)
    scored = study_settings(cfg, [d[0] for d in done])
    scored = {"kind": scored["kind"], "quick": cfg.quick, "seeds": cfg.seeds, "eval_sequences": cfg.eval_sequences,
              "calibration_sequences": cfg.calibration_sequences, "steps": scored["steps"],
              "reused": reused_runs(cfg.out_dir)}
    if cfg.confirm_of:
        doc = {**confirmation_document(cfg, recipe, done, total_s, jobs), "scored": scored}
        write_text_atomic(out / "recall.json", json.dumps(doc, indent=2, allow_nan=False) + "\n")
        return doc
    if cfg.frontier:
        doc = {**assemble_frontier_study(cfg, recipe, done, total_s, jobs), "scored": scored}
        write_text_atomic(out / "recall.json", json.dumps(doc, indent=2, allow_nan=False) + "\n")
        plot_frontier(doc, out / "recall_frontier.png")
        plot_frontier(doc, out / "recall_frontier_training.png", training=True)  # against training compute
        if "contexts" in doc:
            plot_ratio(doc, out / "recall_context_ratio.png")
            for c in doc["contexts"]:  # accuracy against ops, and against training compute, at each length
                plot_frontier({"frontier": c["frontier"]}, out / f"recall_frontier_T{c['T']}.png")
                plot_frontier({"frontier": c["frontier"]}, out / f"recall_frontier_training_T{c['T']}.png", True)
        return doc
    doc = {**assemble(cfg, recipe, done, total_s, jobs), "scored": scored}
    write_text_atomic(out / "recall.json", json.dumps(doc, indent=2, allow_nan=False) + "\n")
    plot_accuracy_vs_ops(doc, out / "recall_accuracy_vs_ops.png")
    first = next((s for s in doc["seeds"]), None)
    if first is not None:
        plot_edits(first["controller_checkpoint"], recipe.mqar, first["seed"], first["controller"]["lambda"],
                   out / "recall_edits.png")
    return doc


def run_study(cfg: RecallStudyConfig, progress: bool = True, resume: bool = False) -> dict[str, Any]:
    """Run every task (in `cfg.jobs` worker processes), then assemble the report document. A study started in
    `cfg.out_dir` with the same settings before continues from what finished (`resume`: one must have been)."""
    cfg, recipe, tasks = prepare_study(cfg, resume)
    store, resumed = None, False
    if not cfg.evaluate_only:
        resumed = open_study(cfg.out_dir, settings := study_settings(cfg, [study_task(t) for t in tasks]))
        if cfg.reuse:  # a bad --reuse is an error before the study is recorded
            copied = reuse_runs(cfg.reuse, cfg.out_dir, settings, [t.name for t in tasks])
            print(f"--reuse: {len(copied)} runs copied from {cfg.reuse} (trained as these settings train them; scored "
                  f"again)", file=sys.stderr, flush=True)
        store = record_study(cfg.out_dir, settings)
    t0 = time.perf_counter()
    prune = defer = None
    planned, names = [study_task(t) for t in tasks], [t.name for t in tasks]
    if cfg.contexts is not None and cfg.context_search == "cheapest":
        prune, defer = costlier_than_passing(cfg, planned, names), decided_by_running(cfg, planned, names)
    if cfg.confirm_seeds:  # the confirmation's runs of the models that decide nothing are dropped
        prune = confirmation_prune(cfg, planned, names, prune)
    results = run_tasks(tasks, cfg.jobs, on_done=progress_printer(progress, len(tasks)), store=store,
                        resumed=resumed, prune=prune, defer=defer, pool=pool_options(cfg))
    return finish_study(cfg, recipe, results, tasks, time.perf_counter() - t0, worker_count(cfg.jobs, len(tasks)))


def progress_printer(on: bool, n: int, label: str = "") -> Any:
    """An `on_done` for `run_tasks` that prints one line per finished recall task (None when `on` is False)."""
    if not on:
        return None
    count = [0]

    def show(task: Task, res: dict[str, Any], elapsed: float) -> None:
        count[0] += 1
        t = study_task(task)
        what = t.kind if t.name is None else f"{t.kind} {t.name}"
        print(f"[{label}{count[0]}/{n} {elapsed:6.0f} s] {what} seed {t.seed}: accuracy {t.headline(res['entry']):.4f}",
              file=sys.stderr, flush=True)

    return show


def study_task(task: Task) -> RecallTask:
    """The recall task a pool task of `prepare_study` runs."""
    return task.args[0]


def assemble_frontier_study(cfg: RecallStudyConfig, recipe: Recipe, done: list[tuple[RecallTask, dict[str, Any]]],
                            total_s: float, jobs: int) -> dict[str, Any]:
    """The `--frontier` study's JSON document: the controls, the frontier, the winners' decode speed, and the verdict
    restated from the confirmation pass's runs (`confirmation`)."""
    done, fresh = [d for d in done if not is_fresh(cfg, d[0])], [d for d in done if is_fresh(cfg, d[0])]
    controls = {t.name: e for t, e in sections(cfg, done)["controls"]}
    contexts = None if cfg.contexts is None else assemble_contexts(cfg, recipe, done)
    frontier = assemble_frontier(cfg, recipe, done) if contexts is None else contexts[-1]["frontier"]  # the longest
    frontiers = {None: frontier} if contexts is None else {c["T"]: c["frontier"] for c in contexts}
    phases: dict[str, float] = {}
    for t, e in done + fresh:
        for k, v in e["wall_s"].items():
            key = f"{t.kind}_{'confirm_' if is_fresh(cfg, t) else ''}{k}"
            phases[key] = phases.get(key, 0.0) + v
    t0 = time.perf_counter()
    speed = decode_speed(frontier, recipe.mqar if contexts is None else recipe_at(cfg, recipe, contexts[-1]["T"]).mqar)
    v = frontier["verdict"]
    extra = {} if contexts is None else {"contexts": contexts, "ratio_by_context": ratio_by_context(contexts)}
    return extra | {
        "task": dataclasses.asdict(recipe.mqar),
        "model": recipe.model.to_dict(),
        "recipe": {"backbone": recipe.backbone.to_dict(), "workspace": recipe.workspace.to_dict(),
                   "router": recipe.router.to_dict()},
        "study": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("config_dir",)},
        "controls": controls,
        "frontier": frontier,
        "decode_speed": speed,
        "confirmation": confirm_study(cfg, recipe, frontiers, fresh),
        "summary": {"negative_control_ok": controls["one_layer"]["accuracy"] <= 0.30,
                    "positive_control_ok": controls["two_layer"]["accuracy"] >= TARGET_ACCURACY,
                    "prisme_beats_dense": v["ops_ratio_prisme_over_dense"] is not None
                    and v["ops_ratio_prisme_over_dense"] < 1},
        "wall_s": {"total": total_s + time.perf_counter() - t0, **phases, "decode_speed": time.perf_counter() - t0,
                   "jobs": jobs, "note": "phases sum the time of every run in that phase over all workers"},
    }


# ---------------------------------------------------------------------------------------------------------------- CLI
def main(args: Any) -> int:
    """`prisme study recall`. With --evaluate-only, the options that choose the runs (--quick, --frontier, --seeds,
    --bank-source, --confirm-seeds, --confirm-of) default to those the study in --out was run with. A --frontier
    study's confirmation pass trains on the 3 seeds after its largest (`seeds_after`) unless --confirm-seeds (or the
    study file) says which; --confirm-of confirms a recorded study, whose seeds are the study's."""
    seeds = parse_seeds(args.seeds) if args.seeds is not None else None
    confirm_of = getattr(args, "confirm_of", None)
    if confirm_of is not None:
        recorded = recorded_seeds(read_recorded(confirm_of))
        if seeds not in (None, recorded):
            raise ValueError(f"--seeds: the study --confirm-of {confirm_of} records ran seeds "
                             f"{','.join(map(str, recorded))}: they are this study's (leave --seeds out)")
        seeds = recorded
    context = getattr(args, "context", None)
    lengths = study_config({}, args.configs).context_lengths if context == "default" else []
    given = {"seeds": seeds, "quick": args.quick or None, "bank_source": args.bank_source,
             "frontier": getattr(args, "frontier", False) or None, "contexts": parse_contexts(context, lengths),
             "confirm_seeds": parse_confirm_seeds(getattr(args, "confirm_seeds", None)), "confirm_of": confirm_of}
    evaluate_only = getattr(args, "evaluate_only", False)
    if evaluate_only:
        given = {**own_settings(args.out or RecallStudyConfig.out_dir, given), **{k: v for k, v in given.items()
                                                                                 if v is not None}}
    elif given["frontier"] and given["confirm_seeds"] is None:  # the default: fresh seeds after the study's
        base = study_config({}, args.configs)
        if base.confirm_seeds is None:
            given["confirm_seeds"] = seeds_after(seeds or base.seeds)
    cfg = study_config({**given, "out_dir": args.out, "jobs": args.jobs, "threads": args.threads,
                        "executor": getattr(args, "executor", None), "address": getattr(args, "address", None),
                        "evaluate_only": evaluate_only or None, "reuse": getattr(args, "reuse", None),
                        "compile": getattr(args, "compile", None) or "off"}, args.configs)
    from prisme.io import check_output_file

    check_output_file(args.json, "--json")  # before anything trains
    return emit_study(run_study(cfg, progress=not args.no_progress, resume=getattr(args, "resume", False)),
                      format_table, args.json)
