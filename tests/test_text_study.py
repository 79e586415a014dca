"""The text study's pieces: a stage-1 backbone rebased under another workspace config is exactly what training stage 1
with that config gives; a workspace kept under a new controller config; verdict lines that follow the intervals."""

from __future__ import annotations

import pytest
import torch

from prisme.checkpoint import load_model
from prisme.config import PrismeConfig
from prisme.model.prisme import PrismeModel
from prisme.rebase import rebase, rebase_backbone
from prisme.studies.text import verdicts
from prisme.training.config import StageConfig
from prisme.training.trainer import train_stage

MQ = dict(vocab_size=64, seq_len=16, n_pairs=2, query_min_pos=4)


def stage1(tmp_path, cfg: PrismeConfig, name: str, seed: int = 3):
    s = StageConfig(stage="backbone", steps=3, batch_size=4, seq_len=16, out_dir=str(tmp_path / name), seed=seed,
                    dataset="mqar", mqar=MQ, progress=False, eval_every=0, eval_batches=1)
    return train_stage(cfg, s).checkpoint


def test_rebased_backbone_equals_training_stage_1_under_that_config(tmp_path):
    """Stage 1 never touches the workspace: rebasing the seed's-config stage-1 checkpoint under the embedding-bank
    config gives bitwise the weights (backbone and fresh workspace) of training stage 1 with that config."""
    plain = PrismeConfig.from_name("tiny")
    other = plain.replace(bank_source="embedding", bank_shift=True, controller_source="residual",
                          controller_bank=True)
    reb = rebase_backbone(stage1(tmp_path, plain, "plain"), other, tmp_path / "rebased", seed=3)
    direct = stage1(tmp_path, other, "direct")
    a, meta = load_model(reb)
    b, _ = load_model(direct)
    assert meta.stage == "backbone" and a.cfg.bank_shift
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    wrong = load_model(rebase_backbone(stage1(tmp_path, plain, "plain2"), other, tmp_path / "r2", seed=4))[0]
    assert not all(torch.equal(wrong.state_dict()[k], sb[k]) for k in sb)  # negative control: another seed differs
    with pytest.raises(ValueError, match="d_model"):
        rebase_backbone(stage1(tmp_path, plain, "plain3"), plain.replace(d_model=64, n_head=4), tmp_path / "r3", 3)


def test_rebase_keeping_the_workspace_changes_only_the_controller(tmp_path):
    """keep=("backbone", "workspace") copies both groups into a config with other controller features and starts a
    fresh controller; a config whose workspace shapes differ is refused."""
    cfg = PrismeConfig.from_name("tiny")
    torch.manual_seed(0)
    from prisme.checkpoint import save_checkpoint

    src = PrismeModel(cfg)
    path = save_checkpoint(tmp_path / "ws" / "ckpt_000005", src, stage="workspace", step=5)
    new = cfg.replace(controller_entropy=True, controller_bank=True)
    out, meta = load_model(rebase(path, new, tmp_path / "out", seed=1, keep=("backbone", "workspace")))
    assert meta.stage == "workspace" and out.cfg.controller_entropy
    for group in ("backbone_parameters", "workspace_parameters"):
        assert all(torch.equal(p, q) for p, q in zip(getattr(out, group)(), getattr(src, group)()))
    assert out.controller.mlp[0].weight.shape[1] == src.controller.mlp[0].weight.shape[1] + 3  # 3 more features
    with pytest.raises(ValueError, match="does not fit"):
        rebase(path, cfg.replace(w=64, ws_head_dim=16), tmp_path / "bad", seed=1, keep=("backbone", "workspace"))
    with pytest.raises(ValueError, match="backbone checkpoint"):
        rebase(path, new, tmp_path / "bad2", seed=1)


def _row(policy, family, d_b, d_m, d_eq=None, ops=1.0):
    ci = lambda m, lo, hi: {"mean": m, "lo": lo, "hi": hi, "n_sequences": 10, "n_tokens": 100}  # noqa: E731
    v = lambda d: None if d is None else ("beats" if d[2] < 0 else "loses" if d[1] > 0 else "ties")  # noqa: E731
    return {"policy": policy, "family": family, "deployable": family != "oracle", "relative_ops": ops,
            "lambda_cost": 0.1, "delta_vs_backbone": ci(*d_b), "delta_vs_matched": ci(*d_m),
            "verdict_vs_backbone": v(d_b), "verdict_vs_matched": v(d_m),
            "delta_vs_equal_edits": None if d_eq is None else ci(*d_eq), "verdict_vs_equal_edits": v(d_eq)}


def test_verdict_lines_follow_the_intervals():
    """The verdicts name 'ties with' when the interval holds 0, whatever the point estimate says, and count the
    prices where the controller beats its equal-edits baseline by the interval."""
    rows = [_row("deeper_backbone", "reference", (-0.2, -0.25, -0.15), (-0.19, -0.22, -0.16), ops=1.87),
            _row("fixed_1xk1", "fixed", (-0.004, -0.006, -0.002), (-0.003, -0.008, 0.001), ops=2.3),
            _row("controller(lambda=0.1)", "controller", (0.01, 0.005, 0.02), (0.012, 0.006, 0.02),
                 d_eq=(-0.001, -0.003, -0.0002), ops=1.5)]
    doc = {"sources": {"residual": {"val": {"rows": rows}, "held_out": {"rows": rows}}}}
    lines = verdicts(doc)
    assert any("deeper" in x and "beats the matched backbone" in x for x in lines)
    assert any("fixed_1xk1 ties with the matched backbone" in x for x in lines)
    assert any("beats uniform allocation at 1 of 1 prices" in x for x in lines)
