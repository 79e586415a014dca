"""`prisme study text`: what the workspace buys on text, over training seeds, against the dense frontier, for each
bank source.

`--context T` (`context`): windows of T bytes (e.g. 1,024), each step as many bytes as at 128; PRISME's backbone is
local (`context_model`: a 64-byte attention window with the key shift) with a router, its workspace reads the whole
window where the router fires (stage 3 is the router's, deployed at budget 1); the frontier (`context_frontier`) is
dense global attention (1-3 layers, with the key shift; one without) and local windows; the slices split AR hits into
those within PRISME's window and those beyond it (`slice_table`).

On byte-level Austen (the `demo` preset: a one-layer backbone, d = 128), per training seed and scored on the same
tokens:

* the backbone alone (stage 1) and the backbone trained on as many extra tokens as stage 2 used (matched);
* the dense frontier: backbones alone over depths and widths (`frontier`; default 1, 2 and 3 layers at the preset's
  width and one layer at d = 96), each trained from scratch on as many tokens as PRISME's three stages together;
* for each bank source: the workspace's fixed / random / dense policies, the controller across lambda with its
  equal-edits baseline (the same mean edits spread uniformly), and the greedy oracle (reads the targets);

on the validation split and on a held-out text by another author and genre (Bierce's *The Devil's Dictionary*,
scored whole). Every difference is a paired 95% bootstrap interval over sequences: to the backbone, to the matched
backbone, and to the dense frontier interpolated at the row's ops (`frontier_gap`). A claim about a method holds over
seeds: the summary counts the seeds whose interval is below zero (`text_report.seed_summary`).

Bank sources: "residual" is the seed's workspace (bank and z from H, the demo's config); "embedding" is the recall
study's (bank keys, values and z from the token embeddings with a token shift; the controller reads H and the bank
match); "residual_shift" reads H with the key shift (entry j's key also reads H_{j-1}: a query that matches a context
reads the byte that followed it, an induction head). Stage 1 is trained once per seed: it never touches the
workspace, so the other source's stage-1 checkpoint is the same backbone under its own workspace config
(`rebase.rebase_backbone`, exact).

After the study's seeds, the confirmation pass (`text_confirm`, `confirm_seeds`): the runs that decide each verdict
train again on fresh seeds, as tasks of the same graph (`text_tasks`), and the verdicts are restated from them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from prisme.config import PrismeConfig, with_added_fields
from prisme.io import write_text_atomic
from prisme.studies.pools import pool_options, task_device
from prisme.studies.records import STUDY_DIR, open_study, record_study, reuse_runs, reused_runs, store_path
from prisme.studies.runner import Task, run_tasks, stored_results, worker_count
from prisme.studies.text_compute import training_compute
from prisme.studies.text_confirm import confirmation_block, confirmation_prune, fresh_tasks, study_evaluations
from prisme.studies.text_data import check_inputs, corpus_records, stage_bytes
from prisme.studies.text_report import capture_summary, format_report, seed_summary, verdicts
from prisme.studies.text_setup import TextStudyConfig, frontier_config, frontier_name, stage_configs
from prisme.studies.text_tasks import (
    BackboneTask,
    EvalTask,
    FrontierTask,
    MatchedTask,
    SourceTask,
    TextTask,
    run_task,
    study_task,
)
from prisme.training.config import StageConfig

__all__ = ["TextStudyConfig", "format_report", "prepare_study", "finish_study", "run_study", "verdicts", "TextTask",
           "BackboneTask", "MatchedTask", "FrontierTask", "SourceTask", "EvalTask"]


# ------------------------------------------------------------------------------------------------------------ run
UNRECORDED = ("out_dir", "jobs", "threads", "progress", "compile", "executor", "address", "reuse")  # change no run
ADDED_FIELDS = {"corpus": "austen", "prisme_layers": None, "workspace_steps": None,  # and their values before them
                "confirm_seeds": None, "copy_head": None, "copy_steps": 500}  # (no confirmation pass: None or [])
RECORDED_DEFAULTS = {f"study.{k}": v for k, v in ADDED_FIELDS.items() if k != "confirm_seeds"}  # a rerun names them


def study_settings(cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[int, dict[str, StageConfig]]
                   ) -> dict[str, Any]:
    """What the study trains and scores, as its folder records it (`records.record_study`): the training corpus by
    name (and every stage's `dataset`), with its bytes and sha256 where it is not Austen; the fields added since
    (`ADDED_FIELDS`) only where they are set, so a study recorded before them continues (`stages` holds the fresh
    seeds' too when there is a confirmation pass)."""
    study = {k: v for k, v in dataclasses.asdict(cfg).items()
             if k not in UNRECORDED and not (k in ADDED_FIELDS and (v == ADDED_FIELDS[k] or k == "confirm_seeds"
                                                                    and not v))}
    out = {"study": study, "model": model_cfg.to_dict(),
           "stages": {str(seed): {k: v.to_dict() for k, v in st.items()} for seed, st in stages.items()}}
    if cfg.corpus != ADDED_FIELDS["corpus"]:
        out["corpus"] = corpus_records(cfg)["train"]
    return out


def prepare_study(cfg: TextStudyConfig, model_cfg: PrismeConfig | None = None, resume: bool = False
                  ) -> tuple[PrismeConfig, dict[int, dict[str, StageConfig]], list[Task]]:
    """Validate and check everything before anything trains; returns (the model config, each seed's stage configs,
    the tasks for `runner.run_tasks`: per seed a small dependency graph, its long chains first, then its evaluations;
    then the confirmation pass's, `text_confirm.fresh_tasks`). A folder where this study was started with the same
    settings is continued (`runner.open_study`); `resume` asks for one."""
    model_cfg = model_cfg if model_cfg is not None else PrismeConfig.from_name("demo")
    cfg.validate(model_cfg)
    model_cfg = cfg.study_model(model_cfg)
    out = Path(cfg.out_dir)
    stages = {seed: stage_configs(cfg, model_cfg, seed) for seed in [*cfg.seeds, *(cfg.confirm_seeds or [])]}
    check_inputs(cfg, stages[cfg.seeds[0]])
    opened = open_study(out, study_settings(cfg, model_cfg, stages), resume, "text study", RECORDED_DEFAULTS)
    if not opened and out.exists() and any(out.iterdir()):  # a study started there with these settings continues
        raise ValueError(f"study folder {out} already exists and is not empty; pass another --out")
    models: dict[str, PrismeConfig] = {}  # the frontier's models by name, in the order of `frontier`
    for f in cfg.frontier_entries:
        models.setdefault(frontier_name(model_cfg, *f), frontier_config(model_cfg, *f))
    sources = list(dict.fromkeys(cfg.sources))
    planned: list[tuple[TextTask, list[TextTask], list[TextTask]]] = []  # (task, the tasks it needs, those it starts
    #   after), in the order they should start
    for seed in cfg.seeds:  # a seed's evaluations start as soon as its own models are trained: its verdict is
        #   printed hours before the last seed's, and a stopped study has whole seeds to show
        backbone = BackboneTask(seed)
        runs = [SourceTask(seed, s) for s in sources]
        frontier = [FrontierTask(seed, m) for m in models.values()]
        matched = MatchedTask(seed)
        planned += [(backbone, [], []), *((r, [backbone], []) for r in runs),  # the long ones: stage 1, each
                    #   source's stages 2-3, the frontier (deepest first; a "+copy" twin after its dense model)
                    *((f, plain_task(f, frontier), []) for f in sorted(frontier, key=frontier_order)),
                    (matched, [backbone], []),
                    *((EvalTask(seed, r.source, split), [r, matched, *frontier], [])
                      for split in ("held_out", "val") for r in runs)]
    planned += fresh_tasks(cfg, sources, list(models.values()))
    tasks = [Task(t.name, run_task, (t, cfg, model_cfg, stages[t.seed], task_device(cfg.executor, i)),
                  tuple(n.name for n in needs), tuple(n.name for n in after))
             for i, (t, needs, after) in enumerate(planned)]
    return model_cfg, stages, tasks


def plain_task(f: FrontierTask, frontier: list[FrontierTask]) -> list[FrontierTask]:
    """What a frontier model's task needs: a "+copy" twin its dense model's task (whose checkpoint its copy stage
    starts from), any other nothing."""
    if not f.model.copy_head:
        return []
    return [t for t in frontier if t.seed == f.seed and t.model.name == f.model.name.removesuffix("+copy")]


def frontier_order(f: FrontierTask) -> tuple[int, bool]:
    """The frontier's start order: deepest first, each dense model before its "+copy" twin."""
    return -f.model.n_layer, f.model.copy_head


def reuse_training(cfg: TextStudyConfig, settings: dict[str, Any], tasks: list[Task]) -> list[str]:
    """`--reuse FOLDER`: copy the finished training runs of the text study in FOLDER (a study's folder, or a demo's
    text/) that trained exactly as these settings would (the model, and the stage configs that train the run's
    folder) into this study's folder (`records.reuse_runs`); nothing is trained again for them, and every run is
    scored anew (another held-out text, other scoring settings). Returns the folders copied."""
    out = Path(cfg.out_dir)
    units: dict[Path, tuple[int, tuple[str, ...], str]] = {}  # run folder -> (seed, its stage configs, its task)
    for t in (study_task(t) for t in tasks):
        copy = ("copy",) if cfg.uses_copy else ()  # a copy-head study's runs: their copy stages too
        st = {"backbone": ("backbone",), "matched": ("backbone", "matched", *(("matched_copy",) if copy else ())),
              "frontier": (t.key,), "source": ("backbone", *copy, "workspace", "controller")}.get(t.kind)
        if st is None:  # an evaluation: scored anew
            continue
        folder = out / f"seed{t.seed}" / t.source if t.kind == "source" else \
            Path(settings["stages"][str(t.seed)][st[-1]]["out_dir"])
        units[folder.relative_to(out)] = (t.seed, st, t.name)
        if t.kind == "matched" and copy:  # the matched backbone's own run, which its copy stage starts from
            plain = Path(settings["stages"][str(t.seed)]["matched"]["out_dir"])
            units[plain.relative_to(out)] = (t.seed, ("backbone", "matched"), t.name)

    ours = PrismeConfig.from_dict(settings["model"])
    entries = {f"frontier:{frontier_name(ours, *f)}": f for f in cfg.frontier_entries}

    def entry(recorded: dict[str, Any], rel: Path) -> Any:
        seed, keys, _ = units[rel]
        stages = [recorded.get("stages", {}).get(str(seed), {}).get(k) for k in keys]
        if None in stages:
            return None
        if keys[0] in entries:  # a dense model: its own config (PRISME's depth, sources and workspace change nothing)
            try:
                model = frontier_config(PrismeConfig.from_dict(with_added_fields(recorded["model"])), *entries[keys[0]])
            except (KeyError, TypeError, ValueError):
                return None
            return {"model": model.to_dict(), "stages": stages}
        return {"model": recorded.get("model"), "stages": stages}

    def finished(src: Path, rel: Path) -> bool:  # a kept result: of this study, or of the demo whose text/ it is
        name = units[rel][2]
        return store_path(src / STUDY_DIR / "done", name).is_file() or \
            store_path(src.parent / STUDY_DIR / "done", f"text/{name}").is_file()

    return reuse_runs(cfg.reuse, out, settings, [str(out / rel) for rel in units], entry, finished)


def finish_study(cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[int, dict[str, StageConfig]],
                 done: dict[str, dict[str, Any]], tasks: list[Task], total_s: float, jobs: int) -> dict[str, Any]:
    """The document from the finished tasks (`done` by task name), written to `<out>/text.json`."""
    doc = assemble(cfg, model_cfg, stages, done, tasks, total_s, jobs)
    write_text_atomic(Path(cfg.out_dir) / "text.json", json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return doc


def progress_printer(on: bool, label: str = "text study") -> Any:
    """An `on_done` for `run_tasks` that prints one line per finished text task (None when `on` is False)."""
    if not on:
        return None
    return lambda task, res, elapsed: print(f"[{label} {elapsed:6.0f} s] {task.name} done ({res['wall_s']:.0f} s)",
                                            file=sys.stderr, flush=True)


def run_study(cfg: TextStudyConfig, model_cfg: PrismeConfig | None = None, resume: bool = False) -> dict[str, Any]:
    """Train and evaluate everything (`jobs` worker processes); returns the document (also `<out>/text.json`). A
    study started in `cfg.out_dir` with the same settings continues from what finished (`resume`: one must have)."""
    model_cfg, stages, tasks = prepare_study(cfg, model_cfg, resume)
    settings = study_settings(cfg, model_cfg, stages)
    resumed = open_study(cfg.out_dir, settings)
    if cfg.reuse:  # a bad --reuse is an error before the study is recorded
        copied = reuse_training(cfg, settings, tasks)
        print(f"--reuse: {len(copied)} runs copied from {cfg.reuse} (trained as these settings train them; scored "
              f"again)", file=sys.stderr, flush=True)
    store = record_study(cfg.out_dir, settings, "text study")
    t0 = time.perf_counter()
    done = run_tasks(tasks, cfg.jobs, on_done=progress_printer(cfg.progress), store=store, resumed=resumed,
                     pool=pool_options(cfg), prune=confirmation_prune(cfg, model_cfg, tasks) if cfg.confirm_seeds
                     else None)
    return finish_study(cfg, model_cfg, stages, done, tasks, time.perf_counter() - t0,
                        worker_count(cfg.jobs, len(tasks)))


def document_so_far(cfg: TextStudyConfig, model_cfg: PrismeConfig | None = None) -> dict[str, Any]:
    """The document of a study still running or stopped, over the seeds whose evaluations have all finished (`prisme
    study text ... --so-far`): read from the study's store, nothing trained or scored; its verdicts count those
    seeds only and `so_far` names them beside the study's. The confirmation pass is left out until the study ends
    (its seeds are judged against every study seed). A ValueError where no seed has finished."""
    model_cfg, stages, tasks = prepare_study(cfg, model_cfg, resume=True)
    done = stored_results(Path(cfg.out_dir) / STUDY_DIR / "done", tasks)
    seeds = [seed for seed in cfg.seeds
             if all(e.name in done for e in study_evaluations(cfg) if e.seed == seed)]
    if not seeds:
        raise ValueError(f"--so-far: no seed of the study in {cfg.out_dir} has finished its evaluations yet (seeds "
                         f"{', '.join(map(str, cfg.seeds))}; {len(done)} of {len(tasks)} tasks finished)")
    kept = {t.name for t in tasks if study_task(t).seed in seeds and t.name in done}
    sub = dataclasses.replace(cfg, seeds=seeds, confirm_seeds=None)
    doc = assemble(sub, model_cfg, stages, {k: done[k] for k in kept}, tasks,
                   sum(done[k]["wall_s"] for k in kept), cfg.jobs)
    doc["so_far"] = {"seeds": seeds, "study_seeds": list(cfg.seeds), "confirm_seeds": cfg.confirm_seeds,
                     "tasks_finished": len(done), "tasks": len(tasks),
                     "note": "the seeds whose evaluations have finished; wall_s.total sums their tasks' times"}
    return doc


def assemble(cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[int, dict[str, StageConfig]],
             done: dict[str, dict[str, Any]], tasks: list[Task], total_s: float, jobs: int) -> dict[str, Any]:
    """`seeds`: per training seed its runs and every source's evaluations; `summary`: each row over the seeds;
    `confirmation`: the verdicts restated from the fresh seeds (`text_confirm.confirmation_block`; null without)."""
    of = {t.name: study_task(t) for t in tasks}
    seeds = {}
    for seed in cfg.seeds:
        seeds[str(seed)] = {
            "training": {of[k].key: v["result"] for k, v in done.items() if of[k].seed == seed and of[k].trains},
            "sources": {s: {split: done[EvalTask(seed, s, split).name]["result"] for split in ("val", "held_out")}
                        for s in cfg.sources}}
    phases: dict[str, float] = {}
    for name, v in done.items():
        phase = of[name].kind
        phases[phase] = phases.get(phase, 0.0) + v["wall_s"]
    first = stages[cfg.seeds[0]]
    doc = {"model": model_cfg.to_dict(), "study": dataclasses.asdict(cfg), "corpus": corpus_records(cfg),
           "stages": {k: v.to_dict() for k, v in first.items()}, "training_bytes": stage_bytes(first),
           "frontier": [frontier_name(model_cfg, *f) for f in cfg.frontier_entries], "seeds": seeds,
           "reused": reused_runs(cfg.out_dir),
           "wall_s": {"total": total_s, **phases, "jobs": jobs,
                      "note": "phases sum the time of every task in that phase over all workers and seeds"}}
    doc["training_compute"] = training_compute(cfg, model_cfg, stages)
    doc["summary"] = seed_summary(doc)
    doc["verdicts"] = verdicts(doc)
    doc["capture"] = capture_summary(doc)
    doc["confirmation"] = confirmation_block(cfg, model_cfg, doc, done)
    return doc
