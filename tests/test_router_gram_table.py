"""The router's n-gram cue in decoding from a table of the n-grams each row holds (`BankCache.seen_last`), instead of
a scan of the whole context at every step: at every decode step, after a prefill, a ragged prefill, a rewind and a
reset, it equals the scan (`router.ngram_seen_at`) for n = 1 and 2; n = 3 at V = 64 (262,144 codes) keeps no table
and scans. Negative control: a table that also holds the new last position's n-gram (every position "seen") is
caught."""

from __future__ import annotations

import pytest
import torch

import prisme.model.bank.cache as cache_mod
from prisme.config import PrismeConfig
from prisme.model.policy import Controller
from prisme.model.prisme import PrismeModel
from prisme.model.router import ngram_seen_at


def _model(n: int) -> PrismeModel:
    torch.manual_seed(0)
    return PrismeModel(PrismeConfig.from_name("tiny", router=True, router_ngram=n)).eval()


def _mismatches(model: PrismeModel, toks: torch.Tensor) -> int:
    """Steps where the table's cue differs from the scan's, over a schedule of prefills, steps, a rewind, a reset."""
    n = model.cfg.router_ngram
    st = model.new_decode_state(toks.shape[0], 60)
    bad = 0

    def steps(at: int, count: int) -> None:
        nonlocal bad
        for i in range(at, at + count):
            st.decode_step(toks[:, i:i + 1], policy=Controller(1, lambda_cost=1e9))
            L = st.lengths[0]
            bad += int(not torch.equal(st.bank.seen_last(L), ngram_seen_at(st.bank.ids, L - 1, n)))

    steps(0, 6)  # from an empty state, token by token
    st.prefill(toks[:, 6:20])  # a chunk: the table is rebuilt where next read
    steps(20, 10)
    st.rewind(25)
    steps(25, 8)
    st.reset()
    st.prefill(toks[:, :9], lengths=[9, 9, 9])
    steps(9, 5)
    return bad


@pytest.mark.parametrize("n", [1, 2])
def test_the_gram_table_gives_the_scans_cue_at_every_step(n):
    model = _model(n)
    toks = torch.randint(0, 6, (3, 40), generator=torch.Generator().manual_seed(n))  # few ids: many repeats
    assert model.new_decode_state(3, 60).bank.grams.shape == (3, 64 ** n)
    assert _mismatches(model, toks) == 0


def test_a_vocabulary_too_large_for_a_table_scans():
    st = _model(3).new_decode_state(2, 60)
    assert st.bank.grams is None and st.bank.seen_last(5) is None


def test_negative_control_a_table_holding_the_last_position_is_caught(monkeypatch):
    model = _model(1)
    toks = torch.randint(0, 6, (3, 40), generator=torch.Generator().manual_seed(1))
    append = cache_mod.BankCache.append

    def too_early(self, st, tokens, n_new, start, start_t):
        append(self, st, tokens, n_new, start, start_t)
        if self.grams is not None and self._gram_len is not None:
            self.grams.scatter_(1, self._codes(start[0] + tokens.shape[1] - 1, 1), True)

    monkeypatch.setattr(cache_mod.BankCache, "append", too_early)
    assert _mismatches(model, toks) > 0
