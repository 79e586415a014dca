"""`prisme bench kv`: seed 001's KV-cache protocol on a PRISME backbone.

Timing (`harness.time_paths`): each path is a `(name, setup, run)` triple; `setup` is untimed (allocate and prefill a
cache), `run` is timed with `time.perf_counter_ns`. Every path runs `warmups` times untimed, then `repeats` timed
times, inside `torch.inference_mode()`, with the garbage collector collected first and off while timing, and with the
path order rotated by one each repeat so that no path always runs first (or just after a given other path).

KV protocol (seed 001, with seed 003's memory figures), on a seeded, untrained preset:
  * correctness: max |logit| error of the cached path (a prompt fed in chunks of 1, 2, 5 through a `KVCache`) against
    a full recomputation, for float32 and float64, batch 1 and 2, over every position of a short sequence;
    per-position errors for float32, batch 2, chunk 1;
  * negative controls: the same check under `faults.reset_positions()` and `faults.unshifted_mask()` (chunk 5) must
    give a large error, proving that the check can see a broken cache;
  * timing, per prompt length P with N forced continuation tokens: `prefill` (the prompt into a fresh cache, head on
    its last position), `full` (for each new token, the whole prefix recomputed, head on its last position) and
    `cached` (the N tokens one at a time through the prefilled cache, head included; the prefill is not timed);
  * memory: the exact K/V payload of P + N positions (and bytes per position), next to the Python `tracemalloc`
    peak of each path, which sees Python objects only (tensor storage is allocated outside Python's allocator).

Output: a table for humans (seed 001's own figures beside ours, labelled as measured on another machine), then one
JSON document, the last thing printed on stdout; `--json PATH` also writes it to a file (atomically).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from prisme import faults
from prisme.bench.harness import (
    DTYPES,
    TimedPath,
    build_model,
    emit,
    make_tokens,
    model_facts,
    parse_ints,
    percentiles,
    time_paths,
    torch_threads,
    tracemalloc_peak,
)
from prisme.config import PrismeConfig
from prisme.io import PACKAGE_DIR, environment
from prisme.model.backbone import Backbone

REFERENCE_DIR = PACKAGE_DIR / "reference"
SEED001_REPORT = REFERENCE_DIR / "seed001_kv_report.json"
# What "exact" means in this benchmark (and in tests/test_attention_cache.py).
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
NEGATIVE_CONTROL_MIN = 1e-2


# --------------------------------------------------------------------------------------------------------- correctness
def position_errors(model: Backbone, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-position max |logit| error `[T]` of the chunked cached path against one full recomputation."""
    with torch.inference_mode():
        full = model.head(model(tokens))  # [B, T, V]
        cache = model.new_cache(tokens.shape[0], tokens.shape[1])
        cached = model.head(model.prefill(tokens, cache, chunk))  # [B, T, V]
        return (cached - full).abs().amax(dim=(0, 2))  # [T]


@dataclass
class CorrectnessRow:
    dtype: str
    batch: int
    chunk: int
    max_abs_logit_error: float


def kv_correctness(cfg: PrismeConfig, dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
                   batches: Sequence[int] = (1, 2), chunks: Sequence[int] = (1, 2, 5), seq_len: int = 24,
                   seed: int = 42) -> list[CorrectnessRow]:
    """Max |logit| error, cached vs full recomputation, over all positions, for each dtype x batch x chunk."""
    rows = []
    for dtype in dtypes:
        model = build_model(cfg, seed, dtype)
        for batch in batches:
            tokens = make_tokens(cfg.vocab_size, batch, seq_len, seed)
            for chunk in chunks:
                err = float(position_errors(model, tokens, chunk).max())
                rows.append(CorrectnessRow(str(dtype), batch, chunk, err))
    return rows


def kv_position_errors(cfg: PrismeConfig, dtype: torch.dtype = torch.float32, batch: int = 2, chunk: int = 1,
                       seq_len: int = 24, seed: int = 42) -> list[float]:
    """Per-position errors of one setting (seed 001 reports float32, batch 2, chunk 1)."""
    model = build_model(cfg, seed, dtype)
    return position_errors(model, make_tokens(cfg.vocab_size, batch, seq_len, seed), chunk).tolist()


def kv_negative_controls(cfg: PrismeConfig, dtype: torch.dtype = torch.float32, batch: int = 2, chunk: int = 5,
                         seq_len: int = 24, seed: int = 42) -> dict[str, float]:
    """The correctness check run on deliberately broken caches; each error must be large."""
    model = build_model(cfg, seed, dtype)
    tokens = make_tokens(cfg.vocab_size, batch, seq_len, seed)
    out = {}
    for name, fault in (("reset_positions", faults.reset_positions), ("unshifted_mask", faults.unshifted_mask)):
        with fault():
            out[name] = float(position_errors(model, tokens, chunk).max())
    return out


# -------------------------------------------------------------------------------------------------------------- timing
@dataclass
class TimingRow:
    prompt_tokens: int
    appended_tokens: int
    cache_payload_bytes: int
    samples_ms: dict[str, list[float]]
    full_projected_positions_per_layer: int
    cached_projected_positions_per_layer: int
    prefill_p50_ms: float
    prefill_p95_ms: float
    full_p50_ms: float
    full_p95_ms: float
    cached_p50_ms: float
    cached_p95_ms: float
    prefill_ms_per_token_p50: float  # prefill p50 / P
    full_ms_per_token_p50: float  # full p50 / N
    cached_ms_per_token_p50: float  # cached p50 / N
    cached_speedup_vs_full: float  # full p50 / cached p50


@dataclass
class MemoryRow:
    prompt_tokens: int
    appended_tokens: int
    kv_payload_bytes: int  # exact K/V bytes of P + N positions, batch 1, all layers
    bytes_per_token: int
    cache_allocated_bytes: int  # the preallocated buffers (capacity P + N, so equal to the payload here)
    python_tracemalloc_peak_bytes: dict[str, int]  # per path; Python objects only, not tensor storage


def kv_paths(model: Backbone, prompt: torch.Tensor, new: torch.Tensor) -> list[TimedPath]:
    """The three timed paths for one prompt `[1, P]` and its forced continuation `[1, N]`."""
    P, N = prompt.shape[1], new.shape[1]
    seq = torch.cat([prompt, new], dim=1)  # [1, P + N]
    fwd, head = model, model.head

    def fresh() -> Any:
        return model.new_cache(1, P + N)

    def prefilled() -> Any:
        cache = fresh()
        fwd(prompt, cache)
        return cache

    def prefill(cache: Any) -> None:
        head(fwd(prompt, cache)[:, -1:])

    def full(_: Any) -> None:
        for i in range(P + 1, P + N + 1):  # score appended token i - 1 from scratch
            head(fwd(seq[:, :i])[:, -1:])

    def cached(cache: Any) -> None:
        for i in range(P, P + N):
            head(fwd(seq[:, i:i + 1], cache))

    return [("prefill", fresh, prefill), ("full", lambda: None, full), ("cached", prefilled, cached)]


def kv_timing(model: Backbone, prompts: Sequence[int], new_tokens: int, warmups: int, repeats: int,
              seed: int = 42) -> list[TimingRow]:
    """Seed 001's timing table: prefill, full recomputation and cached decode per prompt length (batch 1)."""
    check_lengths(model.cfg, prompts, new_tokens)
    rows = []
    for P in prompts:
        seq = make_tokens(model.cfg.vocab_size, 1, P + new_tokens, seed + P)
        seq = seq.to(next(model.parameters()).device)
        samples = time_paths(kv_paths(model, seq[:, :P], seq[:, P:]), warmups, repeats, next(model.parameters()).device)
        (pre50, pre95), (full50, full95), (c50, c95) = (percentiles(samples[k]) for k in ("prefill", "full", "cached"))
        rows.append(TimingRow(
            prompt_tokens=P, appended_tokens=new_tokens,
            cache_payload_bytes=kv_payload_bytes(model, P + new_tokens), samples_ms=samples,
            full_projected_positions_per_layer=sum(range(P + 1, P + new_tokens + 1)),
            cached_projected_positions_per_layer=new_tokens,
            prefill_p50_ms=pre50, prefill_p95_ms=pre95, full_p50_ms=full50, full_p95_ms=full95,
            cached_p50_ms=c50, cached_p95_ms=c95,
            prefill_ms_per_token_p50=pre50 / P, full_ms_per_token_p50=full50 / new_tokens,
            cached_ms_per_token_p50=c50 / new_tokens, cached_speedup_vs_full=full50 / c50))
    return rows


def kv_payload_bytes(model: Backbone, n_tokens: int, batch: int = 1) -> int:
    """Exact K/V bytes of `n_tokens` positions: layers x (K and V) x kv heads x head_dim x element size."""
    cfg, itemsize = model.cfg, model.tok_emb.weight.element_size()
    return cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * itemsize * n_tokens * batch


def kv_memory(model: Backbone, prompts: Sequence[int], new_tokens: int, seed: int = 42) -> list[MemoryRow]:
    """Seed 003's memory figures: exact K/V payload per prompt, and each path's Python tracemalloc peak."""
    check_lengths(model.cfg, prompts, new_tokens)
    rows = []
    for P in prompts:
        seq = make_tokens(model.cfg.vocab_size, 1, P + new_tokens, seed + P)
        peaks = {name: tracemalloc_peak(setup, run) for name, setup, run in kv_paths(model, seq[:, :P], seq[:, P:])}
        cache = model.new_cache(1, P + new_tokens)
        rows.append(MemoryRow(P, new_tokens, kv_payload_bytes(model, P + new_tokens),
                              kv_payload_bytes(model, 1), cache.nbytes, peaks))
    return rows


def check_lengths(cfg: PrismeConfig, prompts: Sequence[int], new_tokens: int) -> None:
    if not prompts or any(P < 1 for P in prompts) or new_tokens < 1:
        raise ValueError(f"need prompt lengths >= 1 and new tokens >= 1, got {list(prompts)} and {new_tokens}")
    if max(prompts) + new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt {max(prompts)} + {new_tokens} new tokens exceeds T_max={cfg.max_seq_len} "
                         f"of preset {cfg.name!r}")


# ----------------------------------------------------------------------------------------------------------- kv report
@dataclass(frozen=True)
class KVBenchOptions:
    """How `run_kv` runs seed 001's protocol (the lengths are checked against the preset's T_max there)."""

    prompts: Sequence[int] = (16, 64, 128, 256)  # prompt lengths, each timed and measured at batch 1
    new_tokens: int = 16  # forced continuation tokens per prompt
    warmups: int = 3  # untimed repeats before timing
    repeats: int = 15  # timed repeats per path
    threads: int = 1  # torch CPU threads (-1: leave as is)
    seed: int = 42  # weights and tokens
    dtype: torch.dtype = torch.float32  # of the timed model (the correctness check runs float32 and float64)
    seq_len: int = 24  # tokens per sequence in the correctness check


def run_kv(preset: str = "seed001", options: KVBenchOptions | None = None) -> dict[str, Any]:
    """Seed 001's whole protocol on `preset` (`options`: default `KVBenchOptions()`); returns the JSON document (see
    the module docstring)."""
    o = options if options is not None else KVBenchOptions()
    cfg = PrismeConfig.from_name(preset)
    check_lengths(cfg, o.prompts, o.new_tokens)
    if not 1 <= o.seq_len <= cfg.max_seq_len:
        raise ValueError(f"correctness seq_len must be in [1, {cfg.max_seq_len}], got {o.seq_len}")
    with torch_threads(o.threads):
        correctness = kv_correctness(cfg, seq_len=o.seq_len, seed=o.seed)  # checked before anything is timed
        pos_errors = kv_position_errors(cfg, seq_len=o.seq_len, seed=o.seed)
        negative = kv_negative_controls(cfg, seq_len=o.seq_len, seed=o.seed)
        model = build_model(cfg, o.seed, o.dtype)
        timings = kv_timing(model, o.prompts, o.new_tokens, o.warmups, o.repeats, o.seed)
        memory = kv_memory(model, o.prompts, o.new_tokens, o.seed)
        env = environment(dtype=o.dtype, seed=o.seed)
    checks = {
        f"float64_max_error_le_{TOLERANCE[torch.float64]:g}": all(
            r.max_abs_logit_error <= TOLERANCE[torch.float64] for r in correctness if r.dtype == "torch.float64"),
        f"float32_max_error_le_{TOLERANCE[torch.float32]:g}": all(
            r.max_abs_logit_error <= TOLERANCE[torch.float32] for r in correctness if r.dtype == "torch.float32"),
        f"negative_controls_ge_{NEGATIVE_CONTROL_MIN:g}": all(v >= NEGATIVE_CONTROL_MIN for v in negative.values()),
    }
    checks["passed"] = all(checks.values())
    return {
        "scope": f"Untrained {cfg.family}-style backbone (preset {preset}, random init, seed {o.seed}), synthetic "
                 "fixed-token continuation; CPU microbenchmark only",
        "environment": env,
        "model": model_facts(model),
        "protocol": {
            "warmups": o.warmups,
            "repeats": o.repeats,
            "timer": "perf_counter_ns",
            "continuation_prefill_included": False,
            "cache": "preallocated static [B, n_kv_head, T_max, head_dim], written in place by position",
            "gradients": "torch.inference_mode",
            "path_order": "rotated each repeat",
            "gc": "collected before timing, disabled while timing",
            "inputs": "predetermined tokens, no sampling or EOS",
            "batch": 1,
            "head": "included in every path (prefill and full: last position only)",
            "correctness": f"all {o.seq_len} positions, chunked prefill through the cache vs one full recomputation",
            "negative_controls": "faults.reset_positions / faults.unshifted_mask, float32, batch 2, chunk 5",
            "memory": "exact K/V payload of prompt + continuation; Python tracemalloc peak reported separately",
        },
        "correctness": [asdict(r) for r in correctness],
        "position_errors_fp32_batch2_chunk1": pos_errors,
        "negative_controls": negative,
        "checks": checks,
        "timings": [asdict(r) for r in timings],
        "memory": [asdict(r) for r in memory],
    }


def load_seed001() -> dict[str, Any] | None:
    try:
        return json.loads(SEED001_REPORT.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def format_kv_table(doc: dict[str, Any], reference: dict[str, Any] | None = None) -> str:
    """The human-readable report: correctness, negative controls, timings (with seed 001's beside), memory."""
    env, m = doc["environment"], doc["model"]
    lines = [f"prisme bench kv: preset {m['preset']} ({m['family']}, {m['parameters']:,} parameters), "
             f"{env['dtype']}, {env['threads']} thread(s), {env['cpu']}, torch {env['torch']}", "",
             "correctness: max |logit error|, cached (chunked prefill) vs full recomputation"]
    chunks = sorted({r["chunk"] for r in doc["correctness"]})
    lines.append(f"  {'dtype':<15}{'batch':>6}" + "".join(f"{'chunk ' + str(c):>12}" for c in chunks))
    for dtype in dict.fromkeys(r["dtype"] for r in doc["correctness"]):
        for batch in dict.fromkeys(r["batch"] for r in doc["correctness"]):
            errs = {r["chunk"]: r["max_abs_logit_error"] for r in doc["correctness"]
                    if r["dtype"] == dtype and r["batch"] == batch}
            lines.append(f"  {dtype:<15}{batch:>6}" + "".join(f"{errs[c]:>12.2e}" for c in chunks))
    neg = doc["negative_controls"]
    lines.append(f"negative controls (must be >= {NEGATIVE_CONTROL_MIN:g}): "
                 + ", ".join(f"{k} {v:.3g}" for k, v in neg.items()))
    lines.append("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in doc["checks"].items()
                                        if k != "passed"))
    ref_rows = {(r["prompt_tokens"], r.get("appended_tokens")): r for r in (reference or {}).get("timings", [])}
    lines += ["", f"timing, batch 1: p50 ms over {doc['protocol']['repeats']} repeats [p95]; per token = p50 / tokens"]
    if reference:
        lines.append(f"  {'':>6} | {'this machine':^79} | {'seed 001, measured on another machine':^40}")
    lines.append(f"  {'prompt':>6} | {'prefill':>16} {'full':>17} {'cached':>16} {'full/tok':>8} {'cached/tok':>10}"
                 f" {'ratio':>6}" + (f" | {'prefill':>8} {'full':>8} {'cached':>8} {'ratio':>6}" if reference else ""))
    for r in doc["timings"]:
        ref = ref_rows.get((r["prompt_tokens"], r["appended_tokens"]))
        theirs = f"{'-':>8} {'-':>8} {'-':>8} {'-':>6}"
        if ref:
            theirs = (f"{ref['prefill_p50_ms']:>8.3f} {ref['full_p50_ms']:>8.3f} {ref['cached_p50_ms']:>8.3f}"
                      f" {ref['full_p50_ms'] / ref['cached_p50_ms']:>5.1f}x")
        lines.append(f"  {r['prompt_tokens']:>6} | {r['prefill_p50_ms']:>7.3f} [{r['prefill_p95_ms']:>6.3f}]"
                     f" {r['full_p50_ms']:>8.3f} [{r['full_p95_ms']:>6.3f}]"
                     f" {r['cached_p50_ms']:>7.3f} [{r['cached_p95_ms']:>6.3f}]"
                     f" {r['full_ms_per_token_p50']:>8.4f} {r['cached_ms_per_token_p50']:>10.4f}"
                     f" {r['cached_speedup_vs_full']:>5.1f}x" + (f" | {theirs}" if reference else ""))
    lines.append("  ratio = full p50 / cached p50 (the cached decode's speed-up over full recomputation)")
    if reference:
        renv = reference.get("environment", {})
        lines.append(f"  seed 001: measured on another machine ({renv.get('cpu', '?')}, torch "
                     f"{renv.get('torch', '?')}, {renv.get('threads', '?')} thread) on its own model and dynamic "
                     "cache; for reference only")
    lines += ["", "memory (batch 1): exact K/V payload of prompt + continuation; Python tracemalloc peak per path "
                  "(Python objects only, not tensor storage)",
              f"  {'prompt':>6} {'new':>4} {'kv bytes':>10} {'bytes/tok':>10} {'peak prefill':>13} {'peak full':>10}"
              f" {'peak cached':>12}"]
    for r in doc["memory"]:
        pk = r["python_tracemalloc_peak_bytes"]
        lines.append(f"  {r['prompt_tokens']:>6} {r['appended_tokens']:>4} {r['kv_payload_bytes']:>10,}"
                     f" {r['bytes_per_token']:>10,} {pk['prefill']:>13,} {pk['full']:>10,} {pk['cached']:>12,}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """`prisme bench kv`: print the table, then the JSON document as the last thing on stdout."""
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {args.dtype!r}")
    doc = run_kv(args.preset, KVBenchOptions(prompts=parse_ints(args.prompts, "--prompts"), new_tokens=args.new_tokens,
                                             warmups=args.warmups, repeats=args.repeats, threads=args.threads,
                                             seed=args.seed, dtype=DTYPES[args.dtype], seq_len=args.seq_len))
    if getattr(args, "seed001", False):  # the origin document's figures beside ours (another machine and cache)
        doc["reference"] = {"report": "prisme/reference/seed001_kv_report.json",
                            "note": "seed 001's figures, measured on another machine (AMD EPYC 9V74, torch 2.15.0+cpu) "
                                    "with a dynamic torch.cat cache: beside ours, not comparable to them"}
    return emit(doc, format_kv_table(doc, load_seed001() if getattr(args, "seed001", False) else None), args.json)
