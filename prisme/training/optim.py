"""The stage's optimizer: which parameters train, their groups and learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from prisme.training.config import StageConfig


def lr_at(step: int, scfg: StageConfig, peak: float | None = None, floor: float | None = None) -> float:
    """Linear warm-up to `peak` (default `lr`) over `warmup` steps, then cosine decay to `floor` (default `min_lr`)."""
    peak = scfg.lr if peak is None else peak
    floor = scfg.min_lr if floor is None else floor
    if step < scfg.warmup:
        return peak * (step + 1) / scfg.warmup
    progress = min(1.0, (step - scfg.warmup) / max(1, scfg.steps - scfg.warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def group_lrs(scfg: StageConfig) -> dict[str, tuple[float, float]]:
    """Peak and final lr per optimizer group kind: "main", and "backbone" when it joins the stage
    (`StageConfig.backbone_joins`: it learns in the workspace stage)."""
    out = {"main": (scfg.lr, scfg.min_lr)}
    if scfg.backbone_joins:
        peak = scfg.lr if scfg.backbone_lr is None else scfg.backbone_lr
        floor = scfg.backbone_min_lr if scfg.backbone_min_lr is not None else min(scfg.min_lr, peak)
        out["backbone"] = (peak, floor)
    return out


def stage_parameters(model: nn.Module, scfg: StageConfig) -> list[nn.Parameter]:
    """The parameters of the stage's groups (`StageConfig.trained_groups`: its spec's group, after the backbone's
    when the backbone joins: only its token embedding with `backbone_trains="embedding"`), once the model's groups are
    checked to partition its parameters; every other parameter gets `requires_grad=False`."""
    model.check_parameter_groups()
    params = [p for group in scfg.trained_groups for p in model.parameter_group(group)]
    if scfg.backbone_joins and scfg.backbone_trains == "embedding":  # the blocks stay frozen
        if not hasattr(model.backbone, "tok_emb"):
            raise ValueError("backbone_trains='embedding' needs a backbone with a token embedding (tok_emb)")
        emb = {id(p) for p in model.backbone.tok_emb.parameters()}
        backbone = {id(p) for p in model.parameter_group("backbone")}
        params = [p for p in params if id(p) in emb or id(p) not in backbone]
    ids = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in ids)
    return params


def make_optimizer(wrapped: nn.Module, scfg: StageConfig) -> torch.optim.Optimizer:
    """AdamW with decay on >= 2-D weights only; the backbone gets its own groups (and lr) when it learns in stage 2."""
    kinds = group_lrs(scfg)
    kind_of = {n: "backbone" if "backbone" in kinds and "model.backbone." in n else "main"
               for n, _ in wrapped.named_parameters()}
    named = [(n, p) for n, p in wrapped.named_parameters() if p.requires_grad]
    groups = []
    for kind in kinds:
        for decay in (True, False):
            ps = [p for n, p in named if kind_of[n] == kind and (p.dim() >= 2) == decay]
            if ps or kind == "main":
                groups.append({"params": ps, "weight_decay": scfg.weight_decay if decay else 0.0, "kind": kind})
    return torch.optim.AdamW(groups, lr=scfg.lr, betas=tuple(scfg.betas), eps=scfg.eps)
