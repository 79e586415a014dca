"""The commands that take your own data: `prisme fit` (a folder of text or code -> a deployable model, every stage of
a recipe), `prisme data prepare` (documents -> memory-mapped token files), `prisme tokenizer train` (a byte-level BPE)
and `prisme export-hf` (a checkpoint -> a Hugging Face folder): their parsers and the few lines each runs over a
library call."""

from __future__ import annotations

import argparse


def cmd_fit(args: argparse.Namespace) -> int:
    from prisme.studies.fit import main
    from prisme.studies.runner import stop_on_signals

    with stop_on_signals():  # SIGINT / SIGTERM: the stage saves, 130 / 143; the same command continues
        return main(args)


def cmd_data(args: argparse.Namespace) -> int:
    from prisme.checks import parse_list
    from prisme.data.shards import prepare
    from prisme.data.tokenizers import tokenizer_named

    ext = () if not getattr(args, "ext", None) else tuple(parse_list(args.ext, "--ext", example="js,ts"))
    if not 0 < args.val_fraction < 1:  # `prepare(val_fraction=0)` makes a folder no training can validate on
        raise ValueError(f"--val-fraction must be in (0, 1) (training validates on those documents), got "
                         f"{args.val_fraction}")
    tok = tokenizer_named(args.tokenizer)
    m = prepare(args.source, args.out, tok, args.text_field, args.val_fraction, args.seed, ext)
    print(f"wrote {args.out}: {m['documents']['train']:,} + {m['documents']['val']:,} documents, "
          f"{m['tokens']['train']:,} + {m['tokens']['val']:,} tokens (train + val, {m['dtype']}); "
          f"{len(m['skipped'])} files skipped; train with `prisme train --dataset {args.out}`")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from prisme.checks import parse_list
    from prisme.data.shards import folder_text
    from prisme.data.text import EMBEDDED_TEXTS, load_text
    from prisme.data.tokenizers import BPETokenizer

    if isinstance(args.vocab_size, bool) or args.vocab_size <= 256:
        raise ValueError(f"--vocab-size must be > 256 (the 256 bytes come first), got {args.vocab_size}")
    ext = () if not args.ext else tuple(parse_list(args.ext, "--ext", example="js,ts"))
    named = args.corpus in EMBEDDED_TEXTS or not Path(args.corpus).is_dir()
    text = load_text(args.corpus) if named else folder_text(args.corpus, ext)
    tok = BPETokenizer.train(text, args.vocab_size)
    tok.save(args.out)
    print(f"wrote {args.out}: a byte-level BPE of {tok.vocab_size} ids trained on {args.corpus}")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from prisme.interop import INSTALL_HINT, export_hf_checkpoint, hf_available

    if not hf_available():
        raise ValueError(f"export-hf needs the optional `transformers` package: {INSTALL_HINT}")
    if args.workspace:
        from prisme.hf_full import export_hf_full

        out = export_hf_full(args.checkpoint, args.out, args.budget, args.lambda_cost)
        print(f"wrote {out}: the whole model (workspace, controller, router), its tokenizer and a model card, "
              f"loadable with AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True) where prisme is "
              f"installed")
        return 0
    export_hf_checkpoint(args.checkpoint, args.out, args.tokenizer)
    print(f"wrote {args.out}: the backbone (the workspace is not exported) and its tokenizer, loadable with "
          f"AutoModelForCausalLM / AutoTokenizer.from_pretrained")
    return 0


def add_own_data_parsers(sub: argparse._SubParsersAction) -> None:
    """`fit`, `data`, `tokenizer` and `export-hf` on the command line's subparsers."""
    s = sub.add_parser("fit", help="a folder of text or code -> a deployable PRISME model: every stage of a recipe, "
                                   "resumable",
                       description="Train every stage of a recipe on your data: the data prepared into OUT/data, each "
                                   "stage in its own folder of OUT (resumed where it stopped; rerun the command to "
                                   "continue), OUT/fit.json naming the deployable stage. Recipes: text (T = 128, "
                                   "controller), long-context (T = 1,024, 64-window backbone, router), code "
                                   "(T = 1,024, "
                                   "2 layers, the copy head, router).")
    s.add_argument("data", help="a folder (recursive: .txt, .md, .py, .jsonl and --ext), a text file, or a folder "
                                "`prisme data prepare` wrote")
    s.add_argument("--recipe", default="long-context", help="text, long-context (default) or code")
    s.add_argument("--out", default="runs/fit", help="the fit's folder (default runs/fit)")
    s.add_argument("--scale", type=float, default=1.0, help="multiplies every stage's steps (0.02: about a minute "
                                                             "for the text recipe on 2 cores)")
    s.add_argument("--seed", type=int, default=1337, help="seed for init, data order and the split")
    s.add_argument("--tokenizer", default="byte", help="byte (default) or a BPE from `prisme tokenizer train`")
    s.add_argument("--ext", default=None, help="more file suffixes a folder's documents have, comma-separated "
                                               "(e.g. js,ts,rs)")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_fit)

    s = sub.add_parser("data", help="your own data: documents -> memory-mapped token files for `train --dataset`")
    dsub = s.add_subparsers(dest="data_cmd", required=True)
    dp = dsub.add_parser("prepare", help="a folder (recursive: .txt, .md, .py, .jsonl), a file, or a saved HF dataset "
                                         "-> "
                                         "train.bin / val.bin + manifest.json (whole documents per split)")
    dp.add_argument("source", help="a folder, a .txt/.md/.py/.jsonl file, or a datasets.save_to_disk folder")
    dp.add_argument("--ext", default=None, help="more file suffixes a folder's documents have, comma-separated "
                                                "(e.g. js,ts,rs)")
    dp.add_argument("--out", required=True, help="folder to write (must not exist or be empty)")
    dp.add_argument("--tokenizer", default="byte", help="byte (default) or a BPE from `prisme tokenizer train`")
    dp.add_argument("--text-field", default="text", help="the text field of .jsonl rows / dataset columns")
    dp.add_argument("--val-fraction", type=float, default=0.1, help="share of the documents held out (default 0.1)")
    dp.add_argument("--seed", type=int, default=0, help="seed of the documents' split")
    dp.set_defaults(func=cmd_data)

    s = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = s.add_subparsers(dest="tokenizer_cmd", required=True)
    tt = tsub.add_parser("train", help="train a byte-level BPE (HF tokenizers; pip install 'prisme[bpe]')")
    tt.add_argument("--corpus", default="austen", help="austen (embedded), devils_dictionary, a text file, or a folder "
                                                         "(recursive: .txt, .md, .py, .jsonl and --ext)")
    tt.add_argument("--ext", default=None, help="more file suffixes a folder's documents have, comma-separated "
                                                "(e.g. js,ts,rs)")
    tt.add_argument("--vocab-size", type=int, required=True, help="ids in all (> 256: the bytes come first)")
    tt.add_argument("--out", required=True, help="tokenizer JSON to write (use it as --tokenizer / \"tokenizer\")")
    tt.set_defaults(func=cmd_tokenizer)

    s = sub.add_parser("export-hf", help="write a checkpoint's backbone and tokenizer as an HF folder (needs [hf])")
    s.add_argument("--checkpoint", required=True, help="checkpoint, stage folder or demo/study folder")
    s.add_argument("--out", required=True, help="folder to write (save_pretrained layout)")
    s.add_argument("--tokenizer", default=None,
                   help="byte, a BPE tokenizer JSON, or none (default: the checkpoint's own tokenizer)")
    s.add_argument("--workspace", action="store_true",
                   help="the whole model (workspace, controller, router) for trust_remote_code, with a model card")
    s.add_argument("--budget", type=int, default=None,
                   help="with --workspace: the exported policy's budget (default: the one its stages trained)")
    s.add_argument("--lambda-cost", type=float, default=None, help="with --workspace: its price (default: the model's)")
    s.set_defaults(func=cmd_export_hf)
