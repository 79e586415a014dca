"""The decode step of a router model (`prisme.model.plans`), per-vocabulary bank tables (`prisme.model.bank.tables`,
the decode option `bank_tables`), their price in the cost model, generation's per-token ops and `prisme bench
decode`'s JSON.

* tables equal the projections of every token's normed embedding in float64, and follow weight changes (negative
  control: a stale table no longer equals them);
* decoding with tables equals teacher-forced `forward_policy` and decoding without them, in float64, at prices
  where the router never fires, fires sometimes, and always; ragged rows included;
* the cost model prices an embedding term's projections as lookups, tied to the counted matmul FLOPs of the decode
  step's bank and query (the lookups are the named allowance; negative control: without tables the same step
  counts the projections);
* `position_ops` equals `trace_cost` of the one position;
* `prisme bench decode` on the tiny preset writes its JSON document in seconds.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from tiny_models import tiny_model

from prisme import costs
from prisme.costs.counting import OpsCounter
from prisme.costs.traces import position_ops, trace_cost
from prisme.decoding.generate import generate
from prisme.model.bank.tables import bank_tables, step_entries
from prisme.model.outputs import Streams
from prisme.model.policy import Controller
from prisme.options import DecodeOptions

EMBED = dict(bank_source="embedding", query_source="embedding", bank_shift=True, router=True)
TABLES = DecodeOptions(bank_tables=True)


def pair(**extra):
    """(without tables, with tables) float64 router models with the same weights."""
    ref = tiny_model(0, **EMBED, **extra)
    tab = tiny_model(0, decode=TABLES, **EMBED, **extra)
    tab.load_state_dict(ref.state_dict())
    return ref, tab


def test_tables_equal_the_projections_and_follow_the_weights():
    _, model = pair()
    E = model.bank_norm(model.backbone.tok_emb.weight)  # [V, d]
    tabs = bank_tables(model.bank)
    w = model.cfg.w
    torch.testing.assert_close(tabs["KV"][:, :w], model.W_K(E), rtol=0, atol=1e-13)  # K, then V
    torch.testing.assert_close(tabs["KV"][:, w:], model.W_V(E), rtol=0, atol=1e-13)
    torch.testing.assert_close(tabs["P"], model.P(E), rtol=0, atol=1e-13)
    torch.testing.assert_close(tabs["S"][:-1], model.W_K_shift(E), rtol=0, atol=1e-13)
    assert bool((tabs["S"][-1] == 0).all()) and bank_tables(model.bank) is tabs  # row V: no previous position; cached
    assert torch.equal(tabs["S2"], torch.cat([tabs["S"], torch.zeros_like(tabs["S"])], -1))  # the key part only
    with torch.no_grad():
        model.W_K.weight.add_(0.1)  # negative control: the old table is stale, a new one is built
    assert not torch.allclose(tabs["KV"][:, :w], model.W_K(E))
    torch.testing.assert_close(bank_tables(model.bank)["KV"][:, :w], model.W_K(E), rtol=0, atol=1e-13)


@pytest.mark.parametrize("lam", [0.0, 0.05, 1e9], ids=["always", "sometimes", "never"])
@pytest.mark.parametrize("budget", [1, 2])
def test_decoding_with_tables_equals_forward_policy(budget, lam):
    ref, model = pair()
    toks = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(3))
    full = ref.forward_policy(toks, budget, lambda_cost=lam)
    for m in (ref, model):
        st = m.new_decode_state(3, 24)
        outs = [st.prefill(toks[:, :5], logits="all", policy=Controller(max_budget=budget, lambda_cost=lam))]
        outs += [st.decode_step(toks[:, i:i + 1], policy=Controller(max_budget=budget, lambda_cost=lam))
                 for i in range(5, 20)]
        logits = torch.cat([o.logits for o in outs], 1)
        actions = torch.cat([o.actions for o in outs], 1)
        torch.testing.assert_close(logits, full.logits, rtol=0, atol=1e-12)
        assert torch.equal(actions, full.actions)
    if lam == 0.05:
        assert 0 < float((full.n_edits > 0).double().mean()) < 1  # some positions fire, some do not


def test_ragged_generation_with_tables_equals_without():
    ref, model = pair()
    prompts = [[1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 9, 6, 7, 8]]
    a = generate(ref, prompts, 6, policy=Controller(max_budget=2, lambda_cost=0.02))
    b = generate(model, prompts, 6, policy=Controller(max_budget=2, lambda_cost=0.02))
    assert a.tokens == b.tokens and a.n_edits == b.n_edits
    assert all(torch.equal(x, y) for x, y in zip(a.actions, b.actions))


@pytest.mark.parametrize("tables", [True, False], ids=["tables", "projections"])
def test_bank_lookups_tie_to_counted_flops(tables):
    """One new position's bank entry and z: counted matmul FLOPs equal bank_ops minus the lookups; without tables
    (the negative control) the same step counts every projection."""
    ref, model = pair()
    m = model if tables else ref
    cfg, decode = m.cfg, m.decode_options
    toks = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        st = m.streams(toks)
        last = st.index(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[4]]))
        prev = [toks[:, 3]] if tables else [m.bank.inputs(st)[0][:, 3]]
        bank_tables(m.bank) if tables else None  # built outside the counted step
        with OpsCounter(m) as oc:
            step_entries(m.bank, decode, last, last.ids, prev)
            m.query_state(Streams(last.H, last.src, last.ids), decode)
    expected = costs.bank_ops(cfg, decode=decode)
    assert oc.total == sum(expected.values()) - costs.bank_lookup_ops(cfg, decode=decode)
    if tables:
        assert costs.bank_lookup_ops(cfg, decode=decode) == 4 * cfg.w and oc.total == 0
        assert expected == {"bank_projection": 3 * cfg.w, "bank_shift": cfg.w}
    else:
        assert costs.bank_lookup_ops(cfg, decode=decode) == 0
        assert expected["bank_projection"] == 3 * 2 * cfg.d_model * cfg.w


def test_tables_need_an_embedding_source():
    """A model, or a decode state, whose bank and query read no embedding cannot be served from tables."""
    with pytest.raises(ValueError, match="bank_tables"):
        tiny_model(0, decode=TABLES)
    with pytest.raises(ValueError, match="bank_tables"):
        tiny_model(0).new_decode_state(1, options=TABLES)


def test_position_ops_equals_trace_cost():
    model = tiny_model(0, decode=TABLES, **EMBED)
    cfg, decode = model.cfg, model.decode_options
    stop, dense = cfg.stop_action, cfg.dense_action
    for acts, steps in (([stop, stop], 0), ([1, stop], 0), ([cfg.n_slots, 2], 1), ([dense, stop], 0)):
        for router in (True, False):
            want = trace_cost(cfg, [acts], [9], [steps], cfg.optimised, router, decode).total_ops
            assert position_ops(cfg, 9, acts, steps, cfg.optimised, router, decode) == want
    assert position_ops(cfg, 9, None) == trace_cost(cfg, None, [9]).total_ops


def test_bench_decode_json_on_the_tiny_preset(tmp_path, capsys):
    from prisme.bench.decode import PARTS, main

    out = tmp_path / "decode.json"
    args = argparse.Namespace(shapes="tiny", batches="1,2", prompt_len=4, new_tokens=4, repeats=1, edit_rate=0.25,
                              threads=1, no_tables=False, bank_store="entries", seed=0, json=str(out), compile=False)
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "decode" and {"torch", "threads", "mode"} <= set(doc["environment"])
    assert [(r["shape"], r["batch"]) for r in doc["results"]] == [("tiny", 1), ("tiny", 2)]
    for res in doc["results"]:
        assert set(res["rows"]) == {"backbone", "routed_off", "routed"}
        for row in res["rows"].values():
            assert set(row["parts"]) == set(PARTS) and row["t_over_ops"] > 0
            assert abs(sum(p["share_of_time"] for p in row["parts"].values()) - 1) < 1e-9
        assert res["rows"]["routed_off"]["edits_per_token"] == 0 and res["rows"]["backbone"]["ops_ratio"] == 1
        for row in res["rows"].values():  # tokens/s from the step's time; the state is the model's at T_max
            assert row["tokens_per_s"] == pytest.approx(res["batch"] * 1000 / row["ms_per_step"])
        from prisme.bench.decode import shapes
        from prisme.model.state import DecodeState
        (_, tiny, _), = shapes(["tiny"], True, 0)
        assert res["rows"]["routed"]["state_bytes"] == DecodeState(tiny, res["batch"], tiny.cfg.max_seq_len).nbytes > 0
    text = capsys.readouterr().out
    assert "routed_off" in text
    for v, res in zip(doc["targets"]["by_shape"], doc["results"]):  # a verdict per shape and batch, printed
        met = res["rows"]["routed_off"]["t_over_ops"] <= 1.25 and res["rows"]["routed"]["t_over_ops"] <= 1.5
        assert v["eager"] == met and v["compiled"] is None
        assert f"targets, tiny batch {res['batch']} (t/ops never firing <= 1.25, deployed <= 1.5): eager " \
               f"{'met' if met else 'missed'}" in text


@pytest.mark.slow
def test_bench_decode_compiled_paths_take_the_same_traces_as_the_eager_ones(tmp_path):
    """`--compile` adds the two router policies with the editor under torch.compile, in the same rotation: the router
    decides eagerly, so they take the eager paths' traces and ops exactly."""
    from prisme.bench.decode import main

    out = tmp_path / "decode.json"
    args = argparse.Namespace(shapes="tiny", batches="2", prompt_len=4, new_tokens=6, repeats=1, edit_rate=0.25,
                              threads=1, no_tables=False, bank_store="entries", seed=0, json=str(out), compile=True)
    assert main(args) == 0
    doc = json.loads(out.read_text())
    rows = doc["results"][0]["rows"]
    assert set(rows) == {"backbone", "routed_off", "routed", "off_compiled", "routed_compiled"}
    routed, base = rows["routed"]["ops_per_token"], rows["backbone"]["ops_per_token"]
    assert rows["routed_compiled"]["ops_per_token"] == routed > base
    assert rows["off_compiled"]["ops_per_token"] == rows["routed_off"]["ops_per_token"]
    assert "compiled" in doc["environment"]["mode"]
    verdict, = doc["targets"]["by_shape"]  # each plan's verdict from its own rows
    assert verdict["compiled"] == (rows["off_compiled"]["t_over_ops"] <= 1.25
                                   and rows["routed_compiled"]["t_over_ops"] <= 1.5) == doc["targets"]["met_compiled"]
    assert verdict["eager"] == doc["targets"]["met"]


def test_bench_decode_times_the_recall_winners_of_each_length():
    """`recall_T32` and `recall_T1024` are the frontier's winners at their lengths: PRISME d=16/w=32 with its router
    (a 64-position-window key-shift backbone whose router reads the token at T = 1,024) beside one key-shift layer (d=8
    at T = 32, d=16 with global attention at 1,024); the long shape's default prompt leaves room for its new tokens, and
    an unknown shape is a ValueError."""
    from prisme.bench.decode import LONG_PROMPT, prompt_length, shapes

    (n32, p32, d32), (n1k, p1k, d1k) = shapes(["recall_T32", "recall_T1024"], True, 0)
    assert (p32.cfg.d_model, p32.cfg.w, p32.cfg.router, p32.cfg.attn_window, p32.cfg.max_seq_len) == (16, 32, True,
                                                                                                        None, 32)
    assert (d32.cfg.n_layer, d32.cfg.d_model, d32.cfg.key_shift, d32.cfg.use_workspace) == (1, 8, True, False)
    assert (p1k.cfg.d_model, p1k.cfg.w, p1k.cfg.attn_window, p1k.cfg.max_seq_len) == (16, 32, 64, 1024)
    assert p1k.cfg.key_shift and p1k.cfg.router_token  # the long-context study's member, not the T = 32 one
    assert (d1k.cfg.n_layer, d1k.cfg.d_model, d1k.cfg.key_shift, d1k.cfg.attn_window) == (1, 16, True, None)
    assert p1k.decode_options.bank_tables and prompt_length(n1k, None) == LONG_PROMPT < 1024 - 3
    assert prompt_length(n32, None) == 8
    assert prompt_length(n1k, 5) == 5 and p1k.decode_options.bank_store == "entries"
    (n8, p8, d8), = shapes(["recall_T1024_d8"], True, 0)  # the study's cheapest passing member, same rival
    assert (p8.cfg.d_model, p8.cfg.w, p8.cfg.attn_window, p8.cfg.key_shift, p8.cfg.router_token) == (8, 32, 64, True,
                                                                                                       True)
    assert d8.cfg == d1k.cfg and prompt_length(n8, None) == LONG_PROMPT
    (_, ids, _), = shapes(["recall_T1024"], True, 0, "ids")
    assert ids.decode_options.bank_store == "ids" and ids.new_decode_state(1).bank.KV is None  # the ids alone
    with pytest.raises(ValueError, match="unknown shape"):
        shapes(["recall_T64"], True, 0)
    from prisme.bench.decode import edit_rate  # each shape's deployed edit rate, unless --edit-rate is given
    assert (edit_rate("recall_T1024", None), edit_rate("recall_T32", None), edit_rate("demo", 0.3)) == (0.0076, 0.125,
                                                                                                      0.3)


def test_a_module_replaced_after_the_first_lookup_is_served_once_the_tables_are_cleared():
    """The tables are checked against the weights they were built from (no module lookup per step): an assigned new
    module is served after `clear_bank_tables`. Negative control: before clearing, the tables are the old module's."""
    from prisme.model.bank.tables import clear_bank_tables

    _, model = pair()
    E = model.bank_norm(model.backbone.tok_emb.weight)
    old = bank_tables(model.bank)["P"]
    model.P = torch.nn.Linear(model.cfg.d_model, model.cfg.w, bias=False).double()
    assert bank_tables(model.bank)["P"] is old and not torch.allclose(old, model.P(E))  # stale until cleared
    clear_bank_tables(model.bank)
    torch.testing.assert_close(bank_tables(model.bank)["P"], model.P(E), rtol=0, atol=1e-13)


@pytest.mark.parametrize("store", ["entries", "ids"])
def test_the_deployed_step_of_ragged_rows_equals_forward_policy_row_by_row(monkeypatch, store):
    """Rows at different lengths decode at budget 1 (`routed.budget1_step`: the bank mask of a fired row shorter than
    the longest; rows of one length read their whole bank without a mask) what `forward_policy` computes on each row
    alone, in float64 to 1e-12 with the same traces, with kept entries and kept ids. Negative control: a fired row
    that reads the bank without its mask (keys past its length) differs."""
    model = tiny_model(0, decode=DecodeOptions(bank_tables=True, bank_store=store), **EMBED)
    lens, n_steps, lam = [6, 3, 9], 8, 0.02
    seqs = torch.randint(0, 64, (3, 9 + n_steps), generator=torch.Generator().manual_seed(7))

    def decode(m):
        st = m.new_decode_state(3, 9 + n_steps)
        st.prefill(seqs[:, :9], lens, logits="none")
        outs = [st.decode_step(torch.stack([seqs[b, lens[b] + i] for b in range(3)]).view(3, 1),
                               policy=Controller(max_budget=1, lambda_cost=lam)) for i in range(n_steps)]
        return torch.cat([o.logits for o in outs], 1), torch.cat([o.actions for o in outs], 1)

    logits, actions = decode(model)
    fired = 0
    for b, L in enumerate(lens):
        full = model.forward_policy(seqs[b:b + 1, :L + n_steps], 1, lambda_cost=lam)
        torch.testing.assert_close(logits[b], full.logits[0, L:], rtol=0, atol=1e-12)
        assert torch.equal(actions[b], full.actions[0, L:])
        fired += int((full.actions[0, L:, 0] != model.cfg.stop_action).sum())
    assert 0 < fired < 3 * n_steps  # steps where rows fire and steps where they do not
    import copy

    import prisme.model.plans.budget1 as budget1

    def unmasked_read(read):  # every key of the padded bank, as if the mask were dropped
        out = copy.copy(read)
        out.mask = None
        return out

    orig = budget1.edit_group
    monkeypatch.setattr(budget1, "edit_group", lambda blocks, S, slots, read, e: orig(blocks, S, slots,
                                                                                      unmasked_read(read), e))
    unmasked, _ = decode(model)
    assert (unmasked - logits).abs().max() > 1e-6


@pytest.mark.parametrize("optimised", [True, False])
def test_readout_of_edited_rows_equals_the_readout(optimised):
    """`DifferentialReadout.edited` (both reads as one batched read, what the deployed step calls) equals `forward`
    in float64 to 1e-14, with the folded query and without. Negative control: the two states swapped differ."""
    model = tiny_model(0, optimised=optimised)
    g = torch.Generator().manual_seed(9)
    M, w = model.cfg.n_slots, model.cfg.w
    S, S0 = torch.randn(5, M, w, generator=g, dtype=torch.float64), torch.randn(5, M, w, generator=g,
                                                                            dtype=torch.float64)
    z = torch.randn(5, w, generator=g, dtype=torch.float64)
    want = model.readout(S, S0, z)
    torch.testing.assert_close(model.readout.edited(S, S0, z), want, rtol=0, atol=1e-14)
    assert (model.readout.edited(S0, S, z) - want).abs().max() > 1e-3


def test_a_model_built_under_inference_mode_decodes_the_same_and_keeps_its_tables_and_router_fold(monkeypatch):
    """Weights made under `torch.inference_mode` are inference tensors, which keep no version counter: the same
    logits as the model built outside it, the bank tables and the router's folded price built once and kept across
    the steps (`version_counter` is -1 for them, asked without the raise that reading the counter gives). Negative
    control: a weight key that differs at every call rebuilds both at every step."""
    import prisme.model.bank.tables as tables

    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    ref = tiny_model(0, decode=TABLES, **EMBED)
    with torch.inference_mode():
        model = tiny_model(0, decode=TABLES, **EMBED)
    assert all(p.is_inference() for p in model.parameters())

    def decode(m):
        kept = []
        with torch.inference_mode():
            state = m.new_decode_state(2, 16)
            outs = [state.prefill(tokens[:, :4], policy=Controller(1, lambda_cost=0.05))]
            for i in range(4, 12):
                outs.append(state.decode_step(tokens[:, i:i + 1], policy=Controller(1, lambda_cost=0.05)))
                kept.append((m.bank.__dict__["_table_cache"][2], m.router.__dict__["_folded_cache"][4]))
        return torch.cat([o.logits for o in outs], 1), kept

    want, _ = decode(ref)
    got, kept = decode(model)
    assert torch.equal(got, want)
    assert all(t is kept[0][0] and f is kept[0][1] for t, f in kept)  # built once
    calls = iter(range(10**6))
    monkeypatch.setattr(tables, "version_counter", lambda p: next(calls))
    monkeypatch.setattr("prisme.model.router.version_counter", lambda p: next(calls))
    _, rebuilt = decode(model)
    assert len({id(t) for t, _ in rebuilt}) == len(rebuilt) and len({id(f) for _, f in rebuilt}) == len(rebuilt)
