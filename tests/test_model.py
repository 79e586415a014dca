"""Model construction: big presets on the meta device, derived buffers, parameter groups."""

from __future__ import annotations

import torch

from prisme.config import PrismeConfig
from prisme.model import PrismeModel


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
