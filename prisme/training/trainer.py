"""Three-stage training (SPEC §5): backbone LM -> workspace on forced actions -> controller on the oracle.

    cfg = PrismeConfig.from_name("demo")
    train_stage(cfg, StageConfig(stage="backbone", steps=600, out_dir="runs/x/backbone"))
    train_stage(None, StageConfig(stage="workspace", init_from="runs/x/backbone", out_dir="runs/x/workspace"))
    train_stage(None, StageConfig(stage="controller", init_from="runs/x/workspace", out_dir="runs/x/controller"))

Each stage (`prisme.training.stages.STAGE_SPECS`: backbone, workspace, controller, router) loads the previous
stage's checkpoint (`init_from`), trains only its own parameter groups (everything else has `requires_grad=False`),
holds its run folder's lock, logs JSONL metrics and writes atomic checkpoints to `out_dir`. What a stage does comes
from its `StageSpec` (`scfg.spec`); the losses are in `prisme.training.objectives`.

Notation: B global batch (sequences per optimizer step), b rows of one micro-batch on one rank, T seq_len,
P oracle positions per sequence, A actions, R forced steps, W world size.

Exactness across world sizes and accumulation: every step draws the global batch and its random inputs (forced
actions, oracle positions) once, identically on every rank; micro-batch m on rank r takes rows
[(m W + r) b, (m W + r + 1) b). Each loss term is a sum divided by its count over the whole global batch (every
rank can count it) and multiplied by W, because DDP and FSDP average gradients over ranks. So W processes and
W accumulation steps give the update of one process on the whole batch, up to summation order
(tests/test_distributed.py). Resume is exact: weights, optimizer, step and generator states are checkpointed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from prisme import checkpoint as ckpt
from prisme.config import PrismeConfig
from prisme.data.mqar import MQARDataset
from prisme.data.text import TokenDataset
from prisme.devices import upload
from prisme.io import write_text_atomic
from prisme.training.config import (
    DTYPES,
    StageConfig,
    build_dataset,
    check_same_tokenizer,
)
from prisme.training.distributed import (
    DistInfo,
    all_reduce_stats,
    any_rank,
    check_layout,
    check_memory,
    gather_state,
    no_sync_unless_last,
    rank_barrier,
    resolve_device,
    restore_optimizer,
    setup_distributed,
    shard_rows,
    stats_to_host,
    wrap_for_ranks,
)
from prisme.training.optim import group_lrs, lr_at, make_optimizer, stage_parameters
from prisme.training.resume import (
    RunLock,
    accumulate,
    clear_run,
    drop_rows_after,
    graceful_sigint,
    load_start,
    restore_rng_state,
    rng_state,
)


@dataclass
class TrainResult:
    """What a stage did."""

    stage: str
    out_dir: Path
    checkpoint: Path | None  # the last checkpoint written (the next stage's init_from)
    step: int  # optimizer steps completed
    tokens: int  # tokens this run processed (global, since its start or resume)
    train: dict[str, float]  # last logged training metrics
    val: dict[str, float]  # last validation metrics
    wall_s: float
    interrupted: bool = False  # stopped by Ctrl-C or SIGTERM (a checkpoint was saved)
    signal: str | None = None  # the signal that stopped it: "SIGINT" or "SIGTERM"


class NonFiniteLossError(RuntimeError):
    """Training hit a NaN/inf loss or gradient norm; nothing was written after the last good checkpoint."""


# ---------------------------------------------------------------------------------------------------------- training


def train_stage(model_cfg: PrismeConfig | None, stage_cfg: StageConfig, *,
                dataset: TokenDataset | MQARDataset | None = None,
                callbacks: Sequence[Callable[[int, dict[str, float]], None]] = (),
                run_lock: RunLock | None = None) -> TrainResult:
    """Train one stage; see the module docstring.

    Args:
        model_cfg: the model config; required for a fresh backbone stage, optional otherwise (taken from the
            checkpoint; if given, a checkpoint of another config is a ValueError).
        stage_cfg: the stage's hyper-parameters and paths.
        dataset: use this dataset instead of building one from `stage_cfg.dataset` (tests, notebooks).
        callbacks: called as `cb(step, train_metrics)` after every optimizer step (rank 0 and others alike).
        run_lock: the caller's lock of `stage_cfg.out_dir` (taken before it wrote there: `prisme train --rebase`),
            used instead of the stage's own and left to the caller to release.
    Returns:
        TrainResult. Ctrl-C saves a checkpoint and returns with `interrupted=True`; a non-finite loss or gradient
        norm raises NonFiniteLossError and leaves the last good checkpoint as the newest one.
    """
    scfg = stage_cfg.validate()
    t_start = time.perf_counter()
    di = setup_distributed(scfg.device if scfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    lock = None  # one process per run folder, from here to the end
    try:
        if run_lock is not None and run_lock.out.resolve() != Path(scfg.out_dir).resolve():
            raise ValueError(f"run_lock holds {run_lock.out}, not the stage's out_dir {scfg.out_dir}")
        lock = RunLock(Path(scfg.out_dir)) if run_lock is None and di.main else None
        return _Trainer(model_cfg, scfg, dataset, di, t_start).run(callbacks)
    finally:
        if lock is not None:
            lock.release()
        if di.world > 1:  # free DDP's reducer and its gloo work objects (held in reference cycles) while the group
            gc.collect()  # and the interpreter are alive: freed at interpreter exit they abort the process
        if di.owns_group:
            import torch.distributed as dist

            with contextlib.suppress(Exception):  # let every rank finish before rank 0's store goes away
                dist.barrier()
            dist.destroy_process_group()


class _Trainer:
    """One stage's run: everything `train_stage` needs between setup and the result, in one place."""

    def __init__(self, model_cfg: PrismeConfig | None, scfg: StageConfig, dataset, di: DistInfo, t_start: float):
        # ---- everything that can fail on user input happens before anything is written
        check_layout(scfg, di)
        self.scfg, self.di, self.t_start = scfg, di, t_start
        self.device = device = resolve_device(scfg.device, di, scfg.tf32)
        model, meta = load_start(model_cfg, scfg)
        cfg = model.cfg
        spec = scfg.spec
        if spec.uses_workspace and not cfg.use_workspace:
            raise ValueError(f"stage {scfg.stage!r} needs a model with a workspace; {cfg.name!r} has "
                             f"use_workspace=False")
        needs = spec.needs
        if needs is not None and not getattr(cfg, needs):
            raise ValueError(f"stage {scfg.stage!r} trains the model's {needs}, but {cfg.name!r} has {needs}=False: "
                             f"build the model with {needs}=True from stage 1 on")
        self.data = dataset if dataset is not None else build_dataset(scfg, cfg.vocab_size)
        check_same_tokenizer(meta, self.data)
        self.T = scfg.seq_len or (self.data.cfg.seq_len if isinstance(self.data, MQARDataset) else cfg.max_seq_len)
        if self.T > cfg.max_seq_len:
            raise ValueError(f"seq_len={self.T} exceeds the model's max_seq_len={cfg.max_seq_len}")
        check_memory(scfg, cfg, self.T, di, device)
        for split in ("train", "val"):  # ValueError now if the data is too small
            self.data.batch(split, 1, self.T, torch.Generator().manual_seed(0))
        if scfg.log_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("log_tensorboard=True needs tensorboard: pip install 'prisme[tb]'") from None

        # ---- model, objective, generators
        self.model = model = model.to(device=device, dtype=DTYPES[scfg.dtype])
        if spec.uses_workspace:
            from prisme.model.compiled_editor import maybe_compile

            maybe_compile(model, scfg.compile)
        self.params = stage_parameters(model, scfg)
        if not self.params:
            raise ValueError(f"stage {scfg.stage!r} has no parameters to train in model {cfg.name!r}")
        self.objective = objective = spec.objective(model, scfg).to(device, DTYPES[scfg.dtype])  # + probes
        self.params += list(_own_parameters(objective).values())  # aux probes
        resuming = scfg.resume and meta is not None
        if resuming and "objective" in (meta.optimizer_state or {}):
            saved = meta.optimizer_state["objective"]
            own = _own_parameters(objective)
            if set(saved) != set(own):
                raise ValueError(f"{meta.path}: the checkpoint's objective weights {sorted(saved)} do not match this "
                                 f"stage's {sorted(own)}; resume with the same aux settings")
            with torch.no_grad():
                for n, p in own.items():
                    p.copy_(saved[n])
        self.step = meta.step if resuming else 0
        self.gens = {"data": torch.Generator().manual_seed(scfg.seed),
                     "sample": torch.Generator().manual_seed(scfg.seed + 1)}
        self.extra_state: dict[str, Any] = dict(meta.extra) if resuming else {}
        trained = ckpt.trained_groups(meta) if meta is not None else set()
        trained |= set(scfg.trained_groups)
        self.extra_state["trained_groups"] = sorted(trained)  # which parts of this model some stage has trained
        if resuming:
            restore_rng_state(self.gens, meta.rng, meta.path / ckpt.STATE)
        self.rng = rng_state(self.gens)  # generator states at the current step boundary (saved with checkpoints)
        self.updating = False
        if spec.calibrates_values:  # the value heads regress dL / scale
            if "value_scale" in self.extra_state:
                objective.scale = float(self.extra_state["value_scale"])
            else:  # the same calibration batch on every rank, from its own generator
                g = torch.Generator().manual_seed(scfg.seed + 3)
                xc, yc = self.data.batch("train", scfg.batch_size, self.T, g)
                fresh = meta is not None and not spec.owns(meta.stage)  # not a checkpoint of this stage
                exc = {k: v.to(device) for k, v in objective.sample(xc, yc, g).items()}  # with the batch
                objective.calibrate(xc.to(device), yc.to(device), exc, init_heads=fresh)
            self.extra_state["value_scale"] = objective.scale

        # ---- wrapper for several processes, optimizer
        self.wrapped = wrap_for_ranks(objective, scfg, di, device)
        self.opt = make_optimizer(self.wrapped, scfg)
        if resuming:  # `load_start` refused any setting that would not continue the run
            restore_optimizer(self.wrapped, self.opt, meta.optimizer_state, scfg, di, meta.path / ckpt.OPTIMIZER)
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if scfg.dtype == "bfloat16" \
            else contextlib.nullcontext

        # ---- outputs (rank 0 writes)
        self.out = Path(scfg.out_dir)
        self.last_ckpt = ckpt.latest_checkpoint(self.out) if resuming else None
        self.writer = None
        if di.main:
            self.out.mkdir(parents=True, exist_ok=True)
            if scfg.overwrite and not resuming:
                clear_run(self.out)
            write_text_atomic(self.out / "stage_config.json", json.dumps(scfg.to_dict(), indent=2) + "\n")
            if resuming:
                drop_rows_after(self.out / "metrics.jsonl", self.step)
            if scfg.log_tensorboard:
                self.writer = SummaryWriter(scfg.tensorboard_dir or str(self.out / "tb"))

    # ------------------------------------------------------------------------------------------------ pieces
    def log(self, row: dict[str, Any]) -> None:
        """Append a JSONL row to out_dir/metrics.jsonl (and tensorboard), rank 0 only."""
        if not self.di.main:
            return
        line = (json.dumps(row) + "\n").encode()
        fd = os.open(self.out / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:  # one write of the whole line: an interrupted append leaves at most a torn last line
            os.write(fd, line)
        finally:
            os.close(fd)
        if self.writer is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.writer.add_scalar(f"{row.get('split', 'train')}/{k}", v, row["step"])

    def evaluate(self) -> dict[str, float]:
        """The stage's metrics on `eval_batches` fixed validation batches (fixed random actions / positions too)."""
        scfg, obj = self.scfg, self.objective
        obj.eval()
        acc: dict[str, torch.Tensor] = {}
        g = torch.Generator().manual_seed(scfg.seed + 2)
        with torch.no_grad(), self.autocast():
            for x, y in self.data.iter_eval("val", scfg.batch_size, self.T, max_batches=scfg.eval_batches):
                ex = obj.sample(x, y, g)
                dn = obj.denominators(x, y, ex)
                _, st = self.wrapped(x.to(self.device), y.to(self.device),
                                     {k: v.to(self.device) for k, v in ex.items()}, dn)
                accumulate(acc, st)
        obj.train()
        return obj.summarise(stats_to_host(acc)) if acc else {}

    def save(self, metrics: dict[str, Any]) -> Path | None:
        """Checkpoint the current step boundary (collective under FSDP; rank 0 writes); returns its folder.

        Weights, optimizer and `self.rng` all describe the state after `self.step` steps: an interrupt in the
        middle of the next step's forward/backward has not touched them yet.
        """
        state_dict, opt_state = gather_state(self.wrapped, self.opt, self.scfg, self.di)
        aux = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()  # collective (FSDP)
               for n, p in _own_parameters(self.objective).items()}
        if aux:  # the objective's own weights (the aux_prev_token probe) travel with the optimizer state
            opt_state = {**opt_state, "objective": aux}
        if self.di.main:
            ckpt.clean_stale_temps(self.out)  # a killed earlier save's leftovers (this process is the only writer)
            state = ckpt.TrainingState(stage=self.scfg.stage, step=self.step, stage_config=self.scfg.to_dict(),
                                       optimizer_state=opt_state, rng=self.rng, metrics=metrics,
                                       extra=self.extra_state, tokenizer=getattr(self.data, "tokenizer", None))
            ckpt.save_checkpoint(self.out / ckpt.checkpoint_name(self.step), self.model, state, state_dict=state_dict)
            ckpt.prune_checkpoints(self.out, self.scfg.keep_last)
        rank_barrier(self.di)
        self.last_ckpt = ckpt.latest_checkpoint(self.out)
        return self.last_ckpt

    def train_step(self) -> dict[str, float]:
        """One optimizer step on one global batch; raises NonFiniteLossError before touching the weights."""
        scfg, di, obj, accum = self.scfg, self.di, self.objective, self.scfg.grad_accum
        x, y = self.data.batch("train", scfg.batch_size, self.T, self.gens["data"])  # [B, T], same on every rank
        ex = obj.sample(x, y, self.gens["sample"])
        dn = obj.denominators(x, y, ex)
        lrs = {k: lr_at(self.step, scfg, *v) for k, v in group_lrs(scfg).items()}
        lr = lrs["main"]
        for group in self.opt.param_groups:
            group["lr"] = lrs[group.get("kind", "main")]
        acc: dict[str, torch.Tensor] = {}
        for m in range(accum):
            xm, ym = upload(shard_rows(x, m, accum, di), self.device), upload(shard_rows(y, m, accum, di), self.device)
            exm = {k: upload(shard_rows(v, m, accum, di), self.device) for k, v in ex.items()}  # pinned, async
            with no_sync_unless_last(self.wrapped, di, last=m == accum - 1), self.autocast():
                loss, st = self.wrapped(xm, ym, exm, dn)
            (loss * di.world).backward()  # DDP/FSDP average over ranks; the loss is already a global mean
            accumulate(acc, {**st, "objective": loss.detach()})
        trainable = self.params if di.world == 1 else [p for p in self.wrapped.parameters() if p.requires_grad]
        norms = []
        for group in self._clip_groups(trainable):
            gn = torch.nn.utils.clip_grad_norm_(group, scfg.grad_clip if scfg.grad_clip > 0 else float("inf"))
            norms.append((gn.full_tensor() if hasattr(gn, "full_tensor") else gn).detach().double().reshape(1))
        # the statistics and the clip norms reach the host in one copy: one sync per step, not one per number
        acc = stats_to_host({**all_reduce_stats(acc, di, self.device), "grad_norms": torch.cat(norms)})
        objective = float(acc.pop("objective"))
        grad_norm = math.sqrt(sum(n * n for n in acc.pop("grad_norms").tolist()))
        if not (math.isfinite(objective) and math.isfinite(grad_norm)):
            self.opt.zero_grad(set_to_none=True)
            self.log({"step": self.step, "event": "non_finite", "loss": objective, "grad_norm": grad_norm})
            what = "loss" if not math.isfinite(objective) else "gradient norm"
            if self.last_ckpt is not None:
                where = (f"the last good checkpoint is {self.last_ckpt}. Lower lr, enable grad_clip or check the "
                         f"data, then resume with --resume")
            else:
                where = ("nothing was saved (no checkpoint had been written yet). Lower lr, enable grad_clip or "
                         "check the data, then start the stage again")
            raise NonFiniteLossError(
                f"stage {scfg.stage!r}: non-finite {what} (loss={objective}, grad_norm={grad_norm}) at step "
                f"{self.step + 1}; training stopped and nothing was written after it; {where}")
        self.updating = True  # an interrupt from here to the end of the step would leave a torn state
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.rng = rng_state(self.gens)
        self.updating = False
        extra_lr = {"lr_backbone": lrs["backbone"]} if "backbone" in lrs else {}
        return {"objective": objective, **obj.summarise(acc), "lr": lr, **extra_lr, "grad_norm": grad_norm}

    def _clip_groups(self, trainable: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """One clipping group, or backbone | the rest when the backbone learns from its own loss alone (so that its
        steps are the matched baseline's)."""
        if not getattr(self.objective, "isolate", False):
            return [trainable]
        ids = {id(p) for p in self.model.backbone_parameters()}
        return [[p for p in trainable if id(p) in ids], [p for p in trainable if id(p) not in ids]]

    # ------------------------------------------------------------------------------------------------ loop
    def run(self, callbacks: Sequence[Callable[[int, dict[str, float]], None]]) -> TrainResult:
        from tqdm.auto import tqdm

        scfg, di = self.scfg, self.di
        train_metrics: dict[str, float] = {}
        val_metrics: dict[str, float] = {}
        start_tokens = self.step * scfg.batch_size * self.T  # a resumed run continues the count
        tokens, tok_last, t_last = start_tokens, start_tokens, time.perf_counter()
        interrupted, stopped_by = False, None
        bar = tqdm(total=scfg.steps, initial=self.step, desc=scfg.stage, disable=not (di.main and scfg.progress),
                   dynamic_ncols=True)
        self.objective.train()
        try:
            with graceful_sigint() as sigint:
                while self.step < scfg.steps:
                    train_metrics = self.train_step()
                    step, now = self.step, time.perf_counter()
                    tokens += scfg.batch_size * self.T
                    if step % scfg.log_every == 0 or step == scfg.steps:
                        tps = (tokens - tok_last) / max(now - t_last, 1e-9)
                        t_last, tok_last = now, tokens
                        self.log({"step": step, "split": "train", **train_metrics, "tokens_per_s": tps,
                                  "tokens": tokens, "time_s": now - self.t_start})
                        bar.set_postfix(loss=f"{train_metrics['loss']:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
                    bar.update(1)
                    if (scfg.eval_every and step % scfg.eval_every == 0) or step == scfg.steps:
                        val_metrics = self.evaluate()
                        self.log({"step": step, "split": "val", **val_metrics})
                    if (scfg.ckpt_every and step % scfg.ckpt_every == 0) or step == scfg.steps:
                        self.save({"train": train_metrics, "val": val_metrics})
                    for cb in callbacks:
                        cb(step, train_metrics)
                    if any_rank(sigint["stop"], di, self.device):
                        raise KeyboardInterrupt
        except KeyboardInterrupt:
            interrupted = True
            stopped_by = sigint["signal"] or "SIGINT"
            bar.close()
            if self.updating:  # pragma: no cover - a second Ctrl-C inside optimizer.step(): weights may be torn
                raise
            if self.last_ckpt is None or self.last_ckpt.name != ckpt.checkpoint_name(self.step):
                self.save({"train": train_metrics, "val": val_metrics, "interrupted": True})
            if di.main:
                print(f"\n{stopped_by}: stopped at step {self.step}/{scfg.steps}; saved {self.last_ckpt}; continue "
                      f"with prisme train --resume --out {self.out}", file=sys.stderr)
        finally:
            bar.close()
            if self.writer is not None:
                self.writer.close()
        return TrainResult(stage=scfg.stage, out_dir=self.out, checkpoint=self.last_ckpt, step=self.step,
                           tokens=tokens - start_tokens, train=train_metrics, val=val_metrics,
                           wall_s=time.perf_counter() - self.t_start, interrupted=interrupted,
                           signal=stopped_by if interrupted else None)


def _own_parameters(objective: nn.Module) -> dict[str, nn.Parameter]:
    """The objective's own weights (e.g. the aux_prev_token probe), not the model's: trained and checkpointed too."""
    return {n: p for n, p in objective.named_parameters() if not n.startswith("model.")}
