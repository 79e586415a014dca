"""Loss curves of a run folder (`prisme plot RUN`; `prisme train` writes one at the end of each stage): train and
validation loss, tokens/s and, for the workspace stage, the gates and |delta| / |H|, read from `metrics.jsonl` (a
finished run or one still training: a torn last line is skipped)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CURVES = "curves.png"


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    """The rows of `run/metrics.jsonl`; ValueError naming the file when there is none or no row in it."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: pass a run folder written by `prisme train` (--out)")
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written, or torn by a kill
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no metrics row yet")
    return rows


def _series(rows: list[dict[str, Any]], split: str, key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get("split", "train") == split and isinstance(r.get(key), float)]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_run(run: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's curves into `out` (default `run/curves.png`, written atomically); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from prisme.io import write_bytes_atomic

    run = Path(run)
    rows = read_metrics(run)
    ws_keys = sorted({k for r in rows if r.get("split") == "val" for k in r
                      if k.startswith("gate") or k == "delta_ratio"})
    panels = 3 if ws_keys else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.6))
    for split, style in (("train", ".-"), ("val", "o-")):
        for key in ("loss", "loss_backbone"):
            x, y = _series(rows, split, key)
            if x:
                axes[0].plot(x, y, style, label=f"{split} {key.replace('_', ' ')}", markersize=3)
    axes[0].set(xlabel="step", ylabel="loss (nats per token)", title=run.name)
    axes[0].legend(fontsize=8)
    x, y = _series(rows, "train", "tokens_per_s")
    axes[1].plot(x, y, ".-")
    axes[1].set(xlabel="step", ylabel="tokens / s", title="throughput")
    if ws_keys:
        for key in ws_keys:
            x, y = _series(rows, "val", key)
            axes[2].plot(x, y, "o-", label=key, markersize=3)
        axes[2].set(xlabel="step", title="workspace (validation)")
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    target = Path(out) if out is not None else run / CURVES
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(target, buf.getvalue())
    return target
