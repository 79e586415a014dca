"""Model construction: big presets on the meta device, derived buffers, parameter groups."""

from __future__ import annotations

import pytest
import torch

from prisme.config import PrismeConfig
from prisme.model.prisme import PrismeModel


def test_meta_init_then_to_empty_and_load_matches_a_cpu_model():
    """A model built on `meta`, materialised with `to_empty` and given a state dict computes what the original does:
    derived tables (RoPE, action slots, prices) are rebuilt rather than left as uninitialised memory."""
    torch.manual_seed(0)
    cfg = PrismeConfig.from_name("tiny")
    ref = PrismeModel(cfg).eval()
    torch.nn.init.normal_(ref.readout.U.weight, std=0.3)
    with torch.device("meta"):
        meta = PrismeModel(cfg)
    model = meta.to_empty(device="cpu").eval()
    model.load_state_dict(ref.state_dict())
    for name, buf in ref.named_buffers():
        assert torch.equal(buf, dict(model.named_buffers())[name]), name
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    actions = torch.randint(0, cfg.dense_action + 1, (2, 12, 3))
    with torch.no_grad():
        assert torch.equal(model(tokens, actions).logits, ref(tokens, actions).logits)
        a, b = model.forward_policy(tokens, 3, lambda_cost=0.0), ref.forward_policy(tokens, 3, lambda_cost=0.0)
    assert torch.equal(a.actions, b.actions)


def test_meta_init_negative_control_stale_tables_change_the_result():
    """If a derived table were left uninitialised (here: scrambled), the same comparison would fail."""
    torch.manual_seed(0)
    cfg = PrismeConfig.from_name("tiny")
    ref = PrismeModel(cfg).eval()
    torch.nn.init.normal_(ref.readout.U.weight, std=0.3)
    model = PrismeModel(cfg).eval()
    model.load_state_dict(ref.state_dict())
    model.backbone.rope_cos = model.backbone.rope_cos.flip(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        assert not torch.equal(model(tokens).logits, ref(tokens).logits)


def test_parameter_groups_partition_the_model():
    """backbone, workspace and controller groups are disjoint and cover every parameter exactly once."""
    model = PrismeModel(PrismeConfig.from_name("tiny"))
    groups = [model.backbone_parameters(), model.workspace_parameters(), model.controller_parameters()]
    ids = [id(p) for g in groups for p in g]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert all(groups)


def test_fan_in_init_lets_a_first_edit_move_a_slot_while_the_readout_stays_exact():
    """With ws_init="fan_in" one DENSE edit of an untrained model moves the slots by O(1) of their size (the "seed"
    init, the negative control, by a few percent), and the zero U keeps every logit bitwise the backbone's."""
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 16))
    change = {}
    for init in ("fan_in", "seed"):
        torch.manual_seed(1)
        model = PrismeModel(PrismeConfig.from_name("tiny", ws_init=init)).double()
        with torch.no_grad():
            out = model(x, torch.full((2, 16, 1), model.cfg.dense_action), return_state=True)
            S0 = out.ctx.S0
            change[init] = ((out.S_final - S0).norm() / S0.norm()).item()
            assert torch.equal(out.logits, model.backbone.head(model.backbone(x)))
    assert change["fan_in"] > 0.3 > 0.1 > change["seed"], change


@pytest.mark.parametrize("preset", ["tiny", "demo", "recall"])
def test_group_first_actions_are_the_first_ids_of_each_action_group(preset):
    from prisme.model.workspace import action_groups, group_first_actions

    cfg = PrismeConfig.from_name(preset)
    group, _, sizes = action_groups(cfg)
    assert group_first_actions(cfg) == tuple(int(torch.nonzero(group == g)[0]) for g in range(len(sizes)))
