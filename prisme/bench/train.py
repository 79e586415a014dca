"""`prisme bench train`: training tokens/s and achieved GFLOP/s next to this machine's measured fp32 matmul peak.

Also the machine measurements other benchmarks compare against (`prisme bench vs-hf` uses both):
  * matmul peak: `a @ b` on square fp32 matrices of a few sizes; the peak is the best size's p50 GFLOP/s (2 n^3 FLOPs);
  * streaming read bandwidth: one full reduction (`buf.sum()`) of a buffer far larger than the last-level cache;
    bytes / p50 time. A decode step that reads its weights once cannot be faster than bytes read / this bandwidth.
Both are timed as paths of the same `harness.time_paths` rotation as the work they are compared with, so a machine
shared with other jobs slows them alike and the ratios stay meaningful.

Training step (the backbone stage, as `prisme train --stage backbone` runs it): forward, next-token cross entropy,
backward, global grad-norm clip at 1.0, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), zero_grad; fp32, eager.
FLOPs per step are analytic (`forward_flops`, the PaLM convention): 2 FLOPs per multiply-add of every matmul, the
causal half of attention only, the head on every position, and backward = 2 x forward, so a step is 3 x forward.
Norms, activations, the embedding lookup and the optimizer are not counted (they are memory-bound): achieved GFLOP/s
is useful model FLOPs / step time, the figure to set against the matmul peak.

Output: a table for humans, then one JSON document, the last thing printed on stdout; `--json PATH` also writes it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from prisme.bench import harness
from prisme.bench.harness import TimedPath, percentiles, time_paths
from prisme.bench.train_stages import (
    ADAMW,
    GRAD_CLIP,
    OPS_CONVENTION,
    STAGE_RECIPES,
    STAGE_TARGET,
    STAGES,
    stage_paths,
    stage_row,
)
from prisme.config import PrismeConfig
from prisme.costs.analytic import matmul_params_per_layer
from prisme.io import environment
from prisme.model.backbone import Backbone

BANDWIDTH_BYTES = 512 * 2**20  # 16x a 32 MiB last-level cache: nothing of it survives in cache between reads
MATMUL_SIZES = (1024, 2048, 3072)
TRAIN_SHAPES = {"demo": (16, 128), "prisme_103m": (4, 256)}  # preset -> (batch, seq_len): demo = prisme/configs/demo_*
TRAIN_TARGET = 0.5  # issue 7: training >= 50% of the matmul peak at the ~100M shape


# ------------------------------------------------------------------------------------------------ machine measures
def stream_read_path(nbytes: int = BANDWIDTH_BYTES, reads: int = 1, name: str = "stream_read") -> TimedPath:
    """A timed path that reads a buffer of `nbytes` fp32 `reads` times (`buf.sum()`); returns the last sum. The buffer
    is allocated and touched up front. Bytes per sample: nbytes * reads."""
    if nbytes < 4 or reads < 1:
        raise ValueError(f"stream read needs at least 4 bytes and 1 read, got {nbytes} and {reads}")
    buf = torch.ones(nbytes // 4)  # [n] fp32, pages touched now, not while timing

    def run(_: object) -> torch.Tensor:
        for _ in range(reads - 1):
            buf.sum()
        return buf.sum()

    return name, lambda: None, run


def matmul_paths(sizes: Sequence[int] = MATMUL_SIZES, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> list[TimedPath]:
    """One timed path per size n, `a @ b` with a, b `[n, n]` on `device` (2 n^3 FLOPs), named `matmul_<n>`."""
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"matmul sizes must be positive, got {list(sizes)}")
    g = torch.Generator().manual_seed(0)
    paths = []
    for n in sizes:
        a, b = torch.randn(n, n, generator=g, dtype=dtype), torch.randn(n, n, generator=g, dtype=dtype)
        if device is not None:
            a, b = a.to(device), b.to(device)
        paths.append((f"matmul_{n}", lambda: None, lambda _, a=a, b=b: a @ b))
    return paths


@dataclass
class Bandwidth:
    """Streaming read bandwidth: `nbytes` read per sample; GB/s = nbytes / p50 (1 GB = 1e9 bytes)."""

    nbytes: int
    samples_ms: list[float]
    p50_ms: float
    p95_ms: float
    gb_per_s: float  # at the p50 time

    @classmethod
    def from_samples(cls, nbytes: int, samples_ms: list[float]) -> Bandwidth:
        p50, p95 = percentiles(samples_ms)
        return cls(nbytes, samples_ms, p50, p95, nbytes / p50 / 1e6)


@dataclass
class MatmulPeak:
    """fp32 matmul throughput per size (GFLOP/s at each size's p50); `peak` is the best size's."""

    samples_ms: dict[str, list[float]]  # matmul_<n> -> samples
    gflops: dict[str, float]  # matmul_<n> -> 2 n^3 / p50
    peak_gflops: float
    peak_size: int

    @classmethod
    def from_samples(cls, samples_ms: dict[str, list[float]]) -> MatmulPeak:
        mm = {k: v for k, v in samples_ms.items() if k.startswith("matmul_")}
        if not mm:
            raise ValueError("no matmul_<n> samples to take a peak from")
        gflops = {k: 2 * int(k.removeprefix("matmul_")) ** 3 / percentiles(v)[0] / 1e6 for k, v in mm.items()}
        best = max(gflops, key=gflops.__getitem__)
        return cls(mm, gflops, gflops[best], int(best.removeprefix("matmul_")))


def stream_read_bandwidth(nbytes: int = BANDWIDTH_BYTES, warmups: int = 1, repeats: int = 9) -> Bandwidth:
    """Streaming read bandwidth with the current torch threads (standalone; see `stream_read_path`)."""
    samples = time_paths([stream_read_path(nbytes)], warmups, repeats)
    return Bandwidth.from_samples(nbytes, samples["stream_read"])


def matmul_peak(sizes: Sequence[int] = MATMUL_SIZES, warmups: int = 1, repeats: int = 5) -> MatmulPeak:
    """fp32 matmul peak with the current torch threads (standalone; see `matmul_paths`)."""
    return MatmulPeak.from_samples(time_paths(matmul_paths(sizes), warmups, repeats))


# ---------------------------------------------------------------------------------------------------------- FLOPs
@dataclass
class FlopCount:
    """Useful FLOPs of a backbone pass (2 per multiply-add); see the module docstring for the convention."""

    matmul: int  # the blocks' projections: qkv, out, MLP
    attention: int  # q k^T and attention-weighted values, causal half only
    head: int  # lm head on the positions whose logits are taken
    total: int


def forward_flops(cfg: PrismeConfig, batch: int, seq_len: int, head_positions: int | None = None) -> FlopCount:
    """FLOPs of one forward over `batch` x `seq_len` tokens from an empty cache, head on `head_positions` positions
    of each row (default: all)."""
    if batch < 1 or seq_len < 1:
        raise ValueError(f"need batch >= 1 and seq_len >= 1, got {batch} and {seq_len}")
    head_positions = seq_len if head_positions is None else head_positions
    B, T, L = batch, seq_len, cfg.n_layer
    matmul = 2 * B * T * L * matmul_params_per_layer(cfg)
    attention = 2 * 2 * B * L * cfg.n_head * cfg.head_dim * (T * (T + 1) // 2)  # query i sees i + 1 keys
    head = 2 * B * head_positions * cfg.d_model * cfg.vocab_size
    return FlopCount(matmul, attention, head, matmul + attention + head)


def train_step_flops(cfg: PrismeConfig, batch: int, seq_len: int) -> int:
    """FLOPs of one training step: forward with the head on every position, backward = 2 x forward."""
    return 3 * forward_flops(cfg, batch, seq_len).total


# ------------------------------------------------------------------------------------------------------- training
def make_optimizer(model: Backbone, lr: float = 3e-4) -> torch.optim.AdamW:
    """AdamW as `prisme train` builds it: weight decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": ADAMW["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=ADAMW["betas"], eps=ADAMW["eps"])


def train_step(model: Backbone, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One optimizer step on tokens x `[B, T]` with next-token targets y `[B, T]`; returns the loss (detached)."""
    with torch.inference_mode(False), torch.enable_grad():  # time_paths times inside inference mode
        logits = model.head(model(x))  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()


@dataclass
class TrainRow:
    preset: str
    parameters: int
    batch: int
    seq_len: int
    tokens_per_step: int
    flops_per_step: int
    samples_ms: dict[str, list[float]]  # train_step, and the interleaved matmul sizes
    step_p50_ms: float
    step_p95_ms: float
    tokens_per_s: float  # tokens_per_step / step p50
    achieved_gflops: float  # flops_per_step / step p50
    matmul_peak_gflops: float  # measured in the same rotation
    fraction_of_peak: float
    losses: list[float]  # every step's loss, warmups included: finite, and falling means the steps really train


def backbone_step_path(cfg: PrismeConfig, batch: int, seq_len: int, seed: int = 42, lr: float = 3e-4,
                       name: str = "train_step", device: torch.device | str = "cpu"
                       ) -> tuple[Backbone, TimedPath, list[float]]:
    """A seeded backbone in train mode on `device` and a timed path of its training step on one fixed batch (its
    losses are appended to the returned list)."""
    model = harness.build_model(cfg, seed).to(device).train()
    opt = make_optimizer(model, lr)
    seq = harness.make_tokens(cfg.vocab_size, batch, seq_len + 1, seed).to(device)  # [B, T + 1], outside inference
    x, y = seq[:, :-1], seq[:, 1:]
    losses: list[float] = []
    return model, (name, lambda: None, lambda _: losses.append(float(train_step(model, opt, x, y)))), losses


@dataclass(frozen=True)
class TrainBenchOptions:
    """How `prisme bench train` times its presets (`run_train`; `train_throughput` reads the timing fields). Checked
    here, once: an unknown stage is a ValueError."""

    warmups: int = 1  # untimed steps before timing
    repeats: int = 5  # timed steps per preset
    threads: int = 2  # torch CPU threads (-1: leave as is)
    seed: int = 42  # weights and tokens
    quick: bool = False  # quarter batches, two matmul sizes, a smaller bandwidth buffer
    shapes: dict[str, tuple[int, int]] | None = None  # (batch, seq_len) per preset, over `TRAIN_SHAPES`
    stages: Sequence[str] = ()  # also time these stages ("workspace", "controller") ...
    stage_presets: Sequence[str] | None = None  # ... on these presets (None: every preset with a workspace)
    compile: bool = False  # the stages with the editor under torch.compile
    device: torch.device | str = "cpu"  # where the steps and matmuls run

    def __post_init__(self) -> None:
        bad = [s for s in self.stages if s not in STAGES]
        if bad:
            raise ValueError(f"unknown stage(s) {bad}; choose from {list(STAGES)}")


def train_throughput(cfg: PrismeConfig, batch: int, seq_len: int, options: TrainBenchOptions,
                     matmul_sizes: Sequence[int] = MATMUL_SIZES, lr: float = 3e-4) -> TrainRow:
    """Time `options.warmups` + `options.repeats` training steps (one fixed batch, seeded by `options.seed`) on
    `options.device`, rotated with the matmul sizes each repeat (on the same device)."""
    if not 1 <= seq_len <= cfg.max_seq_len - 1:
        raise ValueError(f"seq_len must be in [1, T_max - 1 = {cfg.max_seq_len - 1}], got {seq_len}")
    device = options.device
    model, path, losses = backbone_step_path(cfg, batch, seq_len, options.seed, lr, device=device)
    samples = time_paths([path, *matmul_paths(matmul_sizes, device=device)], options.warmups, options.repeats,
                         device)
    peak = MatmulPeak.from_samples(samples)
    p50, p95 = percentiles(samples["train_step"])
    flops = train_step_flops(cfg, batch, seq_len)
    achieved = flops / p50 / 1e6
    return TrainRow(cfg.name, model.num_parameters(), batch, seq_len, batch * seq_len, flops, samples, p50, p95,
                    batch * seq_len / p50 * 1e3, achieved, peak.peak_gflops, achieved / peak.peak_gflops, losses)


# --------------------------------------------------------------------------------------------------------- report
def run_train(presets: Sequence[str] = ("demo", "prisme_103m"), options: TrainBenchOptions | None = None
              ) -> dict[str, Any]:
    """The whole `prisme bench train` protocol on `presets` (`options`: default `TrainBenchOptions()`); returns the
    JSON document.

    The options' stages are also timed on its `stage_presets` (default: the presets with a workspace), each next to
    the backbone stage of its preset (`compile`: with the editor compiled)."""
    o = options if options is not None else TrainBenchOptions()
    shapes = {**TRAIN_SHAPES, **(o.shapes or {})}
    cfgs = [PrismeConfig.from_name(p) for p in presets]  # ValueError for an unknown preset, before any timing
    stage_cfgs = [c for c in cfgs if c.use_workspace and (o.stage_presets is None or c.name in o.stage_presets)]
    sizes = MATMUL_SIZES[:2] if o.quick else MATMUL_SIZES
    with harness.torch_threads(o.threads):
        bandwidth = stream_read_bandwidth(BANDWIDTH_BYTES // (4 if o.quick else 1), o.warmups, max(3, o.repeats * 2))
        rows, models = [], {}
        for cfg in cfgs:
            batch, seq_len = shapes.get(cfg.name, (8, min(128, cfg.max_seq_len - 1)))
            if o.quick:
                batch = max(1, batch // 4)
            rows.append(train_throughput(cfg, batch, seq_len, o, sizes))
            with torch.device("meta"):
                models[cfg.name] = harness.model_facts(Backbone(cfg))
        stage_rows = []
        for cfg in stage_cfgs if o.stages else []:
            bb = next(r for r in rows if r.preset == cfg.name)
            for stage in o.stages:
                b = max(1, STAGE_RECIPES[stage]["batch_size"] // 4) if o.quick else None
                path, info = stage_paths(cfg, stage, o.seed, batch=b, compile=o.compile, device=o.device)
                # the backbone stage's step in the same rotation: the ratio's denominator sees the same machine
                _, bb_path, _ = backbone_step_path(cfg, bb.batch, bb.seq_len, o.seed, name="backbone_step",
                                                   device=o.device)
                samples = time_paths([bb_path, path], o.warmups, o.repeats, o.device)
                bb_tps = bb.batch * bb.seq_len / percentiles(samples["backbone_step"])[0] * 1e3
                stage_rows.append(stage_row(cfg, stage, samples[path[0]], info, o.warmups, bb_tps,
                                            samples["backbone_step"]))
        env = environment(dtype=torch.float32, seed=o.seed) | {"device": str(o.device)}
    big = [r for r in rows if r.parameters >= 50_000_000]
    targets = [{"name": f"training >= {TRAIN_TARGET:.0%} of the fp32 matmul peak ({r.preset})",
                "target": TRAIN_TARGET, "measured": r.fraction_of_peak, "met": r.fraction_of_peak >= TRAIN_TARGET}
               for r in big]
    finite = all(all(map(lambda v: v == v and abs(v) < float("inf"), r.losses)) for r in rows)
    checks = {"losses_finite": finite}
    checks["passed"] = all(checks.values())
    return {
        "scope": f"Backbone-stage training steps (random init, one fixed batch of random tokens), fp32, eager, "
                 f"{torch.device(o.device).type} (the bandwidth row reads host memory)",
        "environment": env,
        "models": models,
        "protocol": {
            "warmups": o.warmups, "repeats": o.repeats, "timer": "perf_counter_ns", "quick": o.quick,
            "step": "forward + cross entropy + backward + clip_grad_norm(1.0) + AdamW(0.9, 0.95, wd 0.1) + zero_grad",
            "flops": "analytic, 3 x forward: matmuls 2/MAC, causal attention half, head on every position; norms, "
                     "activations, embedding and optimizer not counted",
            "matmul_peak": f"square fp32 a @ b at sizes {list(sizes)}, best size's p50, timed in the same rotation "
                           "as the training step",
            "bandwidth": f"buf.sum() over {bandwidth.nbytes:,} bytes, p50",
            "path_order": "rotated each repeat", "gc": "collected before timing, disabled while timing",
        },
        "bandwidth": asdict(bandwidth),
        "train": [asdict(r) for r in rows],
        "stages": [asdict(r) for r in stage_rows],
        "stage_protocol": {"recipes": STAGE_RECIPES, "ops": OPS_CONVENTION, "data": "one fixed batch of random "
                           "tokens, fresh sampled actions / positions / budgets each step (the stage's own sampler)",
                           "target": f"stage tokens/s >= backbone-stage tokens/s / ({STAGE_TARGET} x analytic "
                                     "training-ops ratio)",
                           "model": "seeded, untrained (readout U zero: the steps still run every op)",
                           "timing": "each stage's step rotated with its preset's backbone-stage step (same shape "
                                     "as the backbone row); that rotation's backbone tokens/s is the ratio's "
                                     "denominator"},
        "targets": targets + [{"name": f"{r.stage} stage tokens/s >= backbone's / ({STAGE_TARGET} x ops ratio) "
                                       f"({r.preset})", "target": r.target_tokens_per_s, "measured": r.tokens_per_s,
                               "met": r.met} for r in stage_rows],
        "checks": checks,
    }


def format_train_table(doc: dict[str, Any]) -> str:
    env, bw = doc["environment"], doc["bandwidth"]
    lines = [f"prisme bench train: fp32, {env['threads']} thread(s), {env['cpu']}, torch {env['torch']}",
             f"streaming read bandwidth: {bw['gb_per_s']:.1f} GB/s (p50 over {len(bw['samples_ms'])} reads of "
             f"{bw['nbytes'] / 2**20:.0f} MiB)", "",
             f"  {'preset':<12}{'params':>13}{'batch':>7}{'seq':>5}{'step p50 ms':>13}{'[p95]':>10}{'tokens/s':>10}"
             f"{'GFLOP/step':>12}{'GFLOP/s':>9}{'peak':>8}{'of peak':>9}"]
    for r in doc["train"]:
        lines.append(f"  {r['preset']:<12}{r['parameters']:>13,}{r['batch']:>7}{r['seq_len']:>5}"
                     f"{r['step_p50_ms']:>13.1f}{r['step_p95_ms']:>10.1f}{r['tokens_per_s']:>10.0f}"
                     f"{r['flops_per_step'] / 1e9:>12.2f}{r['achieved_gflops']:>9.1f}{r['matmul_peak_gflops']:>8.1f}"
                     f"{r['fraction_of_peak']:>9.1%}")
    lines.append("  peak = best fp32 square matmul (p50 GFLOP/s) timed in the same rotation as each row's steps")
    if doc.get("stages"):
        lines += ["", f"  {'preset':<12}{'stage':<12}{'batch':>6}{'seq':>5}{'step p50 ms':>13}{'[p95]':>10}"
                      f"{'tokens/s':>10}{'bb tokens/s':>13}{'time x bb':>11}{'ops x bb':>10}{'t/ops':>7}"
                      f"{'target tok/s':>14}  compiled"]
        for r in doc["stages"]:
            lines.append(f"  {r['preset']:<12}{r['stage']:<12}{r['batch']:>6}{r['seq_len']:>5}{r['step_p50_ms']:>13.1f}"
                         f"{r['step_p95_ms']:>10.1f}{r['tokens_per_s']:>10.0f}{r['backbone_tokens_per_s']:>13.0f}"
                         f"{r['time_ratio']:>11.2f}{r['analytic_training_ops_ratio']:>10.2f}"
                         f"{r['time_over_ops']:>7.2f}{r['target_tokens_per_s']:>14.0f}  "
                         f"{'yes' if r['compiled'] else 'no'}")
        lines.append("  ops x bb = the stage's analytic training ops per step / the backbone stage's on the same "
                     "tokens (docs/benchmarks.md: x3 trained, x2 frozen with gradient through, x1 no gradient)")
    for t in doc["targets"]:
        got = (f"{t['measured']:.0f} tokens/s vs {t['target']:.0f}" if "tokens/s" in t["name"]
               else f"{t['measured']:.1%}")
        lines.append(f"target: {t['name']}: measured {got} -> {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """`prisme bench train`: print the table, then the JSON document as the last thing on stdout."""
    presets = harness.parse_names(args.presets, "--presets")
    if args.warmups < 0 or args.repeats < 1:
        raise ValueError(f"need --warmups >= 0 and --repeats >= 1, got {args.warmups} and {args.repeats}")
    stages = getattr(args, "stages", "none")
    stages = () if stages == "none" else harness.parse_names(stages, "--stages")
    stage_presets = harness.parse_names(getattr(args, "stage_presets", "demo"), "--stage-presets")
    device = harness.bench_device(getattr(args, "device", "cpu"))
    doc = run_train(presets, TrainBenchOptions(args.warmups, args.repeats, args.threads, args.seed, args.quick,
                                               stages=stages, stage_presets=stage_presets,
                                               compile=getattr(args, "compile", False), device=device))
    return harness.emit(doc, format_train_table(doc), args.json)
