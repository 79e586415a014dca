"""`prisme bench vs-hf` and `prisme.model.compiled`: the fixed-shape decode step, every timed path's correctness check
with its negative controls, the floor arithmetic, the targets, the report and the CLI, on tiny sizes. Tests that run
torch.compile are marked slow (`pytest -m slow`)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_close

from prisme.bench import harness, kv
from prisme.bench import train as bench_train
from prisme.bench import vs_hf as bench_hf
from prisme.bench import vs_hf_report as hf_report
from prisme.cli import main as cli_main
from prisme.config import PrismeConfig
from prisme.interop import hf_available, to_hf
from prisme.model.backbone import Backbone
from prisme.model.compiled import compile_decode, decode_step, in_out_layout_, prefill_step

PRESETS = pytest.mark.parametrize("preset", ["tiny", "seed001"])  # llama (RoPE, GQA), gpt2 (learned positions)
needs_hf = pytest.mark.skipif(not hf_available(), reason="needs the optional transformers package (prisme[hf])")


def model(preset: str, dtype: torch.dtype = torch.float32) -> Backbone:
    """A seeded backbone with O(1)-scale weights (as tests/test_interop.py), so that position bugs move the logits:
    matrices ~ N(0, 1.2^2 / fan_in), gains ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2)."""
    bb = harness.build_model(PrismeConfig.from_name(preset), seed=0, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in bb.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
            p.copy_(noise * 1.2 / p.shape[-1] ** 0.5 if p.dim() >= 2 else 0.1 * noise + (not name.endswith("bias")))
    return bb


@torch.inference_mode()
def decoder_logits(bb: Backbone, tokens: torch.Tensor, prompt: int, **kw) -> torch.Tensor:
    """Prefill tokens[:, :prompt] into a CompiledDecoder, then step through the rest; logits `[B, T - P + 1, V]`."""
    dec = compile_decode(bb, tokens.shape[0], tokens.shape[1], **kw)
    out = [dec.prefill(tokens[:, :prompt])]
    out += [dec.step(tokens[:, t:t + 1]) for t in range(prompt, tokens.shape[1])]
    return torch.stack(out, dim=1)


@torch.inference_mode()
def full_logits(bb: Backbone, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    return bb.head(bb(tokens))[:, prompt - 1:]  # [B, T - prompt + 1, V]


# ------------------------------------------------------------------------------------------------ prisme.compile
@PRESETS
@pytest.mark.parametrize("prompt", [1, 5, 12])
def test_fixed_shape_decoder_equals_full_forward_in_float64(preset, prompt):
    """The fixed-shape prefill + step (the functions torch.compile compiles), run eagerly, equal the full forward."""
    bb = model(preset, torch.float64)
    x = harness.make_tokens(bb.cfg.vocab_size, 2, 20, seed=1)
    assert_close(decoder_logits(bb, x, prompt, mode=None, prefill_mode=None), full_logits(bb, x, prompt), 1e-12,
                 "fixed-shape decoder vs full forward")


@PRESETS
def test_fixed_shape_step_with_shifted_positions_is_caught(preset):
    """Negative control: the same step with every position one too far gives O(0.1) logit errors."""
    bb = model(preset, torch.float64)
    x = harness.make_tokens(bb.cfg.vocab_size, 2, 20, seed=1)
    with torch.inference_mode():
        dec = compile_decode(bb, 2, 21, mode=None, prefill_mode=None)
        dec.prefill(x[:, :8])
        out = torch.stack([decode_step(bb, x[:, t:t + 1], torch.tensor([t + 1]), dec.cache) for t in range(8, 20)], 1)
    assert (out - full_logits(bb, x, 9)).abs().max() > 1e-2  # steps score positions 8..19


def test_decoder_reset_reuses_the_cache():
    """After reset, a second prompt of another length decodes exactly as in a fresh decoder."""
    bb = model("tiny", torch.float64)
    x, y = (harness.make_tokens(bb.cfg.vocab_size, 2, 16, seed=s) for s in (1, 2))
    with torch.inference_mode():
        dec = compile_decode(bb, 2, 16, mode=None, prefill_mode=None)
        dec.prefill(x[:, :10])
        dec.step(x[:, 10:11])
        dec.reset()
        assert dec.length == 0
        out = torch.stack([dec.prefill(y[:, :4])] + [dec.step(y[:, t:t + 1]) for t in range(4, 16)], 1)
    assert_close(out, full_logits(bb, y, 4), 1e-12, "reused decoder")


def test_prefill_step_attends_within_the_prompt_only():
    """prefill_step over a prompt equals the uncached forward's last logits (no key past the prompt is read)."""
    bb = model("seed001", torch.float64)
    x = harness.make_tokens(bb.cfg.vocab_size, 3, 9, seed=4)
    with torch.inference_mode():
        cache = bb.new_cache(3, 32)
        cache.layers[0].k.fill_(1e3)  # garbage past the prompt must not matter
        assert_close(prefill_step(bb, x, cache), bb.head(bb(x))[:, -1], 1e-12, "prefill_step")


def test_decoder_rejects_bad_input_before_changing_state():
    """Wrong batch, a full decoder, a non-empty prefill, a [B, 2] step, bad ids: ValueError, lengths unchanged."""
    bb = model("tiny")
    dec = compile_decode(bb, 2, 6, mode=None, prefill_mode=None)
    x = harness.make_tokens(bb.cfg.vocab_size, 2, 6, seed=0)
    with torch.inference_mode():
        dec.prefill(x[:, :5])
        bad = [(dec.step, x[:1, :1], r"\[2, 1\]"), (dec.step, x[:, :2], r"\[2, 1\]"), (dec.prefill, x[:1, :1], "rows"),
               (dec.prefill, x[:, :1], "empty"),
               (dec.step, torch.full((2, 1), bb.cfg.vocab_size), "ids")]
        for fn, tokens, match in bad:
            with pytest.raises(ValueError, match=match):
                fn(tokens)
            assert dec.cache.lengths == [5, 5]
        dec.step(x[:, 5:6])
        with pytest.raises(ValueError, match="full"):
            dec.step(x[:, :1])
        assert dec.cache.lengths == [6, 6]
    with pytest.raises(ValueError, match="eval"):
        compile_decode(model("tiny").train(), 1)


@PRESETS
def test_in_out_layout_changes_strides_only(preset):
    """in_out_layout_: linear weights get (1, out) strides, lookup-only embeddings keep theirs, the state_dict values
    are bitwise unchanged and the logits (cached decode included) equal to float64 rounding (another GEMM order)."""
    bb, ref = model(preset, torch.float64), model(preset, torch.float64)
    stock = bb.blocks[0].attn.wqkv.weight
    assert stock.stride() == (stock.shape[1], 1)
    in_out_layout_(bb)
    w = bb.blocks[0].attn.wqkv.weight
    assert w.stride() == (1, w.shape[0]) and not w.is_contiguous()
    assert bb.tok_emb.weight.is_contiguous() == (bb.lm_head is not None)  # a tied head is re-laid out too
    assert all(torch.equal(a, b) for a, b in zip(bb.state_dict().values(), ref.state_dict().values()))
    x = harness.make_tokens(bb.cfg.vocab_size, 2, 16, seed=1)
    with torch.inference_mode():
        assert_close(bb.head(bb(x)), ref.head(ref(x)), 1e-12, "in_out layout, full forward")
        c1, c2 = bb.new_cache(2, 16), ref.new_cache(2, 16)
        assert_close(bb.head(bb.prefill(x, c1, 3)), ref.head(ref.prefill(x, c2, 3)), 1e-12, "in_out layout, cached")


def test_in_out_layout_check_catches_a_reinterpreted_buffer():
    """Negative control: a layout bug that reinterprets the transposed buffer as [out, in] changes the logits."""
    bb, ref = model("tiny", torch.float64), model("tiny", torch.float64)
    w = bb.blocks[0].mlp.w2.weight  # [d, h], not square
    with torch.no_grad():
        w.data = w.data.t().contiguous().view(w.shape)  # the bug: values scrambled, shape kept
    x = harness.make_tokens(bb.cfg.vocab_size, 2, 16, seed=1)
    with torch.inference_mode():
        assert (bb.head(bb(x)) - ref.head(ref(x))).abs().max() > 1e-2


@pytest.mark.slow
@PRESETS
def test_compiled_decoder_matches_full_forward_without_recompiling(preset):
    """max-autotune + freezing: compiled decode equals the full forward to float32 tolerance for several prompt
    lengths, with one graph for the step and one for every prompt length."""
    import torch._dynamo.utils as dynamo_utils

    bb = model(preset)
    x = harness.make_tokens(bb.cfg.vocab_size, 2, 24, seed=1)
    dynamo_utils.counters.clear()
    with torch.inference_mode():
        dec = compile_decode(bb, 2, 24, cpp_wrapper=preset == "seed001", math_attention=preset == "seed001")
        for prompt in (8, 5, 12):
            dec.reset()
            out = torch.stack([dec.prefill(x[:, :prompt])] + [dec.step(x[:, t:t + 1]) for t in range(prompt, 24)], 1)
            assert_close(out, full_logits(bb, x, prompt), kv.TOLERANCE[torch.float32], f"compiled P={prompt}")
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2


# ------------------------------------------------------------------------------------------------ bench vs-hf
@pytest.fixture(scope="module")
def pairs() -> dict[str, bench_hf.Pair]:
    """tiny (LlamaForCausalLM) and seed001 (GPT2LMHeadModel), O(1)-scale weights, with their HF copies."""
    return {p: bench_hf.Pair(bb, to_hf(bb), threads=1) for p, bb in ((p, model(p)) for p in ("tiny", "seed001"))}


@needs_hf
def test_build_pair_uses_the_issue_hf_classes():
    """build_pair: gpt2-style -> GPT2LMHeadModel, llama-style -> LlamaForCausalLM; ours stored [in, out]."""
    for preset, cls in (("seed001", "GPT2LMHeadModel"), ("tiny", "LlamaForCausalLM")):
        pair = bench_hf.build_pair(preset, seed=0, threads=1)
        assert type(pair.hf).__name__ == cls and pair.cfg.name == preset
        assert pair.backbone.blocks[0].mlp.w2.weight.stride()[0] == 1  # ours stored [in, out] by default
        assert all(p.is_contiguous() for p in pair.hf.parameters())


@needs_hf
@pytest.mark.parametrize("preset", ["tiny", "seed001"])
def test_interop_check_passes_and_its_control_is_caught_and_undone(pairs, preset):
    """HF logits equal ours to float32 tolerance; rolled head rows are caught; the HF weights are restored exactly."""
    pair = pairs[preset]
    before = {k: v.clone() for k, v in pair.hf.state_dict().items()}
    sb = bench_hf.ShapeBench(pair, None, seed=0)
    sb.check_interop(batch=2, seq_len=16)
    (check,), (control,) = sb.res.checks, sb.res.negative_controls
    assert check.passed and check.max_abs_logit_error <= bench_hf.TOL
    assert control.passed and control.max_abs_logit_error >= bench_hf.NEGATIVE_MIN
    assert all(torch.equal(before[k], v) for k, v in pair.hf.state_dict().items())


@needs_hf
@pytest.mark.parametrize("preset", ["tiny", "seed001"])
def test_every_decode_and_prefill_path_matches_and_controls_are_caught(pairs, preset):
    """hf_dynamic, hf_static, prisme and the fixed-shape decoder all match the full forward (decode and prefill);
    shifted HF positions and a shifted fixed-shape step are caught."""
    pair = pairs[preset]
    sb = bench_hf.ShapeBench(pair, None, seed=0)
    seq = harness.make_tokens(pair.cfg.vocab_size, 2, 12, seed=3)
    prompt, new = seq[:, :8], seq[:, 8:]
    dec = compile_decode(pair.backbone, 2, 12, mode=None, prefill_mode=None)
    sb.check_decode(bench_hf.decode_paths(pair, prompt, new, dec), prompt, new, negatives=True)
    sb.check_prefill(bench_hf.prefill_paths(pair, prompt, dec), prompt)
    assert [c.path for c in sb.res.checks] == ["hf_dynamic", "hf_static", "prisme", "compiled",
                                               "hf", "prisme", "compiled"]
    assert all(c.passed for c in sb.res.checks), sb.res.checks
    assert [c.path for c in sb.res.negative_controls] == ["hf_dynamic_positions_shifted",
                                                          "fixed_step_positions_shifted"]
    assert all(c.passed for c in sb.res.negative_controls), sb.res.negative_controls


@needs_hf
def test_decode_weight_bytes_reads_a_tied_head_whole_and_lookups_by_row(pairs):
    """Tied llama: every parameter once; untied gpt2: embeddings by row (B token rows, one position row)."""
    tiny, gpt = pairs["tiny"].backbone, pairs["seed001"].backbone
    assert hf_report.decode_weight_bytes(tiny, batch=8) == sum(p.numel() * 4 for p in tiny.parameters())
    d = gpt.cfg.d_model
    expected = (sum(p.numel() * 4 for p in gpt.parameters()) - gpt.tok_emb.weight.numel() * 4
                - gpt.pos_emb.weight.numel() * 4 + 8 * d * 4 + d * 4)
    assert hf_report.decode_weight_bytes(gpt, batch=8) == expected


@needs_hf
def test_decode_floor_is_bytes_over_bandwidth(pairs):
    """floor_ms = (weights + mean attended K/V) / bandwidth; vs_floor = path ms / floor_ms."""
    bb = pairs["tiny"].backbone
    floor = bench_hf.decode_floor(bb, batch=2, prompt=10, new=4, bandwidth_gb_per_s=2.0,
                                  ms_per_step={"prisme": 1.0})
    kv_bytes = kv.kv_payload_bytes(bb, 1, 2) * (10 + 2.5)  # steps attend to 11, 12, 13, 14 positions
    assert floor.kv_bytes == round(kv_bytes) and floor.bytes_per_step == floor.weight_bytes + floor.kv_bytes
    assert floor.floor_ms == pytest.approx(floor.bytes_per_step / 2e6)
    assert floor.vs_floor["prisme"] == pytest.approx(1.0 / floor.floor_ms)


@needs_hf
def test_run_big_rows_on_a_tiny_pair(pairs):
    """The 103m protocol on tiny: decode rows per batch with a floor from stream_read, a prefill row with a peak."""
    protocol = bench_hf.BigProtocol(batches=(1, 2), prompt_len=4, new_tokens=2, prefill_tokens=8, warmups=0,
                                    repeats=1, matmul_sizes=(16,), stream_bytes=4096)
    res = bench_hf.run_big(pairs["tiny"], protocol, compile_mode=None, seed=0)
    assert [r.batch for r in res.decode] == [1, 2]
    for r in res.decode:
        assert set(r.samples_ms) == {"hf_dynamic", "hf_static", "prisme", "stream_read"}
        assert r.floor is not None and set(r.floor.vs_floor) == {"hf_dynamic", "hf_static", "prisme"}
        assert r.ms_per_step["prisme"] == pytest.approx(r.p50_ms["prisme"] / 2)
        assert r.speedup_vs_hf_dynamic["hf_dynamic"] == 1.0
    (p,) = res.prefill
    assert p.prompt_tokens == 8 and p.matmul_peak_gflops > 0 and set(p.gflops) == {"hf", "prisme"}
    assert p.flops == bench_train.forward_flops(pairs["tiny"].cfg, 1, 8, head_positions=1).total
    assert all(c.passed for c in res.checks) and all(c.passed for c in res.negative_controls)
    assert res.compile["first_call_s"] == {}


def row(shape: str, batch: int, per_step: dict[str, float], new: int = 1) -> bench_hf.DecodeRow:
    """A synthetic decode row with the given ms per step."""
    p50 = {k: v * new for k, v in per_step.items()}
    floor = hf_report.Floor(1, 0, 1, 1.0, 10.0, {k: v / 10.0 for k, v in per_step.items()}) if shape == "prisme_103m" \
        else None
    return bench_hf.DecodeRow(shape, 1, batch, 16, new, {}, p50, p50, per_step,
                              {k: p50["hf_dynamic"] / v for k, v in p50.items()},
                              {k: p50["hf_static"] / v for k, v in p50.items()}, floor)


def test_targets_are_judged_from_the_rows():
    """evaluate_targets: worst prompt for seed001, floor ratio at batch 1, static ratio at batch 8, prefill of peak."""
    decode = [row("seed001", 1, {"hf_dynamic": 0.33, "hf_static": 0.5, "prisme": 0.09, "compiled": 0.07}),
              row("seed001", 1, {"hf_dynamic": 0.33, "hf_static": 0.5, "prisme": 0.12, "compiled": 0.07}),
              row("prisme_103m", 1, {"hf_dynamic": 26.0, "hf_static": 30.0, "prisme": 22.0, "compiled": 12.0}),
              row("prisme_103m", 8, {"hf_dynamic": 70.0, "hf_static": 60.0, "prisme": 50.0, "compiled": 31.0})]
    prefill = [bench_hf.PrefillRow("prisme_103m", 2, 1, 512, 1, {}, {}, {}, {"prisme": 170.0, "compiled": 150.0},
                                   200.0, {"prisme": 0.85, "compiled": 0.75})]
    targets = {t["name"]: t for t in bench_hf.evaluate_targets(decode, prefill, {"seed001": {}, "prisme_103m": {}})}
    assert len(targets) == 7
    got = {name.split(" (")[0]: (t["measured"], t["met"]) for name, t in targets.items()}
    assert got["seed001 eager decode ms/token"] == (0.12, False)  # the worse prompt decides
    assert got["seed001 compiled decode ms/token"] == (0.07, True)
    assert targets["prisme_103m compiled batch-1 decode / measured floor"]["measured"] == pytest.approx(1.2)
    assert targets["prisme_103m compiled batch-1 decode / measured floor"]["met"] is True
    assert targets["prisme_103m compiled batch-8 decode speed-up over HF StaticCache"]["measured"] == \
        pytest.approx(60 / 31)
    prefill_t = [t for n, t in targets.items() if "prefill" in n][0]
    assert prefill_t["measured"] == 0.85 and prefill_t["met"] is True and "prisme" in prefill_t["note"]


def test_targets_without_a_compiled_path_are_not_met_and_say_why():
    """A compile failure leaves the compiled targets unmeasured, not met, with the error in the note."""
    decode = [row("seed001", 1, {"hf_dynamic": 0.33, "hf_static": 0.5, "prisme": 0.09})]
    errors = {"seed001": {"B1 cap32 step": "CompileError: no C++ compiler"}}
    (_, _, compiled) = bench_hf.evaluate_targets(decode, [], errors)
    assert compiled["measured"] is None and compiled["met"] is False and "no C++ compiler" in compiled["note"]


@needs_hf
def test_run_vs_hf_rejects_bad_settings_before_any_work():
    """Unknown shapes, prompts past T_max and empty batches are ValueErrors."""
    with pytest.raises(ValueError, match="shapes"):
        bench_hf.run_vs_hf(shapes=("gpt5",))
    with pytest.raises(ValueError, match="T_max"):
        bench_hf.run_vs_hf(("seed001",), bench_hf.VsHFOptions(prompts=(510,), new_tokens=16))
    with pytest.raises(ValueError, match="prefill_tokens"):
        bench_hf.run_vs_hf(options=bench_hf.VsHFOptions(prefill_tokens=4096))


@needs_hf
def test_cli_vs_hf_prints_table_and_json_last(capsys, tmp_path):
    """`prisme bench vs-hf` on seed001 only (no compile, tiny protocol): rc 0, JSON last on stdout and in --json."""
    path = tmp_path / "vs_hf.json"
    rc = cli_main(["bench", "vs-hf", "--shapes", "seed001", "--no-compile", "--prompts", "4,8", "--new-tokens", "2",
                   "--warmups", "0", "--repeats", "1", "--json", str(path)])
    out = capsys.readouterr().out
    lines = out.rstrip().splitlines()
    doc = json.loads("\n".join(lines[max(i for i, line in enumerate(lines) if line == "{"):]))
    assert rc == 0 and doc == json.loads(path.read_text())
    assert doc["checks"]["passed"] is True and doc["models"]["seed001"]["hf_class"] == "GPT2LMHeadModel"
    assert [(r["prompt_tokens"], r["new_tokens"]) for r in doc["decode"]] == [(4, 2), (8, 2)]
    assert {t["name"].split(" (")[0] for t in doc["targets"]} >= {"seed001 eager decode ms/token"}
    assert "correctness" in out and "negative controls" in out and "targets" in out
    assert cli_main(["bench", "vs-hf", "--shapes", "seed001", "--batches", "0"]) == 2


@needs_hf
def test_vs_hf_runs_on_a_device_that_is_not_the_cpu():
    """`run_vs_hf` with `VsHFOptions(device=...)` on the fake device (tests/fake_device.py): both models, the tokens,
    the positions and the planted bugs live there (a device mix raises); every path's logits check passes, the
    negative controls are caught, the environment names the device and no CPU-bandwidth floor is computed.
    `--device cuda` without CUDA is a ValueError naming the option."""
    from fake_device import FakeDevice

    with FakeDevice() as fd:
        doc = bench_hf.run_vs_hf(("seed001",), bench_hf.VsHFOptions(prompts=(8,), new_tokens=2, warmups=0, repeats=1,
                                                                    compile_mode=None, device=fd.device))
    assert doc["checks"]["passed"] is True and doc["environment"]["device"] == "fakegpu:0"
    assert len(doc["correctness"]) >= 5 and len(doc["negative_controls"]) >= 3
    assert all(r["floor"] is None for r in doc["decode"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda"):
            harness.bench_device("cuda")


def test_cli_vs_hf_skips_with_a_clear_message_without_transformers(monkeypatch, capsys):
    """Without the hf extra, vs-hf prints why it is skipped (with the install hint) and exits 0."""
    monkeypatch.setattr(bench_hf, "hf_available", lambda: False)
    assert cli_main(["bench", "vs-hf"]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "pip install" in out


@needs_hf
@pytest.mark.slow
def test_run_vs_hf_seed001_with_compile(capsys):
    """The seed001 half of the default protocol with the compiled paths: checks pass, compiled rows are present."""
    doc = bench_hf.run_vs_hf(("seed001",), bench_hf.VsHFOptions(prompts=(8, 16), new_tokens=4, warmups=1, repeats=2))
    assert doc["checks"]["passed"] is True and doc["compile"]["seed001"]["errors"] == {}
    assert all("compiled" in r["p50_ms"] for r in doc["decode"] + doc["prefill"])
