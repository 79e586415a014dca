"""A training stage's compute (`prisme.training.compute`): the analytic training ops of each kind of stage against a
count by hand on the tiny preset (forward ops x 3 where the part trains, x 2 where a gradient only passes through, x 1
without gradient; negative control: a frozen backbone counted x 3), where an MQAR stage's labels lie, and the wall
time a stage's log records over resumed sessions."""

from __future__ import annotations

import json

import pytest

from prisme.config import PrismeConfig
from prisme.data.mqar import MQARConfig
from prisme.model.prisme import PrismeModel
from prisme.training import compute
from prisme.training.compute import logged_training_s, stage_compute, stage_labels
from prisme.training.config import StageConfig

T, STEPS, BATCH = 16, 5, 3  # a text stage: every position has a label


def tiny(**overrides) -> PrismeConfig:
    return PrismeConfig.from_name("tiny", **overrides)


def by_hand(cfg: PrismeConfig) -> dict[str, float]:
    """The tiny preset's forward ops over one sequence of T positions, counted from its modules and shapes."""
    d, L, V, w, M, A, B_e, h_e = (cfg.d_model, cfg.n_layer, cfg.vocab_size, cfg.w, cfg.n_slots, cfg.n_actions,
                                  cfg.n_edit_blocks, cfg.editor_hidden)
    model = PrismeModel(cfg.replace(use_workspace=False, router=False))
    weights = sum(p.numel() for n, p in model.backbone.named_parameters() if not n.startswith("tok_emb"))
    c = (T + 1) / 2  # the mean context of a position
    k = (M * 1 + (A - M) * 2) / A  # slots of an action drawn uniformly: M singles, A - M pairs
    editor = B_e * (k * (4 * w * w + 4 * c * w) + M * 4 * w * w + k * (4 * w * w + 4 * M * w) + k * 6 * w * h_e
                    + k * 2 * w)  # source attention, slot K/V of all M slots + slot attention, FFN, gate
    return {"blocks": T * 2 * weights + L * 4 * d * T * (T + 1) / 2,  # linears (2 ops per weight), causal attention
            "head": 2 * d * V,
            "bank": 3 * 2 * d * w,  # K, V and z of one position: three d -> w projections
            "editor": editor,
            "readout": 2 * w * w + 2 * w * w + 2 * 4 * M * w + 2 * w * d,  # W_q, W_r folded into q, S and S0, U
            "router": 2 * (d + 1) * A + (c - 1)}  # the value head over [norm(H), seen], the 1-gram's comparisons


def stage(name: str, **kw) -> StageConfig:
    return StageConfig(stage=name, steps=STEPS, batch_size=BATCH, seq_len=T, **kw)


def test_the_backbone_stage_is_three_forward_passes_of_blocks_and_head_at_every_position():
    """Stage 1 trains everything it runs: 3 x (blocks + head on every position) x steps x batch."""
    cfg = tiny(use_workspace=False)
    h = by_hand(cfg)
    got = stage_compute(cfg, stage("backbone"))
    assert got.ops == pytest.approx(STEPS * BATCH * 3 * (h["blocks"] + T * h["head"]), rel=1e-12)
    assert (got.stage, got.steps, got.batch_size, got.seq_len) == ("backbone", STEPS, BATCH, T)


def test_the_workspace_stage_counts_its_frozen_backbone_once_and_what_it_trains_three_times():
    """Stage 2 on a frozen backbone (budget 1, every position labelled): blocks x 1, the bank, editor and readout x 3,
    the head on the corrected logits x 2 (frozen, the gradient passes through it), the logged backbone-only loss x 1.
    Negative control: the same count with the frozen backbone at x 3 is caught."""
    cfg = tiny()
    h = by_hand(cfg)
    per_position = 3 * (h["bank"] + h["editor"] + h["readout"]) + 2 * h["head"] + 1 * h["head"]
    expected = STEPS * BATCH * (1 * h["blocks"] + T * per_position)
    s = stage("workspace", max_budget=1)
    assert stage_compute(cfg, s).ops == pytest.approx(expected, rel=1e-12)
    with pytest.MonkeyPatch.context() as mp:  # a frozen backbone counted as if it trained
        mp.setattr(compute, "NO_GRAD", 3)
        assert stage_compute(cfg, s).ops != pytest.approx(expected, rel=1e-6)
    joined = stage_compute(cfg, s.replace(train_backbone_in_workspace_stage=True)).parts
    assert joined["backbone"][0] == 3 and joined["head"][0] == 3 and joined["backbone_head"] == (3, T * h["head"])
    embedding = stage_compute(cfg, s.replace(train_backbone_in_workspace_stage=True, backbone_trains="embedding"))
    assert embedding.parts["backbone"][0] == 2  # frozen blocks the gradient passes through to the embedding


def test_the_router_stage_runs_every_candidate_without_gradient_and_trains_its_value_head():
    """The router stage at P = oracle_positions sampled positions (every position labelled): blocks, bank entries and
    the loss before any edit x 1; at each sampled position every action's edit, readout and head x 1; the router's
    value head x 3."""
    cfg = tiny(router=True)
    h = by_hand(cfg)
    P, A = 8, cfg.n_actions
    editors = A * h["editor"]  # every action once: A times the mean action's edit
    frozen = h["blocks"] + T * 2 * 2 * cfg.d_model * cfg.w + P * 2 * cfg.d_model * cfg.w + P * h["head"]
    frozen += P * (editors + A * h["readout"] + A * h["head"])
    expected = STEPS * BATCH * (frozen + 3 * P * h["router"])
    got = stage_compute(cfg, stage("router", oracle_positions=P))
    assert got.ops == pytest.approx(expected, rel=1e-12)
    assert got.parts["value_head"][0] == 3 and got.parts["candidates"][0] == 1


def test_an_mqar_stage_prices_its_labels_where_its_queries_lie():
    """An MQAR stage's labels: exactly its queries per sequence, each past the pairs (the mean context between the
    first query's and T); the unlabelled positions' mean context completes the sum over 1..T."""
    mq = MQARConfig(vocab_size=64, seq_len=96, n_pairs=4, query_min_pos=40, n_queries=2)
    lab = stage_labels(tiny(max_seq_len=128), StageConfig(stage="workspace", dataset="mqar", mqar=vars(mq)))
    assert lab.seq_len == 96 and lab.per_row == 2 and mq.query_start + 1 <= lab.context <= 96
    assert lab.per_row * lab.context + (96 - lab.per_row) * lab.unlabelled_context == pytest.approx(96 * 97 / 2)


def test_the_logged_training_time_sums_the_sessions_of_a_resumed_stage(tmp_path):
    """`time_s` of the last train row of each session (a resumed session's clock starts again), validation rows
    aside; None without a log."""
    rows = [{"step": 10, "split": "train", "time_s": 1.0}, {"step": 20, "split": "train", "time_s": 2.5},
            {"step": 20, "split": "val", "loss": 1.0}, {"step": 30, "split": "train", "time_s": 0.75},
            {"step": 40, "split": "train", "time_s": 1.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert logged_training_s(tmp_path) == pytest.approx(4.0)
    assert logged_training_s(tmp_path / "missing") is None
