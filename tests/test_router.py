"""The router (prisme/model/router.py): its n-gram feature, its place in the policy rollout, its cost, its stage.

The contracts and exact chunked decoding run on a router model too (the "router" source option of
tests/test_contracts.py and tests/test_generate.py); here: what only the router has, each with a negative control.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch
from tiny_models import evaluate, tiny_model

from prisme import cli, costs
from prisme.checkpoint import load_checkpoint, load_model
from prisme.config import PrismeConfig
from prisme.costs.counting import OpsCounter
from prisme.data.mqar import MQARConfig
from prisme.model.outputs import EncodedContext
from prisme.model.policy import Controller, check_policy
from prisme.model.prisme import PrismeModel
from prisme.model.rollout import rollout_policy
from prisme.model.router import ngram_seen, ngram_seen_at
from prisme.options import DecodeOptions
from prisme.training.config import StageConfig
from prisme.training.trainer import train_stage

ROUTER = dict(router=True, router_ngram=1, bank_shift=True)
T_CTX = 11


def brute_seen(ids: list[int], t: int, n: int) -> bool:
    """Whether ids[t-n+1 .. t] occurs ending at some i < t (the definition, by a plain loop)."""
    if t < n - 1:
        return False
    gram = ids[t - n + 1:t + 1]
    return any(ids[i - n + 1:i + 1] == gram for i in range(n - 1, t))


# ---------------------------------------------------------------------- the n-gram feature
@pytest.mark.parametrize("n", [1, 2, 3])
def test_ngram_seen_equals_a_plain_search_at_every_position(n):
    """`ngram_seen` says, for every position of random short-alphabet rows, exactly what a plain loop says."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 3, (4, 17), generator=g)
    pos = torch.arange(17).expand(4, 17)
    got = ngram_seen(ids, pos, n)
    want = torch.tensor([[brute_seen(row, t, n) for t in range(17)] for row in ids.tolist()])
    assert torch.equal(got, want)
    assert want.any() and (~want).any()  # both answers occur, so the check can fail


@pytest.mark.parametrize("n", [1, 2, 4])
def test_ngram_seen_at_one_aligned_position_equals_the_plain_search(n):
    """The decode step's `ngram_seen_at` (every row at the same position p, ids past p never read) says at each p what
    the plain loop says, including p < n - 1 (nothing seen); ids past p are garbage and change nothing. Negative
    control: windows one position longer (i <= p, the position against itself) say "seen" everywhere from p = n - 1."""
    g = torch.Generator().manual_seed(10 + n)
    ids = torch.randint(0, 3, (5, 21), generator=g)
    answers = set()
    for p in range(21):
        junk = ids.clone()
        junk[:, p + 1:] = torch.randint(0, 3, (5, 20 - p), generator=g)
        got = ngram_seen_at(junk, p, n)
        want = torch.tensor([[brute_seen(row, p, n)] for row in ids.tolist()])
        assert got.shape == (5, 1) and torch.equal(got, want), p
        answers |= set(want.flatten().tolist())
        if p >= n - 1:
            L = p - n + 2  # the bug: end positions up to p itself
            leaky = torch.stack([ids.narrow(1, n - 1 - m, L) == ids.narrow(1, p - m, 1) for m in range(n)]).all(0)
            assert leaky.any(-1).all()
    assert answers == {True, False}  # both answers occur, so the check can fail


def test_negative_control_a_match_that_includes_the_position_itself_fails(monkeypatch):
    """A match over i <= t (the position against itself) marks every position seen: the plain-search check above
    catches it."""
    ids = torch.randint(0, 3, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    real_gt = torch.Tensor.__gt__
    monkeypatch.setattr(torch.Tensor, "__gt__", lambda a, b: torch.Tensor.__ge__(a, b))  # i < pos -> i <= pos
    leaky = ngram_seen(ids, pos, 1)
    monkeypatch.setattr(torch.Tensor, "__gt__", real_gt)
    want = torch.tensor([[brute_seen(row, t, 1) for t in range(9)] for row in ids.tolist()])
    assert leaky.all() and not torch.equal(leaky, want)


# ---------------------------------------------------------------------- the rollout
def test_router_decides_step_0_and_the_controller_runs_only_where_it_fired():
    """Under forward_policy the router's argmax (or STOP) is step 0 at every position; positions it stopped have no
    controller step and no edit; the controller is evaluated only at positions still editing, from step 1."""
    model = tiny_model(0, **ROUTER)
    cfg = model.cfg
    tokens = torch.randint(0, cfg.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    seen_calls = []
    orig = model.controller.forward
    model.controller.forward = lambda z, *a, **k: (seen_calls.append(z.shape[0]), orig(z, *a, **k))[1]
    out = model.forward_policy(tokens, max_budget=3, lambda_cost=0.0)
    del model.controller.forward
    ctx = model.encode(tokens)
    first = model.router.select(model.router_values(ctx), model.action_cost, 0.0)
    assert torch.equal(out.actions[..., 0], first)
    stopped = first == cfg.stop_action
    assert stopped.any() and (~stopped).any()
    assert (out.n_edits[stopped] == 0).all() and (out.controller_steps[stopped] == 0).all()
    assert (out.controller_steps[~stopped] >= 1).all()
    assert seen_calls[0] == int((~stopped).sum())  # step 1: the fired positions only


@pytest.mark.parametrize("tables", [False, True], ids=["projections", "tables"])
def test_deployed_decode_step_equals_forward_policy_with_several_action_groups_firing_at_once(monkeypatch, tables):
    """The deployed step (budget 1: the router's action, then nothing; the "budget1" plan, `prisme.model.plans`)
    decodes what forward_policy computes, in float64 to 1e-12 and with the same traces, in steps where rows fire
    single-slot and pair actions at once and steps where none fires; the routed plan (the rollout where the router
    fired) gives the same numbers. Negative control: an edit at the wrong remaining budget differs."""
    import prisme.model.plans.budget1 as budget1
    import prisme.model.state as state_mod
    from prisme.model.plans import Routed, choose

    extra = dict(bank_source="embedding", query_source="embedding", decode=DecodeOptions(bank_tables=True)) \
        if tables else {}
    model = tiny_model(0, **ROUTER, **extra)
    cfg = model.cfg
    tokens = torch.randint(0, cfg.vocab_size, (3, 18), generator=torch.Generator().manual_seed(2))
    lam = 1.0
    full = model.forward_policy(tokens, max_budget=1, lambda_cost=lam)
    spans_seen = []
    orig, orig_edit = budget1.eager_deltas, budget1.edit_group
    monkeypatch.setattr(budget1, "eager_deltas", lambda *a, **k: (spans_seen.append(a[4]), orig(*a, **k))[1])

    def decode(m):
        st = m.new_decode_state(3, 18)
        outs = [st.prefill(tokens[:, :4], logits="all", policy=Controller(max_budget=1, lambda_cost=lam))]
        outs += [st.decode_step(tokens[:, i:i + 1], policy=Controller(max_budget=1, lambda_cost=lam))
                 for i in range(4, 18)]
        return torch.cat([o.logits for o in outs], 1), torch.cat([o.actions for o in outs], 1)

    logits, actions = decode(model)
    torch.testing.assert_close(logits, full.logits, rtol=0, atol=1e-12)
    assert torch.equal(actions, full.actions)
    fired = full.actions[:, 4:, 0] != cfg.stop_action  # the decode steps' positions
    assert fired.any(0).any() and not fired.any(0).all()  # steps with edits and steps without
    assert len(spans_seen) == int(fired.any(0).sum()) and any(len(s) > 1 for s in spans_seen)  # groups at once
    monkeypatch.setattr(state_mod, "choose", lambda state, ws, Q: Routed(state.run))  # the routed plan
    general, _ = decode(model)
    torch.testing.assert_close(general, logits, rtol=0, atol=1e-12)
    monkeypatch.setattr(state_mod, "choose", choose)
    monkeypatch.setattr(budget1, "edit_group", lambda blocks, S, slots, read, e: orig_edit(
        blocks, S, slots, read, [blk.step_embedding(0, 1) for blk in blocks]))  # remaining 1: wrong
    wrong, _ = decode(model)
    assert (wrong - full.logits).abs().max() > 1e-3


def test_router_decide_equals_select_of_its_values_and_follows_the_price_and_the_weights():
    """`Router.decide` (the decode step's rule: price folded into the bias, n-gram column added where seen) picks, in
    float64, what `select(forward(H, seen))` picks at every position, across prices, a price it cached and a weight
    changed in place. Negative controls: the n-gram cue read the wrong way round, and the decision of the old
    weights, each disagree somewhere."""
    model = tiny_model(0, **ROUTER)
    router, cost, stop = model.router, model.action_cost, model.cfg.stop_action
    g = torch.Generator().manual_seed(3)
    H = torch.randn(4, 64, model.cfg.d_model, generator=g, dtype=torch.float64)
    seen = torch.rand(4, 64, generator=g) < 0.5
    with torch.no_grad():
        router.head.weight[:, -1].uniform_(-1, 1, generator=g)  # a cue that matters, as a trained router's does

    def decided(s):
        best, fires = router.decide(H, s, cost, lam)
        return torch.where(fires, best, stop)

    for lam in (0.0, 0.003, 0.02, 0.0, 1e9):
        want = router.select(router(H, seen), cost, lam)
        assert torch.equal(decided(seen), want)
    lam = 0.0
    want = router.select(router(H, seen), cost, lam)
    assert (want != stop).any() and (want == stop).any()
    assert not torch.equal(decided(~seen), want)  # the cue matters: reading it inverted is caught
    with torch.no_grad():
        router.head.bias.sub_(0.05)  # in place: the folded bias must be rebuilt
    new = router.select(router(H, seen), cost, lam)
    assert not torch.equal(new, want) and torch.equal(decided(seen), new)


def test_router_token_adds_the_current_tokens_row_in_the_values_and_the_decode_rule():
    """With `router_token` the value at each position is the head's plus row x_t of the token table (float64, exact),
    the encoded context carries the token at each query, and `decide` picks what `select` of those values picks.
    Negative controls: the previous token's row, and the decision without the table, each disagree somewhere."""
    model = tiny_model(0, router_token=True, **ROUTER)
    router, cost, stop = model.router, model.action_cost, model.cfg.stop_action
    tokens = torch.randint(0, model.cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(4))
    ctx = model.encode(tokens)
    assert torch.equal(ctx.router_tok, tokens)
    plain = router.head(torch.cat([torch.nn.functional.rms_norm(ctx.H, (ctx.H.shape[-1],), eps=model.cfg.norm_eps),
                                   ctx.router_seen.unsqueeze(-1).to(ctx.H.dtype)], -1))
    U = router.token_value.weight
    assert torch.equal(model.router_values(ctx), plain + U[tokens])
    previous = plain + U[torch.cat([tokens[:, :1], tokens[:, :-1]], 1)]
    assert not torch.allclose(model.router_values(ctx), previous)
    for lam in (0.0, 0.01, 1e9):
        want = router.select(model.router_values(ctx), cost, lam)
        best, fires = router.decide(ctx.H, ctx.router_seen, cost, lam, tok=ctx.router_tok)
        assert torch.equal(torch.where(fires, best, stop), want)
    want = router.select(model.router_values(ctx), cost, 0.0)
    assert not torch.equal(router.select(plain, cost, 0.0), want)  # the table moves decisions
    with pytest.raises(ValueError, match="router_token"):
        router.decide(ctx.H, ctx.router_seen, cost, 0.0)  # without the tokens: a clear error


def test_router_decide_reading_the_final_norm_equals_its_own_norm_and_falls_back_where_it_cannot():
    """With the backbone's final norm h = g * norm(H) given (what the decode step computes for its logits), `decide`
    divides the head's columns by g and reads h: in float64 the same decisions as norming H itself, across prices and
    after g changes in place. A zero in g, another eps or a LayerNorm fall back to norming H. Negative control: h read
    with the undivided head (the gain applied twice) decides otherwise somewhere."""
    model = tiny_model(0, **ROUTER)
    router, cost, stop, d = model.router, model.action_cost, model.cfg.stop_action, model.cfg.d_model
    g = torch.Generator().manual_seed(5)
    H = torch.randn(4, 64, d, generator=g, dtype=torch.float64)
    seen = torch.rand(4, 64, generator=g) < 0.5
    norm = model.backbone.norm
    with torch.no_grad():
        router.head.weight[:, -1].uniform_(-1, 1, generator=g)
        norm.weight.copy_(torch.rand(d, generator=g, dtype=torch.float64) * 3 - 1.5)  # signs and scales that matter

    def decided(normed, lam):
        best, fires = router.decide(H, seen, cost, lam, normed)
        return torch.where(fires, best, stop)

    for lam in (0.0, 0.003, 0.02, 0.0):
        want = router.select(router(H, seen), cost, lam)
        assert torch.equal(decided((norm(H), norm), lam), want)
    assert router._folded(cost, 0.0, norm.weight)[3]  # the shared path ran
    want = router.select(router(H, seen), cost, 0.0)
    assert (want != stop).any() and (want == stop).any()
    W, u, b = router._folded(cost, 0.0, None)[:3]
    twice = torch.where(seen.unsqueeze(-1), torch.nn.functional.linear(norm(H), W, b) + u,
                        torch.nn.functional.linear(norm(H), W, b))
    best, action = twice.max(-1)
    assert not torch.equal(torch.where(best > 0, action, stop), want)  # the gain must be divided out
    with torch.no_grad():
        norm.weight.mul_(-0.5)  # in place: the fold is rebuilt
    assert torch.equal(decided((norm(H), norm), 0.0), want)
    with torch.no_grad():
        norm.weight[3] = 0.0  # norm(H) cannot be recovered from h: H is normed here
    assert not router._folded(cost, 0.0, norm.weight)[3]
    assert torch.equal(decided((norm(H), norm), 0.0), want)
    other = type(norm)(d, eps=norm.eps * 10).double()
    assert torch.equal(decided((other(H), other), 0.0), want)  # another eps: not shared
    ln = torch.nn.LayerNorm(d).double()
    assert torch.equal(decided((ln(H), ln), 0.0), want)  # a LayerNorm: not shared


def test_router_model_keeps_every_other_weight_of_the_same_seed():
    """The router is built last: a router model's backbone, workspace and controller are bit-identical to the model
    of the same seed without it (so turning the option on changes nothing else)."""
    torch.manual_seed(3)
    plain = PrismeModel(PrismeConfig.from_name("tiny", bank_shift=True))
    torch.manual_seed(3)
    routed = PrismeModel(PrismeConfig.from_name("tiny", **ROUTER))
    theirs = routed.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in plain.state_dict().items())
    assert set(theirs) - set(plain.state_dict()) == {"router.head.weight", "router.head.bias"}


@pytest.mark.parametrize("token", [False, True], ids=["plain", "token_table"])
def test_parameter_groups_partition_the_model_and_the_router_group_is_the_router(token):
    """Every parameter is in exactly one group, the router group holds the router's (its token table too) and nothing
    else, and the cost model counts them."""
    model = tiny_model(0, router_token=token, **ROUTER)
    groups = dict(model.parameter_groups())
    ids = [id(p) for ps in groups.values() for p in ps]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert {id(p) for p in groups["router"]} == {id(p) for p in model.router.parameters()}
    assert model.num_parameters()["router"] == costs.workspace_params(model.cfg)["router"]
    assert "router" not in tiny_model(0).num_parameters()


# ---------------------------------------------------------------------- the cost model
def decode_one_token(model: PrismeModel, script: int, budget: int):
    """Count the ops of one decoded position (T_CTX - 1) under the router policy with the router's step-0 choice
    forced to `script` (its forward still runs); returns (counter, rollout)."""
    cfg = model.cfg
    tokens = torch.randint(0, cfg.vocab_size, (1, T_CTX), generator=torch.Generator().manual_seed(5))
    tokens[0, -1] = tokens[0, 2]  # the last token was seen before: the n-gram feature is 1
    cache = model.backbone.new_cache(1, dtype=torch.float64)
    model.router.select = lambda v, c, lam: torch.full(v.shape[:-1], script, dtype=torch.long)
    with torch.no_grad():
        st_prev = model.streams(tokens[:, :-1], cache)
        hs_prev = model.bank.inputs(st_prev)
        K_prev, V_prev = model.bank.from_inputs(hs_prev)
        prev = [h[:, -1] for h in hs_prev]
        with OpsCounter(model) as oc:
            st = model.streams(tokens[:, -1:], cache)
            K, V = model.bank.from_inputs(model.bank.inputs(st), prev)
            z, S0 = model.query_state(st)
            ctx = EncodedContext(H=st.H, K=torch.cat([K_prev, K], 1), V=torch.cat([V_prev, V], 1), z=z,
                                 bank_mask=torch.ones(1, 1, T_CTX, dtype=torch.bool), S0=S0,
                                 ctrl_in=model.controller_stream(st),
                                 router_seen=model.router_inputs(tokens, torch.tensor([[T_CTX - 1]]))[0],
                                 router_tok=model.router_inputs(tokens, torch.tensor([[T_CTX - 1]]))[1])
            roll = rollout_policy(model, ctx, check_policy(model, Controller(budget, 0.0)))
            model.logits_from_state(roll.S, ctx, roll.n_edits > 0)
    del model.router.select
    return oc, roll


@pytest.mark.parametrize("token", [False, True], ids=["plain", "token_table"])
@pytest.mark.parametrize("script, budget", [("stop", 2), ("k1", 1), ("k2", 2)], ids=["stops", "edits_b1", "pair_b2"])
def test_router_policy_ops_of_a_decoded_token_tie_to_trace_cost(script, budget, token):
    """A decoded position under the router: counted matmul FLOPs equal `trace_cost(..., router=True)` term by term
    (the n-gram comparisons and the token table's adds are the named allowances); a position the router stopped pays
    the backbone, the bank and the router only."""
    model = tiny_model(0, optimised=True, router_token=token, **ROUTER)
    cfg = model.cfg
    a = {"stop": cfg.stop_action, "k1": 1, "k2": cfg.n_slots}[script]
    oc, roll = decode_one_token(model, a, budget)
    expected = costs.trace_cost(cfg, roll.actions[0], [T_CTX], roll.controller_steps[0], optimised=True, router=True)
    measured = dict(oc.by_component)
    measured["router"] += costs.router_match_ops(cfg, T_CTX) + costs.router_lookup_ops(cfg)
    assert costs.router_lookup_ops(cfg) == (cfg.n_actions if token else 0)
    measured["backbone_linear"] += costs.backbone_linear_allowance(cfg)
    assert measured.pop("untagged") == 0
    assert {k: v for k, v in measured.items() if v != expected.by_component[k]} == {}
    if script == "stop":
        assert expected.by_component["controller"] == 0 and expected.by_component["readout"] == 0
        assert expected.by_component["router"] > 0 and expected.by_component["bank_projection"] > 0


def test_negative_control_a_router_priced_at_zero_fails_the_tie():
    """A cost model that forgets the router's head (the term set to 0) no longer matches the counted FLOPs."""
    model = tiny_model(0, optimised=True, **ROUTER)
    oc, roll = decode_one_token(model, model.cfg.stop_action, 1)
    expected = costs.trace_cost(model.cfg, roll.actions[0], [T_CTX], roll.controller_steps[0], optimised=True,
                                router=False)
    assert oc.by_component["router"] > 0 and expected.by_component.get("router", 0) == 0


def test_router_costs_a_few_percent_of_one_backbone_layer():
    """The router's ops per position: <= 2% of one backbone layer at the recall and demo presets (MoD's order), and
    <= 10% at the recall study's smallest PRISME size; without the option, no router term and seed 000's terms."""
    for preset, kw, bound in (("recall", {}, 0.02), ("demo", {}, 0.02),
                              ("recall", dict(d_model=16, w=32, ws_head_dim=32), 0.10)):
        cfg = PrismeConfig.from_name(preset, router=True, **kw)
        assert 0 < costs.router_share_of_layer(cfg) <= bound, (preset, kw)
        assert "router" in costs.components(cfg)
    assert "router" not in costs.components(PrismeConfig.from_name("recall"))
    assert costs.components(PrismeConfig.from_name("prisme_103m")) == costs.COMPONENTS


def test_trace_cost_rejects_a_router_trace_for_a_model_without_one():
    with pytest.raises(ValueError, match="router"):
        costs.trace_cost(PrismeConfig.from_name("tiny"), torch.zeros(1, 1, dtype=torch.long), [3], router=True)


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("cost", [float("nan"), float("inf"), -0.1])
def test_a_non_finite_or_negative_price_is_a_value_error_naming_cost(cost):
    """A price vector with a NaN, an infinity or a negative entry would make every position STOP (or edit at any
    price): forward_policy, decode_step and generate refuse it, naming `cost`."""
    model = tiny_model(0, **ROUTER)
    bad = model.action_cost.clone()
    bad[1] = cost
    tokens = torch.randint(0, 64, (1, 6))
    with pytest.raises(ValueError, match="cost"):
        model.forward_policy(tokens, 2, cost=bad)
    state = model.new_decode_state(1)
    with pytest.raises(ValueError, match="cost"):
        state.decode_step(tokens, policy=Controller(max_budget=2, cost=bad))
    assert state.lengths == [0]


@pytest.mark.parametrize("cost", ["abc", [True] * 6, [1.0, 2.0]])
def test_a_price_vector_of_the_wrong_kind_is_a_value_error_naming_cost(cost):
    model = tiny_model(0, **ROUTER)
    with pytest.raises(ValueError, match="cost"):
        model.forward_policy(torch.randint(0, 64, (1, 6)), 2, cost=cost)


@pytest.mark.parametrize("lam", [float("nan"), float("inf"), -1.0])
def test_a_bad_router_price_is_a_value_error_naming_lambda_cost(lam):
    model = tiny_model(0, **ROUTER)
    with pytest.raises(ValueError, match="lambda_cost"):
        model.forward_policy(torch.randint(0, 64, (1, 6)), 1, lambda_cost=lam)


@pytest.mark.parametrize("bad, field", [(dict(router=1), "router"), (dict(router_ngram=-1), "router_ngram"),
                                        (dict(router=True, use_workspace=False), "router"),
                                        (dict(router_token=True), "router_token"),
                                        (dict(router=True, router_token=1), "router_token")])
def test_bad_router_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        PrismeConfig.from_name("tiny", **bad)


# ---------------------------------------------------------------------- the router stage
MQAR = {"vocab_size": 64, "seq_len": 16, "n_pairs": 2, "query_min_pos": 4}


def stage(tmp_path, name: str, **kw) -> StageConfig:
    base = dict(stage=name, steps=4, batch_size=8, warmup=1, eval_every=0, eval_batches=1, dataset="mqar", mqar=MQAR,
                out_dir=str(tmp_path / name), progress=False, seed=3)
    return StageConfig(**{**base, **kw})


@pytest.mark.parametrize("token", [False, True], ids=["plain", "token_table"])
def test_router_stage_trains_the_router_alone_and_generate_and_eval_run_it(tmp_path, token):
    """backbone -> workspace -> router on MQAR: the router stage moves the router's weights (its token table too) and
    nothing else; its checkpoint generates with the router (budget 1) and `prisme eval` scores its deployed policy
    with the router's term in the ops."""
    cfg = PrismeConfig.from_name("tiny", router_token=token, **ROUTER)
    r1 = train_stage(cfg, stage(tmp_path, "backbone"))
    r2 = train_stage(None, stage(tmp_path, "workspace", init_from=str(r1.checkpoint)))
    r3 = train_stage(None, stage(tmp_path, "router", init_from=str(r2.checkpoint), steps=6, max_budget=1,
                                 oracle_positions=16, lr=0.05))
    before, _ = load_model(r2.checkpoint)
    after, _ = load_model(r3.checkpoint)
    a = after.state_dict()
    changed = {k for k, v in before.state_dict().items() if not torch.equal(v, a[k])}
    assert changed == {"router.head.weight", "router.head.bias"} | ({"router.token_value.weight"} if token else set())
    assert {"value_mse", "top1_agree", "oracle_best_dl"} <= set(r3.train)
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli.main(["generate", "--checkpoint", str(r3.checkpoint), "--prompt-ids", "5,40,9,33,5",
                       "--max-new-tokens", "2", "--budget", "1", "--lambda-cost", "0"])
    assert rc == 0 and buf.getvalue()
    from prisme.data.mqar import MQARDataset

    res = evaluate(after, MQARDataset(MQARConfig(**MQAR)), policies=["backbone", "controller"],
                            batch_size=4, seq_len=16, max_batches=1, lambdas=[0.0], controller_budget=1)
    row = next(r for r in res.rows if r.family == "controller")
    x = MQARDataset(MQARConfig(**MQAR)).batch("val", 1, 16, torch.Generator().manual_seed(0))[0]
    bank_and_router = costs.token_ops(after.cfg, 16, router=True)["workspace"]
    assert bank_and_router > 0 and row.relative_ops > 1.0  # every position pays the bank and the router
    assert after.forward_policy(x, 1, lambda_cost=0.0).controller_steps.sum() == 0  # budget 1: the router alone


def test_router_stage_needs_a_router_model_and_a_router_checkpoint_needs_a_router_config(tmp_path):
    """The router stage on a model built without the router, and a router checkpoint loaded as a config without it,
    are ValueErrors naming `router`, before anything trains."""
    plain = PrismeConfig.from_name("tiny")
    r1 = train_stage(plain, stage(tmp_path / "plain", "backbone", steps=1))
    r2 = train_stage(None, stage(tmp_path / "plain", "workspace", steps=1, init_from=str(r1.checkpoint)))
    with pytest.raises(ValueError, match="router"):
        train_stage(None, stage(tmp_path / "plain", "router", init_from=str(r2.checkpoint)))
    assert not (tmp_path / "plain" / "router").exists()
    routed = PrismeConfig.from_name("tiny", **ROUTER)
    r1r = train_stage(routed, stage(tmp_path / "routed", "backbone", steps=1))
    with pytest.raises(ValueError, match="router"):
        load_checkpoint(r1r.checkpoint, expected_config=routed.replace(router=False))
    with pytest.raises(ValueError, match="router"):
        load_checkpoint(r1.checkpoint, expected_config=plain.replace(router=True))


# ---------------------------------------------------------------------- derived sizes
def test_replace_derives_sizes_from_the_new_inputs_unless_set():
    """`replace(d_model=32)` on the d=64 recall preset gets d=32's ffn_hidden (as `from_name` does); an explicitly set
    value is kept. The negative control: d=64's ffn_hidden differs, so keeping it would be caught."""
    base = PrismeConfig.from_name("recall")
    assert base.replace(d_model=32).ffn_hidden == PrismeConfig.from_name("recall", d_model=32).ffn_hidden
    assert base.replace(d_model=32).ffn_hidden != base.ffn_hidden
    assert base.replace(w=32, ws_head_dim=32).editor_hidden == PrismeConfig.from_name(
        "recall", w=32, ws_head_dim=32).editor_hidden
    assert base.replace(d_model=32, ffn_hidden=96).ffn_hidden == 96
    assert base.replace(max_seq_len=64).cost_context == 64
    explicit = PrismeConfig.from_name("prisme_103m")  # cost_context set to 512 = max_seq_len: derived, follows
    assert explicit.replace(max_seq_len=256).cost_context == 256


def test_the_deployed_decode_step_ties_to_trace_cost_term_by_term():
    """A batched decode step at budget 1 where some rows fire and some do not (`routed.budget1_step`: the fired rows
    edit without a bank mask, their readout as one batched read): counted matmul FLOPs equal `trace_cost` of the
    step's traces term by term, with the named allowances per position; the editor's cross-attention to the bank is
    counted as such without a mask. Negative control: the same counts read as one row fewer firing do not tie."""
    model = tiny_model(0, optimised=True, **ROUTER)
    cfg, B, T = model.cfg, 4, 12
    tokens = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(8))
    for lam in (0.0, 1e-3, 1e-2, 0.03, 0.1, 0.3, 1.0):
        st = model.new_decode_state(B, T + 1)
        st.prefill(tokens[:, :T], logits="none")
        with OpsCounter(model) as oc:
            out = st.decode_step(tokens[:, T], policy=Controller(max_budget=1, lambda_cost=lam))
        fired = int(out.n_edits.sum())
        if 0 < fired < B:
            break
    assert 0 < fired < B
    ctx = [T + 1] * B

    def expected(actions):
        return costs.trace_cost(cfg, actions, ctx, out.controller_steps[:, 0], optimised=True, router=True)

    measured = dict(oc.by_component)
    measured["router"] += B * (costs.router_match_ops(cfg, T + 1) + costs.router_lookup_ops(cfg))
    measured["backbone_linear"] += B * costs.backbone_linear_allowance(cfg)
    # what the cost model charges and the step does not compute (conservative): the n-gram column's multiply-add at
    # every position (folded into a select of the bias), and z at each position the router stopped (kept entries
    # charge it at every position)
    measured["router"] += B * 2 * cfg.n_actions
    measured["bank_projection"] += (B - fired) * costs.bank_projection_ops(cfg, 0, True)
    assert measured.pop("untagged") == 0 and measured["editor_source_attn"] > 0
    want = expected(out.actions[:, 0]).by_component
    assert {k: (v, want[k]) for k, v in measured.items() if v != want[k]} == {}
    one_less = out.actions[:, 0].clone()
    one_less[int(torch.nonzero(out.n_edits[:, 0])[0])] = cfg.stop_action
    assert any(v != expected(one_less).by_component[k] for k, v in measured.items())
