"""The text study's report: every row over the training seeds (`seed_summary`), the verdicts that follow from the
per-seed intervals, and the text for humans."""

from __future__ import annotations

from typing import Any

from prisme.evaluation.policies import ROW_KINDS

DIFFS = ("delta_vs_backbone", "delta_vs_matched", "frontier_gap", "delta_vs_equal_edits")


def _workspace_row(e: dict[str, Any]) -> bool:
    """A deployable row that runs the workspace itself (not a baseline of another row)."""
    kind = ROW_KINDS[e["family"]]
    return e["deployable"] and kind.workspace and not kind.baseline


def _frontier_model(e: dict[str, Any]) -> bool:
    """Another backbone alone scored on the same targets (neither this model's backbone nor the matched one)."""
    kind = ROW_KINDS[e["family"]]
    return kind.backbone_only and kind.own_reference is None


def _ci(d: dict[str, Any] | None) -> str:
    return "-" if not d else f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]"


def seed_summary(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per (source, split, row) present on every seed: its ops, loss and each paired difference per seed,
    and for each difference the number of seeds whose interval lies below 0 (`<diff>_below`) and above 0
    (`<diff>_above`). A claim about a row holds when its count is every seed."""
    seeds = list(doc["seeds"])
    first = doc["seeds"][seeds[0]]["sources"]
    out = []
    for src, by in first.items():
        for split in ("val", "held_out"):
            for row in by[split]["rows"]:
                per = [next((r for r in doc["seeds"][s]["sources"][src][split]["rows"]
                             if r["policy"] == row["policy"]), None) for s in seeds]
                if any(p is None for p in per):
                    continue
                e: dict[str, Any] = {"source": src, "split": split, "policy": row["policy"], "family": row["family"],
                                     "deployable": row["deployable"], "seeds": [int(s) for s in seeds],
                                     "relative_ops": [p["relative_ops"] for p in per], "loss": [p["loss"] for p in per]}
                if all(p.get("slices") for p in per):
                    e["slices"] = [p["slices"] for p in per]
                for key in DIFFS:
                    ds = [p.get(key) for p in per]
                    if all(ds):
                        e[key] = ds
                        e[f"{key}_below"] = sum(d["hi"] < 0 for d in ds)
                        e[f"{key}_above"] = sum(d["lo"] > 0 for d in ds)
                out.append(e)
    return out


def _count(e: dict[str, Any], key: str) -> str:
    return f"{e[f'{key}_below']}/{len(e['seeds'])}"


def verdicts(doc: dict[str, Any]) -> list[str]:
    """Sentences that follow from the per-seed intervals: each frontier model against the matched backbone; per
    source and split the workspace row closest to beating the dense frontier, the best against the matched backbone,
    and the controller against its equal-edits baseline; each says on how many seeds its interval lies below 0."""
    summary = doc.get("summary") or seed_summary(doc)
    n = len(doc["seeds"])
    lines = []
    first_src = next(iter(doc["seeds"][next(iter(doc["seeds"]))]["sources"]))
    for split in ("val", "held_out"):
        for e in summary:
            if e["source"] == first_src and e["split"] == split and _frontier_model(e) and "delta_vs_matched" in e:
                ops = sum(e["relative_ops"]) / n
                lines.append(f"{split}: {e['policy']} ({ops:.2f}x ops) beats the matched backbone on "
                             f"{_count(e, 'delta_vs_matched')} seeds ({'; '.join(map(_ci, e['delta_vs_matched']))})")
    for src in doc["seeds"][next(iter(doc["seeds"]))]["sources"]:
        for split in ("val", "held_out"):
            ws = [e for e in summary if e["source"] == src and e["split"] == split and _workspace_row(e)]
            gapped = [e for e in ws if "frontier_gap" in e]
            if gapped:
                best = min(gapped, key=lambda e: (-e["frontier_gap_below"], max(d["hi"] for d in e["frontier_gap"])))
                every = best["frontier_gap_below"] == n
                lines.append(f"{split}, {src} bank: the workspace's row closest to the dense frontier, "
                             f"{best['policy']} ({sum(best['relative_ops']) / n:.2f}x ops), is below it on "
                             f"{_count(best, 'frontier_gap')} seeds ({'; '.join(map(_ci, best['frontier_gap']))}) -> "
                             f"{'beats' if every else 'does not beat'} the dense frontier on every seed")
            matched = [e for e in ws if "delta_vs_matched" in e]
            if matched:
                best = min(matched, key=lambda e: (-e["delta_vs_matched_below"],
                                                   max(d["hi"] for d in e["delta_vs_matched"])))
                lines.append(f"{split}, {src} bank: best row against the matched backbone, {best['policy']}: below "
                             f"on {_count(best, 'delta_vs_matched')} seeds "
                             f"({'; '.join(map(_ci, best['delta_vs_matched']))})")
            for e in ws:
                if "delta_vs_equal_edits" in e:
                    lines.append(f"{split}, {src} bank: {e['policy']} minus its equal-edits baseline: below on "
                                 f"{_count(e, 'delta_vs_equal_edits')} seeds "
                                 f"({'; '.join(map(_ci, e['delta_vs_equal_edits']))})")
    return lines


def format_report(doc: dict[str, Any]) -> str:
    """The first seed's tables (every row, with its intervals), the rows over the seeds, and the verdicts."""
    seeds = list(doc["seeds"])
    parts = []
    for src, by in doc["seeds"][seeds[0]]["sources"].items():
        for split in ("val", "held_out"):
            parts.append(f"== seed {seeds[0]}, {src} bank, {split} ==\n{by[split]['table']}")
    head = f"{'source':<10}{'split':<9}{'policy':<28}{'ops':>6}  {'minus the dense frontier, per seed':<40}below 0"
    lines = [f"== over the training seeds {', '.join(seeds)} ==", head, "-" * len(head)]
    for e in doc.get("summary") or seed_summary(doc):
        if "frontier_gap" not in e or not e["deployable"]:
            continue
        gaps = " ".join(f"{d['mean']:+.4f}" for d in e["frontier_gap"])
        lines.append(f"{e['source']:<10}{e['split']:<9}{e['policy']:<28}{sum(e['relative_ops']) / len(seeds):>6.2f}"
                     f"  {gaps:<40}{_count(e, 'frontier_gap')}")
    parts.append("\n".join(lines))
    table = slice_table(doc)
    if table:
        parts.append(table)
    parts.append("\n".join(doc["verdicts"]))
    return "\n\n".join(parts)


def slice_table(doc: dict[str, Any]) -> str | None:
    """Where the gains are (a study whose slices split AR hits by a window, `--context`): per source, split and row,
    the loss on AR hits within PRISME's window, on AR hits beyond it, and on the rest (seen misses and others), mean
    over the seeds, with each slice's share of the targets (None when the rows carry no window slices)."""
    summary = doc.get("summary") or seed_summary(doc)
    rows = [e for e in summary if e.get("slices") and "ar_hit_beyond_window" in e["slices"][0]]
    if not rows:
        return None

    def mean_loss(e: dict[str, Any], names: tuple[str, ...]) -> str:
        per = []
        for sl in e["slices"]:  # one seed: the slices' losses weighted by their targets
            n = sum(sl[k]["share_of_targets"] for k in names)
            if n == 0:
                return "-"
            per.append(sum(sl[k]["share_of_targets"] * (sl[k]["loss"] or 0.0) for k in names) / n)
        return f"{sum(per) / len(per):.4f}"

    groups = (("ar_hit_in_window",), ("ar_hit_beyond_window",), ("seen_miss", "other"))
    shares = [sum(sum(sl[k]["share_of_targets"] for k in g) for sl in rows[0]["slices"]) / len(rows[0]["slices"])
              for g in groups]
    head = (f"{'source':<10}{'split':<9}{'policy':<28}{'ops':>6}  {'AR hit in window':>17}{'AR hit beyond':>15}"
            f"{'the rest':>10}")
    lines = [f"== loss by slice (nats/byte, mean over the seeds; the first split's shares of targets: "
             f"{shares[0]:.1%} / {shares[1]:.1%} / {shares[2]:.1%}) ==", head, "-" * len(head)]
    for e in rows:
        if ROW_KINDS[e["family"]].baseline:
            continue
        n = len(e["relative_ops"])
        lines.append(f"{e['source']:<10}{e['split']:<9}{e['policy']:<28}{sum(e['relative_ops']) / n:>6.2f}  "
                     f"{mean_loss(e, groups[0]):>17}{mean_loss(e, groups[1]):>15}{mean_loss(e, groups[2]):>10}")
    return "\n".join(lines)
