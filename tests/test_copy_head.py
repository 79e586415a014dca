"""The copy head (prisme/model/copy.py) and its keys (prisme/model/bank/suffix.py): the match lengths against a brute
force, their decode-step update, the longest match, the mixture's numbers in float64, causality, the positions with
no candidate left bitwise, what the copy stage trains, and the untrained references (prisme/evaluation/far_reads.py).
Each check has a negative control."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from prisme.config import PrismeConfig
from prisme.evaluation.far_reads import ContinuousCache, ExactCopy, fit_gate, length_bucket
from prisme.model.bank.suffix import longest_match, match_lengths, step_lengths
from prisme.model.copy import copy_inputs, distance_bucket
from prisme.model.prisme import PrismeModel


def brute_lengths(ids: torch.Tensor, cap: int) -> torch.Tensor:
    B, T = ids.shape
    out = torch.zeros(B, T, T, dtype=torch.uint8)
    for b in range(B):
        for t in range(T):
            for j in range(t):
                m = 0
                while m < cap and j - m >= 0 and ids[b, t - m] == ids[b, j - m]:
                    m += 1
                out[b, t, j] = m
    return out


def test_match_lengths_are_the_common_suffix_lengths():
    """L[t, j] is the number of tokens ending at t that equal those ending at j (j < t, capped), for random ids over a
    small alphabet (many long matches); a brute force that forgets the j < t rule differs (negative control)."""
    ids = torch.randint(0, 3, (2, 30), generator=torch.Generator().manual_seed(0))
    L = match_lengths(ids, cap=6)
    assert torch.equal(L, brute_lengths(ids, 6))
    assert int(L.max()) == 6  # the cap was reached: long matches were counted
    wrong = brute_lengths(ids, 6) + torch.eye(30, dtype=torch.uint8)  # j = t counted (every position matches itself)
    assert not torch.equal(L, wrong)


def test_step_lengths_are_the_rows_of_match_lengths():
    """The decode step's update of one query's row, from the previous row, is that row of the full matrix."""
    ids = torch.randint(0, 3, (2, 25), generator=torch.Generator().manual_seed(1))
    L = match_lengths(ids, cap=5)
    prev = torch.zeros(2, 0, dtype=torch.uint8)
    for t in range(25):
        prev = step_lengths(prev, ids, t, cap=5)
        assert torch.equal(prev, L[:, t, :t])
    stale = step_lengths(torch.zeros_like(L[:, 23, :23]), ids, 24, cap=5)  # a row never updated: wrong (control)
    assert not torch.equal(stale, L[:, 24, :24])


def test_longest_match_is_the_most_recent_of_the_longest():
    """"abcXabcYabc": at the last c the longest match is "abc" (3), found twice; the most recent (j = 6) proposes Y;
    beyond a window of 4 (n = 3) only the first occurrence (j = 2) is allowed, proposing X."""
    ids = torch.tensor([[ord(c) for c in "abcXabcYabc"]])
    L = match_lengths(ids)
    lm = longest_match(L, ids, min_len=3)
    assert (lm.length[0, 10], lm.source[0, 10], lm.copy[0, 10], lm.count[0, 10]) == (3, 6, ord("Y"), 2)
    far = longest_match(L, ids, min_len=3, beyond=7, n=3)  # t - j + 3 > 7: j < 6
    assert (far.length[0, 10], far.source[0, 10], far.copy[0, 10]) == (3, 2, ord("X"))
    assert longest_match(L, ids, min_len=4).length[0, 10] == 0  # nothing of 4 tokens


def model(**kw) -> PrismeModel:
    torch.manual_seed(0)
    return PrismeModel(PrismeConfig.from_name("tiny", copy_head=True, use_workspace=False, **kw)).double().eval()


def test_the_copy_mixture_in_float64():
    """Where a query has candidates, exp(logits) is (1 - g) softmax(head) + g p_copy with p_copy the pointer's
    softmax over matching positions (length and distance tables) added onto the tokens that followed them, to 1e-12;
    where it has none the logits are the head's, bitwise."""
    m = model(copy_stream=4)
    with torch.no_grad():  # a gate that copies visibly
        m.copy.gate_out.bias.fill_(0.5)
        m.copy.dist_score.copy_(torch.linspace(0.3, -0.4, m.copy.dist_score.numel()))
    x = torch.randint(0, 5, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        H = m.backbone(x)
        head = m.backbone.head(H)
        out = m(x).logits
        inp = copy_inputs(x)
        _, g = m.copy.mix(head, inp, H)
    L = brute_lengths(x, 32).double()
    for b in range(2):
        for t in range(24):
            cand = [j for j in range(t) if L[b, t, j] >= 1]
            if not cand:
                assert torch.equal(out[b, t], head[b, t])
                continue
            s = torch.stack([m.copy.len_score[int(L[b, t, j])] + m.copy.dist_score[min(int(math.log2(t - j)), 10)]
                             for j in cand])
            a = torch.softmax(s, 0)
            pc = torch.zeros(64, dtype=torch.float64)
            for w, j in zip(a, cand):
                pc[x[b, j + 1]] += w
            want = (1 - g[b, t]) * torch.softmax(head[b, t], 0) + g[b, t] * pc
            torch.testing.assert_close(out[b, t].exp(), want, atol=1e-12, rtol=0)
    assert float(g.max()) > 0.3


def test_copy_head_causality_and_a_lookahead_fault_is_caught():
    """Perturbing tokens after t leaves the logits at t and before bitwise; a pointer that may read position t itself
    (proposing x[t + 1], the target) changes them (negative control)."""
    m = model()
    x = torch.randint(0, 4, (1, 30), generator=torch.Generator().manual_seed(3))
    x2 = x.clone()
    x2[0, 20:] = (x2[0, 20:] + 1) % 4
    with torch.no_grad():
        a, b = m(x).logits, m(x2).logits
        assert torch.equal(a[0, :20], b[0, :20])

        def peeking(ids, pos=None):
            inp = copy_inputs(ids, pos)
            L = inp.L.clone()
            T = L.shape[-1]
            L[:, torch.arange(T), torch.arange(T)] = 1  # j = t a candidate: it proposes x[t + 1]
            return type(inp)(L, inp.nxt, inp.pos)

        H = m.backbone(x)
        H2 = m.backbone(x2)
        la = m.copy.mix(m.backbone.head(H), peeking(x), H)[0]
        lb = m.copy.mix(m.backbone.head(H2), peeking(x2), H2)[0]
    assert not torch.equal(la[0, :20], lb[0, :20])


def test_distance_buckets():
    assert distance_bucket(torch.tensor([1, 2, 3, 4, 1023, 1024, 5000])).tolist() == [0, 1, 1, 2, 9, 10, 10]


def test_the_copy_stage_trains_the_copy_head_alone_or_with_the_backbone(tmp_path):
    """The copy stage moves the copy head's parameters and nothing else; joint (`train_backbone_in_workspace_stage`,
    from a fresh model) the backbone's too; a model without a copy head is refused before anything is written."""
    from prisme import checkpoint as ckpt
    from prisme.data.text import TokenDataset
    from prisme.training.config import StageConfig
    from prisme.training.trainer import train_stage

    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 8, (40,), generator=g).repeat(6)  # a text that repeats: copying pays
    data = TokenDataset(toks.numpy(), val_fraction=0.2, vocab_size=64)
    cfg = PrismeConfig.from_name("tiny", copy_head=True, use_workspace=False)
    kw = dict(steps=3, batch_size=2, seq_len=32, eval_batches=1, warmup=1, dataset="austen", progress=False)
    bb = train_stage(cfg, StageConfig(stage="backbone", out_dir=str(tmp_path / "bb"), **kw), dataset=data)
    before = {k: v.clone() for k, v in ckpt.load_model(bb.checkpoint)[0].state_dict().items()}
    res = train_stage(None, StageConfig(stage="copy", init_from=str(bb.checkpoint), out_dir=str(tmp_path / "c"),
                                        **kw), dataset=data)
    after = ckpt.load_model(res.checkpoint)[0].state_dict()
    moved = {k.split(".")[0] for k in after if not torch.equal(before[k], after[k])}
    assert moved == {"copy"} and "gain" in res.train
    joint = train_stage(cfg, StageConfig(stage="copy", out_dir=str(tmp_path / "j"),
                                         train_backbone_in_workspace_stage=True, **kw), dataset=data)
    assert joint.step == 3
    plain = PrismeConfig.from_name("tiny", use_workspace=False)
    with pytest.raises(ValueError, match="copy_head"):
        train_stage(plain, StageConfig(stage="copy", out_dir=str(tmp_path / "no"),
                                       train_backbone_in_workspace_stage=True, **kw), dataset=data)
    assert not (tmp_path / "no").exists()


def test_the_copy_head_is_priced_as_a_lookup_plus_its_gate():
    """The cost model's copy_head term: 3 (T - 1) lookups, the stream projection and the gate's MLP, the mix; a
    backbone term (every position pays it); 0 without a copy head; its matmul part equals the FLOPs the copy head's
    linear layers count on a forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from prisme.config import COPY_FEATURES
    from prisme.costs.analytic import copy_head_ops, token_ops

    cfg = PrismeConfig.from_name("tiny", copy_head=True, copy_stream=4, copy_hidden=8)
    T = 40
    row = token_ops(cfg, T)
    assert row["copy_head"] == copy_head_ops(cfg, T) > 0
    assert row["backbone"] == token_ops(cfg.replace(copy_head=False), T)["backbone"] + row["copy_head"]
    assert copy_head_ops(cfg.replace(copy_head=False), T) == 0
    matmul = 2 * cfg.d_model * 4 + 2 * (COPY_FEATURES + 4) * 8 + 2 * 8
    assert copy_head_ops(cfg, T) == matmul + 3 * (T - 1) + 2 * cfg.vocab_size
    m = PrismeModel(cfg).eval()
    H = torch.randn(1, 1, cfg.d_model)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        feats = m.copy.features(F.log_softmax(torch.randn(1, 1, 64), -1), torch.zeros(1, 1, 64),
                                torch.zeros(1, 1, 3, dtype=torch.uint8), torch.full((1, 1), 3), H)
        m.copy.gate(feats, torch.ones(1, 1, dtype=torch.bool))
    assert fc.get_total_flops() == matmul  # the stream projection and the gate's two layers
    no_stream = cfg.replace(copy_stream=0)
    assert copy_head_ops(cfg, T) - copy_head_ops(no_stream, T) == 2 * cfg.d_model * 4 + 2 * 4 * 8


def test_the_exact_copy_reference_fits_its_gates_and_mixes():
    """`fit_gate` maximises the mixture's likelihood (a copy that is always right gets the top gate, one that is never
    right gets 0); `ExactCopy.nll` is -log((1 - g) p + g [y = copy]); length buckets start at 4 tokens."""
    p = torch.full((50,), 0.1, dtype=torch.float64)
    assert fit_gate(p, torch.ones(50)) == pytest.approx(0.999)
    assert fit_gate(p, torch.zeros(50)) == 0.0
    half = fit_gate(p, (torch.arange(50) % 2).double())
    assert 0.3 < half < 0.6
    assert length_bucket(torch.tensor([0, 3, 4, 5, 8, 32])).tolist() == [0, 0, 1, 2, 4, 9]
    ref = ExactCopy()
    ref.gates = torch.tensor([0.0, 0.5] + [0.0] * 8, dtype=torch.float64)
    nll = ref.nll(torch.log(torch.tensor([0.2, 0.2])), torch.tensor([1, 1]), torch.tensor([3, 4]), torch.tensor([3, 3]))
    torch.testing.assert_close(nll, -torch.log(torch.tensor([0.5 * 0.2 + 0.5, 0.5 * 0.2], dtype=torch.float64)))


def test_the_continuous_cache_reads_beyond_the_window_only():
    """p_cache of a target is the softmax weight of the positions j beyond the window whose token x_j is the target
    (keys h_{j-1}); positions with nothing beyond the window have no cache."""
    h = F.normalize(torch.randn(1, 12, 8, generator=torch.Generator().manual_seed(4)), dim=-1) * math.sqrt(8)
    x = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]])
    y = torch.roll(x, -1, 1)
    pc, has = ContinuousCache(far=4).cache_prob(h, x, y, theta=2.0)
    assert not bool(has[0, :5].any()) and bool(has[0, 5:].all())  # j >= 1 with t - j + 1 > 4: from t = 5 on
    t = 8
    js = [j for j in range(1, t) if t - j + 1 > 4]
    s = torch.stack([2.0 * (h[0, t] @ h[0, j - 1]) / math.sqrt(8) for j in js])
    w = torch.softmax(s, 0)
    torch.testing.assert_close(pc[0, t], sum(wi for wi, j in zip(w, js) if x[0, j] == y[0, t]))


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("workspace", [False, True], ids=["dense", "router"])
def test_decoding_a_copy_head_model_equals_its_forward(chunk, workspace):
    """A copy-head model decoded in chunks (one token: the match lengths' decode-step update from the kept row of the
    last position; several: computed for the chunk's queries) gives the logits and traces of its parallel pass in
    float64 to 1e-12: a dense model's `model(x)`, a router model's `forward_policy` at budget 1 (the router fires at
    some positions); ragged rows too (chunk 3)."""
    from prisme.model.policy import Controller

    if workspace:
        torch.manual_seed(0)
        m = PrismeModel(PrismeConfig.from_name("tiny", copy_head=True, router=True, router_ngram=2,
                                               bank_shift=True)).double().eval()
    else:
        m = model()
    if workspace:
        with torch.no_grad():
            m.router.head.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    x = torch.randint(0, 5, (2, 21), generator=torch.Generator().manual_seed(6))
    policy = Controller(1, 0.0) if workspace else None
    with torch.no_grad():
        full = m.forward_policy(x, policy=policy) if workspace else m(x)
        st = m.new_decode_state(2, 24)
        outs = [st.decode_step(x[:, i:i + chunk], policy=policy) for i in range(0, 21, chunk)]
    logits = torch.cat([o.logits for o in outs], 1)
    torch.testing.assert_close(logits, full.logits, atol=1e-12, rtol=0)
    if workspace:
        acts = torch.cat([o.actions for o in outs], 1)
        assert torch.equal(acts, full.actions) and bool((acts != m.cfg.stop_action).any())
    if chunk == 3:  # ragged rows: the second row one chunk behind, then caught up
        st = m.new_decode_state(2, 24)
        with torch.no_grad():
            st.prefill(x[:, :12], lengths=[12, 9], logits="none")
            out = st.decode_step(torch.stack([x[0, 12:15], torch.cat([x[1, 9:12]])]), policy=policy)
        torch.testing.assert_close(out.logits[0], full.logits[0, 12:15], atol=1e-12, rtol=0)
        torch.testing.assert_close(out.logits[1], full.logits[1, 9:12], atol=1e-12, rtol=0)


def test_negative_control_a_stale_match_row_is_caught(monkeypatch):
    """The same one-token decode with the decode-step update reading a row of zeros (as a state that forgot its last
    position's lengths would): the logits move far from the parallel pass's."""
    import prisme.model.state as state_mod

    m = model()
    x = torch.randint(0, 4, (1, 20), generator=torch.Generator().manual_seed(7))
    orig = state_mod.step_lengths
    monkeypatch.setattr(state_mod, "step_lengths", lambda prev, ids, t, cap=32: orig(torch.zeros_like(prev), ids, t))
    with torch.no_grad():
        full = m(x).logits
        st = m.new_decode_state(1, 20)
        logits = torch.cat([st.decode_step(x[:, i:i + 1]).logits for i in range(20)], 1)
    assert float((logits - full).abs().max()) > 1e-3
