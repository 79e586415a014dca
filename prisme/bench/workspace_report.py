"""`prisme bench workspace`'s verdicts and table: the share-ratio target, optimised vs seed as a paired
time ratio with its interval, and the human report."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from prisme.bench.workspace_paths import COMPILED, ROWS
from prisme.stats import paired_bootstrap

TARGET_SHARE_RATIO = 1.15  # workspace time share <= 1.15 x its analytic ops share, at batch 8
OPTIMISED_SLOWDOWN_MAX = 0.03  # an optimised model's decode step may be at most 3% slower than the seed model's ...
OPTIMISED_TIME_SHARE_MIN = 0.5  # ... and must save at least half of its op saving in time (batch 8)


def target_summary(results: list[dict[str, Any]], batch: int = 8) -> dict[str, Any]:
    """share_ratio of every workspace row x model at `batch`, per preset, and whether it is <= 1.15."""
    out = {}
    for pr in results:
        for bt in pr["batches"]:
            if bt["batch"] != batch:
                continue
            rows = {f"{r['variant']}/{r['row']}": r["share_ratio"] for r in bt["rows"] if r["share_ratio"] is not None}
            out[pr["preset"]] = {"share_ratio": rows, "met": all(v <= TARGET_SHARE_RATIO for v in rows.values()),
                                 "optimised_vs_seed": optimised_vs_seed(bt["rows"])}
    return out


def time_ratio(a: Sequence[float], b: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """Geometric-mean time ratio a / b of paired samples (sample i of both paths comes from the same rotation of
    `time_paths`, so slow spells of the machine cancel) with its 95% bootstrap interval: (ratio, lo, hi)."""
    la, lb = torch.tensor(a, dtype=torch.float64).log(), torch.tensor(b, dtype=torch.float64).log()
    d = paired_bootstrap(la, lb, torch.ones_like(la), seed=seed)
    return math.exp(d.mean), math.exp(d.lo), math.exp(d.hi)


def optimised_vs_seed(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per workspace row, each optimised model ("opt", "opt_kv") against the seed model on the whole decode step:
    the paired time ratio with its 95% interval (`time_ratio`), the fraction of ops the model saves, and verdicts
    that follow from the interval: `not_slower` when its upper end is <= 1.03 (OPTIMISED_SLOWDOWN_MAX), `pays` when
    even that end saves at least half of the op saving (OPTIMISED_TIME_SHARE_MIN); `met` when both hold."""
    by = {(r["row"], r["variant"]): r for r in rows}
    out: dict[str, Any] = {}
    for variant in ("opt", "opt_kv"):
        per_row = {}
        for row in ROWS[1:]:
            o, s = by.get((row, variant)), by.get((row, "seed"))
            if not (o and s):
                continue
            ratio, lo, hi = time_ratio(o["samples_ms"], s["samples_ms"])
            ops_saving = 1 - o["analytic_ops_per_token"] / s["analytic_ops_per_token"]
            not_slower = hi <= 1 + OPTIMISED_SLOWDOWN_MAX
            pays = 1 - hi >= OPTIMISED_TIME_SHARE_MIN * ops_saving
            per_row[row] = {"time_ratio": ratio, "time_ratio_lo": lo, "time_ratio_hi": hi,
                            "time_saving": 1 - ratio, "ops_saving": ops_saving, "not_slower": not_slower,
                            "pays": pays, "met": not_slower and pays}
        if per_row:
            out[variant] = {"rows": per_row, "met": all(v["met"] for v in per_row.values())}
    return out


def _savings(by: dict[tuple[str, str], dict[str, Any]], base: str, variant: str) -> list[str]:
    """Per workspace row, what `variant` saves over `base` in workspace time (ms and share) and in ops."""
    out = []
    for row in ROWS[1:]:
        b, v = by.get((row, base)), by.get((row, variant))
        if b and v:
            ops_saving = 1 - v["analytic_workspace_ops_per_token"] / b["analytic_workspace_ops_per_token"]
            out.append(f"{row} {b['workspace_ms'] - v['workspace_ms']:+.3f} ms "
                       f"({1 - v['workspace_ms'] / b['workspace_ms']:.1%}; ops {ops_saving:.1%})")
    return out


def format_workspace_table(doc: dict[str, Any]) -> str:
    """The human-readable report: checks, one table per preset x batch, the target, the optimised saving, profile."""
    env = doc["environment"]
    lines = [f"prisme bench workspace: {env['dtype']}, {env['device']}, {env['cpu']}, torch {env['torch']}, "
             f"{doc['protocol']['prompt_tokens']} prompt + {doc['protocol']['decoded_tokens']} decoded tokens, "
             f"p50 over {doc['protocol']['repeats']} repeats", ""]
    for name, c in doc["checks"]["by_preset"].items():
        lines.append(f"checks {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in c.items()))
    lines.append("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in doc["checks"].items()
                                        if k not in ("passed", "by_preset")))
    for pr in doc["presets"]:
        m = pr["model"]
        params = sum(m["parameters"].values())
        for bt in pr["batches"]:
            B = bt["batch"]
            lines += ["", f"{pr['preset']} ({params:,} parameters), {pr['threads']} thread(s), batch {B}"
                      + ("" if B == 1 else ": row b takes ceil((b+1) n / B) actions")]
            lines.append(f"  {'row':<18}{'model':>9}{'ms/step':>9}{'[p95]':>8}{'us/tok':>9}{'x bb':>7}"
                         f"{'ops x (seed/opt)':>17}{'bb ms':>8}{'ws ms':>8}{'mod ms':>8}{'ws us/tok':>10}{'ws/bb t':>8}"
                         f"{'ws/bb ops':>10}{'t/ops':>7}{'ws GF/s':>8}{'bb GF/s':>8}{'matmul/an':>10}")
            for r in bt["rows"]:
                has = r["share_ratio"] is not None
                mm = (r["measured_workspace_matmul_ops_per_token"] / r["analytic_workspace_ops_first_step"]
                      if has and r["analytic_workspace_ops_first_step"] else float("nan"))
                lines.append(
                    f"  {r['row']:<18}{r['variant']:>9}{r['step_ms_p50']:>9.3f}{r['step_ms_p95']:>8.3f}"
                    f"{r['token_us_p50']:>9.1f}{r['ratio_to_backbone_only']:>7.3f}"
                    f"{r['analytic_ratio_seed']:>9.3f}/{r['analytic_ratio_optimised']:<7.3f}"
                    f"{r['backbone_ms']:>8.3f}{r['workspace_ms']:>8.3f}{r['workspace_modules_ms']:>8.3f}"
                    f"{r['workspace_token_us']:>10.1f}"
                    f"{r['workspace_time_share']:>8.3f}{r['workspace_ops_share']:>10.3f}"
                    + (f"{r['share_ratio']:>7.2f}{r['workspace_gflops']:>8.2f}" if has else f"{'-':>7}{'-':>8}")
                    + f"{r['backbone_gflops']:>8.2f}" + (f"{mm:>10.3f}" if has else f"{'-':>10}"))
            if B > 1:
                lines.append("  actions per row: " + "; ".join(
                    f"{r['row']} {r['actions_per_row']}" for r in bt["rows"] if r["variant"] == "opt"))
            by = {(r["row"], r["variant"]): r for r in bt["rows"]}
            lines.append("  optimised saving in workspace time (seed - opt): " + ", ".join(_savings(by, "seed", "opt")))
            cache = _savings(by, "opt", "opt_kv")
            if cache:
                lines.append("  slot K/V cache saving in workspace time (opt - opt_kv): " + ", ".join(cache))
            speed = [f"{row} {by[(row, 'seed')]['workspace_ms'] / by[(row, COMPILED)]['workspace_ms']:.2f}x"
                     for row in ROWS[1:] if (row, COMPILED) in by and (row, "seed") in by]
            if speed:
                lines.append("  compiled editor, workspace time seed / compiled: " + ", ".join(speed))
    lines += ["", "columns: ms/step = one decode step of B tokens (p50 [p95]); x bb = / backbone_only;",
              "  ops x = analytic total / backbone of the same traces (seed / optimised column);",
              "  bb ms = backbone step + LM head inside the row's steps; ws ms = total - bb (what the workspace adds);",
              "  mod ms = the part of ws ms inside the model's workspace methods (the rest: decode_step's checks and "
              "bookkeeping);",
              "  ws/bb t = ws ms / bb ms pooled over the batch's rows; t/ops = (ws/bb t) / (ws/bb ops), target <= "
              f"{TARGET_SHARE_RATIO} at batch 8;",
              "  GF/s = analytic ops per second; matmul/an = matmul ops counted on the first step / analytic"]
    for preset, t in doc["target"].items():
        lines.append(f"target at batch 8, {preset}: {'met' if t['met'] else 'NOT met'} ("
                     + ", ".join(f"{k} {v:.2f}" for k, v in t["share_ratio"].items()) + ")")
        for variant, o in t.get("optimised_vs_seed", {}).items():
            verdict = "met" if o["met"] else "NOT met"
            lines.append(f"  {variant} vs seed at batch 8, time ratio [95% interval] (met: <= "
                         f"{1 + OPTIMISED_SLOWDOWN_MAX:g} and a saving >= {OPTIMISED_TIME_SHARE_MIN:.0%} of the op "
                         f"saving, both at the interval's upper end): {verdict}")
            for row, v in o["rows"].items():
                lines.append(f"    {row:<18} x{v['time_ratio']:.3f} [{v['time_ratio_lo']:.3f}, "
                             f"{v['time_ratio_hi']:.3f}] for ops -{v['ops_saving']:.1%}: "
                             f"{'not slower' if v['not_slower'] else 'slower or not shown'}, "
                             f"{'pays' if v['pays'] else 'does not pay (or not shown)'}")
    prof = doc.get("profile")
    if prof:
        lines += ["", f"profile: {prof['preset']}, batch {prof['batch']}, {prof['decode_steps']} decode steps under "
                      "torch.profiler; everything outside the backbone and head, per decode step (profiler overhead "
                      "included: read shares and calls)"]
        for name, p in prof["rows"].items():
            meth = ", ".join(f"{k} {v:.0f}" for k, v in p["workspace_methods_us_per_step"].items())
            lines.append(f"  {name}: {p['top_level_aten_calls_per_step']:.0f} ATen calls/step for "
                         f"{p['mean_actions_per_position']:.2f} actions/position; us/step by method: {meth}")
            for t in p["top"][:8]:
                lines.append(f"    {t['op']:<50}{t['calls_per_step']:>7.1f} calls {t['self_us_per_step']:>9.1f} us"
                             f"{t['us_per_call']:>8.1f} us/call {t['share']:>6.1%}")
    return "\n".join(lines)
