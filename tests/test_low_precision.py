"""bf16 and fp16 on the CPU: autocast and half-precision weights through ragged prefill and decoding, sampling, and
the training stages. Low precision is compared with float32 on the same weights at stated tolerances (bf16 keeps 8
bits of mantissa, fp16 11); what must be exact is exact (the sampled token given the same float32 distribution)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prisme.config import PrismeConfig
from prisme.decoding.generate import generate
from prisme.decoding.sampling import Sampling, sample_logits
from prisme.model.policy import Controller
from prisme.model.prisme import PrismeModel
from prisme.training.config import StageConfig
from prisme.training.trainer import train_stage

PROMPTS = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]])  # row 1 is 3 tokens long (ragged)
LENGTHS = [6, 3]
# max |logit - fp32 logit| on the tiny preset (logits below 1 in magnitude): measured 2.1e-3 (bf16, autocast and
# weights alike) and 2.3e-4 (fp16); the tolerances leave about 5x
LOGIT_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3}


def model() -> PrismeModel:
    torch.manual_seed(0)
    return PrismeModel(PrismeConfig.from_name("tiny").replace(router=True)).eval()


def ragged_logits(m: PrismeModel, steps: int = 3) -> torch.Tensor:
    """Logits `[B, 1 + steps, V]` in float32: a ragged prefill at budget 2, then `steps` decode steps."""
    st = m.new_decode_state(2, max_len=16, bank=True)
    outs = [st.prefill(PROMPTS, LENGTHS, logits="last", policy=Controller(max_budget=2)).logits.float()]
    for s in range(steps):
        outs.append(st.decode_step(torch.tensor([[10 + s], [20 + s]]), policy=Controller(max_budget=2)).logits.float())
    return torch.cat(outs, 1)


def test_ragged_decoding_under_bf16_autocast_is_close_to_float32():
    """The ragged cache write used to fail under autocast ("Index put requires the source and destination dtypes
    match"): the projections are bf16, the cache float32."""
    m = model()
    ref = ragged_logits(m)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = ragged_logits(m)
    assert torch.isfinite(low).all()
    diff = float((low - ref).abs().max())
    assert 0 < diff <= LOGIT_TOL[torch.bfloat16], diff  # > 0: autocast did run in bf16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_weights_decode_ragged_rows_close_to_float32(dtype):
    m = model()
    ref = ragged_logits(m)
    low = ragged_logits(model().to(dtype))
    assert torch.isfinite(low).all()
    assert 0 < float((low - ref).abs().max()) <= LOGIT_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_generate_with_top_p_on_half_precision_weights(dtype):
    out = generate(model().to(dtype), [[1, 2, 3, 4], [5, 6]], 5, policy=Controller(max_budget=2),
                   sampling=Sampling(temperature=0.8, top_p=0.9, seed=1))
    assert [len(t) for t in out.tokens] == [5, 5] and all(0 <= t < 64 for row in out.tokens for t in row)


def _sample_in_own_dtype(logits, temperature, top_p, generator):
    """The behaviour before: the nucleus computed in the logits' dtype (the negative control)."""
    logits = logits / temperature
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = probs.cumsum(-1) - probs >= top_p
    logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(torch.softmax(logits, dim=-1).float(), 1, generator=generator).squeeze(-1)


def test_sampling_from_bf16_logits_runs_in_float32():
    """Top-p over a 32k vocabulary: bf16 logits sample exactly as their float32 values do (the nucleus is computed
    in float32); computing it in bf16 keeps another set of tokens and draws other samples."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 32000, generator=g) * 2).to(torch.bfloat16)
    ours = [sample_logits(logits, 1.0, None, 0.9, torch.Generator().manual_seed(s)) for s in range(50)]
    exact = [sample_logits(logits.float(), 1.0, None, 0.9, torch.Generator().manual_seed(s)) for s in range(50)]
    assert all(torch.equal(a, b) for a, b in zip(ours, exact))
    old = [_sample_in_own_dtype(logits, 1.0, 0.9, torch.Generator().manual_seed(s)) for s in range(50)]
    assert not all(torch.equal(a, b) for a, b in zip(old, exact))  # the negative control differs


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory) -> dict[str, object]:
    """The four stages, 3 steps each, under bf16 autocast (`dtype="bfloat16"`)."""
    root: Path = tmp_path_factory.mktemp("bf16")
    mqar = dict(vocab_size=64, seq_len=16, n_pairs=2, query_min_pos=4)
    res, prev = {}, None
    for stage, kw in (("backbone", {}), ("workspace", {}), ("controller", {}), ("router", dict(max_budget=1))):
        scfg = StageConfig(**{**dict(stage=stage, steps=3, batch_size=4, seq_len=16, out_dir=str(root / stage),
                                     init_from=None if prev is None else str(prev), dataset="mqar", mqar=mqar,
                                     progress=False, eval_every=3, eval_batches=1, oracle_positions=4,
                                     max_budget=2, dtype="bfloat16"), **kw})
        res[stage] = train_stage(PrismeConfig.from_name("tiny").replace(router=True) if prev is None else None, scfg)
        prev = root / stage
    return res


@pytest.mark.parametrize("stage", ["backbone", "workspace", "controller", "router"])
def test_every_stage_trains_under_bf16_autocast_with_a_finite_loss(bf16_runs, stage):
    res = bf16_runs[stage]
    assert res.step == 3 and res.train and res.val, res
    values = [v for v in {**res.train, **res.val}.values() if isinstance(v, float)]
    assert "loss" in res.val and all(v == v and abs(v) != float("inf") for v in values), (res.train, res.val)


def test_rope_keeps_the_activations_dtype_under_autocast():
    """The float32 RoPE tables used to promote bf16 q and k to float32 (twice the attention's memory traffic)."""
    from prisme.model.attention import apply_rope, rope_tables

    cos, sin = (t.float()[:4, None] for t in rope_tables(8, 4, 10000.0))  # [4, 1, 8]
    x = torch.randn(2, 4, 3, 8).to(torch.bfloat16)
    assert apply_rope(x, cos, sin).dtype == torch.bfloat16
    assert (x * cos + x.roll(4, dims=-1) * sin).dtype == torch.float32  # the negative control: the old expression
    ref = apply_rope(x.float(), cos, sin)
    assert float((apply_rope(x, cos, sin).float() - ref).abs().max()) <= 0.05
