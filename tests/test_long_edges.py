"""The edges of the long-context surfaces (`study lengths`, `bench long`, `--confirm-of`, `--confirm-seeds`,
`--compile`) and the typed Python options: each unclear input is one error naming the option, field or file, before
any training or timing; where an input changes what was asked, one note says so. Each case is a row of
docs/reliability.md."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from prisme.bench import long as long_bench
from prisme.bench.harness import peak_memory
from prisme.bench.long import configs, memory_needed, state_bytes
from prisme.bench.long import main as bench_long
from prisme.config import PrismeConfig
from prisme.devices import check_fits
from prisme.io import check_output_file
from prisme.model.policy import Controller
from prisme.model.prisme import PrismeModel
from prisme.options import DecodeOptions, ExecutionOptions


# ---------------------------------------------------------------------------------------------- the Python API
@pytest.mark.parametrize("target", [-3.0, 0.0, 0.5])
def test_a_target_cost_below_the_backbones_is_refused(target):
    """A target below 1 (the backbone alone costs 1 per token) can never be met: refused naming target_cost."""
    with pytest.raises(ValueError, match=r"target_cost must be a finite number >= 1"):
        Controller(1, target_cost=target)
    assert Controller(1, target_cost=1.0).target_cost == 1.0  # control: the backbone's own cost is a target


def test_an_unknown_compile_mode_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"compile_mode.*bogus-mode"):
        ExecutionOptions(compile_mode="bogus-mode")
    assert ExecutionOptions(compile_mode="reduce-overhead").compile_mode == "reduce-overhead"  # control


def test_a_bank_key_without_a_workspace_is_refused():
    with pytest.raises(ValueError, match=r"bank_key='preceding' configures the workspace's bank, but use_workspace"):
        PrismeConfig.from_name("tiny", bank_key="preceding", use_workspace=False)
    assert not PrismeConfig.from_name("tiny", use_workspace=False).use_workspace  # control: the default key is fine
    assert PrismeConfig.from_name("tiny", bank_key="preceding").bank_key == "preceding"


def test_fill_synthetic_names_a_generator_of_the_wrong_type():
    model = PrismeModel(PrismeConfig.from_name("tiny")).eval()
    state = model.new_decode_state(1)
    with pytest.raises(ValueError, match=r"generator must be a torch.Generator or None, got str"):
        state.fill_synthetic(4, generator="seed")
    state.fill_synthetic(4, generator=torch.Generator().manual_seed(0))  # control: a generator fills
    assert state.lengths == [4]


# --------------------------------------------------------------------------------------------------- bench long
def _long(tmp_path, **kw) -> argparse.Namespace:
    base = dict(shapes="d64_L2", contexts="128", batches="1", steps=4, repeats=1, edit_rate=0.2,
                bank_source="embedding", prefill=False, prefill_repeats=1, train=False, train_positions=16,
                train_repeats=1, threads=1, seed=0, json=str(tmp_path / "long.json"), device="cpu")
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("over, named", [
    (dict(contexts="200,200"), r"--contexts '200,200' lists 200 twice"),
    (dict(batches="3,3"), r"--batches '3,3' lists 3 twice"),
    (dict(contexts="5", steps=1), r"--contexts 5 is too short: PRISME's backbone attends over a 64-position window"),
    (dict(device="tpu"), r"--device tpu: a benchmark runs on cpu or cuda\[:N\]"),
    (dict(device="meta"), r"--device meta: a benchmark runs on cpu or cuda"),
    (dict(device="mps"), r"--device mps: a benchmark runs on cpu or cuda"),
])
def test_bench_long_names_the_option_before_any_timing(tmp_path, over, named):
    with pytest.raises(ValueError, match=named):
        bench_long(_long(tmp_path, **over))
    assert not (tmp_path / "long.json").exists()


def test_bench_long_refuses_a_case_that_cannot_fit_naming_the_figure(tmp_path, monkeypatch):
    """The estimate is the states' exact bytes (two small states give the line) and the cases' temporaries: the
    d512_L2, batch 64, T = 65,536 case of the report needs about 68 GB of dense K/V; refused before any model is
    built at that size, naming the options; a case that fits runs (control)."""
    decode = DecodeOptions(bank_tables=True, bank_store="ids")
    need = memory_needed("d512_L2", 65536, 64, "embedding", decode, False, False)
    dense_kv = 2 * 2 * 2 * 64 * 65536 * 512 * 4  # dense and dense_ks: 2 layers of K and V, batch 64, d 512, float32
    assert dense_kv <= need <= 1.15 * dense_kv  # and the fill's one [B, T, d] temporary
    cfgs = configs("d64_L2", 300, "embedding")  # the line is exact: a state built at that size holds those bytes
    for k, c in cfgs.items():
        assert state_bytes(c, 300, 3, decode if k == "prisme" else None) == \
            PrismeModel(c, decode if k == "prisme" else None).new_decode_state(3).nbytes
    monkeypatch.setattr(long_bench, "check_fits",
                        lambda need, what, advice, device: check_fits(need, what, advice, device, available=2**30))
    with pytest.raises(ValueError, match=r"bench long d512_L2 at T = 65,536, batch 64 needs about 72\.\d GiB, more "
                                         r"than the 1\.0 GiB this machine has free: pass shorter --contexts"):
        bench_long(_long(tmp_path, shapes="d512_L2", contexts="65536", batches="64"))
    assert bench_long(_long(tmp_path)) == 0  # control: 128 positions fit in 1 GiB


def test_bench_long_notes_an_edit_rate_that_rounds_to_no_position(tmp_path, capfd):
    assert bench_long(_long(tmp_path, edit_rate=1e-9)) == 0
    err = capfd.readouterr().err
    assert "--edit-rate 1e-09 of the 4 timed positions at batch 1 rounds to none; the routed path fires at 1" in err
    doc = json.loads((tmp_path / "long.json").read_text())
    assert doc["results"][0]["fired_positions"] == 1
    assert bench_long(_long(tmp_path, edit_rate=0.5)) == 0  # control: no note where the rate picks positions
    assert "rounds to none" not in capfd.readouterr().err


def test_bench_long_writes_no_profiler_noise_and_its_peak_counts_every_free(tmp_path, capfd):
    """stderr holds nothing of the profiler's (its start/stop lines, the CPU allocator's warning about frees it cannot
    count); each path's peak is at least its state and the steps' logits."""
    assert bench_long(_long(tmp_path)) == 0
    err = capfd.readouterr().err
    assert "profiler_st" not in err and "allocated before the profiling started" not in err
    rows = json.loads((tmp_path / "long.json").read_text())["results"][0]["rows"]
    assert all(r["peak_bytes"] >= r["state_bytes"] + 256 * 4 for r in rows.values())


def test_peak_memory_refuses_a_run_that_frees_what_was_allocated_before_it():
    """A run that frees a 4 MiB tensor made before the profile, then makes a 4 MiB one, holds 4 MiB at most beyond
    what it started with, but the profiler cannot see the free: the sum would read 4 MiB high. It is an error; freeing
    it in `setup` gives the exact figure."""
    n = 2**20
    held = [torch.ones(n)]

    def run():
        held.clear()
        return torch.ones(n)

    with pytest.raises(RuntimeError, match="freed memory allocated before it"):
        peak_memory(run, torch.device("cpu"))
    held.append(torch.ones(n))
    assert peak_memory(run, torch.device("cpu"), setup=held.clear) == 4 * n


def test_an_output_file_the_filesystem_refuses_is_named_before_the_work(tmp_path):
    if not Path("/proc/version").exists():
        pytest.skip("needs /proc")
    with pytest.raises(ValueError, match=r"--json /proc/version: cannot write a file in /proc"):
        check_output_file("/proc/version", "--json")
    check_output_file(str(tmp_path / "x.json"), "--json")  # control
