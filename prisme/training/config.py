"""What a training stage is told: `StageConfig` (every field validated, JSON round trip), run configs
(configs/*.json: a stage plus an optional model), the dataset a stage trains on, and the demo's four-run recipe."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prisme.checks import COMPILE_SETTINGS, check_choice, check_fields
from prisme.config import PrismeConfig, reject_unknown_fields, with_added_fields
from prisme.data.mqar import MQARConfig, MQARDataset
from prisme.data.text import TokenDataset
from prisme.io import CONFIG_DIR, loads_config
from prisme.training.stages import STAGE_SPECS, STAGES, StageSpec

RESUME_FREE = ("steps", "resume", "reschedule", "overwrite", "out_dir", "init_from", "progress", "log_every",
               "eval_every", "eval_batches", "ckpt_every", "keep_last", "log_tensorboard", "tensorboard_dir", "device",
               "cache_dir", "compile", "tf32")  # what a resumed run may change without changing the run it continues
# StageConfig fields added since stage configs were first recorded, at the values that reproduce what a run recorded
# before them did (a study's record of its stages is completed with them: `stage_with_added_fields`)
ADDED_STAGE_FIELDS: dict[str, Any] = {"backbone_trains": "all"}
BACKBONE_TRAINS = ("all", "embedding")  # `backbone_trains`: what of the backbone learns when it joins stage 2
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.float32}


# ---------------------------------------------------------------------------------------------------------- configs


@dataclass
class StageConfig:
    """One training stage. Load from JSON with `StageConfig.from_json` / `load_run_config`."""

    stage: str = "backbone"  # "backbone" | "workspace" | "controller" | "router" (`STAGE_SPECS`; `spec`)
    steps: int = 200  # optimizer steps of this stage (the cosine schedule ends here)
    batch_size: int = 16  # global batch: sequences per optimizer step, over all ranks and accumulation steps
    seq_len: int | None = None  # tokens per sequence (default: the model's max_seq_len; MQAR: its seq_len)
    grad_accum: int = 1  # micro-batches per optimizer step on each rank
    lr: float = 3e-3  # peak learning rate, reached after `warmup` steps
    min_lr: float = 3e-4  # learning rate at the end of the cosine decay
    warmup: int = 20  # linear warm-up steps
    weight_decay: float = 0.1  # AdamW decay, on >= 2-D weights only (not on gains, biases, b_v, b_r)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = no clipping (the norm is still logged)
    eval_every: int = 50  # validate every this many steps and at the end; 0 = only at the end
    eval_batches: int = 4  # validation batches per evaluation
    ckpt_every: int = 0  # also checkpoint every this many steps; 0 = only at the end (and on Ctrl-C)
    keep_last: int = 2  # checkpoint folders kept in out_dir (older ones are deleted); 0 = keep all
    seed: int = 1337  # model init (fresh stage 1), data order, forced actions and oracle positions
    dataset: str = "austen"  # "austen" (embedded corpus), a text file or folder, or "mqar" (synthetic recall)
    tokenizer: str = "byte"  # "byte" (UTF-8 bytes, V=256) or the path of a saved BPE tokenizer JSON
    val_fraction: float = 0.1  # tail of the token stream held out for validation (text datasets)
    mqar: dict[str, Any] = field(default_factory=dict)  # MQARConfig fields when dataset == "mqar"
    cache_dir: str | None = None  # token cache folder for text datasets (None: encode every run)
    out_dir: str = "runs/stage"  # run folder: ckpt_* folders, `latest`, metrics.jsonl, stage_config.json
    init_from: str | None = None  # checkpoint (or run folder) to start from; required by workspace/controller
    resume: bool = False  # continue out_dir's latest checkpoint exactly (weights, optimizer, step, RNGs)
    reschedule: bool = False  # with resume: accept another `steps` than the run was started with (a new lr schedule)
    overwrite: bool = False  # a fresh run into an out_dir that holds another run's checkpoints or metrics replaces
    #   them (without it: a ValueError naming --resume and --overwrite)
    # --- workspace stage
    train_backbone_in_workspace_stage: bool = False  # let the backbone keep learning in stage 2 (SPEC §5 lesson)
    backbone_aux_weight: float = 1.0  # with the option above: weight of the backbone head's own LM loss
    aux_prev_token: float = 0.0  # with the option above: weight of a linear probe's CE predicting token t-1 from H[t]
    workspace_grad_to_backbone: bool = True  # with the option above; False: the backbone learns from its own LM loss
    #   alone (the workspace's loss does not reach it, gradients clipped per group), i.e. as the matched baseline does
    backbone_trains: str = "all"  # with the option above: every backbone weight learns, or ("embedding") its token
    #   embedding alone, what an embedding bank reads (the blocks stay as the backbone stage left them)
    backbone_lr: float | None = None  # with the option above: the backbone's peak lr (default: lr)
    backbone_min_lr: float | None = None  # with the option above: its final lr (default: min_lr, at most backbone_lr)
    deep_supervision: float = 0.0  # weight of the CE after every intermediate forced step (0 = final state only)
    min_budget: int = 1  # forced budgets are drawn uniformly per position from [min_budget, max_budget]
    max_budget: int | None = None  # default: the model's r_max (also bounds the controller stage's rollouts: train the
    #   controller for the budgets its workspace was trained for)
    p_dense: float = 0.0  # probability that a forced step is DENSE (trains the dense baseline's path too)
    workspace_positions: int = 0  # > 0: the workspace trains at this many of each sequence's labelled positions,
    #   drawn anew each step (all where fewer); 0: at every one. Each reads its whole bank, so at long contexts the
    #   stage costs P / T of training at every position (a deployed router edits a few percent of them)
    # --- controller and router stages
    oracle_positions: int = 16  # positions per sequence where every candidate action is executed
    oracle_greedy: float = 0.5  # behaviour policy: P(follow the oracle's best action), else a random action
    value_clip: float = 5.0  # dL targets are clipped to +- value_clip * scale (scale: std of dL at the start)
    risk_weight: float = 1.0  # weight of the risk head's loss
    unlabelled_value: str = "zero"  # sampled positions without a label (MQAR: all but the queries): "zero" = targets
    #   with dL = 0 for every action (an edit there changes no scored loss, and the controller must learn so);
    #   "skip" = left out of the value loss
    # --- system
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:N"
    dtype: str = "float32"  # parameter dtype: "float32" | "float64"; "bfloat16" = bf16 autocast, fp32 weights
    parallel: str = "ddp"  # with several processes: "ddp" (DistributedDataParallel) or "fsdp" (FSDP2 fully_shard)
    log_every: int = 10  # JSONL/tensorboard train row every this many steps
    log_tensorboard: bool = False  # also write tensorboard events to out_dir/tb (needs `pip install prisme[tb]`)
    tensorboard_dir: str | None = None  # where the events go instead of out_dir/tb
    progress: bool = True  # tqdm progress bar (rank 0)
    compile: str = "off"  # workspace and controller stages: "auto" = the editor under torch.compile where it works
    #   (one warning and eager elsewhere), "strict" = an error where it cannot compile, "off" = eager
    tf32: bool = False  # allow TF32 matmuls on CUDA (`prisme.devices.set_tf32`); off = PyTorch's float32 default

    @property
    def spec(self) -> StageSpec:
        """The stage's `StageSpec` (`STAGE_SPECS`); ValueError naming the stages for an unknown one."""
        if self.stage not in STAGE_SPECS:
            raise ValueError(f"StageConfig: stage must be one of {STAGES}, got {self.stage!r}")
        return STAGE_SPECS[self.stage]

    @property
    def trained_groups(self) -> tuple[str, ...]:
        """The parameter groups this stage trains, in the optimizer's order (`StageSpec.trained_groups`)."""
        return self.spec.trained_groups(self.train_backbone_in_workspace_stage)

    @property
    def backbone_joins(self) -> bool:
        """Whether the backbone learns next to the stage's own group (the workspace stage with
        train_backbone_in_workspace_stage): its parameters come first, with their own lr (`backbone_lr`)."""
        return self.spec.backbone_joins and self.train_backbone_in_workspace_stage

    @property
    def may_start_fresh(self) -> bool:
        """Whether the stage can start from a fresh model (no init_from): stage 1, or the workspace stage when the
        backbone learns in it too (joint training from scratch)."""
        return self.spec.may_start_fresh(self.train_backbone_in_workspace_stage)

    @property
    def prev_token_probe_weight(self) -> float:
        """The aux_prev_token probe's loss weight: `aux_prev_token` where the stage's spec trains the probe
        (`StageSpec.prev_token_probe`), else 0 (no probe)."""
        return self.aux_prev_token if self.spec.prev_token_probe else 0.0

    def validate(self) -> StageConfig:
        """Raise ValueError naming the field for every bad value; returns self."""

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"StageConfig: {msg}")

        check_fields(self, "StageConfig: ")  # bools are bools, floats finite, strings strings
        need(self.stage in STAGES, f"stage must be one of {STAGES}, got {self.stage!r}")
        for f in ("steps", "batch_size", "grad_accum", "eval_batches", "log_every", "oracle_positions",
                  "min_budget"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{f} must be an int >= 1, got {v!r}")
        for f in ("warmup", "eval_every", "ckpt_every", "keep_last", "seed", "workspace_positions"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"{f} must be an int >= 0, got {v!r}")
        need(self.seed < 2**63 - 8, f"seed must be below 2**63 (a torch generator seed), got {self.seed}")
        need(self.seq_len is None or (isinstance(self.seq_len, int) and self.seq_len >= 1),
             f"seq_len must be None or an int >= 1, got {self.seq_len!r}")
        need(self.max_budget is None or (isinstance(self.max_budget, int) and self.max_budget >= self.min_budget),
             f"max_budget must be None or an int >= min_budget={self.min_budget}, got {self.max_budget!r}")
        need(self.lr > 0 and math.isfinite(self.lr), f"lr must be > 0, got {self.lr}")
        need(0 <= self.min_lr <= self.lr, f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        for f, top in (("backbone_lr", None), ("backbone_min_lr", self.backbone_lr or self.lr)):
            v = getattr(self, f)
            need(v is None or (v >= 0 and math.isfinite(v) and (top is None or v <= top)),
                 f"{f} must be None or a finite value >= 0{'' if top is None else f' and <= {top}'}, got {v!r}")
        need(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        need(all(0 <= b < 1 for b in self.betas), f"betas must be two values in [0, 1), got {self.betas}")
        need(self.eps > 0, f"eps must be > 0, got {self.eps}")
        need(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 = off), got {self.grad_clip}")
        need(0 <= self.val_fraction < 1, f"val_fraction must be in [0, 1), got {self.val_fraction}")
        need(0 <= self.p_dense <= 1, f"p_dense must be in [0, 1], got {self.p_dense}")
        need(0 <= self.oracle_greedy <= 1, f"oracle_greedy must be in [0, 1], got {self.oracle_greedy}")
        need(self.value_clip > 0, f"value_clip must be > 0, got {self.value_clip}")
        need(self.unlabelled_value in ("zero", "skip"), f"unlabelled_value must be 'zero' or 'skip', got "
             f"{self.unlabelled_value!r}")
        for f in ("backbone_aux_weight", "aux_prev_token", "deep_supervision", "risk_weight"):
            need(getattr(self, f) >= 0, f"{f} must be >= 0, got {getattr(self, f)}")
        need((self.backbone_lr is None and self.backbone_min_lr is None) or self.train_backbone_in_workspace_stage,
             "backbone_lr / backbone_min_lr need train_backbone_in_workspace_stage=True (a frozen backbone has no lr)")
        own_loss = self.train_backbone_in_workspace_stage and self.backbone_aux_weight > 0
        need(self.workspace_grad_to_backbone or own_loss, "workspace_grad_to_backbone=False needs "
             "train_backbone_in_workspace_stage=True and backbone_aux_weight > 0 (it learns from its own loss)")
        need(self.backbone_trains in BACKBONE_TRAINS, f"backbone_trains must be one of {list(BACKBONE_TRAINS)}, got "
                                                      f"{self.backbone_trains!r}")
        need(self.backbone_trains == "all" or self.train_backbone_in_workspace_stage,
             f"backbone_trains={self.backbone_trains!r} needs train_backbone_in_workspace_stage=True")
        need(self.aux_prev_token == 0 or self.train_backbone_in_workspace_stage,
             f"aux_prev_token={self.aux_prev_token} needs train_backbone_in_workspace_stage=True (it trains H)")
        need(self.dtype in DTYPES, f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        need(self.parallel in ("ddp", "fsdp"), f"parallel must be 'ddp' or 'fsdp', got {self.parallel!r}")
        check_choice("compile", self.compile, COMPILE_SETTINGS, "StageConfig: ")
        need(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
             f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        need(isinstance(self.mqar, dict), f"mqar must be a dict of MQARConfig fields, got {type(self.mqar).__name__}")
        need(bool(self.out_dir), "out_dir must be a folder path")
        need(not (self.resume and self.overwrite), "resume and overwrite exclude each other: continue the run in "
             "out_dir, or replace it")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageConfig:
        reject_unknown_fields(cls, d)
        d = dict(d)
        if isinstance(d.get("betas"), list):  # JSON's list; anything else is `validate`'s to name
            d["betas"] = tuple(d["betas"])
        return cls(**d).validate()

    def replace(self, **changes: Any) -> StageConfig:
        return StageConfig.from_dict({**self.to_dict(), **changes})


def load_run_config(path: str | Path) -> tuple[PrismeConfig | None, StageConfig]:
    """Read a run config JSON: StageConfig fields plus an optional "model" entry.

    "model" is a preset name (`"demo"`), a dict `{"preset": "demo", ...PrismeConfig overrides}` or a full
    PrismeConfig dict; leave it out for stages that take the model from `init_from`.
    """
    p = Path(path)
    if not p.is_file() and p.parent == Path("."):  # a shipped recipe by name: `--config demo_backbone`
        p = next((c for c in (CONFIG_DIR / p.name, CONFIG_DIR / f"{p.name}.json") if c.is_file()), p)
    if not p.is_file():
        shipped = ", ".join(sorted(c.stem for c in CONFIG_DIR.glob("*.json")))
        raise ValueError(f"run config {p} does not exist (a JSON file, or a shipped recipe: {shipped})")
    try:
        d = loads_config(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"run config {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"run config {p} is not valid JSON: {e}") from None
    except ValueError as e:
        raise ValueError(f"run config {p}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"run config {p} must hold a JSON object")
    d = dict(d)
    d.pop("description", None)
    model = d.pop("model", None)
    if model is None:
        model_cfg = None
    elif isinstance(model, str):
        model_cfg = PrismeConfig.from_name(model)
    elif isinstance(model, dict) and "preset" in model:
        m = dict(model)
        model_cfg = PrismeConfig.from_name(m.pop("preset"), **m)
    elif isinstance(model, dict):
        model_cfg = PrismeConfig.from_dict(model)
    else:
        raise ValueError(f"run config {p}: 'model' must be a preset name or a dict, got {type(model).__name__}")
    return model_cfg, StageConfig.from_dict(d)


# ------------------------------------------------------------------------------------------------------ data helpers


def build_dataset(scfg: StageConfig, vocab_size: int) -> TokenDataset | MQARDataset:
    """The stage's dataset: the embedded corpus, a text path (byte or BPE tokens), or MQAR."""
    from prisme.data.text import load_text
    from prisme.data.tokenizers import tokenizer_named

    if scfg.dataset == "mqar":
        reject_unknown_fields(MQARConfig, scfg.mqar, "StageConfig.mqar: ")
        m = dict(scfg.mqar)
        if scfg.seq_len is not None:
            m["seq_len"] = scfg.seq_len
        mcfg = MQARConfig(**m)
        if mcfg.vocab_size > vocab_size:
            raise ValueError(f"MQAR vocab_size={mcfg.vocab_size} exceeds the model's vocab_size={vocab_size}")
        return MQARDataset(mcfg)
    from prisme.data.shards import ShardDataset, is_prepared

    if is_prepared(scfg.dataset):  # `prisme data prepare`'s token files: the tokens are already made
        ds = ShardDataset(scfg.dataset)
        check_prepared_tokenizer(ds, scfg.tokenizer)
        if ds.n_tokens("val") == 0:
            raise ValueError(f"{scfg.dataset} has no validation documents (prepared with val_fraction 0); prepare it "
                             f"again with --val-fraction > 0 from two or more documents")
        if ds.vocab_size > vocab_size:
            raise ValueError(f"{scfg.dataset}'s tokenizer has {ds.vocab_size} ids but the model's vocab_size is "
                             f"{vocab_size}; use a model with vocab_size >= {ds.vocab_size}")
        return ds
    tok = tokenizer_named(scfg.tokenizer)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {scfg.tokenizer!r} has {tok.vocab_size} ids but the model's vocab_size is "
                         f"{vocab_size}; use a model with vocab_size >= {tok.vocab_size}")
    return TokenDataset.from_text(load_text(scfg.dataset), tok, val_fraction=scfg.val_fraction,
                                  cache_dir=scfg.cache_dir, name="corpus")


def check_prepared_tokenizer(ds: Any, name: str, byte_asked: bool = False) -> None:
    """ValueError naming both when the tokenizer `name` is not the one prepared folder `ds` was made with. The
    default "byte" means "the prepared one" unless it was asked for (`byte_asked`: an explicit --tokenizer byte)."""
    from prisme.data.tokenizers import describe_tokenizer, tokenizer_identity, tokenizer_named

    if name == "byte" and not byte_asked:
        return
    asked = tokenizer_named(name)
    if asked.identity != tokenizer_identity(ds.tokenizer):
        raise ValueError(f"{ds.path} was prepared with {describe_tokenizer(ds.tokenizer)}, not --tokenizer {name} "
                         f"({describe_tokenizer(asked)}); prepare it again with this one, or leave --tokenizer out "
                         f"(the prepared one is used)")


def stage_tokenizer(scfg: StageConfig) -> Any:
    """The tokenizer the stage's dataset is read with, without reading the data: None for MQAR (token ids), a
    prepared folder's own, else `scfg.tokenizer`."""
    from prisme.data.shards import ShardDataset, is_prepared
    from prisme.data.tokenizers import tokenizer_named

    if scfg.dataset == "mqar":
        return None
    if is_prepared(scfg.dataset):
        ds = ShardDataset(scfg.dataset)
        check_prepared_tokenizer(ds, scfg.tokenizer)
        return ds.tokenizer
    return tokenizer_named(scfg.tokenizer)


def check_same_tokenizer(meta: Any, data: Any) -> None:
    """ValueError when a stage would train on other tokens than the checkpoint it starts from (or resumes) was
    trained on: the embedding rows would mean other strings. `data`: the stage's dataset (its `tokenizer`; token-id
    data has none)."""
    check_start_tokenizer(meta, getattr(data, "tokenizer", None))


def check_start_tokenizer(meta: Any, ours: Any) -> None:
    """`check_same_tokenizer` for the stage's tokenizer `ours` (None: token ids). A checkpoint that recorded no
    tokenizer is compared only with a text tokenizer (its own is then a guess from its stage config)."""
    from prisme.checkpoint import tokenizer_of
    from prisme.data.tokenizers import describe_tokenizer, tokenizer_identity

    if meta is None or (ours is None and meta.tokenizer is None):
        return
    theirs = tokenizer_of(meta)
    if (theirs is not None or meta.tokenizer is not None) and tokenizer_identity(theirs) != tokenizer_identity(ours):
        fix = (f"pass --tokenizer {meta.path / 'tokenizer.json'} (a checkpoint folder also works)" if theirs is not None
               and theirs.identity.startswith("bpe-") else "train on data of the checkpoint's tokenizer")
        raise ValueError(f"this stage's tokenizer ({describe_tokenizer(ours)}) is not the one {meta.path} was trained "
                         f"with ({describe_tokenizer(theirs)}); {fix}, or start from a checkpoint of this tokenizer")


# --------------------------------------------------------------------------------------------- the demo's recipe
DEMO_CONFIGS = {"backbone": "demo_backbone.json", "workspace": "demo_workspace.json",
                "matched": "demo_backbone_matched.json", "controller": "demo_controller.json"}
_FOLDERS = {"backbone": "1_backbone", "workspace": "2_workspace", "matched": "3_backbone_matched",
            "controller": "4_controller"}


def demo_stage_configs(run: Path, scale: float = 1.0, seed: int = 1337, backbone_keeps_learning: bool = False,
                       seq_len: int = 128, config_dir: str | Path | None = None) -> dict[str, StageConfig]:
    """The demo's four runs, read from prisme/configs/demo_*.json (what `prisme train --config` runs), placed in `run`.

    `scale` multiplies every step count (0.05 makes a smoke run); `seq_len` caps the sequence length (small test
    models). The matched run's steps are set so that it sees as many tokens as the workspace stage.
    """
    folder = Path(config_dir) if config_dir else CONFIG_DIR
    missing = [str(folder / f) for f in DEMO_CONFIGS.values() if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"the demo's recipe is missing {missing}")

    def steps(n: int) -> int:
        return max(2, round(n * scale))

    out: dict[str, StageConfig] = {}
    for name, file in DEMO_CONFIGS.items():
        _, s = load_run_config(folder / file)
        s = s.replace(steps=steps(s.steps), warmup=min(steps(s.warmup), steps(s.steps)),
                      eval_every=steps(s.eval_every) if s.eval_every else 0, seed=seed,
                      seq_len=min(seq_len, s.seq_len or seq_len), out_dir=str(run / _FOLDERS[name]), keep_last=1,
                      init_from=None if name == "backbone" else str(run / _FOLDERS["workspace" if name ==
                                                                                     "controller" else "backbone"]))
        out[name] = s
    s2 = out["workspace"]
    if backbone_keeps_learning:  # the backbone takes exactly the matched baseline's steps; the workspace rides on it
        out["workspace"] = s2.replace(train_backbone_in_workspace_stage=True, workspace_grad_to_backbone=False,
                                      backbone_lr=1e-3, backbone_min_lr=3e-4)
    m = out["matched"]
    tokens_ws = s2.steps * s2.batch_size * s2.seq_len
    out["matched"] = m.replace(steps=max(2, math.ceil(tokens_ws / (m.batch_size * m.seq_len))))
    return out


def stage_with_added_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A recorded stage config dict with the fields of `ADDED_STAGE_FIELDS` it lacks, at the values that reproduce
    what it ran."""
    return with_added_fields(d, ADDED_STAGE_FIELDS)
