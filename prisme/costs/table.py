"""`prisme costs`: seed 000's cost table for a preset (and the optimised column beside it), as a human table or as
one JSON document in seed 000's layout."""

from __future__ import annotations

import argparse
import json
from typing import Any

from prisme.config import PrismeConfig
from prisme.costs.analytic import cost_document
from prisme.options import ExecutionOptions


# ---------------------------------------------------------------------- over a sequence, and the deployed row
def sequence_row(cfg: PrismeConfig, T: int) -> dict[str, Any]:
    """The backbone alone over a whole sequence of T positions, each at its own context 1..T (how the studies price a
    model: `costs.traces.trace_cost`), mean ops per token."""
    import torch

    from prisme.costs.traces import trace_cost

    return {"T": T, "ops_per_token": trace_cost(cfg, None, torch.arange(1, T + 1)).ops_per_token}


def deployed_row(cfg: PrismeConfig, T: int, fire_rate: float, optimised: bool | str = False,
                 bank_store: str = "entries") -> dict[str, Any]:
    """The router deployed at budget 1 (`cfg.router`) over a sequence of T positions, each at its own context 1..T (as
    the studies price it): every position pays the backbone, its bank entry and the router's score; `fire_rate` of
    them, spread evenly, take one single-slot edit (its editor, readout and reads of the bank). Priced by
    `costs.traces.trace_cost` with the bank kept as projected entries (the studies' pricing), or as token ids and
    tables (`bank_store="ids"`, an embedding bank: what `bench decode --bank-store ids` runs). ValueError for a model
    without a router or a rate outside [0, 1]."""
    import torch

    from prisme.costs.traces import trace_cost
    from prisme.options import DecodeOptions

    if not cfg.use_workspace or not cfg.router:
        raise ValueError(f"--fire-rate prices a router model's deployed step; {cfg.name!r} has "
                         f"{'no workspace' if not cfg.use_workspace else 'no router'} (--set router=true)")
    if isinstance(fire_rate, bool) or not isinstance(fire_rate, (int, float)) or not 0 <= fire_rate <= 1:
        raise ValueError(f"--fire-rate must be a share of the positions in [0, 1] (e.g. 0.005), got {fire_rate!r}")
    fired = round(fire_rate * T)
    actions = torch.full((T, 1), cfg.stop_action, dtype=torch.long)
    if fired:
        actions[torch.linspace(T - 1, 0, fired).round().long(), 0] = 0  # slot 0 alone: the single-slot edit
    if bank_store not in ("entries", "ids"):
        raise ValueError(f"--bank-store must be entries or ids, got {bank_store!r}")
    decode = DecodeOptions(bank_tables=bank_store == "ids", bank_store=bank_store)
    tc = trace_cost(cfg, actions, torch.arange(1, T + 1), None, optimised, True, decode)
    base = sequence_row(cfg, T)["ops_per_token"]
    return {"T": T, "fire_rate": fired / T, "budget": 1, "ops_per_token": tc.ops_per_token,
            "x_backbone_only": tc.ops_per_token / base, "backbone_only_ops_per_token": base,
            "decode": {"bank_tables": decode.bank_tables, "bank_store": decode.bank_store}}


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
    if "sequence" in doc:
        q = doc["sequence"]
        lines.append(f"over a sequence of {q['T']:,} (each position at its own context): the backbone alone "
                     f"{q['ops_per_token']:,.0f} ops per token")
    if "deployed" in doc:
        d = doc["deployed"]
        lines.append(f"deployed over a sequence of {d['T']:,} (the router at budget 1, {d['fire_rate']:.2%} of "
                     f"positions edit one slot): {d['ops_per_token']:,.0f} ops per token, "
                     f"{d['x_backbone_only']:.3f} x the backbone alone there")
    return "\n".join(lines)


def costs_cli(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> int:
    """`prisme costs --preset NAME [--set FIELD=VALUE ...] [--context T] [--json] [--optimised [--slot-kv-cache]]
    [--fire-rate R]`; `overrides`: the model fields `--set` changes."""
    if args.slot_kv_cache and not args.optimised:
        raise ValueError("--slot-kv-cache prices the optimised column's editor: pass --optimised too")
    try:
        cfg = PrismeConfig.from_name(args.preset, **(overrides or {}))
    except TypeError as e:
        raise ValueError(f"--set: {e}") from None
    T = cfg.cost_context if args.context is None else args.context
    column = ExecutionOptions(slot_kv_cache=args.slot_kv_cache).column(args.optimised)
    doc = cost_document(cfg, T, optimised=column)
    if getattr(args, "fire_rate", None) is not None or getattr(args, "sequence", False):
        doc["sequence"] = sequence_row(cfg, T)
    if getattr(args, "fire_rate", None) is not None:
        doc["deployed"] = deployed_row(cfg, T, args.fire_rate, column, getattr(args, "bank_store", "entries"))
    print(json.dumps(doc, indent=2) if args.json else format_table(doc))
    return 0
