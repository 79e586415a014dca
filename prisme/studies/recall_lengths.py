"""`prisme study lengths`: the long-context recall study's trained models scored and decoded at longer contexts than
they trained on.

A 64-window backbone and a content-addressed bank meet no position they have not seen at a longer context (the
window's relative positions are the same, the bank matches content), while one layer of global attention with RoPE
meets distances it never trained on. For each finished member of a `prisme study recall --frontier --context` folder
(PRISME with its router at budget 1 and its calibrated price, and each dense model), at each context T: query
accuracy on `sequences` held-out MQAR sequences of length T (the study's task: its pairs, and its queries after every
window, `context_mqar`), the same draws for every model; and decoding tokens/s at batch 8 side by side (`generate`
from the first query slot to the end, the models alternating, the median of `repeats`), with each model's decode state
at T. A model is rebuilt at T_max = T (RoPE tables are computed, not learned); its weights are the trained ones.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prisme.checkpoint import load_model
from prisme.data.mqar import make_mqar_batch
from prisme.devices import TimedPath, time_paths
from prisme.evaluation.policies import BackboneRows, ControllerRows
from prisme.model.prisme import PrismeModel

DEFAULT_CONTEXTS = (2048, 4096, 8192, 16384)
FAMILY_OF_KIND = {"family": "prisme", "dense": "dense"}  # a recall frontier task's kind -> the model it trained


@dataclass(frozen=True)
class Member:
    """One finished run of the study: its name, family ("prisme" or "dense"), seed, checkpoint, (PRISME) price and the
    sequence length it trained at."""

    name: str
    family: str
    seed: int
    checkpoint: Path
    price: float | None
    context: int


TRAINED_AT = re.compile(r"(?:^|/)T(\d+)(?:/|_)")  # frontier/T1024/... or T1024_<key>: a long-context run's length


def trained_context(task: dict[str, Any], entry: dict[str, Any]) -> int | None:
    """The length a run trained at: its record's `context` (written since `study lengths` reads it), else its folder
    `frontier/T<n>/` or name `T<n>_...` (how a long-context study names every run); None for neither."""
    if isinstance(task.get("context"), int):
        return task["context"]
    for text in (task.get("folder"), entry.get("checkpoint"), task.get("name")):
        found = TRAINED_AT.search(str(text or ""))
        if found:
            return int(found.group(1))
    return None


def members(folder: str | Path) -> list[Member]:
    """The finished runs a recall study folder records (`.prisme-study/done`), PRISME family members and dense models,
    each with the length it trained at, sorted by name and seed; ValueError where the folder does not exist or holds
    none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"study lengths: {folder} is not a folder; pass the --out folder of a "
                         f"`prisme study recall --frontier --context` run")
    done = sorted((folder / ".prisme-study" / "done").glob("*.json"))
    out = []
    for path in done:
        rec = json.loads(path.read_text())
        task, entry = rec.get("task", {}), rec.get("entry") or {}
        if task.get("kind") not in FAMILY_OF_KIND or "checkpoint" not in entry:
            continue
        ckpt = next((p for p in (folder.parent / entry["checkpoint"], folder / entry["checkpoint"],
                                 Path(entry["checkpoint"])) if p.exists()), None)
        if ckpt is None:
            raise ValueError(f"study lengths: {path.name} names the checkpoint {entry['checkpoint']}, which is not in "
                             f"{folder} or beside it")
        context = trained_context(task, entry)
        if context is None:
            raise ValueError(f"study lengths: {path} names no trained length (a run of a long-context study is "
                             f"T<n>_<name> in frontier/T<n>/): {folder} is not a `prisme study recall --frontier "
                             f"--context` study")
        family = FAMILY_OF_KIND[task["kind"]]
        price = entry["router"]["lambda"] if family == "prisme" else None
        out.append(Member(task["name"], family, int(task["seed"]), ckpt, price, context))
    if not out:
        raise ValueError(f"study lengths: {folder} records no finished run of a recall frontier study "
                         f"(.prisme-study/done)")
    return sorted(out, key=lambda m: (m.family, m.name, m.seed))


def recorded_settings(folder: Path):
    """The study's own settings (its record's `study`), as a `RecallStudyConfig`: the task at a longer length is the
    one it trained on (its queries, its largest window); the defaults for a folder without a record."""
    from prisme.studies.recall_setup import RecallStudyConfig
    from prisme.studies.records import recorded_study

    study = (recorded_study(folder) or {}).get("study") or {}
    known = {f.name for f in dataclasses.fields(RecallStudyConfig)}
    kw = {k: v for k, v in study.items() if k in known and k not in ("out_dir", "control_layers")}
    return RecallStudyConfig(**{**kw, "frontier": True})


def memory_needed(found: list[Member], loaded: dict[Member, PrismeModel], T: int, sequences: int) -> int:
    """What scoring and decoding at T hold at once, at least: every model rebuilt at T (its RoPE tables); the largest
    evaluation batch's pairwise bank match of a model with a workspace (`BankMatch`: scores, their masked copy and
    two masks, `[b, T, T]`); and the batch-8 decode states of one model of each name, side by side."""
    from prisme.model.prisme import decode_state_bytes
    from prisme.studies.recall_setup import CHUNK

    b = min(sequences, max(1, CHUNK * 32 // T))
    rope = sum(2 * T * loaded[m].cfg.head_dim * 4 for m in found)
    pairwise = max((b * T * T * 10 for m in found if loaded[m].cfg.use_workspace), default=0)
    first = {m.name: m for m in reversed(found)}.values()
    states = sum(decode_state_bytes(loaded[m].cfg, 8, T, loaded[m].decode_options) for m in first)
    return rope + pairwise + states


def at_length(model: PrismeModel, T: int) -> PrismeModel:
    """The same weights in a model of T_max = max(T, its own) (its RoPE tables computed to T)."""
    cfg = dataclasses.replace(model.cfg, max_seq_len=max(T, model.cfg.max_seq_len))
    out = PrismeModel(cfg, model.decode_options).to(model.backbone.tok_emb.weight.dtype)
    out.load_state_dict(model.state_dict())
    return out.eval()


def accuracy(model: PrismeModel, member: Member, mcfg, sequences: int, data_seed: int) -> float:
    """Query accuracy on `sequences` MQAR sequences of `mcfg` drawn from `data_seed` (PRISME at budget 1 and its
    price; a dense model alone)."""
    from prisme.studies.recall_eval import score

    policy = BackboneRows() if member.price is None else ControllerRows([member.price], 1, equal_edits=False)
    return score(model, mcfg, data_seed, sequences, [policy]).rows[0].accuracy


def decode_speed(models: dict[str, tuple[PrismeModel, float | None]], mcfg, batch: int, repeats: int,
                 data_seed: int) -> dict[str, float]:
    """Tokens/s of `generate` from the first query slot to the end of an MQAR sequence, the models alternating."""
    from prisme.decoding.generate import generate
    from prisme.model.policy import Controller as Price

    x, _ = make_mqar_batch(mcfg, batch, torch.Generator().manual_seed(data_seed))
    P = mcfg.query_start + 1
    new = mcfg.seq_len - P

    def path(k: str, m: PrismeModel, price: float | None) -> TimedPath:
        kw = {} if price is None else dict(policy=Price(1, lambda_cost=price))
        return k, lambda: None, lambda _: generate(m, x[:, :P], new, **kw)

    samples = time_paths([path(k, m, price) for k, (m, price) in models.items()], 1, repeats, inference=False)
    return {k: batch * new * 1000.0 / sorted(t)[len(t) // 2] for k, t in samples.items()}


def run_lengths(folder: str | Path, contexts: tuple[int, ...], sequences: int, repeats: int,
                progress: bool = True) -> dict[str, Any]:
    """Every member of the study in `folder` scored at the length it trained at (its record's) and at each of
    `contexts`, and one model of each name (its first seed) decoded at each (module docstring): the document.
    ValueError before any scoring: a context not longer than every trained length, or one that cannot fit (naming
    --contexts)."""
    import sys

    from prisme.devices import check_fits
    from prisme.studies.recall_context import context_mqar
    from prisme.studies.recall_setup import EVAL_SEED, load_recipe

    if not contexts:
        raise ValueError("study lengths: --contexts is empty")
    folder = Path(folder)
    found = members(folder)
    trained = sorted({m.context for m in found})
    if min(contexts) <= trained[-1]:
        raise ValueError(f"study lengths: --contexts must be longer than every length the study trained at "
                         f"({', '.join(f'{T:,}' for T in trained)}), got {min(contexts):,}")
    study = recorded_settings(folder)
    recipe, _ = load_recipe(study)
    loaded = {m: load_model(m.checkpoint)[0].eval() for m in found}
    for T in sorted(contexts):
        check_fits(memory_needed(found, loaded, T, sequences), f"study lengths at --contexts {T:,}",
                   "pass shorter --contexts (or fewer --sequences)")
    rows: dict[str, dict[str, Any]] = {}
    speed: dict[int, dict[str, float]] = {}
    t0 = time.perf_counter()
    for T in sorted(set(trained) | set(contexts)):
        mcfg = context_mqar(study, recipe, T, limit=False)
        first: dict[str, tuple[PrismeModel, float | None]] = {}
        for m in found:
            if T < m.context or (T in trained and T != m.context):
                continue  # a member is scored at its own length and the longer ones asked for
            model = at_length(loaded[m], T)
            row = rows.setdefault(m.name, {"family": m.family, "trained_context": m.context, "seeds": [],
                                           "accuracy": {}})
            if m.seed not in row["seeds"]:
                row["seeds"].append(m.seed)
            row["accuracy"].setdefault(str(T), []).append(accuracy(model, m, mcfg, sequences, EVAL_SEED + m.seed))
            first.setdefault(m.name, (model, m.price))
            if progress:
                print(f"[lengths {time.perf_counter() - t0:6.0f} s] T = {T} {m.name} seed {m.seed}: "
                      f"{row['accuracy'][str(T)][-1]:.3f}", file=sys.stderr, flush=True)
        if T in contexts:
            speed[T] = decode_speed(first, mcfg, 8, repeats, EVAL_SEED + 99)
    return {"study": "lengths", "folder": str(folder), "trained_contexts": trained,
            "contexts": sorted(set(trained) | set(contexts)), "sequences": sequences, "rows": rows,
            "decode_batch8_tokens_per_s": {str(k): v for k, v in speed.items()},
            "threads": torch.get_num_threads(), "wall_s": time.perf_counter() - t0}


def format_lengths(doc: dict[str, Any]) -> str:
    """Accuracy per seed at each context, and decoding tokens/s side by side, for humans."""
    Ts = doc["contexts"]
    trained = ", ".join(f"{T:,}" for T in doc["trained_contexts"])
    head = f"{'model':<34}" + "".join(f"{'T = ' + format(T, ','):>22}" for T in Ts)
    lines = [f"query accuracy per seed (trained at T = {trained}, each model at its own and the longer ones; "
             f"{doc['sequences']} sequences per seed and context)", head, "-" * len(head)]
    for name, row in doc["rows"].items():
        cells = "".join(f"{' '.join(f'{a:.3f}' for a in row['accuracy'].get(str(T), [])) or '-':>22}" for T in Ts)
        lines.append(f"{name:<34}{cells}")
    lines += ["", "decoding, batch 8, tokens/s (one seed of each model, from the first query slot to the end)"]
    for T, by in doc["decode_batch8_tokens_per_s"].items():
        lines.append(f"  T = {int(T):,}: " + ", ".join(f"{k} {v:,.0f}" for k, v in by.items()))
    return "\n".join(lines)


def main(args: Any) -> int:
    """`prisme study lengths`: run, print the table and the document, write it where asked."""
    from prisme.checks import integer, parse_list
    from prisme.io import write_json_atomic

    contexts = tuple(parse_list(args.contexts, "--contexts", integer(1), example="2048,4096", distinct=True))
    if args.threads >= 1:
        torch.set_num_threads(args.threads)
    with torch.inference_mode():
        doc = run_lengths(args.runs, contexts, args.sequences, args.repeats, not args.no_progress)
    print(format_lengths(doc))
    if args.json:
        write_json_atomic(doc, args.json)
    print(json.dumps(doc, indent=2))
    return 0
