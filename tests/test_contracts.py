"""The five contracts of the reference model's docstring, each with a negative control that breaks it on purpose.

bypass, causality, locality, read-only inputs, target-free controller (SPEC §3). All runs are float64 on the tiny
preset with a non-zero readout (U starts at zero, which would hide every edit).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

from prisme.config import PrismeConfig
from prisme.model.bank import SourceBank
from prisme.model.policy import Controller, StepPolicy, check_policy
from prisme.model.prisme import PrismeModel
from prisme.model.rollout import rollout_forced, rollout_policy
from prisme.model.workspace import absorb_stop, slots_of_action
from prisme.options import ExecutionOptions

torch.set_default_dtype(torch.float32)

# What the workspace reads: the seed's inputs, and the source-bank options every contract must survive (a token shift
# of the bank keys; embedding-level bank and query with the controller reading H and the bank's best match; two summed
# sources with the query from an intermediate layer).
SOURCES = {
    "seed": {},
    "shift": dict(bank_shift=True),
    "embedding": dict(bank_source="embedding", bank_shift=True, controller_source="residual", controller_bank=True,
                      controller_entropy=True),
    "two_sources": dict(bank_source="residual+embedding", query_source="layer1", bank_shift=True),
    # the router decides step 0 (from norm(H) and whether the current bigram was seen), the controller the rest
    "router": dict(router=True, router_ngram=2, bank_shift=True),
}
sources = pytest.mark.parametrize("src", list(SOURCES))


EDITOR_PATHS = ["kv", True, False]  # optimised with the slot K/V cache, optimised (the default), the seed's


def editor_path(optimised: bool | str) -> dict[str, Any]:
    """`tiny_model` arguments of one of EDITOR_PATHS: the config's `optimised`, the editor's execution options."""
    return {"optimised": bool(optimised), "execution": ExecutionOptions(slot_kv_cache=optimised == "kv")}


def make_model(seed: int = 0, **overrides) -> PrismeModel:
    return tiny_model(seed, **overrides)


def random_tokens(cfg: PrismeConfig, B: int, T: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (B, T), generator=g)


def random_actions(cfg: PrismeConfig, B: int, T: int, R: int, seed: int = 2, dense: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hi = cfg.dense_action + 1 if dense else cfg.stop_action + 1
    return torch.randint(0, hi, (B, T, R), generator=g)


@contextlib.contextmanager
def spy(module: torch.nn.Module):
    """Record the positional arguments of every call of `module`."""
    calls: list[tuple] = []
    handle = module.register_forward_pre_hook(lambda m, args: calls.append(args))
    try:
        yield calls
    finally:
        handle.remove()


# ---------------------------------------------------------------------- bypass
def bypass_violations(model: PrismeModel, tokens: torch.Tensor, actions: torch.Tensor) -> int:
    """Number of all-STOP positions whose logits differ (bitwise) from backbone.head(H) of the same batch."""
    with torch.no_grad():
        ref = model.backbone.head(model.backbone(tokens))
        out = model(tokens, actions)
    idle = (absorb_stop(actions, model.cfg.stop_action) == model.cfg.stop_action).all(-1)  # [B, T]
    assert idle.any() and (~idle).any(), "the test needs both idle and edited positions"
    differs = (out.logits != ref).any(-1)
    return int((differs & idle).sum())


def test_bypass_is_bit_identical_and_never_touches_the_workspace():
    """actions=None, zero-length actions and max_budget=0 give backbone.head(H) bitwise and call no workspace module."""
    model = make_model()
    tokens = random_tokens(model.cfg, 2, 16)
    with torch.no_grad():
        ref = model.backbone.head(model.backbone(tokens))
        with spy(model.editor) as e, spy(model.controller) as c, spy(model.readout) as r, spy(model.P) as p:
            outs = [model(tokens).logits, model(tokens, tokens.new_zeros(2, 16, 0)).logits,
                    model.forward_policy(tokens, max_budget=0).logits]
        assert not (e or c or r or p)
    for logits in outs:
        assert torch.equal(logits, ref)


@sources
def test_bypass_all_stop_positions_are_bit_identical(src):
    """Positions whose forced actions are all STOP get exactly the backbone's logits, in the same batch."""
    model = make_model(**SOURCES[src])
    cfg = model.cfg
    tokens = random_tokens(cfg, 2, 16)
    actions = random_actions(cfg, 2, 16, 3)
    actions[:, ::3, 0] = cfg.stop_action  # every third position never edits
    assert bypass_violations(model, tokens, actions) == 0
    with torch.no_grad():  # and under the controller, positions that stopped at once
        pol = model.forward_policy(tokens, max_budget=3, lambda_cost=0.0)
        ref = model.backbone.head(model.backbone(tokens))
    idle = pol.n_edits == 0
    assert idle.any() and (~idle).any()
    assert torch.equal(pol.logits[idle], ref[idle])
    assert not torch.equal(pol.logits[~idle], ref[~idle])


def test_bypass_negative_control_stop_treated_as_an_edit(monkeypatch):
    """If STOP is not honoured (the editor edits slot 0 and the readout counts the position as edited), the bypass
    check reports violations."""
    model = make_model()
    cfg = model.cfg
    tokens = random_tokens(cfg, 2, 16)
    actions = random_actions(cfg, 2, 16, 3)
    actions[:, ::3, 0] = cfg.stop_action
    model.editor.act_group[cfg.stop_action] = 0  # bug: STOP joins the single-slot group ...
    model.editor.act_slots[cfg.stop_action, 0] = 0
    original = PrismeModel.logits_from_state
    monkeypatch.setattr(PrismeModel, "logits_from_state", lambda self, S, ctx, edited=None: original(self, S, ctx))
    assert bypass_violations(model, tokens, actions) > 0  # ... and every position counts as edited


def test_readout_of_every_position_equals_the_masked_readout_with_every_position_edited():
    """`logits_from_state(S, ctx)` (edited=None: the routed decode step's path, no gather or scatter) equals the
    masked path with every position marked edited, in float64; the negative control (no position edited) is the
    backbone's head exactly, and differs."""
    model = make_model()
    cfg = model.cfg
    tokens = random_tokens(cfg, 2, 16)
    with torch.no_grad():
        ctx = model.encode(tokens)
        S = rollout_forced(model, ctx, StepPolicy(actions=random_actions(cfg, 2, 16, 2))).S
        every, d_every = model.logits_from_state(S, ctx)
        masked, d_masked = model.logits_from_state(S, ctx, torch.ones(2, 16, dtype=torch.bool))
        none, d_none = model.logits_from_state(S, ctx, torch.zeros(2, 16, dtype=torch.bool))
    torch.testing.assert_close(every, masked, rtol=0, atol=1e-12)
    torch.testing.assert_close(d_every, d_masked, rtol=0, atol=1e-12)
    assert torch.equal(none, model.backbone.head(ctx.H)) and not torch.equal(d_none, d_every)
    assert (every - none).abs().max() > 1e-6


# ---------------------------------------------------------------------- causality
def causality_gap(model: PrismeModel, t: int, policy: bool, seed: int = 3) -> tuple[float, float, bool]:
    """Perturb every token after t; return (max logit change at <= t, max final-state change at <= t,
    traces at <= t identical)."""
    cfg = model.cfg
    B, T = 2, 20
    tokens = random_tokens(cfg, B, T, seed)
    other = tokens.clone()
    other[:, t + 1:] = random_tokens(cfg, B, T - t - 1, seed + 100)
    assert not torch.equal(tokens[:, t + 1:], other[:, t + 1:])
    outs = []
    with torch.no_grad():
        for toks in (tokens, other):
            if policy:
                outs.append(model.forward_policy(toks, max_budget=cfg.r_max, lambda_cost=0.2, return_state=True))
            else:
                outs.append(model(toks, random_actions(cfg, B, T, cfg.r_max, seed), return_state=True))
    a, b = outs
    dl = (a.logits[:, : t + 1] - b.logits[:, : t + 1]).abs().max().item()
    ds = (a.S_final[:, : t + 1] - b.S_final[:, : t + 1]).abs().max().item()
    return dl, ds, torch.equal(a.actions[:, : t + 1], b.actions[:, : t + 1])


@sources
@pytest.mark.parametrize("policy", [False, True], ids=["forced", "controller"])
def test_causality_later_tokens_change_nothing_at_or_before_t(policy, src):
    """Changing tokens after position t leaves logits, final workspace and action traces at positions <= t unchanged."""
    model = make_model(**SOURCES[src])
    for t in (0, 7, 18):
        dl, ds, same_trace = causality_gap(model, t, policy)
        assert dl <= 1e-12 and ds <= 1e-12, (t, dl, ds)
        assert same_trace


def test_causality_negative_control_leaky_bank(monkeypatch):
    """A bank mask that lets position t read key t+1 breaks the causality check."""
    model = make_model()
    original = PrismeModel.bank_mask

    def leaky(B, Tq, Tb, query_pos=None, bank_len=None, device=None):
        q = torch.arange(Tq, device=device).view(1, Tq).expand(B, Tq) if query_pos is None else query_pos
        return original(B, Tq, Tb, q + 1, bank_len, device)

    monkeypatch.setattr(PrismeModel, "bank_mask", staticmethod(leaky))
    dl, ds, _ = causality_gap(model, 7, policy=False)
    assert dl > 1e-3 and ds > 1e-3


def test_causality_negative_control_shift_reads_the_next_position(monkeypatch):
    """A token shift that feeds key j from position j+1 instead of j-1 breaks the causality check."""
    model = make_model(**SOURCES["embedding"])
    original = SourceBank.from_inputs

    def ahead(self, hs, prev=None):
        K, V = original(self, hs, prev)
        nxt = torch.cat([hs[0][:, 1:], torch.zeros_like(hs[0][:, :1])], dim=1)  # bug: n(X_{j+1}) at position j
        return K + self.W_K_shift(nxt), V

    assert causality_gap(model, 7, policy=False)[0] <= 1e-12  # clean first
    monkeypatch.setattr(SourceBank, "from_inputs", ahead)
    dl, ds, _ = causality_gap(model, 7, policy=False)
    assert dl > 1e-3 and ds > 1e-3


# ---------------------------------------------------------------------- locality
def locality_violations(model: PrismeModel, actions: torch.Tensor, seed: int = 4) -> int:
    """Apply one action per position; count slots outside each action that changed (bitwise)."""
    cfg = model.cfg
    B, T = actions.shape
    tokens = random_tokens(cfg, B, T, seed)
    with torch.no_grad():
        ctx = model.encode(tokens)
        S1, _ = model.apply_action(ctx.S0, ctx, actions, 0, 0, model.new_slot_kv(ctx.S0))
    bad = 0
    for b in range(B):
        for t in range(T):
            inside = set(slots_of_action(cfg, int(actions[b, t])))
            for m in range(cfg.n_slots):
                changed = not torch.equal(S1[b, t, m], ctx.S0[b, t, m])
                if m in inside:
                    assert changed, "an edited slot did not change"
                elif changed:
                    bad += 1
    return bad


@pytest.mark.parametrize("kind", ["single", "pair", "dense", "mixed"])
@pytest.mark.parametrize("optimised", [True, False])
@pytest.mark.parametrize("src", ["seed", "embedding"])
def test_locality_only_the_actions_slots_change(kind, optimised, src):
    """apply_action leaves every slot outside the action (and every STOP position) bitwise identical."""
    model = make_model(**editor_path(optimised), **SOURCES[src])
    cfg = model.cfg
    g = torch.Generator().manual_seed(5)
    lo, hi = {"single": (0, cfg.n_slots), "pair": (cfg.n_slots, cfg.n_actions),
              "dense": (cfg.dense_action, cfg.dense_action + 1), "mixed": (0, cfg.dense_action + 1)}[kind]
    actions = torch.randint(lo, hi, (2, 10), generator=g)
    actions[:, ::4] = cfg.stop_action
    assert locality_violations(model, actions) == 0


def test_locality_negative_control_editor_writes_a_neighbour():
    """If a single-slot action also writes its neighbour slot, the locality check counts the violations."""
    model = make_model()
    cfg = model.cfg
    model.editor.act_group[: cfg.n_slots] = 1  # bug: single-slot actions run as pairs (slot i and its neighbour)
    model.editor.act_slots[: cfg.n_slots, 1] = (torch.arange(cfg.n_slots) + 1) % cfg.n_slots
    actions = torch.randint(0, cfg.n_slots, (2, 10), generator=torch.Generator().manual_seed(6))
    assert locality_violations(model, actions) == 20


# ---------------------------------------------------------------------- read-only inputs
def read_only_changes(model: PrismeModel) -> dict[str, bool]:
    """Run a forced rollout and a policy rollout on one context; report which inputs changed."""
    cfg = model.cfg
    tokens = random_tokens(cfg, 2, 12)
    with torch.no_grad():
        ctx = model.encode(tokens)
        before = {k: getattr(ctx, k).clone() for k in ("H", "K", "V", "z", "S0", "bank_mask", "ctrl_in")
                  if getattr(ctx, k) is not None}
        rollout_forced(model, ctx, StepPolicy(actions=random_actions(cfg, 2, 12, cfg.r_max)))
        rollout_policy(model, ctx, check_policy(model, Controller(cfg.r_max, 0.0)))
        model.logits_from_state(ctx.S0 + 1.0, ctx)
    return {k: not torch.equal(v, getattr(ctx, k)) for k, v in before.items()}


@sources
@pytest.mark.parametrize("optimised", EDITOR_PATHS, ids=str)
def test_read_only_inputs_are_never_modified(optimised, src):
    """H, K, V, z, S0, the bank mask (and the controller's own input stream) are bit-identical after forced and
    controller rollouts and the readout."""
    assert not any(read_only_changes(make_model(**editor_path(optimised), **SOURCES[src])).values())


def test_read_only_negative_control_in_place_editor(monkeypatch):
    """An editor that writes its result into the workspace it was given is caught (S0 changes)."""
    model = make_model()
    original = type(model.editor).forward

    def in_place(self, S, *args, **kwargs):
        S_new, info = original(self, S, *args, **kwargs)
        S.copy_(S_new)
        return S, info

    monkeypatch.setattr(type(model.editor), "forward", in_place)
    assert read_only_changes(model)["S0"]


# ---------------------------------------------------------------------- target-free controller
def test_target_free_controller_structure():
    """No target, label or token input exists anywhere on the controller path's signatures."""
    from prisme.model.controller import ValueController

    for fn in (ValueController.forward, ValueController.features, ValueController.select, rollout_policy):
        params = set(inspect.signature(fn).parameters)
        assert not params & {"targets", "target", "labels", "y", "tokens"}, (fn.__qualname__, params)


def editor_calls_match_trace(calls: list[tuple], trace: torch.Tensor, stop: int) -> bool:
    """Every editor call's action tensor equals the trace's column for that step, and no other call happened."""
    executed = [r for r in range(trace.shape[-1]) if (trace[..., r] != stop).any() or r == 0]
    if len(calls) > trace.shape[-1]:
        return False
    return all(torch.equal(args[2], trace[..., r]) for r, args in enumerate(calls)) and len(calls) <= len(executed) + 1


@sources
def test_target_free_editor_only_runs_chosen_actions(src):
    """A spy on the editor shows forward_policy only ever applies the actions the controller chose."""
    model = make_model(**SOURCES[src])
    tokens = random_tokens(model.cfg, 2, 12)
    with spy(model.editor) as calls:
        out = model.forward_policy(tokens, max_budget=model.cfg.r_max, lambda_cost=0.1)
    assert calls and (out.n_edits > 0).any()
    assert editor_calls_match_trace(calls, out.actions, model.cfg.stop_action)


def test_target_free_negative_control_candidate_execution():
    """A policy that executes candidate edits before choosing (as the training oracle does) fails the spy check."""
    model = make_model()
    cfg = model.cfg
    tokens = random_tokens(cfg, 2, 12)
    with torch.no_grad(), spy(model.editor) as calls:
        ctx = model.encode(tokens)
        for a in range(cfg.n_actions):  # peek at every candidate's effect
            model.apply_action(ctx.S0, ctx, torch.full((2, 12), a), 0, cfg.r_max - 1)
        out = model.forward_policy(tokens, max_budget=cfg.r_max, lambda_cost=0.1)
    assert not editor_calls_match_trace(calls, out.actions, cfg.stop_action)


# ---------------------------------------------------------------------- property-style runs
@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 12), M=st.sampled_from([2, 4, 6]), R=st.integers(1, 4),
       optimised=st.sampled_from(EDITOR_PATHS), seed=st.integers(0, 10_000))
def test_property_forced_rollouts_keep_bypass_and_locality(B, T, M, R, optimised, seed):
    """For random shapes, slot counts, budgets and action sequences: idle positions are bit-identical to the backbone,
    and the reference and optimised editors agree to float64 precision."""
    torch.manual_seed(seed)
    path = editor_path(optimised)
    cfg = PrismeConfig.from_name("tiny", n_slots=M, optimised=path["optimised"])
    model = PrismeModel(cfg, execution=path["execution"]).double().eval()
    torch.nn.init.normal_(model.readout.U.weight, std=0.5)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    actions = torch.randint(0, cfg.dense_action + 1, (B, T, R), generator=g)
    budget = torch.randint(1, cfg.r_max + 1, (B, T), generator=g)
    late = torch.arange(R).view(1, 1, R) >= budget.unsqueeze(-1)
    actions = actions.masked_fill(late, cfg.stop_action)
    with torch.no_grad():
        out = model(tokens, actions, budget=budget)
        ref = model.backbone.head(model.backbone(tokens))
        other_path = editor_path(False if optimised else "kv")
        twin = PrismeModel(cfg.replace(optimised=other_path["optimised"]), execution=other_path["execution"])
        twin = twin.double().eval()
        twin.load_state_dict(model.state_dict())
        other = twin(tokens, actions, budget=budget)
    idle = out.n_edits == 0
    assert torch.equal(out.logits[idle], ref[idle])
    assert (out.logits - other.logits).abs().max().item() <= 1e-12


@settings(max_examples=10, deadline=None)
@given(T=st.integers(2, 14), t=st.integers(0, 12), budget=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_property_policy_causality(T, t, budget, seed):
    """For random lengths, budgets and cut points, the controller's decisions and logits at <= t ignore later tokens."""
    t = min(t, T - 2)
    model = make_model(seed)
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=g)
    other = tokens.clone()
    other[:, t + 1:] = (tokens[:, t + 1:] + 1 + torch.randint(0, cfg.vocab_size - 1, (2, T - t - 1), generator=g)) \
        % cfg.vocab_size
    with torch.no_grad():
        a = model.forward_policy(tokens, max_budget=budget, lambda_cost=0.05)
        b = model.forward_policy(other, max_budget=budget, lambda_cost=0.05)
    assert torch.equal(a.actions[:, : t + 1], b.actions[:, : t + 1])
    assert (a.logits[:, : t + 1] - b.logits[:, : t + 1]).abs().max().item() <= 1e-12


# ---------------------------------------------------------------------- bad input
def test_bad_actions_and_budgets_raise_value_errors():
    """Out-of-range ids, too many steps, shape mismatches, bad budgets and bad max_budget each raise ValueError."""
    model = make_model()
    cfg = model.cfg
    tokens = random_tokens(cfg, 2, 6)
    ok = random_actions(cfg, 2, 6, 2)
    cases = {
        "out of range": ok.clone().fill_(cfg.dense_action + 1),
        "negative id": ok.clone().fill_(-1),
        "R > r_max": random_actions(cfg, 2, 6, cfg.r_max + 1),
        "shape mismatch": random_actions(cfg, 2, 5, 2),
        "float actions": ok.double(),
    }
    for name, actions in cases.items():
        with pytest.raises(ValueError):
            model(tokens, actions)
        assert name
    for budget in (0, -1, cfg.r_max + 1):
        with pytest.raises(ValueError, match="budget"):
            model(tokens, ok, budget=budget)
    with pytest.raises(ValueError, match="budget"):  # an action scheduled past its position's budget
        model(tokens, torch.zeros(2, 6, 2, dtype=torch.long), budget=1)
    for mb in (cfg.r_max + 1, -1, 1.5):
        with pytest.raises(ValueError, match="max_budget"):
            model.forward_policy(tokens, max_budget=mb)
    with pytest.raises(ValueError, match="cost"):
        model.forward_policy(tokens, max_budget=1, cost=torch.zeros(cfg.n_actions + 1))


def test_dense_is_not_a_controller_action():
    """The controller never selects DENSE, and selection rejects negative prices."""
    model = make_model()
    tokens = random_tokens(model.cfg, 2, 10)
    out = model.forward_policy(tokens, max_budget=model.cfg.r_max, lambda_cost=0.0)
    assert int(out.actions.max()) <= model.cfg.stop_action
    with pytest.raises(ValueError, match="lambda_cost"):
        model.forward_policy(tokens, max_budget=1, lambda_cost=-1.0)


@pytest.mark.parametrize("bad, field", [(dict(n_slots=3), "n_slots"), (dict(w=40), "ws_head_dim"),
                                         (dict(d_model=30), "n_head"), (dict(r_max=0), "r_max")])
def test_bad_workspace_configs_raise_value_errors(bad, field):
    """An odd M, widths that don't divide by heads, or r_max < 1 raise a ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        PrismeModel(PrismeConfig.from_name("tiny", **bad))
