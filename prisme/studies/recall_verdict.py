"""A frontier study's verdict restated from its confirmation pass (`recall_confirm`): each deciding model's pass rate
on the study's seeds and on the fresh ones, stable or not, each family's confirmed model, the confirmed ratio (or why
there is none), and the margins.

A model passes on a set of seeds by the study's rule (>= 95% on `seeds_needed` of them: 4 of 5, 2 of 3). It is stable
when it passes on both sets or fails on both, unstable otherwise. Each family's confirmed model is its cheapest that
passes on both sets; the confirmed ratio (PRISME's ops over the dense model's, each measured on its fresh runs) is
given only where both families have one, else it is null and `why` says which model failed where. Margins: each
side's worst passing accuracy over both sets, its distance to the 95% bar, and how many passing seeds each set could
lose before the model fails (`recall_frontier.margins`: 0 means the verdict hangs on one seed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prisme.studies.confirm import stable
from prisme.studies.recall_confirm import SECTIONS, is_fresh, mark_roles, plan_grid, recorded_rows, study_rows
from prisme.studies.recall_context import recipe_at
from prisme.studies.recall_frontier import FrontierMember, margins, reference_ops, seeds_needed
from prisme.studies.recall_setup import TARGET_ACCURACY, RecallStudyConfig, RecallTask, Recipe

FAMILY = {"dense": "dense", "prisme": "PRISME"}
STATUS = {(True, True): "passes on both", (False, False): "fails on both",
          (True, False): "unstable: passes on the study's seeds, fails on the fresh ones",
          (False, True): "unstable: fails on the study's seeds, passes on the fresh ones"}


def seed_set(accuracy: list[float], seeds: list[int], need: int, ops_ratio: float) -> dict[str, Any]:
    """A model on one set of seeds: its accuracy per seed, pass rate, whether it passes (`need` seeds at 95%), its
    ops and its margins."""
    n = sum(a >= TARGET_ACCURACY for a in accuracy)
    return {"seeds": list(seeds), "accuracy": list(accuracy), "pass_rate": f"{n}/{len(accuracy)}",
            "passes": n >= need, "ops_ratio": ops_ratio, **margins(accuracy, need)}


def fresh_entries(cfg: RecallStudyConfig, recipe: Recipe, done: list[tuple[RecallTask, dict[str, Any]]]
                  ) -> dict[tuple[Any, str, str], dict[str, Any]]:
    """The confirmation runs of `done`, one entry per (length, family, member) over the fresh seeds
    (`FrontierMember.frontier_entry`: accuracy per seed, mean ops over the reference at that length)."""
    groups: dict[tuple[Any, str, str], list[tuple[FrontierMember, dict[str, Any]]]] = {}
    for t, e in done:
        if is_fresh(cfg, t):
            groups.setdefault((t.context, t.section, t.key), []).append((t, e))
    need = seeds_needed(len(cfg.confirm_seeds))
    out = {}
    for (T, section, key), members in groups.items():
        rT = recipe if T is None else recipe_at(cfg, recipe, T)
        ref = reference_ops(rT, rT.mqar.seq_len)
        runs = sorted((e for _, e in members), key=lambda e: cfg.confirm_seeds.index(e["seed"]))
        out[(T, section, key)] = members[0][0].frontier_entry(runs[-1]["model"], runs, ref, need)
    return out


def confirm_length(rows: list[dict[str, Any]], fresh: dict[tuple[str, str], dict[str, Any]], need_study: int,
                   need_fresh: int) -> dict[str, Any]:
    """One length's confirmation from the study's `rows` (`recall_confirm.study_rows`, with their roles) and the fresh
    entries by (family, key): the deciding models, the restated verdict and the margins."""
    models = []
    for r in sorted((r for r in rows if r.get("role")), key=lambda r: (r["section"], r["ops_ratio"])):
        f = fresh.get((r["section"], r["key"]))
        study = seed_set(r["accuracy"], r["seeds"], need_study, r["ops_ratio"])
        new = None if f is None else seed_set(f["accuracy"], f["seeds"], need_fresh, f["ops_ratio"])
        models.append({"family": r["section"], "key": r["key"], "name": r["name"], "role": r["role"], "study": study,
                       "fresh": new, "stable": stable(study["passes"], None if new is None else new["passes"]),
                       "status": "not trained on the fresh seeds" if new is None
                       else STATUS[(study["passes"], new["passes"])]})
    verdict, margin = restate(models)
    return {"models": models, "verdict": verdict, "margins": margin,
            "outside_grid": [r["name"] for r in rows if r["key"] is None]}


def _accuracies(s: dict[str, Any]) -> str:
    return f"{s['pass_rate']}: " + " ".join(f"{a:.3f}" for a in s["accuracy"])


def _how(m: dict[str, Any]) -> str:
    """A model that passes on the study's seeds and not on the fresh ones, in words."""
    if m["fresh"] is None:
        return f"{FAMILY[m['family']]} {m['name']} was not trained on the fresh seeds"
    return (f"{FAMILY[m['family']]} {m['name']} is unstable: {_accuracies(m['study'])} on the study's seeds, "
            f"{_accuracies(m['fresh'])} on the fresh ones")


def restate(models: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the verdict, the margins) from one length's deciding models: each family's cheapest model that passes on both
    sets, the confirmed ratio where both families have one (else null and `why`), and `caveats`: a study winner that
    gave way to its fallback, a cheaper member that passes on the fresh seeds alone (the frontier may lie lower)."""
    best = {s: min((m for m in models if m["family"] == s and m["stable"] and m["study"]["passes"]),
                   key=lambda m: m["fresh"]["ops_ratio"], default=None) for s in SECTIONS}
    d, p = best["dense"], best["prisme"]
    ratio = p["fresh"]["ops_ratio"] / d["fresh"]["ops_ratio"] if d and p else None
    study_best = {s: next((m for m in models if m["family"] == s and m["role"] == "cheapest_passing"), None)
                  for s in SECTIONS}
    reasons, caveats = [], []
    for s in SECTIONS:
        mine = [m for m in models if m["family"] == s]
        if study_best[s] is None:
            reasons.append(f"no {FAMILY[s]} configuration passes on the study's seeds")
            continue
        for m in mine:
            if m["study"]["passes"] and not (m["fresh"] and m["fresh"]["passes"]):
                (reasons if best[s] is None else caveats).append(_how(m))
        if best[s] is not None and best[s] is not study_best[s]:
            caveats.append(f"{FAMILY[s]}: the confirmed verdict takes {best[s]['name']}, the next member that passes "
                           f"on both sets")
        for m in mine:
            if m["role"] == "next_cheaper" and m["fresh"] and m["fresh"]["passes"]:
                against = (f" (PRISME over it: {p['fresh']['ops_ratio'] / m['fresh']['ops_ratio']:.3f})"
                           if s == "dense" and p else "")
                caveats.append(f"{FAMILY[s]} {m['name']} fails on the study's seeds ({_accuracies(m['study'])}) but "
                               f"passes on the fresh ones ({_accuracies(m['fresh'])}): the {FAMILY[s]} frontier may "
                               f"lie lower{against}")
    sd, sp = study_best["dense"], study_best["prisme"]
    verdict = {"dense": d and d["key"], "prisme": p and p["key"], "dense_name": d and d["name"],
               "prisme_name": p and p["name"], "dense_ops_ratio": d and d["fresh"]["ops_ratio"],
               "prisme_ops_ratio": p and p["fresh"]["ops_ratio"], "confirmed_ratio": ratio,
               "study_ratio": sp["study"]["ops_ratio"] / sd["study"]["ops_ratio"] if sd and sp else None,
               "why": None if ratio is not None else "; ".join(reasons), "caveats": caveats}
    margin = {}
    for s in SECTIONS:
        m = best[s] or study_best[s]
        if m is None:
            margin[s] = None
            continue
        acc = m["study"]["accuracy"] + (m["fresh"]["accuracy"] if m["fresh"] else [])
        worst = min((a for a in acc if a >= TARGET_ACCURACY), default=None)
        margin[s] = {"key": m["key"], "name": m["name"], "confirmed": m is best[s], "worst_passing": worst,
                     "margin": None if worst is None else worst - TARGET_ACCURACY,
                     "spare_seeds": {"study": m["study"]["spare_seeds"],
                                     "fresh": m["fresh"] and m["fresh"]["spare_seeds"]}}
    return verdict, margin


def assemble_confirmation(cfg: RecallStudyConfig, recipe: Recipe, rows: dict[Any, list[dict[str, Any]]],
                          done: list[tuple[RecallTask, dict[str, Any]]]) -> dict[str, Any] | None:
    """The document's `confirmation` block from the study's rows at each length (None: the recipe's own; with their
    roles) and the finished runs (`done`: the confirmation's are picked out); None without fresh seeds."""
    if not cfg.confirm_seeds:
        return None
    fresh = fresh_entries(cfg, recipe, done)
    need_study, need_fresh = seeds_needed(len(cfg.seeds)), seeds_needed(len(cfg.confirm_seeds))
    contexts = []
    for T, rs in rows.items():
        mine = {(s, k): e for (c, s, k), e in fresh.items() if c == T}
        contexts.append({"T": T or recipe.mqar.seq_len, **confirm_length(rs, mine, need_study, need_fresh)})
    return {"seeds": list(cfg.confirm_seeds), "study_seeds": list(cfg.seeds), "seeds_needed": need_fresh,
            "study_seeds_needed": need_study, "target_accuracy": TARGET_ACCURACY, "of": cfg.confirm_of,
            "contexts": contexts}


def confirm_study(cfg: RecallStudyConfig, recipe: Recipe, frontiers: dict[Any, dict[str, Any]],
                  done: list[tuple[RecallTask, dict[str, Any]]]) -> dict[str, Any] | None:
    """A study's `confirmation` block: its frontier at each length (`assemble_frontier`'s, None: the recipe's own),
    its deciding models as `roles` finds them, and their confirmation runs in `done`."""
    need = seeds_needed(len(cfg.seeds))
    rows = {T: mark_roles(study_rows(f, need)) for T, f in frontiers.items()}
    return assemble_confirmation(cfg, recipe, rows, done)


def confirmation_document(cfg: RecallStudyConfig, recipe: Recipe, done: list[tuple[RecallTask, dict[str, Any]]],
                          total_s: float, jobs: int) -> dict[str, Any]:
    """The document of a recorded study's confirmation (`--confirm-of`): what it confirms, the settings, the
    `confirmation` block."""
    rows = recorded_rows(cfg, plan_grid(cfg, recipe, cfg.out_dir))
    return {"confirmation_of": cfg.confirm_of, "task": dataclasses.asdict(recipe.mqar),
            "study": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "config_dir"},
            "confirmation": assemble_confirmation(cfg, recipe, rows, done),
            "wall_s": {"total": total_s, "jobs": jobs}}


def format_confirmation(block: dict[str, Any] | None) -> str:
    """The confirmation block for humans: per length each deciding model on both sets of seeds, the confirmed
    verdict, the margins and the caveats."""
    if block is None:
        return "confirmation pass: off (--confirm-seeds none)"
    seeds = lambda xs: ",".join(map(str, xs))  # noqa: E731
    lines = [f"confirmation on fresh seeds {seeds(block['seeds'])} (pass: >= 95% on >= {block['seeds_needed']} of "
             f"{len(block['seeds'])}; on the study's seeds {seeds(block['study_seeds'])}: >= "
             f"{block['study_seeds_needed']} of {len(block['study_seeds'])})"
             + (f", the study recorded in {block['of']}" if block["of"] else "")]
    for c in block["contexts"]:
        wide = max([12] + [len(m["key"]) + 2 for m in c["models"]])
        head = (f"{'family':<8}{'model':<{wide}}{'role':<18}{'ops':>7}  {'study seeds':<38}{'fresh seeds':<26}"
                f"verdict")
        lines += ["", f"T = {c['T']}"] + ([head, "-" * (len(head) + 20)] if c["models"] else [])
        for m in c["models"]:
            fresh = _accuracies(m["fresh"]) if m["fresh"] else "-"
            ops = (m["fresh"] or m["study"])["ops_ratio"]
            lines.append(f"{FAMILY[m['family']]:<8}{m['key']:<{wide}}{m['role'].replace('_', ' '):<18}{ops:>7.3f}  "
                         f"{_accuracies(m['study']):<38}{fresh:<26}{m['status']}")
        v = c["verdict"]
        side = {s: f"{v[s + '_name']} at {v[s + '_ops_ratio']:.3f}x" if v[s] else "none" for s in SECTIONS}
        lines.append(f"confirmed (passes on both sets): dense {side['dense']}; PRISME {side['prisme']}")
        study = "" if v["study_ratio"] is None else f" (the study's seeds alone: {v['study_ratio']:.3f})"
        lines.append(f"confirmed ratio PRISME / dense: {v['confirmed_ratio']:.3f}{study}" if v["confirmed_ratio"]
                     is not None else f"no confirmed ratio{study}: {v['why']}")
        for s, m in c["margins"].items():
            if m is not None:
                worst = "no seed passes" if m["worst_passing"] is None else \
                    f"worst passing seed {m['worst_passing']:.3f} ({m['margin']:+.3f} over the bar)"
                spare = m["spare_seeds"]
                fresh = "" if spare["fresh"] is None else f", {spare['fresh']} of the fresh"
                lines.append(f"margin, {FAMILY[s]} {m['key']}{'' if m['confirmed'] else ' (not confirmed)'}: {worst}"
                             f" over both sets; passing seeds to spare (below 0: short): {spare['study']} of the "
                             f"study's{fresh}")
        lines += [f"caveat: {x}" for x in v["caveats"]]
        if c["outside_grid"]:
            lines.append("not in this study's grid (not confirmed): " + ", ".join(c["outside_grid"]))
    return "\n".join(lines)
