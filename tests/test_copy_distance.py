"""Slices by copy distance (`evaluation.slices` with bucket edges) against a plain search, the capture of the far-copy
gain on hand-made numbers, and both in the text study's report."""

from __future__ import annotations

import math

import pytest
import torch

from prisme.evaluation.slices import (
    WINDOW_SLICES,
    ar_slice_labels,
    beyond_window_names,
    capture,
    capture_interval,
    merge_slices,
    slice_edges,
    slice_names,
)


def _distance_labels_by_hand(x: list[int], y: list[int], n: int, edges: tuple[int, ...], shift: int = 0) -> list[int]:
    """Plain search: an AR hit's copy distance is t - j + n for its nearest earlier n-gram end j followed by y_t (the
    window that holds the occurrence whole); its label the first edge it does not exceed (`shift` moves the distance:
    the negative control)."""
    k, out = len(edges), []
    for t in range(len(x)):
        gram = x[t - n + 1:t + 1] if t >= n - 1 else None
        seen = [j for j in range(n - 1, t) if gram is not None and x[j - n + 1:j + 1] == gram]
        hits = [j for j in seen if x[j + 1] == y[t]]
        if hits:
            d = t - max(hits) + n + shift
            out.append(next((i for i, e in enumerate(edges) if d <= e), k))
        else:
            out.append(k + 1 if seen else k + 2)
    return out


@pytest.mark.parametrize("n, edges", [(1, (3, 8, 20)), (2, (4, 10)), (3, (6, 12, 24, 40)), (2, (5,))])
def test_distance_buckets_equal_a_plain_search(n, edges):
    """Each AR hit lands in the bucket of its nearest occurrence's distance; seen misses and others keep their own
    labels after the buckets. Negative control: a distance one shorter moves some hits to a nearer bucket."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 3, (6, 48), generator=g)
    y = torch.cat([x[:, 1:], torch.randint(0, 3, (6, 1), generator=g)], 1)
    got = ar_slice_labels(x, y, n, window=edges)
    for b in range(6):
        assert got[b].tolist() == _distance_labels_by_hand(x[b].tolist(), y[b].tolist(), n, edges)
    assert any(got[b].tolist() != _distance_labels_by_hand(x[b].tolist(), y[b].tolist(), n, edges, shift=-1)
               for b in range(6))
    assert set(got.flatten().tolist()) >= set(range(min(len(edges), 2)))
    assert len(slice_names(edges)) == len(edges) + 3


def test_one_edge_is_the_window_split_and_the_buckets_refine_it():
    """`window=W` and `(W,)` give the within / beyond labels; with more edges, the beyond-window hits are exactly the
    buckets' hits, and the other labels do not move."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 4, (4, 96), generator=g)
    y = torch.cat([x[:, 1:], torch.randint(0, 4, (4, 1), generator=g)], 1)
    y[1, 3] = -100
    w = ar_slice_labels(x, y, 2, window=8)
    assert torch.equal(w, ar_slice_labels(x, y, 2, window=(8,))) and slice_names((8,)) == WINDOW_SLICES
    b = ar_slice_labels(x, y, 2, window=[8, 16, 32])
    assert slice_names((8, 16, 32)) == ("ar_hit_in_window", "ar_hit_8_16", "ar_hit_16_32", "ar_hit_beyond_32",
                                        "seen_miss", "other")
    assert torch.equal(b == 0, w == 0) and torch.equal((b >= 1) & (b <= 3), w == 1)
    assert torch.equal(b == 4, w == 2) and torch.equal(b == 5, w == 3) and b[1, 3] == -1
    assert beyond_window_names(slice_names((8, 16, 32))) == ("ar_hit_8_16", "ar_hit_16_32", "ar_hit_beyond_32")
    assert beyond_window_names(WINDOW_SLICES) == ("ar_hit_beyond_window",) and beyond_window_names(
        slice_names(None)) == ()
    for bad in (0, (8, 8), (16, 8), (8, 0), True, (8, 2.5), "8"):
        with pytest.raises(ValueError, match="window"):
            slice_edges(bad)


def test_merged_slices_weight_each_by_its_targets():
    """Two slices as one: shares add, losses and gains are target-weighted; a slice without targets drops out."""
    rep = {"a": {"share_of_targets": 0.1, "loss": 1.0, "gain_over_backbone": 0.2},
           "b": {"share_of_targets": 0.3, "loss": 2.0, "gain_over_backbone": None},
           "c": {"share_of_targets": 0.0, "loss": None, "gain_over_backbone": None}}
    m = merge_slices(rep, ("a", "b", "c"))
    assert m["share_of_targets"] == pytest.approx(0.4) and m["loss"] == pytest.approx(1.75)
    assert m["gain_over_backbone"] is None and merge_slices(rep, ("c",))["loss"] is None


def test_capture_on_hand_made_losses():
    """The issue's numbers: global attention removes 1.727 - 1.042 beyond the window; a row removing 0.1 of its
    backbone's captures 0.1 / 0.685. A global model that removes nothing (or worse) leaves capture undefined."""
    c = capture(row=1.869, backbone=1.969, global_model=1.042, window_twin=1.727)
    assert c.removed == pytest.approx(0.1) and c.global_removed == pytest.approx(0.685)
    assert c.value == pytest.approx(0.1 / 0.685) and c.fmt() == "14.6%"
    none = capture(row=2.0, backbone=1.9, global_model=1.5, window_twin=1.5)  # no division by zero
    assert none.value is None and none.global_removed == 0.0 and none.removed == pytest.approx(-0.1)
    assert "removes nothing" in none.undefined and none.fmt() == "undefined"
    assert capture(1.8, 1.9, 1.6, 1.5).value is None  # the global model is worse than its twin
    assert capture(1.9, 1.9, 1.0, 1.5).value == 0.0 and capture(2.0, 1.9, 1.0, 1.5).value == pytest.approx(-0.2)
    with pytest.raises(ValueError, match="finite"):
        capture(math.nan, 1.9, 1.0, 1.5)


def test_capture_interval_resamples_sequences():
    """Per-sequence sums: the point is the ratio of summed gains; a constant per-sequence ratio gives a zero-width
    interval; a noisy one an interval holding the point; undefined where the global model removes nothing, and no
    interval when a resample's global model removes nothing."""
    n = torch.tensor([10.0, 20.0, 5.0, 0.0, 15.0])
    twin = n * 1.5
    glob = n * 1.0  # removes 0.5 per target
    back = n * 2.0
    row = back - 0.25 * n  # removes 0.25 per target: capture 50 % on every sequence
    c = capture_interval(row, back, glob, twin, n, n_boot=200)
    assert c.value == pytest.approx(0.5) and c.lo == pytest.approx(0.5) and c.hi == pytest.approx(0.5)
    noisy = row + torch.tensor([0.5, -1.0, 0.3, 0.0, 0.2])
    c = capture_interval(noisy, back, glob, twin, n, n_boot=500, seed=1)
    assert c.lo < c.value < c.hi and c.fmt().startswith(f"{c.value:.1%} [")
    assert capture_interval(row, back, twin, twin, n).value is None
    mixed = glob + torch.tensor([1.0, -0.9, 0.0, 0.0, 0.0]) * n  # the twin beats the global model on one sequence
    c = capture_interval(row, back, mixed, twin, n, n_boot=500)
    assert c.value is not None and c.lo is None and c.hi is None
    with pytest.raises(ValueError, match="one entry per sequence"):
        capture_interval(row, back, glob, twin, n[:3])


def _row(policy: str, family: str, loss: dict[str, float], ops: float = 1.0, shares=(0.1, 0.15, 0.1, 0.65)):
    names = ("ar_hit_in_window", "ar_hit_64_256", "ar_hit_256_1024", "ar_hit_beyond_1024", "seen_miss", "other")
    share = dict(zip(names, (shares[0], shares[1], shares[2], 0.0, shares[3] / 2, shares[3] / 2)))
    slices = {k: {"share_of_targets": share[k], "loss": None if share[k] == 0 else loss.get(k, 1.5),
                  "gain_over_backbone": None, "share_of_gain": None, "edits_per_position": None} for k in names}
    return {"policy": policy, "family": family, "deployable": True, "relative_ops": ops, "loss": 1.4,
            "slices": slices}


def _doc(ctrl_far: list[float], ks_far: list[float]) -> dict:
    """Two seeds; the beyond-window slice = the 64-256 and 256-1,024 buckets (equal losses within a row here)."""
    def far(v: float) -> dict[str, float]:
        return {"ar_hit_64_256": v, "ar_hit_256_1024": v}

    def seed(i: int) -> dict:
        rows = [_row("backbone", "backbone", far(2.0)),
                _row("controller(lambda=0.03)", "controller", far(ctrl_far[i]), ops=1.09),
                _row("L1_d128", "reference", far(1.7), ops=1.42), _row("L1_d128_w64", "reference", far(1.9), 0.97),
                _row("L1_d128_ks", "reference", far(ks_far[i]), ops=1.45),
                _row("L1_d128_w64_ks", "reference", far(2.0), ops=1.0),
                _row("L2_d128_ks", "reference", far(1.0), ops=2.78)]  # another depth: never the reference
        return {"sources": {"residual": {"val": {"rows": rows, "table": ""}, "held_out": {"rows": rows, "table": ""}}}}

    return {"seeds": {"1": seed(0), "2": seed(1)}, "model": {"n_layer": 1, "attn_window": 64}}


def test_the_report_prints_distance_buckets_and_each_rows_capture():
    """The slice table gains a column per bucket; the capture is measured against the same-depth global model with
    the lowest loss beyond the window (here the key-shift one) and its window twin, per seed, undefined where that
    model removes nothing."""
    from prisme.studies.text_report import capture_summary, capture_table, format_report, seed_summary, slice_table

    doc = _doc(ctrl_far=[1.9, 1.95], ks_far=[1.5, 1.6])
    doc["summary"] = seed_summary(doc)
    table = slice_table(doc)
    assert "64-256" in table and "256-1024" in table and "> 1024" in table and "AR hit beyond" in table
    assert "10.0% / 15.0% / 10.0% / 0.0% / 25.0% / 32.5% / 32.5%" in table  # seen miss and other apart
    caps = {(c["split"], c["policy"]): c for c in capture_summary(doc)}
    c = caps[("val", "controller(lambda=0.03)")]
    assert c["global"] == "L1_d128_ks" and c["window_twin"] == "L1_d128_w64_ks"
    assert [d["value"] for d in c["capture"]] == pytest.approx([0.1 / 0.5, 0.05 / 0.4])
    assert not any(p.startswith("L") for _, p in caps)  # the frontier models are references, not PRISME rows
    text = capture_table(doc)
    assert "L1_d128_ks removes +0.5000 +0.4000 relative to L1_d128_w64_ks" in text and "20.0% 12.5%" in text
    doc = _doc(ctrl_far=[1.9, 1.95], ks_far=[1.5, 2.0])
    doc["summary"] = seed_summary(doc)
    c = next(c for c in capture_summary(doc) if c["policy"].startswith("controller"))
    assert c["global"] == "L1_d128" and [d["value"] for d in c["capture"]] == pytest.approx([0.5, 0.25])
    doc = _doc(ctrl_far=[1.9, 1.95], ks_far=[2.0, 2.0])
    for r in (r for s in doc["seeds"].values() for r in s["sources"]["residual"]["val"]["rows"]):
        if r["policy"] in ("L1_d128", "L1_d128_w64"):
            r["slices"]["ar_hit_64_256"]["loss"] = r["slices"]["ar_hit_256_1024"]["loss"] = 2.0
    doc["summary"] = seed_summary(doc)
    doc["verdicts"] = []
    assert "undefined undefined" in capture_table(doc)
    assert "capture beyond the 64-position window" in format_report(doc)
    doc["model"]["attn_window"] = None
    assert capture_table(doc) is None
