"""A trained checkpoint under another model config: the backbone (and optionally the workspace) kept, the other
parameter groups initialised as a fresh model of the new config would be (`prisme train --init-from ... --rebase`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from prisme.checkpoint import TrainingState, checkpoint_name, load_checkpoint, save_checkpoint, tokenizer_of
from prisme.config import PrismeConfig
from prisme.data.tokenizers import describe_tokenizer, tokenizer_identity

BACKBONE_FIELDS = ("family", "vocab_size", "max_seq_len", "d_model", "n_layer", "n_head", "n_kv_head", "ffn_hidden",
                   "ffn_multiple_of", "rope_theta", "norm_eps", "tie_embeddings", "init_std", "key_shift",
                   "attn_window")
# What a rebase writes, by the parameter groups it keeps: the stage of its checkpoint (a checkpoint metadata value;
# the training stage that starts from it keeps `prisme.training.stages.StageSpec.rebase_keeps`). A stage-1
# checkpoint is rebased from a stage-1 checkpoint only (a later stage's backbone may have learnt); keeping the
# workspace too needs a checkpoint past stage 1 (a stage-1 checkpoint's workspace is untrained).
REBASES = {("backbone",): "backbone", ("backbone", "workspace"): "workspace"}
STAGE1 = (REBASES[("backbone",)],)  # the checkpoint stages that are stage 1's result and nothing more


def rebase(path: str | Path, cfg: PrismeConfig, out_dir: str | Path, seed: int,
           keep: tuple[str, ...] = ("backbone",), tokenizer: Any = "unchecked") -> Path:
    """A checkpoint of `path`'s trained parameter groups `keep` under another config `cfg`; the other groups are
    initialised as `torch.manual_seed(seed); PrismeModel(cfg)` does.

    keep=("backbone",): a stage-1 checkpoint. Stage 1 trains the backbone alone and never touches the workspace, and
    `PrismeModel` builds (and seeds) the backbone first, so training stage 1 with `cfg` and seed `seed` ends with
    exactly this checkpoint (tests/test_text_study.py checks it bitwise). keep=("backbone", "workspace"): a stage-2
    checkpoint whose controller (and controller features) are new, e.g. to train another controller recipe on a
    trained workspace. ValueError if the kept groups do not fit `cfg` (another backbone, other workspace shapes), or
    if `tokenizer` (the tokenizer the rebased model goes on with; None: token ids) is not the one `path` was trained
    with, naming both. The rebased checkpoint records `path`'s tokenizer.
    """
    from prisme.model.prisme import PrismeModel

    kept = next((k for k in REBASES if set(k) == set(keep)), None) if keep else None
    if kept is None:
        raise ValueError(f"keep must be {' or '.join(map(repr, REBASES))}, got {keep!r}")
    src, meta = load_checkpoint(path, load_optimizer=False)
    own = tokenizer_of(meta)
    if tokenizer != "unchecked" and tokenizer_identity(tokenizer) != tokenizer_identity(own):
        raise ValueError(f"cannot rebase {meta.path}: it was trained with {describe_tokenizer(own)}, the rebased "
                         f"model would go on with {describe_tokenizer(tokenizer)} (its embedding rows would mean other "
                         f"strings); train on the checkpoint's tokenizer (--tokenizer {meta.path})")
    ws = "workspace" in kept
    if (meta.stage in STAGE1) == ws:
        need = "a workspace or controller" if ws else "a backbone"
        raise ValueError(f"{meta.path} is a {meta.stage!r} checkpoint; keep={keep} needs {need} checkpoint")
    diff = {k: v for k, v in cfg.diff(meta.config).items() if k in BACKBONE_FIELDS}
    if diff:
        raise ValueError(f"cannot rebase {meta.path}: the backbones differ in {sorted(diff)}")
    torch.manual_seed(seed)
    model = PrismeModel(cfg.validate()).to(next(src.parameters()).dtype)
    model.backbone.load_state_dict(src.backbone.state_dict(), strict=True)
    if ws:
        names = {n for n, p in model.named_parameters() if any(p is q for q in model.workspace_parameters())}
        theirs = dict(src.named_parameters())
        with torch.no_grad():
            for n in sorted(names):
                if n not in theirs or theirs[n].shape != model.get_parameter(n).shape:
                    raise ValueError(f"cannot keep the workspace of {meta.path}: parameter {n} does not fit "
                                     f"{cfg.name!r} (the workspace options differ; only controller options may)")
                model.get_parameter(n).copy_(theirs[n])
    return save_checkpoint(Path(out_dir) / checkpoint_name(meta.step), model, TrainingState(
        stage=REBASES[kept], step=meta.step, stage_config=meta.stage_config, metrics=meta.metrics,
        extra={"rebased_from": str(meta.path), "kept": list(keep)}, tokenizer=own))


def rebase_backbone(path: str | Path, cfg: PrismeConfig, out_dir: str | Path, seed: int) -> Path:
    """`rebase(path, cfg, out_dir, seed, keep=("backbone",))`: the stage-1 backbone under another workspace config."""
    return rebase(path, cfg, out_dir, seed, ("backbone",))
