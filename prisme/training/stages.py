"""What each training stage is: `StageSpec` owns its stage (its objective, the parameter groups it trains, where it
starts from, what a rebase keeps, what else it does), and `STAGE_SPECS` is the one table of them. The trainer, the
optimizer, resume, the training CLI and the benches read a stage's spec (`StageConfig.spec`) and never its name.

The checkpoint layer below training keeps two tables of checkpoint metadata that follow these specs:
`prisme.checkpoint.STAGE_PREFERENCE` (which run of a folder is the most trained) and `_LEGACY_TRAINED` (the groups
of checkpoints written before `trained_groups` was recorded), and `prisme.rebase.REBASES` (the checkpoint a rebase
keeping `StageSpec.rebase_keeps` writes); tests/test_stage_specs.py ties them to the specs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from prisme.training.objectives import BackboneObjective, CopyObjective, WorkspaceObjective
from prisme.training.oracle_objectives import ControllerObjective, RouterObjective


@dataclass(frozen=True)
class StageSpec:
    """One training stage."""

    name: str  # the stage's name: `StageConfig.stage`, `--stage`, the `stage` of its checkpoints
    objective: type[nn.Module]  # its loss: `objective(model, scfg)` (sample, denominators, forward, summarise)
    group: str  # the `PrismeModel` parameter group it trains (`PrismeModel.GROUPS`)
    previous: str | None  # the stage whose checkpoint it normally starts from (None: the first stage, a fresh model)
    accepts_init: tuple[str, ...]  # checkpoint stages it may start from (its own: a second run of the stage)
    backbone_joins: bool = False  # train_backbone_in_workspace_stage adds the backbone's parameters (before its own
    #   group, with their own lr: `backbone_lr`), and the stage may then start from a fresh model (joint training)
    prev_token_probe: bool = False  # it trains the aux_prev_token probe (a linear probe of token t-1 on H[t])
    calibrates_values: bool = False  # its value heads regress the oracle's dL / scale: `scale` is calibrated on one
    #   batch before the first step (the heads initialised there when the start is another stage's checkpoint)
    rebase_keeps: tuple[str, ...] = ()  # the groups `--rebase` keeps of init_from (the rest new); (): no rebase
    needs: str | None = None  # a model option the stage needs ("router"), or None

    @property
    def is_first(self) -> bool:
        """The first stage: it starts from a fresh model (or any checkpoint), never from a previous stage's."""
        return self.previous is None

    @property
    def uses_workspace(self) -> bool:
        """It trains a part of the workspace (the model needs use_workspace=True; its editor may be compiled)."""
        return self.group not in ("backbone", "copy")

    def trained_groups(self, train_backbone: bool) -> tuple[str, ...]:
        """The parameter groups it trains, in the optimizer's order, given `train_backbone_in_workspace_stage`."""
        return ("backbone", self.group) if self.backbone_joins and train_backbone else (self.group,)

    def may_start_fresh(self, train_backbone: bool) -> bool:
        """Whether it can start from a fresh model (no init_from): the first stage, or a stage the backbone joins."""
        return self.is_first or (self.backbone_joins and train_backbone)

    def owns(self, checkpoint_stage: str) -> bool:
        """Whether a checkpoint of `checkpoint_stage` (its state.json's `stage`) was written by this stage."""
        return checkpoint_stage == self.name

    def accepts(self, checkpoint_stage: str) -> bool:
        """Whether init_from may be a checkpoint of `checkpoint_stage`."""
        return checkpoint_stage in self.accepts_init


STAGE_SPECS = {s.name: s for s in (
    StageSpec("backbone", BackboneObjective, "backbone", None,
              ("backbone", "workspace", "controller", "router", "export")),
    StageSpec("copy", CopyObjective, "copy", "backbone", ("backbone", "copy", "workspace"), backbone_joins=True,
              rebase_keeps=("backbone",), needs="copy_head"),
    StageSpec("workspace", WorkspaceObjective, "workspace", "backbone", ("backbone", "copy", "workspace"),
              backbone_joins=True, prev_token_probe=True, rebase_keeps=("backbone",)),
    StageSpec("controller", ControllerObjective, "controller", "workspace", ("workspace", "controller", "router"),
              calibrates_values=True, rebase_keeps=("backbone", "workspace")),
    StageSpec("router", RouterObjective, "router", "workspace", ("workspace", "router", "controller"),
              calibrates_values=True, rebase_keeps=("backbone", "workspace"), needs="router"),
)}
STAGES = tuple(STAGE_SPECS)
