"""`prisme.devices` and the GPU-only paths that can be checked with stubs on a CPU-only machine: timers that read
CUDA events instead of synchronising inside the timed region, evaluation timings that wait for the device, TF32 as
an opt-in, pinned non-blocking uploads, studies spreading workers over GPUs, and compiled decoding's CUDA graphs
(their output cloned, since the next replay overwrites it)."""

from __future__ import annotations

import time

import pytest
import torch
from tiny_models import evaluate

from prisme import devices
from prisme.bench.workspace_paths import SplitTimer
from prisme.config import PrismeConfig
from prisme.data.mqar import MQARConfig, MQARDataset
from prisme.model import compiled
from prisme.model.prisme import PrismeModel


class FakeEvent:
    """A CUDA event stand-in: `record` notes the host clock; `elapsed_time` in ms, as CUDA's."""

    synced = 0

    def __init__(self, enable_timing: bool = False):
        self.t = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        FakeEvent.synced += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1e3


@pytest.fixture
def fake_cuda_events(monkeypatch):
    FakeEvent.synced = 0
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronize inside a timed region"))
    return FakeEvent


def test_a_stopwatch_on_cuda_reads_events_and_never_synchronises_the_device(fake_cuda_events):
    sw = devices.Stopwatch("cuda")
    sw.start()
    time.sleep(0.02)
    ms = sw.stop()
    assert 15 <= ms <= 500 and fake_cuda_events.synced == 1  # waits on its end event only, after the region
    cpu = devices.Stopwatch("cpu")  # control: the host clock on the CPU
    cpu.start()
    time.sleep(0.02)
    assert 15 <= cpu.stop() <= 500


def test_the_split_timer_on_cuda_reads_events_and_keeps_the_head_out_of_the_workspace(fake_cuda_events):
    """A workspace method that calls the head: with events (CUDA) as with the host clock (CPU), the head's 30 ms go
    to `head` and only the method's own 20 ms to `workspace_modules`; nothing synchronises inside the calls."""

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Module()
            self.backbone.streams = lambda *a: time.sleep(0.01)
            self.backbone.head = lambda *a: time.sleep(0.03)
            self.w = torch.nn.Parameter(torch.zeros(1))

        def logits_from_state(self):
            time.sleep(0.02)
            return self.backbone.head()

    for cuda in (True, False):
        m = Tiny()
        with SplitTimer([m]) as st:
            st._cuda = cuda
            st.reset()
            m.backbone.streams()
            m.logits_from_state()
            ns = st.ns
        assert 25e6 <= ns["head"] <= 200e6 and 15e6 <= ns["workspace_modules"] <= 28e6, (cuda, ns)
        assert 5e6 <= ns["backbone"] <= 100e6


def test_evaluation_timings_wait_for_the_models_device(monkeypatch):
    from prisme.evaluation import run as eval_run

    seen = []
    monkeypatch.setattr(eval_run, "synchronize", lambda d: seen.append(torch.device(d)))
    torch.manual_seed(0)
    model = PrismeModel(PrismeConfig.from_name("tiny")).eval()
    data = MQARDataset(MQARConfig(vocab_size=64, seq_len=16, n_pairs=2, query_min_pos=4))
    evaluate(model, data, ["backbone", "fixed"], batch_size=4, max_batches=1, budgets=[1],
                               bootstrap_samples=20)
    assert seen and set(seen) == {torch.device("cpu")}  # every clock read synchronised the model's device first


def test_tf32_is_an_explicit_opt_in():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        devices.set_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        devices.set_tf32(False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        with pytest.raises(ValueError, match="tf32"):
            devices.set_tf32(1)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    from prisme.training.config import StageConfig

    assert StageConfig(stage="backbone").tf32 is False  # off unless asked (`prisme train --tf32`)


def test_uploads_to_cuda_are_pinned_and_non_blocking(monkeypatch):
    calls = []
    t = torch.arange(4)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(("to", a, k)) or real_to(self, "cpu"))
    devices.upload(t, torch.device("cuda", 1))
    assert calls == ["pin", ("to", (torch.device("cuda", 1),), {"non_blocking": True})]
    calls.clear()
    devices.upload(t, torch.device("cpu"))  # control: a plain copy elsewhere
    assert calls == [("to", (torch.device("cpu"),), {})]


def test_study_workers_spread_over_several_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert [devices.spread(i) for i in range(5)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:0", "cuda:1"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert devices.spread(3) == "auto"  # one GPU (or none): the stage's own device


def test_compiled_decoding_uses_cuda_graphs_on_cuda_and_clones_their_output():
    assert compiled.step_mode(compiled.DEFAULT_MODE, torch.device("cuda")) == compiled.CUDA_MODE
    assert compiled.step_mode(compiled.DEFAULT_MODE, torch.device("cpu")) == compiled.DEFAULT_MODE
    assert compiled.step_mode("default", torch.device("cuda")) == "default"  # an explicit mode is kept
    assert compiled.uses_cuda_graphs(compiled.CUDA_MODE) and not compiled.uses_cuda_graphs(compiled.DEFAULT_MODE)
    # a step whose output buffer is reused by the next call, as a CUDA graph's is
    model = PrismeModel(PrismeConfig.from_name("tiny")).eval()
    dec = compiled.compile_decode(model.backbone, 1, 8, mode=None, prefill_mode=None)
    out_buffer = torch.zeros(1, 64)

    def replay(tokens, pos, kv):
        out_buffer.fill_(float(tokens[0, 0]))
        return out_buffer

    dec._step = replay
    dec.prefill(torch.tensor([[1, 2]]))
    dec.mode = compiled.CUDA_MODE
    a, b = dec.step(torch.tensor([[3]])), dec.step(torch.tensor([[4]]))
    assert float(a[0, 0]) == 3 and float(b[0, 0]) == 4  # the first result survived the second replay
    dec.mode = None  # control: without the clone the first result is overwritten
    dec.reset()
    dec.prefill(torch.tensor([[1, 2]]))
    a, b = dec.step(torch.tensor([[3]])), dec.step(torch.tensor([[4]]))
    assert float(a[0, 0]) == 4
