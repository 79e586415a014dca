"""Incremental decoding (`DecodeState`, `generate`) against the parallel teacher-forced model (SPEC §4).

The central claim: feeding tokens through a `DecodeState` in chunks of any size gives the logits and action traces of
one `forward_policy` call — exactly in float64 (<= 1e-12, identical traces), and to 1e-5 in float32 when the
parallel trace is replayed as forced actions (a float32 near-tie may legitimately flip a controller decision). Each
check has a negative control that breaks decoding on purpose (a bank that reads the future, positions reset, a bank
that is never appended) and shows the check fails. All models are the tiny preset with a non-zero readout U (it
starts at zero, which would hide every edit) and a controller that edits at some positions and stops at others.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import assert_close
from tiny_models import tiny_model

from prisme import cli, faults
from prisme.config import PrismeConfig
from prisme.costs.analytic import token_ops
from prisme.costs.traces import position_ops, trace_cost
from prisme.decoding.generate import GenerationOutput, calibrate_lambda, generate, generate_stream
from prisme.decoding.sampling import Sampling, sample_logits
from prisme.model.bank import SourceBank
from prisme.model.policy import Controller, Forced
from prisme.model.prisme import PrismeModel
from prisme.model.state import DecodeState, StepOutput

BUDGET = 3



def make_model(dtype: torch.dtype = torch.float64, seed: int = 0, **overrides) -> PrismeModel:
    """`tiny_models.tiny_model` with the seed's workspace init: a controller that both edits and stops."""
    return tiny_model(seed, dtype, **{"ws_init": "seed", **overrides})


@pytest.fixture(scope="module")
def model64() -> PrismeModel:
    return make_model(torch.float64)


@pytest.fixture(scope="module")
def model32() -> PrismeModel:
    return make_model(torch.float32)


def random_tokens(vocab: int, B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# lengths per row: one full-length row (batch 1), and a ragged batch of three right-padded rows
CASES = {"batch1": [19], "ragged": [19, 11, 15]}


def decode_in_chunks(state: DecodeState, tokens: torch.Tensor, lengths: list[int], chunk: int,
                     policy: Controller | Forced | None = None) -> StepOutput:
    """Feed right-padded `tokens` `[B, T]` through `decode_step` `chunk` columns at a time; concatenate the outputs.

    `Forced` actions `[B, T, R]` and budget `[B, T]` are sliced per chunk like the tokens.
    """
    T = tokens.shape[1]
    outs = []
    for i in range(0, T, chunk):
        n_new = [min(max(L - i, 0), chunk) for L in lengths]
        part = policy
        if isinstance(policy, Forced):
            budget = policy.budget[:, i:i + chunk] if torch.is_tensor(policy.budget) else policy.budget
            part = Forced(policy.actions[:, i:i + chunk], budget)
        outs.append(state.decode_step(tokens[:, i:i + chunk], n_new, part))
    return StepOutput(logits=torch.cat([o.logits for o in outs], 1),
                      **{f: torch.cat([getattr(o, f) for o in outs], 1)
                         for f in ("actions", "n_edits", "controller_steps", "positions", "valid")})


def parallel_reference(model: PrismeModel, tokens: torch.Tensor, lengths: list[int]) -> list:
    """One teacher-forced `forward_policy` per row, on that row's real tokens only (no padding anywhere)."""
    return [model.forward_policy(tokens[b:b + 1, :L], BUDGET, lambda_cost=0.0) for b, L in enumerate(lengths)]


def decode_errors(model: PrismeModel, case: str, chunk: int, refs: list | None = None,
                  replay: bool = False) -> tuple[float, bool]:
    """(max |logit diff| over real positions, every action trace identical) of chunked decoding vs the reference."""
    lengths = CASES[case]
    tokens = random_tokens(model.cfg.vocab_size, len(lengths), max(lengths))
    refs = parallel_reference(model, tokens, lengths) if refs is None else refs
    state = model.new_decode_state(len(lengths), max_len=24)
    if replay:  # the parallel trace as forced actions (right-padded with STOP)
        actions = torch.full((len(lengths), tokens.shape[1], BUDGET), model.cfg.stop_action)
        for b, (L, ref) in enumerate(zip(lengths, refs)):
            actions[b, :L] = ref.actions[0]
        out = decode_in_chunks(state, tokens, lengths, chunk, Forced(actions))
    else:
        out = decode_in_chunks(state, tokens, lengths, chunk, Controller(BUDGET, lambda_cost=0.0))
    err, same = 0.0, True
    for b, (L, ref) in enumerate(zip(lengths, refs)):
        assert out.valid[b, :L].all() and not out.valid[b, L:].any()
        assert out.positions[b, :L].tolist() == list(range(L))
        err = max(err, (out.logits[b, :L] - ref.logits[0]).abs().max().item())
        if not replay:
            same &= torch.equal(out.actions[b, :L], ref.actions[0])
            same &= torch.equal(out.n_edits[b, :L], ref.n_edits[0])
            same &= torch.equal(out.controller_steps[b, :L], ref.controller_steps[0])
    return err, same


# ---------------------------------------------------------------------- exactness against the parallel rollout
def test_reference_rollout_both_edits_and_stops(model64):
    """The test model's controller edits at some positions, stops at once at others, and U is non-zero."""
    lengths = CASES["ragged"]
    tokens = random_tokens(model64.cfg.vocab_size, 3, max(lengths))
    n = torch.cat([r.n_edits[0] for r in parallel_reference(model64, tokens, lengths)])
    assert (n > 0).any() and (n == 0).any()
    assert model64.readout.U.weight.abs().max() > 0


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_chunked_decoding_equals_forward_policy_float64(model64, case, chunk):
    """Decoding forced tokens in chunks of 1, 2 or 5 gives forward_policy's logits (<= 1e-12) and identical action
    traces, edit counts and controller steps, for one row and for a ragged batch."""
    err, same = decode_errors(model64, case, chunk)
    assert err <= 1e-12, f"max |diff| = {err:.3e}"
    assert same


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_replayed_trace_decoding_matches_forward_policy_float32(model32, case, chunk):
    """In float32, the parallel trace replayed as forced actions through decode_step gives its logits to 1e-5."""
    err, _ = decode_errors(model32, case, chunk, replay=True)
    assert err <= 1e-5, f"max |diff| = {err:.3e}"


@pytest.mark.parametrize("chunk", [1, 5])
def test_prefill_matches_forward_policy_at_every_and_at_the_last_position(model64, chunk):
    """prefill(logits="all") equals forward_policy; prefill(logits="last") gives each ragged row's last-position
    logits from the workspace (not the backbone head) and leaves the state at the prompt lengths."""
    lengths = CASES["ragged"]
    tokens = random_tokens(model64.cfg.vocab_size, 3, max(lengths))
    refs = parallel_reference(model64, tokens, lengths)
    state = model64.new_decode_state(3, max_len=24)
    full = state.prefill(tokens, lengths, chunk, logits="all", policy=Controller(max_budget=BUDGET, lambda_cost=0.0))
    state.reset()
    last = state.prefill(tokens, lengths, chunk, logits="last", policy=Controller(max_budget=BUDGET, lambda_cost=0.0))
    assert state.lengths == lengths
    for b, (L, ref) in enumerate(zip(lengths, refs)):
        assert_close(full.logits[b, :L], ref.logits[0], 1e-12, "prefill all")
        assert torch.equal(full.actions[b, :L], ref.actions[0])
        assert_close(last.logits[b, 0], ref.logits[0, -1], 1e-12, "prefill last")
        assert torch.equal(last.actions[b, 0], ref.actions[0, -1])
        assert last.positions[b, 0].item() == L - 1
    edited = last.n_edits[:, 0] > 0
    assert edited.any()
    with torch.no_grad():
        head = torch.stack([model64.backbone.head(model64.backbone(tokens[b:b + 1, :L]))[0, -1]
                            for b, L in enumerate(lengths)])
    assert ((last.logits[:, 0] - head).abs().amax(-1)[edited] > 1e-3).all()  # the workspace's correction is there


def test_forced_actions_decode_equals_forward_with_the_same_actions(model64):
    """Random forced actions (DENSE included, with per-position budgets) decoded in chunks of 3 give the logits of
    `model.forward(tokens, actions, budget)` to 1e-12."""
    cfg = model64.cfg
    g = torch.Generator().manual_seed(5)
    tokens = random_tokens(cfg.vocab_size, 2, 12)
    actions = torch.randint(0, cfg.dense_action + 1, (2, 12, 3), generator=g)
    budget = torch.full((2, 12), 3)
    budget[:, ::4] = 4
    with torch.no_grad():
        ref = model64(tokens, actions, budget)
    state = model64.new_decode_state(2, max_len=12)
    out = decode_in_chunks(state, tokens, [12, 12], 3, Forced(actions, budget))
    assert_close(out.logits, ref.logits, 1e-12, "forced decode")
    assert torch.equal(out.actions, ref.actions)
    assert torch.equal(out.controller_steps, torch.zeros_like(ref.n_edits))


# ---------------------------------------------------------------------- what the workspace reads
SOURCES = {  # the source-bank options beside the seed's inputs (tests/test_contracts.py runs the contracts on them)
    "shift": dict(bank_shift=True),
    "embedding": dict(bank_source="embedding", bank_shift=True, controller_source="residual", controller_bank=True,
                      controller_entropy=True),
    "two_sources": dict(bank_source="residual+embedding", query_source="layer1", bank_shift=True),
    # the router decides step 0 (from norm(H) and whether the current bigram was seen), the controller the rest
    "router": dict(router=True, router_ngram=2, bank_shift=True),
    "router_token": dict(router=True, router_ngram=1, router_token=True, bank_shift=True),  # + a value per token
}


@pytest.fixture(scope="module", params=list(SOURCES))
def model64_src(request) -> PrismeModel:
    return make_model(torch.float64, **SOURCES[request.param])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_chunked_decoding_equals_forward_policy_with_every_source_option(model64_src, case, chunk):
    """With a shifted bank (its key at j reads j-1 across chunk boundaries: the state keeps each row's last stream),
    embedding-level sources, a controller source and bank match, or two summed sources, chunked decoding still gives
    forward_policy's logits to 1e-12 and identical traces, for one row and a ragged batch."""
    err, same = decode_errors(model64_src, case, chunk)
    assert err <= 1e-12, f"max |diff| = {err:.3e}"
    assert same


def test_negative_control_decoding_that_forgets_the_shift_fails(monkeypatch):
    """A DecodeState that never updates the shift's memory (each chunk's first key reads zeros, as position 0 does)
    differs from forward_policy at every chunk size that splits the sequence, by a million times the 1e-12 the check
    allows."""
    model = make_model(torch.float64, **SOURCES["embedding"])
    refs = parallel_reference(model, random_tokens(model.cfg.vocab_size, 3, 19), CASES["ragged"])
    original = SourceBank.from_inputs
    monkeypatch.setattr(SourceBank, "from_inputs", lambda self, hs, prev=None: original(self, hs, None))
    for chunk in (1, 2, 5):
        err, _ = decode_errors(model, "ragged", chunk, refs=refs)
        assert err > 1e-6, f"chunk {chunk}: the check (1e-12) did not catch the forgotten shift ({err:.3e})"


def test_decode_state_holds_the_shift_memory_in_its_bytes_and_reset_clears_it():
    """A shifted bank's state carries each row's last normed stream [B, d] per bank term: counted in nbytes and zeroed
    by reset()."""
    model = make_model(torch.float64, **SOURCES["two_sources"])
    state = model.new_decode_state(2, max_len=8)
    plain = make_model(torch.float64).new_decode_state(2, max_len=8)
    assert len(state.bank.prev) == 2 and state.nbytes - plain.nbytes == 2 * 2 * model.cfg.d_model * 8
    state.decode_step(random_tokens(model.cfg.vocab_size, 2, 3), policy=Controller(max_budget=1, lambda_cost=0.0))
    assert all(p.abs().sum() > 0 for p in state.bank.prev)
    state.reset()
    assert all(p.abs().sum() == 0 for p in state.bank.prev) and state.lengths == [0, 0]


# ---------------------------------------------------------------------- negative controls
def _leaky_bank_mask(monkeypatch):
    original = PrismeModel.bank_mask

    def leaky(B, Tq, Tb, query_pos=None, bank_len=None, device=None):  # query t may also read key t + 1
        q = None if query_pos is None else query_pos + 1
        return original(B, Tq, Tb, q, None if bank_len is None else bank_len + 1, device)

    monkeypatch.setattr(PrismeModel, "bank_mask", staticmethod(leaky))
    return contextlib.nullcontext()


def _stale_bank(monkeypatch):
    monkeypatch.setattr(DecodeState, "_advance", _advance_without_bank)
    return contextlib.nullcontext()


def _advance_without_bank(self: DecodeState, tokens: torch.Tensor, n_new: list[int]):
    return self.model.streams(tokens, self.cache, n_new)  # bug: the new positions' bank entries are never written


FAULTS = {
    "bank_reads_one_key_ahead": (_leaky_bank_mask, [2, 5]),  # with chunk 1 the next key is not in the cache yet
    "positions_reset": (lambda mp: faults.reset_positions(), [1, 2, 5]),
    "bank_never_appended": (_stale_bank, [1, 2, 5]),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_negative_control_broken_decoding_fails_the_equivalence(model64, monkeypatch, fault):
    """A bank that reads the next position, positions reset in each chunk, or a bank never appended make chunked
    decoding differ from forward_policy by far more than the 1e-12 the check allows."""
    make_fault, chunks = FAULTS[fault]
    for case in CASES:
        lengths = CASES[case]
        refs = parallel_reference(model64, random_tokens(model64.cfg.vocab_size, len(lengths), max(lengths)),
                                  lengths)
        with monkeypatch.context() as mp, make_fault(mp):
            results = [decode_errors(model64, case, chunk, refs=refs) for chunk in chunks]
        for err, _ in results:
            assert err > 1e-3, f"{fault}/{case}: the check did not catch the fault (max |diff| {err:.3e})"


def test_negative_control_float32_replay_catches_a_leaky_bank(model32, monkeypatch):
    """The float32 replay check (1e-5) fails when the bank lets a query read the next position."""
    refs = parallel_reference(model32, random_tokens(model32.cfg.vocab_size, 3, 19), CASES["ragged"])
    with monkeypatch.context() as mp, _leaky_bank_mask(mp):
        err, _ = decode_errors(model32, "ragged", 5, refs=refs, replay=True)
    assert err > 1e-3


# ---------------------------------------------------------------------- the backbone-only path
def test_budget_zero_decoding_is_bitwise_the_backbone_decoder(model64):
    """max_budget=0 through a DecodeState (bank kept or not) gives bitwise the logits of Backbone + KVCache decoding
    in the same chunks; with a budget the edited positions differ (the comparison can see the workspace)."""
    tokens = random_tokens(model64.cfg.vocab_size, 2, 14)
    bb = model64.backbone
    cache = bb.new_cache(2, 16)
    with torch.no_grad():
        ref = torch.cat([bb.head(bb(tokens[:, i:i + 3], cache)) for i in range(0, 14, 3)], 1)
    for bank in (True, False):
        state = model64.new_decode_state(2, max_len=16, bank=bank)
        out = decode_in_chunks(state, tokens, [14, 14], 3, Controller(0))
        assert torch.equal(out.logits, ref)
        assert out.actions.shape == (2, 14, 0) and not out.n_edits.any()
    state = model64.new_decode_state(2, max_len=16)
    out = decode_in_chunks(state, tokens, [14, 14], 3, Controller(BUDGET, lambda_cost=0.0))
    edited = out.n_edits > 0
    assert edited.any() and not torch.equal(out.logits, ref)
    assert torch.equal(out.logits[~edited], ref[~edited])  # positions that stopped at once: bitwise the backbone


def test_budget_zero_generation_equals_backbone_greedy_decoding(model64):
    """generate(max_budget=0) yields the greedy tokens of a plain Backbone + KVCache loop and costs exactly 1.0."""
    bb = model64.backbone
    prompt = random_tokens(model64.cfg.vocab_size, 1, 6)
    cache = bb.new_cache(1, 16)
    with torch.no_grad():
        nxt, ref = bb.head(bb(prompt, cache))[0, -1].argmax().item(), []
        for _ in range(8):
            ref.append(nxt)
            nxt = bb.head(bb(torch.tensor([[nxt]]), cache))[0, -1].argmax().item()
    out = generate(model64, prompt, 8, policy=Controller(max_budget=0))
    assert out.tokens == [ref]
    assert out.relative_cost == 1.0
    assert out.ops[0] == [token_ops(model64.cfg, 6 + i, controller_steps=0)["total"] for i in range(8)]


def test_per_token_ops_memo_is_kept_per_model_and_config_and_tells_the_bypass_from_a_stopped_trace(model64):
    """Per-token ops are memoised across calls (a later call prices its tokens by lookup) and still equal
    `position_ops` of each token's own trace: the bypass (budget 0) and an all-STOP trace at budget 1 at the same
    contexts cost differently (negative control: a memo keyed on the trace alone would hand the bypass price on), and
    a model given another config prices afresh."""
    prompt = random_tokens(model64.cfg.vocab_size, 1, 6)
    bypass = generate(model64, prompt, 8, policy=Controller(max_budget=0)).ops[0]
    stopped = generate(model64, prompt, 8, policy=Controller(max_budget=1, lambda_cost=1e9))
    assert all(a == [model64.cfg.stop_action] for a in stopped.actions[0].tolist())
    fresh = [position_ops(model64.cfg, 6 + i, [model64.cfg.stop_action], s, model64.cfg.optimised)
             for i, s in enumerate(stopped.controller_steps[0])]
    assert stopped.ops[0] == fresh and fresh != bypass
    cfg, memo = model64.__dict__["_position_ops_memo"]
    assert cfg is model64.cfg and len(memo) >= 16
    assert generate(model64, prompt, 8, policy=Controller(max_budget=0)).ops[0] == bypass  # from the memo
    other = PrismeModel(model64.cfg.replace(optimised=not model64.cfg.optimised)).double()
    other.load_state_dict(model64.state_dict())
    theirs = generate(other, prompt, 8, policy=Controller(max_budget=1, lambda_cost=1e9))
    assert theirs.ops[0] == [position_ops(other.cfg, 6 + i, [other.cfg.stop_action], s, other.cfg.optimised)
                             for i, s in enumerate(theirs.controller_steps[0])] != fresh


# ---------------------------------------------------------------------- generation
def test_greedy_generation_is_the_argmax_of_forward_policy_with_its_traces_and_costs(model64):
    """Each greedy token of a ragged batch is the argmax of forward_policy on (prompt + tokens so far) at the position
    that produced it, with the same trace; per-token ops are token_ops at that position's own context."""
    cfg = model64.cfg
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    out = generate(model64, prompts, 6, policy=Controller(max_budget=BUDGET, lambda_cost=0.0))
    assert isinstance(out, GenerationOutput) and out.finish_reasons == ["length"] * 3
    n_all, ops_all, base_all, shifted_ok = [], 0, 0, []
    for b, p in enumerate(prompts):
        seq = torch.tensor([p + out.tokens[b]])
        ref = model64.forward_policy(seq, BUDGET, lambda_cost=0.0)
        pos = torch.arange(len(p) - 1, len(p) + 5)  # the positions whose logits produced the 6 tokens
        assert ref.logits[0, pos].argmax(-1).tolist() == out.tokens[b]
        assert torch.equal(out.actions[b], ref.actions[0, pos])
        assert out.n_edits[b] == ref.n_edits[0, pos].tolist()
        for i, t in enumerate(pos.tolist()):
            ks = [1 if a < cfg.n_slots else 2 for a in out.actions[b][i].tolist() if a != cfg.stop_action]
            row = token_ops(cfg, t + 1, ks, controller_steps=out.controller_steps[b][i], optimised=cfg.optimised)
            assert out.ops[b][i] == row["total"]
            ops_all, base_all = ops_all + row["total"], base_all + row["backbone"]
        n_all += out.n_edits[b]
        # negative control: the same checks one position early
        shifted_ok.append(ref.logits[0, pos - 1].argmax(-1).tolist() == out.tokens[b]
                          and torch.equal(out.actions[b], ref.actions[0, pos - 1]))
    assert any(n > 0 for n in n_all) and any(n == 0 for n in n_all)
    assert out.relative_cost == pytest.approx(ops_all / base_all, rel=1e-12)
    assert not any(shifted_ok)


def test_same_seed_same_sample_and_different_seed_differs(model32):
    """Sampling (temperature 1, top-k 40, top-p 0.95) is a function of the seed: same seed -> same tokens,
    another seed -> other tokens."""
    policy, sampled = Controller(2, lambda_cost=0.0), dict(temperature=1.0, top_k=40, top_p=0.95)
    prompts = [[1, 2, 3], [4, 5]]
    a = generate(model32, prompts, 16, policy, Sampling(seed=7, **sampled))
    b = generate(model32, prompts, 16, policy, Sampling(seed=7, **sampled))
    c = generate(model32, prompts, 16, policy, Sampling(seed=8, **sampled))
    assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.actions, b.actions))
    assert a.tokens != c.tokens


def test_sample_logits_filters():
    """top_k=1 and a tiny top_p are greedy; temperature 0 is the argmax; top-k never samples outside the k best."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    greedy = logits.argmax(-1)
    assert torch.equal(sample_logits(logits), greedy)
    assert torch.equal(sample_logits(logits, 1.0, top_k=1, generator=g), greedy)
    assert torch.equal(sample_logits(logits, 1.0, top_p=1e-6, generator=g), greedy)
    top5 = logits.topk(5, -1).indices
    s = sample_logits(logits, 2.0, top_k=5, generator=g)
    assert (top5 == s[:, None]).any(-1).all()
    assert not torch.equal(sample_logits(logits, 2.0, generator=g), greedy)  # unfiltered sampling does leave the argmax


def test_streaming_yields_the_same_tokens_and_traces(model32):
    """generate_stream yields, step by step, the tokens, traces and ops that generate returns at once."""
    kw = dict(policy=Controller(2, lambda_cost=0.0), sampling=Sampling(temperature=0.8, seed=3), stop_tokens=[5])
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    full = generate(model32, prompts, 10, **kw)
    events = list(generate_stream(model32, prompts, 10, **kw))
    for b in range(2):
        assert [e.tokens[b] for e in events if e.tokens[b] is not None] == full.tokens[b]
        assert [e.ops[b] for e in events if e.ops[b] is not None] == full.ops[b]
        trace = torch.stack([e.actions[b] for e in events if e.tokens[b] is not None])
        assert torch.equal(trace, full.actions[b])
    assert [e.step for e in events] == list(range(len(events)))
    assert all(events[-1].finished)


def test_stop_tokens_stop_rows_independently(model64):
    """A row ends right after its first stop token while the other rows go on with exactly the (sampled) tokens they
    would have produced without it."""
    prompts = [[1, 2, 3], [7, 8], [9, 10, 11, 12]]
    kw = dict(policy=Controller(BUDGET, lambda_cost=0.0), sampling=Sampling(temperature=1.0, seed=0))
    free = generate(model64, prompts, 10, **kw)
    row0 = free.tokens[0]
    stop = next(t for i, t in enumerate(row0) if i >= 2 and t not in row0[:i])
    out = generate(model64, prompts, 10, stop_tokens=[stop], **kw)
    for b, row in enumerate(free.tokens):
        expected = row[:row.index(stop) + 1] if stop in row else row
        assert out.tokens[b] == expected
        assert out.finish_reasons[b] == ("stop" if stop in row else "length")
    assert out.finish_reasons[0] == "stop"
    assert max(map(len, out.tokens)) > len(out.tokens[0])  # the other rows did run on


def test_target_cost_bisection_lands_on_the_target(model64):
    """target_cost finds a lambda whose calibration-pass cost is within 2% of the target (between the cheapest and
    the unrestricted policy), while lambda = 0 is far from it; generate reports and uses that lambda."""
    cfg = model64.cfg
    prompts = random_tokens(cfg.vocab_size, 4, 24, seed=9)
    N = 4 * 24
    ctx = torch.arange(1, 25).repeat(4)
    unpriced = model64.forward_policy(torch.as_tensor(prompts), BUDGET, lambda_cost=0.0)  # everything it wants
    top = trace_cost(cfg, unpriced.actions.reshape(N, -1), ctx, unpriced.controller_steps.reshape(N),
                     cfg.optimised).relative
    free = calibrate_lambda(model64, prompts, BUDGET, target_cost=top)
    assert free.lambda_cost == 0.0 and free.relative_cost == pytest.approx(top)
    with pytest.raises(ValueError, match=r"above the costliest controller policy's cost"):  # as a target below the
        calibrate_lambda(model64, prompts, BUDGET, target_cost=1.5 * top)  # cheapest policy's is an error too
    floor = trace_cost(cfg, torch.full((N, BUDGET), cfg.stop_action), ctx, torch.ones(N, dtype=torch.long),
                       cfg.optimised).relative
    target = (floor + free.relative_cost) / 2
    cal = calibrate_lambda(model64, prompts, BUDGET, target_cost=target)
    assert abs(cal.relative_cost - target) <= 0.02 * target, cal
    assert abs(free.relative_cost - target) > 0.1 * target  # negative control: the unpriced policy misses it
    assert cal.lambda_cost > 0
    out = generate(model64, prompts, 2, policy=Controller(max_budget=BUDGET, target_cost=target))
    assert out.calibration == cal and out.lambda_cost == cal.lambda_cost


# ---------------------------------------------------------------------- bad input: ValueError, state unchanged
def snapshot(state: DecodeState) -> list:
    return [state.lengths] + [t.clone() for layer in state.cache.layers for t in (layer.k, layer.v)] + [
        state.bank.K.clone(), state.bank.V.clone()]


def same_state(a: list, b: list) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))


def _bad_calls(cfg: PrismeConfig) -> dict:
    tok = torch.zeros(2, 3, dtype=torch.long)
    R, stop = cfg.r_max, cfg.stop_action
    return {
        "token id >= V": lambda s: s.decode_step(torch.full((2, 1), cfg.vocab_size)),
        "negative token id": lambda s: s.decode_step(torch.full((2, 1), -1)),
        "float tokens": lambda s: s.decode_step(torch.zeros(2, 1)),
        "wrong batch size": lambda s: s.decode_step(torch.zeros(3, 1, dtype=torch.long)),
        "n_new too large": lambda s: s.decode_step(tok, [3, 4]),
        "n_new wrong length": lambda s: s.decode_step(tok, [3]),
        "past capacity": lambda s: s.decode_step(torch.zeros(2, 5, dtype=torch.long)),
        "budget over r_max": lambda s: s.decode_step(tok, policy=Controller(max_budget=R + 1)),
        "negative budget": lambda s: s.decode_step(tok, policy=Controller(max_budget=-1)),
        "negative lambda": lambda s: s.decode_step(tok, policy=Controller(max_budget=2, lambda_cost=-1.0)),
        "nan kappa": lambda s: s.decode_step(tok, policy=Controller(max_budget=2, kappa_risk=float("nan"))),
        "cost of wrong shape": lambda s: s.decode_step(tok, policy=Controller(max_budget=2, cost=torch.ones(3))),
        "actions of wrong shape": lambda s: s.decode_step(tok, policy=Forced(torch.zeros(2, 2, 1, dtype=torch.long))),
        "actions not 3-d": lambda s: s.decode_step(tok, policy=Forced(torch.zeros(2, 3, dtype=torch.long))),
        "more forced steps than r_max": lambda s: s.decode_step(tok, policy=Forced(torch.zeros(2, 3, R + 1,
                                                                                          dtype=torch.long))),
        "action id out of range": lambda s: s.decode_step(tok, policy=Forced(torch.full((2, 3, 1), stop + 2))),
        "forced step past its budget": lambda s: s.decode_step(tok, policy=Forced(torch.zeros(2, 3, 2,
                                                                                          dtype=torch.long), budget=1)),
        "a policy that is no policy": lambda s: s.decode_step(tok, policy={"max_budget": 1}),
        "a policy that is no policy, no workspace": lambda s: s.prefill(tok, logits="none", policy={"max_budget": 1}),
        "a target cost in a decode step": lambda s: s.decode_step(tok, policy=Controller(max_budget=1,
                                                                                         target_cost=1.5)),
        "prefill length 0": lambda s: s.prefill(tok, [3, 0]),
        "prefill length > T": lambda s: s.prefill(tok, [3, 4]),
        "prefill not padded to the longest": lambda s: s.prefill(tok, [2, 2]),
        "prefill chunk 0": lambda s: s.prefill(tok, chunk_size=0),
        "prefill unknown logits mode": lambda s: s.prefill(tok, logits="first"),
        "prefill none with a budget": lambda s: s.prefill(tok, logits="none", policy=Controller(max_budget=2)),
        "prefill past capacity": lambda s: s.prefill(torch.zeros(2, 5, dtype=torch.long)),
        "prefill last actions of wrong shape": lambda s: s.prefill(tok, policy=Forced(torch.zeros(2, 3, 1,
                                                                                            dtype=torch.long))),
    }


@pytest.mark.parametrize("name", list(_bad_calls(PrismeConfig.from_name("tiny"))))
def test_bad_decode_input_raises_value_error_and_leaves_the_state_unchanged(model32, name):
    """Each bad decode_step / prefill argument is a ValueError raised before the caches or lengths change."""
    state = model32.new_decode_state(2, max_len=8)
    state.prefill(random_tokens(model32.cfg.vocab_size, 2, 4), [4, 2], policy=Controller(max_budget=2))
    before = snapshot(state)
    with pytest.raises(ValueError):
        _bad_calls(model32.cfg)[name](state)
    assert same_state(before, snapshot(state))


def test_state_check_negative_control_and_capacity_message(model32):
    """The unchanged-state check sees a real step (negative control); running past capacity says so, and reset()
    empties the state so it can be reused."""
    state = model32.new_decode_state(2, max_len=8)
    state.prefill(random_tokens(model32.cfg.vocab_size, 2, 4), [4, 2])
    before = snapshot(state)
    state.decode_step(torch.zeros(2, 1, dtype=torch.long), [1, 0], policy=Controller(max_budget=2))
    assert not same_state(before, snapshot(state)) and state.lengths == [5, 2]
    with pytest.raises(ValueError, match="capacity"):
        state.decode_step(torch.zeros(2, 4, dtype=torch.long))
    state.reset()
    assert state.lengths == [0, 0] and not state.bank.K.any() and not state.cache.layers[0].k.any()
    bankless = model32.new_decode_state(2, max_len=8, bank=False)
    with pytest.raises(ValueError, match="bank"):
        bankless.decode_step(torch.zeros(2, 1, dtype=torch.long), policy=Controller(max_budget=1))
    assert bankless.lengths == [0, 0]
    with pytest.raises(ValueError, match="dtype"):
        model32.new_decode_state(1, dtype=torch.float64)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[]), "non-empty"),
    (dict(prompts=[[1, 2], []]), "prompt 1"),
    (dict(prompts=[[1, 64]]), r"\[0, 64\)"),
    (dict(prompts=[[-1]]), r"\[0, 64\)"),
    (dict(prompts="hello"), "non-empty"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=62), "T_max"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(temperature=-0.5), "temperature"),
    (dict(max_budget=5), "r_max"),
    (dict(lambda_cost=-1.0, max_budget=2), "lambda_cost"),
    (dict(stop_tokens=[64]), "stop_tokens"),
    (dict(target_cost=3.0, lambda_cost=0.1, max_budget=2), "not both"),
    (dict(target_cost=3.0), "max_budget"),
    (dict(target_cost=1.0, max_budget=2), "cheapest"),
])
def test_bad_generate_input_raises_value_error(model32, kwargs, match):
    """Bad prompts, lengths past T_max, sampling knobs out of range and budget conflicts are ValueErrors (a policy or
    sampling setting is one when it is made)."""
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        policy = {k: args.pop(k) for k in ("max_budget", "lambda_cost", "kappa_risk", "target_cost") if k in args}
        sampling = {k: args.pop(k) for k in ("temperature", "top_k", "top_p", "seed") if k in args}
        generate(model32, args.pop("prompts"), args.pop("max_new_tokens"), Controller(**policy), Sampling(**sampling),
                 **args)


# ---------------------------------------------------------------------- command line
def test_cli_generate_prints_text_and_per_token_edits(capsys):
    """`prisme generate --preset demo --show-edits` prints the prompt plus its continuation and one row per token."""
    rc = cli.main(["generate", "--preset", "demo", "--prompt", "Emma", "--max-new-tokens", "5", "--budget", "2",
                   "--lambda-cost", "0", "--seed", "0", "--show-edits"])
    out = capsys.readouterr()
    assert rc == 0
    lines = out.out.splitlines()
    assert lines[0].startswith("Emma")
    assert lines[1].startswith("legend:") and "0=0" in lines[1] and "8=0+1" in lines[1]  # action id -> its slots
    assert lines[2].split()[:3] == ["pos", "token", "edits"] and len(lines) == 3 + 5
    assert [int(line.split()[0]) for line in lines[3:]] == [4, 5, 6, 7, 8]
    assert "mean relative cost" in out.err
    assert cli.main(["generate", "--preset", "demo", "--prompt", "x", "--budget", "99"]) == 2
    assert "r_max" in capsys.readouterr().err


def test_cli_generate_from_a_checkpoint_matches_the_library(tmp_path, capsys):
    """`prisme generate --checkpoint` decodes the saved weights: its text is the library's greedy continuation."""
    from prisme.checkpoint import TrainingState, save_checkpoint
    from prisme.data.tokenizers import ByteTokenizer

    torch.manual_seed(3)
    model = PrismeModel(PrismeConfig.from_name("demo")).eval()
    torch.nn.init.normal_(model.readout.U.weight, std=0.5)
    save_checkpoint(tmp_path / "ckpt", model, TrainingState(stage="export", step=0))
    prompt = ByteTokenizer().encode("Mr. Knightley")
    ref = generate(model, [prompt], 6, policy=Controller(max_budget=2, lambda_cost=0.0))
    rc = cli.main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "Mr. Knightley",
                   "--max-new-tokens", "6", "--budget", "2", "--lambda-cost", "0", "--allow-untrained"])
    assert rc == 0  # the saved workspace was never trained (an export of random weights): allowed, with a warning
    captured = capsys.readouterr()
    assert captured.out == "Mr. Knightley" + ByteTokenizer().decode(ref.tokens[0]) + "\n"
    assert "warning" in captured.err and "workspace" in captured.err
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_one_model_generates_with_another_decode_state_s_options_without_a_copy():
    """`generate(..., runtime=Runtime(decode=...))` runs the model's own weights with the bank served from tables and
    kept as token ids: the same tokens, traces and costs as the model's default options, as a twin built with those
    options gives; the options are checked against the model (a residual bank has no tables: a ValueError naming
    bank_tables), and a Runtime holds only options (a ValueError naming the field)."""
    from prisme.options import DecodeOptions, ExecutionOptions, Runtime

    kw = dict(bank_source="embedding", query_source="embedding", bank_shift=True, router=True, router_ngram=1)
    model = tiny_model(0, **kw)
    prompts = torch.randint(0, model.cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    policy = Controller(1, lambda_cost=0.0)
    ids = DecodeOptions(bank_tables=True, bank_store="ids")
    plain = generate(model, prompts, 8, policy=policy)
    served = generate(model, prompts, 8, policy=policy, runtime=Runtime(decode=ids))
    twin = generate(tiny_model(0, decode=ids, **kw), prompts, 8, policy=policy)
    assert served.tokens == plain.tokens == twin.tokens
    assert all(torch.equal(a, b) for a, b in zip(served.actions, twin.actions))
    assert served.ops == twin.ops and served.ops != plain.ops  # priced as that state ran: lookups, not projections
    with pytest.raises(ValueError, match="bank_tables=True needs"):
        generate(tiny_model(0), prompts, 2, runtime=Runtime(decode=ids))
    for bad in (dict(decode="ids"), dict(execution=DecodeOptions()), dict(prefill_chunk_size=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Runtime(**bad)
    assert isinstance(Runtime(execution=ExecutionOptions()).execution, ExecutionOptions)


def test_a_policy_is_checked_once_per_decode_state_and_policy_object(monkeypatch):
    """A decode loop with one `Controller` checks it (budget, price, cost) and chooses its plan at its first step only;
    a new policy object is checked again. Negative control: a bad budget is still refused at the first step."""
    import prisme.model.state as state_mod

    model = tiny_model(0, router=True, router_ngram=1)
    calls = []
    orig = state_mod.check_policy
    monkeypatch.setattr(state_mod, "check_policy", lambda *a, **k: calls.append(1) or orig(*a, **k))
    st = model.new_decode_state(1, 12)
    policy = Controller(1, lambda_cost=0.0)
    for t in range(6):
        st.decode_step(torch.tensor([[t % 5]]), policy=policy)
    assert len(calls) == 1
    st.decode_step(torch.tensor([[1]]), policy=Controller(1, lambda_cost=0.0))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="max_budget"):
        st.decode_step(torch.tensor([[1]]), policy=Controller(model.cfg.r_max + 1))
