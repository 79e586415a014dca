"""The text study's training compute per model: analytic training ops (`prisme.training.compute.stage_compute`, every
stage a model's training runs) and measured core-seconds (the stages' logged wall time x the study's threads per
worker), per seed; printed beside the verdicts, recorded in the document (`training_compute`).

The models: `backbone` (stage 1), `backbone+matched` (stage 1, then as many more bytes as the workspace stage's),
`prisme:<source>` (stage 1, the workspace stage and the router's or the controller's, on the source's model), and
`frontier:<name>` (one backbone stage on as many bytes as PRISME's stages together)."""

from __future__ import annotations

from pathlib import Path
from statistics import fmean
from typing import Any

from prisme.config import PrismeConfig
from prisme.studies.text_setup import (
    TextStudyConfig,
    copy_config,
    final_folder,
    frontier_config,
    frontier_name,
    frontier_options,
    plain_entry,
    source_config,
)
from prisme.training.compute import training_record
from prisme.training.config import StageConfig


def model_stages(cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig]
                 ) -> dict[str, list[tuple[PrismeConfig, StageConfig]]]:
    """Each model's training: (model config, stage config with its own run folder) per stage, for one seed."""
    out = {"backbone": [(model_cfg, stages["backbone"])]}
    out["backbone+matched"] = out["backbone"] + [(model_cfg, stages["matched"])]
    if cfg.uses_copy:  # its copy head's stage too
        out["backbone+matched"].append((copy_config(model_cfg), stages["matched_copy"]))
    run = Path(stages["backbone"].out_dir).parent
    for s in cfg.sources:
        src = source_config(model_cfg, s)
        chain = out["backbone"]
        if cfg.uses_copy:
            src = copy_config(src)
            chain = chain + [(src, stages["copy"].replace(out_dir=str(run / s / "1c_copy")))]
        ws = stages["workspace"].replace(out_dir=str(run / s / "2_workspace"))
        last = stages["controller"].replace(out_dir=str(run / s / final_folder(stages)))
        out[f"prisme:{s}"] = chain + [(src, ws), (src, last)]
    for f in cfg.frontier_entries:
        name = frontier_name(model_cfg, *f)
        own = [(frontier_config(model_cfg, *f), stages[f"frontier:{name}"])]
        if frontier_options(f)["copy_head"]:  # its dense model's training, then its copy stage
            plain = frontier_name(model_cfg, *plain_entry(f))
            own = out.get(f"frontier:{plain}", [(frontier_config(model_cfg, *plain_entry(f)),
                                                  stages[f"frontier:{plain}"])]) + own
        out[f"frontier:{name}"] = own
    return out


def training_compute(cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[int, dict[str, StageConfig]]
                     ) -> dict[str, dict[str, Any]]:
    """Per model: `training_ops` (the same on every seed), `training_core_s_per_seed` (None where a stage left no
    log) and their mean."""
    out: dict[str, dict[str, Any]] = {}
    for seed in cfg.seeds:
        for name, runs in model_stages(cfg, model_cfg, stages[seed]).items():
            rec = training_record([(m, s, s.out_dir) for m, s in runs], cfg.threads)  # the recall study's record
            e = out.setdefault(name, {"training_ops": rec["training_ops"], "training_core_s_per_seed": []})
            e["training_core_s_per_seed"].append(rec["training_core_s"])
    for e in out.values():
        core = e["training_core_s_per_seed"]
        e["training_core_s"] = None if not core or None in core else fmean(core)
    return out


def format_compute(compute: dict[str, dict[str, Any]]) -> str:
    """The table: each model's training ops (and over the backbone's) and core-seconds."""
    base = compute.get("backbone", {}).get("training_ops")
    lines = ["== training compute per model (analytic ops of every stage it trains; core-seconds its stages' logs "
             "record x threads, mean over the seeds) ==",
             f"{'model':<34}{'train ops':>12}{'x backbone':>12}{'core-s':>10}"]
    for name, e in compute.items():
        core = e["training_core_s"]
        rel = f"{e['training_ops'] / base:.2f}" if base else "-"
        lines.append(f"{name:<34}{e['training_ops']:>12.3g}{rel:>12}{'-' if core is None else f'{core:,.0f}':>10}")
    return "\n".join(lines)
