"""`prisme costs`: seed 000's cost table for a preset (and the optimised column beside it), as a human table or as
one JSON document in seed 000's layout."""

from __future__ import annotations

import argparse
import json
from typing import Any

from prisme.config import PrismeConfig
from prisme.costs.analytic import cost_document
from prisme.options import ExecutionOptions


# ---------------------------------------------------------------------- CLI
def format_table(doc: dict[str, Any]) -> str:
    """Human table of `cost_document`: components x the five rows, in ops; with the optimised column, each row shows
    the seed and optimised ops side by side (millions, or thousands for small presets) and the saving."""
    rows, opt = doc["rows"], doc.get("optimised_rows")
    names = list(rows)
    keys = (*(c for c in rows[names[0]] if c not in ("backbone", "workspace", "total")), "backbone", "workspace",
            "total")
    base = rows[names[0]]["total"]
    title = f"{doc['config']}  T={doc['T']}  ops per generated token"
    if opt is None:
        width = max(13, *(len(n) + 2 for n in names))
        lines = [f"{title} (1 multiply-add = 2 ops)", f"{'component':<20}" + "".join(f"{n:>{width}}" for n in names)]
        lines += [f"{c:<20}" + "".join(f"{rows[n][c]:>{width},}" for n in names) for c in keys]
        lines.append(f"{'x backbone_only':<20}" + "".join(f"{rows[n]['total'] / base:>{width}.3f}" for n in names))
    else:  # two cells of 9 per row: seed | optimised
        unit, scale = ("millions", 1e6) if base >= 1e7 else ("thousands", 1e3)
        lines = [f"{title}, {unit}; seed = seed 000's accounting, opt = the optimised modules",
                 f"{'':<20}" + "".join(f"  {n:^18}" for n in names),
                 f"{'component':<20}" + "".join(f"  {'seed':>9}{'opt':>9}" for n in names)]
        lines += [f"{c:<20}" + "".join(f"  {rows[n][c] / scale:>9.3f}{opt[n][c] / scale:>9.3f}" for n in names)
                  for c in keys]
        lines.append(f"{'x backbone_only':<20}" + "".join(
            f"  {rows[n]['total'] / base:>9.3f}{opt[n]['total'] / base:>9.3f}" for n in names))
        cells = [f"{(rows[n]['total'] - opt[n]['total']) / scale:.3f} ({1 - opt[n]['total'] / rows[n]['total']:.1%})"
                 for n in names]
        lines.append(f"{'saving':<20}" + "".join(f"  {c:>18}" for c in cells))
    p = doc["action_cost_proxy"]
    line = f"action_cost_proxy (seed): single slot {p[0]:.6f}, pair {p[-1]:.6f}"
    if opt is not None:
        q = doc["optimised_action_cost_proxy"]
        line += f"  |  optimised: single slot {q[0]:.6f}, pair {q[-1]:.6f}"
    lines.append(line)
    return "\n".join(lines)


def costs_cli(args: argparse.Namespace) -> int:
    """`prisme costs --preset NAME [--context T] [--json] [--optimised [--slot-kv-cache]]`."""
    if args.slot_kv_cache and not args.optimised:
        raise ValueError("--slot-kv-cache prices the optimised column's editor: pass --optimised too")
    cfg = PrismeConfig.from_name(args.preset)
    T = cfg.cost_context if args.context is None else args.context
    doc = cost_document(cfg, T, optimised=ExecutionOptions(slot_kv_cache=args.slot_kv_cache).column(args.optimised))
    print(json.dumps(doc, indent=2) if args.json else format_table(doc))
    return 0
