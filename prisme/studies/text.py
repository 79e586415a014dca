"""`prisme study text`: what the workspace buys on text, with paired intervals, for each bank source.

On byte-level Austen (the `demo` preset: a one-layer backbone, d = 128), against the alternatives a reviewer would
ask for, each scored on the same tokens:

* the backbone alone (stage 1) and the backbone trained on as many extra tokens as stage 2 used (matched);
* a backbone one layer deeper trained from scratch on stage 1 + stage 2's tokens ("just make it bigger");
* for each bank source: the workspace's fixed / random / dense policies, the controller across lambda with its
  equal-edits baseline (the same mean edits spread uniformly), and the greedy oracle (reads the targets);

on the validation split and on a held-out text by another author and genre (Bierce's *The Devil's Dictionary*,
scored whole). Every difference is a paired 95% bootstrap interval over sequences; every verdict follows from it.

Bank sources: "residual" is the seed's workspace (bank and z from H, the demo's config); "embedding" is the recall
study's (bank keys, values and z from the token embeddings with a token shift; the controller reads H and the bank
match). Stage 1 is trained once: it never touches the workspace, so the other source's stage-1 checkpoint is the same
backbone under its own workspace config (`rebase.rebase_backbone`, exact).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prisme.checkpoint import load_model
from prisme.checks import COMPILE_SETTINGS, check_choice
from prisme.config import PrismeConfig
from prisme.data.text import HELD_OUT_TEXT, TokenDataset, load_text
from prisme.data.tokenizers import ByteTokenizer
from prisme.devices import spread
from prisme.io import write_text_atomic
from prisme.rebase import rebase_backbone
from prisme.studies.runner import Task, run_tasks, worker_count
from prisme.training.config import StageConfig
from prisme.training.trainer import train_stage

SOURCES = {  # name -> PrismeConfig overrides of the demo preset
    "residual": {},
    "embedding": dict(bank_source="embedding", bank_shift=True, controller_source="residual", controller_bank=True),
}
VAL_POLICIES = ["backbone", "matched", "fixed", "random", "dense", "controller", "oracle"]
HELD_OUT_POLICIES = ["backbone", "matched", "fixed", "controller", "oracle"]  # all of the text: the cheaper rows


@dataclass
class TextStudyConfig:
    """Settings of `prisme study text`."""

    sources: list[str] = field(default_factory=lambda: list(SOURCES))
    seed: int = 1337
    scale: float = 1.0  # multiplies every stage's steps (0.05: a smoke run)
    val_batches: int | None = 8  # validation batches of `eval_batch_size` x 128 (None: the whole split)
    held_out_batches: int | None = None  # batches of the held-out text (None: all of it)
    eval_batch_size: int = 64
    held_out: str = HELD_OUT_TEXT  # an embedded text's name, or a UTF-8 file / folder
    lambdas: list[float] = field(default_factory=lambda: [0.001, 0.003])  # the controller's prices (validation)
    held_out_lambdas: list[float] = field(default_factory=lambda: [0.003])  # ... on the held-out text (all of it)
    controller_budget: int = 1  # edits per position the deployed controller may make (its workspace trained 1..4)
    kappa_risk: float = 0.3  # its risk aversion: value - lambda cost - kappa risk (docs/workspace_training.md)
    oracle_positions: int = 4  # labelled positions per sequence the oracle samples (validation)
    held_out_oracle_positions: int = 1  # ... and on the held-out text (all of it: more sequences)
    fixed_budgets: list[int] = field(default_factory=lambda: [1])  # n of the fixed/random/dense rows (validation)
    held_out_budgets: list[int] = field(default_factory=lambda: [1])  # ... on the held-out text (single slots only)
    bootstrap_samples: int = 1000
    out_dir: str = "runs/text"
    jobs: int = 0  # worker processes (0 = one per CPU core)
    threads: int = 1  # torch threads per worker
    progress: bool = True
    backbone_keeps_learning: bool = False  # stage 2 also trains the backbone (from its own loss, the matched steps)
    compile: str = "off"  # the editor under torch.compile in stages 2-3 and the evaluation ("auto" | "strict")

    def validate(self) -> TextStudyConfig:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"text study: {msg}")

        need(len(self.sources) > 0 and all(s in SOURCES for s in self.sources),
             f"sources must be a non-empty list from {sorted(SOURCES)}, got {self.sources!r}")
        need(self.scale > 0 and math.isfinite(self.scale), f"scale must be > 0, got {self.scale}")
        for f in ("val_batches", "held_out_batches"):
            v = getattr(self, f)
            need(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                 f"{f} must be an int >= 1 or None (all), got {v!r}")
        for f in ("eval_batch_size", "oracle_positions", "bootstrap_samples", "threads"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{f} must be an int >= 1, got {v!r}")
        need(isinstance(self.jobs, int) and self.jobs >= 0, f"jobs must be an int >= 0, got {self.jobs!r}")
        need(all(isinstance(n, int) and n >= 1 for n in self.fixed_budgets), "fixed_budgets must be ints >= 1")
        need(len(self.lambdas) > 0 and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                                           for v in self.lambdas), f"lambdas must be finite numbers >= 0, got "
             f"{self.lambdas!r}")
        need(isinstance(self.controller_budget, int) and self.controller_budget >= 1,
             f"controller_budget must be an int >= 1, got {self.controller_budget!r}")
        need(isinstance(self.kappa_risk, (int, float)) and math.isfinite(self.kappa_risk) and self.kappa_risk >= 0,
             f"kappa_risk must be a finite number >= 0, got {self.kappa_risk!r}")
        check_choice("compile", self.compile, COMPILE_SETTINGS, "text study: ")
        return self


def stage_configs(cfg: TextStudyConfig, model_cfg: PrismeConfig) -> dict[str, StageConfig]:
    """The demo's recipe (`training.config.demo_stage_configs`, configs/demo_*.json) in the study folder, plus the
    deeper backbone: one more layer, trained from scratch on stage 1's and stage 2's tokens."""
    from prisme.training.config import demo_stage_configs

    run = Path(cfg.out_dir)
    st = demo_stage_configs(run, cfg.scale, cfg.seed, cfg.backbone_keeps_learning,
                            seq_len=min(128, model_cfg.max_seq_len))
    s1, s2 = st["backbone"], st["workspace"]
    steps = s1.steps + math.ceil(s2.steps * s2.batch_size * s2.seq_len / (s1.batch_size * s1.seq_len))
    st["deeper"] = s1.replace(steps=steps, out_dir=str(run / "deeper_backbone"))
    ws_stages = ("workspace", "controller")
    return {k: v.replace(progress=False, compile=cfg.compile if k in ws_stages else "off") for k, v in st.items()}


def source_config(base: PrismeConfig, source: str) -> PrismeConfig:
    return base.replace(**SOURCES[source]) if SOURCES[source] else base


# ------------------------------------------------------------------------------------------------------------ tasks
def _task(kind: str, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
          source: str | None = None, device: str = "auto") -> dict[str, Any]:
    """One unit of work, in a worker process: a training run or an evaluation (on `device`, see `devices.spread`)."""
    torch.set_num_threads(cfg.threads)
    stages = {k: v.replace(device=device) if v.device == "auto" else v for k, v in stages.items()}
    t0 = time.perf_counter()
    run = Path(cfg.out_dir)
    data = TokenDataset.from_text(load_text("austen"), ByteTokenizer(), val_fraction=0.1)
    out: dict[str, Any] = {"kind": kind, "source": source}
    if kind == "backbone":
        r = train_stage(model_cfg, stages["backbone"], dataset=data)
        out["result"] = _summary(r)
    elif kind == "deeper":
        r = train_stage(model_cfg.replace(n_layer=model_cfg.n_layer + 1, use_workspace=False), stages["deeper"],
                        dataset=data)
        out["result"] = _summary(r)
    elif kind == "matched":
        out["result"] = _summary(train_stage(None, stages["matched"], dataset=data))
    elif kind == "source":
        folder = run / source
        init = stages["backbone"].out_dir
        if SOURCES[source]:  # the same stage-1 backbone under this source's workspace config
            init = str(rebase_backbone(init, source_config(model_cfg, source), folder / "1_backbone",
                                       stages["backbone"].seed).parent)
        s2 = stages["workspace"].replace(out_dir=str(folder / "2_workspace"), init_from=init)
        r2 = train_stage(None, s2, dataset=data)
        s3 = stages["controller"].replace(out_dir=str(folder / "4_controller"), init_from=s2.out_dir)
        r3 = train_stage(None, s3, dataset=data)
        out["result"] = {"workspace": _summary(r2), "controller": _summary(r3)}
    elif kind in ("eval_val", "eval_held_out"):
        out["result"] = _evaluate(cfg, stages, source, data, kind.removeprefix("eval_"))
    else:  # pragma: no cover
        raise ValueError(kind)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _summary(r: Any) -> dict[str, Any]:
    return {"steps": r.step, "tokens": r.tokens, "wall_s": round(r.wall_s, 1), "checkpoint": str(r.checkpoint),
            "val": r.val}


def _evaluate(cfg: TextStudyConfig, stages: dict[str, StageConfig], source: str, data: TokenDataset,
              split: str) -> dict:
    """Every policy of one source on the validation split ("val") or the whole held-out text ("held_out"), with
    paired intervals."""
    from prisme.evaluation.run import evaluate_policies

    run = Path(cfg.out_dir)
    model, _ = load_model(run / source / "4_controller")
    from prisme.model.compiled import maybe_compile

    maybe_compile(model, cfg.compile)
    matched, _ = load_model(stages["matched"].out_dir)
    deeper, _ = load_model(stages["deeper"].out_dir)
    T = stages["workspace"].seq_len
    out = {}
    if split == "val":
        plan = [("val", data, cfg.val_batches, VAL_POLICIES, cfg.fixed_budgets, (1, 2), cfg.oracle_positions,
                 list(cfg.lambdas))]
    else:
        held = TokenDataset.held_out(load_text(cfg.held_out), ByteTokenizer(), T, name=Path(cfg.held_out).name)
        plan = [("held_out", held, cfg.held_out_batches, HELD_OUT_POLICIES, cfg.held_out_budgets, (1,),
                 cfg.held_out_oracle_positions, list(cfg.held_out_lambdas))]
    for name, ds, batches, policies, budgets, ks, oracle_pos, lam in plan:
        t0 = time.perf_counter()
        rep = evaluate_policies(model, ds, policies, batch_size=cfg.eval_batch_size, seq_len=T, max_batches=batches,
                                matched_backbone=matched, references={"deeper_backbone": deeper}, lambdas=lam,
                                oracle_positions=oracle_pos, seed=cfg.seed, oracle_lambdas=[0.0],
                                bootstrap_samples=cfg.bootstrap_samples, budgets=budgets, ks=ks,
                                controller_budget=cfg.controller_budget, kappa_risk=cfg.kappa_risk)
        if name == "held_out":
            rep.split = f"held-out text {Path(cfg.held_out).name} (all of it)"
        rep.plot(run / source / f"pareto_{name}.png")
        doc = rep.to_json()
        doc["wall_s"] = time.perf_counter() - t0
        doc["table"] = rep.table()
        out = doc
    return out


# ------------------------------------------------------------------------------------------------------------ run
def prepare_study(cfg: TextStudyConfig, model_cfg: PrismeConfig | None = None
                  ) -> tuple[PrismeConfig, dict[str, StageConfig], list[Task]]:
    """Validate and check everything before anything trains; returns (the model config, the stage configs, the
    tasks for `runner.run_tasks`: a small dependency graph, the long chains first)."""
    cfg.validate()
    model_cfg = model_cfg if model_cfg is not None else PrismeConfig.from_name("demo")
    out = Path(cfg.out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"study folder {out} already exists and is not empty; pass another --out")
    load_text(cfg.held_out)  # a missing or empty held-out text fails now, not after training
    stages = stage_configs(cfg, model_cfg)
    graph = {"backbone": [], "deeper": []}  # task -> tasks it needs, in the order they should start
    graph.update({f"source:{s}": ["backbone"] for s in cfg.sources})
    graph["matched"] = ["backbone"]
    for split in ("held_out", "val"):
        graph.update({f"eval_{split}:{s}": [f"source:{s}", "matched", "deeper"] for s in cfg.sources})
    tasks = []
    for i, (name, needs) in enumerate(graph.items()):
        kind, _, src = name.partition(":")
        tasks.append(Task(name, _task, (kind, cfg, model_cfg, stages, src or None, spread(i)), tuple(needs)))
    return model_cfg, stages, tasks


def finish_study(cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
                 done: dict[str, dict[str, Any]], total_s: float, jobs: int) -> dict[str, Any]:
    """The document from the finished tasks, written to `<out>/text.json`."""
    doc = assemble(cfg, model_cfg, stages, done, total_s, jobs)
    write_text_atomic(Path(cfg.out_dir) / "text.json", json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return doc


def progress_printer(on: bool, label: str = "text study") -> Any:
    """An `on_done` for `run_tasks` that prints one line per finished text task (None when `on` is False)."""
    if not on:
        return None
    return lambda task, res, elapsed: print(f"[{label} {elapsed:6.0f} s] {task.name} done ({res['wall_s']:.0f} s)",
                                            file=sys.stderr, flush=True)


def run_study(cfg: TextStudyConfig, model_cfg: PrismeConfig | None = None) -> dict[str, Any]:
    """Train and evaluate everything (`jobs` worker processes); returns the document (also `<out>/text.json`)."""
    model_cfg, stages, tasks = prepare_study(cfg, model_cfg)
    t0 = time.perf_counter()
    done = run_tasks(tasks, cfg.jobs, on_done=progress_printer(cfg.progress))
    return finish_study(cfg, model_cfg, stages, done, time.perf_counter() - t0, worker_count(cfg.jobs, len(tasks)))


def verdicts(doc: dict[str, Any]) -> list[str]:
    """Sentences that follow from the intervals, one per (source, split), plus the deeper backbone's."""
    lines = []
    first = True
    for src, by in doc["sources"].items():
        for split in ("val", "held_out"):
            rows = by[split]["rows"]
            if first:
                deeper = next(r for r in rows if r["family"] == "reference")
                lines.append(f"{split}: the backbone one layer deeper (same tokens, "
                             f"{deeper['relative_ops']:.2f}x ops) {deeper['verdict_vs_matched']} the matched backbone "
                             f"({_ci(deeper['delta_vs_matched'])})")
            ws = [r for r in rows if r["deployable"] and r["family"] in ("fixed", "random", "dense", "controller")
                  and r.get("delta_vs_matched")]
            if not ws:
                continue
            best = min(ws, key=lambda r: r["delta_vs_matched"]["hi"])
            word = {"beats": "beats", "ties": "ties with", "loses": "loses to"}[best["verdict_vs_matched"]]
            lines.append(f"{split}, {src} bank: the workspace's best row {best['policy']} {word} the matched backbone "
                         f"({_ci(best['delta_vs_matched'])} nats/byte at {best['relative_ops']:.2f}x ops); vs its own "
                         f"backbone {_ci(best['delta_vs_backbone'])}")
            ctrl = [r for r in rows if r["family"] == "controller" and r.get("delta_vs_equal_edits")]
            wins = [r for r in ctrl if r["verdict_vs_equal_edits"] == "beats"]
            shown = ", ".join(f"lambda {r['lambda_cost']:.3g}: {_ci(r['delta_vs_equal_edits'])} "
                              f"{r['verdict_vs_equal_edits']}" for r in ctrl)
            lines.append(f"{split}, {src} bank: controller minus equal-edits baseline — {shown}; the controller beats "
                         f"uniform allocation at {len(wins)} of {len(ctrl)} prices")
        first = False
    return lines


def _ci(d: dict[str, Any] | None) -> str:
    return "-" if not d else f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]"


def assemble(cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
             done: dict[str, dict[str, Any]], total_s: float, jobs: int) -> dict[str, Any]:
    doc = {"model": model_cfg.to_dict(), "study": dataclasses.asdict(cfg),
           "stages": {k: v.to_dict() for k, v in stages.items()},
           "training": {k: v["result"] for k, v in done.items() if not k.startswith("eval_")},
           "sources": {s: {split: done[f"eval_{split}:{s}"]["result"] for split in ("val", "held_out")}
                       for s in cfg.sources},
           "wall_s": {"total": total_s, **{k: v["wall_s"] for k, v in done.items()}, "jobs": jobs}}
    doc["verdicts"] = verdicts(doc)
    return doc


def format_report(doc: dict[str, Any]) -> str:
    parts = []
    for src, by in doc["sources"].items():
        for split in ("val", "held_out"):
            parts.append(f"== {src} bank, {split} ==\n{by[split]['table']}")
    parts.append("\n".join(doc["verdicts"]))
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------------------------- CLI
def main(args: Any) -> int:
    """`prisme study text`."""
    sources = [s.strip() for s in args.sources.split(",") if s.strip()] if args.sources else list(SOURCES)
    cfg = TextStudyConfig(sources=sources, seed=args.seed, scale=args.scale, out_dir=args.out or "runs/text",
                          jobs=args.jobs or 0, threads=args.threads or 1, progress=not args.no_progress,
                          val_batches=None if args.val_batches == "all" else int(args.val_batches),
                          held_out=args.held_out, compile=getattr(args, "compile", None) or "off")
    from prisme.io import check_output_file
    from prisme.studies.recall_report import emit_study

    check_output_file(args.json, "--json")  # before anything trains
    return emit_study(run_study(cfg), format_report, args.json)
