"""Paired bootstrap intervals over sequences (`prisme.stats`): coverage on synthetic replications with a known
difference, the width theory predicts (and its change when the pairing is broken), verdicts, and bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

from prisme.stats import PairedDelta, paired_bootstrap, verdict


def synthetic(seed: int, S: int = 150, delta: float = 0.05, seq_sd: float = 1.0, tok_sd: float = 0.5):
    """Per-sequence summed losses of a policy and a reference on the same tokens: a shared per-sequence level (what
    pairing cancels), independent per-token noise, and a true per-token difference `delta`."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(20, 120, (S,), generator=g).double()  # scored tokens per sequence
    level = torch.randn(S, generator=g, dtype=torch.float64) * seq_sd  # [S] sequence difficulty, shared
    b = n * (2.0 + level) + torch.randn(S, generator=g, dtype=torch.float64) * n.sqrt() * tok_sd
    a = n * (2.0 + level + delta) + torch.randn(S, generator=g, dtype=torch.float64) * n.sqrt() * tok_sd
    return a, b, n


def delta_method_se(a: torch.Tensor, b: torch.Tensor, n: torch.Tensor) -> float:
    """Standard error of the ratio estimator sum(a - b) / sum(n) over sequences (first-order, large S)."""
    d = a - b
    m = d.sum() / n.sum()
    return float(((d - m * n) ** 2).sum().sqrt() / n.sum())


def test_paired_interval_covers_the_true_difference_in_90_to_99_percent_of_200_replications():
    """200 seeded replications with a known difference: the 95% interval covers it 90-99% of the time."""
    delta = 0.05
    hits = 0
    for r in range(200):
        a, b, n = synthetic(r, delta=delta)
        res = paired_bootstrap(a, b, n, n_boot=400, seed=r)
        hits += res.lo <= delta <= res.hi
    assert 0.90 <= hits / 200 <= 0.99, hits


def test_interval_width_follows_theory_and_grows_when_the_pairing_is_broken():
    """The bootstrap width is ~2 x 1.96 standard errors of the ratio estimator; shuffling the reference across
    sequences (breaking the pairing) keeps the mean and widens the interval by the ratio theory predicts (the shared
    per-sequence level no longer cancels)."""
    a, b, n = synthetic(7, S=400)
    paired = paired_bootstrap(a, b, n, n_boot=2000, seed=1)
    se = delta_method_se(a, b, n)
    assert (paired.hi - paired.lo) == pytest.approx(2 * 1.96 * se, rel=0.15)
    perm = torch.randperm(400, generator=torch.Generator().manual_seed(3))
    # the negative control: each policy sequence compared with another sequence's reference, rescaled to its length
    b_broken = b[perm] * n / n[perm]
    broken = paired_bootstrap(a, b_broken, n, n_boot=2000, seed=1)
    se_broken = delta_method_se(a, b_broken, n)
    assert (broken.hi - broken.lo) == pytest.approx(2 * 1.96 * se_broken, rel=0.15)
    ratio = (broken.hi - broken.lo) / (paired.hi - paired.lo)
    assert ratio == pytest.approx(se_broken / se, rel=0.15) and ratio > 3  # theory: ~ sqrt(1 + 2 var(level) ...)


def test_estimate_is_the_token_weighted_mean_difference_and_seeded():
    """mean = (sum a - sum b) / sum n; the same seed gives the same interval; sequences without tokens are dropped."""
    a, b, n = torch.tensor([3.0, 10.0, 0.0]), torch.tensor([2.0, 4.0, 0.0]), torch.tensor([2.0, 4.0, 0.0])
    r1 = paired_bootstrap(a, b, n, seed=5)
    assert r1.mean == pytest.approx(7 / 6) and r1.n_sequences == 2 and r1.n_tokens == 6
    assert r1 == paired_bootstrap(a, b, n, seed=5)
    assert r1.lo <= r1.mean <= r1.hi


def test_verdicts_follow_the_interval_not_the_point_estimate():
    """beats: hi < 0; loses: lo > 0; ties: the interval contains 0, whatever the sign of the mean."""
    assert verdict(-0.3, -0.1) == "beats" and verdict(0.1, 0.2) == "loses"
    assert verdict(-0.3, 0.01) == "ties" and verdict(-0.01, 0.5) == "ties"
    assert PairedDelta(-0.2, -0.5, 0.1, 10, 100).verdict == "ties"


@pytest.mark.parametrize("kwargs, match", [(dict(n_boot=0), "positive integer"), (dict(n_boot=2.5), "positive"),
                                           (dict(seed=-1), "seed"), (dict(seed=True), "seed"),
                                           (dict(level=1.0), "level")])
def test_bad_bootstrap_arguments_are_value_errors(kwargs, match):
    """A sample count or seed that is not a positive / non-negative integer, or a level outside (0, 1)."""
    with pytest.raises(ValueError, match=match):
        paired_bootstrap([1.0, 2.0], [1.0, 1.0], [1, 1], **kwargs)
    with pytest.raises(ValueError, match="no sequence"):
        paired_bootstrap([0.0], [0.0], [0])
    assert math.isfinite(paired_bootstrap([1.0], [0.5], [1]).mean)
