"""Checkpoints: one folder per save, written atomically, read back with clear errors.

Layout of a checkpoint folder::

    ckpt_000200/
      model.safetensors   # weights (the PrismeModel state dict; the tied head is stored once)
      config.json         # PrismeConfig: the model can be rebuilt from this alone
      state.json          # schema_version, stage, step, StageConfig, RNG states, metrics, sha256 of the weights
      optimizer.pt        # optimizer state dict (absent for weights-only exports)

A run folder (a stage's `out_dir`) holds `ckpt_<step>` folders and a `latest` file naming the newest one;
`load_checkpoint(run_dir)` follows it. A checkpoint folder is first written under a temporary name next to its
final place (every file fsynced), then renamed into place, and only then is `latest` replaced (temp file +
`os.replace`): a crash (or a full disk) at any moment leaves the previous checkpoint or the new one, never half.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from prisme.checks import is_int
from prisme.config import PrismeConfig, complete_config, moved_fields
from prisme.data.tokenizers import TOKENIZER_FILE, ByteTokenizer, tokenizer_from_record, tokenizer_record
from prisme.io import current_umask, fsync_dir, json_default, loads_config, write_file, write_text_atomic

SCHEMA_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
STATE = "state.json"
OPTIMIZER = "optimizer.pt"
LATEST = "latest"
REQUIRED = (WEIGHTS, CONFIG, STATE)


@dataclass
class CheckpointMeta:
    """What a checkpoint says about itself (everything but the weights)."""

    path: Path  # the checkpoint folder
    config: PrismeConfig
    schema_version: int
    stage: str  # the stage that wrote it (`prisme.training.stages.STAGES`), or "export"
    step: int  # optimizer steps completed in this stage
    stage_config: dict[str, Any] = field(default_factory=dict)  # StageConfig.to_dict() of the run that wrote it
    rng: dict[str, Any] = field(default_factory=dict)  # name -> RNG state (see `encode_rng` / `decode_rng`)
    metrics: dict[str, Any] = field(default_factory=dict)  # last train/val metrics
    extra: dict[str, Any] = field(default_factory=dict)  # stage-specific state (e.g. the controller's target scale)
    optimizer_state: dict[str, Any] | None = None  # loaded by `load_checkpoint(..., load_optimizer=True)`
    optimizer_sha256: str | None = None  # what state.json records of optimizer.pt (None: written before it did)
    tokenizer: dict[str, Any] | None = None  # state.json's tokenizer record (None: written before it had one)
    moved: dict[str, Any] = field(default_factory=dict)  # config.json's fields that moved out of PrismeConfig, where
    #   they changed something (`config.MOVED_CONFIG_FIELDS`): the loaded model's decode options and default price


# ---------------------------------------------------------------------------------------------------------------- RNG


def encode_rng(state: torch.Tensor) -> str:
    """A generator state (uint8 tensor) as base64 text for JSON."""
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    """Inverse of `encode_rng`: a uint8 tensor for `Generator.set_state` / `torch.set_rng_state`."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


# ------------------------------------------------------------------------------------------------------- path helpers


def checkpoint_name(step: int) -> str:
    return f"ckpt_{step:06d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint folder that `run_dir/latest` names, or None when the run has not saved one yet."""
    pointer = Path(run_dir) / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{pointer} is not a UTF-8 checkpoint name; the run's pointer is corrupt (write the name of "
                         f"its newest ckpt_* folder into it, or remove it)") from None
    target = Path(run_dir) / name
    return target if name and target.is_dir() else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, given either the folder itself or a run folder with a `latest` pointer.

    Raises ValueError naming the missing file and what to do.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"checkpoint {p} does not exist; pass a checkpoint folder (with {WEIGHTS}, {CONFIG}, "
                         f"{STATE}) or a run folder written by `prisme train`")
    if p.is_file():
        raise ValueError(f"checkpoint {p} is a file; pass the folder that holds {WEIGHTS}, {CONFIG} and {STATE}")
    if not (p / STATE).exists() and (p / LATEST).is_file():
        found = latest_checkpoint(p)
        if found is None:
            raise ValueError(f"{p / LATEST} names {(p / LATEST).read_text().strip()!r}, which does not exist in {p}")
        p = found
    elif not (p / STATE).exists():  # a run folder whose `latest` was removed: its newest complete checkpoint
        complete = [c for c in sorted(p.glob("ckpt_*")) if all((c / name).is_file() for name in REQUIRED)]
        p = complete[-1] if complete else p
    missing = [name for name in REQUIRED if not (p / name).is_file()]
    if missing:
        raise ValueError(f"checkpoint {p} is missing {', '.join(str(p / m) for m in missing)}; it is not a complete "
                         f"checkpoint (run the stage that writes it, or pass another folder)")
    return p


# ------------------------------------------------------------------------------------------------------------- saving


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint records of its run beside the weights and the config (`save_checkpoint`): state.json's
    fields, the optimizer state (optimizer.pt) and the tokenizer (tokenizer.json); `CheckpointMeta` reads them back."""

    stage: str  # the stage that wrote it (`prisme.training.stages.STAGES`), or "export"
    step: int  # optimizer steps completed in this stage
    stage_config: dict[str, Any] | None = None  # StageConfig.to_dict() of the run (None: {})
    optimizer_state: dict[str, Any] | None = None  # `optimizer.state_dict()` (torch.save), or None: weights only
    rng: dict[str, Any] | None = None  # name -> RNG state (`encode_rng`; None: {})
    metrics: dict[str, Any] | None = None  # last train/val metrics (None: {})
    extra: dict[str, Any] | None = None  # stage-specific state (None: {})
    tokenizer: Any = "unrecorded"  # the training text's tokenizer (a BPE is saved as tokenizer.json in the folder,
    #   so that the checkpoint travels with it; `load_tokenizer` reads it back), None for token-id data (MQAR), or
    #   "unrecorded" (`load_tokenizer` then goes by the stage config, as for older checkpoints)


def save_checkpoint(path: str | Path, model: torch.nn.Module, state: TrainingState, *,
                    state_dict: dict[str, torch.Tensor] | None = None, update_latest: bool = True) -> Path:
    """Write a checkpoint folder atomically and return its path.

    Args:
        path: the checkpoint folder to create (replaced if it exists). Its parent is the run folder whose `latest`
            pointer is updated afterwards (unless `update_latest=False`).
        model: a PrismeModel (its `cfg` goes to config.json; its state dict to model.safetensors unless `state_dict`
            is given, e.g. gathered from FSDP shards).
        state: the run's stage, step, stage config, optimizer state, RNG states, metrics, extra state and tokenizer
            (`TrainingState`).
    """
    from safetensors.torch import save_file

    path = Path(path)
    optimizer_state, tokenizer = state.optimizer_state, state.tokenizer
    cfg: PrismeConfig = model.cfg
    sd = state_dict if state_dict is not None else model.state_dict()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700 folders
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", "schema_version": str(SCHEMA_VERSION)})
        os.chmod(tmp / WEIGHTS, 0o666 & ~current_umask())  # files follow the umask like every other write
        with open(tmp / WEIGHTS, "rb+") as f:
            os.fsync(f.fileno())
        digest = hashlib.sha256((tmp / WEIGHTS).read_bytes()).hexdigest()
        write_file(tmp / CONFIG, (cfg.to_json() + "\n").encode())
        opt_digest = None
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / OPTIMIZER)
            os.chmod(tmp / OPTIMIZER, 0o666 & ~current_umask())
            with open(tmp / OPTIMIZER, "rb+") as f:
                os.fsync(f.fileno())
            opt_digest = hashlib.sha256((tmp / OPTIMIZER).read_bytes()).hexdigest()
        tok_record, tok_file = tokenizer_record(tokenizer) if tokenizer != "unrecorded" else (None, None)
        if tok_file is not None:
            write_file(tmp / TOKENIZER_FILE, tok_file)
        record = {"schema_version": SCHEMA_VERSION, "stage": state.stage, "step": int(state.step),
                  **({"tokenizer": tok_record} if tok_record is not None else {}),
                  "stage_config": state.stage_config or {}, "rng": state.rng or {}, "metrics": state.metrics or {},
                  "extra": state.extra or {}, "weights_sha256": digest, "has_optimizer": optimizer_state is not None,
                  "optimizer_sha256": opt_digest, "torch_version": torch.__version__}
        write_file(tmp / STATE, (json.dumps(record, indent=2, sort_keys=True, default=json_default) + "\n").encode())
        fsync_dir(tmp)
        old = None
        if path.exists():  # move the old folder aside first: a directory rename cannot replace a non-empty one
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
            os.rename(path, old / path.name)
        os.rename(tmp, path)
        fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":  # disk full, quota, read-only, ...
            kept = (f"the previous checkpoint {prev} is intact" if (prev := latest_checkpoint(path.parent))
                    else "no earlier checkpoint was touched")  # the failed write touched neither it nor `latest`
            msg = f"could not write checkpoint {path} ({getattr(e, 'strerror', None) or e}); {kept}"
            raise (OSError(e.errno, msg) if getattr(e, "errno", None) else OSError(msg)) from e
        raise
    if update_latest:
        write_text_atomic(path.parent / LATEST, path.name + "\n")
    return path


def clean_stale_temps(run_dir: str | Path) -> list[Path]:
    """Remove what interrupted saves left in a run folder (`.ckpt_*.tmp-*` / `.ckpt_*.old-*` folders, `.*.tmp`
    files of atomic writes); returns what was removed. Only call it where no save is in progress (one writer)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    gone = []
    for p in run_dir.iterdir():
        name = p.name
        if p.is_dir() and name.startswith(".ckpt_") and (".tmp-" in name or ".old-" in name):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
        elif p.is_file() and name.startswith(".") and name.endswith(".tmp"):
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` `ckpt_*` folders of a run (never the one `latest` names)."""
    if keep_last <= 0:
        return
    run_dir = Path(run_dir)
    latest = latest_checkpoint(run_dir)
    folders = sorted(p for p in run_dir.glob("ckpt_*") if p.is_dir())
    for p in folders[:-keep_last]:
        if latest is None or p.resolve() != latest.resolve():
            shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------------ loading


# Checkpoint metadata this layer reads by stage name (it sits below training's `StageSpec`, and
# tests/test_stage_specs.py holds these tables to the specs): each stage ranked before the one it starts from.
STAGE_PREFERENCE = ("controller", "router", "workspace", "copy", "backbone", "export")
FIT_RECORD = "fit.json"  # in a `prisme fit` folder: its settings, stages and the deployable stage's folder


def find_model_checkpoint(path: str | Path) -> Path:
    """`path` itself if it is a checkpoint (or a run folder with `latest`); a `prisme fit` folder's deployable stage;
    else, for a folder holding runs (a demo or study folder), the checkpoint of its most trained stage found up to
    three levels down (controller, router, workspace, copy, then backbone; the newest if several). ValueError if there
    is none."""
    p = Path(path)
    if (p / FIT_RECORD).is_file():  # a `prisme fit` folder: its deployable stage, once the fit has finished
        final = json.loads((p / FIT_RECORD).read_text() or "{}").get("checkpoint")
        if not final:
            raise ValueError(f"{p} holds a fit that has not finished ({p / FIT_RECORD} names no deployable stage): "
                             f"rerun its `prisme fit` command to continue it")
        return resolve_checkpoint(p / final)
    try:
        return resolve_checkpoint(p)
    except ValueError:  # an incomplete checkpoint or run folder: its own error (which file is missing) is the answer
        if not p.is_dir() or any((p / n).exists() for n in (*REQUIRED, LATEST)) or any(p.glob("ckpt_*")):
            raise
    found = []
    for depth in ("*", "*/*", "*/*/*"):
        for run in sorted(p.glob(depth)):
            if run.is_dir() and (run / LATEST).is_file() and latest_checkpoint(run) is not None:
                found.append(latest_checkpoint(run))
    if not found:
        raise ValueError(f"{p} holds no checkpoint (no {STATE}, no `{LATEST}` pointer in it or in the folders below "
                         f"it); pass a stage folder written by `prisme train`")

    def rank(c: Path) -> tuple[int, float]:
        try:
            stage = json.loads((c / STATE).read_text()).get("stage")
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            stage = None
        return (STAGE_PREFERENCE.index(stage) if stage in STAGE_PREFERENCE else 9, -(c / STATE).stat().st_mtime)

    return min(found, key=rank)


def read_meta(path: str | Path) -> CheckpointMeta:
    """Config and state of a checkpoint, without its weights. Raises ValueError for a malformed checkpoint."""
    p = resolve_checkpoint(path)
    try:
        state = json.loads((p / STATE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p / STATE} is not valid JSON ({e}); the checkpoint is corrupt") from None
    if not isinstance(state, dict) or "schema_version" not in state:
        raise ValueError(f"{p / STATE} has no schema_version; it was not written by prisme.checkpoint")
    if state["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"{p} has checkpoint schema version {state['schema_version']}, but this prisme reads "
                         f"version {SCHEMA_VERSION}; load it with the prisme version that wrote it and re-export")
    try:
        d, moved = moved_fields(complete_config(_read_json_object(p / CONFIG), p / CONFIG))
        cfg = PrismeConfig.from_dict(d)
    except ValueError as e:
        raise ValueError(f"{p / CONFIG}: {e}") from None
    step = state.get("step", 0)
    if not is_int(step) or step < 0:
        raise ValueError(f"{p / STATE}: step must be an integer >= 0, got {step!r}; the checkpoint is corrupt")
    return CheckpointMeta(path=p, config=cfg, schema_version=state["schema_version"], stage=state.get("stage", "?"),
                          step=step, stage_config=state.get("stage_config", {}),
                          rng=state.get("rng", {}), metrics=state.get("metrics", {}), extra=state.get("extra", {}),
                          optimizer_sha256=state.get("optimizer_sha256"), tokenizer=state.get("tokenizer"),
                          moved=moved)


# The parameter groups each stage's checkpoint has trained, for checkpoints written before `trained_groups` was
# recorded in state.json's extra (every stage before the router started from its predecessor's checkpoint: its
# `StageSpec` chain's groups, tests/test_stage_specs.py).
_LEGACY_TRAINED = {"backbone": ("backbone",), "workspace": ("backbone", "workspace"),
                   "controller": ("backbone", "workspace", "controller"), "export": ("backbone",)}


def trained_groups(meta: CheckpointMeta) -> set[str]:
    """The parameter groups some stage trained for this checkpoint (the rest hold their initial weights)."""
    if "trained_groups" in meta.extra:
        return set(meta.extra["trained_groups"])
    return set(_LEGACY_TRAINED.get(meta.stage, ()))


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        d = loads_config(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"not a readable JSON file ({e})") from None
    if not isinstance(d, dict):
        raise ValueError("must hold a JSON object")
    return d


def _read_weights(p: Path, verify: bool) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    data = (p / WEIGHTS).read_bytes()
    state = json.loads((p / STATE).read_text())
    if verify and state.get("weights_sha256") and hashlib.sha256(data).hexdigest() != state["weights_sha256"]:
        raise ValueError(f"{p / WEIGHTS} does not match the sha256 recorded in {p / STATE}: the file is truncated "
                         f"or corrupt; restore it or use an earlier checkpoint")
    try:
        return st_load(data)
    except (SafetensorError, ValueError, RuntimeError, OSError) as e:
        raise ValueError(f"{p / WEIGHTS} is truncated or corrupt ({e}); restore it or use an earlier checkpoint") \
            from None


def load_checkpoint(path: str | Path, *, map_location: str | torch.device = "cpu",
                    expected_config: PrismeConfig | None = None, load_optimizer: bool = True,
                    verify: bool = True) -> tuple[torch.nn.Module, CheckpointMeta]:
    """Rebuild the model of a checkpoint and read its training state.

    Args:
        path: a checkpoint folder, or a run folder (its `latest` checkpoint).
        expected_config: if given, a checkpoint whose config differs from it (other than `name`/`extra`) is a
            ValueError listing the differing fields.
        load_optimizer: also read optimizer.pt into `meta.optimizer_state` (None when the checkpoint has none).
        verify: check the weights against the sha256 recorded at save time.
    Returns:
        (PrismeModel in the saved dtype on `map_location`, in eval mode, CheckpointMeta). A config.json written before
        `bank_tables`, `bank_store`, `slot_kv_cache`, `lambda_cost` and `kappa_risk` left PrismeConfig gives their
        values to the model: its `decode_options`, `execution` and `default_price`, so that it runs as it did.
    """
    from prisme.model.policy import Price
    from prisme.model.prisme import PrismeModel
    from prisme.options import DecodeOptions, ExecutionOptions

    try:
        dev = torch.device(map_location)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"map_location {map_location!r} is not a device: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"map_location {map_location!r}: CUDA is not available on this machine (use 'cpu')")
    meta = read_meta(path)
    p = meta.path
    if expected_config is not None:
        diff = expected_config.diff(meta.config)
        if diff:
            shown = ", ".join(f"{k}: expected {a!r}, checkpoint has {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"checkpoint {p} was written for another model config ({shown}); use a checkpoint of "
                             f"this config, drop the model override, or (a backbone for another workspace design) "
                             f"pass --rebase")
    tensors = _read_weights(p, verify)
    moved = {kind: {k: v for k, v in meta.moved.items() if k in {f.name for f in fields(kind)}}
             for kind in (DecodeOptions, Price, ExecutionOptions)}  # each moved field is one of theirs
    model = PrismeModel(meta.config, *(kind(**v) for kind, v in moved.items()))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    bad_shape = sorted(k for k in set(expected) & set(tensors) if tuple(expected[k].shape) != tuple(tensors[k].shape))
    if missing or unexpected or bad_shape:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        if bad_shape:
            parts.append("shape mismatch " + ", ".join(f"{k} {tuple(tensors[k].shape)} vs {tuple(expected[k].shape)}"
                                                       for k in bad_shape[:3]))
        raise ValueError(f"{p / WEIGHTS} does not fit the model of {p / CONFIG} ({'; '.join(parts)}): the weights "
                         f"come from another config")
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1 and dtypes != {torch.float32}:  # keep the saved precision (e.g. float64 runs)
        model = model.to(dtypes.pop())
    model.load_state_dict(tensors, strict=True)
    model = model.to(map_location).eval()
    if load_optimizer:
        opt = p / OPTIMIZER
        if opt.is_file():
            want = meta.optimizer_sha256
            if verify and want and hashlib.sha256(opt.read_bytes()).hexdigest() != want:
                raise ValueError(f"{opt} does not match the sha256 its {p / STATE} records: it was replaced or "
                                 f"damaged (another run's optimizer state?); restore it, or start from the weights "
                                 f"only with init_from")
            try:
                meta.optimizer_state = torch.load(opt, map_location=map_location, weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing here
                raise ValueError(f"{opt} is truncated or corrupt ({type(e).__name__}: {e}); restore it, or "
                                 f"start from the weights only with init_from") from None
    return model, meta


def load_model(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[torch.nn.Module, CheckpointMeta]:
    """The model of a checkpoint (weights + config, no optimizer state), in eval mode."""
    return load_checkpoint(path, map_location=map_location, load_optimizer=False)


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer a checkpoint (or run folder) was trained with: a `ByteTokenizer`, a `BPETokenizer` read from
    the checkpoint's own tokenizer.json, or None (token-id data such as MQAR). Checkpoints written before the
    tokenizer was recorded fall back to their stage config (its `dataset` and `tokenizer` path)."""
    return tokenizer_of(read_meta(path))


def tokenizer_of(meta: CheckpointMeta) -> Any:
    """`load_tokenizer` of a checkpoint whose meta is already read."""
    if meta.tokenizer is not None:
        return tokenizer_from_record(meta.tokenizer, meta.path)
    sc = meta.stage_config
    if sc.get("dataset") == "mqar":
        return None
    name = sc.get("tokenizer", "byte")
    return ByteTokenizer() if name == "byte" else tokenizer_from_record({"kind": "bpe", "file": str(name)}, meta.path)

