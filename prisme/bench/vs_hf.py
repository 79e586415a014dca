"""`prisme bench vs-hf`: the PRISME backbone against the same weights in HF transformers, side by side in one process.

Shapes (random init, seeded; fp32; HF copy by `interop.to_hf`, sdpa attention):
  * seed001: gpt2-style, 145k parameters, `GPT2LMHeadModel`; batch 1, 1 thread, prompts 16..256;
  * prisme_103m: llama-style, 99.5M parameters, `LlamaForCausalLM`; 2 threads, batch 1 and 8, and a 512-token prefill.

Decode paths (N forced tokens after a prompt; the prompt's prefill is setup, untimed; logits on every step). N is 64
at seed001: a step of a few tens of µs only reaches its steady state after some tens of steps once another path has
run (measured here for the compiled step: 96 µs per step at N = 16, 77 at 64, 72 at 160; HF and eager barely move):
  hf_dynamic  HF with its default `DynamicCache`        hf_static  HF with a `StaticCache` of P + N positions
  prisme      the lean eager cached path, `head(backbone(token, cache))`, weights stored [in, out] in memory
              (`compile.in_out_layout_`: same values, faster batch-1 products; `--stock-layout` for nn.Linear's)
  compiled    `prisme.model.compiled`'s fixed-shape step under torch.compile(mode="max-autotune-no-cudagraphs"), frozen
              weights (seed001: also Inductor's C++ wrapper and math attention); one decoder per batch size, its
              cache sized to the longest prompt + N, over which it attends (masked)
  stream_read (prisme_103m) four reads of a 512 MiB buffer, timed in the same rotation: the floor's bandwidth
Prefill paths (the prompt into a fresh cache, logits of its last position): hf (`logits_to_keep=1`), prisme (eager),
compiled (`prefill_step`, dynamic length, default mode, frozen weights); at prisme_103m the fp32 matmul peak
(`bench_train.matmul_paths`, sizes 1024..3072) is timed in the same rotation.

Correctness, before anything is timed (float32, max |logit error| <= `kv.TOLERANCE`): HF's logits on a random
batch against our full forward (the interop check), and every timed path's logits (each decode step and each prefill)
against our full forward at the same positions. Negative controls, which must give errors >= 1e-2: HF with its head
rows rolled by one vocabulary id (a converter bug), HF decode with positions shifted by one, and the fixed-shape step
(the function that is compiled, run eagerly) with positions shifted by one.

Floor (prisme_103m): bytes a decode step must read, weights (every matrix once; the token embedding too when it is
the tied head) + the K/V of the positions attended (mean over the N steps), divided by the streaming read bandwidth
measured in the same rotation. The compiled step reads its whole cache (P + N positions), a little more.

Timing protocol: `harness.time_paths` (warmups, repeats, path order rotated each repeat, gc off, inference mode);
p50/p95 and raw samples. The machine may be shared: compare paths within one row, and read ratios next to
absolute figures. Output: a table for humans, then one JSON document, the last thing printed on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from prisme.bench import harness, kv
from prisme.bench import train as bench_train
from prisme.bench.harness import TimedPath, parse_ints, percentiles, time_paths
from prisme.bench.vs_hf_paths import DecodePath, Pair, build_pair, decode_paths, prefill_paths
from prisme.bench.vs_hf_report import (
    BIG,
    NEGATIVE_MIN,
    SMALL,
    TOL,
    Check,
    DecodeRow,
    PrefillRow,
    ShapeResult,
    decode_floor,
    evaluate_targets,
    format_vs_hf_table,
    protocol,
)
from prisme.config import PrismeConfig
from prisme.interop import INSTALL_HINT, hf_available
from prisme.io import environment
from prisme.model.compiled import DEFAULT_MODE, CompiledDecoder, compile_decode, decode_step
from prisme.model.compiled_editor import error_line

STREAM_READS = 4  # reads of the 512 MiB buffer per stream_read sample


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


class ShapeBench:
    """Correctness, then timing, for one shape; compiled decoders are built once and reused by every row."""

    def __init__(self, pair: Pair, compile_mode: str | None, seed: int):
        self.pair, self.mode, self.seed = pair, compile_mode, seed
        self.name = pair.cfg.name
        self.res = ShapeResult([], [], [], [], {"mode": compile_mode, "freezing": True, "first_call_s": {},
                                                "errors": {}})

    # -- compiled decoders: a compile failure is recorded, and that decoder's rows go without the compiled path
    def decoder(self, batch: int, capacity: int, prompt: torch.Tensor, step: bool,
                prefill: bool) -> CompiledDecoder | None:
        if self.mode is None:
            return None
        dec = compile_decode(self.pair.backbone, batch, capacity, mode=self.mode if step else None,
                             prefill_mode="default" if prefill else None, cpp_wrapper=self.name == SMALL,
                             math_attention=self.name == SMALL)
        key = f"B{batch} cap{capacity}"
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                dec.prefill(prompt)
                t1 = time.perf_counter()
                if step:
                    dec.step(prompt[:, -1:])
                t2 = time.perf_counter()
        except Exception as e:  # noqa: BLE001 - no C++ compiler, unsupported op, ...: report, time the rest
            self.res.compile["errors"][key] = error_line(e)
            return None
        if prefill:
            self.res.compile["first_call_s"][f"{key} prefill"] = t1 - t0
        if step:
            self.res.compile["first_call_s"][f"{key} step"] = t2 - t1
        return dec

    # -- correctness
    def check(self, what: str, path: str, batch: int, prompt: int, err: float, negative: bool = False) -> None:
        passed = err >= NEGATIVE_MIN if negative else err <= TOL
        (self.res.negative_controls if negative else self.res.checks).append(
            Check(self.name, what, path, batch, prompt, err, passed))

    @torch.inference_mode()
    def check_interop(self, batch: int = 2, seq_len: int = 64) -> None:
        bb, hf = self.pair.backbone, self.pair.hf
        x = harness.make_tokens(bb.cfg.vocab_size, batch, seq_len, self.seed).to(self.pair.device)
        ref = bb.head(bb(x))  # [B, T, V]
        self.check("interop", "hf", batch, seq_len, _max_err(hf(x).logits, ref))
        w = hf.get_output_embeddings().weight  # [V, d]: plant a converter bug, then undo it exactly
        w.copy_(w.roll(1, 0))
        try:
            self.check("interop", "hf_head_rows_rolled", batch, seq_len, _max_err(hf(x).logits, ref), negative=True)
        finally:
            w.copy_(w.roll(-1, 0))

    @torch.inference_mode()
    def check_decode(self, paths: list[DecodePath], prompt: torch.Tensor, new: torch.Tensor,
                     negatives: bool) -> None:
        bb, (B, P), N = self.pair.backbone, prompt.shape, new.shape[1]
        ref = bb.head(bb(torch.cat([prompt, new], dim=1)))[:, P:]  # [B, N, V]: token P + i is scored at P + i
        for path in paths:
            self.check("decode", path.name, B, P, _max_err(path.logits(N), ref))
        if not negatives:
            return
        shifted = decode_paths(self.pair, prompt, new, None, pos_shift=1)[0]
        self.check("decode", "hf_dynamic_positions_shifted", B, P, _max_err(shifted.logits(N), ref), negative=True)
        eager = compile_decode(bb, B, P + N + 1, mode=None, prefill_mode=None)  # the compiled function, run eagerly
        eager.prefill(prompt)
        out = torch.stack([decode_step(bb, new[:, i:i + 1], torch.tensor([P + i + 1], device=new.device), eager.cache)
                           for i in range(N)], dim=1)
        self.check("decode", "fixed_step_positions_shifted", B, P, _max_err(out, ref), negative=True)

    @torch.inference_mode()
    def check_prefill(self, paths: list[TimedPath], prompt: torch.Tensor) -> None:
        bb = self.pair.backbone
        ref = bb.head(bb(prompt))[:, -1]  # [B, V]
        for name, setup, run in paths:
            self.check("prefill", name, prompt.shape[0], prompt.shape[1], _max_err(run(setup()), ref))

    # -- timing
    def decode_row(self, prompt: torch.Tensor, new: torch.Tensor, decoder: CompiledDecoder | None, warmups: int,
                   repeats: int, stream_bytes: int | None, negatives: bool) -> DecodeRow:
        (B, P), N = prompt.shape, new.shape[1]
        paths = decode_paths(self.pair, prompt, new, decoder)
        self.check_decode(paths, prompt, new, negatives)
        timed = [p.timed(N) for p in paths]
        if stream_bytes:  # four reads a sample: about as long as a sample of the batch-1 compiled path
            timed.append(bench_train.stream_read_path(stream_bytes, STREAM_READS))
        samples = time_paths(timed, warmups, repeats, prompt.device)
        stats = {k: percentiles(v) for k, v in samples.items()}
        p50 = {k: s[0] for k, s in stats.items() if k != "stream_read"}
        per_step = {k: v / N for k, v in p50.items()}
        floor = None
        if stream_bytes:
            bw = bench_train.Bandwidth.from_samples(stream_bytes * STREAM_READS, samples["stream_read"])
            floor = decode_floor(self.pair.backbone, B, P, N, bw.gb_per_s, per_step)
        return DecodeRow(self.name, self.pair.threads, B, P, N, samples, p50, {k: s[1] for k, s in stats.items()},
                         per_step, {k: p50["hf_dynamic"] / v for k, v in p50.items()},
                         {k: p50["hf_static"] / v for k, v in p50.items()}, floor)

    def prefill_row(self, prompt: torch.Tensor, decoder: CompiledDecoder | None, warmups: int, repeats: int,
                    matmul_sizes: Sequence[int]) -> PrefillRow:
        (B, P), cfg = prompt.shape, self.pair.cfg
        paths = prefill_paths(self.pair, prompt, decoder)
        self.check_prefill(paths, prompt)
        peak_paths = bench_train.matmul_paths(matmul_sizes, device=prompt.device) if matmul_sizes else []
        samples = time_paths([*paths, *peak_paths], warmups, repeats, prompt.device)
        stats = {k: percentiles(v) for k, v in samples.items() if not k.startswith("matmul_")}
        flops = bench_train.forward_flops(cfg, B, P, head_positions=1).total
        gflops = {k: flops / s[0] / 1e6 for k, s in stats.items()}
        peak = bench_train.MatmulPeak.from_samples(samples).peak_gflops if matmul_sizes else None
        return PrefillRow(self.name, self.pair.threads, B, P, flops, samples, {k: s[0] for k, s in stats.items()},
                          {k: s[1] for k, s in stats.items()}, gflops, peak,
                          {k: v / peak for k, v in gflops.items()} if peak else None)


def run_small(pair: Pair, prompts: Sequence[int], new_tokens: int, warmups: int, repeats: int,
              compile_mode: str | None, seed: int) -> ShapeResult:
    """seed001 rows: decode and prefill per prompt length, batch 1; one compiled decoder serves every prompt."""
    sb = ShapeBench(pair, compile_mode, seed)
    V, cap = pair.cfg.vocab_size, max(prompts) + new_tokens
    sb.check_interop()
    seqs = {P: harness.make_tokens(V, 1, P + new_tokens, seed + P).to(pair.device) for P in prompts}
    dec = sb.decoder(1, cap, seqs[prompts[0]][:, :prompts[0]], step=True, prefill=True)
    for i, P in enumerate(prompts):
        prompt, new = seqs[P][:, :P], seqs[P][:, P:]
        sb.res.decode.append(sb.decode_row(prompt, new, dec, warmups, repeats, None, negatives=i == 0))
        sb.res.prefill.append(sb.prefill_row(prompt, dec, warmups, repeats, ()))
    return sb.res


@dataclass(frozen=True)
class BigProtocol:
    """What `run_big` measures on a prisme_103m-like shape: decode at each batch size (with its floor where
    `stream_bytes` is given), then one batch-1 prefill (against the matmul peak where `matmul_sizes` are given)."""

    batches: Sequence[int]  # decode batch sizes
    prompt_len: int  # decode prompt tokens, prefilled untimed
    new_tokens: int  # forced tokens per decode sample
    prefill_tokens: int  # the prefill row's prompt
    warmups: int  # untimed repeats before timing
    repeats: int  # timed repeats
    matmul_sizes: Sequence[int]  # fp32 square matmuls timed with the prefill (the peak; (): none)
    stream_bytes: int | None  # the buffer read in each decode row's rotation (the floor's bandwidth; None: no floor)


def run_big(pair: Pair, protocol: BigProtocol, compile_mode: str | None, seed: int) -> ShapeResult:
    """prisme_103m rows: decode at each batch size with its floor, then one batch-1 prefill against the peak."""
    p = protocol
    sb = ShapeBench(pair, compile_mode, seed)
    V = pair.cfg.vocab_size
    sb.check_interop()
    for i, B in enumerate(p.batches):
        seq = harness.make_tokens(V, B, p.prompt_len + p.new_tokens, seed + B).to(pair.device)
        prompt, new = seq[:, :p.prompt_len], seq[:, p.prompt_len:]
        dec = sb.decoder(B, p.prompt_len + p.new_tokens, prompt, step=True, prefill=False)
        sb.res.decode.append(sb.decode_row(prompt, new, dec, p.warmups, p.repeats, p.stream_bytes, negatives=i == 0))
        del dec
    prompt = harness.make_tokens(V, 1, p.prefill_tokens, seed).to(pair.device)
    dec = sb.decoder(1, p.prefill_tokens, prompt, step=False, prefill=True)
    sb.res.prefill.append(sb.prefill_row(prompt, dec, p.warmups, p.repeats, p.matmul_sizes))
    return sb.res


@dataclass(frozen=True)
class VsHFOptions:
    """How `run_vs_hf` times its shapes. Checked here, once: counts, batch sizes, and the lengths against the
    seed001 and prisme_103m presets' T_max."""

    prompts: Sequence[int] = (16, 64, 128, 256)  # seed001 prompt lengths
    new_tokens: int = 64  # seed001 forced tokens per sample
    big_prompt: int = 64  # prisme_103m decode prompt length
    big_new_tokens: int = 8  # prisme_103m forced tokens per sample
    batches: Sequence[int] = (1, 8)  # prisme_103m decode batch sizes
    prefill_tokens: int = 512  # prisme_103m prefill length
    warmups: int = 2  # untimed repeats before timing (prisme_103m: at most 1)
    repeats: int = 15  # timed repeats (prisme_103m: a third, >= 3)
    threads_small: int = 1  # torch threads for seed001 (-1: leave as is)
    threads_big: int = 2  # torch threads for prisme_103m (-1: leave as is)
    compile_mode: str | None = DEFAULT_MODE  # the compiled paths' torch.compile mode (None: no compiled paths)
    seed: int = 42  # weights and tokens
    quick: bool = False  # two matmul sizes for the peak
    in_out: bool = True  # our eager path on [in, out] weights (`compile.in_out_layout_`; False: nn.Linear's)
    device: str | torch.device = "cpu"  # where both models run and are timed

    def __post_init__(self) -> None:
        if self.warmups < 0 or self.repeats < 1 or self.new_tokens < 1 or self.big_new_tokens < 1:
            raise ValueError("need warmups >= 0, repeats >= 1 and new tokens >= 1")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be positive, got {list(self.batches)}")
        kv.check_lengths(PrismeConfig.from_name(SMALL), self.prompts, self.new_tokens)
        kv.check_lengths(PrismeConfig.from_name(BIG), [self.big_prompt], self.big_new_tokens)
        if not 1 <= self.prefill_tokens <= PrismeConfig.from_name(BIG).max_seq_len:
            raise ValueError(f"prefill_tokens must be in [1, T_max={PrismeConfig.from_name(BIG).max_seq_len}], "
                             f"got {self.prefill_tokens}")


def run_vs_hf(shapes: Sequence[str] = (SMALL, BIG), options: VsHFOptions | None = None) -> dict[str, Any]:
    """The whole `prisme bench vs-hf` protocol on `shapes` (`options`: default `VsHFOptions()`, on its `device`);
    returns the JSON document. Needs `transformers`. Off the CPU the decode floor is not computed (its bandwidth row
    reads host memory) and the matmul peak runs on the device."""
    if not hf_available():
        raise ImportError(f"prisme bench vs-hf needs the optional `transformers` package: {INSTALL_HINT}")
    unknown = sorted(set(shapes) - {SMALL, BIG})
    if unknown or not shapes:
        raise ValueError(f"shapes must be a non-empty subset of {[SMALL, BIG]}, got {list(shapes)}")
    o = options if options is not None else VsHFOptions()
    warmups, repeats, compile_mode, seed, quick = o.warmups, o.repeats, o.compile_mode, o.seed, o.quick
    big_repeats = max(3, repeats // 3)
    matmul_sizes = bench_train.MATMUL_SIZES[:2] if quick else bench_train.MATMUL_SIZES
    device = torch.device(o.device)
    stream_bytes = bench_train.BANDWIDTH_BYTES if device.type == "cpu" else None
    big = BigProtocol(o.batches, o.big_prompt, o.big_new_tokens, o.prefill_tokens, min(warmups, 1), big_repeats,
                      matmul_sizes, stream_bytes)
    load_start = os.getloadavg()[0]
    results: dict[str, ShapeResult] = {}
    models: dict[str, Any] = {}
    t_start = time.perf_counter()
    for shape in shapes:
        threads = o.threads_small if shape == SMALL else o.threads_big
        with harness.torch_threads(threads):
            pair = build_pair(shape, seed, torch.get_num_threads(), o.in_out, device)
            models[shape] = {**harness.model_facts(pair.backbone), "hf_class": type(pair.hf).__name__,
                             "threads": pair.threads}
            if shape == SMALL:
                results[shape] = run_small(pair, o.prompts, o.new_tokens, warmups, repeats, compile_mode, seed)
            else:
                results[shape] = run_big(pair, big, compile_mode, seed)
            del pair
    import transformers

    env = {**environment(dtype=torch.float32, seed=seed), "device": str(device),
           "threads": {s: models[s]["threads"] for s in shapes},
           "transformers": transformers.__version__, "load_average_1m": {"start": load_start,
                                                                          "end": os.getloadavg()[0]},
           "wall_s": time.perf_counter() - t_start}
    decode = [r for s in shapes for r in results[s].decode]
    prefill = [r for s in shapes for r in results[s].prefill]
    checks = [c for s in shapes for c in results[s].checks]
    negatives = [c for s in shapes for c in results[s].negative_controls]
    compile_info = {s: results[s].compile for s in shapes}
    verdict = {f"logits_max_error_le_{TOL:g}": all(c.passed for c in checks),
               f"negative_controls_ge_{NEGATIVE_MIN:g}": all(c.passed for c in negatives)}
    verdict["passed"] = all(verdict.values())
    return {
        "scope": "Untrained backbones (random init, seeded) vs the same weights in HF transformers; synthetic "
                 "forced tokens; CPU microbenchmark, one run, on a machine that may be shared",
        "environment": env,
        "models": models,
        "protocol": protocol(shapes, warmups, repeats, big_repeats, quick, o.in_out, compile_mode),
        "correctness": [asdict(c) for c in checks],
        "negative_controls": [asdict(c) for c in negatives],
        "checks": verdict,
        "compile": compile_info,
        "decode": [asdict(r) for r in decode],
        "prefill": [asdict(r) for r in prefill],
        "targets": evaluate_targets(decode, prefill, {s: compile_info[s]["errors"] for s in shapes}),
    }


def main(args: argparse.Namespace) -> int:
    """`prisme bench vs-hf`: print the table, then the JSON document as the last thing on stdout."""
    shapes = harness.parse_names(args.shapes, "--shapes")
    if not hf_available():
        msg = f"prisme bench vs-hf: skipped: it needs the optional `transformers` package ({INSTALL_HINT})"
        print(msg)
        print(json.dumps({"skipped": msg}))
        return 0
    quick = args.quick

    def pick(value: Any, quick_default: Any, default: Any) -> Any:
        return value if value is not None else (quick_default if quick else default)

    doc = run_vs_hf(shapes, VsHFOptions(
        prompts=parse_ints(pick(args.prompts, "16,256", "16,64,128,256"), "--prompts"),
        new_tokens=args.new_tokens, big_prompt=args.big_prompt, big_new_tokens=pick(args.big_new_tokens, 4, 8),
        batches=parse_ints(pick(args.batches, "1", "1,8"), "--batches"), prefill_tokens=args.prefill_tokens,
        warmups=args.warmups, repeats=pick(args.repeats, 5, 15), threads_small=args.threads_small,
        threads_big=args.threads_big, compile_mode=None if args.no_compile else DEFAULT_MODE, seed=args.seed,
        quick=quick, in_out=not args.stock_layout, device=harness.bench_device(getattr(args, "device", "cpu"))))
    return harness.emit(doc, format_vs_hf_table(doc), args.json)
