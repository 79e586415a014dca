"""`prisme fit DATA --recipe NAME`: a folder of text or code to a deployable PRISME model in one command.

A recipe is one of the studies' PRISME chains, for one seed and without the dense frontier around it (what the
project has answers for; `docs/python.md` says which recipe fits what):

=================  ==========================================================================================  ========
recipe             the model and its stages                                                                    context
=================  ==========================================================================================  ========
``text``           the demo's: a 1-layer d = 128 global backbone, the residual bank, the value controller      128
                   (stage 1, workspace, controller)
``long-context``   a 1-layer 64-window key-shift backbone, the residual bank read where a router fires          1,024
                   (stage 1, workspace, router): `prisme study text --context 1024`'s chain
``code``           a 2-layer 64-window key-shift backbone with the copy head (a pointer over exact suffix      1,024
                   matches), the bank keyed on the preceding position, the router (stage 1, copy, workspace,
                   router): the code study's chain (`docs/code.md`)
=================  ==========================================================================================  ========

DATA is prepared first (`prisme data prepare`: every `.txt`, `.md`, `.py` and `.jsonl` file under a folder, and the
extensions `extensions` adds; split by whole files) into `<out>/data`, unless it is a prepared folder already. Each
stage trains in its own folder of `<out>` (`1_backbone`, `1c_copy`, `2_workspace`, `3_router` or `4_controller`),
resumes where it stopped, and is not trained again once finished: rerunning the same command continues. `<out>/fit.json`
records the settings (a rerun with others is refused, naming them) and, once done, the deployable stage, which
`prisme generate --checkpoint <out>`, `prisme eval --checkpoint <out>` and `prisme.load(<out>)` read.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prisme.checkpoint import FIT_RECORD
from prisme.config import PrismeConfig
from prisme.io import write_text_atomic


@dataclass(frozen=True)
class FitRecipe:
    """One recipe: the text study's settings it runs (`TextStudyConfig` fields) and what it is for."""

    name: str
    about: str
    context: int | None  # windows of this many tokens (None: the demo's 128)
    source: str  # the bank source (`text_setup.SOURCES`)
    layers: int | None = None  # PRISME's backbone depth at `context` (None: the preset's)
    copy_head: bool = False
    workspace_steps: int | None = None  # the workspace stage's steps (None: the recipe's)


RECIPES = {r.name: r for r in (
    FitRecipe("text", "the demo's: a global 1-layer backbone, the residual bank, the value controller (T = 128)", None,
           "residual"),
    FitRecipe("long-context", "a 64-window key-shift backbone, the residual bank read where a router fires (T = 1,024)",
           1024, "residual"),
    FitRecipe("code", "the code study's: a 2-layer 64-window backbone with the copy head, the bank keyed on the "
                   "preceding position, the router (T = 1,024)", 1024, "residual_preceding", layers=2,
           copy_head=True, workspace_steps=960),
)}
DEFAULT_RECIPE = "long-context"
SCALE_FLOOR = 0.002  # below it a stage would train its minimum of 2 steps at every scale


@dataclass(frozen=True)
class FitResult:
    """What `fit` made: the final (deployable) stage's run folder, every stage's, the prepared data, the wall time."""

    recipe: str
    out: Path
    checkpoint: Path
    stages: dict[str, str]
    data: Path
    wall_s: float


# ------------------------------------------------------------------------------------------------------------ checks
def check_settings(data: str | Path, recipe: str, out: str | Path, scale: float, seed: int) -> FitRecipe:
    """The recipe; ValueError naming the option for a bad one, before anything is read or written."""
    if recipe not in RECIPES:
        raise ValueError(f"--recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not SCALE_FLOOR <= scale <= 10:
        raise ValueError(f"--scale must be a number in [{SCALE_FLOOR}, 10] (1: the recipe's steps; 0.02: a one-minute "
                         f"run of the text recipe), got {scale!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"--seed must be an int >= 0, got {seed!r}")
    if not Path(data).exists():
        raise ValueError(f"{data} does not exist: pass a folder of text or code files, a file, or a folder "
                         f"`prisme data prepare` wrote")
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out {out} is a file, not a folder: give a folder path (made if missing)")
    return RECIPES[recipe]


def settings_record(data: str | Path, recipe: str, scale: float, seed: int, tokenizer: str,
                    extensions: tuple[str, ...]) -> dict[str, Any]:
    """What a fit folder records of the command that started it (a rerun must give the same to continue it)."""
    return {"data": str(Path(data).resolve()), "recipe": recipe, "scale": scale, "seed": seed,
            "tokenizer": tokenizer, "extensions": sorted(extensions)}


def open_fit(out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The fit folder's record: a new one, or the one a run with the same settings started (continued); ValueError
    naming the settings that differ, or for a non-empty folder that is not a fit's."""
    record = out / FIT_RECORD
    if record.is_file():
        try:
            before = json.loads(record.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{record} is not readable ({e}); pass another --out") from None
        differ = [f"{k}: was {before.get('settings', {}).get(k)!r}, now {v!r}" for k, v in settings.items()
                  if before.get("settings", {}).get(k) != v]
        if differ:
            raise ValueError(f"--out {out} holds a fit run with other settings ({'; '.join(differ)}): rerun it with "
                             f"those to continue it, or pass another --out")
        return before
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty (and holds no {FIT_RECORD}): pass another --out")
    rec = {"settings": settings, "stages": {}, "checkpoint": None}
    write_text_atomic(record, json.dumps(rec, indent=2) + "\n")
    return rec


# ------------------------------------------------------------------------------------------------------------ data
def prepared_data(data: Path, out: Path, tokenizer: str, extensions: tuple[str, ...]) -> Path:
    """A prepared folder of DATA: DATA itself when `prisme data prepare` wrote it, else `<out>/data` (written now, or
    kept from an earlier run of the same fit)."""
    from prisme.data.shards import is_prepared, prepare
    from prisme.data.tokenizers import tokenizer_named

    if is_prepared(data):
        return data
    target = out / "data"
    if is_prepared(target):
        return target
    manifest = prepare(data, target, tokenizer_named(tokenizer), extensions=extensions)
    print(f"[fit] prepared {data} into {target}: {manifest['documents']['train']:,} training and "
          f"{manifest['documents']['val']:,} validation documents, {manifest['tokens']['train']:,} / "
          f"{manifest['tokens']['val']:,} tokens ({len(manifest['skipped'])} files of other suffixes left out)",
          file=sys.stderr)
    return target


def check_windows(ds: Any, T: int, data: Path) -> None:
    """ValueError naming DATA when a split holds less than one window of T tokens + 1."""
    n_train, n_val = ds.n_tokens("train"), ds.n_tokens("val")
    if min(n_train, n_val) < T + 1:
        raise ValueError(f"{data}: its training split holds {n_train:,} tokens and its validation split {n_val:,}; the "
                         f"recipe reads windows of {T:,} tokens (+ 1 target) from each: add files, or pick a recipe "
                         f"of shorter windows (--recipe text: 128)")


# ------------------------------------------------------------------------------------------------------------ fit
def fit(data: str | Path, recipe: str = DEFAULT_RECIPE, out: str | Path = "runs/fit", scale: float = 1.0,
        seed: int = 1337, tokenizer: str = "byte", extensions: tuple[str, ...] | list[str] = (),
        progress: bool = True) -> FitResult:
    """Train `recipe` (`RECIPES`) on DATA into `out`, every stage in turn (the module docstring); returns the
    `FitResult`. A stopped fit raises `runner.StudyInterrupted` (rerun the same call to continue)."""
    from prisme.data.corpora import resolve_corpus
    from prisme.data.tokenizers import tokenizer_named
    from prisme.rebase import rebase_backbone
    from prisme.studies.runner import train_stage_once
    from prisme.studies.text_setup import SOURCES, TextStudyConfig, copy_config, source_config, stage_configs

    t0 = time.perf_counter()
    r = check_settings(data, recipe, out, scale, seed)
    extensions = tuple(sorted({e if e.startswith(".") else f".{e}" for e in extensions}))
    tok = tokenizer_named(tokenizer)  # a ValueError naming it when it is no tokenizer
    out, data = Path(out), Path(data)
    rec = open_fit(out, settings_record(data, recipe, scale, seed, tokenizer, extensions))
    prepared = prepared_data(data, out, tokenizer, extensions)
    ds = resolve_corpus(str(prepared)).dataset(tok)
    cfg = TextStudyConfig(corpus=str(prepared), held_out=str(prepared), sources=[r.source], seeds=[seed], scale=scale,
                          context=r.context, prisme_layers=r.layers, copy_head=r.copy_head,
                          workspace_steps=r.workspace_steps, out_dir=str(out / ".stages"), confirm_seeds=None,
                          progress=progress)
    model_cfg = cfg.study_model(PrismeConfig.from_name("demo")).replace(vocab_size=ds.vocab_size)
    check_windows(ds, r.context or 128, data)
    st = stage_configs(cfg, model_cfg, seed)
    final = st["controller"].stage  # "controller" at T = 128, "router" at a long context
    folders = {"backbone": "1_backbone", "copy": "1c_copy", "workspace": "2_workspace",
               final: "4_controller" if final == "controller" else "3_router"}
    place = {k: st["controller" if k == final else k].replace(out_dir=str(out / f), progress=progress,
                                                              dataset=str(prepared))
             for k, f in folders.items() if k != "copy" or cfg.uses_copy}
    stages: dict[str, str] = {}

    def run(name: str, model: PrismeConfig | None, init: str | None) -> str:
        s = place[name] if init is None else place[name].replace(init_from=init)
        print(f"[fit {time.perf_counter() - t0:6.0f} s] {name}: {s.steps} steps of {s.batch_size} x {s.seq_len} "
              f"tokens -> {s.out_dir}", file=sys.stderr, flush=True)
        train_stage_once(model, s, dataset=ds)
        stages[name] = s.out_dir
        write_text_atomic(out / FIT_RECORD, json.dumps({**rec, "stages": stages}, indent=2) + "\n")
        return s.out_dir

    init = run("backbone", model_cfg, None)
    src = source_config(model_cfg, r.source)
    if cfg.uses_copy:
        src = copy_config(src)
    if SOURCES[r.source] or cfg.uses_copy:  # stage 1's backbone under the workspace's config
        init = str(rebase_backbone(init, src, out / "1r_rebased", seed).parent)
    if cfg.uses_copy:
        init = run("copy", None, init)
    init = run("workspace", None, init)
    last = run(final, None, init)
    wall = time.perf_counter() - t0
    rec = {**rec, "stages": stages, "checkpoint": Path(last).name, "recipe": asdict(r), "data": str(prepared),
           "wall_s": round(wall, 1)}
    write_text_atomic(out / FIT_RECORD, json.dumps(rec, indent=2) + "\n")
    return FitResult(recipe, out, Path(last), stages, prepared, wall)


# ------------------------------------------------------------------------------------------------------------ CLI
def main(args: Any) -> int:
    """`prisme fit`: train, then print where the model is and the commands that use it."""
    from prisme.checks import parse_list

    if args.threads is not None and args.threads >= 1:
        import torch

        torch.set_num_threads(args.threads)
    ext = () if not args.ext else tuple(parse_list(args.ext, "--ext", example="js,ts"))
    res = fit(args.data, args.recipe, args.out, args.scale, args.seed, args.tokenizer, ext, not args.no_progress)
    final = "controller" if res.checkpoint.name == "4_controller" else "router"
    print(f"fit {res.recipe} on {args.data}: {len(res.stages)} stages in {res.wall_s:,.0f} s; the model: "
          f"{res.checkpoint} (its {final}; the folder {res.out} stands for it)")
    print(f"  prisme generate --checkpoint {res.out} --prompt \"...\" --budget 1 --show-edits")
    print(f"  prisme eval --checkpoint {res.out} --batches 2")
    print(f"  python -c \"import prisme; print(prisme.load('{res.out}').generate('...', 64).text)\"")
    return 0
