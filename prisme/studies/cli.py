"""The command line of `prisme study recall`, `prisme study text`, `prisme study lengths` and `prisme demo`: their
options, on the `prisme` parser (`prisme.cli`), and how the text study's (and the recall study's lists) are read and
checked before anything trains; each study's module is imported only when it runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from prisme.checks import count_option


def add_study_parsers(sub: Any, add_compile: Callable[[argparse.ArgumentParser], None], run_study: Callable,
                      run_demo: Callable) -> None:
    """The `study` command (recall, text) and `demo`, on the `prisme` parser's subparsers `sub`; `add_compile` adds
    `--compile`, `run_study` / `run_demo` are the commands' entry points."""
    s = sub.add_parser("study", help="controlled studies with success rates over seeds")
    ssub = s.add_subparsers(dest="study", required=True)
    r = ssub.add_parser("recall", help="MQAR: 1-layer backbone + workspace vs controls, the controller's allocation")
    r.add_argument("--seeds", default=None, help="comma-separated seeds (default: recall_study.json's, 0,1,2,3,4)")
    r.add_argument("--out", default=None, help="study folder (default: runs/recall)")
    r.add_argument("--jobs", type=int, default=None, help="worker processes (default 0 = one per CPU core)")
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads per worker (default 1)")
    r.add_argument("--json", default=None, help="also write the JSON document to this file (atomically)")
    r.add_argument("--quick", action="store_true", help="one seed, few steps: a smoke run of every phase")
    r.add_argument("--bank-source", default=None,
                   help="override the recipe's bank and query source (e.g. residual: the seed's, for comparison)")
    r.add_argument("--configs", default=None,
                   help="folder holding recall_*.json (default: the shipped recipes, prisme/configs/)")
    r.add_argument("--frontier", action="store_true",
                   help="the dense frontier instead of the controller runs: backbones alone over depths x widths and "
                        "the PRISME family with its router, every seed, ops against the same reference")
    r.add_argument("--context", nargs="?", const="default", default=None, metavar="T1,T2,...",
                   help="with --frontier: the long-context study at these sequence lengths (alone: recall_study.json's "
                        "context_lengths, 256,512,1024), every query's pair beyond the largest attention window")
    r.add_argument("--evaluate-only", action="store_true",
                   help="train nothing: score the checkpoints an earlier run with the same settings left in --out")
    r.add_argument("--reuse", default=None, metavar="FOLDER",
                   help="copy the finished runs of the study in FOLDER that trained exactly as these settings would "
                        "(same model and stage configs) instead of training them again; every run is scored again")
    r.add_argument("--confirm-seeds", default=None, metavar="S1,S2,...",
                   help="with --frontier: the fresh seeds of the confirmation pass, where the models that decide the "
                        "verdict train again and the verdict is restated from them (default: the 3 seeds after the "
                        "largest study seed; none: no pass); a seed of the study's is an error")
    r.add_argument("--confirm-of", default=None, metavar="DOC.json",
                   help="with --frontier: confirm a recorded study (its JSON document, or prisme/reference/"
                        "recall_context_frontier.json): its deciding models, taken from this study's grid by name, "
                        "train on the fresh seeds alone; its seeds are the study's")
    r.add_argument("--no-progress", action="store_true", help="no per-run progress lines on stderr")
    r.add_argument("--resume", action="store_true", help="continue the study an interrupted run left in --out (a "
                   "rerun with the same settings does so too): finished runs are kept, interrupted stages resume")
    add_compile(r)
    add_executor(r)
    r.set_defaults(func=run_study)
    t = ssub.add_parser("text", help="a corpus (Austen, or --corpus) + a held-out text over training seeds: every "
                                     "policy vs the backbone, the matched one and the dense frontier, with paired "
                                     "intervals, per bank source")
    t.add_argument("--corpus", default=None, metavar="NAME|FILE|FOLDER|PREPARED",
                   help="the training text and its validation split: an embedded corpus (austen, bierce, "
                        "python-stdlib, click), a UTF-8 file (split contiguously), a folder of text files (split by "
                        "whole files) or a folder `prisme data prepare` wrote (default: austen)")
    t.add_argument("--sources", default=None, help="comma-separated bank sources: residual, embedding, residual_shift, "
                   "residual_preceding, embedding_preceding (the key reads the preceding byte alone: a one-step "
                   "induction read) (default: residual,embedding)")
    t.add_argument("--seeds", default=None, help="training seeds, comma-separated (default 1337,1338,1339): every "
                   "run per seed, every claim over them")
    t.add_argument("--seed", type=int, default=None, help="one training seed (the same as --seeds N)")
    t.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps (0.05 = smoke run)")
    t.add_argument("--frontier", default=None,
                   help="the dense frontier: backbones alone as LAYERS[xWIDTH][wWINDOW][ks] (a width, a causal "
                        "attention window, the key shift), comma-separated (default 1,2,3,1x96,1ks,2ks,3ks; with "
                        "--context: 1,1ks,2ks,3ks,1w64,1w64ks,2w64ks,3w64ks)")
    t.add_argument("--context", type=int, default=None,
                   help="long contexts: train and score windows of this many bytes (e.g. 1024); PRISME's backbone is "
                        "local (a 64-byte window with the key shift), its workspace reads the whole window where its "
                        "router fires; the slices split AR hits by that window")
    t.add_argument("--ngram", type=int, default=4, help="n of the AR-hit / seen-miss / other slices (default 4)")
    t.add_argument("--window", type=int, default=None,
                   help="evaluation window length (default 128, the workspace stage's; at most the preset's 256)")
    t.add_argument("--val-batches", default="8", help="validation batches of 64 x 128, or 'all' (default 8)")
    t.add_argument("--held-out", default="devils_dictionary", metavar="NAME|FILE|FOLDER",
                   help="held-out text, scored whole, chosen as --corpus is (e.g. click: held-out code; default: the "
                        "embedded devils_dictionary, Bierce)")
    t.add_argument("--prisme-layers", type=int, default=None, metavar="N",
                   help="with --context: PRISME's backbone depth (default 1), a 64-window key-shift backbone of N "
                        "layers; the dense frontier must hold its twins, N layers global and N layers at the 64 "
                        "window (the default frontier does for N = 1, 2, 3)")
    t.add_argument("--workspace-steps", type=int, default=None, metavar="N",
                   help="with --context: the workspace stage's steps of 2 x T bytes, times --scale (default 240: "
                        "0.49 MB at T = 1,024); the matched backbone and every frontier model train on the added "
                        "bytes too")
    t.add_argument("--router-prices", default=None, metavar="L1,L2,...",
                   help="with --context: the router's prices (lambda) its deployed rows are scored at (default "
                        "0.003,0.01,0.03); a higher price fires at fewer positions")
    t.add_argument("--copy-head", choices=("auto", "on", "off"), default="auto",
                   help="with --context: PRISME's backbone gets the copy head (prisme.model.copy: the next byte copied "
                        "from the context's exact matches, a learned gate; its copy stage after stage 1) and every "
                        "dense frontier model a twin with the same head (+copy); auto: on for a corpus split by whole "
                        "files (code, a folder), off otherwise")
    t.add_argument("--copy-steps", type=count_option(1), default=None, metavar="N",
                   help="the copy stage's steps of 4 x 1,024 bytes, times --scale (default 500), PRISME's and each "
                        "dense twin's")
    t.add_argument("--out", default=None, help="study folder (default: runs/text)")
    t.add_argument("--jobs", type=int, default=None, help="worker processes (default 0 = one per CPU core)")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads per worker (default 1)")
    t.add_argument("--json", default=None, help="also write the JSON document to this file (atomically)")
    t.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    t.add_argument("--resume", action="store_true", help="continue the study an interrupted run left in --out (a "
                   "rerun with the same settings does so too): finished tasks are kept, interrupted stages resume")
    t.add_argument("--so-far", action="store_true",
                   help="report the study in --out as it stands (running or stopped, the same settings): every seed "
                        "whose evaluations have finished, its rows, gaps and verdicts; nothing trains (the "
                        "confirmation pass is reported when the study ends)")
    t.add_argument("--reuse", default=None, metavar="FOLDER",
                   help="copy the finished runs of the text study in FOLDER (or a demo's FOLDER/text) that trained "
                        "exactly as these settings would instead of training them again; every run is scored again "
                        "(e.g. on another --held-out text, with other --val-batches or --ngram)")
    t.add_argument("--confirm-seeds", default=None, metavar="S1,S2,...",
                   help="the fresh seeds of the confirmation pass: the runs that decide each verdict (the workspace "
                        "row closest to the dense frontier and the dense models it is compared with) train again on "
                        "them and the verdict is restated (default: the 3 seeds after the largest study seed; for a "
                        "study folder started without a pass, none; none: no pass); a study seed is an error")
    add_compile(t)
    add_executor(t)
    t.set_defaults(func=run_study)

    c = ssub.add_parser("code-screen", help="a far-read design for code at T = 1,024 in minutes: the code backbones "
                                            "(cached), a short stage per design, every row on fixed subsets of the "
                                            "validation split and the held-out code, by copy distance")
    c.add_argument("--designs", default=None, help="comma-separated designs (default: all of them; see "
                   "prisme.studies.code_screen.DESIGNS): reference, reference_any, cache, copy, copy_stream, "
                   "copy_wide, copy_long, copy_joint, workspace")
    c.add_argument("--seed", type=int, default=1337, help="training seed (default 1337)")
    c.add_argument("--depth", type=int, default=2, help="the backbones' layers: PRISME's 64-window one and its global "
                   "twin (default 2)")
    c.add_argument("--out", default="runs/code-screen", help="screen folder (default: runs/code-screen)")
    c.add_argument("--backbones", default=None, metavar="FOLDER", help="a text study's (or screen's) folder whose "
                   "seed<N>/frontier backbones to reuse (default: --out)")
    c.add_argument("--held-out", default="click", metavar="NAME|FILE|FOLDER", help="held-out code (default: click)")
    c.add_argument("--val-windows", type=count_option(1), default=64, help="validation windows (default 64)")
    c.add_argument("--held-out-windows", default="all", help="held-out windows spread over the text, or all "
                   "(default)")
    c.add_argument("--steps", type=count_option(1), default=500, help="the copy stage's steps of 4 x 1,024 bytes "
                   "(default 500)")
    c.add_argument("--threads", type=count_option(1), default=1, help="torch CPU threads (default 1)")
    c.add_argument("--json", default=None, help="also write the JSON document to this file (atomically)")
    c.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    c.set_defaults(func=run_study)

    n = ssub.add_parser("lengths", help="a long-context recall study's trained models scored and decoded at longer "
                                         "contexts than they trained on (PRISME at its price, each dense model)")
    n.add_argument("runs", help="the study folder (`prisme study recall --frontier --context 1024 --out FOLDER`)")
    n.add_argument("--contexts", default="2048,4096,8192,16384",
                   help="comma-separated contexts longer than 1,024 (default 2048,4096,8192,16384)")
    n.add_argument("--sequences", type=count_option(1), default=128,
                   help="held-out MQAR sequences per model, seed and context (4 queries each; default 128)")
    n.add_argument("--repeats", type=count_option(1), default=2, help="timed decoding rounds (one warm-up)")
    n.add_argument("--threads", type=int, default=1, help="torch CPU threads (-1 = leave as is)")
    n.add_argument("--json", default=None, help="also write the JSON document to this file (atomically)")
    n.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    n.set_defaults(func=run_study)

    s = sub.add_parser("demo", help="the project's current answers: long-context recall against the dense frontier and "
                                    "the text study on Austen (one seed), with a sample")
    s.add_argument("--out", default=None, help="run folder (default: runs/demo-<timestamp>)")
    s.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps (e.g. 0.05 = smoke run)")
    s.add_argument("--threads", type=int, default=-1, help="torch CPU threads (-1 = leave as is)")
    s.add_argument("--seed", type=int, default=1337, help="seed for init, data order and random actions")
    s.add_argument("--eval-batches", type=int, default=8, help="validation batches (64 x 128 tokens) per policy")
    s.add_argument("--recall-seeds", default=None,
                   help="seeds of the long-context recall run (comma-separated; default 30, the study's first; "
                        "'none' skips it)")
    s.add_argument("--jobs", type=int, default=0, help="worker processes (default 0 = one per CPU core)")
    s.add_argument("--sources", default=None, help="bank sources of the text study (default: residual; "
                   "residual,embedding = the full `prisme study text`)")
    s.add_argument("--backbone-keeps-learning", action="store_true",
                   help="stage 2 also trains the backbone, from its own loss only, on exactly the matched baseline's "
                        "steps (default: frozen, as SPEC stage 2)")
    s.add_argument("--resume", action="store_true", help="continue the demo an interrupted run left in --out (a "
                   "rerun with the same settings does so too)")
    s.add_argument("--verbose", action="store_true", help="print every table too (they are in report.txt)")
    add_compile(s)
    add_executor(s)
    s.set_defaults(func=run_demo)


def add_executor(p: argparse.ArgumentParser) -> None:
    """--executor / --address: where a study's runs go (this machine's worker processes, or a Ray cluster)."""
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="local: worker processes of this machine (--jobs); ray: each run a Ray task on the cluster "
                        "at --address, asking for --threads CPUs (and a GPU where the cluster has them); the --out "
                        "folder must be on a filesystem every node mounts at the same path (pip install 'prisme[ray]')")
    p.add_argument("--address", default=None,
                   help="with --executor ray: the cluster (e.g. auto, HOST:6379, ray://HOST:10001; default: "
                        "RAY_ADDRESS, else a new local cluster)")


# ----------------------------------------------------------------------------------------------------- the commands
def run_text(args: Any) -> int:
    """`prisme study text`: every option read and checked (`text_config`), then every input (`text.prepare_study`),
    before anything trains."""
    from prisme.studies.recall_report import emit_study
    from prisme.studies.text import document_so_far, format_report, run_study

    if getattr(args, "so_far", False):
        if getattr(args, "resume", False) or getattr(args, "reuse", None):
            raise ValueError("--so-far reports a study as it stands: it takes neither --resume nor --reuse")
        return emit_study(document_so_far(text_config(args)), format_report, args.json)
    return emit_study(run_study(text_config(args), resume=getattr(args, "resume", False)), format_report, args.json)


def text_config(args: Any) -> Any:
    """The text study's settings (`TextStudyConfig`) from its command line, checked: a ValueError naming the option
    for a bad one."""
    from prisme.checks import number, one_of, parse_list
    from prisme.config import PrismeConfig
    from prisme.data.text import HELD_OUT_TEXT
    from prisme.studies.confirm import parse_confirm_seeds
    from prisme.studies.recall_setup import parse_seeds
    from prisme.studies.text_setup import DEFAULT_SEEDS, SOURCES, TextStudyConfig, parse_frontier

    opt = lambda name: getattr(args, name, None)  # noqa: E731 - an option the caller may leave out
    if opt("seeds") is not None and opt("seed") is not None:
        raise ValueError(f"--seeds {args.seeds} and --seed {args.seed} both set the training seeds: give one")
    seeds = parse_seeds(args.seeds) if opt("seeds") is not None else None if opt("seed") is None else [args.seed]
    val = "8" if opt("val_batches") is None else str(args.val_batches).strip()
    if val.lower() != "all" and not (val.isdigit() and int(val) >= 1):
        raise ValueError(f"--val-batches must be a number of batches >= 1, or all; got {val!r}")
    held_out = HELD_OUT_TEXT if opt("held_out") is None else args.held_out
    if not held_out.strip():
        raise ValueError("--held-out is empty: give a text file or folder, or devils_dictionary (the default)")
    corpus = "austen" if opt("corpus") is None else args.corpus
    if not corpus.strip():
        raise ValueError("--corpus is empty: give a corpus name, a text file or folder, or austen (the default)")
    given = {"seeds": seeds, "sources": None if opt("sources") is None else parse_list(
                 args.sources, "--sources", one_of(SOURCES), example="residual,embedding", distinct=True),
             "context_frontier" if opt("context") else "frontier": None if opt("frontier") is None
             else parse_frontier(args.frontier)}
    out = args.out or "runs/text"
    confirm = parse_confirm_seeds(opt("confirm_seeds"))
    given["confirm_seeds"] = default_confirm_seeds(out, seeds or DEFAULT_SEEDS) if confirm is None else confirm
    cfg = TextStudyConfig(**{k: v for k, v in given.items() if v is not None}, scale=args.scale, out_dir=out,
                          jobs=args.jobs or 0, threads=1 if opt("threads") is None else args.threads,
                          progress=not args.no_progress,
                          executor=opt("executor") or "local", address=opt("address"),
                          val_batches=None if val.lower() == "all" else int(val),
                          held_out=held_out, compile=opt("compile") or "off", window=opt("window"),
                          slice_ngram=4 if opt("ngram") is None else args.ngram, context=opt("context"),
                          reuse=opt("reuse"), corpus=corpus, prisme_layers=opt("prisme_layers"),
                          workspace_steps=opt("workspace_steps"),
                          copy_head={"on": True, "off": False}.get(opt("copy_head") or "auto"),
                          **({} if opt("router_prices") is None else {"context_lambdas": parse_list(
                              args.router_prices, "--router-prices", number(0.0), example="0.01,0.03,0.1",
                              distinct=True)}),
                          **({} if opt("copy_steps") is None else {"copy_steps": opt("copy_steps")}))
    return cfg.validate(PrismeConfig.from_name("demo"))  # before anything trains


def default_confirm_seeds(out: str, seeds: list[int]) -> list[int]:
    """`prisme study text` without `--confirm-seeds`: the 3 seeds after the largest study seed; for a folder where a
    text study was started with these seeds, the fresh seeds it was started with (none when it was started without a
    confirmation pass, before the option existed or with `--confirm-seeds none`): a rerun continues it."""
    import sys

    from prisme.studies.confirm import seeds_after
    from prisme.studies.records import recorded_study

    study = (recorded_study(out) or {}).get("study")
    if not isinstance(study, dict) or study.get("seeds") != list(seeds):
        return seeds_after(seeds)
    fresh = list(study.get("confirm_seeds") or [])
    if not fresh:
        print(f"the text study in {out} was started without a confirmation pass: it continues without one (to add "
              f"one, start a study in another --out with --reuse {out} and --confirm-seeds)", file=sys.stderr)
    return fresh


def recall_args(args: argparse.Namespace) -> argparse.Namespace:
    """`prisme study recall`'s lists read before the study: `--context` a set of distinct lengths, in increasing order
    (`--context 512,256` is the study of `--context 256,512`)."""
    from prisme.checks import integer, parse_list

    if getattr(args, "context", None) not in (None, "default"):
        lengths = parse_list(args.context, "--context", integer(1), example="256,512,1024", distinct=True)
        args.context = ",".join(map(str, sorted(lengths)))
    return args
