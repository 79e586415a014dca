"""Analytic cost model: operations per generated token, one named term per component (seed 000, SPEC §6).

Notation: d backbone width, L layers, V vocab, T context (keys the new token attends to), w workspace width,
M slots, A = M + M/2 actions, B_e editor blocks, h_e editor hidden, F controller features, n actions of k slots.

Conventions (the seed's):
  * one multiply-add = 2 ops; softmax, norms and activations are ignored (O(dim), not O(dim^2)), except that norm
    gains count in `backbone_linear` (2 ops per gain) because that term is 2 x non-embedding parameters;
  * decode step: the backbone attends over the whole context T (KV cache); the LM head is included;
  * the source bank is incremental: K, V and z of the new position only (3 projections d -> w);
  * the editor reads the whole bank (T keys) for every edited slot in every block (`editor_source_attn`);
  * seed accounting (`optimised=False`, what `cfg.optimised=False` models run): every block refreshes the K/V of
    all M slots of the position for every action; the controller projects all A action summaries; the readout
    projects the M slots of both states with W_r;
  * optimised accounting (`optimised=True`, what `cfg.optimised` models run): the controller projects the M slots
    and averages pairs (M w^2 instead of A w^2); the readout folds W_r into its query (2 w^2 once instead of
    2 M w^2 per state). With `cfg.slot_kv_cache` too (`cfg.uses_slot_kv_cache`), slot K/V are computed once per
    edited position (all M slots, every block: the first sparse action pays it), then only for the slots an action
    changes (its k slots in blocks >= 1, and a refresh of its k slots in every block after it); DENSE actions keep
    the seed's path and leave the position without a slot K/V cache. Without it the editor counts as the seed's.

Sources: seed 000 (cost table for prisme_103m at T = 512); SPEC §6. docs/costs.md derives every term;
tests/test_costs.py checks every integer of the seed, ties each term to the matmul FLOPs that
`torch.utils.flop_counter.FlopCounterMode` counts on the real modules (`OpsCounter`), and parameter counts to `numel`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from prisme.config import PrismeConfig
from prisme.costs.analytic import cost_document


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
    cfg = PrismeConfig.from_name(args.preset, **({"slot_kv_cache": True} if args.slot_kv_cache else {}))
    T = cfg.cost_context if args.context is None else args.context
    doc = cost_document(cfg, T, optimised=args.optimised)
    print(json.dumps(doc, indent=2) if args.json else format_table(doc))
    return 0
