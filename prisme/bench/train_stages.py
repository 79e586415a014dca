"""`prisme bench train`'s workspace and controller stages: their real training steps and the analytic
training-ops ratio of the traces they sampled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from prisme.bench import harness
from prisme.bench.harness import TimedPath, percentiles
from prisme.config import PrismeConfig
from prisme.training.compute import (
    TRAINED,
    backbone_forward,
    controller_stage_step,
    head_ops,
    workspace_stage_step,
)

# ------------------------------------------------------------------------------------- workspace and controller stages
# The demo's stage 2 and 3 recipes (prisme/configs/demo_workspace.json, demo_controller.json): what is timed.
STAGE_RECIPES: dict[str, dict[str, Any]] = {
    "workspace": dict(batch_size=16, seq_len=128, lr=1e-3, max_budget=4, deep_supervision=0.5, p_dense=0.05),
    "controller": dict(batch_size=8, seq_len=128, lr=3e-3, max_budget=4, oracle_positions=16),
}

ADAMW = dict(betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)  # as prisme.training's defaults
GRAD_CLIP = 1.0
STAGES = tuple(STAGE_RECIPES)  # the stages it times
STAGE_TARGET = 1.5  # stage tokens/s >= backbone-stage tokens/s / (1.5 x the analytic training-ops ratio)
OPS_CONVENTION = (
    "analytic ops of one step from the cost model (prisme.costs, seed accounting: the editor trains on the reference "
    "path), from the timed steps' own sampled action traces, budgets and positions: forward ops x 3 for what is "
    "trained (the workspace in stage 2: bank projections, editor, readout; the controller in stage 3), x 2 for a "
    "frozen module the gradient passes through (the LM head on the workspace's logits, deep supervision included), "
    "x 1 for what runs without gradient (the frozen backbone, the oracle's candidate edits, readouts and heads, the "
    "backbone-loss reference); the backbone stage is 3 x (backbone + head) on every position; norms, softmax, "
    "activations, embeddings and the optimizer are not counted")


@dataclass
class StageRow:
    preset: str
    stage: str
    batch: int
    seq_len: int
    tokens_per_step: int
    samples_ms: list[float]
    step_p50_ms: float
    step_p95_ms: float
    tokens_per_s: float
    analytic_ops_per_step: float  # mean over the timed steps (each its own sampled traces)
    backbone_stage_ops_per_step: float  # 3 x (backbone + head) on the same tokens
    analytic_training_ops_ratio: float
    backbone_tokens_per_s: float  # the backbone stage of the same preset, same rotation
    time_ratio: float  # backbone tokens/s / this stage's tokens/s
    time_over_ops: float  # time_ratio / analytic_training_ops_ratio (1 = the backbone's achieved speed)
    target_tokens_per_s: float  # backbone tokens/s / (STAGE_TARGET x ops ratio)
    met: bool
    compiled: bool
    losses: list[float]
    backbone_samples_ms: list[float] = field(default_factory=list)  # the backbone step's, same rotation


def stage_optimizer(model: torch.nn.Module, scfg: Any, objective: torch.nn.Module
                    ) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """The parameters stage `scfg` trains (the model's, and the objective's own) and their AdamW (the trainer's
    settings)."""
    from prisme.training.optim import stage_parameters

    params = stage_parameters(model, scfg) + [p for n, p in objective.named_parameters() if not n.startswith("model.")]
    return params, torch.optim.AdamW(params, lr=scfg.lr, betas=ADAMW["betas"], eps=ADAMW["eps"])


def optimizer_step(objective: torch.nn.Module, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
                   batch: tuple, denom: dict[str, float]) -> torch.Tensor:
    """One training step: the objective's loss on `batch` = (x, y, extras), its backward, the gradient clipped, the
    optimizer's step; returns the loss."""
    loss, _ = objective(*batch, denom)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def stage_paths(cfg: PrismeConfig, stage: str, seed: int = 42, batch: int | None = None, seq_len: int | None = None,
                compile: bool = False, device: torch.device | str = "cpu") -> tuple[TimedPath, dict[str, Any]]:
    """A timed path of `stage`'s real training step (its objective, AdamW, grad clip) on one fixed batch of random
    tokens with fresh sampled actions each step, and the info to price it."""
    from prisme.model.prisme import PrismeModel
    from prisme.training.config import StageConfig

    if not cfg.use_workspace:
        raise ValueError(f"stage {stage!r} needs a preset with a workspace; {cfg.name!r} has none")
    full = STAGE_RECIPES[stage]
    B, T = batch or full["batch_size"], min(seq_len or full["seq_len"], cfg.max_seq_len - 1)
    recipe = {k: v for k, v in full.items() if k not in ("batch_size", "seq_len")}
    recipe["max_budget"] = min(recipe["max_budget"], cfg.r_max)
    scfg = StageConfig(stage=stage, batch_size=B, seq_len=T, seed=seed, progress=False, **recipe).validate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = PrismeModel(cfg).to(device)
    if compile:
        from prisme.model.compiled_editor import compile_editor

        compile_editor(model, strict=True)
    objective = scfg.spec.objective(model, scfg).to(device)
    params, opt = stage_optimizer(model, scfg, objective)
    seq = harness.make_tokens(cfg.vocab_size, B, T + 1, seed)
    x, y = seq[:, :-1], seq[:, 1:]  # the sampler draws on the host (as the trainer's); the step runs on `device`
    xd, yd = x.to(device), y.to(device)
    g = torch.Generator().manual_seed(seed + 1)
    if scfg.spec.calibrates_values:  # as the trainer does before its first step
        objective.calibrate(xd, yd, {k: v.to(device) for k, v in objective.sample(x, y, g).items()}, init_heads=True)
    info: dict[str, Any] = {"extras": [], "losses": [], "B": B, "T": T, "scfg": scfg, "objective": objective,
                            "y": y, "compiled": compile}

    def step(_: object) -> None:
        with torch.inference_mode(False), torch.enable_grad():
            ex = objective.sample(x, y, g)
            exd = {k: v.to(device) for k, v in ex.items()}
            loss = optimizer_step(objective, params, opt, (xd, yd, exd), objective.denominators(x, y, ex))
        info["extras"].append(ex)
        info["losses"].append(float(loss.detach()))

    return (f"{stage}_step", lambda: None, step), info


def stage_row(cfg: PrismeConfig, stage: str, samples: list[float], info: dict[str, Any], warmups: int,
              backbone_tps: float, backbone_samples: list[float] | None = None) -> StageRow:
    """Price the timed steps (their own traces) and set them against the backbone stage (`backbone_tps`, from
    `backbone_samples` timed in the same rotation)."""
    B, T, y = info["B"], info["T"], info["y"]
    timed = info["extras"][warmups:]
    if info["scfg"].spec.calibrates_values:  # an oracle stage: its rollouts, candidate edits and value heads
        ops = [controller_stage_step(cfg, info["objective"], ex, y) for ex in timed]
    else:  # the workspace stage: its forced traces
        ops = [workspace_stage_step(cfg, ex, y, info["scfg"].deep_supervision) for ex in timed]
    bb_stage = TRAINED * (B * backbone_forward(cfg, T) + B * T * head_ops(cfg))
    mean_ops = sum(ops) / len(ops)
    ratio = mean_ops / bb_stage
    p50, p95 = percentiles(samples)
    tps = B * T / p50 * 1e3
    target = backbone_tps / (STAGE_TARGET * ratio)
    return StageRow(cfg.name, stage, B, T, B * T, samples, p50, p95, tps, mean_ops, bb_stage, ratio, backbone_tps,
                    backbone_tps / tps, backbone_tps / tps / ratio, target, tps >= target, info["compiled"],
                    info["losses"], list(backbone_samples or []))
