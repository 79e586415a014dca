"""The deployed decode step on a compiled editor (`prisme.model.fired`): the fired rows of each action group as one
fixed-shape graph from their streams to their corrections (rows padded to a power of two, the bank padded under a
mask) decode what `forward_policy` computes, with a bank kept as entries and one kept as ids (looked up, then read
through the tables), ragged rows included; the padding is never read (negative control: a graph that reads the
padded bank unmasked is caught); a graph that fails to compile reruns eagerly.

Tolerance: float64, 1e-10 (a compiled graph sums in another order; differences are ~1e-15).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from prisme import faults
from prisme.model.compiled_editor import CompiledEditor
from prisme.model.fired import BANK_FLOOR, bucket
from prisme.model.policy import Controller
from prisme.options import DecodeOptions, ExecutionOptions

TOL = 1e-10
LENGTHS = [22, 13, 19]  # ragged rows: each row's last decoded position
MAX_LEN = 80  # a capacity above BANK_FLOOR: the bank pads to 64 (a power of two), not to the capacity
READS = {  # (model overrides, how a fired row reads its bank at the longest bank of the run: `BankCache.read_kind`)
    "entries": (dict(router=True, router_ngram=1, bank_shift=True, max_seq_len=MAX_LEN), "entries"),
    "ids": (dict(router=True, bank_shift=True, bank_source="embedding", query_source="embedding", vocab_size=8,
                 max_seq_len=MAX_LEN, decode=DecodeOptions(bank_tables=True, bank_store="ids")),
            "ids"),  # V = 8: a fired row looks its entries up, then from T = 14 reads through the tables
}


def models(read: str) -> tuple:
    """(eager, compiled) float64 router models with the same weights."""
    overrides, _ = READS[read]
    eager = tiny_model(0, **overrides)
    comp = tiny_model(0, execution=ExecutionOptions(compile="strict"), **overrides)
    comp.load_state_dict(eager.state_dict())
    return eager, comp


def decode(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill 4 tokens, then one token per step; row b stops after LENGTHS[b] tokens (deployed policy: budget 1)."""
    policy = Controller(max_budget=1, lambda_cost=1.0)
    state = model.new_decode_state(tokens.shape[0], MAX_LEN)
    outs = [state.prefill(tokens[:, :4], logits="all", policy=policy)]
    with torch.inference_mode():
        for i in range(4, tokens.shape[1]):
            outs.append(state.decode_step(tokens[:, i:i + 1], [int(i < L) for L in LENGTHS[:len(tokens)]],
                                           policy=policy))
    return torch.cat([o.logits for o in outs], 1), torch.cat([o.actions for o in outs], 1)


def test_bucket_pads_to_a_power_of_two_between_its_floor_and_cap():
    assert [bucket(n, 1, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert [bucket(n, 1, 6) for n in (3, 5, 6)] == [4, 6, 6]
    assert [bucket(T, BANK_FLOOR, 80) for T in (1, 64, 65, 80)] == [64, 64, 80, 80]


@pytest.mark.slow  # compiles a dozen small graphs (~1 min): `make test-slow`, CI
@pytest.mark.parametrize("read", list(READS))
def test_compiled_deployed_step_equals_forward_policy_on_padded_fixed_shape_graphs(read):
    eager, comp = models(read)
    tokens = torch.randint(0, eager.cfg.vocab_size, (3, max(LENGTHS)), generator=torch.Generator().manual_seed(2))
    full = eager.forward_policy(tokens, max_budget=1, lambda_cost=1.0)
    logits, actions = decode(comp, tokens)
    for b, L in enumerate(LENGTHS):
        assert torch.equal(actions[b, :L], full.actions[b, :L])
        torch.testing.assert_close(logits[b, :L], full.logits[b, :L], rtol=0, atol=TOL)
    fired = full.actions[:, 4:, 0] != eager.cfg.stop_action
    assert fired.any() and not fired.all()
    keys = comp.editor.run.compiled.graphs
    assert all(k[0] == "fired" and k[3] == BANK_FLOOR for k in keys)  # the deployed step, on the 64-bank graphs
    assert READS[read][1] in {k[4] for k in keys}
    assert any(k[2] > 1 for k in keys)  # several rows of one group in one graph
    assert comp.editor.run.compiled.calls["eager"] == 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again, _ = decode(comp, tokens)  # a new decode state: its buffers are the graphs' inputs, not constants
    assert torch.equal(again, logits) and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow  # compiles two graphs (~25 s without Inductor's cache)
def test_negative_control_a_fired_graph_that_reads_its_padded_bank_unmasked_is_caught():
    """The same decode of one row with `faults.fired_rows_unmasked` (it reads all 64 padded keys): the logits of
    fired positions move far past the tolerance; the same model decodes right once the fault is gone."""
    eager, comp = models("entries")
    tokens = torch.randint(0, eager.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    full = eager.forward_policy(tokens, max_budget=1, lambda_cost=1.0)
    with faults.fired_rows_unmasked():
        bad, _ = decode(comp, tokens)
    good, _ = decode(comp, tokens)
    n = tokens.shape[1]
    assert (bad[:, :n] - full.logits).abs().max().item() > 1e-3
    torch.testing.assert_close(good[:, :n], full.logits, rtol=0, atol=TOL)


def test_a_fired_graph_that_fails_to_compile_reruns_eagerly(monkeypatch):
    """The first compiled call raises (as a compiler crash would): the step's rows come from the eager
    `fired_path`, the same numbers, with one warning; strict mode raises ValueError."""
    import prisme.model.compiled_editor as pc

    monkeypatch.setattr(pc, "_COMPILER_PROBE", "")

    def crash(*args, **kwargs):
        raise RuntimeError("backend compiler failed")

    monkeypatch.setattr(CompiledEditor, "_get", lambda self, key: crash)
    eager, comp = models("entries")
    comp.set_execution(ExecutionOptions(compile="auto"))
    tokens = torch.randint(0, eager.cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(2))
    full = eager.forward_policy(tokens, max_budget=1, lambda_cost=1.0)
    with pytest.warns(UserWarning, match="compiling the editor failed.*backend compiler failed"):
        logits, _ = decode(comp, tokens)
    torch.testing.assert_close(logits[:, :tokens.shape[1]], full.logits, rtol=0, atol=1e-12)
    assert comp.editor.run.compiled.calls["compiled"] == 0 and comp.editor.run.compiled.calls["eager"] > 0
    comp.set_execution(ExecutionOptions(compile="strict"))
    with pytest.raises(ValueError, match="could not be compiled"):
        decode(comp, tokens)
