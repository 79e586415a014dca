"""The `prisme` command line: thin argparse front-ends over library functions.

    prisme fit DATA --recipe NAME    a folder of text or code -> a deployable PRISME model (every stage, resumable)
    prisme info                      presets and their parameter counts
    prisme bench kv                  seed 001's KV-cache correctness + timing protocol (and seed 003's memory figures)
    prisme bench workspace           decode time per token of seed 000's rows next to their analytic ops
    prisme bench vs-hf               the backbone vs the same weights in HF transformers: logits, decode, prefill
    prisme bench train               training tokens/s and GFLOP/s next to the measured fp32 matmul peak
    prisme eval --checkpoint PATH    every policy's validation loss vs measured ops per token (table, JSON, plot)
    prisme generate --prompt TEXT    sample text with the workspace (KV cache + incremental bank)
    prisme costs --preset NAME       analytic ops per generated token (seed 000's table; --optimised, --json)
    prisme train --config FILE       one training stage (backbone -> workspace -> controller); torchrun for DDP/FSDP2
    prisme study recall              MQAR: controls, 1-layer + workspace on every seed, the controller's allocation
    prisme study text                Austen + a held-out text: every policy with paired intervals, per bank source
    prisme tokenizer train           a byte-level BPE tokenizer (HF tokenizers)
    prisme export-hf                 a checkpoint's backbone + tokenizer as a self-contained HF folder
    prisme demo                      the project's current answers: long-context recall against the dense frontier,
                                     and the text study on Austen (one seed), with a sample
"""

from __future__ import annotations

import argparse
import os
import sys


def _add_compile(parser: argparse.ArgumentParser) -> None:
    """`--compile` / `--compile strict` on a command that runs the workspace (`prisme.model.compiled.maybe_compile`)."""
    parser.add_argument("--compile", nargs="?", const="auto", default=None, choices=["auto", "strict"],
                        help="run the workspace editor under torch.compile (same results; its first calls "
                             "compile); '--compile strict': an error where it cannot compile, instead of one "
                             "warning and the eager editor")


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    from prisme.config import PRESETS, PrismeConfig
    from prisme.model.backbone import Backbone

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


def _cmd_eval(args: argparse.Namespace) -> int:
    from prisme.evaluation.cli import main

    return main(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from prisme.decoding.generate import main

    check_idle_options(args)
    return main(args)


def check_idle_options(args: argparse.Namespace) -> None:
    """`prisme generate`: an option that does nothing under the others is an error naming both, before the model
    loads (`--top-k` / `--top-p` without a temperature decoded greedily without a word; a price, or `--compile`, at
    budget 0 ran the backbone alone); `--prompt-ids` is read by the shared list parser."""
    from prisme.checks import integer, parse_list

    if getattr(args, "prompt_ids", None) is not None:  # the shared list parser: "5,,9" or "5," is no prompt
        parse_list(args.prompt_ids, "--prompt-ids", integer(), example="5,40,9,33")
    given = lambda *names: [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in names  # noqa: E731
                            if getattr(args, n, None) is not None]
    idle = given("top_k", "top_p")
    if idle and not args.temperature:
        raise ValueError(f"{' and '.join(idle)} only shape{'s' if len(idle) == 1 else ''} sampling, but --temperature "
                         f"is 0 (greedy decoding, the default): pass --temperature T > 0 (e.g. 0.8) to sample, or "
                         f"leave {'it' if len(idle) == 1 else 'them'} out")
    idle = given("lambda_cost", "kappa_risk", "target_cost", "compile")
    if idle and args.budget == 0:
        what = "compiles the workspace's editor" if idle == [f"--compile {args.compile}"] else \
            f"price{'s' if len(idle) == 1 else ''} the workspace's edits" if "--compile" not in " ".join(idle) else \
            "shape the workspace's edits"
        raise ValueError(f"{' and '.join(idle)} only {what}, but --budget is 0 (the backbone alone, the default): "
                         f"pass --budget N >= 1, or leave {'it' if len(idle) == 1 else 'them'} out")


def _cmd_costs(args: argparse.Namespace) -> int:
    from prisme.costs.table import costs_cli
    from prisme.training.cli import parse_set

    overrides = dict(parse_set(item) for item in args.set or [])
    overrides = {k.removeprefix("model."): v for k, v in overrides.items()}
    return costs_cli(args, overrides)


def _cmd_train(args: argparse.Namespace) -> int:
    from prisme.training.cli import main

    return main(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from prisme.studies.demo import main
    from prisme.studies.runner import stop_on_signals

    with stop_on_signals():  # SIGINT / SIGTERM end the whole study, 130 / 143
        return main(args)


def _cmd_study(args: argparse.Namespace) -> int:
    from prisme.studies.runner import stop_on_signals

    with stop_on_signals():  # SIGINT / SIGTERM end the whole study, 130 / 143
        from prisme.studies.cli import recall_args, run_text

        if args.study == "text":
            return run_text(args)
        if args.study == "lengths":
            from prisme.studies.recall_lengths import main as study_lengths

            return study_lengths(args)
        if args.study == "code-screen":
            from prisme.studies.code_screen import main as code_screen

            return code_screen(args)
        from prisme.studies.recall import main as study_recall

        return study_recall(recall_args(args))


def _cmd_plot(args: argparse.Namespace) -> int:
    from prisme.training.curves import plot_run

    print(f"wrote {plot_run(args.run, args.out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from prisme import __version__
    from prisme.bench.cli import add_bench_parser
    from prisme.own_data_cli import add_own_data_parsers
    from prisme.studies.cli import add_study_parsers
    from prisme.training.config import STAGES  # the stage registry

    p = argparse.ArgumentParser(prog="prisme", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"prisme {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("info", help="list presets and their parameter counts")
    s.set_defaults(func=_cmd_info)

    add_bench_parser(sub)

    s = sub.add_parser("eval", help="every policy's validation loss vs measured ops per token (table, JSON, plot)")
    s.add_argument("--checkpoint", required=True, help="checkpoint to evaluate (written by `prisme train`)")
    s.add_argument("--matched-backbone", default=None,
                   help="checkpoint whose backbone alone is the 'backbone + matched tokens' baseline")
    s.add_argument("--corpus", default=None, help="austen or mqar (their validation split), or a held-out text scored "
                   "whole: devils_dictionary (embedded), a UTF-8 file or folder (default: the checkpoint's dataset)")
    s.add_argument("--batches", default="8", help="validation batches, or 'all' for the whole split (default 8)")
    s.add_argument("--batch-size", type=int, default=16, help="sequences per batch (default 16)")
    s.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: MQAR length or T_max)")
    s.add_argument("--policies", default=None, help="comma-separated families (default: all that apply; a router "
                   "model's deployed rows are the router's): backbone,matched,fixed,random,dense,controller,router,"
                   "oracle")
    s.add_argument("--lambdas", default=None, help="comma-separated controller/oracle lambdas (default: calibrated)")
    s.add_argument("--oracle-positions", type=int, default=16,
                   help="labelled positions per sequence the oracle samples (-1 = all)")
    s.add_argument("--seed", type=int, default=0, help="seed for random policies and oracle subsampling")
    s.add_argument("--device", default=None, help="auto (default: cuda when available, else cpu), cpu, cuda or cuda:N")
    s.add_argument("--json", default=None, help="write the JSON report to this file")
    s.add_argument("--plot", default=None, help="write the loss-vs-ops Pareto plot (PNG) to this file")
    s.add_argument("--threads", type=int, default=-1, help="torch CPU threads (-1 = leave as is)")
    s.add_argument("--controller-budget", type=int, default=None,
                   help="max edits per position of the controller rows (default r_max)")
    s.add_argument("--kappa-risk", type=float, default=None, help="the controller rows' risk aversion "
                   "(default: the model's, 0)")
    s.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the paired intervals")
    s.add_argument("--bootstrap-seed", type=int, default=0, help="seed of the bootstrap resamples")
    s.add_argument("--reference", action="append", default=None, metavar="NAME=CKPT",
                   help="another model whose backbone alone is scored on the same targets, as row NAME (e.g. a "
                   "backbone-only model of the dense frontier); repeatable")
    s.add_argument("--frontier", default=None, help="comma-separated rows that make the dense frontier (backbone, "
                   "backbone+matched, reference names; 'references' = every --reference): every other row gets "
                   "its frontier gap, its loss minus the frontier interpolated in log ops at its ops")
    s.add_argument("--routing-bound", action="store_true", help="also the oracle-routed bound against the frontier "
                   "of the --reference models: the oracle's budget-1 edit at the positions where it helps most, at "
                   "the router's price, over routed shares of the positions (can any router reach the frontier?)")
    s.add_argument("--slices", type=int, default=None, metavar="N",
                   help="split every row into AR-hit / seen-miss / other positions by N-grams (e.g. 4)")
    s.add_argument("--slices-window", type=int, default=None, metavar="W",
                   help="with --slices: split the AR hits into those within an attention window of W positions and "
                        "those beyond it (what only a model that reads farther back can copy)")
    _add_compile(s)
    s.set_defaults(func=_cmd_eval)

    s = sub.add_parser("generate", help="generate text with the workspace (greedy or sampled, budget, lambda)")
    s.add_argument("--allow-untrained", action="store_true",
                   help="run a budget whose workspace, router or controller no stage of the checkpoint trained "
                        "(a warning instead of an error)")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--preset", default="demo", help="model preset with random weights (default: demo)")
    src.add_argument("--checkpoint", default=None, help="checkpoint, stage folder, or a demo/study folder (its most "
                     "trained stage) to load instead of a preset")
    prompt = s.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", default=None,
                        help="prompt as comma-separated token ids (models without a text tokenizer, e.g. MQAR)")
    s.add_argument("--tokenizer", default=None,
                   help="'byte' or a saved BPE tokenizer (file, or a folder holding tokenizer.json); default: the "
                        "checkpoint's own tokenizer, or 'byte' for a preset")
    s.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    s.add_argument("--budget", type=int, default=0, help="controller budget per token, 0..r_max (0 = backbone only)")
    s.add_argument("--lambda-cost", type=float, default=None, help="price of compute (default: the model's, 0)")
    s.add_argument("--kappa-risk", type=float, default=None, help="risk aversion (default: the model's, 0)")
    s.add_argument("--target-cost", type=float, default=None,
                   help="target mean ops per token relative to the backbone (>= 1); lambda found by bisection")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    s.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (and the random weights' seed for --preset)")
    s.add_argument("--threads", type=int, default=-1, help="torch CPU threads (-1 = leave as is)")
    s.add_argument("--show-edits", action="store_true", help="print how many edits each generated token got")
    s.add_argument("--device", default=None, help="auto (default: cuda when available, else cpu), cpu, cuda or cuda:N")
    _add_compile(s)
    s.set_defaults(func=_cmd_generate)

    s = sub.add_parser("costs", help="analytic ops per generated token: seed 000's rows (+ the optimised column)")
    s.add_argument("--preset", default="prisme_103m", help="model preset (default: prisme_103m)")
    s.add_argument("--context", type=int, default=None, help="context length T (default: the preset's cost_context)")
    s.add_argument("--optimised", action="store_true",
                   help="add the optimised column (folded readout, M-slot controller projection) and the saving "
                        "per row")
    s.add_argument("--slot-kv-cache", action="store_true",
                   help="with --optimised: price the editor's slot K/V cache too (ExecutionOptions.slot_kv_cache; off "
                        "by default)")
    s.add_argument("--json", action="store_true", help="print one JSON document in seed 000's layout instead")
    s.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="a model field of the preset (--set attn_window=64 --set router=true); repeatable")
    s.add_argument("--fire-rate", type=float, default=None, metavar="R",
                   help="also the deployed row: a router model at budget 1 over a sequence of T (each position at "
                        "its own context), R of the positions editing one slot (e.g. 0.005)")
    s.add_argument("--bank-store", default="entries", choices=["entries", "ids"],
                   help="with --fire-rate: the bank kept as projected entries (the studies' pricing, default) or as "
                        "token ids and tables (an embedding bank, as `bench decode --bank-store ids` runs it)")
    s.add_argument("--sequence", action="store_true",
                   help="also the backbone alone over a sequence of T, each position at its own context (how the "
                        "studies price every model)")
    s.set_defaults(func=_cmd_costs)

    s = sub.add_parser("train", help="train one stage (backbone, workspace, controller, router); under torchrun: "
                                     "DDP/FSDP2",
                       description="Train one stage. Several processes: torchrun --nproc_per_node=N -m prisme train "
                                   "... (gloo on CPU, nccl on CUDA); --batch-size is the global batch.")
    s.add_argument("--config", default=None,
                   help="run config JSON (StageConfig fields + optional 'model'), or a shipped recipe's name "
                        "(prisme/configs/: demo_backbone, recall_router, ...)")
    s.add_argument("--stage", default=None, choices=list(STAGES),
                   help="stage to train (overrides the config's)")
    s.add_argument("--preset", default=None, help="model preset for a fresh backbone stage (overrides 'model')")
    s.add_argument("--init-from", default=None, help="previous stage's checkpoint or run folder")
    s.add_argument("--out", default=None, help="run folder for checkpoints and metrics (StageConfig.out_dir)")
    s.add_argument("--resume", action="store_true", help="continue the latest checkpoint in --out exactly")
    s.add_argument("--rebase", action="store_true",
                   help="start from --init-from's trained backbone under another model config (e.g. another "
                        "workspace design): the new parts are initialised with --seed")
    s.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --out (its checkpoints, metrics and stage config) instead of "
                        "refusing to start")
    s.add_argument("--reschedule", action="store_true",
                   help="with --resume and another --steps: accept the new learning-rate schedule")
    s.add_argument("--steps", type=int, default=None, help="optimizer steps")
    s.add_argument("--batch-size", type=int, default=None, help="global batch (sequences per optimizer step)")
    s.add_argument("--grad-accum", type=int, default=None, help="micro-batches per step on each process")
    s.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    s.add_argument("--lr", type=float, default=None, help="peak learning rate")
    s.add_argument("--seed", type=int, default=None, help="seed for init, data order and random actions")
    s.add_argument("--dataset", default=None, help="austen (embedded), a text file or folder, a folder `prisme data "
                                                   "prepare` wrote, or mqar")
    s.add_argument("--tokenizer", default=None,
                   help="byte (default) or a BPE from `prisme tokenizer train` (a file, or a folder holding "
                        "tokenizer.json, e.g. the previous stage's checkpoint); saved with every checkpoint")
    s.add_argument("--device", default=None, help="auto (default: cuda when available, else cpu), cpu, cuda or cuda:N")
    s.add_argument("--dtype", default=None, choices=["float32", "float64", "bfloat16"],
                   help="float32/float64 weights, or bf16 autocast over float32 weights")
    s.add_argument("--parallel", default=None, choices=["ddp", "fsdp"], help="multi-process wrapper (torchrun)")
    s.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on CUDA (Ampere+; off by default)")
    s.add_argument("--tensorboard", nargs="?", const=True, default=None, metavar="DIR",
                   help="also write tensorboard events (into the run folder's tb/, or DIR; pip install 'prisme[tb]')")
    s.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="any StageConfig field (--set warmup=100), or a model field (--set model.d_model=128); "
                        "repeatable; values read as JSON, else as text")
    s.add_argument("--backbone-keeps-learning", action="store_true",
                   help="workspace stage: train the backbone too (train_backbone_in_workspace_stage)")
    s.add_argument("--threads", type=int, default=-1, help="torch CPU threads per process (-1 = leave as is)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_compile(s)
    s.set_defaults(func=_cmd_train)

    s = sub.add_parser("plot", help="a run's curves (train/val loss, tokens/s, workspace gates) as a PNG")
    s.add_argument("run", help="a run folder written by `prisme train` (finished or still training)")
    s.add_argument("--out", default=None, help="the PNG to write (default: RUN/curves.png)")
    s.set_defaults(func=_cmd_plot)

    add_own_data_parsers(sub)
    add_study_parsers(sub, _add_compile, _cmd_study, _cmd_demo)
    return p


FOLDER_OUTPUTS = ("train", "study", "demo", "export-hf", "data", "fit")  # commands whose --out is a folder (else: a
#   file)


def check_outputs(args: argparse.Namespace) -> None:
    """Every output path a command was given, before it does any work (a study or a benchmark never fails on a path
    after hours): --json and --plot are files, --out a folder (a file for `plot` and `tokenizer train`); a ValueError
    naming the option."""
    from prisme.io import check_output_file, check_output_folder

    for option in ("json", "plot"):
        if isinstance(value := getattr(args, option, None), str):
            check_output_file(value, f"--{option}")
    if (out := getattr(args, "out", None)) is not None:
        (check_output_folder if args.command in FOLDER_OUTPUTS else check_output_file)(out, "--out")


# options whose value may start with "-<digit>" (argparse would read "-1,2" as an unknown option)
NEGATIVE_VALUE_OPTIONS = ("--prompt-ids", "--prompt")


def attach_negative_values(argv: list[str]) -> list[str]:
    """`--prompt-ids -1,2` -> `--prompt-ids=-1,2`, so the value reaches its own check (which names the bad id)
    instead of argparse's "expected one argument"."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in NEGATIVE_VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1][:1] == "-" \
                and argv[i + 1][1:2].isdigit():
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    """Every failure goes through here: a user error (ValueError, a missing or unreadable file) prints one line
    `prisme: error: ...` and exits 2; anything else does the same with its type (PRISME_DEBUG=1 shows the traceback);
    Ctrl-C exits 130 without a traceback (a study stopped by SIGTERM: 143); a closed output pipe (`prisme info |
    head -1`) exits quietly."""
    args = build_parser().parse_args(attach_negative_values(sys.argv[1:] if argv is None else list(argv)))
    try:
        check_outputs(args)
        return int(args.func(args) or 0)
    except BrokenPipeError:
        _silence_stdout()
        return 0
    except KeyboardInterrupt as e:  # a study's `StudyInterrupted` names its signal and how to continue
        sig = getattr(e, "signal", "SIGINT")
        print(f"prisme: interrupted: {e}" if str(e) else "prisme: interrupted", file=sys.stderr)
        return 143 if sig == "SIGTERM" else 130
    except ValueError as e:  # user errors: one clear line, no traceback
        print(f"prisme: error: {e}", file=sys.stderr)
        return 2
    except (OSError, UnicodeError) as e:
        print(f"prisme: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one handler for every failure; the traceback on request
        if os.environ.get("PRISME_DEBUG"):
            raise
        print(f"prisme: error: {type(e).__name__}: {e} (PRISME_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2


def _silence_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover - stdout without a file descriptor (captured in tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
