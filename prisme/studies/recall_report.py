"""The recall study's report: its document, the table, its plots, and the table-then-JSON output both studies share."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from prisme.checkpoint import load_model
from prisme.data.mqar import MQARConfig, make_mqar_batch
from prisme.data.text import IGNORE_INDEX
from prisme.evaluation.policies import ROW_KINDS
from prisme.io import write_text_atomic
from prisme.studies.recall_setup import EVAL_SEED, TARGET_ACCURACY, RecallStudyConfig, RecallTask, Recipe


def sections(cfg: RecallStudyConfig, done: list[tuple[RecallTask, dict[str, Any]]]
             ) -> dict[str, list[tuple[RecallTask, dict[str, Any]]]]:
    """The finished (task, entry) pairs by the part of the document they go to (`RecallTask.section`), each part in
    seed order."""
    parts: dict[str, list[tuple[RecallTask, dict[str, Any]]]] = {}
    for t, e in sorted(done, key=lambda r: cfg.seeds.index(r[0].seed)):
        parts.setdefault(t.section, []).append((t, e))
    return parts


def listed(e: dict[str, Any]) -> dict[str, Any]:
    """A controller run's entry as the document lists it: its checkpoint last, as `controller_checkpoint`."""
    return {k: v for k, v in e.items() if k != "checkpoint"} | {"controller_checkpoint": e["checkpoint"]}


def assemble(cfg: RecallStudyConfig, recipe: Recipe, done: list[tuple[RecallTask, dict[str, Any]]], total_s: float,
             jobs: int) -> dict[str, Any]:
    """The study's JSON document from the finished (task, entry) pairs."""
    parts = sections(cfg, done)
    seeds = [listed(e) for _, e in parts.get("seeds", [])]
    converged = [listed(e) for _, e in parts.get("converged", [])]  # none when the converged case is off
    controls = {t.name: e for t, e in parts["controls"]}
    phases: dict[str, float] = {"backbone": 0.0, "workspace": 0.0, "controller": 0.0, "evaluate": 0.0,
                                "controls": 0.0}
    for t, e in done:
        for k, v in e["wall_s"].items():
            phases[t.phase(k)] += v
    n = len(seeds)
    ws_ok = sum(e["success"]["workspace"] for e in seeds)
    ctrl_ok = sum(e["success"]["controller"] for e in seeds)
    conv_ok = sum(e["success"]["workspace"] for e in converged)
    conv_ctrl_ok = sum(e["success"]["controller"] for e in converged)
    mc = recipe.model
    doc = {
        "task": dataclasses.asdict(recipe.mqar),
        "model": mc.to_dict(),
        "recipe": {"backbone": recipe.backbone.to_dict(), "workspace": recipe.workspace.to_dict(),
                   "controller": recipe.controller.to_dict(), "converged_backbone_steps": cfg.converged_backbone_steps},
        "study": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("config_dir",)},
        "controls": controls,
        "seeds": seeds,
        "converged": None if not converged else {
            "bank_source": mc.bank_source, "query_source": mc.query_source, "bank_shift": mc.bank_shift,
            "backbone_steps": converged[0]["backbone_steps"], "success_rate": conv_ok / n,
            "controller_success_rate": conv_ctrl_ok / n, "seeds": converged},
        "summary": {"workspace_success": f"{ws_ok}/{n}", "controller_success": f"{ctrl_ok}/{n}",
                    **({"converged_success": f"{conv_ok}/{n}", "converged_controller_success": f"{conv_ctrl_ok}/{n}"}
                       if converged else {}),
                    "negative_control_ok": controls["one_layer"]["accuracy"] <= 0.30,
                    "positive_control_ok": controls["two_layer"]["accuracy"] >= TARGET_ACCURACY},
        "wall_s": {"total": total_s, **phases, "jobs": jobs,
                   "note": "phases sum the time of every run in that phase over all workers"},
    }
    return doc


def format_table(doc: dict[str, Any]) -> str:
    """The study's table for humans (the frontier's and its confirmation, for a `--frontier` study; the confirmation
    alone for a recorded study's, `--confirm-of`)."""
    from prisme.studies.recall_verdict import format_confirmation

    if "confirmation_of" in doc:
        return format_confirmation(doc["confirmation"])
    c = doc["controls"]
    lines = [f"MQAR N={doc['task']['n_pairs']} V={doc['task']['vocab_size']} T={doc['task']['seq_len']} "
             f"(filler after each query); bank {doc['model']['bank_source']!r}, shift {doc['model']['bank_shift']}, "
             f"query {doc['model']['query_source']!r}, controller source {doc['model']['controller_source']!r}",
             f"controls (backbone alone, {c['one_layer']['steps']} steps, seed {c['one_layer']['seed']}): "
             f"1 layer {c['one_layer']['accuracy']:.4f}, 2 layers {c['two_layer']['accuracy']:.4f}", ""]
    if "frontier" in doc:
        from prisme.studies.recall_frontier import format_frontier

        s = doc["summary"]
        if "contexts" in doc:
            from prisme.studies.recall_context import format_contexts

            table = format_contexts(doc)
        else:
            table = format_frontier(doc)
        return "\n".join(lines + [table, "", format_confirmation(doc.get("confirmation")), "",
                                  f"negative control <= 30%: {'yes' if s['negative_control_ok'] else 'NO'}; positive "
                                  f"control >= 95%: {'yes' if s['positive_control_ok'] else 'NO'}; wall "
                                  f"{doc['wall_s']['total']:.0f} s ({doc['wall_s']['jobs']} workers)"])
    head = (f"{'run':<14}{'budget1':>9}{'xattn':>7}{'gate q/o':>12}{'|d|/|H|':>9}{'lambda':>8}{'ctrl acc':>9}"
            f"{'edits':>7}{'on q':>6}{'ops':>7}{'fix95 ops':>10}  ok")
    lines += [head, "-" * len(head)]
    for label, entries in (("seed", doc["seeds"]), ("converged", (doc["converged"] or {}).get("seeds", []))):
        for e in entries:
            k = e["controller"]
            cheapest = min((r["ops_ratio"] for r in e["fixed"] if ROW_KINDS[r["family"]].workspace
                            and r["accuracy"] >= TARGET_ACCURACY), default=float("nan"))
            ok = ("W" if e["success"]["workspace"] else "-") + ("C" if e["success"]["controller"] else "-")
            lines.append(f"{label + ' ' + str(e['seed']):<14}{e['budget1_accuracy']:>9.4f}"
                         f"{e['xattn_correct_value']:>7.3f}{e['gate_query']:>6.2f}/{e['gate_other']:<5.2f}"
                         f"{e['delta_over_H']:>9.3f}{k['lambda']:>8.3g}{k['accuracy']:>9.4f}"
                         f"{k['edits_per_token']:>7.3f}{k['query_edit_share']:>6.2f}{k['ops_ratio']:>7.3f}"
                         f"{cheapest:>10.3f}  {ok}")
    s = doc["summary"]
    conv = (f"converged backbone ({doc['converged']['backbone_steps']} stage-1 steps): {s['converged_success']} "
            f"(controller {s['converged_controller_success']})" if doc["converged"] else
            "the converged case was not run (`prisme study recall` runs it)")
    lines += ["", f"workspace at budget 1 >= 95%: {s['workspace_success']} seeds; controller bars: "
              f"{s['controller_success']}; {conv}",
              f"negative control <= 30%: {'yes' if s['negative_control_ok'] else 'NO'}; positive control >= 95%: "
              f"{'yes' if s['positive_control_ok'] else 'NO'}; wall {doc['wall_s']['total']:.0f} s "
              f"({doc['wall_s']['jobs']} workers)",
              "ok: W = budget-1 accuracy >= 95%; C = controller >= 95% at <= 0.3 edits/token, >= 80% of edits on "
              "queries, fewer ops than the cheapest fixed row reaching 95%, no fixed row cheaper and better"]
    return "\n".join(lines)


def finish_log_plot(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str, legend_loc: str) -> None:
    """Label an accuracy-vs-ops figure (log x, grid, small legend) and write it as a PNG to `path`."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc=legend_loc)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)


def plot_accuracy_vs_ops(doc: dict[str, Any], path: Path) -> None:
    """Accuracy against ops per token (x the backbone): fixed/random/dense rows, the controller across lambda
    (its chosen lambda ringed), the oracle, per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=120)
    seen = set()
    for e in doc["seeds"]:
        for r in e["fixed"]:
            m, col = ROW_KINDS[r["family"]].marker, ROW_KINDS[r["family"]].color
            ax.scatter(r["ops_ratio"], r["accuracy"], marker=m, color=col, s=30, alpha=0.7,
                       label=r["family"] if r["family"] not in seen else None)
            seen.add(r["family"])
        cs = sorted(e["controllers"], key=lambda r: r["ops_ratio"])
        ax.plot([r["ops_ratio"] for r in cs], [r["accuracy"] for r in cs], "-*", color="C5", ms=6, alpha=0.7,
                label="controller (lambda grid)" if "ctrl" not in seen else None)
        seen.add("ctrl")
        k = e["controller"]
        ax.scatter(k["ops_ratio"], k["accuracy"], s=140, facecolors="none", edgecolors="k",
                   label="controller, calibrated lambda" if "chosen" not in seen else None)
        seen.add("chosen")
        o = e["oracle"]
        ax.scatter(o["ops_ratio"], o["accuracy"], marker="P", facecolors="none", edgecolors="C6", s=60,
                   label="oracle (not deployable)" if "oracle" not in seen else None)
        seen.add("oracle")
    ax.axhline(TARGET_ACCURACY, color="gray", ls=":", lw=1)
    ax.axhline(doc["controls"]["two_layer"]["accuracy"], color="C1", ls="--", lw=1, label="2-layer backbone")
    finish_log_plot(fig, ax, path, "ops per token / backbone only (actual traces, all positions)",
                    "accuracy on query positions", "MQAR: 1-layer backbone + workspace, every seed", "lower right")


def plot_frontier(doc: dict[str, Any], path: Path, training: bool = False) -> None:
    """Accuracy against ops per token (x the reference backbone) of every dense and PRISME configuration, one point
    per seed at the configuration's mean ops, the per-seed mean joined within each family. With `training`, against
    training compute instead: each seed at its run's analytic training ops (every stage, warm-ups included); entries
    without them (a document made before they were recorded) are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = doc["frontier"]

    def xs(e: dict[str, Any]) -> list[float] | None:  # the x of each seed
        per_seed = e.get("training_ops_per_seed") if training else [e["ops_ratio"]] * len(e["accuracy"])
        return None if not per_seed or None in per_seed else per_seed

    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=120)
    shown = 0
    for kind, entries, col in (("dense", f["dense"], "C0"), ("prisme", f["prisme"], "C3")):
        entries = [e for e in entries if xs(e)]
        shown += len(entries)
        for L in sorted({e["n_layer"] for e in entries}):
            es = sorted((e for e in entries if e["n_layer"] == L), key=lambda e: sum(xs(e)))
            label = f"{kind}, {L} layer{'s' if L > 1 else ''}" if kind == "dense" else "PRISME + router (1 layer)"
            marker = {1: "s", 2: "o"}.get(L, "^") if kind == "dense" else "*"
            ax.plot([sum(xs(e)) / len(xs(e)) for e in es], [sum(e["accuracy"]) / len(e["accuracy"]) for e in es],
                    "-", color=col, alpha=0.4 if L == 1 and kind == "dense" else 0.8)
            for i, e in enumerate(es):
                ax.scatter(xs(e), e["accuracy"], marker=marker, color=col, s=28, alpha=0.7,
                           label=label if i == 0 else None)
                tag = f"d{e['d_model']}" + (f"/w{e['w']}" if e["w"] else "")
                ax.annotate(tag, (sum(xs(e)) / len(xs(e)), max(e["accuracy"])), fontsize=6, xytext=(2, 3),
                            textcoords="offset points")
    if not shown:  # a document made before training compute was recorded (or an empty frontier)
        ax.text(0.5, 0.5, "no training compute recorded" if training else "no entry", ha="center",
                transform=ax.transAxes)
    ax.axhline(TARGET_ACCURACY, color="gray", ls=":", lw=1, label=None if shown else "95%")
    if training:
        xlabel, title = ("training ops per run (analytic, every stage: forward x3 trained, x2 gradient through, x1 "
                         "frozen)"), "MQAR: accuracy against training compute, dense frontier and PRISME"
    else:
        xlabel = f"ops per token / 1-layer d=64 backbone ({f['reference']['ops_per_token']:,.0f})"
        title = "MQAR: the dense frontier and PRISME with its router"
    finish_log_plot(fig, ax, path, xlabel, "accuracy on query positions (each seed)", title, "center right")


@torch.no_grad()
def plot_edits(checkpoint: str, mcfg: MQARConfig, seed: int, lam: float, path: Path) -> None:
    """One held-out sequence under the calibrated controller: positions x steps, coloured by action, queries marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    model, _ = load_model(checkpoint)
    cfg = model.cfg
    x, y = make_mqar_batch(mcfg, 1, torch.Generator().manual_seed(EVAL_SEED + seed))
    out = model.forward_policy(x, cfg.r_max, lambda_cost=lam)
    acts = out.actions[0].T.numpy().astype(float)  # [R, T]
    acts[acts == cfg.stop_action] = np.nan
    T = x.shape[1]
    fig, ax = plt.subplots(figsize=(9, 2.8), dpi=120)
    im = ax.imshow(acts, aspect="auto", cmap="tab10", vmin=0, vmax=max(9, cfg.n_actions - 1), interpolation="nearest")
    q = (y[0] != IGNORE_INDEX).nonzero().flatten().tolist()
    for t in q:
        ax.axvline(t, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(T))
    ax.set_xticklabels([str(v) for v in x[0].tolist()], fontsize=6, rotation=90)
    ax.set_yticks(range(cfg.r_max))
    ax.set_ylabel("step")
    ax.set_xlabel("position (token id); dashed = query; blank = STOP")
    ax.set_title(f"controller edits, lambda={lam:g}: {int(out.n_edits.sum())} edits, "
                 f"{int(out.n_edits[0, q].sum())} on the {len(q)} queries")
    fig.colorbar(im, ax=ax, label="action id (0..M-1 slot, M.. pair)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)


def emit_study(doc: dict[str, Any], table: Any, json_path: str | None) -> int:
    """A study's report: `table(doc)`, then its JSON document as the last thing on stdout (also written atomically to
    `json_path` when given). Returns 0."""
    print(table(doc))
    text = json.dumps(doc, indent=2, allow_nan=False)
    if json_path:
        write_text_atomic(Path(json_path), text + "\n")
    print(text)
    return 0
