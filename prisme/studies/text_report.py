"""The text study's report: every row over the training seeds (`seed_summary`), the verdicts that follow from the
per-seed intervals, the loss by slice and each PRISME row's capture of the far-copy gain (`capture_summary`), and the
text for humans."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from prisme.evaluation.policies import ROW_KINDS
from prisme.evaluation.slices import Capture, beyond_window_names, capture, merge_slices
from prisme.studies.text_setup import EXACT_COPY, NO_COPY

DIFFS = ("delta_vs_backbone", "delta_vs_matched", "frontier_gap", "delta_vs_equal_edits", "delta_vs_reference")


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


def closest_row(summary: list[dict[str, Any]], source: str, split: str) -> dict[str, Any] | None:
    """The summary entry of `source`'s workspace row closest to beating the dense frontier on `split`: below it on
    the most seeds, then with the lowest worst upper end of its gap interval (None: no row has a gap). Its verdict is
    whether it is below on every seed."""
    gapped = [e for e in summary if e["source"] == source and e["split"] == split and _workspace_row(e)
              and "frontier_gap" in e]
    return min(gapped, key=lambda e: (-e["frontier_gap_below"], max(d["hi"] for d in e["frontier_gap"])),
               default=None)


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
            best = closest_row(summary, src, split)
            if best is not None:
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
            ref = [e for e in ws if "delta_vs_reference" in e]
            if ref:  # against the untrained exact copy (a copy-head study's reference row)
                best = min(ref, key=lambda e: (-e["delta_vs_reference_below"],
                                               max(d["hi"] for d in e["delta_vs_reference"])))
                name = best["delta_vs_reference"][0].get("reference", "the reference")
                lines.append(f"{split}, {src} bank: best row against {name}, {best['policy']}: below on "
                             f"{_count(best, 'delta_vs_reference')} seeds "
                             f"({'; '.join(map(_ci, best['delta_vs_reference']))})")
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
    if doc.get("so_far"):  # a study still running or stopped (`document_so_far`): said first
        s = doc["so_far"]
        parts.append(f"so far: seeds {', '.join(map(str, s['seeds']))} of the study's "
                     f"{', '.join(map(str, s['study_seeds']))} have finished ({s['tasks_finished']} of {s['tasks']} "
                     f"tasks); the verdicts below count those seeds only"
                     + ("; the confirmation pass is reported when the study ends" if s["confirm_seeds"] else ""))
    parts += [h for h in (corpus_header(doc),) if h]
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
    for table in (slice_table(doc), capture_table(doc)):
        if table:
            parts.append(table)
    if doc.get("training_compute"):  # (a document written before it has none)
        from prisme.studies.text_compute import format_compute

        parts.append(format_compute(doc["training_compute"]))
    parts.append("\n".join(doc["verdicts"]))
    if doc.get("confirmation"):
        parts.append(confirmation_text(doc["confirmation"]))
    return "\n\n".join(parts)


def _uppers(s: dict[str, Any]) -> str:
    return f"below on {s['below']}/{len(s['seeds'])}, upper ends " + " ".join(f"{u:+.4f}" for u in s["upper"])


def confirmation_text(block: dict[str, Any]) -> str:
    """The confirmation pass (`text_confirm.confirmation_block`) for humans: per deciding row the dense models it is
    compared with, its gap's upper ends per seed on both sets, and the restated verdict with its worst seed."""
    seeds = lambda xs: ", ".join(map(str, xs))  # noqa: E731
    lines = [f"== confirmation on fresh seeds {seeds(block['seeds'])} (the study's: {seeds(block['study_seeds'])}): "
             f"the row closest to the dense frontier, per source and split, trained and scored again =="]
    for r in block["rows"]:
        ops = sum(r["study"]["relative_ops"]) / len(r["study"]["seeds"])
        lines += [f"{r['split']}, {r['source']} bank: {r['policy']} ({ops:.2f}x ops) against "
                  f"{', '.join(r['compared_with']) or '-'}",
                  f"  study seeds: {_uppers(r['study'])}",
                  f"  fresh seeds: {_uppers(r['fresh']) if r['fresh'] else 'not scored'}"]
        m = r["margin"]
        worst = "" if m is None else f"; worst seed {m['seed']} ({m['set']}), upper end {m['upper']:+.4f}"
        lines.append(f"  -> {r['status']}{worst}")
    return "\n".join(lines)


def _describe(c: dict[str, Any]) -> str:
    size = f", {c['bytes']:,} bytes, sha256 {c['sha256'][:12]}" if "bytes" in c else ""
    return f"{c['name']} ({c['kind']}, {c['licence']}, split {c['split']}{size})"


def corpus_header(doc: dict[str, Any]) -> str | None:
    """The texts the study read (`text_data.corpus_records`) and each run's training bytes per seed (None for a
    document that records neither)."""
    lines = []
    if doc.get("corpus"):
        lines += [f"corpus: {_describe(doc['corpus']['train'])}", f"held-out: {_describe(doc['corpus']['held_out'])}"]
    nbytes = doc.get("training_bytes")
    if nbytes:
        model = doc.get("model") or {}
        frontier = sorted({v for k, v in nbytes.items() if k.startswith("frontier:")})
        third = (doc.get("stages") or {}).get("controller", {}).get("stage", "controller")  # at --context: router
        named = [f"{third if k == 'controller' else k} {nbytes[k]:,}" for k in ("backbone", "workspace", "controller",
                                                                               "matched") if k in nbytes]
        lines.append(f"training bytes per seed: {', '.join(named)}; each dense frontier model "
                     f"{' / '.join(f'{v:,}' for v in frontier) or '-'} (PRISME: {model.get('n_layer', '?')}-layer "
                     f"backbone, attention window {model.get('attn_window') or 'global'})")
    return "\n".join(lines) or None


def _by_slice(e: dict[str, Any], names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The slices `names` of a summary entry as one, per seed (`merge_slices`)."""
    return [merge_slices(sl, names) for sl in e["slices"]]


def _mean_loss(per_seed: list[dict[str, Any]]) -> float | None:
    """A merged slice's loss, mean over the seeds (None where a seed's slice holds no target)."""
    losses = [m["loss"] for m in per_seed]
    return None if any(v is None for v in losses) else sum(losses) / len(losses)


def slice_table(doc: dict[str, Any]) -> str | None:
    """Where the gains are (a study whose slices split AR hits by a window, `--context`): per source, split and row,
    the loss on AR hits within PRISME's window, in each distance bucket beyond it (slices with bucket edges), on all
    AR hits beyond it, on the seen misses (the n-gram occurred, followed by another token: where a copy is wrong)
    and on the other positions, mean over the seeds, with each slice's share of the targets (None when the rows
    carry no window slices)."""
    summary = doc.get("summary") or seed_summary(doc)
    rows = [e for e in summary if e.get("slices") and beyond_window_names(list(e["slices"][0]))]
    if not rows:
        return None
    names = list(rows[0]["slices"][0])
    beyond = beyond_window_names(names)
    groups = [("AR hit in window", ("ar_hit_in_window",))]
    if len(beyond) > 1:  # distance buckets: each, then all of them
        groups += [(k.removeprefix("ar_hit_").replace("_", "-").replace("beyond-", "> "), (k,)) for k in beyond]
    groups += [("AR hit beyond", beyond), ("seen miss", ("seen_miss",)), ("other", ("other",))]
    shares = [sum(m["share_of_targets"] for m in _by_slice(rows[0], g)) / len(rows[0]["slices"]) for _, g in groups]
    head = f"{'source':<10}{'split':<9}{'policy':<28}{'ops':>6}  " + "".join(f"{t:>17}" for t, _ in groups)
    lines = [f"== loss by slice (nats/byte, mean over the seeds; the first split's shares of targets: "
             f"{' / '.join(f'{v:.1%}' for v in shares)}) ==", head, "-" * len(head)]
    for e in rows:
        if ROW_KINDS[e["family"]].baseline:
            continue
        n = len(e["relative_ops"])
        cells = [_mean_loss(_by_slice(e, g)) for _, g in groups]
        lines.append(f"{e['source']:<10}{e['split']:<9}{e['policy']:<28}{sum(e['relative_ops']) / n:>6.2f}  "
                     + "".join(f"{'-' if v is None else f'{v:.4f}':>17}" for v in cells))
    return "\n".join(lines)


_FRONTIER_NAME = re.compile(r"L(\d+)_d(\d+)(?:_w(\d+))?(_ks)?")


def capture_summary(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each PRISME row's capture (`evaluation.slices.capture`) per seed, per source and split: the loss it removes on
    the AR hits beyond PRISME's window relative to its own backbone ("backbone"), as a share of what the global-
    attention frontier model of PRISME's depth removes there relative to its window twin (the same entry with
    PRISME's window). Of several such models (with and without the key shift) the one with the lowest loss on that
    slice, mean over the seeds, is the reference. Empty without window slices, a model with a window, or such a pair
    in the frontier."""
    summary = doc.get("summary") or seed_summary(doc)
    model = doc.get("model") or {}
    W, depth = model.get("attn_window"), model.get("n_layer")
    out = []
    for src, split in dict.fromkeys((e["source"], e["split"]) for e in summary):
        here = {e["policy"]: e for e in summary if e["source"] == src and e["split"] == split and e.get("slices")}
        beyond = beyond_window_names(list(next(iter(here.values()))["slices"][0])) if here else ()
        if not beyond or W is None or "backbone" not in here:
            continue
        loss = {p: [m["loss"] for m in _by_slice(e, beyond)] for p, e in here.items()}
        pairs = []  # (global model, its window twin) of PRISME's depth, both scored with slices
        for p, e in here.items():
            m = _FRONTIER_NAME.fullmatch(p)
            if _frontier_model(e) and m and m.group(3) is None and int(m.group(1)) == depth:
                twin = f"L{m.group(1)}_d{m.group(2)}_w{W}{m.group(4) or ''}"
                if twin in here and None not in loss[p] + loss[twin]:
                    pairs.append((p, twin))
        base = NO_COPY if NO_COPY in here else "backbone"  # the local backbone without a far read
        if not pairs or None in loss[base]:
            continue
        best, twin = min(pairs, key=lambda pt: sum(loss[pt[0]]))
        for p, e in here.items():
            kind = ROW_KINDS[e["family"]]
            if (kind.workspace and not kind.baseline or p in ("backbone", EXACT_COPY) and base != "backbone") \
                    and None not in loss[p]:
                caps = [capture(r, b, g, w) for r, b, g, w in zip(loss[p], loss[base], loss[best], loss[twin])]
                out.append({"source": src, "split": split, "policy": p, "deployable": e["deployable"],
                            "relative_ops": e["relative_ops"], "global": best, "window_twin": twin,
                            "capture": [dataclasses.asdict(c) for c in caps]})
    return out


def capture_table(doc: dict[str, Any]) -> str | None:
    """`capture_summary` for humans: per row the loss removed beyond the window and the capture, per seed, under a
    line per source and split naming the global model and what it removes (None when there is nothing to show)."""
    caps = capture_summary(doc)
    if not caps:
        return None
    W = doc["model"]["attn_window"]
    lines = [f"== capture beyond the {W}-position window (per seed: the loss a row removes on AR hits beyond it, "
             f"relative to its backbone, as a share of what global attention removes there, relative to its window "
             f"twin; nats/byte) =="]
    head = f"{'source':<10}{'split':<9}{'policy':<28}{'ops':>6}  {'removed, per seed':<30}capture, per seed"
    last = None
    for c in caps:
        if (c["source"], c["split"]) != last:
            last = (c["source"], c["split"])
            removed = " ".join(f"{d['global_removed']:+.4f}" for d in c["capture"])
            lines += ["", f"{c['source']}, {c['split']}: {c['global']} removes {removed} relative to "
                          f"{c['window_twin']}", head, "-" * len(head)]
        n = len(c["relative_ops"])
        removed = " ".join(f"{d['removed']:+.4f}" for d in c["capture"])
        shares = " ".join(Capture(**d).fmt() for d in c["capture"])
        lines.append(f"{c['source']:<10}{c['split']:<9}{c['policy']:<28}{sum(c['relative_ops']) / n:>6.2f}  "
                     f"{removed:<30}{shares}")
    return "\n".join(lines)
