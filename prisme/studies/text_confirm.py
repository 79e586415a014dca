"""The text study's confirmation pass: the runs that decide its verdicts trained again on fresh seeds
(`TextStudyConfig.confirm_seeds`), and each verdict restated from them.

A verdict, per bank source and split, is whether the workspace row closest to the dense frontier
(`text_report.closest_row`) beats it on every seed: its frontier gap's paired 95% interval below 0 on each. What
decides it: that row (PRISME's stage 1, the source's stages 2-3, and the matched backbone its evaluation reads) and
the dense frontier models its gap was interpolated between on any study seed (the gap's `at`). Each is planned on
every fresh seed as an ordinary task of the study's graph, in `seed<S>/` beside the study's runs, so `--resume`
continues it and `--reuse` copies it (`fresh_tasks`). PRISME's runs start when a worker is free; the dense models and
the evaluations wait for the study's evaluations (`runner.Task.after`), which decide what is needed: the rest is
dropped before it starts (`confirmation_prune`). On a fresh seed the dense frontier is the lower envelope of the
dense models trained there (at T = 128 with PRISME's own backbone and the matched one, as in the study), and every
row is scored as the study scores it (`FreshEvalTask`).

The restated verdict of each deciding row (`confirmation_block`): its gap interval per fresh seed; "confirmed" only
where it lies below 0 on every study seed and every fresh seed, "confirmed negative" where it does not on either set,
"unstable" where the two sets disagree; with the margins: each seed's upper end, the worst seed named.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prisme.config import PrismeConfig
from prisme.data.text import TokenDataset
from prisme.studies.confirm import restated, stable
from prisme.studies.records import STUDY_DIR, store_path
from prisme.studies.runner import Task
from prisme.studies.text_report import closest_row, seed_summary
from prisme.studies.text_setup import TextStudyConfig, frontier_name
from prisme.studies.text_tasks import (
    BackboneTask,
    EvalTask,
    FrontierTask,
    MatchedTask,
    SourceTask,
    TextTask,
    evaluate,
    study_task,
)
from prisme.training.config import StageConfig

SPLITS = ("val", "held_out")
RULE = "beats the dense frontier: its frontier gap's paired 95% interval lies below 0 on every seed"
VERDICTS = {  # (beats on every study seed, beats on every fresh seed) -> (verdict, in words); the rule: `confirm`
    (True, True): (restated(True, True), "confirmed: beats the dense frontier on every study seed and every fresh "
                                         "seed"),
    (False, False): (restated(False, False), "confirmed negative: does not beat the dense frontier on every seed of "
                                             "either set"),
    (True, False): (restated(True, False), "unstable: beats the dense frontier on every study seed, not on every "
                                           "fresh seed"),
    (False, True): (restated(False, True), "unstable: beats the dense frontier on every fresh seed, not on every "
                                           "study seed")}


def frontier_names(cfg: TextStudyConfig, model_cfg: PrismeConfig) -> list[str]:
    """The study's dense frontier models by name, in the order of its frontier."""
    return list(dict.fromkeys(frontier_name(model_cfg, *f) for f in cfg.frontier_entries))


# ------------------------------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class FreshEvalTask(EvalTask):
    """An evaluation of the confirmation pass: every policy of one source on one split of a fresh seed, against the
    dense models the study's verdicts are compared with (from the study's evaluations, kept in its folder)."""

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        doc = study_document(cfg, kept_evaluations(cfg))
        if doc is None:
            raise RuntimeError(f"{self.name}: the study's evaluations are not all kept in {cfg.out_dir}")
        models = [m for r in deciding_rows(doc, frontier_names(cfg, model_cfg)) for m in r["frontier_models"]]
        return evaluate(cfg, model_cfg, stages, self.seed, self.source, data, self.split, models)


def study_evaluations(cfg: TextStudyConfig) -> list[EvalTask]:
    """The study's evaluations (every study seed, source and split): what decides the verdicts."""
    return [EvalTask(seed, s, split) for seed in cfg.seeds for s in dict.fromkeys(cfg.sources) for split in SPLITS]


def fresh_tasks(cfg: TextStudyConfig, sources: list[str], models: list[PrismeConfig]
                ) -> list[tuple[TextTask, list[TextTask], list[TextTask]]]:
    """(task, the tasks it needs, the tasks it starts after) of every run of the confirmation pass, in the order
    they should start: per fresh seed PRISME's chain (stage 1, each source's stages 2-3, the matched backbone) with
    no wait, each dense frontier model after the study's evaluations, and each evaluation after those and the seed's
    dense models (a dropped one, `confirmation_prune`, is not waited for). None without fresh seeds."""
    study = list(study_evaluations(cfg))
    chains: list[tuple[TextTask, list[TextTask], list[TextTask]]] = []
    rest: list[tuple[TextTask, list[TextTask], list[TextTask]]] = []
    for seed in cfg.confirm_seeds or []:
        backbone = BackboneTask(seed)
        runs = [SourceTask(seed, s) for s in sources]
        frontier = sorted((FrontierTask(seed, m) for m in models), key=lambda f: (-f.model.n_layer, f.model.copy_head))
        chains += [(backbone, [], []), *((r, [backbone], []) for r in runs),
                   *((f, twin_needs(f, frontier), study) for f in frontier)]
        matched = MatchedTask(seed)
        rest.append((matched, [backbone], []))
        for split in ("held_out", "val"):
            rest += [(FreshEvalTask(seed, r.source, split), [r, matched], [*study, *frontier]) for r in runs]
    return chains + rest


def twin_needs(f: FrontierTask, frontier: list[FrontierTask]) -> list[FrontierTask]:
    """A "+copy" twin needs its dense model's task (its copy stage starts from that checkpoint)."""
    if not f.model.copy_head:
        return []
    return [t for t in frontier if t.model.name == f.model.name.removesuffix("+copy")]


def kept_evaluations(cfg: TextStudyConfig) -> dict[str, Any]:
    """The study's evaluations kept in its folder's store (`runner.run_tasks`), by task name."""
    store = Path(cfg.out_dir) / STUDY_DIR / "done"
    return {t.name: json.loads(store_path(store, t.name).read_text()) for t in study_evaluations(cfg)
            if store_path(store, t.name).is_file()}


def study_document(cfg: TextStudyConfig, results: dict[str, Any]) -> dict[str, Any] | None:
    """The study's evaluations as the document `text_report.seed_summary` reads ({"seeds": {seed: {"sources": {source:
    {split: evaluation}}}}}), from finished tasks' results by name; None while one is missing."""
    if any(t.name not in results for t in study_evaluations(cfg)):
        return None
    return {"seeds": {str(seed): {"sources": {s: {split: results[EvalTask(seed, s, split).name]["result"]
                                                  for split in SPLITS} for s in dict.fromkeys(cfg.sources)}}
                      for seed in cfg.seeds}}


def deciding_rows(doc: dict[str, Any], models: list[str]) -> list[dict[str, Any]]:
    """Per source and split, the row whose verdict the study states (`closest_row`): {"source", "split", "policy",
    "compared_with" (the frontier rows its gap was interpolated between on any seed), "frontier_models" (those of
    them that are dense frontier models, of `models`: they train again)}."""
    summary = doc.get("summary") or seed_summary(doc)
    out = []
    for src, split in dict.fromkeys((e["source"], e["split"]) for e in summary):
        best = closest_row(summary, src, split)
        if best is None:
            continue
        compared = list(dict.fromkeys(n for d in best["frontier_gap"] for n in d.get("at") or {}))
        out.append({"source": src, "split": split, "policy": best["policy"], "family": best["family"],
                    "compared_with": compared, "frontier_models": [m for m in models if m in compared]})
    return out


def confirmation_prune(cfg: TextStudyConfig, model_cfg: PrismeConfig, tasks: list[Task]
                       ) -> Callable[[dict[str, Any]], set[str]]:
    """`runner.run_tasks(prune=...)`: once the study's evaluations have all finished, the confirmation runs that
    decide no verdict (`deciding_rows`): the dense models no deciding row is compared with, the evaluations of a
    source and split without a deciding row, PRISME's runs of a source with none."""
    fresh_seeds = set(cfg.confirm_seeds or ())
    fresh = [study_task(t) for t in tasks if study_task(t).seed in fresh_seeds]
    names = frontier_names(cfg, model_cfg)

    def prune(done: dict[str, Any]) -> set[str]:
        doc = study_document(cfg, done)
        if doc is None:
            return set()  # the verdicts are not known yet
        rows = deciding_rows(doc, names)
        models = {m for r in rows for m in r["frontier_models"]}
        models |= {m.removesuffix("+copy") for m in models}  # a "+copy" twin trains from its dense model
        pairs = {(r["source"], r["split"]) for r in rows}
        sources = {s for s, _ in pairs}

        def needed(t: TextTask) -> bool:
            if isinstance(t, FrontierTask):
                return t.what in models
            if isinstance(t, EvalTask):
                return (t.source, t.split) in pairs
            if isinstance(t, SourceTask):
                return t.source in sources
            return bool(sources)  # stage 1 and the matched backbone

        return {t.name for t in fresh if not needed(t)}

    return prune


# ----------------------------------------------------------------------------------------------------------- score
def seed_set(seeds: list[int], gaps: list[dict[str, Any]], ops: list[float]) -> dict[str, Any]:
    """A row on one set of seeds: its gap interval per seed, the upper ends, on how many seeds it lies below 0,
    whether on every one, and the worst seed (the highest upper end)."""
    upper = [g["hi"] for g in gaps]
    worst = max(range(len(upper)), key=upper.__getitem__)
    below = sum(u < 0 for u in upper)
    return {"seeds": list(seeds), "relative_ops": list(ops),
            "frontier_gap": [{k: g[k] for k in ("mean", "lo", "hi", "at") if k in g} for g in gaps],
            "upper": upper, "below": below, "beats": below == len(upper),
            "worst": {"seed": seeds[worst], "upper": upper[worst]}}


def restate(row: dict[str, Any], study: dict[str, Any], fresh: dict[str, Any] | None) -> dict[str, Any]:
    """One deciding row's verdict from both sets of seeds (`VERDICTS`), with its margin: the worst seed over both."""
    if fresh is None:
        verdict, status = "not confirmed", "not scored on every fresh seed: not confirmed"
    else:
        verdict, status = VERDICTS[(study["beats"], fresh["beats"])]
    worst = max([("study", study), *([("fresh", fresh)] if fresh else [])], key=lambda s: s[1]["worst"]["upper"])
    return {**row, "study": study, "fresh": fresh, "verdict": verdict, "status": status,
            "confirmed": verdict == "confirmed",
            "stable": stable(study["beats"], None if fresh is None else fresh["beats"]),
            "margin": {"set": worst[0], **worst[1]["worst"]}}


def confirmation_block(cfg: TextStudyConfig, model_cfg: PrismeConfig, doc: dict[str, Any],
                       done: dict[str, Any]) -> dict[str, Any] | None:
    """The document's `confirmation` block from the study's document (`doc`, with its `summary`) and the finished
    tasks (`done` by name: the fresh seeds' evaluations are read from it); None without fresh seeds."""
    if not cfg.confirm_seeds:
        return None
    fresh_seeds = list(cfg.confirm_seeds)
    rows = []
    for r in deciding_rows(doc, frontier_names(cfg, model_cfg)):
        e = next(e for e in doc["summary"] if (e["source"], e["split"], e["policy"]) == (r["source"], r["split"],
                                                                                        r["policy"]))
        study = seed_set(e["seeds"], e["frontier_gap"], e["relative_ops"])
        scored = []
        for seed in fresh_seeds:
            res = done.get(FreshEvalTask(seed, r["source"], r["split"]).name)
            row = next((x for x in res["result"]["rows"] if x["policy"] == r["policy"]), None) if res else None
            scored.append(row if row and row.get("frontier_gap") else None)
        fresh = None if None in scored else seed_set(fresh_seeds, [x["frontier_gap"] for x in scored],
                                                     [x["relative_ops"] for x in scored])
        rows.append(restate(r, study, fresh))
    return {"seeds": fresh_seeds, "study_seeds": list(cfg.seeds), "rule": RULE, "rows": rows,
            "confirmed": [f"{r['split']}, {r['source']}: {r['policy']}" for r in rows if r["confirmed"]]}
