"""`prisme train`: flags (and a run config) to a `StageConfig`, then `train_stage`."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from prisme.config import PrismeConfig
from prisme.training.config import (
    StageConfig,
    load_run_config,
)
from prisme.training.trainer import NonFiniteLossError, train_stage

# ---------------------------------------------------------------------------------------------------------------- CLI


def main(args: Any) -> int:
    """`prisme train`: one stage from a run config JSON and/or flags; returns the process exit code."""
    if args.threads is not None and args.threads != -1:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1 (or -1 to leave torch's setting), got {args.threads}")
        torch.set_num_threads(args.threads)
    model_cfg, scfg = load_run_config(args.config) if args.config else (None, None)
    changes: dict[str, Any] = {}
    for flag, name in (("stage", "stage"), ("steps", "steps"), ("batch_size", "batch_size"), ("lr", "lr"),
                       ("out", "out_dir"), ("init_from", "init_from"), ("dataset", "dataset"), ("device", "device"),
                       ("dtype", "dtype"), ("parallel", "parallel"), ("seed", "seed"), ("seq_len", "seq_len"),
                       ("grad_accum", "grad_accum"), ("tokenizer", "tokenizer")):
        value = getattr(args, flag, None)
        if value is not None:
            changes[name] = value
    if args.resume:
        changes["resume"] = True
    if getattr(args, "reschedule", False):
        changes["reschedule"] = True
    if getattr(args, "overwrite", False):
        changes["overwrite"] = True
    if args.no_progress:
        changes["progress"] = False
    if args.backbone_keeps_learning:
        changes["train_backbone_in_workspace_stage"] = True
    if getattr(args, "compile", None):
        changes["compile"] = args.compile
    if getattr(args, "tf32", False):
        changes["tf32"] = True
    if getattr(args, "tensorboard", None):  # --tensorboard (into the run folder) or --tensorboard DIR
        changes["log_tensorboard"] = True
        if args.tensorboard is not True:
            changes["tensorboard_dir"] = args.tensorboard
    if scfg is None and args.resume:  # the run's own settings are the defaults; a flag may not change them
        scfg = saved_stage_config(changes.get("out_dir"))
    if scfg is None:
        if "stage" not in changes:
            raise ValueError("pass --config FILE or at least --stage")
        scfg = StageConfig(**changes).validate()
    else:
        scfg = scfg.replace(**changes)
    if args.preset:
        if model_cfg is not None and args.config:  # the preset would silently replace the config's model
            raise ValueError(f"--preset {args.preset} and the 'model' entry of {args.config} both name the model; "
                             f"use one (a preset's fields can be changed with --set model.FIELD=VALUE)")
        model_cfg = PrismeConfig.from_name(args.preset)
    scfg, model_cfg = apply_sets(getattr(args, "set", None) or [], scfg, model_cfg)
    if getattr(args, "tokenizer", None) is not None:
        check_tokenizer_option(scfg)
    lock = None
    try:
        if getattr(args, "rebase", False):  # the run folder's lock is held from the rebased start's write on
            from pathlib import Path

            from prisme.training.resume import RunLock

            lock = RunLock(Path(scfg.out_dir))
            scfg = rebased_start(scfg, model_cfg)
            model_cfg = None
        if scfg.may_start_fresh and model_cfg is None and scfg.init_from is None and not scfg.resume:
            raise ValueError(f"a fresh {scfg.stage} stage needs a model: --preset NAME or a 'model' entry in --config")
        result = train_stage(model_cfg, scfg, run_lock=lock)
    except NonFiniteLossError as e:
        print(f"prisme train: error: {e}", file=sys.stderr)
        return 1
    finally:
        if lock is not None:
            lock.release()
    if int(os.environ.get("RANK", "0")) == 0:
        shown = ", ".join(f"{k} {v:.4g}" for k, v in result.val.items())
        print(f"{result.stage}: {result.step} steps, {result.tokens:,} tokens in {result.wall_s:.1f} s; "
              f"val {shown or '-'}; checkpoint {result.checkpoint}")
        if not result.interrupted and result.step > 0:
            from prisme.training.curves import plot_run

            print(f"curves: {plot_run(result.out_dir)}")
    return {"SIGTERM": 143, "SIGINT": 130}.get(result.signal or "", 130) if result.interrupted else 0


def check_tokenizer_option(scfg: StageConfig) -> None:
    """An explicit `--tokenizer` is the one the data is read with: ValueError for token-id data (MQAR: it would be
    ignored) and for a prepared folder of another tokenizer (`--tokenizer byte` included), before anything is
    written."""
    from prisme.data.shards import ShardDataset, is_prepared
    from prisme.training.config import check_prepared_tokenizer

    if scfg.dataset == "mqar":
        raise ValueError(f"--tokenizer {scfg.tokenizer}: the mqar dataset is token ids, read by no tokenizer; leave "
                         f"--tokenizer out")
    if is_prepared(scfg.dataset):
        check_prepared_tokenizer(ShardDataset(scfg.dataset), scfg.tokenizer, byte_asked=True)


def saved_stage_config(out_dir: str | None) -> StageConfig:
    """The StageConfig of the run in `out_dir` (its latest checkpoint's), for `--resume` without `--config`."""
    from pathlib import Path

    from prisme import checkpoint as ckpt

    if out_dir is None:
        raise ValueError("--resume needs --out RUN_FOLDER (or a --config naming it)")
    found = ckpt.latest_checkpoint(Path(out_dir))
    if found is None:
        raise ValueError(f"--resume: {out_dir} holds no checkpoint ({Path(out_dir) / ckpt.LATEST} is missing); start "
                         f"the stage without --resume")
    return StageConfig.from_dict(ckpt.read_meta(found).stage_config)


def parse_set(item: str) -> tuple[str, Any]:
    """`key=value` -> (key, value): the value read as JSON (numbers, true/false, null, lists), else as a string."""
    import json

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {item!r}: expected FIELD=VALUE (e.g. --set warmup=100 or --set model.d_model=128)")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def apply_sets(items: list[str], scfg: StageConfig, model_cfg: PrismeConfig | None
               ) -> tuple[StageConfig, PrismeConfig | None]:
    """`--set FIELD=VALUE` (repeatable) on the stage config, or `--set model.FIELD=VALUE` on the model config; every
    value type-checked by the config's own validation, a ValueError naming the field otherwise."""
    import dataclasses

    stage_fields = {f.name for f in dataclasses.fields(StageConfig)}
    model_fields = {f.name for f in dataclasses.fields(PrismeConfig)}
    stage_changes: dict[str, Any] = {}
    model_changes: dict[str, Any] = {}
    for item in items:
        key, value = parse_set(item)
        if key.startswith("model."):
            name = key.removeprefix("model.")
            if name not in model_fields:
                raise ValueError(f"--set {key}: PrismeConfig has no field {name!r}")
            model_changes[name] = value
        elif key in stage_fields:
            stage_changes[key] = value
        else:
            hint = " (model fields take the prefix model.)" if key in model_fields else ""
            raise ValueError(f"--set {key}: StageConfig has no field {key!r}{hint}")
    if model_changes:
        if model_cfg is None:
            raise ValueError(f"--set model.{next(iter(model_changes))}: this run takes its model from a checkpoint; "
                             f"a model field can be set with --preset or a config's 'model' entry")
        try:
            model_cfg = model_cfg.replace(**model_changes)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--set model.*: {e}") from None
    if stage_changes:
        try:
            scfg = scfg.replace(**stage_changes).validate()
        except (TypeError, ValueError) as e:
            raise ValueError(f"--set: {e}") from None
    return scfg, model_cfg


def rebased_start(scfg: StageConfig, model_cfg: PrismeConfig | None) -> StageConfig:
    """`--rebase`: `init_from`'s trained groups `StageSpec.rebase_keeps` (the backbone; and the workspace, for a
    controller or router stage) under the asked model config, the other parameters initialised as a fresh model of
    that config with the stage's seed (`prisme.rebase.rebase`); written to OUT/0_rebased_init, which becomes the
    stage's init_from."""
    from pathlib import Path

    from prisme.rebase import rebase
    from prisme.training.resume import check_fresh_run

    keep = scfg.spec.rebase_keeps  # the groups of init_from the stage keeps; none: the first stage does not rebase
    if scfg.init_from is None or model_cfg is None or not keep or scfg.resume:
        raise ValueError("--rebase needs --init-from (a trained checkpoint), the new model (--preset, a config's "
                         "'model', --set model.FIELD=...) and a stage after the backbone, without --resume")
    check_fresh_run(Path(scfg.out_dir), scfg.overwrite)  # before the rebased start is written into the folder
    folder = Path(scfg.out_dir) / "0_rebased_init"
    from prisme.training.config import stage_tokenizer

    path = rebase(scfg.init_from, model_cfg, folder, seed=scfg.seed, keep=keep, tokenizer=stage_tokenizer(scfg))
    print(f"rebased {scfg.init_from} under {model_cfg.name!r}: kept its {' and '.join(keep)}, the rest initialised "
          f"as a fresh model with seed {scfg.seed}; written to {path}", file=sys.stderr)
    return scfg.replace(init_from=str(path))

