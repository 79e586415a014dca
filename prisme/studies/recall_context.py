"""Long-context recall (`prisme study recall --frontier --context T1,T2,...`): the dense frontier and PRISME at several
sequence lengths, where dense attention reads the whole context at every position and the workspace only where the
router fires.

Per length T: MQAR with `context_queries` queries, every one after position 2N + W_max, where W_max is the largest
attention window of the grid (`context_dense` blocks, `context_family` entries), so that no query's pair lies inside
any local model's window; the dense frontier over `context_dense` (global attention with and without a key shift at
widths down to where it fails, and local-window backbones, to show what a local model cannot do), and PRISME on a
local-window backbone (`context_family`: `FamilyEntry`) whose workspace reads the whole bank, with its router. Every
stage at T runs at `context_batch_size` sequences per step; the dense models train for `context_frontier_steps` (at
least the family's stages together), the family's workspace stage for `context_workspace_steps`, after
`context_workspace_warmup` steps at the recipe's short task (each dense model's warm-up there as many steps
longer). Ops per token come from the same cost model for every model, each position at its own context, over the
same reference (the recipe's one-layer d = 64 backbone alone at that T). Runs live in `frontier/T{T}/`.

The search (`context_search`): with "cheapest" (the default) each length's dense configurations are trained in
increasing ops (their ops per token are the cost model's before anything trains: a backbone alone runs the same at
every position), and once one passes, those that cost more are not trained (`costlier_than_passing`): every
configuration cheaper than the cheapest passing one is trained and fails, so the cheapest passing configuration, the
family's ratio and the verdict are those of the whole grid. The document lists the untrained ones with their ops
(`not_trained`). "grid" trains every configuration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from prisme.config import PrismeConfig
from prisme.costs.traces import trace_cost
from prisme.data.mqar import MQARConfig
from prisme.studies.recall_frontier import (
    DenseTask,
    FrontierMember,
    assemble_frontier,
    format_frontier,
    plan_frontier,
    reference_ops,
    seeds_needed,
)
from prisme.studies.recall_setup import TARGET_ACCURACY, RecallStudyConfig, RecallTask, Recipe, family_entry

LONG_PRESET = "recall_long"  # the preset whose T_max bounds `--context`


def parse_contexts(text: str | None, cfg_lengths: list[int]) -> list[int] | None:
    """`--context 256,512,1024` -> [256, 512, 1024]; "default" (the flag alone): `context_lengths`; None: no flag."""
    if text is None:
        return None
    if text == "default":
        return list(cfg_lengths)
    try:
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"--context must be comma-separated lengths, e.g. 256,512,1024; got {text!r}") from None


def largest_window(cfg: RecallStudyConfig) -> int:
    """The largest attention window of the long-context grid (0 if every model attends globally)."""
    windows = [b.get("attn_window") or 0 for b in cfg.context_dense] + [
        family_entry(e, "context_family").attn_window or 0 for e in cfg.context_family]
    return max(windows, default=0)


def context_mqar(cfg: RecallStudyConfig, recipe: Recipe, T: int, limit: bool = True) -> MQARConfig:
    """The recipe's task at length T, its queries after every window; ValueError naming `--context` when T is over
    the preset's T_max (`limit`: the study trains at T; a trained model scored at a longer T passes False) or too short
    for the queries."""
    t_max = PrismeConfig.from_name(LONG_PRESET).max_seq_len
    if limit and T > t_max:
        raise ValueError(f"recall study: --context {T} is over the {LONG_PRESET} preset's T_max = {t_max}")
    q0 = 2 * recipe.mqar.n_pairs + largest_window(cfg)
    mcfg = dataclasses.replace(recipe.mqar, seq_len=T, query_min_pos=q0, n_queries=cfg.context_queries)
    if cfg.context_queries > recipe.mqar.n_pairs or mcfg.n_query_slots < cfg.context_queries:
        raise ValueError(f"recall study: --context {T} cannot hold {cfg.context_queries} queries (at most n_pairs = "
                         f"{recipe.mqar.n_pairs}) after position {q0} (every pair beyond the largest window, "
                         f"{largest_window(cfg)}): pass longer contexts")
    return mcfg


def recipe_at(cfg: RecallStudyConfig, recipe: Recipe, T: int) -> Recipe:
    """The recipe at length T: the model's T_max, every stage's task and batch size, the workspace stage training
    what `context_backbone_trains` says of the backbone; the warm-ups at the recipe's short task (`context_warmup`:
    its stage 1 for `context_warmup_steps`; `context_workspace_warmup`: its stage 2, for as many steps)."""
    mcfg = context_mqar(cfg, recipe, T)
    task = dataclasses.asdict(mcfg)

    def at(s, **kw):
        return None if s is None else s.replace(mqar=task, batch_size=cfg.context_batch_size, **kw)

    warmup = recipe.backbone.replace(steps=cfg.context_warmup_steps) if cfg.context_warmup else None
    learns = cfg.context_backbone_trains != "none"
    trains = dict(train_backbone_in_workspace_stage=learns,
                  backbone_trains=cfg.context_backbone_trains if learns else "all")
    n = cfg.context_workspace_warmup
    ws_warmup = recipe.workspace.replace(steps=n, warmup=min(recipe.workspace.warmup, n), **trains) if n else None
    return Recipe(recipe.model.replace(max_seq_len=T), at(recipe.backbone), at(recipe.workspace, **trains),
                  at(recipe.controller), mcfg, at(recipe.router), warmup, ws_warmup)


def context_study(cfg: RecallStudyConfig) -> RecallStudyConfig:
    """The study's settings with the long-context step counts."""
    return dataclasses.replace(cfg, frontier_steps=cfg.context_frontier_steps,
                               family_workspace_steps=cfg.context_workspace_steps)


def planned_ops(task: DenseTask) -> float:
    """A dense member's ops per token at its context, before it trains: `trace_cost` of the backbone alone over
    positions 1..T (what its evaluation measures: a backbone runs the same at every position)."""
    return trace_cost(task.model, None, torch.arange(1, task.context + 1)).ops_per_token


def plan_contexts(cfg: RecallStudyConfig, recipe: Recipe, out: str | Path) -> list[FrontierMember]:
    """Every length's frontier runs (`plan_frontier` over the long-context grid), each in `frontier/T{T}/`; with the
    "cheapest" search the dense runs in increasing ops over the reference (every length's cheapest first)."""
    long = context_study(cfg)
    tasks = [t for T in cfg.contexts for t in plan_frontier(long, recipe_at(cfg, recipe, T), out, cfg.context_dense,
                                                            cfg.context_family, context=T)]
    if cfg.context_search == "cheapest":
        ref = {T: reference_ops(recipe_at(cfg, recipe, T), T) for T in cfg.contexts}
        dense = sorted((t for t in tasks if isinstance(t, DenseTask)), key=lambda t: planned_ops(t) / ref[t.context])
        tasks = [t for t in tasks if not isinstance(t, DenseTask)] + dense
    return tasks


def costlier_than_passing(cfg: RecallStudyConfig, planned: list[RecallTask], folders: list[str]
                          ) -> Callable[[dict[str, Any]], set[str]]:
    """The "cheapest" search's rule for `runner.run_tasks(prune=...)`: given the results so far (by folder), the
    folders of the dense runs not needed: at each length, those of configurations costing more ops than the cheapest
    configuration that already passes (>= 95% on `seeds_needed` seeds), and the remaining seeds of a configuration
    that can no longer pass (more than `len(seeds) - seeds_needed` seeds below 95%: decided, whatever the rest say).
    With `--evaluate-only`, also the runs the study did not train (no checkpoint)."""
    need = seeds_needed(len(cfg.seeds))
    spare = len(cfg.seeds) - need  # failed seeds a configuration may have and still pass
    members = [(f, t, planned_ops(t)) for f, t in zip(folders, planned)
               if isinstance(t, DenseTask) and t.seed in cfg.seeds]  # the confirmation pass's runs aside
    untrained = set()
    if cfg.evaluate_only:
        untrained = {f for f, t, _ in members if not (Path(t.folder) / t.stage_folders()[-1] / "latest").exists()}

    def prune(done: dict[str, Any]) -> set[str]:
        passed: dict[tuple[int, str], int] = {}
        failed: dict[tuple[int, str], int] = {}
        for f, t, _ in members:
            if f in done:
                tally = passed if done[f]["entry"]["accuracy"] >= TARGET_ACCURACY else failed
                tally[(t.context, t.key)] = tally.get((t.context, t.key), 0) + 1
        cheapest: dict[int, float] = {}
        for _, t, ops in members:
            if passed.get((t.context, t.key), 0) >= need:
                cheapest[t.context] = min(ops, cheapest.get(t.context, ops))
        costlier = {f for f, t, ops in members if t.context in cheapest and ops > cheapest[t.context]}
        decided = {f for f, t, _ in members if f not in done and failed.get((t.context, t.key), 0) > spare}
        return untrained | costlier | decided

    return prune


def decided_by_running(cfg: RecallStudyConfig, planned: list[RecallTask], folders: list[str]
                       ) -> Callable[[dict[str, Any], set[str]], set[str]]:
    """The "cheapest" search's rule for `runner.run_tasks(defer=...)`: the dense runs not started of a configuration
    whose running seeds, should they all fail, would decide it (with the seeds already below 95%, more than
    `len(seeds) - seeds_needed`): started after the other ready runs, so that a free worker trains the next
    configuration instead of a seed the running ones may make unnecessary."""
    spare = len(cfg.seeds) - seeds_needed(len(cfg.seeds))
    members = [(f, (t.context, t.key)) for f, t in zip(folders, planned) if isinstance(t, DenseTask)
               and t.seed in cfg.seeds]

    def defer(done: dict[str, Any], running: set[str]) -> set[str]:
        at_risk: dict[tuple[int, str], int] = {}  # seeds failed or still running, per configuration
        for f, k in members:
            if f in running or (f in done and done[f]["entry"]["accuracy"] < TARGET_ACCURACY):
                at_risk[k] = at_risk.get(k, 0) + 1
        return {f for f, k in members if f not in done and f not in running and at_risk.get(k, 0) > spare}

    return defer


def not_trained(cfg: RecallStudyConfig, recipe: Recipe, done: list[tuple[RecallTask, dict[str, Any]]],
                T: int) -> list[dict[str, Any]]:
    """The dense configurations of length T that the search did not train (costlier than the cheapest passing one);
    a configuration decided on some of its seeds lists those in its entry (`seeds`)."""
    ran = {t.key for t, _ in done if isinstance(t, DenseTask) and t.context == T}
    rT = recipe_at(cfg, recipe, T)
    ref = reference_ops(rT, T)
    out = {}
    for t in plan_frontier(context_study(cfg), rT, cfg.out_dir, cfg.context_dense, cfg.context_family, context=T):
        if isinstance(t, DenseTask) and t.key not in ran:
            out[t.key] = {"name": t.key, "n_layer": t.n_layer, "d_model": t.d_model, "key_shift": t.key_shift,
                          "attn_window": t.attn_window, "ops_ratio": planned_ops(t) / ref}
    return sorted(out.values(), key=lambda e: e["ops_ratio"])


def assemble_contexts(cfg: RecallStudyConfig, recipe: Recipe,
                      done: list[tuple[RecallTask, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per length, in order: {"T", "task", "frontier"} (the frontier as `assemble_frontier` writes it)."""
    long = context_study(cfg)
    out = []
    for T in sorted(cfg.contexts):
        rT = recipe_at(cfg, recipe, T)
        out.append({"T": T, "task": dataclasses.asdict(rT.mqar), "search": cfg.context_search,
                    "frontier": assemble_frontier(long, rT, done, context=T),
                    "not_trained": not_trained(cfg, recipe, done, T)})
    return out


def ratio_by_context(contexts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per length: the cheapest passing configuration's ops of each family and PRISME's over the dense one's."""
    rows = []
    for c in contexts:
        v = c["frontier"]["verdict"]
        rows.append({"T": c["T"], "dense_ops": v["dense_best"] and v["dense_best"]["ops_ratio"],
                     "prisme_ops": v["prisme_best"] and v["prisme_best"]["ops_ratio"],
                     "ratio": v["ops_ratio_prisme_over_dense"]})
    return rows


def entry_label(e: dict[str, Any]) -> str:
    """A frontier entry in words: "1 layer d=16 + key shift, global attention" (PRISME: its backbone and w)."""
    if e.get("w"):
        window = f", {e['attn_window']}-window backbone" if e.get("attn_window") else ""
        return f"d={e['d_model']} w={e['w']}{window}" + (" + key shift" if e.get("key_shift") else "") + ", router"
    return (f"{e['n_layer']} layer{'s' if e['n_layer'] > 1 else ''} d={e['d_model']}"
            + (" + key shift" if e.get("key_shift") else "")
            + (f", {e['attn_window']}-window" if e.get("attn_window") else ", global attention"))


def frontier_reference(doc: dict[str, Any], command: str, cpu: str) -> dict[str, Any]:
    """A long-context study's frontier as `prisme demo` reads it (`prisme/reference/recall_context_frontier.json`):
    per length every trained configuration (accuracy per seed, ops over the reference, whether it passes), the
    cheapest passing one of each family and PRISME's ops over the dense one's; `command` and `cpu` say how it was
    made."""
    def entry(e: dict[str, Any] | None, family: str) -> dict[str, Any] | None:
        if e is None:
            return None
        out = {"family": family, "name": entry_label(e), "ops_ratio": e["ops_ratio"], "accuracy": e["accuracy"],
               "seeds": e["seeds"], "seeds_at_95": e["seeds_at_95"], "passes": e["passes"]}
        if family == "PRISME":  # the member as a `context_family` entry: what `prisme demo` trains again
            out["member"] = {"d": e["d_model"], "w": e["w"], "attn_window": e["attn_window"],
                             "key_shift": e["key_shift"], "router_token": e.get("router_token", False)}
        return out

    out: dict[str, Any] = {"command": command, "cpu": cpu, "seeds": doc["scored"]["seeds"], "contexts": []}
    for c in doc["contexts"]:
        f, v = c["frontier"], c["frontier"]["verdict"]
        rows = [entry(e, "dense") for e in f["dense"]] + [entry(e, "PRISME") for e in f["prisme"]]
        out["contexts"].append({"T": c["T"], "entries": sorted(rows, key=lambda e: e["ops_ratio"]),
                                "dense_best": entry(v["dense_best"], "dense"),
                                "prisme_best": entry(v["prisme_best"], "PRISME"),
                                "ratio": v["ops_ratio_prisme_over_dense"]})
    return out


def format_contexts(doc: dict[str, Any]) -> str:
    """Each length's frontier table, then the ratio against T."""
    lines = []
    for c in doc["contexts"]:
        task = c["task"]
        lines += [f"T = {c['T']} (queries from position {task['query_min_pos']}, {task['n_queries']} per sequence)",
                  format_frontier({"frontier": c["frontier"]})]
        if c.get("not_trained"):
            lines.append("not trained (more ops than the cheapest passing dense configuration, so they cannot change "
                         "the verdict): " + ", ".join(f"{e['name']} {e['ops_ratio']:.3f}" for e in c["not_trained"]))
        lines.append("")
    lines.append(f"{'T':>6}{'dense':>9}{'PRISME':>9}{'ratio':>8}   (cheapest passing configuration's ops, x reference)")
    fmt = lambda v, w: f"{'-':>{w}}" if v is None else f"{v:>{w}.3f}"  # noqa: E731
    for r in doc["ratio_by_context"]:
        lines.append(f"{r['T']:>6}{fmt(r['dense_ops'], 9)}{fmt(r['prisme_ops'], 9)}{fmt(r['ratio'], 8)}")
    return "\n".join(lines)


def plot_ratio(doc: dict[str, Any], path: Path) -> None:
    """PRISME's ops over the dense frontier's (cheapest passing of each) against T, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["ratio_by_context"] if r["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.axhline(1.0, color="gray", ls="--", lw=1, label="the dense frontier")
    if rows:
        ax.plot([r["T"] for r in rows], [r["ratio"] for r in rows], "-o", color="C3", label="PRISME")
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.6, "no length where both families pass", ha="center", transform=ax.transAxes)
    ax.set_xlabel("context length T")
    ax.set_ylabel("PRISME ops / dense ops (cheapest passing)")
    ax.set_title("MQAR: where a sparse workspace pays")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
