"""`prisme demo` (`make demo`): the recall study and the text study on the embedded Austen corpus, in minutes on a
laptop CPU. Both studies' runs share one worker pool (`studies.runner`): the text study's long chains start first and
the recall runs fill the workers they leave idle.

1. recall        `prisme study recall` on a few seeds without its converged case (MQAR: where the workspace solves
                 what its backbone cannot)
2. text          `prisme study text` (`prisme.studies.text`): the three stages on byte-level Austen at the `demo` preset
                 (stage 1 once, stage 2 and 3 per bank source), the matched and a one-layer-deeper backbone, every
                 policy on the validation split and the whole held-out text with paired 95% intervals
3. sample        a short greedy continuation with the controller

Everything lands in one run folder (printed at the end): recall/ (the recall study's folder), text/ (stage folders,
one folder per bank source with its stages and Pareto plots, text.json), sample.txt and summary.json (wall time per
phase, both studies' verdicts).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from prisme.checkpoint import load_model
from prisme.checks import is_int
from prisme.config import PrismeConfig
from prisme.data.tokenizers import ByteTokenizer
from prisme.io import write_text_atomic

PROMPT = "It is a truth universally acknowledged, that"


DEMO_SOURCES = ("residual",)  # the demo's text study: the seed's bank (`prisme study text` adds "embedding")
DEMO_FRONTIER = (2, None)  # ... and one frontier model, one layer deeper (`prisme study text`: 1-3 layers, 2 widths)


def _sample(model: torch.nn.Module, prompt: str, n_tokens: int, max_budget: int,
            kappa_risk: float | None = None) -> tuple[str, dict[str, Any]]:
    """Greedy continuation with the controller (prisme.decoding.generate, else a plain forward loop)."""
    tok = ByteTokenizer()
    ids = tok.encode(prompt)
    try:
        from prisme.decoding.generate import generate
    except ImportError:  # pragma: no cover - the decoding module is optional for the demo
        generate = None
    if generate is not None:
        out = generate(model, [ids], n_tokens, max_budget=max_budget, kappa_risk=kappa_risk)
        return tok.decode(out.tokens[0]), {"relative_cost": out.relative_cost, "lambda_cost": out.lambda_cost,
                                           "mean_edits": sum(out.n_edits[0]) / max(1, len(out.n_edits[0]))}
    x = torch.tensor([ids])
    with torch.no_grad():  # pragma: no cover
        for _ in range(n_tokens):
            logits = model.forward_policy(x[:, -model.cfg.max_seq_len:], max_budget).logits[:, -1]
            x = torch.cat([x, logits.argmax(-1, keepdim=True)], dim=1)
    return tok.decode(x[0, len(ids):].tolist()), {}


def run_demo(out: str | Path | None = None, scale: float = 1.0, threads: int | None = None, seed: int = 1337,
             backbone_keeps_learning: bool = False, eval_batches: int = 8, progress: bool = True,
             model_cfg: PrismeConfig | None = None, recall_seeds: list[int] | None = None, jobs: int = 0,
             sources: list[str] | None = None, held_out: str | None = None, compile: str = "off",
             resume: bool = False) -> dict[str, Any]:
    """Run the demo end to end; returns the summary (also written to <run>/summary.json).

    1. the recall study on `recall_seeds` (None or [] skips it; with `scale` < 1 it runs in its quick mode), without
       its converged case;
    2. the text study (`prisme.studies.text`): Austen with the demo preset (`model_cfg` replaces it: tests run a
       byte-level `tiny`), every policy against the backbone, the matched and a deeper backbone, on `eval_batches`
       validation batches and the whole held-out text (`held_out`, default the embedded devils_dictionary), for the
       bank sources `sources` (default: the seed's, which keeps the demo within its time; `prisme study text` runs
       both);
    3. a short greedy sample from the seed's-bank controller.

    A demo started in `out` with the same settings continues from what finished (`resume`: one must have been).
    """
    from prisme.studies.runner import Task, open_study, prefixed, record_study, run_tasks, worker_count
    from prisme.studies.text import TextStudyConfig, format_report
    from prisme.studies.text import finish_study as finish_text
    from prisme.studies.text import prepare_study as prepare_text

    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if not is_int(eval_batches) or eval_batches < 1:
        raise ValueError(f"eval_batches must be an int >= 1, got {eval_batches!r}")  # before minutes of training
    if threads is not None and threads > 0:
        torch.set_num_threads(threads)
    run = Path(out) if out is not None else Path("runs") / f"demo-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    cfg = model_cfg if model_cfg is not None else PrismeConfig.from_name("demo")
    settings = {"scale": scale, "seed": seed, "backbone_keeps_learning": backbone_keeps_learning,
                "eval_batches": eval_batches, "recall_seeds": list(recall_seeds or []), "sources": sources,
                "held_out": held_out, "model": cfg.to_dict()}
    resumed = open_study(run, settings, resume, "demo")
    if not resumed and run.exists() and any(run.iterdir()):
        raise ValueError(f"run folder {run} already exists and is not empty; pass another --out")
    if cfg.vocab_size < 256 or not cfg.use_workspace:
        raise ValueError(f"the demo needs a byte-level model (vocab_size >= 256) with a workspace, got {cfg.name!r}")
    tcfg = TextStudyConfig(sources=list(sources or DEMO_SOURCES), seeds=[seed], frontier=[list(DEMO_FRONTIER)],
                           scale=scale, val_batches=eval_batches,
                           out_dir=str(run / "text"), jobs=jobs, threads=max(1, threads or 1), progress=progress,
                           backbone_keeps_learning=backbone_keeps_learning, compile=compile,
                           **({} if held_out is None else {"held_out": held_out})).validate(cfg)
    run.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    walls: dict[str, float] = {}
    # both studies' tasks in one pool (the text study's long chains first, the recall runs filling the gaps)
    text_model, stages, text_tasks = prepare_text(tcfg, cfg)
    from prisme.studies.text import study_settings as text_settings

    studies = [(tcfg.out_dir, text_settings(tcfg, text_model, stages))]  # recorded with the demo's below
    tasks = [prefixed(t, "text/") for t in text_tasks]
    recall_tasks: list = []
    if recall_seeds:
        from prisme.studies.recall import finish_study as finish_recall
        from prisme.studies.recall import format_table
        from prisme.studies.recall import prepare_study as prepare_recall
        from prisme.studies.recall_setup import study_config

        rcfg = study_config({"seeds": list(recall_seeds), "out_dir": str(run / "recall"), "quick": scale < 1,
                             "jobs": jobs, "eval_sequences": 1024, "compile": compile,  # the demo's share of the time
                             "calibration_sequences": 1024,  # the study's own calibration set: the same lambda
                             "converged": False})  # the converged case: `prisme study recall`
        rcfg, recipe, recall_tasks = prepare_recall(rcfg)
        from prisme.studies.recall import study_settings as recall_settings
        from prisme.studies.recall import study_task

        studies.append((rcfg.out_dir, recall_settings(rcfg, [study_task(t) for t in recall_tasks])))
        chains = 1 + len(tcfg.sources) + len(tcfg.frontier)  # the text study's backbone, sources and frontier first
        tasks = tasks[:chains] + [prefixed(t, "recall/") for t in recall_tasks] + tasks[chains:]
        print(f"demo: the recall study (seeds {','.join(map(str, rcfg.seeds))}) in {run / 'recall'}", flush=True)
    print(f"demo: the text study ({cfg.name} preset, {sum(model_params(cfg).values()):,} parameters; bank sources "
          f"{', '.join(tcfg.sources)}) in {run / 'text'}", flush=True)
    from prisme.studies.recall import progress_printer as recall_progress
    from prisme.studies.text import progress_printer as text_progress

    shows = {"recall/": recall_progress(progress, len(recall_tasks), "recall "), "text/": text_progress(progress)}
    study_of = {prefix + t.name: prefix for prefix, ts in (("recall/", recall_tasks), ("text/", text_tasks))
                for t in ts}  # pool task name -> its study's prefix
    finished: dict[str, float] = {}

    def on_done(task: Task, res: Any, elapsed: float) -> None:
        prefix = study_of[task.name]
        finished[prefix] = elapsed
        if shows[prefix] is not None:
            shows[prefix](task, res, elapsed)

    for folder, study in studies:  # a rerun finds each study started with its settings
        record_study(folder, study)
    results = run_tasks(tasks, jobs, on_done=on_done, store=record_study(run, settings), resumed=resumed)
    n_workers = worker_count(jobs, len(tasks))
    recall = None
    if recall_seeds:
        doc = finish_recall(rcfg, recipe, {t.name: results["recall/" + t.name] for t in recall_tasks}, recall_tasks,
                            finished.get("recall/", 0.0), n_workers)
        print(format_table(doc) + "\n", flush=True)
        recall = {"summary": doc["summary"], "controls": {k: v["accuracy"] for k, v in doc["controls"].items()},
                  "json": str(run / "recall" / "recall.json"), "wall_s": round(doc["wall_s"]["total"], 1)}
        walls["recall"] = finished.get("recall/", 0.0)
    text_doc = finish_text(tcfg, text_model, stages, {t.name: results["text/" + t.name] for t in text_tasks},
                           text_tasks, finished.get("text/", 0.0), n_workers)
    walls["text"] = finished.get("text/", 0.0)
    print(format_report(text_doc), flush=True)

    t = time.perf_counter()
    model, _ = load_model(run / "text" / f"seed{seed}" / tcfg.sources[0] / "4_controller")
    T = text_doc["stages"]["workspace"]["seq_len"]
    n_new = T - len(ByteTokenizer().encode(PROMPT))  # stay within the trained positions
    budget = tcfg.controller_budget  # the deployed controller's budget, as the study evaluates it
    text, info = _sample(model, PROMPT, n_new, budget, tcfg.kappa_risk)
    walls["sample"] = time.perf_counter() - t
    write_text_atomic(run / "sample.txt", PROMPT + text + "\n")
    print(f"\nsample ({tcfg.sources[0]} bank, greedy, controller budget {budget}):\n{PROMPT}{text}\n")
    walls["total"] = time.perf_counter() - t0
    summary = {"run": str(run), "preset": cfg.to_dict(), "wall_s": {k: round(v, 1) for k, v in walls.items()},
               "recall": recall, "text": {"json": str(run / "text" / "text.json"), "verdicts": text_doc["verdicts"],
                                          "wall_s": {k: round(v, 1) for k, v in text_doc["wall_s"].items()
                                                     if isinstance(v, (int, float))}},
               "sample": {"prompt": PROMPT, "text": text, **info}}
    write_text_atomic(run / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    print(f"wall time {walls['total']:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in walls.items() if k != 'total')})")
    print(f"run folder: {run}  (recall/, text/ with one folder per bank source, sample.txt, summary.json)")
    return summary


def model_params(cfg: PrismeConfig) -> dict[str, int]:
    from prisme.model.prisme import PrismeModel

    with torch.device("meta"):
        return PrismeModel(cfg).num_parameters()


def main(args: argparse.Namespace) -> int:
    """Entry point of `prisme demo`."""
    from prisme.studies.recall_setup import parse_seeds

    threads = getattr(args, "threads", -1)
    text = getattr(args, "recall_seeds", "0")
    recall_seeds = [] if text in ("", "none") else parse_seeds(text)
    run_demo(out=getattr(args, "out", None), scale=getattr(args, "scale", 1.0),
             threads=threads if threads and threads > 0 else None, seed=getattr(args, "seed", 1337),
             backbone_keeps_learning=getattr(args, "backbone_keeps_learning", False),
             eval_batches=getattr(args, "eval_batches", 8), recall_seeds=recall_seeds,
             jobs=getattr(args, "jobs", 0) or 0,
             sources=[v.strip() for v in args.sources.split(",") if v.strip()] if getattr(args, "sources", None)
             else None, compile=getattr(args, "compile", None) or "off", resume=getattr(args, "resume", False))
    return 0
