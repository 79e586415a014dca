"""The oracle-routed bound (`prisme.evaluation.routing_bound`): routing the k positions of largest oracle drop, priced
as a routed trace, against the dense frontier of the reference models."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import tiny_model

from prisme.data.text import TokenDataset
from prisme.data.tokenizers import ByteTokenizer
from prisme.evaluation.oracle import greedy_oracle
from prisme.evaluation.routing_bound import oracle_routed_bound
from prisme.evaluation.run import EvalOptions
from prisme.model.oracle import token_ce

B, T, NB = 4, 16, 2


def text() -> TokenDataset:
    rng = random.Random(1)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "home"]
    return TokenDataset.from_text(" ".join(rng.choice(words) for _ in range(400)), ByteTokenizer(), val_fraction=0.3)


def fitted(model, ds: TokenDataset, steps: int = 40):
    """A few Adam steps on the train split: a reference that is better than chance (an untrained one is not)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _, (x, y) in zip(range(steps), ds.iter_eval("train", 8, T, None)):
        opt.zero_grad()
        token_ce(model(x).logits, y, reduction="mean").backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def bound():
    ds = text()
    model = tiny_model(vocab_size=256)
    small = tiny_model(5, vocab_size=256, use_workspace=False, n_layer=1)
    torch.nn.init.zeros_(small.backbone.norm.weight)  # uniform logits: log 256 nats, worse than the fitted deep model
    refs = {"small": small, "deep": fitted(tiny_model(6, vocab_size=256, use_workspace=False, n_layer=4), ds)}
    fr = (0.0, 0.1, 0.25, 0.5, 1.0)
    res = oracle_routed_bound(model, ds, refs, EvalOptions(batch_size=B, seq_len=T, max_batches=NB,
                                                           bootstrap_samples=200), fractions=fr)
    drops, base, ref_ce = [], [], {n: [] for n in refs}
    torch.set_grad_enabled(False)
    for x, y in ds.iter_eval("val", B, T, NB):  # by hand: the oracle's budget-1 drop at every position
        o = greedy_oracle(model, x, y, torch.arange(T).expand(x.shape[0], T), max_budget=1)
        drops.append((o.base_loss - o.loss).flatten())
        base.append(o.base_loss.flatten())
        for n, r in refs.items():
            ref_ce[n].append(token_ce(r(x).logits, y).flatten())
    torch.set_grad_enabled(True)
    return res, fr, torch.cat(drops).clamp_min(0), torch.cat(base), {n: torch.cat(v) for n, v in ref_ce.items()}


def test_routed_loss_is_the_backbone_minus_the_k_largest_oracle_drops(bound):
    """Each fraction's gain is the sum of the k largest oracle drops over all positions (float64 exact); fraction 0
    is the backbone, fraction 1 the oracle at every position. Negative control: the k smallest drops differ."""
    res, fr, d, base, _ = bound
    N = d.numel()
    assert res.n_positions == N == NB * B * T and abs(res.backbone_loss - float(base.mean())) < 1e-12
    top, bottom = torch.sort(d, descending=True).values, torch.sort(d).values
    for p, f in zip(res.points, fr):
        k = round(f * N)
        assert p.k == k and abs(p.gain - float(top[:k].sum()) / N) < 1e-12
        assert abs(p.loss - (res.backbone_loss - p.gain)) < 1e-12
    mid = res.points[2]
    assert abs(float(bottom[:mid.k].sum()) / N - mid.gain) > 1e-6  # the check would see a wrong selection


def test_routing_more_positions_costs_more_and_gains_no_less(bound):
    """Ops rise with the routed share (the router and bank projection make even fraction 0 cost more than the
    backbone alone); gains never fall."""
    res = bound[0]
    ops = [p.relative_ops for p in res.points]
    gains = [p.gain for p in res.points]
    assert 1.0 < ops[0] and all(a < b for a, b in zip(ops, ops[1:]))
    assert all(a <= b + 1e-15 for a, b in zip(gains, gains[1:])) and gains[0] == 0.0


def test_the_frontier_gap_interpolates_the_references_in_log_ops(bound):
    """The gap is the routed loss minus the lower envelope of the references at the point's ops (linear in log ops;
    beyond the ends, the nearest model)."""
    import math

    res, _, d, base, ref = bound
    env = sorted(res.frontier, key=res.frontier.get)
    xs = [res.frontier[n] for n in env]
    for p in res.points:
        if p.relative_ops <= xs[0] or len(xs) == 1:
            front = float(ref[env[0]].mean())
        elif p.relative_ops >= xs[-1]:
            front = float(ref[env[-1]].mean())
        else:
            a = (math.log(p.relative_ops) - math.log(xs[0])) / (math.log(xs[1]) - math.log(xs[0]))
            front = (1 - a) * float(ref[env[0]].mean()) + a * float(ref[env[1]].mean())
        assert abs(p.frontier_gap["mean"] - (p.loss - front)) < 1e-9
        assert p.frontier_gap["lo"] <= p.frontier_gap["mean"] <= p.frontier_gap["hi"]
    assert any(xs[0] < p.relative_ops < xs[-1] for p in res.points) and len(xs) == 2  # interpolation was tested
    assert res.best.frontier_gap["mean"] == min(p.frontier_gap["mean"] for p in res.points)


def test_bad_arguments_are_value_errors():
    model = tiny_model(vocab_size=256)
    ds = text()
    with pytest.raises(ValueError, match="reference"):
        oracle_routed_bound(model, ds, {}, EvalOptions(batch_size=B, seq_len=T, max_batches=1))
    with pytest.raises(ValueError, match="fractions"):
        oracle_routed_bound(model, ds, {"r": model}, EvalOptions(batch_size=B, seq_len=T, max_batches=1),
                            fractions=(1.5,))
    with pytest.raises(ValueError, match="workspace"):
        oracle_routed_bound(tiny_model(vocab_size=256, use_workspace=False), ds, {"r": model},
                            EvalOptions(seq_len=T))
