"""The confirmation pass of a frontier study (`prisme study recall --frontier [--context T]`): the models that decide
its verdict trained again on fresh seeds (`confirm_seeds`), and the verdict restated from them.

Which models (`roles`), per length and per family (dense, PRISME), from the accuracies on the study's seeds: the
cheapest configuration that passes (>= 95% on `seeds_needed` of them), the next cheaper one (might the frontier lie
lower?) and the next costlier one that passes (the verdict's fallback, should the cheapest prove unstable). Each is
trained on every fresh seed as an ordinary run of the study, in its folder `<member>_seed<S>` beside the study's runs:
`--resume` continues it, and `--reuse` copies it from another study that trained the same model on that seed. The
study plans every member on every fresh seed; each waits for the study's runs of its family at its length
(`runner.Task.after`), and once those have decided, the members that decide nothing are dropped
(`confirmation_prune`). A recorded study (`confirm_of`: a study's JSON document, or
`prisme/reference/recall_context_frontier.json`) gives the study's seeds and accuracies instead: its deciding models
are found from the document, taken from this study's grid by name, and only those train (`recorded_rows`).

The verdict from the fresh seeds is `recall_verdict`'s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prisme.studies.recall_context import entry_label, plan_contexts
from prisme.studies.recall_frontier import FrontierMember, dense_name, family_name, plan_frontier, seeds_needed
from prisme.studies.recall_setup import TARGET_ACCURACY, RecallStudyConfig, RecallTask, Recipe

SECTIONS = ("dense", "prisme")  # the frontier's families, as its document names them


def is_fresh(cfg: RecallStudyConfig, t: RecallTask) -> bool:
    """Whether `t` is a run of the confirmation pass (a frontier member on a seed that is not the study's)."""
    return isinstance(t, FrontierMember) and t.seed not in cfg.seeds


def roles(entries: list[dict[str, Any]]) -> dict[str, str]:
    """The models of one family that decide the verdict, {key: role}, from its entries on the study's seeds (each
    {"key", "ops", "passes"}): "cheapest_passing", "next_cheaper" (the costliest one cheaper than it) and "fallback"
    (the next costlier one that passes). Empty when no entry passes."""
    order = sorted(entries, key=lambda e: e["ops"])
    first = next((i for i, e in enumerate(order) if e["passes"]), None)
    if first is None:
        return {}
    out = {order[first]["key"]: "cheapest_passing"}
    if first > 0:
        out[order[first - 1]["key"]] = "next_cheaper"
    later = next((e for e in order[first + 1:] if e["passes"]), None)
    if later is not None:
        out[later["key"]] = "fallback"
    return out


def mark_roles(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` (a frontier's entries as `study_rows` writes them), each given its `role` within its family (None: it
    decides nothing, or it is not in this study's grid: no key)."""
    for section in SECTIONS:
        mine = [r for r in rows if r["section"] == section]
        role = roles([{"key": r["key"], "ops": r["ops_ratio"], "passes": r["passes"]} for r in mine if r["key"]])
        for r in mine:
            r["role"] = role.get(r["key"]) if r["key"] else None
    return rows


def task_label(t: FrontierMember) -> str:
    """A planned member in the words of a recorded frontier (`recall_context.entry_label`)."""
    return entry_label({"n_layer": t.model.n_layer, "d_model": t.d_model, "w": getattr(t, "w", None),
                        "key_shift": t.key_shift, "attn_window": t.attn_window})


def fresh_study(cfg: RecallStudyConfig) -> RecallStudyConfig:
    """The study's settings with the fresh seeds as its seeds: the confirmation pass's runs are planned by them."""
    return dataclasses.replace(cfg, seeds=list(cfg.confirm_seeds), confirm_seeds=None, confirm_of=None)


def plan_grid(cfg: RecallStudyConfig, recipe: Recipe, out: str | Path) -> list[FrontierMember]:
    """Every member of the study's grid (every length) on every fresh seed."""
    fresh = fresh_study(cfg)
    return plan_frontier(fresh, recipe, out) if cfg.contexts is None else plan_contexts(fresh, recipe, out)


def plan_confirmation(cfg: RecallStudyConfig, recipe: Recipe, out: str | Path) -> list[FrontierMember]:
    """The confirmation pass's runs: every member on every fresh seed (those that decide nothing are dropped once the
    study's runs have decided, `confirmation_prune`); of a recorded study (`confirm_of`), its deciding models alone.
    None without fresh seeds."""
    if not cfg.confirm_seeds:
        return []
    tasks = plan_grid(cfg, recipe, out)
    if cfg.confirm_of is None:
        return tasks
    wanted = {(T, r["section"], r["key"]) for T, rows in recorded_rows(cfg, tasks).items() for r in rows
              if r.get("role")}
    return [t for t in tasks if (t.context, t.section, t.key) in wanted]


def waits_for(cfg: RecallStudyConfig, planned: list[RecallTask], names: list[str]) -> dict[str, tuple[str, ...]]:
    """{the name of each confirmation run: the names of the study's runs of its family at its length}: it starts
    once they have finished or been dropped (`runner.Task.after`), when its family's verdict is known."""
    study: dict[tuple[Any, str], list[str]] = {}
    for n, t in zip(names, planned):
        if isinstance(t, FrontierMember) and not is_fresh(cfg, t):
            study.setdefault((t.context, t.section), []).append(n)
    return {n: tuple(study.get((t.context, t.section), ())) for n, t in zip(names, planned) if is_fresh(cfg, t)}


def confirmation_prune(cfg: RecallStudyConfig, planned: list[RecallTask], names: list[str],
                       search: Callable[[dict[str, Any]], set[str]] | None = None
                       ) -> Callable[[dict[str, Any]], set[str]]:
    """`runner.run_tasks(prune=...)` with the confirmation pass: what `search` drops (the long-context search's rule),
    and, for each family at each length whose study runs have all finished or been dropped, its confirmation runs of
    members that decide nothing (`roles` of the accuracies so far). With `--evaluate-only`, also the confirmation
    runs that were never trained (no checkpoint)."""
    fresh = [(n, t) for n, t in zip(names, planned) if is_fresh(cfg, t)]
    groups: dict[tuple[Any, str], list[tuple[str, FrontierMember]]] = {}
    for n, t in zip(names, planned):
        if isinstance(t, FrontierMember) and not is_fresh(cfg, t):
            groups.setdefault((t.context, t.section), []).append((n, t))
    untrained = {n for n, t in fresh if cfg.evaluate_only
                 and not (Path(t.folder) / t.stage_folders()[-1] / "latest").exists()}
    need = seeds_needed(len(cfg.seeds))

    def prune(done: dict[str, Any]) -> set[str]:
        dropped = set(search(done)) if search is not None else set()
        out = dropped | untrained
        for group, members in groups.items():
            if not all(n in done or n in dropped for n, _ in members):
                continue  # the family's verdict is not known yet
            runs: dict[str, list[dict[str, Any]]] = {}
            for n, t in members:
                if n in done:
                    runs.setdefault(t.key, []).append(done[n]["entry"])
            keep = roles([{"key": k, "ops": sum(e["ops_per_token"] for e in es) / len(es),
                           "passes": sum(e["accuracy"] >= TARGET_ACCURACY for e in es) >= need}
                          for k, es in runs.items()])
            out |= {n for n, t in fresh if (t.context, t.section) == group and t.key not in keep}
        return out

    return prune


# ------------------------------------------------------------------------------------------------ recorded studies
def read_recorded(path: str | Path) -> dict[str, Any]:
    """A recorded study's JSON document (`--confirm-of`); ValueError naming the option when it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--confirm-of {path}: not a readable JSON document ({e})") from None
    what = "a recall.json of `prisme study recall --frontier`, or prisme/reference/recall_context_frontier.json"
    if not isinstance(doc, dict):
        raise ValueError(f"--confirm-of {path}: not a frontier study's document ({what}): it holds a "
                         f"{type(doc).__name__}")
    if doc.get("study") == "text" or "sources" in doc or doc.get("study") == "lengths":
        kind = "prisme study lengths" if doc.get("study") == "lengths" else "prisme study text"
        raise ValueError(f"--confirm-of {path}: a document of `{kind}`, not a frontier study's ({what})")
    frontier, contexts = doc.get("frontier"), doc.get("contexts")
    if not (isinstance(frontier, dict) and all(isinstance(frontier.get(k), list) for k in SECTIONS)
            or isinstance(contexts, list) and contexts and all(isinstance(c, dict) and "T" in c for c in contexts)):
        raise ValueError(f"--confirm-of {path}: not a frontier study's document ({what}): it has neither a "
                         f"frontier (its {'/'.join(SECTIONS)} entries) nor contexts")
    seeds = doc.get("seeds") if "seeds" in doc else (doc.get("scored") or {}).get("seeds")
    if not (isinstance(seeds, list) and seeds and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                      for v in seeds)):
        raise ValueError(f"--confirm-of {path}: the seeds its study ran must be a list of ints >= 0 (`seeds`, or "
                         f"`scored.seeds`), got {seeds!r}")
    return doc


def recorded_seeds(doc: dict[str, Any]) -> list[int]:
    """The seeds a recorded study ran (a study's document: `scored.seeds`; the reference: `seeds`)."""
    return list(doc.get("seeds") or (doc.get("scored") or {}).get("seeds") or [])


def study_rows(frontier: dict[str, Any], need: int) -> list[dict[str, Any]]:
    """A study document's frontier as rows: {"section", "key", "name", "ops_ratio", "accuracy", "seeds", "passes"}."""
    rows = []
    for section in SECTIONS:
        for e in frontier[section]:
            ks, win = e.get("key_shift", False), e.get("attn_window")
            key = dense_name(e["n_layer"], e["d_model"], ks, win) if section == "dense" else \
                family_name(e["d_model"], e["w"], win, ks, e.get("router_token", False))
            rows.append({"section": section, "key": key, "name": entry_label(e), "ops_ratio": e["ops_ratio"],
                         "accuracy": list(e["accuracy"]), "seeds": list(e["seeds"]),
                         "passes": sum(a >= TARGET_ACCURACY for a in e["accuracy"]) >= need})
    return rows


def reference_rows(entries: list[dict[str, Any]], need: int) -> list[dict[str, Any]]:
    """The reference's entries (`recall_context.frontier_reference`) as rows; a dense one's key is None (its name
    alone says which model it is: `recorded_rows` finds it in the grid)."""
    rows = []
    for e in entries:
        prisme = e["family"] == "PRISME"
        m = e.get("member") or {}
        key = family_name(m["d"], m["w"], m.get("attn_window"), m.get("key_shift", False),
                          m.get("router_token", False)) if prisme else None
        rows.append({"section": "prisme" if prisme else "dense", "key": key, "name": e["name"],
                     "ops_ratio": e["ops_ratio"], "accuracy": list(e["accuracy"]), "seeds": list(e["seeds"]),
                     "passes": sum(a >= TARGET_ACCURACY for a in e["accuracy"]) >= need})
    return rows


def recorded_rows(cfg: RecallStudyConfig, grid: list[FrontierMember]) -> dict[int | None, list[dict[str, Any]]]:
    """The recorded study's (`confirm_of`) rows at each length of this study (None: the recipe's own), each with its
    key in this study's `grid` (None: not in it) and its `role` where it decides the verdict (`roles`, among the rows
    the grid holds). ValueError naming `--confirm-of` for a length the document lacks, or a family's cheapest passing
    configuration that the grid lacks."""
    path = cfg.confirm_of
    doc = read_recorded(path)
    need = seeds_needed(len(recorded_seeds(doc)))
    if "contexts" in doc:
        recorded = {c["T"]: reference_rows(c["entries"], need) if "entries" in c else study_rows(c["frontier"], need)
                    for c in doc["contexts"]}
    else:
        recorded = {None: study_rows(doc["frontier"], need)}
    out = {}
    for T in [None] if cfg.contexts is None else cfg.contexts:
        if T not in recorded:
            has = ", ".join(f"T = {k}" if k else "the recipe's T = 32" for k in recorded)
            raise ValueError(f"--confirm-of {path}: the document has no frontier at "
                             f"{'the recipe T = 32' if T is None else f'T = {T}'} (it has {has})")
        rows = [dict(r) for r in recorded[T]]
        for section in SECTIONS:
            keys = {t.key: task_label(t) for t in grid if t.context == T and t.section == section}
            by_name = {label: key for key, label in keys.items()}
            mine = [r for r in rows if r["section"] == section]
            for r in mine:
                r["key"] = r["key"] if r["key"] in keys else by_name.get(r["name"]) if r["key"] is None else None
            best = min((r for r in mine if r["passes"]), key=lambda r: r["ops_ratio"], default=None)
            if best is not None and best["key"] is None:
                raise ValueError(f"--confirm-of {path}: its cheapest passing {section} configuration at "
                                 f"{'T = ' + str(T) if T else 'T = 32'}, {best['name']!r}, is not in this study's grid "
                                 f"(it holds {', '.join(sorted(keys.values())) or 'none'}): pass --configs with a "
                                 f"grid that has it")
        out[T] = mark_roles(rows)
    return out
