"""`prisme bench kv`: the harness, the protocol's functions on tiny settings, the JSON document and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from prisme.bench import harness, kv
from prisme.cli import main as cli_main
from prisme.config import PrismeConfig

DOC_KEYS = {"scope", "environment", "model", "protocol", "correctness", "position_errors_fp32_batch2_chunk1",
            "negative_controls", "checks", "timings", "memory"}  # "reference" only with --seed001
ENV_KEYS = {"python", "torch", "numpy", "device", "dtype", "threads", "platform", "cpu", "logical_cpus",
            "executed_at_utc", "seed"}
TIMING_KEYS = {"prompt_tokens", "appended_tokens", "cache_payload_bytes", "samples_ms", "prefill_p50_ms",
               "prefill_p95_ms", "full_p50_ms", "full_p95_ms", "cached_p50_ms", "cached_p95_ms",
               "full_ms_per_token_p50", "cached_ms_per_token_p50", "cached_speedup_vs_full"}


def last_json_block(stdout: str) -> dict:
    """The JSON document that ends stdout: from the last line that is exactly '{' to the end."""
    lines = stdout.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    return json.loads("\n".join(lines[start:]))


@pytest.fixture(scope="module")
def tiny_doc() -> dict:
    """run_kv on the tiny preset with a small protocol (computed once for the module)."""
    return kv.run_kv("tiny", kv.KVBenchOptions(prompts=(4, 8), new_tokens=3, warmups=1, repeats=2, seq_len=12))


def test_correctness_rows_are_exact_on_tiny_settings(tiny_cfg):
    """kv_correctness covers dtype x batch x chunk with float64 errors <= 1e-12 and float32 <= 1e-5."""
    rows = kv.kv_correctness(tiny_cfg, seq_len=12, seed=3)
    assert [(r.dtype, r.batch, r.chunk) for r in rows] == [
        (str(d), b, c) for d in (torch.float32, torch.float64) for b in (1, 2) for c in (1, 2, 5)]
    for r in rows:
        assert r.max_abs_logit_error <= kv.TOLERANCE[getattr(torch, r.dtype.removeprefix("torch."))], r


def test_position_errors_cover_every_position(tiny_cfg):
    """kv_position_errors returns one small float32 error per position of the sequence."""
    errs = kv.kv_position_errors(tiny_cfg, seq_len=12)
    assert len(errs) == 12
    assert all(0 <= e <= 1e-5 for e in errs)


def test_negative_controls_are_large(tiny_cfg):
    """Both deliberately broken caches give errors >= 1e-2 (the check can fail)."""
    neg = kv.kv_negative_controls(tiny_cfg, seq_len=12)
    assert set(neg) == {"reset_positions", "unshifted_mask"}
    assert min(neg.values()) >= kv.NEGATIVE_CONTROL_MIN, neg


def test_kv_timing_reports_samples_percentiles_and_per_token_figures(tiny_cfg):
    """kv_timing gives `repeats` positive samples per path, p50 <= p95, ms/token = p50 / tokens, ratio = full/cached."""
    model = harness.build_model(tiny_cfg, seed=0)
    (row,) = kv.kv_timing(model, prompts=[6], new_tokens=3, warmups=1, repeats=3)
    assert set(row.samples_ms) == {"prefill", "full", "cached"}
    assert all(len(s) == 3 and min(s) > 0 for s in row.samples_ms.values())
    for path in ("prefill", "full", "cached"):
        assert getattr(row, f"{path}_p50_ms") <= getattr(row, f"{path}_p95_ms")
    assert row.cached_ms_per_token_p50 == pytest.approx(row.cached_p50_ms / 3)
    assert row.full_ms_per_token_p50 == pytest.approx(row.full_p50_ms / 3)
    assert row.cached_speedup_vs_full == pytest.approx(row.full_p50_ms / row.cached_p50_ms)
    assert row.full_projected_positions_per_layer == 7 + 8 + 9
    cfg = tiny_cfg
    assert row.cache_payload_bytes == cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * 4 * 9


def test_time_paths_rotates_the_order_and_skips_warmups():
    """time_paths runs warmups untimed, rotates the path order each repeat, and keeps `repeats` samples per path."""
    order = []
    paths = [(n, lambda: None, lambda _, n=n: order.append(n)) for n in "abc"]
    samples = harness.time_paths(paths, warmups=1, repeats=3)
    assert "".join(order) == "abc" + "bca" + "cab" + "abc"
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3, "c": 3}
    with pytest.raises(ValueError):
        harness.time_paths(paths, warmups=0, repeats=0)


def test_percentiles_reproduce_seed001_p50_and_p95_from_its_samples():
    """percentiles() gives exactly seed 001's p50/p95 from its own raw samples (numpy's linear interpolation)."""
    reference = kv.load_seed001()
    for row in reference["timings"]:
        for path in ("prefill", "full", "cached"):
            p50, p95 = harness.percentiles(row["samples_ms"][path])
            assert (p50, p95) == (row[f"{path}_p50_ms"], row[f"{path}_p95_ms"]), (row["prompt_tokens"], path)


def test_seed001_memory_matches_the_seed_report():
    """seed001's K/V payload at 16 + 16 and 256 + 16 tokens is seed 001's 32,768 and 278,528 bytes (1,024 a token)."""
    model = harness.build_model(PrismeConfig.from_name("seed001"), seed=0)
    assert kv.kv_payload_bytes(model, 16 + 16) == 32_768
    assert kv.kv_payload_bytes(model, 256 + 16) == 278_528
    (row,) = kv.kv_memory(model, prompts=[4], new_tokens=2)
    assert row.bytes_per_token == 1024 and row.cache_allocated_bytes == row.kv_payload_bytes == 6 * 1024
    assert set(row.python_tracemalloc_peak_bytes) == {"prefill", "full", "cached"}


def test_run_kv_document_has_the_documented_layout(tiny_doc):
    """run_kv's document has seed 001's sections plus checks and memory, passes its checks, and survives JSON."""
    doc = json.loads(json.dumps(tiny_doc))
    assert set(doc) == DOC_KEYS
    assert set(doc["environment"]) == ENV_KEYS
    assert doc["model"]["parameters"] > 0 and doc["model"]["preset"] == "tiny"
    assert doc["protocol"]["timer"] == "perf_counter_ns" and doc["protocol"]["repeats"] == 2
    assert len(doc["correctness"]) == 12
    assert max(r["max_abs_logit_error"] for r in doc["correctness"] if r["dtype"] == "torch.float64") <= 1e-12
    assert min(doc["negative_controls"].values()) >= 1e-2
    assert len(doc["position_errors_fp32_batch2_chunk1"]) == 12
    assert doc["checks"]["passed"] is True
    assert [t["prompt_tokens"] for t in doc["timings"]] == [4, 8]
    assert TIMING_KEYS <= set(doc["timings"][0])
    assert [m["prompt_tokens"] for m in doc["memory"]] == [4, 8]


def test_human_table_labels_seed001_figures_as_another_machine(tiny_doc):
    """The table shows the correctness grid, timings, and seed 001's figures marked 'measured on another machine'."""
    reference = kv.load_seed001()
    assert reference is not None and reference["model"]["parameters"] == 145_280
    text = kv.format_kv_table(tiny_doc, reference)
    assert "measured on another machine" in text
    assert "negative controls" in text and "torch.float64" in text
    plain = kv.format_kv_table(tiny_doc)  # without --seed001: this machine's figures alone
    assert "seed 001" not in plain and "another machine" not in plain and "negative controls" in plain


def test_write_json_atomic_leaves_only_the_final_file(tmp_path):
    """write_json_atomic writes parseable JSON and no temporary file stays behind."""
    path = tmp_path / "sub" / "kv.json"
    harness.write_json_atomic({"a": 1}, path)
    harness.write_json_atomic({"a": 2}, path)
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["kv.json"]


def test_run_kv_rejects_prompts_past_t_max():
    """A prompt plus continuation longer than the preset's T_max is a ValueError naming T_max."""
    with pytest.raises(ValueError, match="T_max"):
        kv.run_kv("tiny", kv.KVBenchOptions(prompts=(60,), new_tokens=16))


def test_cli_bench_kv_prints_json_last_and_writes_the_file(capsys, tmp_path):
    """`prisme bench kv` (in process) returns 0, ends stdout with the JSON document and writes the same to --json."""
    out = tmp_path / "kv.json"
    threads = torch.get_num_threads()
    rc = cli_main(["bench", "kv", "--preset", "tiny", "--prompts", "4,8", "--new-tokens", "2", "--repeats", "2",
                   "--warmups", "1", "--seq-len", "10", "--json", str(out)])
    assert rc == 0
    assert torch.get_num_threads() == threads  # --threads 1 is restored afterwards
    doc = last_json_block(capsys.readouterr().out)
    assert doc == json.loads(out.read_text())
    assert doc["checks"]["passed"] and doc["environment"]["threads"] == 1


def test_cli_bench_kv_subprocess_exits_zero_with_json_last():
    """`python -m prisme bench kv --prompts 8 --repeats 2 --warmups 1` exits 0 and its last stdout block is JSON."""
    proc = subprocess.run([sys.executable, "-m", "prisme", "bench", "kv", "--prompts", "8", "--repeats", "2",
                           "--warmups", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = last_json_block(proc.stdout)
    assert doc["model"]["parameters"] == 145_280
    assert doc["timings"][0]["prompt_tokens"] == 8


def test_cli_bench_kv_bad_prompts_is_a_clean_error(capsys):
    """Malformed --prompts gives exit code 2 and a one-line error, no traceback."""
    assert cli_main(["bench", "kv", "--prompts", "8,x"]) == 2
    assert "prompts" in capsys.readouterr().err


def test_a_path_may_time_itself_keep_its_output_and_run_with_autograd():
    """A run that returns `Timed(ms, value)` gives its own sample and keeps its value (`outputs`); `inference=False`
    runs with autograd on (a training step), the default under inference mode. Negative control: a plain return is
    timed by the stopwatch, never read as a sample."""
    from prisme.devices import Timed

    grads = []
    paths = [("own", lambda: None, lambda _: Timed(7.0, "v")),
             ("grad", lambda: None, lambda _: grads.append(torch.is_grad_enabled()) or 3.0)]
    outs: dict = {}
    samples = harness.time_paths(paths, warmups=1, repeats=2, inference=False, outputs=outs)
    assert samples["own"] == [7.0, 7.0] and outs == {"own": "v", "grad": 3.0}
    assert all(grads) and samples["grad"][0] < 7.0  # the stopwatch's time of a trivial run, not its 3.0
    grads.clear()
    harness.time_paths(paths, warmups=0, repeats=1)
    assert grads == [False]  # inference mode by default
