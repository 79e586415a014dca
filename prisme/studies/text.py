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
from prisme.config import PrismeConfig, with_added_fields
from prisme.data.text import TokenDataset
from prisme.io import write_text_atomic
from prisme.rebase import rebase_backbone
from prisme.studies.pools import pool_options, task_device
from prisme.studies.records import STUDY_DIR, open_study, record_study, reuse_runs, reused_runs, store_path
from prisme.studies.runner import Task, run_tasks, train_stage_once, worker_count
from prisme.studies.text_data import check_inputs, corpus_records, held_out_data, stage_bytes, training_data
from prisme.studies.text_report import capture_summary, format_report, seed_summary, verdicts
from prisme.studies.text_setup import (
    CONTEXT_POLICIES,
    HELD_OUT_POLICIES,
    SOURCES,
    VAL_POLICIES,
    TextStudyConfig,
    context_slice_edges,
    final_folder,
    frontier_config,
    frontier_name,
    source_config,
    stage_configs,
)
from prisme.training.config import StageConfig

__all__ = ["TextStudyConfig", "format_report", "prepare_study", "finish_study", "run_study", "verdicts", "TextTask",
           "BackboneTask", "MatchedTask", "FrontierTask", "SourceTask", "EvalTask"]


# ------------------------------------------------------------------------------------------------------------ tasks
@dataclass(frozen=True)
class TextTask:
    """One unit of work of one training seed (a training run or an evaluation), `s<seed>/<key>` in the pool; it runs
    in a worker process, so every field pickles."""

    kind: ClassVar[str]  # also the phase of the study's wall time it counts towards
    trains: ClassVar[bool] = True  # a training run: its result is one of the seed's `training` entries
    seed: int

    @property
    def what(self) -> str | None:
        """The bank source, or the frontier model's name (None: the kind alone names the task)."""
        return None

    @property
    def key(self) -> str:
        """The task's name within its seed: `kind` or `kind:what` (its entry in the seed's `training`)."""
        return self.kind if self.what is None else f"{self.kind}:{self.what}"

    @property
    def name(self) -> str:
        return f"s{self.seed}/{self.key}"

    def describe(self) -> dict[str, Any]:
        """The task in its result: {"kind", "what", "seed"}."""
        return {"kind": self.kind, "what": self.what, "seed": self.seed}

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        """Train or evaluate; returns the task's result."""
        raise NotImplementedError


@dataclass(frozen=True)
class BackboneTask(TextTask):
    """Stage 1: the backbone, once per seed (both bank sources start from it)."""

    kind: ClassVar[str] = "backbone"

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        return _summary(train_stage_once(model_cfg, stages["backbone"], dataset=data))


@dataclass(frozen=True)
class MatchedTask(TextTask):
    """The backbone trained on as many extra tokens as stage 2 used."""

    kind: ClassVar[str] = "matched"

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        return _summary(train_stage_once(None, stages["matched"], dataset=data))


@dataclass(frozen=True)
class FrontierTask(TextTask):
    """One dense frontier model (`frontier_config`), trained from scratch on PRISME's tokens."""

    kind: ClassVar[str] = "frontier"
    model: PrismeConfig

    @property
    def what(self) -> str:
        return self.model.name

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        return _summary(train_stage_once(self.model, stages[self.key], dataset=data))


@dataclass(frozen=True)
class SourceTask(TextTask):
    """Stages 2 and 3 for one bank source, from the seed's stage-1 backbone (rebased onto the source's config)."""

    kind: ClassVar[str] = "source"
    source: str

    @property
    def what(self) -> str:
        return self.source

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        folder = Path(cfg.out_dir) / f"seed{self.seed}" / self.source
        init = stages["backbone"].out_dir
        if SOURCES[self.source]:  # the same stage-1 backbone under this source's workspace config
            init = str(rebase_backbone(init, source_config(model_cfg, self.source), folder / "1_backbone",
                                       stages["backbone"].seed).parent)
        s2 = stages["workspace"].replace(out_dir=str(folder / "2_workspace"), init_from=init)
        r2 = train_stage_once(None, s2, dataset=data)
        s3 = stages["controller"].replace(out_dir=str(folder / final_folder(stages)), init_from=s2.out_dir)
        r3 = train_stage_once(None, s3, dataset=data)
        return {"workspace": _summary(r2), "controller": _summary(r3)}


@dataclass(frozen=True)
class EvalTask(TextTask):
    """Every policy of one bank source on one split: "val" (the validation split) or "held_out" (the held-out text)."""

    trains: ClassVar[bool] = False
    source: str
    split: str

    @property
    def kind(self) -> str:
        return f"eval_{self.split}"

    @property
    def what(self) -> str:
        return self.source

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        return _evaluate(cfg, model_cfg, stages, self.seed, self.source, data, self.split)


def _task(task: TextTask, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
          device: str = "auto") -> dict[str, Any]:
    """Run one task of one training seed, in a worker process (on `device`, see `devices.spread`)."""
    torch.set_num_threads(cfg.threads)
    stages = {k: v.replace(device=device) if v.device == "auto" else v for k, v in stages.items()}
    t0 = time.perf_counter()
    data = training_data(cfg.corpus)
    out: dict[str, Any] = task.describe()
    out["result"] = task.run(cfg, model_cfg, stages, data)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _summary(r: Any) -> dict[str, Any]:
    return {"steps": r.step, "tokens": r.tokens, "wall_s": round(r.wall_s, 1), "checkpoint": str(r.checkpoint),
            "val": r.val}


def _evaluate(cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig], seed: int, source: str,
              data: TokenDataset, split: str) -> dict:
    """Every policy of one source on the validation split ("val") or the whole held-out text ("held_out"), with
    paired intervals to the backbone, the matched backbone and the dense frontier."""
    from prisme.evaluation.policies import PolicySettings, standard_policies
    from prisme.evaluation.run import EvalOptions, evaluate_policies
    from prisme.model.compiled import maybe_compile

    run = Path(cfg.out_dir) / f"seed{seed}"
    model, _ = load_model(run / source / final_folder(stages))
    maybe_compile(model, cfg.compile)
    matched, _ = load_model(stages["matched"].out_dir)
    names = [frontier_name(model_cfg, *f) for f in cfg.frontier_entries]
    refs = {n: load_model(stages[f"frontier:{n}"].out_dir)[0] for n in names}
    T = cfg.eval_window or stages["workspace"].seq_len
    long = cfg.context is not None  # the router's rows at budget 1 (`CONTEXT_POLICIES`), slices by its window
    if split == "val":
        ds, batches, policies, budgets, ks, oracle_pos, lam = (data, cfg.val_batches, VAL_POLICIES, cfg.fixed_budgets,
                                                               (1, 2), cfg.oracle_positions, list(cfg.lambdas))
    else:
        ds = held_out_data(cfg.held_out, T)
        batches, policies, budgets, ks, oracle_pos, lam = (cfg.held_out_batches, HELD_OUT_POLICIES,
                                                           cfg.held_out_budgets, (1,), cfg.held_out_oracle_positions,
                                                           list(cfg.held_out_lambdas))
    if long:
        policies, budgets, ks, lam = CONTEXT_POLICIES, [1], (1,), list(cfg.context_lambdas)
    t0 = time.perf_counter()
    settings = PolicySettings(budgets=budgets, ks=ks, lambdas=lam, oracle_lambdas=[0.0], oracle_positions=oracle_pos,
                              controller_budget=1 if long else cfg.controller_budget, kappa_risk=cfg.kappa_risk)
    rows = standard_policies(model, policies, settings, matched=matched, references=refs)
    # the dense frontier: every dense model trained on PRISME's bytes (at 128 also PRISME's own backbone, alone and
    # with the matched bytes: the T = 128 study's frontier); at a long context PRISME's local backbone is a row
    frontier = names if long else ["backbone", "backbone+matched", *names]
    rep = evaluate_policies(model, ds, rows, EvalOptions(
        batch_size=cfg.context_eval_batch_size if long else cfg.eval_batch_size, seq_len=T, max_batches=batches,
        seed=seed, bootstrap_samples=cfg.bootstrap_samples, frontier=frontier, slices=cfg.slice_ngram,
        slices_window=context_slice_edges(model.cfg.attn_window, T) if long else None))
    if split == "held_out":
        rep.split = f"held-out text {Path(cfg.held_out).name} (all of it)"
    rep.plot(run / source / f"pareto_{split}.png")
    doc = rep.to_json()
    doc["wall_s"] = time.perf_counter() - t0
    doc["table"] = rep.table()
    return doc


# ------------------------------------------------------------------------------------------------------------ run
UNRECORDED = ("out_dir", "jobs", "threads", "progress", "compile", "executor", "address", "reuse")  # change no run
ADDED_FIELDS = {"corpus": "austen", "prisme_layers": None, "workspace_steps": None}  # and their values before them


def study_settings(cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[int, dict[str, StageConfig]]
                   ) -> dict[str, Any]:
    """What the study trains and scores, as its folder records it (`records.record_study`): the training corpus by
    name (and every stage's `dataset`), with its bytes and sha256 where it is not Austen; the fields added since
    (`ADDED_FIELDS`) only where they are set, so a study recorded before them continues."""
    study = {k: v for k, v in dataclasses.asdict(cfg).items()
             if k not in UNRECORDED and not (k in ADDED_FIELDS and v == ADDED_FIELDS[k])}
    out = {"study": study, "model": model_cfg.to_dict(),
           "stages": {str(seed): {k: v.to_dict() for k, v in st.items()} for seed, st in stages.items()}}
    if cfg.corpus != ADDED_FIELDS["corpus"]:
        out["corpus"] = corpus_records(cfg)["train"]
    return out


def prepare_study(cfg: TextStudyConfig, model_cfg: PrismeConfig | None = None, resume: bool = False
                  ) -> tuple[PrismeConfig, dict[int, dict[str, StageConfig]], list[Task]]:
    """Validate and check everything before anything trains; returns (the model config, each seed's stage configs,
    the tasks for `runner.run_tasks`: per seed a small dependency graph, every seed's long chains first). A folder
    where this study was started with the same settings is continued (`runner.open_study`); `resume` asks for one."""
    model_cfg = model_cfg if model_cfg is not None else PrismeConfig.from_name("demo")
    cfg.validate(model_cfg)
    model_cfg = cfg.study_model(model_cfg)
    out = Path(cfg.out_dir)
    stages = {seed: stage_configs(cfg, model_cfg, seed) for seed in cfg.seeds}
    check_inputs(cfg, stages[cfg.seeds[0]])
    if not open_study(out, study_settings(cfg, model_cfg, stages), resume, "text study") and out.exists() \
            and any(out.iterdir()):  # a study started there with these settings continues
        raise ValueError(f"study folder {out} already exists and is not empty; pass another --out")
    models: dict[str, PrismeConfig] = {}  # the frontier's models by name, in the order of `frontier`
    for f in cfg.frontier_entries:
        models.setdefault(frontier_name(model_cfg, *f), frontier_config(model_cfg, *f))
    sources = list(dict.fromkeys(cfg.sources))
    planned: list[tuple[TextTask, list[TextTask]]] = []  # (task, the tasks it needs), in the order they should start
    for tier in ("chains", "rest"):
        for seed in cfg.seeds:
            backbone = BackboneTask(seed)
            runs = [SourceTask(seed, s) for s in sources]
            frontier = [FrontierTask(seed, m) for m in models.values()]
            if tier == "chains":  # the long ones: stage 1, each source's stages 2-3, the frontier (deepest first)
                planned += [(backbone, []), *((r, [backbone]) for r in runs),
                            *((f, []) for f in sorted(frontier, key=lambda f: -f.model.n_layer))]
                continue
            matched = MatchedTask(seed)
            planned.append((matched, [backbone]))
            for split in ("held_out", "val"):
                planned += [(EvalTask(seed, r.source, split), [r, matched, *frontier]) for r in runs]
    tasks = [Task(t.name, _task, (t, cfg, model_cfg, stages[t.seed], task_device(cfg.executor, i)),
                  tuple(n.name for n in needs))
             for i, (t, needs) in enumerate(planned)]
    return model_cfg, stages, tasks


def reuse_training(cfg: TextStudyConfig, settings: dict[str, Any], tasks: list[Task]) -> list[str]:
    """`--reuse FOLDER`: copy the finished training runs of the text study in FOLDER (a study's folder, or a demo's
    text/) that trained exactly as these settings would (the model, and the stage configs that train the run's
    folder) into this study's folder (`records.reuse_runs`); nothing is trained again for them, and every run is
    scored anew (another held-out text, other scoring settings). Returns the folders copied."""
    out = Path(cfg.out_dir)
    units: dict[Path, tuple[int, tuple[str, ...], str]] = {}  # run folder -> (seed, its stage configs, its task)
    for t in (study_task(t) for t in tasks):
        st = {"backbone": ("backbone",), "matched": ("backbone", "matched"), "frontier": (t.key,),
              "source": ("backbone", "workspace", "controller")}.get(t.kind)
        if st is None:  # an evaluation: scored anew
            continue
        folder = out / f"seed{t.seed}" / t.source if t.kind == "source" else \
            Path(settings["stages"][str(t.seed)][st[-1]]["out_dir"])
        units[folder.relative_to(out)] = (t.seed, st, t.name)

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


def study_task(task: Task) -> TextTask:
    """The text task a pool task of `prepare_study` runs."""
    return task.args[0]


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
                     pool=pool_options(cfg))
    return finish_study(cfg, model_cfg, stages, done, tasks, time.perf_counter() - t0,
                        worker_count(cfg.jobs, len(tasks)))


def assemble(cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[int, dict[str, StageConfig]],
             done: dict[str, dict[str, Any]], tasks: list[Task], total_s: float, jobs: int) -> dict[str, Any]:
    """`seeds`: per training seed its runs and every source's evaluations; `summary`: each row over the seeds."""
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
    doc["summary"] = seed_summary(doc)
    doc["verdicts"] = verdicts(doc)
    doc["capture"] = capture_summary(doc)
    return doc
