"""The `prisme` command line: thin argparse front-ends over library functions.

    prisme info                      presets and their parameter counts
    prisme bench kv                  seed 001's KV-cache correctness + timing protocol (and seed 003's memory figures)
    prisme demo                      the main job on the embedded default corpus
"""

from __future__ import annotations

import argparse
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    from .backbone import Backbone
    from .config import PRESETS, PrismeConfig

    print(f"{'preset':<14}{'family':<8}{'V':>7}{'d':>6}{'L':>4}{'heads':>7}{'T_max':>7}{'w':>5}{'M':>4}"
          f"{'backbone params':>17}")
    for name in PRESETS:
        cfg = PrismeConfig.from_name(name)
        with torch.device("meta"):
            n = Backbone(cfg).num_parameters()
        heads = f"{cfg.n_head}/{cfg.n_kv_head}"
        ws = (cfg.w, cfg.n_slots) if cfg.use_workspace else ("-", "-")
        print(f"{name:<14}{cfg.family:<8}{cfg.vocab_size:>7}{cfg.d_model:>6}{cfg.n_layer:>4}{heads:>7}"
              f"{cfg.max_seq_len:>7}{ws[0]:>5}{ws[1]:>4}{n:>17,}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.main(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prisme", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("info", help="list presets and their parameter counts")
    s.set_defaults(func=_cmd_info)

    s = sub.add_parser("bench", help="benchmarks: table for humans, one JSON document for machines")
    bsub = s.add_subparsers(dest="bench", required=True, metavar="WHAT")
    kv = bsub.add_parser("kv", help="KV-cache correctness + timing (seed 001) and memory (seed 003)")
    kv.add_argument("--preset", default="seed001", help="model preset (default: seed001)")
    kv.add_argument("--prompts", default="16,64,128,256", help="comma-separated prompt lengths")
    kv.add_argument("--new-tokens", type=int, default=16, help="forced continuation tokens per prompt")
    kv.add_argument("--warmups", type=int, default=3, help="untimed repeats before timing")
    kv.add_argument("--repeats", type=int, default=15, help="timed repeats per path")
    kv.add_argument("--threads", type=int, default=1, help="torch CPU threads (-1 = leave as is)")
    kv.add_argument("--seed", type=int, default=42, help="seed for weights and tokens")
    kv.add_argument("--json", default=None, help="also write the JSON document to this file")
    s.set_defaults(func=_cmd_bench)

    s = sub.add_parser("demo", help="run the main job on the embedded default corpus")
    s.add_argument("--out", default=None, help="run folder (default: runs/demo-<timestamp>)")
    s.set_defaults(func=_cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # user errors: one clear line, no traceback
        print(f"prisme: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
