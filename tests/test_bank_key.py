"""A bank whose key reads the position before its own (`bank_key="preceding"`): K_j = W_K n(X_{j-1}), V_j =
W_V n(X_j), the one-step induction read. A new way for the workspace to read the context is one entry in
`prisme.model.bank` and these tests; decoding is exact for it without any change to the decode state.

* the keys are the previous position's projection (zero at j = 0), the values the position's own (negative control:
  the "current" bank's keys are not);
* causality: a token changed after position t changes nothing at or before t;
* chunked and stepwise decoding equal teacher-forced `forward_policy` in float64, with the embedding bank projected,
  served from tables, kept as ids, and with a residual bank (negative control: a cache that forgets the previous
  position differs);
* with `bank_shift` (which would read j-2) it is a ValueError naming both fields.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model

import prisme.model.bank.cache as cache_mod
from prisme.config import PrismeConfig
from prisme.model.policy import Controller
from prisme.options import DecodeOptions

EMBED = dict(bank_source="embedding", query_source="embedding", bank_key="preceding", router=True)
CONFIGS = {
    "embedding": EMBED,
    "tables": {**EMBED, "decode": DecodeOptions(bank_tables=True)},
    "ids": {**EMBED, "decode": DecodeOptions(bank_tables=True, bank_store="ids")},
    "residual": dict(bank_key="preceding", router=True),
    "controller": dict(bank_source="embedding", query_source="embedding", bank_key="preceding"),  # no router
}


def tokens(B: int = 3, T: int = 20, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(seed))


def test_a_preceding_key_reads_the_position_before_alone():
    """K_j = W_K n(E_{j-1}) (0 at j = 0) and V_j = W_V n(E_j), in float64; the current key is W_K n(E_j)."""
    model = tiny_model(0, **EMBED)
    x = tokens(2, 12)
    st = model.streams(x)
    K, V = model.bank.entries(st)  # [B, T, w] each
    h = model.bank.norm_of("embedding")(st.src["embedding"])  # [B, T, d]
    want_K = torch.cat([torch.zeros_like(K[:, :1]), F.linear(h[:, :-1], model.bank.W_K.weight)], 1)
    torch.testing.assert_close(K, want_K, rtol=0, atol=1e-13)
    torch.testing.assert_close(V, F.linear(h, model.bank.W_V.weight), rtol=0, atol=1e-13)
    current = tiny_model(0, **{**EMBED, "bank_key": "current"})
    K_cur, _ = current.bank.entries(current.streams(x))
    assert not torch.allclose(K_cur, want_K, atol=1e-6)  # negative control: the current key reads X_j


def test_a_preceding_key_is_causal():
    """Changing the tokens after position t leaves the actions at 0..t unchanged and their logits to float64
    rounding (the edited positions are gathered into batches of another size)."""
    model = tiny_model(0, **EMBED)
    x = tokens(2, 16)
    y = x.clone()
    y[:, 9:] = (y[:, 9:] + 7) % 64
    a, b = (model.forward_policy(z, 2, lambda_cost=0.05) for z in (x, y))
    torch.testing.assert_close(a.logits[:, :9], b.logits[:, :9], rtol=0, atol=1e-12)
    assert torch.equal(a.actions[:, :9], b.actions[:, :9])
    assert not torch.allclose(a.logits[:, 9:], b.logits[:, 9:], atol=1e-6)


def decode(model, x: torch.Tensor, budget: int, lam: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt of 5 by `prefill` (logits at every position), then chunks of `chunk` tokens by `decode_step`."""
    st = model.new_decode_state(x.shape[0], 24)
    outs = [st.prefill(x[:, :5], logits="all", policy=Controller(max_budget=budget, lambda_cost=lam))]
    outs += [st.decode_step(x[:, i:i + chunk], policy=Controller(max_budget=budget, lambda_cost=lam))
             for i in range(5, x.shape[1], chunk)]
    return torch.cat([o.logits for o in outs], 1), torch.cat([o.actions for o in outs], 1)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("budget", [1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decoding_with_a_preceding_key_equals_forward_policy(name, budget, chunk):
    model = tiny_model(0, **CONFIGS[name])
    x = tokens()
    full = model.forward_policy(x, budget, lambda_cost=0.05)
    assert 0 < float((full.n_edits > 0).double().mean()) < 1 or not model.cfg.router  # some edit, some do not
    logits, actions = decode(model, x, budget, 0.05, chunk)
    torch.testing.assert_close(logits, full.logits, rtol=0, atol=1e-12)
    assert torch.equal(actions, full.actions)


@pytest.mark.parametrize("name", ["embedding", "tables"])
def test_negative_control_a_cache_that_forgets_the_previous_position_differs(monkeypatch, name):
    """Every chunk's first key read as if it were position 0: decoding no longer equals teacher forcing."""
    model = tiny_model(0, **CONFIGS[name])
    x = tokens()
    full = model.forward_policy(x, 1, lambda_cost=0.0)
    original = cache_mod.step_entries
    monkeypatch.setattr(cache_mod, "step_entries", lambda bank, options, st, toks, prev, out=None: original(
        bank, options, st, toks, None, out))
    logits, _ = decode(model, x, 1, 0.0, 1)
    assert not torch.allclose(logits, full.logits, rtol=0, atol=1e-6)


def test_a_preceding_key_with_a_bank_shift_is_an_error_naming_both():
    with pytest.raises(ValueError, match="bank_key='preceding'.*bank_shift"):
        PrismeConfig.from_name("tiny", bank_key="preceding", bank_shift=True)
    with pytest.raises(ValueError, match="bank_key must be one of"):
        PrismeConfig.from_name("tiny", bank_key="next")
