"""`prisme bench train`: FLOP accounting, the machine measurements (matmul peak, read bandwidth), the training step and
the report, on tiny sizes (timings are only checked for consistency, never against a speed)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from prisme.bench import harness
from prisme.bench import train as bench_train
from prisme.bench import train_stages as train_stages
from prisme.cli import main as cli_main
from prisme.config import PrismeConfig
from prisme.training import compute

PRESETS = pytest.mark.parametrize("preset", ["tiny", "seed001"])  # llama (GQA, SwiGLU, tied), gpt2 (MHA, GELU, untied)


def counted_flops(cfg: PrismeConfig, batch: int, seq_len: int) -> int:
    """FLOPs torch's FlopCounterMode sees in one forward with the head on every position (matmuls only on CPU)."""
    model = harness.build_model(cfg, seed=0)
    x = harness.make_tokens(cfg.vocab_size, batch, seq_len, seed=0)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.head(model(x))
    return counter.get_total_flops()


@PRESETS
def test_forward_flops_matmul_and_head_equal_torch_flop_counter(preset):
    """forward_flops' matmul + head terms equal FlopCounterMode's count of the real forward, exactly."""
    cfg = PrismeConfig.from_name(preset)
    f = bench_train.forward_flops(cfg, batch=2, seq_len=12)
    assert f.matmul + f.head == counted_flops(cfg, 2, 12)
    assert f.total == f.matmul + f.attention + f.head


def test_flop_check_catches_a_missized_projection():
    """Negative control: the same comparison with the kv heads miscounted (MHA instead of GQA) fails."""
    cfg = PrismeConfig.from_name("tiny")
    assert cfg.n_kv_head != cfg.n_head
    wrong = bench_train.forward_flops(cfg.replace(n_kv_head=cfg.n_head), batch=2, seq_len=12)
    assert wrong.matmul + wrong.head != counted_flops(cfg, 2, 12)


def test_attention_flops_count_the_causal_half():
    """Attention FLOPs = 2 x 2 x B x L x nh x hd x sum_{i<T} (i + 1): each query sees only itself and earlier keys."""
    cfg = PrismeConfig.from_name("tiny")
    B, T = 3, 10
    keys_seen = sum(i + 1 for i in range(T))
    expected = 4 * B * cfg.n_layer * cfg.n_head * cfg.head_dim * keys_seen
    assert bench_train.forward_flops(cfg, B, T).attention == expected
    assert expected < 4 * B * cfg.n_layer * cfg.n_head * cfg.head_dim * T * T  # the full square would be larger


def test_head_positions_and_training_step_flops():
    """The head term scales with the positions scored, and a training step is 3 forward passes over all positions."""
    cfg = PrismeConfig.from_name("demo")
    all_pos, last = bench_train.forward_flops(cfg, 4, 32), bench_train.forward_flops(cfg, 4, 32, head_positions=1)
    assert all_pos.head == 32 * last.head == 2 * 4 * 32 * cfg.d_model * cfg.vocab_size
    assert all_pos.matmul == last.matmul and all_pos.attention == last.attention
    assert bench_train.train_step_flops(cfg, 4, 32) == 3 * all_pos.total
    with pytest.raises(ValueError, match="batch"):
        bench_train.forward_flops(cfg, 0, 32)


def test_matmul_peak_is_the_best_size_at_2n3_over_p50():
    """MatmulPeak: GFLOP/s = 2 n^3 / p50 per size, the peak is the best of them; non-matmul samples are ignored."""
    samples = {"matmul_100": [1.0, 2.0, 3.0], "matmul_200": [5.0, 10.0, 15.0], "train_step": [5.0]}
    peak = bench_train.MatmulPeak.from_samples(samples)
    assert peak.gflops == pytest.approx({"matmul_100": 2e6 / 2.0 / 1e6, "matmul_200": 16e6 / 10.0 / 1e6})
    assert (peak.peak_size, peak.peak_gflops) == (200, pytest.approx(1.6))
    with pytest.raises(ValueError, match="matmul"):
        bench_train.MatmulPeak.from_samples({"train_step": [1.0]})


def test_bandwidth_is_bytes_over_p50():
    """Bandwidth.from_samples: GB/s = bytes / p50 (1 GB = 1e9 bytes), p50 <= p95."""
    bw = bench_train.Bandwidth.from_samples(2_000_000_000, [100.0, 200.0, 300.0])
    assert bw.p50_ms == 200.0 and bw.p95_ms >= bw.p50_ms
    assert bw.gb_per_s == pytest.approx(10.0)


def test_stream_read_path_reads_every_element():
    """The stream-read path's run sums a buffer of ones: the result counts every fp32 element of `nbytes`."""
    name, setup, run = bench_train.stream_read_path(4096)
    assert name == "stream_read" and float(run(setup())) == 1024.0
    assert float(bench_train.stream_read_path(4096, reads=3)[2](None)) == 1024.0
    bw = bench_train.stream_read_bandwidth(4096, warmups=0, repeats=2)
    assert bw.nbytes == 4096 and len(bw.samples_ms) == 2 and bw.gb_per_s > 0
    for bad in ({"nbytes": 2}, {"nbytes": 4096, "reads": 0}):
        with pytest.raises(ValueError):
            bench_train.stream_read_path(**bad)


def test_matmul_paths_compute_the_product():
    """Each matmul path multiplies two n x n matrices (checked against torch.mm on its own inputs' shape)."""
    (name, setup, run), = bench_train.matmul_paths([8])
    out = run(setup())
    assert name == "matmul_8" and out.shape == (8, 8)
    with pytest.raises(ValueError):
        bench_train.matmul_paths([])


def test_train_throughput_trains_and_reports_consistent_figures(tiny_cfg):
    """On tiny: the loss falls over the timed steps (same batch), and tokens/s, GFLOP/s, fraction of peak agree."""
    row = bench_train.train_throughput(tiny_cfg, 2, 16, bench_train.TrainBenchOptions(warmups=1, repeats=3),
                                       matmul_sizes=(16, 32), lr=3e-3)
    assert len(row.losses) == 4 and row.losses[-1] < row.losses[0] - 1e-3
    assert set(row.samples_ms) == {"train_step", "matmul_16", "matmul_32"}
    assert len(row.samples_ms["train_step"]) == 3
    assert row.tokens_per_step == 32 and row.flops_per_step == bench_train.train_step_flops(tiny_cfg, 2, 16)
    assert row.tokens_per_s == pytest.approx(32 / row.step_p50_ms * 1e3)
    assert row.achieved_gflops == pytest.approx(row.flops_per_step / row.step_p50_ms / 1e6)
    assert row.fraction_of_peak == pytest.approx(row.achieved_gflops / row.matmul_peak_gflops)


def test_train_throughput_with_zero_lr_does_not_train(tiny_cfg):
    """Negative control for 'the steps really train': with lr = 0 the loss on the fixed batch stays put."""
    row = bench_train.train_throughput(tiny_cfg, 2, 16, bench_train.TrainBenchOptions(warmups=1, repeats=2),
                                       matmul_sizes=(16,), lr=0.0)
    assert max(row.losses) - min(row.losses) < 1e-6


def test_train_throughput_rejects_a_sequence_past_t_max(tiny_cfg):
    """seq_len must leave room for the next-token target inside T_max."""
    with pytest.raises(ValueError, match="T_max"):
        bench_train.train_throughput(tiny_cfg, 1, tiny_cfg.max_seq_len, bench_train.TrainBenchOptions())


@pytest.fixture
def small_machine(monkeypatch):
    """Shrink the machine measurements so the whole report runs in a second."""
    monkeypatch.setattr(bench_train, "MATMUL_SIZES", (16, 32, 48))
    monkeypatch.setattr(bench_train, "BANDWIDTH_BYTES", 1 << 16)
    monkeypatch.setattr(bench_train, "TRAIN_SHAPES", {"tiny": (2, 16)})


def test_run_train_document_layout(small_machine):
    """run_train's JSON document: environment, bandwidth, one row per preset, checks passed; table renders."""
    options = bench_train.TrainBenchOptions(warmups=0, repeats=2, threads=1, quick=True)
    doc = json.loads(json.dumps(bench_train.run_train(("tiny",), options)))
    assert set(doc) == {"scope", "environment", "models", "protocol", "bandwidth", "train", "targets", "checks",
                        "stages", "stage_protocol"}
    assert doc["environment"]["threads"] == 1 and doc["checks"]["passed"] is True
    (row,) = doc["train"]
    assert row["preset"] == "tiny" and row["batch"] == 1 and row["seq_len"] == 16  # quick: a quarter of batch 2
    assert set(row["samples_ms"]) == {"train_step", "matmul_16", "matmul_32"}  # quick: two matmul sizes
    assert doc["targets"] == []  # the 50% target applies to the ~100M shape only
    text = bench_train.format_train_table(doc)
    assert "tiny" in text and "of peak" in text


def test_run_train_rejects_an_unknown_preset_before_timing():
    """An unknown preset is a ValueError naming it."""
    with pytest.raises(ValueError, match="nope"):
        bench_train.run_train(("nope",))


def test_cli_bench_train_prints_json_last_and_writes_the_file(small_machine, capsys, tmp_path):
    """`prisme bench train` returns 0, ends stdout with the JSON document and writes the same to --json."""
    path = tmp_path / "train.json"
    rc = cli_main(["bench", "train", "--presets", "tiny", "--repeats", "1", "--warmups", "0", "--threads", "1",
                   "--json", str(path)])
    out = capsys.readouterr().out
    lines = out.rstrip().splitlines()
    doc = json.loads("\n".join(lines[max(i for i, line in enumerate(lines) if line == "{"):]))
    assert rc == 0 and doc == json.loads(path.read_text())
    assert cli_main(["bench", "train", "--presets", ",", "--threads", "1"]) == 2


# ------------------------------------------------------------------------------ workspace and controller stages
def _counted_step(cfg: PrismeConfig, stage: str) -> tuple[int, dict]:
    """FlopCounterMode's matmul FLOPs of one real stage step (forward and backward; its CPU attention kernels count
    0), and the step's info (its sampled traces)."""
    path, info = bench_train.stage_paths(cfg, stage, seed=1, batch=2, seq_len=16)
    with FlopCounterMode(display=False) as fc:
        path[2](None)
    return fc.get_total_flops(), info


def _analytic(cfg: PrismeConfig, stage: str, info: dict) -> float:
    ex = info["extras"][-1]
    if stage == "workspace":
        return compute.workspace_stage_step(cfg, ex, info["y"], info["scfg"].deep_supervision)
    return compute.controller_stage_step(cfg, info["objective"], ex, info["y"])


@pytest.mark.parametrize("stage,fault", [("workspace", ("TRAINED", 1)), ("controller", ("NO_GRAD", 0))])
def test_stage_training_ops_bracket_the_counted_matmuls_of_a_real_step(stage, fault):
    """The analytic training ops of a step (its own traces; x3 trained, x2 gradient through, x1 no gradient) lie
    just above torch's count of the step's matmul FLOPs, forward and backward, which misses only the attention
    kernels: within [counted, counted / 0.75]. Negative controls: pricing stage 2's trained workspace x1 instead of x3,
    or leaving out stage 3's no-gradient oracle work (its candidate edits), falls below the count."""
    cfg = PrismeConfig.from_name("tiny")
    counted, info = _counted_step(cfg, stage)
    analytic = _analytic(cfg, stage, info)
    assert counted <= analytic <= counted / 0.75, (counted, analytic)
    mp = pytest.MonkeyPatch()
    mp.setattr(compute, *fault)
    try:
        assert _analytic(cfg, stage, info) < counted
    finally:
        mp.undo()


def test_bench_train_stage_rows_and_their_json(capsys):
    doc = bench_train.run_train(("tiny",), bench_train.TrainBenchOptions(warmups=1, repeats=2, threads=1, quick=True,
                                                                         stages=("workspace", "controller")))
    rows = {r["stage"]: r for r in doc["stages"]}
    assert set(rows) == {"workspace", "controller"}
    train = doc["train"][0]
    for r in rows.values():  # the denominator: the backbone stage's step timed in the stage's own rotation
        bb = train["batch"] * train["seq_len"] / harness.percentiles(r["backbone_samples_ms"])[0] * 1e3
        assert len(r["backbone_samples_ms"]) == len(r["samples_ms"]) == 2
        assert r["analytic_training_ops_ratio"] > 1 and r["backbone_tokens_per_s"] == pytest.approx(bb, rel=1e-12)
        assert r["time_ratio"] == pytest.approx(bb / r["tokens_per_s"])
        assert r["met"] == (r["tokens_per_s"] >= bb / (bench_train.STAGE_TARGET * r["analytic_training_ops_ratio"]))
        assert len(r["losses"]) == 3 and all(math.isfinite(v) for v in r["losses"])
    assert "x 3 for what is trained" in doc["stage_protocol"]["ops"] and "rotated" in doc["stage_protocol"]["timing"]
    assert any("workspace stage" in t["name"] for t in doc["targets"])
    with pytest.raises(ValueError, match="unknown stage"):
        bench_train.run_train(("tiny",), bench_train.TrainBenchOptions(stages=("decoder",)))
    table = bench_train.format_train_table(doc)
    assert "controller" in table and "ops x bb" in table
