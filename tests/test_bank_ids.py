"""A decode state that keeps the bank as token ids (`DecodeOptions(bank_store="ids")`, `bank.tables.entries_from_ids`).

* decoding equals teacher-forced `forward_policy` in float64 and the state that keeps every entry, at prices where
  the router never fires, fires sometimes and always (negative control: a lookup whose shift reads the position's
  own id instead of the previous one is caught); a decode step's fired rows at budget 1 read their ids through the
  tables (`IdRead`: scores and weights per vocabulary entry, no entry written), equal to attention over the looked-up
  entries in float64, ragged rows' masks included (negative controls: an `IdRead` whose shift reads the own id, or
  that drops the mask, is caught);
* the state holds the ids alone (no entries, no shift memory), so it rewinds to any length its rows share;
* the cost model charges nothing for a position's own entry and, where its workspace runs, the lookups of its whole
  context: tied to the counted FLOPs of the lookups (none: they are the named allowance) and to generation's
  per-token ops; at the deployed decode step, where reading the ids through the tables takes fewer ops (about
  T > 1.5 V), z and that read's products and gathers instead, tied to the FLOPs counted on the step (negative
  control: a step that looks its entries up anyway misses that price);
* options, or a config, that cannot serve the bank from ids are a ValueError naming the fields.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model

import prisme.model.bank.cache as cache_mod
import prisme.model.bank.read as read_mod
from prisme import costs
from prisme.costs.counting import OpsCounter
from prisme.costs.traces import position_ops, trace_cost
from prisme.decoding.generate import generate
from prisme.model.bank.read import IdRead, bank_attend
from prisme.model.bank.tables import bank_tables, entries_from_ids
from prisme.model.outputs import Streams
from prisme.model.policy import Controller
from prisme.options import DecodeOptions

V = 8  # a small vocabulary: from T = 14 on a fired row reads its ids through the tables (`tables_read_pays`), before
#   it looks its entries up, so a decode of 20 positions runs both reads
EMBED = dict(bank_source="embedding", query_source="embedding", bank_shift=True, router=True, vocab_size=V)
ENTRIES, IDS = DecodeOptions(bank_tables=True), DecodeOptions(bank_tables=True, bank_store="ids")


def trio():
    """(no tables, kept entries, kept ids) float64 router models with the same weights."""
    ref = tiny_model(0, **EMBED)
    entries = tiny_model(0, decode=ENTRIES, **EMBED)
    ids = tiny_model(0, decode=IDS, **EMBED)
    entries.load_state_dict(ref.state_dict())
    ids.load_state_dict(ref.state_dict())
    return ref, entries, ids


def decode(m, toks, budget, lam):
    st = m.new_decode_state(toks.shape[0], 24)
    outs = [st.prefill(toks[:, :5], logits="all", policy=Controller(max_budget=budget, lambda_cost=lam))]
    outs += [st.decode_step(toks[:, i:i + 1], policy=Controller(max_budget=budget, lambda_cost=lam))
             for i in range(5, toks.shape[1])]
    return torch.cat([o.logits for o in outs], 1), torch.cat([o.actions for o in outs], 1)


@pytest.mark.parametrize("lam", [0.0, 2.0, 1e9], ids=["always", "sometimes", "never"])
@pytest.mark.parametrize("budget", [1, 2])
def test_decoding_with_kept_ids_equals_forward_policy_and_kept_entries(budget, lam):
    ref, entries, ids = trio()
    toks = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(3))
    full = ref.forward_policy(toks, budget, lambda_cost=lam)
    logits, actions = decode(ids, toks, budget, lam)
    torch.testing.assert_close(logits, full.logits, rtol=0, atol=1e-12)
    assert torch.equal(actions, full.actions)
    kept_logits, kept_actions = decode(entries, toks, budget, lam)
    torch.testing.assert_close(logits, kept_logits, rtol=0, atol=1e-12)  # budget 1 reads through the tables:
    assert torch.equal(actions, kept_actions)  # the same attention summed in another order
    if lam == 2.0:
        assert 0 < float((full.n_edits > 0).double().mean()) < 1  # some positions fire, some do not


def test_negative_control_a_lookup_shifted_onto_its_own_id_is_caught(monkeypatch):
    ref, _, ids = trio()
    toks = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(3))
    full = ref.forward_policy(toks, 1, lambda_cost=0.0)

    def own_id(bank, rows_ids, tabs=None):  # K' of the position's own token instead of the previous one
        tabs = bank_tables(bank) if tabs is None else tabs
        return F.embedding(rows_ids, tabs["KV"]) + F.embedding(rows_ids, tabs["S2"])

    monkeypatch.setattr(read_mod, "entries_from_ids", own_id)
    logits, _ = decode(ids, toks, 2, 0.0)  # budget 2: the rollout reads looked-up entries
    full = ref.forward_policy(toks, 2, lambda_cost=0.0)
    assert not torch.allclose(logits, full.logits, rtol=0, atol=1e-6)


def _id_read_case(ragged: bool):
    """(model, IdRead of 3 rows, the same bank's looked-up entries K, V, mask or None, queries [3, 2, w])."""
    _, _, ids = trio()
    g = torch.Generator().manual_seed(7)
    rows_ids = torch.randint(0, ids.cfg.vocab_size, (3, 17), generator=g)
    mask = (torch.arange(17) < torch.tensor([17, 9, 12]).unsqueeze(1)) if ragged else None
    K, V = entries_from_ids(ids.bank, rows_ids).split(ids.cfg.w, -1)
    q = torch.randn(3, 2, ids.cfg.w, generator=g, dtype=torch.float64)
    return ids, IdRead(ids.bank, rows_ids, ids.cfg.n_ws_heads), K, V, mask, q


def _attend(model, K, V, mask, q):
    """`bank_attend` over entries (what the editor reads from a bank kept as entries)."""
    N, k, w = q.shape
    nh = model.cfg.n_ws_heads
    Kh, Vh = (t.view(N, -1, nh, w // nh).transpose(1, 2) for t in (K, V))
    m = None if mask is None else mask.view(N, 1, 1, -1).expand(N, 1, k, mask.shape[-1])
    return bank_attend(q, Kh, Vh, m, None, None, True)


@pytest.mark.parametrize("ragged", [False, True])
def test_id_read_equals_attention_over_the_looked_up_entries(ragged):
    model, read, K, V, mask, q = _id_read_case(ragged)
    want = _attend(model, K, V, mask, q)
    torch.testing.assert_close(read.rows(0, 3, mask).attend(q), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(read.rows(1, 3, None if mask is None else mask[1:]).attend(q[1:]), want[1:],
                               rtol=0, atol=1e-12)
    if ragged:  # negative control: the mask dropped
        assert not torch.allclose(read.rows(0, 3, None).attend(q), want, rtol=0, atol=1e-6)


def test_negative_control_an_id_read_whose_shift_reads_the_own_id_is_caught(monkeypatch):
    ref, _, ids = trio()
    toks = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(3))
    full = ref.forward_policy(toks, 1, lambda_cost=0.0)
    rows = IdRead.rows

    def own(self, i, j, mask):
        out = rows(self, i, j, mask)
        out.prev = out.ids
        return out

    monkeypatch.setattr(IdRead, "rows", own)
    logits, _ = decode(ids, toks, 1, 0.0)
    assert not torch.allclose(logits, full.logits, rtol=0, atol=1e-6)


def test_kept_ids_state_holds_the_ids_alone_and_rewinds_to_any_shared_length():
    _, entries, ids = trio()
    toks = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(5))
    st = ids.new_decode_state(2, 24)
    assert st.bank.KV is None and st.bank.prev == [] and st.bank.ids is not None
    assert st.nbytes == st.cache.nbytes + 2 * 24 * 8 + 2 * V  # int64 ids, nothing per entry; the router's table
    #   of the 1-grams each row holds (V bools a row)
    kept = entries.new_decode_state(2, 24)
    assert kept.nbytes - st.nbytes == 2 * 24 * 2 * ids.cfg.w * 8 + 2 * 8  # its entries and its shift's ids
    st.prefill(toks[:, :12], logits="none")
    st.rewind(7)  # mid-sequence: no shift memory to lose
    again = st.prefill(toks[:, 7:12], logits="all", policy=Controller(max_budget=1, lambda_cost=0.0))
    fresh = ids.new_decode_state(2, 24).prefill(toks[:, :12], logits="all",
                                                policy=Controller(max_budget=1, lambda_cost=0.0))
    torch.testing.assert_close(again.logits, fresh.logits[:, 7:], rtol=0, atol=1e-12)
    kept.prefill(toks[:, :12], logits="none")
    with pytest.raises(ValueError, match="bank shift"):  # the kept entries' shift memory cannot
        kept.rewind(7)


def test_kept_ids_price_the_lookups_of_the_whole_context_where_the_workspace_runs():
    _, entries, ids = trio()
    cfg, w, T = ids.cfg, ids.cfg.w, 9
    assert costs.bank_ops(cfg, T, reads=False, decode=IDS) == {"bank_projection": 0, "bank_shift": 0}
    read = costs.bank_ops(cfg, T, reads=True, decode=IDS)
    assert read == {"bank_projection": T * 2 * w + w, "bank_shift": T * w}
    assert costs.bank_lookup_ops(cfg, *costs.bank_reads(cfg, T, True, IDS), IDS) == sum(read.values())  # lookups
    assert costs.bank_ops(entries.cfg, T, reads=False, decode=ENTRIES) == {"bank_projection": 3 * w, "bank_shift": w}
    stop = cfg.stop_action
    # a router STOP pays the router alone; a fired position its whole context's lookups (entries: one entry each)
    stopped = costs.token_ops(cfg, T, [], controller_steps=0, router=True, decode=IDS)
    fired = costs.token_ops(cfg, T, [1], controller_steps=0, router=True, decode=IDS)
    base = costs.token_ops(entries.cfg, T, [1], controller_steps=0, router=True, decode=ENTRIES)
    assert stopped["bank_projection"] == stopped["bank_shift"] == 0 and stopped["router"] > 0
    assert fired["total"] - base["total"] == sum(read.values()) - 4 * w
    # a position the router stopped is priced the same by every path (not as a forced all-STOP trace, which reads)
    assert position_ops(cfg, T, [stop], 0, cfg.optimised, True, IDS) == stopped["total"]
    assert trace_cost(cfg, [[stop]], [T], [0], cfg.optimised, True, IDS).total_ops == stopped["total"]
    assert position_ops(cfg, T, [stop], 0, cfg.optimised, decode=IDS) == stopped["total"] - stopped["router"] + sum(
        read.values())
    toks = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        st = ids.new_decode_state(1, 16)
        st.prefill(toks, logits="none")
        s = ids.streams(toks)
        last = s.index(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[T - 1]]))
        bank_tables(ids.bank)  # built outside the counted step
        with OpsCounter(ids) as oc:
            st.bank.view(T, torch.zeros(1, dtype=torch.long))
            ids.query_state(Streams(last.H, last.src, last.ids), IDS)
    assert oc.total == sum(read.values()) - costs.bank_lookup_ops(cfg, *costs.bank_reads(cfg, T, True, IDS), IDS) == 0
    out = generate(ids, [[3, 1, 4, 1, 5]], 16, policy=Controller(max_budget=1, lambda_cost=1.0))
    acts = out.actions[0]
    ctx = torch.arange(5, 21)
    fired = acts[:, 0] != stop
    assert not fired.all() and fired.any()  # both kinds of position, and both reads where one fired:
    assert fired[ctx < 14].any() and fired[ctx >= 14].any()  # entries looked up, then ids through the tables
    want = trace_cost(cfg, acts, ctx, torch.tensor(out.controller_steps[0]), cfg.optimised, True, IDS)
    assert sum(out.ops[0]) == want.total_ops
    assert sum(out.ops[0]) != trace_cost(cfg, acts, ctx, torch.tensor(out.controller_steps[0]), cfg.optimised,
                                         True).total_ops  # control: priced as kept entries, it differs


def _fired_step(model, T):
    """The ops counted on a decode step at context T (one row, budget 1, a price at which the router fires) and the
    step's output."""
    toks = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        st = model.new_decode_state(1, 24)
        st.prefill(toks[:, :-1], logits="none")
        bank_tables(model.bank)  # built outside the counted step
        with OpsCounter(model) as oc:
            out = st.decode_step(toks[:, -1:], policy=Controller(max_budget=1, lambda_cost=0.0))
    return oc, out


def test_a_fired_row_reading_its_ids_through_the_tables_is_priced_as_it_runs(monkeypatch):
    """Where the tables' read pays (T >= 14 at V = 8), a decode step's fired row looks no entry up: it pays z, and the
    tables' products and T gathers instead of attention over T entries, tied to the FLOPs counted on the step (the
    gathers are the named allowance); negative control: a step that looks its entries up anyway misses that price."""
    _, _, ids = trio()
    cfg, w, B_e, T = ids.cfg, ids.cfg.w, ids.cfg.n_edit_blocks, 20
    assert not costs.tables_read_pays(cfg, 13) and costs.tables_read_pays(cfg, 14)
    products, gathers = costs.id_read_attention_ops(cfg, T)
    fired = costs.token_ops(cfg, T, [1], controller_steps=0, router=True, decode=IDS)
    assert fired["bank_projection"] == w and fired["bank_shift"] == 0  # z alone
    assert fired["editor_source_attn"] == B_e * (4 * w * w + products + gathers) < B_e * (4 * w * w + 4 * T * w)
    two = costs.token_ops(cfg, T, [1, 1], controller_steps=1, router=True, decode=IDS)  # the routed plan: lookups
    assert two["bank_projection"] == T * 2 * w + w and two["bank_shift"] == T * w

    def tie(oc, out):
        acts = out.actions[0]  # [1, R]
        assert int(acts[0, 0]) != cfg.stop_action
        k = 1 if int(acts[0, 0]) < cfg.n_slots else 2
        want = trace_cost(cfg, acts, [T], [0], cfg.optimised, True, IDS).by_component
        return oc.by_component["untagged"] == 0 and oc.by_component["editor_source_attn"] == (
            want["editor_source_attn"] - k * B_e * gathers)

    assert tie(*_fired_step(ids, T))
    monkeypatch.setattr(cache_mod, "tables_read_pays", lambda cfg, T: False)
    assert not tie(*_fired_step(ids, T))


@pytest.mark.parametrize("options, fields, match", [
    (dict(bank_store="ids"), {}, "bank_store"),
    (dict(bank_store="ids", bank_tables=True), dict(bank_source="residual", query_source="embedding"), "bank_source"),
    (dict(bank_store="tables"), {}, "bank_store must be one of"),
])
def test_a_bank_that_ids_cannot_serve_is_refused(options, fields, match):
    """Options that cannot keep ids are refused when made; options a model cannot use, when they meet it (the model's
    default options, or a decode state's)."""
    with pytest.raises(ValueError, match=match):
        tiny_model(0, decode=DecodeOptions(**options), **fields)
    if fields:
        with pytest.raises(ValueError, match=match):
            tiny_model(0, **fields).new_decode_state(1, options=DecodeOptions(**options))
