"""The recall study's training compute: each run's analytic training ops (every stage it trains, warm-ups included:
`prisme.training.compute`) and measured core-seconds (the training wall time its stages' logs record x the study's
threads per worker), each frontier entry's per seed and mean, and the table's columns.

A result kept before these fields existed is given them when the frontier is assembled (`with_training`: the ops
from its task, the time from its run folder's logs; None where the folder holds no log), so an older study resumes,
re-scores (`--evaluate-only`) and prints as before; a document without them prints "-" in their columns.
"""

from __future__ import annotations

from pathlib import Path
from statistics import fmean
from typing import Any

from prisme.studies.recall_setup import RecallTask
from prisme.training.compute import training_record as compute_record

FIELDS = ("training_ops", "training_stages", "training_s", "threads", "training_core_s")  # of a run's result


def training_record(task: RecallTask) -> dict[str, Any]:
    """A run's training compute (`training.compute.training_record`: every stage's ops and logged seconds, their sums,
    the threads, core-seconds)."""
    runs = [(task.model, s, Path(task.folder) / folder) for s, folder in zip(task.stages, task.stage_folders())]
    return compute_record(runs, task.study.threads)


def with_training(task: RecallTask, entry: dict[str, Any]) -> dict[str, Any]:
    """`entry` (a run's result), given `training_record`'s fields where it was kept without them."""
    return entry if "training_ops" in entry else {**entry, **training_record(task)}


def training_entry(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A frontier entry's training compute from its runs (in seed order): per seed and the mean (None where a run has
    none)."""
    ops = [r.get("training_ops") for r in runs]
    core = [r.get("training_core_s") for r in runs]
    mean = lambda xs: None if not xs or None in xs else fmean(xs)  # noqa: E731
    return {"training_ops": mean(ops), "training_ops_per_seed": ops, "training_core_s": mean(core),
            "training_core_s_per_seed": core}


def training_ratio(dense: dict[str, Any] | None, prisme: dict[str, Any] | None) -> float | None:
    """PRISME's training ops over the dense model's (each family's cheapest passing entry), where both have them."""
    a, b = (prisme or {}).get("training_ops"), (dense or {}).get("training_ops")
    return a / b if a is not None and b else None


TABLE_HEAD = f"{'train ops':>10}{'core-s':>8}"


def table_cells(e: dict[str, Any]) -> str:
    """An entry's training columns (mean over its seeds): analytic ops and measured core-seconds; "-" where none."""
    ops, core = e.get("training_ops"), e.get("training_core_s")
    core_text = "-" if core is None else f"{core:,.0f}" if core >= 10 else f"{core:.1f}"
    return f"{'-' if ops is None else f'{ops:.3g}':>10}{core_text:>8}"


def ratio_line(f: dict[str, Any]) -> list[str]:
    """The verdict's line on training compute (none for a document without it)."""
    r = f.get("training_ops_prisme_over_dense")
    return [] if r is None else [f"PRISME / dense training ops (cheapest passing of each): {r:.3f}"]
