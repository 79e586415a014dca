"""`prisme bench`'s command line: the subcommands' options (every benchmark shares --seed and --json) and the
dispatch to each benchmark's `main` (imported only when that benchmark runs)."""

from __future__ import annotations

import argparse
import importlib

from prisme.bench import MIN_NEW_TOKENS
from prisme.checks import count_option

BENCHES = {"kv": "prisme.bench.kv", "workspace": "prisme.bench.workspace", "vs-hf": "prisme.bench.vs_hf",
           "train": "prisme.bench.train", "decode": "prisme.bench.decode", "long": "prisme.bench.long"}


def run_bench(args: argparse.Namespace) -> int:
    """`prisme bench <what>`: each benchmark prints its table, then its JSON document as the last thing on stdout."""
    if args.bench not in BENCHES:
        raise ValueError(f"unknown benchmark {args.bench!r}")
    return importlib.import_module(BENCHES[args.bench]).main(args)


def bench_parser(bsub, name: str, **kw) -> argparse.ArgumentParser:
    """A `prisme bench` subcommand with the options every benchmark shares (--seed, --json)."""
    b = bsub.add_parser(name, **kw)
    b.add_argument("--seed", type=int, default=42, help="seed for weights and tokens")
    b.add_argument("--json", default=None, help="also write the JSON document to this file (atomically)")
    return b


def add_bench_parser(sub) -> None:
    """The `bench` command and its subcommands, on the `prisme` parser's subparsers `sub`."""
    s = sub.add_parser("bench", help="benchmarks: table for humans, one JSON document for machines")
    bsub = s.add_subparsers(dest="bench", required=True, metavar="WHAT")
    kv = bench_parser(bsub, "kv", help="KV-cache correctness + timing (seed 001) and memory (seed 003)")
    kv.add_argument("--preset", default="seed001", help="model preset (default: seed001)")
    kv.add_argument("--prompts", default="16,64,128,256", help="comma-separated prompt lengths")
    kv.add_argument("--new-tokens", type=count_option(1), default=16, help="forced continuation tokens per prompt")
    kv.add_argument("--warmups", type=count_option(0), default=3, help="untimed repeats before timing")
    kv.add_argument("--repeats", type=count_option(1), default=15, help="timed repeats per path")
    kv.add_argument("--threads", type=int, default=1, help="torch CPU threads (-1 = leave as is)")
    kv.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="dtype of the timed model")
    kv.add_argument("--seq-len", type=count_option(2), default=24, help="tokens per sequence in the correctness check")
    kv.add_argument("--seed001", action="store_true", help="also the origin document's figures (seed 001: another "
                                                          "machine, another cache) beside this machine's")
    ws = bench_parser(bsub, "workspace", help="decode time per token of seed 000's rows vs their analytic ops, "
                         "the workspace's own time, optimised vs seed modules")
    ws.add_argument("--presets", default="demo,prisme_103m", help="comma-separated presets (random weights)")
    ws.add_argument("--quick", action="store_true", help="demo only, 4 decoded tokens, 2 repeats (a smoke run)")
    ws.add_argument("--batches", default="1,8", help="comma-separated batch sizes (B > 1: ragged budgets)")
    ws.add_argument("--prompt-len", type=count_option(1), default=128, help="prompt tokens, prefilled untimed")
    ws.add_argument("--new-tokens", type=count_option(1), default=16, help="forced decode steps per timed sample")
    ws.add_argument("--warmups", type=count_option(0), default=1, help="untimed repeats before timing")
    ws.add_argument("--repeats", type=count_option(1), default=5, help="timed repeats per row x model")
    ws.add_argument("--threads", type=int, default=-1,
                    help="torch CPU threads (-1 = 2 for prisme_103m/459m, 1 for other presets)")
    ws.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"],
                    help="dtype of the timed models")
    ws.add_argument("--device", default="cpu", help="cpu or cuda")
    ws.add_argument("--profile", action="store_true",
                    help="profile the workspace's ATen ops (last preset, largest batch, optimised model)")
    ws.add_argument("--profile-steps", type=count_option(1), default=4, help="decode steps per profiled row")
    ws.add_argument("--compile", action="store_true",
                    help="also time the seed model with its editor under torch.compile (variant 'compiled')")
    hf = bench_parser(bsub, "vs-hf", help="the backbone vs the same weights in HF transformers (needs the hf extra): "
                         "logits, cached decode and prefill, eager and compiled")
    hf.add_argument("--shapes", default="seed001,prisme_103m", help="comma-separated: seed001, prisme_103m")
    hf.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]: where both models run and are timed")
    hf.add_argument("--quick", action="store_true",
                    help="a smoke run: prompts 16,256, prisme_103m batch 1 only with 4 new tokens, 5 repeats")
    hf.add_argument("--prompts", default=None, help="seed001 prompt lengths (default 16,64,128,256)")
    hf.add_argument("--new-tokens", type=count_option(1), default=64, help="seed001 forced tokens per sample")
    hf.add_argument("--big-prompt", type=count_option(1), default=64, help="prisme_103m decode prompt length")
    hf.add_argument("--big-new-tokens", type=count_option(1), default=None,
                    help="prisme_103m forced tokens per sample (default 8)")
    hf.add_argument("--batches", default=None, help="prisme_103m decode batch sizes (default 1,8)")
    hf.add_argument("--prefill-tokens", type=count_option(1), default=512, help="prisme_103m prefill length")
    hf.add_argument("--warmups", type=count_option(0), default=2,
                    help="untimed repeats before timing (prisme_103m: at most 1)")
    hf.add_argument("--repeats", type=count_option(1), default=None,
                    help="timed repeats (default 15; prisme_103m: a third, >= 3)")
    hf.add_argument("--threads-small", type=int, default=1, help="torch threads for seed001 (-1 = leave as is)")
    hf.add_argument("--threads-big", type=int, default=2, help="torch threads for prisme_103m (-1 = leave as is)")
    hf.add_argument("--no-compile", action="store_true", help="skip the torch.compile paths")
    hf.add_argument("--stock-layout", action="store_true",
                    help="time our eager path on nn.Linear's [out, in] weights instead of the [in, out] layout")
    tr = bench_parser(bsub, "train", help="training tokens/s and achieved GFLOP/s vs the measured fp32 matmul peak")
    tr.add_argument("--presets", default="demo,prisme_103m", help="comma-separated presets (random weights)")
    tr.add_argument("--quick", action="store_true", help="quarter batches, two matmul sizes, smaller bandwidth buffer")
    tr.add_argument("--warmups", type=count_option(0), default=1, help="untimed steps before timing")
    tr.add_argument("--repeats", type=count_option(1), default=5, help="timed steps per preset")
    tr.add_argument("--threads", type=int, default=2, help="torch CPU threads (-1 = leave as is)")
    tr.add_argument("--stages", default="workspace,controller",
                    help="also time these stages on the presets with a workspace (none = the backbone stage only)")
    tr.add_argument("--stage-presets", default="demo",
                    help="presets whose workspace/controller stages are timed (default: demo; a prisme_103m stage step "
                         "takes minutes on a CPU)")
    tr.add_argument("--compile", action="store_true", help="the stages with the editor under torch.compile")
    tr.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]: where the steps and matmuls run")
    dc = bench_parser(bsub, "decode", help="one decode step of a router model by part: time and ops per part, and "
                         "time over its backbone's step / ops over its backbone's (routed off, at a deployed price)")
    dc.add_argument("--shapes", default="recall_T32,recall_T1024,demo",
                    help="comma-separated: recall_T32, recall_T1024, recall_T1024_d8, recall_d24_w32, demo, tiny")
    dc.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    dc.add_argument("--prompt-len", type=count_option(1), default=None,
                    help="prompt tokens per row (default: 8; 1,000 for recall_T1024 and recall_T1024_d8)")
    dc.add_argument("--new-tokens", type=count_option(MIN_NEW_TOKENS), default=23,
                    help="generated tokens per row (>= 3; at most T_max - prompt: fewer where a shape has less room, "
                         "noted and recorded)")
    dc.add_argument("--repeats", type=count_option(1), default=7,
                    help="timed rounds (paths rotated each round; one warm-up)")
    dc.add_argument("--edit-rate", type=float, default=None, help="share of positions the deployed price edits "
                    "(default: each shape's study winner's, 12.5%% at T = 32, 0.76%% for recall_T1024)")
    dc.add_argument("--threads", type=int, default=1, help="torch CPU threads (-1 = leave as is)")
    dc.add_argument("--compile", action="store_true", help="also time both router policies with the editor under "
                    "torch.compile (paths off_compiled, routed_compiled; compiles first, minutes on a CPU)")
    dc.add_argument("--no-tables", action="store_true", help="project the recall shape's embedding bank per step "
                    "instead of serving it from per-vocabulary tables (bank_tables=False)")
    dc.add_argument("--bank-store", default="entries", choices=["entries", "ids"],
                    help="what the recall shapes' decode state keeps of their embedding bank: every entry, or the "
                         "token ids alone, K and V looked up where the router fires (bank_store)")
    lg = bench_parser(bsub, "long", help="PRISME against dense attention at long contexts and real widths: decode "
                         "steps at batch 1 and 8 (caches filled synthetically), prefill; tokens/s, ops, time/ops")
    lg.add_argument("--shapes", default="d256_L2",
                    help="comma-separated: d256_L2, d512_L2, d256_L4 (d64_L2: a smoke shape)")
    lg.add_argument("--contexts", default="4096,16384", help="comma-separated contexts T (65536 fits in 24 GB)")
    lg.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    lg.add_argument("--steps", type=count_option(1), default=128,
                    help="teacher-forced decode steps per timed pass, ending at position T")
    lg.add_argument("--repeats", type=count_option(1), default=5,
                    help="timed rounds (paths rotated each round; one warm-up)")
    lg.add_argument("--edit-rate", type=float, default=0.005,
                    help="share of the timed positions the routed path edits (default 0.5%%; at least one "
                         "position edits)")
    lg.add_argument("--bank-source", default="embedding", choices=["embedding", "residual"],
                    help="PRISME's bank: the embedding, kept as token ids (default), or the residual, kept as entries")
    lg.add_argument("--copy-head", action="store_true",
                    help="every model with the copy head (the code recipe's read; the dense rivals get it too)")
    lg.add_argument("--prefill", action="store_true", help="also time each model's prefill of a T-token prompt")
    lg.add_argument("--prefill-repeats", type=count_option(1), default=3, help="timed prefill rounds")
    lg.add_argument("--train", action="store_true", help="also time a training step on one T-token sequence: each "
                    "dense model's, PRISME's backbone stage and its workspace stage")
    lg.add_argument("--train-positions", type=count_option(1), default=256,
                    help="the positions of each sequence the workspace stage trains at (workspace_positions)")
    lg.add_argument("--train-repeats", type=count_option(1), default=2, help="timed training rounds")
    lg.add_argument("--threads", type=int, default=1, help="torch CPU threads (-1 = leave as is)")
    lg.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]: where every model, state and step runs "
                    "(the synthetic fill is drawn on the CPU and copied there; --train runs on the CPU only)")
    s.set_defaults(func=run_bench)
