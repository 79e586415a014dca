"""`StageConfig.workspace_positions`: the workspace stage trains at P drawn positions of each sequence instead of all
of them (at long contexts each reads its whole bank, so the stage costs P / T).

* `sample` draws min(P, labelled) labelled positions per row, anew each step;
* the loss is that of training at every position with the other labels removed (the positions not
  drawn add nothing, and the mean is over the drawn ones); the backbone's own loss (`backbone_aux_weight`) still
  reads every label; negative control: an objective that draws but still scores every position is caught;
* the editor runs on P query positions per row; the training-compute record charges P positions' editor work;
* a negative count is a ValueError naming the field.
"""

from __future__ import annotations

import pytest
import torch

from prisme.config import PrismeConfig
from prisme.data.text import IGNORE_INDEX
from prisme.model.prisme import PrismeModel
from prisme.training import objectives
from prisme.training.compute import _workspace_stage, stage_labels
from prisme.training.config import StageConfig

T, P = 24, 5


def _setup(**kw):
    torch.manual_seed(0)
    model = PrismeModel(PrismeConfig.from_name("tiny")).double()
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 64, (3, T + 1), generator=g)
    x, y = seq[:, :-1], seq[:, 1:].clone()
    y[2, :20] = IGNORE_INDEX  # a row with 4 labels: fewer than P
    scfg = StageConfig(stage="workspace", workspace_positions=P, **kw)
    return model, x, y, scfg


def test_sample_draws_p_labelled_positions_per_row_anew_each_step():
    model, x, y, scfg = _setup()
    obj = objectives.WorkspaceObjective(model, scfg)
    g = torch.Generator().manual_seed(1)
    a, b = obj.sample(x, y, g)["trained"], obj.sample(x, y, g)["trained"]
    assert a.sum(1).tolist() == [P, P, 4] and not bool((a & (y == IGNORE_INDEX)).any())
    assert not torch.equal(a, b)
    assert "trained" not in objectives.WorkspaceObjective(model, scfg.replace(workspace_positions=0)).sample(x, y, g)


@pytest.mark.parametrize("aux", [False, True])
def test_the_loss_is_training_at_every_position_with_the_other_labels_removed(aux, monkeypatch):
    model, x, y, scfg = _setup(train_backbone_in_workspace_stage=aux)
    drawn = objectives.WorkspaceObjective(model, scfg)
    every = objectives.WorkspaceObjective(model, scfg.replace(workspace_positions=0))
    ex = drawn.sample(x, y, torch.Generator().manual_seed(1))
    loss = drawn(x, y, ex, drawn.denominators(x, y, ex))[0]
    y_drawn = y.masked_fill(~ex["trained"], IGNORE_INDEX)
    rest = {k: v for k, v in ex.items() if k != "trained"}
    want = every(x, y_drawn, rest, every.denominators(x, y_drawn, rest))[0]
    if aux:  # the backbone's own loss reads every label: the reference's reads the drawn ones only
        head = model.backbone.head(model.backbone(x))
        ce = torch.nn.functional.cross_entropy
        full = ce(head.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX)
        part = ce(head.flatten(0, 1).float(), y_drawn.flatten(), ignore_index=IGNORE_INDEX)
        want = want + scfg.backbone_aux_weight * (full - part)
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-6)
    # negative control: drawing positions but scoring every label is a different loss
    monkeypatch.setattr(objectives.WorkspaceObjective, "_trained", staticmethod(lambda y, extra: y))
    assert abs(float(drawn(x, y, ex, drawn.denominators(x, y, ex))[0].detach() - loss.detach())) > 1e-4


def test_the_editor_runs_at_p_query_positions_and_the_compute_record_charges_them(monkeypatch):
    model, x, y, scfg = _setup()
    obj = objectives.WorkspaceObjective(model, scfg)
    ex = obj.sample(x, y, torch.Generator().manual_seed(1))
    seen = []
    ctx_of = model.context_from_H
    monkeypatch.setattr(model, "context_from_H",
                        lambda *a, **k: (seen.append(k["query_pos"].shape), ctx_of(*a, **k))[1])
    obj(x, y, ex, obj.denominators(x, y, ex))
    assert seen == [torch.Size([3, P])]
    cfg = model.cfg
    full = StageConfig(stage="workspace", seq_len=T)
    part = _workspace_stage(cfg, full.replace(workspace_positions=P), stage_labels(cfg, full))
    whole = _workspace_stage(cfg, full, stage_labels(cfg, full))
    assert part["editor"][1] == pytest.approx(whole["editor"][1] * P / T)
    assert part["backbone"] == whole["backbone"]


def test_a_negative_count_is_a_value_error():
    with pytest.raises(ValueError, match="workspace_positions"):
        StageConfig(stage="workspace", workspace_positions=-1).validate()
