"""`prisme eval`: flags to an evaluation, the dataset a checkpoint was trained on, the report."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from prisme.checks import number, parse_list
from prisme.data.mqar import MQARDataset
from prisme.data.text import TokenDataset
from prisme.evaluation.families import PolicySettings, standard_policies
from prisme.evaluation.policies import row_family_of_name
from prisme.evaluation.run import EvalOptions, evaluate_policies
from prisme.io import write_text_atomic


# ---------------------------------------------------------------------------------------------------------- CLI
def dataset_for_checkpoint(meta: Any, vocab_size: int, corpus: str | None = None, seq_len: int | None = None):
    """The evaluation dataset of a checkpoint: its training stage's dataset (tokenizer, val split, MQAR settings), or
    `corpus`: "austen" / "mqar" / a `prisme data prepare` folder with the checkpoint's other data settings (their val
    split), or a held-out text (the embedded "devils_dictionary", a UTF-8 file or folder) scored whole with the
    checkpoint's tokenizer; ValueError naming both tokenizers when the data's is not the checkpoint's. Returns
    (dataset, seq_len or None)."""
    from prisme.checkpoint import load_tokenizer
    from prisme.data.shards import is_prepared
    from prisme.data.text import EMBEDDED_CORPUS, load_text
    from prisme.data.tokenizers import BPETokenizer, describe_tokenizer, tokenizer_identity, tokenizer_named
    from prisme.training.config import StageConfig, build_dataset

    sc = getattr(meta, "stage_config", None) or {}
    scfg = StageConfig.from_dict(sc) if sc else StageConfig()
    own = load_tokenizer(meta.path) if getattr(meta, "path", None) is not None else None
    if isinstance(own, BPETokenizer):  # the checkpoint's own copy: the run folder may have moved since training
        scfg = scfg.replace(tokenizer=str(meta.path))
    if corpus is not None and corpus not in (EMBEDDED_CORPUS, "mqar") and corpus != scfg.dataset \
            and not is_prepared(corpus):  # a prepared folder: its val split, below
        tok = tokenizer_named(scfg.tokenizer)
        if tok.vocab_size > vocab_size:
            raise ValueError(f"the checkpoint's tokenizer has {tok.vocab_size} ids but the model has {vocab_size}")
        T = seq_len or scfg.seq_len
        if T is None:
            raise ValueError("a held-out text needs a sequence length: pass --seq-len")
        return TokenDataset.held_out(load_text(corpus), tok, T, name=Path(str(corpus)).name), scfg.seq_len
    if corpus is not None and corpus != scfg.dataset:
        scfg = scfg.replace(dataset=corpus)
    ds = build_dataset(scfg, vocab_size)
    theirs = getattr(ds, "tokenizer", None)
    if theirs is not None and getattr(meta, "path", None) is not None and theirs.identity != tokenizer_identity(own):
        raise ValueError(f"--corpus {scfg.dataset} was prepared with {describe_tokenizer(theirs)}, the checkpoint "
                         f"{meta.path} was trained with {describe_tokenizer(own)}: its ids would be read as other "
                         f"strings; prepare the text with the checkpoint's tokenizer (prisme data prepare ... "
                         f"--tokenizer {meta.path})")
    return ds, scfg.seq_len


def n_eval_batches(dataset: Any, split: str, batch_size: int, seq_len: int) -> int | None:
    """How many batches the whole split holds (None for a synthetic dataset, which has no end)."""
    if isinstance(dataset, TokenDataset):
        return math.ceil(dataset.n_eval_windows(split, seq_len) / batch_size)
    return None


def parse_batches(text: str | int | None) -> int | None:
    """`--batches`: a positive int, or "all" (None: the whole split)."""
    if text is None or (isinstance(text, str) and text.strip().lower() == "all"):
        return None
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"--batches must be a positive integer or 'all', got {text!r}") from None
    if n < 1:
        raise ValueError(f"--batches must be >= 1 (or 'all'), got {n}")
    return n


def _parse_floats(s: str | None) -> list[float] | None:
    """`--lambdas`: comma-separated prices (finite numbers >= 0), or None when not given."""
    return None if s is None else parse_list(s, "--lambdas", number(0), example="0,0.01,0.1")


BUILT_IN_ROWS = ("backbone", "backbone+matched")  # names a --reference may not take


def parse_references(items: list[str] | None) -> dict[str, str]:
    """`--reference NAME=CKPT` (repeatable) -> {name: checkpoint}; names unique and not a built-in row's."""
    out: dict[str, str] = {}
    for item in items or []:
        cuts = [i for i, c in enumerate(item) if c == "=" and item[:i].count("(") == item[:i].count(")")]
        name, sep, path = (item[:cuts[0]], "=", item[cuts[0] + 1:]) if cuts else (item, "", "")  # a row name's "="
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--reference must be NAME=CHECKPOINT, got {item!r}")
        if name in out:
            raise ValueError(f"--reference name {name!r} is used twice; give each reference its own NAME")
        family = row_family_of_name(name)
        if family is not None:  # the evaluation's own rows take names of this form, whatever its prices
            raise ValueError(f"--reference {item}: {name!r} has the form of a built-in or policy row's name (the "
                             f"{family} family's); give the reference another NAME (e.g. ref_{name})")
        out[name] = path
    return out


def parse_frontier_rows(text: str | None, references: dict[str, str], has_matched: bool) -> list[str] | None:
    """`--frontier`: comma-separated row names ('references' = every --reference), each one a row this run has."""
    if text is None:
        return None
    rows: list[str] = []
    for name in parse_list(text, "--frontier", example="backbone,references"):
        rows += list(references) if name == "references" else [name]
    known = [*BUILT_IN_ROWS[:1 + int(has_matched)], *references]
    bad = [r for r in rows if r not in known]
    if not rows or bad:
        raise ValueError(f"--frontier names rows {bad or text!r} that this evaluation does not have; known: {known} "
                         f"(a backbone-only model becomes a row with --reference NAME=CHECKPOINT)")
    return list(dict.fromkeys(rows))


def load_references(references: dict[str, str], model: Any, device: torch.device, meta: Any = None
                    ) -> dict[str, Any]:
    """Load each `--reference` and check that it reads the same tokens as the evaluated model (its vocabulary and,
    with the evaluated checkpoint's `meta`, its tokenizer)."""
    from prisme.checkpoint import load_model

    out = {}
    for name, path in references.items():
        ref, ref_meta = load_model(path, map_location=device)
        if ref.cfg.vocab_size != model.cfg.vocab_size:
            raise ValueError(f"--reference {name}={path} has a vocabulary of {ref.cfg.vocab_size} ids, the evaluated "
                             f"model {model.cfg.vocab_size}: they cannot be scored on the same targets")
        if meta is not None:
            check_same_tokens(meta, ref_meta, f"--reference {name}={path}")
        out[name] = ref
    return out


def check_same_tokens(meta: Any, other: Any, what: str) -> None:
    """ValueError naming both tokenizers when checkpoint `other` (`what`: the option that named it) was trained on
    another tokenizer than the evaluated checkpoint `meta`: the same ids would mean other strings."""
    from prisme.checkpoint import tokenizer_of
    from prisme.data.tokenizers import describe_tokenizer, tokenizer_identity

    ours, theirs = tokenizer_of(meta), tokenizer_of(other)
    if None in (meta.tokenizer, other.tokenizer) and None in (ours, theirs):
        return  # a checkpoint that recorded no tokenizer: its "token ids" or "byte" is a guess from its stage config
    if tokenizer_identity(ours) != tokenizer_identity(theirs):
        raise ValueError(f"{what} was trained with {describe_tokenizer(theirs)}, the evaluated checkpoint {meta.path} "
                         f"with {describe_tokenizer(ours)}: the same ids mean other strings, so they cannot be "
                         f"compared on the same targets")



def check_routing_bound(model: Any, meta: Any) -> None:
    """`--routing-bound` runs the oracle's edits on the checkpoint's workspace: ValueError naming the option when the
    model has none, or no stage trained it."""
    from prisme.checkpoint import trained_groups

    if not model.cfg.use_workspace:
        raise ValueError(f"--routing-bound needs a model with a workspace; {meta.path} is a backbone-only model "
                         f"({model.cfg.name!r}, use_workspace=False): evaluate a workspace checkpoint")
    if "workspace" not in trained_groups(meta):
        raise ValueError(f"--routing-bound needs a trained workspace; no stage of {meta.path} (a {meta.stage!r} "
                         f"checkpoint) trained it: evaluate the workspace or a later stage's checkpoint")


def main(args: argparse.Namespace) -> int:
    """`prisme eval`: load a checkpoint, evaluate every policy, print the table, write JSON / PNG if asked."""
    from prisme.checkpoint import load_model
    from prisme.stats import check_bootstrap_args

    if getattr(args, "threads", -1) != -1:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1 (or -1 to leave torch's setting), got {args.threads}")
        torch.set_num_threads(args.threads)
    from prisme.io import check_output_file

    check_output_file(args.json, "--json")  # output paths first: never fail after the whole evaluation
    check_output_file(args.plot, "--plot")
    max_batches = parse_batches(args.batches)
    references = parse_references(getattr(args, "reference", None))
    frontier = parse_frontier_rows(getattr(args, "frontier", None), references, bool(args.matched_backbone))
    if getattr(args, "routing_bound", False) and not references:
        raise ValueError("--routing-bound needs the dense frontier's models: pass --reference NAME=CHECKPOINT")
    slices = getattr(args, "slices", None)
    if slices is not None and slices < 1:
        raise ValueError(f"--slices must be an n-gram length >= 1, got {slices}")
    check_bootstrap_args(args.bootstrap, args.bootstrap_seed)
    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device!r} requested but CUDA is not available")
    auto = args.device in (None, "auto")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if auto else args.device)
    from prisme.checkpoint import find_model_checkpoint

    path = find_model_checkpoint(args.checkpoint)
    if str(path) != str(args.checkpoint):
        print(f"note: using {path}", file=sys.stderr)
    model, meta = load_model(path, map_location=device)
    if getattr(args, "routing_bound", False):  # before the evaluation: the bound runs the trained workspace
        check_routing_bound(model, meta)
    from prisme.model.compiled_editor import maybe_compile

    maybe_compile(model, getattr(args, "compile", None))
    matched = None
    if args.matched_backbone:
        from prisme.rebase import BACKBONE_FIELDS

        matched, matched_meta = load_model(args.matched_backbone, map_location=device)
        diff = {k: v for k, v in model.cfg.diff(matched.cfg).items() if k in BACKBONE_FIELDS}
        if diff:
            shown = ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(f"--matched-backbone {args.matched_backbone} is another backbone ({shown}); the matched "
                             f"baseline is the evaluated model's backbone trained on more tokens (same architecture)")
        check_same_tokens(meta, matched_meta, f"--matched-backbone {args.matched_backbone}")
    refs = load_references(references, model, device, meta)
    dataset, train_seq_len = dataset_for_checkpoint(meta, model.cfg.vocab_size, args.corpus, args.seq_len)
    seq_len = args.seq_len if args.seq_len is not None else train_seq_len
    if seq_len is None:
        seq_len = dataset.cfg.seq_len if isinstance(dataset, MQARDataset) else model.cfg.max_seq_len
    if slices is not None and slices > seq_len:
        raise ValueError(f"--slices {slices}: an n-gram longer than the window ({seq_len} tokens, --seq-len) occurs "
                         f"in none; pass an n-gram length <= {seq_len}")
    available = n_eval_batches(dataset, "val", args.batch_size, seq_len)
    if max_batches is not None and available is not None and max_batches > available:
        raise ValueError(f"--batches {max_batches} exceeds the split: {dataset!r} holds {available} batches of "
                         f"{args.batch_size} x {seq_len} (pass --batches all for the whole split)")
    policies = None if args.policies is None else parse_list(args.policies, "--policies", example="backbone,controller")
    oracle_positions = None if args.oracle_positions == -1 else args.oracle_positions
    settings = PolicySettings(lambdas=_parse_floats(args.lambdas), oracle_positions=oracle_positions,
                              controller_budget=getattr(args, "controller_budget", None),
                              kappa_risk=getattr(args, "kappa_risk", None))
    planned = standard_policies(model, policies, settings, matched=matched, references=refs or None)
    options = EvalOptions(batch_size=args.batch_size, seq_len=seq_len, max_batches=max_batches, seed=args.seed,
                          progress=sys.stderr.isatty(), bootstrap_samples=args.bootstrap,
                          bootstrap_seed=args.bootstrap_seed, frontier=frontier, slices=slices,
                          slices_window=getattr(args, "slices_window", None))
    report = evaluate_policies(model, dataset, planned, options)
    from prisme.checkpoint import trained_groups

    groups = trained_groups(meta)
    rows_of = {r.name: r for p in planned for r in p.planned}
    for row in report.rows:  # a policy that runs a part no stage trained is not what would be deployed
        planned_row = rows_of[row.policy]
        missing = planned_row.policy.untrained(planned_row, model.cfg, groups)
        if missing:
            row.deployable = False
            row.untrained = missing
    print(report.table())
    bound = None
    if getattr(args, "routing_bound", False):
        from prisme.evaluation.routing_bound import oracle_routed_bound

        bound = oracle_routed_bound(model, dataset, refs, options)  # the evaluation's windows and intervals
        print(bound.table())
    if args.json:
        doc = report.to_json()
        if bound is not None:
            doc["routing_bound"] = bound.to_json()
        doc["checkpoint"] = str(args.checkpoint)
        doc["matched_backbone"] = args.matched_backbone
        doc["references"] = references
        write_text_atomic(Path(args.json), json.dumps(doc, indent=2, allow_nan=False) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0
