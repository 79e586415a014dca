"""The contracts and the decoding equivalence on every device: each test runs on CPU (in `make test`) and on CUDA
(marked `gpu`: deselected by default, skipped cleanly without CUDA; `benchmarks/run_gpu.sh` runs them).

float64 everywhere the check is exactness (CUDA computes float64 too); the cross-device check is float32 at 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close
from test_contracts import EDITOR_PATHS, editor_path, make_model, random_actions, random_tokens

from prisme.model.policy import Controller
from prisme.model.workspace import absorb_stop, slots_of_action

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
device_param = pytest.mark.parametrize("device", DEVICES)


def on(device: str, **overrides):
    return make_model(**overrides).to(device)


@device_param
def test_bypass_all_stop_positions_are_bit_identical_on_device(device):
    model = on(device)
    cfg = model.cfg
    tokens = random_tokens(cfg, 2, 16).to(device)
    actions = random_actions(cfg, 2, 16, 3)
    actions[:, ::3] = cfg.stop_action
    actions = actions.to(device)
    with torch.no_grad():
        ref = model.backbone.head(model.backbone(tokens))
        out = model(tokens, actions)
    idle = (absorb_stop(actions, cfg.stop_action) == cfg.stop_action).all(-1)
    assert idle.any() and (~idle).any()
    assert torch.equal(out.logits[idle], ref[idle])
    assert not torch.equal(out.logits[~idle], ref[~idle])


@device_param
@pytest.mark.parametrize("policy", [False, True], ids=["forced", "controller"])
def test_causality_later_tokens_change_nothing_at_or_before_t_on_device(device, policy):
    model = on(device)
    cfg = model.cfg
    B, T, t = 2, 20, 7
    tokens = random_tokens(cfg, B, T).to(device)
    other = tokens.clone()
    other[:, t + 1:] = random_tokens(cfg, B, T - t - 1, seed=101).to(device)
    acts = random_actions(cfg, B, T, cfg.r_max).to(device)
    outs = []
    with torch.no_grad():
        for toks in (tokens, other):
            outs.append(model.forward_policy(toks, max_budget=cfg.r_max, lambda_cost=0.2) if policy
                        else model(toks, acts))
    a, b = outs
    assert_close(a.logits[:, :t + 1], b.logits[:, :t + 1], 1e-12, "logits at <= t")
    assert torch.equal(a.actions[:, :t + 1], b.actions[:, :t + 1])
    assert (a.logits[:, t + 1:] - b.logits[:, t + 1:]).abs().max().item() > 1e-3  # later positions did change


@device_param
@pytest.mark.parametrize("optimised", EDITOR_PATHS, ids=str)
def test_locality_only_the_actions_slots_change_on_device(device, optimised):
    model = on(device, **editor_path(optimised))
    cfg = model.cfg
    g = torch.Generator().manual_seed(5)
    actions = torch.randint(0, cfg.dense_action + 1, (2, 10), generator=g)
    actions[:, ::4] = cfg.stop_action
    tokens = random_tokens(cfg, 2, 10, seed=4).to(device)
    with torch.no_grad():
        ctx = model.encode(tokens)
        S1, _ = model.apply_action(ctx.S0, ctx, actions.to(device), 0, 0, model.new_slot_kv(ctx.S0))
    for b in range(2):
        for t in range(10):
            inside = set(slots_of_action(cfg, int(actions[b, t])))
            for m in range(cfg.n_slots):
                assert torch.equal(S1[b, t, m], ctx.S0[b, t, m]) != (m in inside), (b, t, m)


@device_param
def test_batched_ragged_decoding_equals_the_parallel_rollout_on_device(device):
    model = on(device)
    lengths = [11, 6, 9]
    tokens = random_tokens(model.cfg, 3, 11).to(device)
    with torch.no_grad():
        refs = [model.forward_policy(tokens[b:b + 1, :L], 3, lambda_cost=0.0) for b, L in enumerate(lengths)]
    state = model.new_decode_state(3, max_len=16)
    logits, actions = [], []
    with torch.inference_mode():
        for i in range(0, 11, 2):
            n_new = [min(max(L - i, 0), 2) for L in lengths]
            o = state.decode_step(tokens[:, i:i + 2], n_new, policy=Controller(max_budget=3, lambda_cost=0.0))
            logits.append(o.logits)
            actions.append(o.actions)
    logits, actions = torch.cat(logits, 1), torch.cat(actions, 1)
    for b, (L, ref) in enumerate(zip(lengths, refs)):
        assert_close(logits[b, :L], ref.logits[0], 1e-10, f"row {b}")
        assert torch.equal(actions[b, :L], ref.actions[0])


@device_param
def test_float32_logits_on_device_equal_cpu(device):
    cpu = make_model().float()
    dev = make_model().float().to(device)
    tokens = random_tokens(cpu.cfg, 2, 16)
    acts = random_actions(cpu.cfg, 2, 16, 3)  # forced: a float32 controller could break a near-tie differently
    with torch.no_grad():
        a = cpu(tokens, acts)
        b = dev(tokens.to(device), acts.to(device))
    assert_close(b.logits.cpu(), a.logits, 1e-4, "device vs cpu")
