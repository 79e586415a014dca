"""`prisme bench long` and what it stands on: a decode state filled synthetically (`DecodeState.fill_synthetic`,
`KVCache.set_lengths`), the price that fires an exact share of the timed positions, and the document on a smoke
shape (d = 64, contexts of 128 positions: seconds)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from prisme.bench.harness import peak_memory
from prisme.bench.long import PATHS, configs, main, price_for
from prisme.config import PrismeConfig
from prisme.model.policy import Controller
from prisme.model.prisme import PrismeModel


def _model(**kw) -> PrismeModel:
    torch.manual_seed(0)
    return PrismeModel(PrismeConfig.from_name("tiny", router=True, **kw)).eval()


def test_fill_synthetic_sets_lengths_and_fills_every_buffer_the_step_reads():
    model = _model(key_shift=True, bank_shift=True, bank_source="embedding")
    state = model.new_decode_state(2)
    state.fill_synthetic(40, torch.Generator().manual_seed(1))
    assert state.lengths == [40, 40]
    for layer in state.cache.layers:
        assert bool((layer.k != 0).all()) and bool((layer.v != 0).all()) and bool((layer.prev != 0).all())
    assert state.bank.KV is not None and bool((state.bank.KV != 0).all())
    assert int(state.bank.ids.max()) < model.cfg.vocab_size and int(state.bank.ids.max()) > 0
    # a step reads what was filled: the same step from a zero state of the same length differs (negative control)
    tok = torch.tensor([[3], [5]])
    filled = state.decode_step(tok, policy=Controller(1, lambda_cost=0.0)).logits
    zero = model.new_decode_state(2)
    zero.cache.set_lengths([40, 40])
    assert not torch.allclose(filled, zero.decode_step(tok, policy=Controller(1, lambda_cost=0.0)).logits)


def test_fill_synthetic_is_deterministic_per_generator():
    model = _model()
    a = model.new_decode_state(1).fill_synthetic(10, torch.Generator().manual_seed(3))
    b = model.new_decode_state(1).fill_synthetic(10, torch.Generator().manual_seed(3))
    c = model.new_decode_state(1).fill_synthetic(10, torch.Generator().manual_seed(4))
    assert torch.equal(a.cache.layers[0].k, b.cache.layers[0].k)
    assert not torch.equal(a.cache.layers[0].k, c.cache.layers[0].k)


@pytest.mark.parametrize("length", [-1, 64, 2.5])
def test_fill_synthetic_bad_length_is_a_value_error_and_changes_nothing(length):
    state = _model().new_decode_state(1)
    with pytest.raises(ValueError, match="fill_synthetic: length"):
        state.fill_synthetic(length)
    assert state.lengths == [0] and bool((state.cache.layers[0].k == 0).all())


def test_set_lengths_refuses_a_length_past_capacity_or_a_wrong_count():
    cache = _model().new_decode_state(2).cache
    with pytest.raises(ValueError, match="set_lengths"):
        cache.set_lengths([65, 0])
    with pytest.raises(ValueError, match="set_lengths"):
        cache.set_lengths([3])
    assert cache.lengths == [0, 0]


def test_price_for_fires_exactly_the_share_asked():
    ratios = torch.tensor([[0.5, 0.1, 0.0, 0.9, 0.3, 0.7, 0.2, 0.05]])
    for rate, k in ((0.25, 2), (0.5, 4), (0.01, 1)):
        price, fired = price_for(ratios, rate)
        assert fired == k and int((ratios > price).sum()) == k
    assert price_for(torch.zeros(1, 4), 0.5) == (1e9, 0)  # no positive value: nothing can fire


def test_configs_hold_the_dense_rivals_to_the_same_widths_and_prisme_to_a_local_key_shift_backbone():
    cfgs = configs("d256_L2", 4096, "embedding")
    p, d, dk = cfgs["prisme"], cfgs["dense"], cfgs["dense_ks"]
    assert (p.d_model, p.n_layer, p.attn_window, p.key_shift, p.router) == (256, 2, 64, True, True)
    assert (d.d_model, d.n_layer, d.attn_window, d.key_shift, d.use_workspace) == (256, 2, None, False, False)
    assert dk.key_shift and dk.attn_window is None and p.max_seq_len == d.max_seq_len == 4096


def _args(tmp_path, **kw) -> argparse.Namespace:
    base = dict(shapes="d64_L2", contexts="128", batches="1,2", steps=8, repeats=1, edit_rate=0.2,
                bank_source="embedding", prefill=True, prefill_repeats=1, train=True, train_positions=16,
                train_repeats=1, threads=1, seed=0, json=str(tmp_path / "long.json"), device="cpu")
    return argparse.Namespace(**{**base, **kw})


def test_bench_long_document_on_the_smoke_shape(tmp_path, capsys):
    assert main(_args(tmp_path)) == 0
    doc = json.loads((tmp_path / "long.json").read_text())
    assert doc["bench"] == "long" and doc["checks"]["passed"] and len(doc["results"]) == 2
    for res in doc["results"]:
        rows = res["rows"]
        assert list(rows) == list(PATHS)
        # the routed path fired at exactly the positions its price picked (teacher-forced, the same steps)
        assert res["fired_positions"] >= 1
        positions = res["batch"] * res["steps"]
        assert rows["routed"]["edits_per_token"] == pytest.approx(res["fired_positions"] / positions)
        assert rows["routed_off"]["edits_per_token"] == 0 == rows["backbone"]["edits_per_token"]
        # ops: the key shift costs the dense model more; PRISME's 64-window backbone reads less than global at 128
        assert rows["dense_ks"]["ops_per_token"] > rows["dense"]["ops_per_token"] > rows["backbone"]["ops_per_token"]
        assert rows["routed"]["ops_per_token"] > rows["routed_off"]["ops_per_token"]
        assert rows["dense"]["speedup_vs_dense"] == 1.0
        # a bank kept as ids is far smaller than the dense K/V cache
        assert rows["backbone"]["state_bytes"] < rows["dense"]["state_bytes"]
        # a path's peak: its decode state and the temporaries of its steps (the logits at least: B x 256 floats)
        assert all(row["peak_bytes"] >= row["state_bytes"] + res["batch"] * 256 * 4 for row in rows.values())
    assert set(doc["prefill"][0]["rows"]) == {"dense", "dense_ks", "backbone", "routed"}
    train = doc["train"][0]
    assert train["workspace_positions"] == 16
    rows = train["rows"]
    assert set(rows) == {"dense", "dense_ks", "prisme_backbone", "prisme_workspace", "prisme"}
    assert rows["prisme"]["ms"] == pytest.approx(rows["prisme_backbone"]["ms"] + rows["prisme_workspace"]["ms"])
    assert "x dense" in capsys.readouterr().out
    assert doc["environment"]["device"] == "cpu" and doc["environment"]["gpu"] is None


def test_bench_long_bad_options_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="--contexts"):
        main(_args(tmp_path, contexts="8", steps=8))
    with pytest.raises(ValueError, match="--edit-rate"):
        main(_args(tmp_path, edit_rate=1.5))
    with pytest.raises(ValueError, match="--shapes"):
        main(_args(tmp_path, shapes="d999"))
    if not torch.cuda.is_available():  # no device here: named, before any work
        with pytest.raises(ValueError, match="--device cuda"):
            main(_args(tmp_path, device="cuda"))
    assert not (tmp_path / "long.json").exists()


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"),
                                    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def test_peak_memory_counts_the_tensors_a_run_holds_at_once_not_those_held_before(device):
    """A run that makes two 4 MiB tensors, frees one, then makes a third, peaks at 8 MiB (two at once, not three);
    negative control: a run that only reads a 64 MiB tensor made before it stays under 1 MiB."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev, n = torch.device(device), 2**20

    def run():
        a, b = torch.ones(n, device=dev), torch.ones(n, device=dev)
        del a
        c = torch.ones(n, device=dev)
        return b, c

    assert peak_memory(run, dev) == 8 * 2**20
    held = torch.ones(16 * n, device=dev)
    assert peak_memory(lambda: held.sum(), dev) < 2**20


def test_bench_long_with_the_copy_head_times_the_decode_recurrence(tmp_path, monkeypatch):
    """`--copy-head`: every model carries the copy head; a synthetically filled state keeps the last position's match
    lengths, so each timed step takes the one-row recurrence (`suffix.step_lengths`) a decode takes, never the
    whole-context `query_lengths` (negative control: a state whose kept row is not set would call it)."""
    import prisme.model.state as state_module

    cfgs = configs("d64_L2", 128, "embedding", copy_head=True)
    assert all(c.copy_head for c in cfgs.values())
    model = PrismeModel(cfgs["prisme"]).eval()
    calls = []
    real = state_module.query_lengths
    monkeypatch.setattr(state_module, "query_lengths", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        state = model.new_decode_state(2).fill_synthetic(100, torch.Generator().manual_seed(0))
        for _ in range(3):
            state.decode_step(torch.tensor([[3], [4]]), policy=Controller(1, lambda_cost=0.0))
        assert calls == []
        state._copy_at = None  # negative control: without the kept row the step recomputes every length
        state.decode_step(torch.tensor([[3], [4]]))
        assert calls == [1]
    assert main(_args(tmp_path, copy_head=True, train=False)) == 0
    doc = json.loads((tmp_path / "long.json").read_text())
    assert doc["settings"]["copy_head"] and all(r["rows"]["routed"]["edits_per_token"] > 0 for r in doc["results"])
    with pytest.raises(ValueError, match="--copy-head leave --train out"):
        main(_args(tmp_path, copy_head=True, train=True))
