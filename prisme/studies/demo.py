"""`prisme demo` (`make demo`): the project's current answer on the embedded default, in about ten minutes on a
laptop CPU, ending with a short summary. Both parts' runs share one worker pool (`studies.runner`): the text study's
long chains start first and the recall run fills the worker they leave idle.

1. recall   the long-context recall claim (`prisme study recall --frontier --context 1024`): the cheapest PRISME member
            that passed there (`prisme/reference/recall_context_frontier.json`) trained again on `recall_seeds` and
            scored as the study scores it, beside the study's frontier (every dense model it trained, per seed)
2. text     `prisme study text` (`prisme.studies.text`): the three stages on byte-level Austen at the `demo` preset,
            the matched and a one-layer-deeper backbone, every policy on the validation split and the whole held-out
            text with paired 95% intervals
3. sample   a sampled continuation from the text controller (temperature 0.8, top-k 20), and the command for more

Everything lands in one run folder: recall/ (the recall runs and recall.json), text/ (stage folders, one folder per
bank source with its Pareto plots, text.json), report.txt (every table; on the screen too with `verbose`),
sample.txt and summary.json (each result, its verdict, the wall time per phase).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
RECALL_SEEDS = (30,)  # the study's first seed: the demo's run repeats the study's run of it
REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "recall_context_frontier.json"
SAMPLING = {"temperature": 0.8, "top_k": 20}  # what suits a small byte model: greedy decoding loops


@dataclass(frozen=True)
class DemoOptions:
    """What `run_demo` runs and how (the run folder aside). Checked here, once: a scale <= 0 or fewer than one
    evaluation batch is a ValueError before anything is written or trained."""

    scale: float = 1.0  # the text study's steps x this (< 1: also a quick recall run)
    threads: int | None = None  # torch CPU threads of this process and of each task (None: leave as is)
    seed: int = 1337  # the text study's seed (and the sample's)
    backbone_keeps_learning: bool = False  # stage 2 also trains the backbone (`TextStudyConfig`)
    eval_batches: int = 8  # validation batches per evaluation of the text study
    progress: bool = True  # a line per finished task on stderr
    model_cfg: PrismeConfig | None = None  # the text study's model (None: the `demo` preset)
    recall_seeds: Sequence[int] | None = None  # the recall part's seeds (None: `RECALL_SEEDS`; empty: no recall part)
    jobs: int = 0  # worker processes (0: one per CPU core)
    sources: Sequence[str] | None = None  # the text study's bank sources (None: `DEMO_SOURCES`)
    held_out: str | None = None  # the held-out text (None: the text study's default, the embedded devils_dictionary)
    compile: str = "off"  # torch.compile of the trained models (`TextStudyConfig.compile`)
    verbose: bool = False  # print every table too (they are in report.txt)
    recall_context: int | None = None  # the recall part's length (None: the reference's)
    reference: str | Path | None = None  # the recall frontier's record (None: `REFERENCE`)
    executor: str = "local"  # where the tasks run: this machine's worker processes, or "ray" (a cluster's tasks)
    address: str | None = None  # the Ray cluster's address (with executor "ray")

    def __post_init__(self) -> None:
        if self.scale <= 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")
        if not is_int(self.eval_batches) or self.eval_batches < 1:  # before minutes of training
            raise ValueError(f"eval_batches must be an int >= 1, got {self.eval_batches!r}")


def load_reference(path: str | Path | None = None) -> dict[str, Any]:
    """The long-context study's frontier as recorded (`recall_context.frontier_reference`); its longest length's.
    `best` is the PRISME member the demo trains: the one its confirmation on fresh seeds confirmed (`confirmation`,
    from `prisme study recall --confirm-of`), else the study's cheapest passing one."""
    path = Path(path) if path is not None else REFERENCE
    try:
        ref = json.loads(path.read_text())
        context = max(ref["contexts"], key=lambda c: c["T"])
        best = context["prisme_best"]
        confirmed = (context.get("confirmation") or {}).get("verdict", {}).get("prisme_name")
        if confirmed:
            best = next(e for e in context["entries"] if e["family"] == "PRISME" and e["name"] == confirmed)
        member = best["member"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, StopIteration) as e:
        raise ValueError(f"the recall frontier reference {path} is missing or malformed ({e!r}); it is written by "
                         f"prisme.studies.recall_context.frontier_reference from a finished study") from None
    return {"document": ref, "context": context, "member": member, "best": best}


def _sample(model: torch.nn.Module, prompt: str, n_tokens: int, max_budget: int, kappa_risk: float | None = None,
            seed: int = 0) -> tuple[str, dict[str, Any]]:
    """A sampled continuation with the controller (`SAMPLING`), reproducible from `seed`."""
    from prisme.decoding.generate import generate
    from prisme.decoding.sampling import Sampling
    from prisme.model.policy import Controller

    tok = ByteTokenizer()
    out = generate(model, [tok.encode(prompt)], n_tokens, Controller(max_budget, kappa_risk=kappa_risk),
                   Sampling(seed=seed, **SAMPLING))
    return tok.decode(out.tokens[0]), {"relative_cost": out.relative_cost, "lambda_cost": out.lambda_cost,
                                       "mean_edits": sum(out.n_edits[0]) / max(1, len(out.n_edits[0])), **SAMPLING}


def plan_recall(run: Path, seeds: list[int], reference: dict[str, Any], quick: bool, jobs: int, compile: str,
                context: int | None = None) -> tuple[Any, Any, list[Any], int]:
    """The recall part's runs: the reference's cheapest passing PRISME member at its length (`context` replaces the
    length: tests run a short one) on `seeds`, as `prisme study recall --frontier --context T` trains and scores it.
    Returns (the study settings, the recipe, the pool tasks, T)."""
    from prisme.studies.recall import plan_tasks, run_task
    from prisme.studies.recall_frontier import FamilyTask
    from prisme.studies.recall_setup import load_recipe, study_config
    from prisme.studies.runner import Task

    T = context or reference["context"]["T"]
    few = {"eval_sequences": 128, "calibration_sequences": 128} if quick else {}
    rcfg = study_config({"seeds": list(seeds), "out_dir": str(run / "recall"), "frontier": True, "contexts": [T],
                         "context_family": [reference["member"]], "quick": quick, "jobs": jobs, "compile": compile,
                         **few})
    recipe, _ = load_recipe(rcfg)
    planned = [t for t in plan_tasks(rcfg, recipe) if isinstance(t, FamilyTask)]  # the frontier is the reference's
    return rcfg, recipe, [Task(t.folder, run_task, (t,)) for t in planned], T


def finish_recall(rcfg: Any, recipe: Any, results: dict[str, Any], reference: dict[str, Any], T: int,
                  out: Path) -> dict[str, Any]:
    """This run's member per seed beside the study's frontier; written to `out` (recall/recall.json)."""
    from prisme.studies.recall_context import recipe_at
    from prisme.studies.recall_frontier import reference_ops
    from prisme.studies.recall_setup import TARGET_ACCURACY

    ref_ops = reference_ops(recipe_at(rcfg, recipe, T), T)
    study, best = reference["context"], reference["best"]
    recorded = dict(zip(best["seeds"], best["accuracy"]))
    runs = []
    for seed, res in sorted(results.items()):
        e = res["entry"]
        runs.append({"seed": seed, "accuracy": e["accuracy"], "passes": e["accuracy"] >= TARGET_ACCURACY,
                     "ops_ratio": e["ops_per_token"] / ref_ops, "budget1_accuracy": e["budget1_accuracy"],
                     "edits_per_token": e["router"]["edits_per_token"], "lambda": e["router"]["lambda"],
                     "study_accuracy": recorded.get(seed) if T == study["T"] else None,
                     "checkpoint": e["checkpoint"]})
    doc = {"T": T, "member": best["name"], "reference_ops_per_token": ref_ops, "runs": runs,
           "study": {k: v for k, v in reference["document"].items() if k != "contexts"} | {"frontier": study}}
    write_text_atomic(out, json.dumps(doc, indent=2) + "\n")
    return doc


def confirmation_lines(conf: dict[str, Any] | None) -> list[str]:
    """The summary's two lines of the reference's confirmation on fresh seeds: each deciding model's pass rate there
    (an unstable one with its accuracies), then the confirmed verdict (or why there is none) with each side's worst
    passing seed against the 95 % bar."""
    if not conf:
        return []
    family = {"dense": "dense", "prisme": "PRISME"}
    parts = []
    for m in conf["models"]:
        if m["fresh"]:
            acc = "" if m["stable"] else " (" + " / ".join(f"{a:.3f}" for a in m["fresh"]["accuracy"]) + ": unstable)"
            parts.append(f"{family[m['family']]} {m['key']} {m['fresh']['pass_rate']}{acc}")
    out = [f"  fresh seeds {','.join(map(str, conf['seeds']))}: " + "; ".join(parts)]
    v = conf["verdict"]
    if v["confirmed_ratio"] is None:
        return out + [f"  confirmed verdict: none ({v['why']})"]
    worst = ", ".join(f"{family[s]} {m['worst_passing']:.3f}" for s, m in conf["margins"].items()
                      if m and m["worst_passing"] is not None)
    return out + [f"  confirmed verdict (passes on both sets): PRISME {v['prisme_name']} at "
                  f"{v['prisme_ops_ratio']:.3f}x, dense {v['dense_name']} at {v['dense_ops_ratio']:.3f}x: PRISME needs "
                  f"{v['confirmed_ratio']:.3f}x its ops (worst passing seed {worst}; the bar 0.95)"]


def recall_lines(doc: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the summary's recall lines, the full table for report.txt)."""
    study = doc["study"]["frontier"]
    best = next((e for e in study["entries"] if e["family"] == "PRISME" and e["name"] == doc["member"]),
                study["prisme_best"])
    bound, conf = study.get("dense_bound"), study.get("confirmation")
    lines = [f"recall at T = {doc['T']:,} (MQAR, 4 queries per sequence, each pair beyond a 64-token window)"]
    for r in doc["runs"]:
        again = "" if r["study_accuracy"] is None else f" (the study's run of this seed: {r['study_accuracy']:.3f})"
        lines.append(f"  this run: PRISME {doc['member']}, seed {r['seed']}: accuracy {r['accuracy']:.3f}"
                     f"{again} at {r['ops_ratio']:.3f}x ops, edits at {100 * r['edits_per_token']:.2f}% of positions")
    acc = " / ".join(f"{a:.3f}" for a in best["accuracy"])
    lines.append(f"  the study (seeds {','.join(map(str, best['seeds']))}): PRISME {best['seeds_at_95']}/"
                 f"{len(best['seeds'])} at {best['ops_ratio']:.3f}x ({acc})")
    failing = [e for e in study["entries"] if "member" not in e]  # the dense entries (a PRISME one names its member)
    if study.get("dense_best"):
        win = study["dense_best"]
        cheaper = [e for e in failing if e["ops_ratio"] < win["ops_ratio"] and not e["passes"]]
        if cheaper:
            lines.append("  every cheaper dense model of the grid fails ("
                         + "; ".join(f"{e['name']} {max(e['accuracy']):.2f}" for e in cheaper[-2:]) + "; ...)")
        head = "on the study's seeds" if conf else "verdict"  # a confirmation restates it below
        who = f" {study['prisme_best']['name'].split(',')[0]}" if conf else ""  # its cheapest passing member there
        lines.append(f"  {head}: the cheapest dense model that passes is {win['name']} at {win['ops_ratio']:.3f}x "
                     f"({win['seeds_at_95']}/{len(win['seeds'])} seeds); PRISME{who} needs {study['ratio']:.3f}x its "
                     f"ops")
    elif bound:
        lines.append(f"  every dense model of the grid up to {bound['all_fail_up_to']:.3f}x fails ("
                     + "; ".join(f"{e['name']} {max(e['accuracy']):.2f}" for e in failing[:2]) + "; ...)")
        lines.append(f"  verdict: PRISME needs at most {bound['ratio_at_most']:.2f}x the dense frontier's ops "
                     f"(next dense rung, {bound['next_rung']['name']} at {bound['next_rung']['ops_ratio']:.3f}x, "
                     f"not yet trained)")
    lines += confirmation_lines(conf)
    table = [f"recall: the study's frontier at T = {study['T']:,} ({doc['study']['command']}; "
             f"{doc['study']['cpu']})", f"{'family':<8}{'model':<52}{'ops':>7}  accuracy per seed",
             *(f"{e['family']:<8}{e['name']:<52}{e['ops_ratio']:>7.3f}  "
               + " ".join(f"{a:.3f}" for a in e["accuracy"]) for e in study["entries"])]
    return lines, table


def plot_recall(doc: dict[str, Any], path: Path) -> None:
    """Accuracy against ops: every seed of the study's frontier (dense and PRISME) and this run's seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for family, color, marker in (("dense", "C0", "o"), ("PRISME", "C3", "s")):
        es = [e for e in doc["study"]["frontier"]["entries"] if e["family"] == family]
        ax.scatter([e["ops_ratio"] for e in es for _ in e["accuracy"]], [a for e in es for a in e["accuracy"]],
                   color=color, marker=marker, alpha=0.6, label=f"{family} (the study, per seed)")
    ax.scatter([r["ops_ratio"] for r in doc["runs"]], [r["accuracy"] for r in doc["runs"]], color="k", marker="*",
               s=120, label=f"this run (T = {doc['T']:,})")
    ax.axhline(0.95, color="gray", ls="--", lw=1, label="95 %")
    ax.set_xlabel("ops per token (x the one-layer d = 64 backbone)")
    ax.set_ylabel("query accuracy")
    ax.set_title(f"MQAR at T = {doc['study']['frontier']['T']:,}: PRISME against the dense frontier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def text_lines(doc: dict[str, Any], preset: str) -> list[str]:
    """The summary's text lines: per split, the workspace row closest to the dense frontier and its verdict."""
    out = [f"text (byte-level Austen, {preset} preset, seed {', '.join(doc['seeds'])}; against the dense frontier: "
           f"the backbone, its matched-steps twin, one layer deeper)"]
    close = [v for v in doc["verdicts"] if "closest to the dense frontier" in v]
    return out + [f"  {v}" for v in close or doc["verdicts"][:4]]


def run_demo(out: str | Path | None = None, options: DemoOptions | None = None, resume: bool = False
             ) -> dict[str, Any]:
    """Run the demo end to end in the run folder `out` (default runs/demo-<time>); returns the summary (also written
    to <run>/summary.json). `options` (`DemoOptions`, default: the demo as `make demo` runs it):

    1. the recall claim: the reference's PRISME member at its length on `recall_seeds` (default `RECALL_SEEDS`; []
       skips it; with `scale` < 1 a quick run), beside the reference frontier (`reference`, default the shipped one);
    2. the text study (`prisme.studies.text`): Austen with the demo preset (`model_cfg` replaces it: tests run a
       byte-level `tiny`), every policy against the backbone, the matched and a deeper backbone, on `eval_batches`
       validation batches and the whole held-out text (`held_out`, default the embedded devils_dictionary), for the
       bank sources `sources` (default: the seed's, which keeps the demo within its time; `prisme study text` runs
       both);
    3. a sampled continuation from the seed's-bank controller.

    Every run is a task of one pool: this machine's worker processes (`jobs`), or with `executor` "ray" a Ray
    cluster's tasks (`address`; the run folder on a filesystem every node shares).

    The screen shows the summary (every table too with `verbose`); progress goes to stderr. A demo started in `out`
    with the same settings continues from what finished (`resume`: one must have been).
    """
    from prisme.studies.pools import PoolOptions
    from prisme.studies.runner import open_study, prefixed, record_study, run_tasks, worker_count
    from prisme.studies.text import TextStudyConfig, format_report
    from prisme.studies.text import finish_study as finish_text
    from prisme.studies.text import prepare_study as prepare_text

    o = options if options is not None else DemoOptions()
    recall_seeds = list(RECALL_SEEDS) if o.recall_seeds is None else list(o.recall_seeds)
    ref = load_reference(o.reference) if recall_seeds else None
    if o.threads is not None and o.threads > 0:
        torch.set_num_threads(o.threads)
    run = Path(out) if out is not None else Path("runs") / f"demo-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    cfg = o.model_cfg if o.model_cfg is not None else PrismeConfig.from_name("demo")
    sources = None if o.sources is None else list(o.sources)
    settings = {"scale": o.scale, "seed": o.seed, "backbone_keeps_learning": o.backbone_keeps_learning,
                "eval_batches": o.eval_batches, "recall_seeds": recall_seeds, "sources": sources,
                "held_out": o.held_out, "model": cfg.to_dict(), "recall_context": o.recall_context,
                "recall_member": ref and ref["member"]}
    resumed = open_study(run, settings, resume, "demo")
    if not resumed and run.exists() and any(run.iterdir()):
        raise ValueError(f"run folder {run} already exists and is not empty; pass another --out")
    if cfg.vocab_size < 256 or not cfg.use_workspace:
        raise ValueError(f"the demo needs a byte-level model (vocab_size >= 256) with a workspace, got {cfg.name!r}")
    tcfg = TextStudyConfig(sources=list(sources or DEMO_SOURCES), seeds=[o.seed], frontier=[list(DEMO_FRONTIER)],
                           scale=o.scale, val_batches=o.eval_batches,
                           out_dir=str(run / "text"), jobs=o.jobs, threads=max(1, o.threads or 1),
                           progress=o.progress, backbone_keeps_learning=o.backbone_keeps_learning, compile=o.compile,
                           executor=o.executor, address=o.address,
                           **({} if o.held_out is None else {"held_out": o.held_out})).validate(cfg)
    run.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    walls: dict[str, float] = {}
    # both parts' tasks in one pool (the text study's long chains first, the recall runs filling the gaps)
    text_model, stages, text_tasks = prepare_text(tcfg, cfg)
    from prisme.studies.text import study_settings as text_settings

    record_study(tcfg.out_dir, text_settings(tcfg, text_model, stages), "text study")  # a rerun continues it
    tasks = [prefixed(t, "text/") for t in text_tasks]
    recall_tasks: list = []
    if recall_seeds:
        rcfg, recipe, recall_tasks, T = plan_recall(run, recall_seeds, ref, o.scale < 1, o.jobs, o.compile,
                                                    o.recall_context)
        chains = 1 + len(tcfg.sources) + len(tcfg.frontier)  # the text study's backbone, sources and frontier first
        tasks = tasks[:chains] + [prefixed(t, "recall/") for t in recall_tasks] + tasks[chains:]
        print(f"demo: PRISME {ref['best']['name']} at T = {T:,} (seeds "
              f"{','.join(map(str, recall_seeds))}) in {run / 'recall'}", flush=True)
    print(f"demo: the text study ({cfg.name} preset, {sum(model_params(cfg).values()):,} parameters; bank sources "
          f"{', '.join(tcfg.sources)}) in {run / 'text'}", flush=True)
    from prisme.studies.recall import progress_printer as recall_progress
    from prisme.studies.text import progress_printer as text_progress

    shows = {"recall/": recall_progress(o.progress, len(recall_tasks), "recall "),
             "text/": text_progress(o.progress)}
    study_of = {prefix + t.name: prefix for prefix, ts in (("recall/", recall_tasks), ("text/", text_tasks))
                for t in ts}  # pool task name -> its part's prefix
    finished: dict[str, float] = {}

    def on_done(task: Any, res: Any, elapsed: float) -> None:
        prefix = study_of[task.name]
        finished[prefix] = elapsed
        if shows[prefix] is not None:
            shows[prefix](task, res, elapsed)

    results = run_tasks(tasks, o.jobs, on_done=on_done, store=record_study(run, settings, "demo"), resumed=resumed,
                        pool=PoolOptions(o.executor, o.address, max(1, o.threads or 1)))
    n_workers = worker_count(o.jobs, len(tasks))
    summary_lines: list[str] = []
    report: list[str] = []
    recall = None
    if recall_seeds:
        by_seed = {t.args[0].seed: results["recall/" + t.name] for t in recall_tasks}
        doc = finish_recall(rcfg, recipe, by_seed, ref, T, run / "recall" / "recall.json")
        lines, table = recall_lines(doc)
        plot_recall(doc, run / "recall" / "recall_frontier.png")
        summary_lines += lines
        report += ["\n".join(table), ""]
        recall = {"json": str(run / "recall" / "recall.json"), "runs": doc["runs"], "lines": lines,
                  "wall_s": round(finished.get("recall/", 0.0), 1)}
        walls["recall"] = finished.get("recall/", 0.0)
    text_doc = finish_text(tcfg, text_model, stages, {t.name: results["text/" + t.name] for t in text_tasks},
                           text_tasks, finished.get("text/", 0.0), n_workers)
    walls["text"] = finished.get("text/", 0.0)
    report.append(format_report(text_doc))
    summary_lines += text_lines(text_doc, cfg.name)

    t = time.perf_counter()
    checkpoint = run / "text" / f"seed{o.seed}" / tcfg.sources[0] / "4_controller"
    model, _ = load_model(checkpoint)
    T_text = text_doc["stages"]["workspace"]["seq_len"]
    n_new = T_text - len(ByteTokenizer().encode(PROMPT))  # stay within the trained positions
    budget = tcfg.controller_budget  # the deployed controller's budget, as the study evaluates it
    text, info = _sample(model, PROMPT, n_new, budget, tcfg.kappa_risk, seed=o.seed)
    walls["sample"] = time.perf_counter() - t
    write_text_atomic(run / "sample.txt", PROMPT + text + "\n")
    more = (f"prisme generate --checkpoint {checkpoint} --budget {budget} --temperature {SAMPLING['temperature']} "
            f"--top-k {SAMPLING['top_k']} --max-new-tokens {n_new} --prompt \"...\"")
    walls["total"] = time.perf_counter() - t0
    plots = sorted(str(p) for p in run.rglob("*.png"))
    summary_lines += [f"sample ({tcfg.sources[0]} bank, controller budget {budget}, temperature "
                      f"{SAMPLING['temperature']}, top-k {SAMPLING['top_k']}):",
                      "  " + (PROMPT + text).replace("\n", " "), f"  more: {more}",
                      f"files: {run / 'report.txt'} (every table), {run / 'summary.json'}, {run / 'sample.txt'}",
                      "  json: " + ", ".join(str(p) for p in (run / "recall" / "recall.json",
                                                              run / "text" / "text.json") if p.is_file()),
                      *(f"  plot: {p}" for p in plots[:4]),
                      f"wall time {walls['total']:.0f} s ("
                      + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items() if k != "total") + ")"]
    write_text_atomic(run / "report.txt", "\n".join(report) + "\n")
    summary = {"run": str(run), "preset": cfg.to_dict(), "wall_s": {k: round(v, 1) for k, v in walls.items()},
               "recall": recall, "text": {"json": str(run / "text" / "text.json"), "verdicts": text_doc["verdicts"],
                                          "wall_s": {k: round(v, 1) for k, v in text_doc["wall_s"].items()
                                                     if isinstance(v, (int, float))}},
               "sample": {"prompt": PROMPT, "text": text, "command": more, **info}, "plots": plots,
               "lines": summary_lines}
    write_text_atomic(run / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    if o.verbose:
        print("\n".join(report), flush=True)
    print(f"\n== PRISME demo: summary ({run}) ==\n" + "\n".join(summary_lines), flush=True)
    return summary


def model_params(cfg: PrismeConfig) -> dict[str, int]:
    from prisme.model.prisme import PrismeModel

    with torch.device("meta"):
        return PrismeModel(cfg).num_parameters()


def main(args: argparse.Namespace) -> int:
    """Entry point of `prisme demo`."""
    from prisme.checks import one_of, parse_list
    from prisme.studies.recall_setup import parse_seeds
    from prisme.studies.text_setup import SOURCES

    threads = getattr(args, "threads", -1)
    text = getattr(args, "recall_seeds", None)
    recall_seeds = None if text is None else [] if text.strip() == "none" else parse_seeds(text, "--recall-seeds")
    sources = getattr(args, "sources", None)
    sources = None if sources is None else parse_list(sources, "--sources", one_of(SOURCES), "residual,embedding",
                                                      distinct=True)
    options = DemoOptions(scale=getattr(args, "scale", 1.0), threads=threads if threads and threads > 0 else None,
                          seed=getattr(args, "seed", 1337),
                          backbone_keeps_learning=getattr(args, "backbone_keeps_learning", False),
                          eval_batches=getattr(args, "eval_batches", 8), recall_seeds=recall_seeds,
                          jobs=getattr(args, "jobs", 0) or 0, sources=sources,
                          compile=getattr(args, "compile", None) or "off", verbose=getattr(args, "verbose", False),
                          executor=getattr(args, "executor", None) or "local", address=getattr(args, "address", None))
    run_demo(getattr(args, "out", None), options, resume=getattr(args, "resume", False))
    return 0
