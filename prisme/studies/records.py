"""A study folder's record (`.prisme-study/`): the settings a study was started with and which command made it, what
a rerun's settings change (the fields named; lists of lengths compared as sets), where each finished task's result is
kept, and the finished runs one study copies from another (`--reuse`).

    record_study("runs/text", settings, "text study")   # the first run
    open_study("runs/text", settings, label="text study")  # a rerun: True (continue), or a ValueError naming the
                                                           # fields that differ and the folder's own kind
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from prisme.config import current_fields
from prisme.io import write_text_atomic
from prisme.training.config import stage_with_added_fields

STUDY_DIR = ".prisme-study"  # in a study folder: the settings it was run with, and each finished task's result
ORDERLESS = ("contexts", "context_lengths")  # lists of lengths: the same lengths in another order are the same study
COMMANDS = {"recall study": "prisme study recall", "text study": "prisme study text", "demo": "prisme demo"}


def store_path(store: Path, name: str) -> Path:
    """The file in a study's store (`record_study`) that keeps task `name`'s result."""
    return store / (name.replace("%", "%25").replace("/", "%2F").replace(":", "%3A") + ".json")


# ------------------------------------------------------------------------------------------------------------ record
def record_study(out: str | Path, settings: dict[str, Any], label: str = "study") -> Path:
    """Start a study in `out`: its settings recorded (what a rerun must match to continue it) with the kind of study
    that made it (`label`: "recall study", "text study", "demo"; by default the kind its settings have); returns its
    store."""
    record = Path(out) / STUDY_DIR / "settings.json"
    if not record.is_file():
        label = label if label in COMMANDS else study_label(settings)
        kind = {"command": label} if label in COMMANDS else {}
        write_text_atomic(record, json.dumps({**kind, **settings}, indent=2, sort_keys=True, default=str) + "\n")
    return Path(out) / STUDY_DIR / "done"


def _record(out: str | Path) -> dict[str, Any] | None:
    record = Path(out) / STUDY_DIR / "settings.json"
    if not record.is_file():
        return None
    try:
        settings = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{record} is not readable ({e}); remove the study folder {out} or pass another --out") \
            from None
    if not isinstance(settings, dict):
        raise ValueError(f"{record} holds no study settings (a JSON object); remove the study folder {out} or pass "
                         f"another --out")
    return settings


def recorded_study(out: str | Path) -> dict[str, Any] | None:
    """The settings a study in `out` was started with (`record_study`), or None."""
    settings = _record(out)
    return None if settings is None else {k: v for k, v in settings.items() if k != "command"}


def study_label(settings: dict[str, Any]) -> str:
    """The kind of study a record belongs to: the command it names, or for a record written before the command was
    recorded, the kind its settings have ("study" when they say nothing)."""
    if settings.get("command") in COMMANDS:
        return settings["command"]
    if "runs" in settings:
        return "recall study"
    if "recall_seeds" in settings:
        return "demo"
    return "text study" if "stages" in settings else "study"


def describe(settings: dict[str, Any]) -> str:
    """A record's study in words, with the options that chose its kind: `a recall study (--frontier --quick)`."""
    label, study = study_label(settings), settings.get("study") or {}
    options = []
    if label == "recall study":
        options += ["--frontier"] if settings.get("kind") == "frontier" else []
        options += [f"--context {','.join(map(str, sorted(study['contexts'])))}"] if study.get("contexts") else []
        options += ["--quick"] if settings.get("quick") else []
    elif label == "text study" and study.get("context"):
        options.append(f"--context {study['context']}")
    return f"a {label}" + (f" ({' '.join(options)})" if options else "")


def open_study(out: str | Path, settings: dict[str, Any], resume: bool = False, label: str = "study",
               defaults: dict[str, Any] | None = None) -> bool:
    """Check, before anything runs, that a study with `settings` may run in folder `out`: True when a study was
    started there with the same settings (this run continues it), False when none was (`record_study` starts one).
    A folder another kind of study made is a ValueError naming that kind; other settings than the recorded ones are
    a ValueError naming the fields that differ (a field left out of the settings because it holds its default named
    with it: `defaults`, by path); `resume` asks for a study started there."""
    out = Path(out)
    record = _record(out)
    if record is None:
        if resume:
            raise ValueError(f"--resume: {out} holds no {label} to continue ({out / STUDY_DIR / 'settings.json'} is "
                             f"missing); start it without --resume")
        return False
    theirs = study_label(record)
    if label in COMMANDS and theirs in COMMANDS and theirs != label:
        raise ValueError(f"{out} holds {describe(record)} (made by `{COMMANDS[theirs]}`), not a {label}: pass "
                         f"another --out")
    before = {k: v for k, v in record.items() if k != "command"}
    changed = differences(migrated(before), json.loads(json.dumps(settings, default=str)), defaults=defaults)
    if changed:
        raise ValueError(f"{out} holds {describe(record)} run with other settings ({'; '.join(changed)}); rerun it "
                         f"with the settings it was run with to continue it, or pass another --out")
    return True


def migrated(settings: Any) -> Any:
    """Recorded settings with every model config (a "model" entry) given the fields added to `PrismeConfig` since, and
    every stage config (a "stages" entry) those added to `StageConfig`, at the values that reproduce what it ran
    (`config.ADDED_CONFIG_FIELDS`, `training.config.ADDED_STAGE_FIELDS`), and the model fields that moved out of
    `PrismeConfig` dropped where they changed nothing (`config.current_fields`): a study started before a field
    existed, or before one moved, continues."""
    if isinstance(settings, list):
        return [migrated(v) for v in settings]
    if not isinstance(settings, dict):
        return settings
    out = {k: migrated(v) for k, v in settings.items()}
    model = out.get("model")
    if isinstance(model, dict) and "d_model" in model:
        out["model"] = current_fields(model)
    if isinstance(out.get("stages"), list):
        out["stages"] = [stage_with_added_fields(s) if isinstance(s, dict) and "stage" in s else s
                         for s in out["stages"]]
    return out


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


class Unrecorded:
    """A field a record leaves out because it held its default (`open_study`'s `defaults`): compares as that value,
    and says so where a difference names it."""

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: Any) -> bool:
        return (other.value if isinstance(other, Unrecorded) else other) == self.value

    def __repr__(self) -> str:
        return f"{self.value!r} (the default)"


def _leaves(a: Any, b: Any, path: str, defaults: dict[str, Any] | None = None) -> list[tuple[str, Any, Any]]:
    """(path, was, now) for every place where `a` and `b` differ: into dicts and lists of one length; a list of
    lengths (`ORDERLESS`) compared as a set; a field one side leaves out read as its default where `defaults` (by
    path) has one."""
    if isinstance(a, dict) and isinstance(b, dict):
        defaults = defaults or {}

        def at(d: dict[str, Any], k: str, p: str) -> Any:
            return d[k] if k in d else Unrecorded(defaults[p]) if p in defaults else None

        return [leaf for k in dict.fromkeys([*a, *b])
                for p in [f"{path}.{k}" if path else str(k)] for leaf in _leaves(at(a, k, p), at(b, k, p), p,
                                                                                 defaults)]
    if path.rsplit(".", 1)[-1] in ORDERLESS and isinstance(a, list) and isinstance(b, list):
        return [] if sorted(map(str, a)) == sorted(map(str, b)) else [(path, a, b)]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and a != b:
        return [leaf for i, (x, y) in enumerate(zip(a, b)) for leaf in _leaves(x, y, f"{path}[{i}]", defaults)]
    return [] if a == b or b == a else [(path, a, b)]


def differences(before: dict[str, Any], now: dict[str, Any], most: int = 4,
                defaults: dict[str, Any] | None = None) -> list[str]:
    """Where two settings differ, each field by its path: `study.seeds: was [0], now [0, 1]`. The study's own
    settings (what the command line sets) come first; the fields they derive (steps, model and stage configs) are
    named only when nothing else differs; at most `most`, then how many more. `defaults`: the value of a field (by
    path, e.g. "study.corpus") that a record leaves out when it holds it."""
    leaves = _leaves(before, now, "", defaults)
    own = [x for x in leaves if x[0].split(".")[0].split("[")[0] in ("kind", "quick", "study")]
    shown = own or leaves
    out = [f"{p}: was {_short(a)}, now {_short(b)}" for p, a, b in shown[:most]]
    return out + ([f"and {len(shown) - most} more"] if len(shown) > most else [])


# ------------------------------------------------------------------------------------------------------------- reuse
def _relative(entry: Any, root: Path) -> Any:
    """A run's recorded entry with its study folder's path read as `<study>/` (two studies' runs compare equal)."""
    return json.loads(json.dumps(migrated(entry), default=str).replace(json.dumps(f"{root}/")[1:-1], "<study>/"))


def recall_entry(settings: dict[str, Any], rel: Path) -> Any:
    """What trains the recall study's run in folder `rel`: its entry in `settings["runs"]` (None: no such run)."""
    return settings.get("runs", {}).get(rel.name)


def reuse_runs(source: str | Path, out: str | Path, settings: dict[str, Any], folders: Iterable[str],
               entry: Callable[[dict[str, Any], Path], Any] = recall_entry,
               finished: Callable[[Path, Path], bool] | None = None) -> list[str]:
    """Copy into the study folder `out` each run (of `folders`, under `out`) that the study in `source` trained
    exactly as `settings` would train it: `entry(settings, rel)` (what trains the run at `rel`, relative to its study
    folder: the recall study's model and stage configs by default) equal for both studies, each path read relative to
    its study folder, and finished there (`finished(source, rel)`; by default a result kept for the task named by the
    run's folder). A copied run's finished stages are not trained again (`train_stage_once`), and the study scores it
    anew with its own settings. Each copy lands whole (copied beside its place, then renamed) and is listed in `out`'s
    record (reused.json) as it lands. Returns the folders copied (a run already in `out` is left alone)."""
    src, dst = Path(source), Path(out)
    before = recorded_study(src)
    if before is None:
        raise ValueError(f"--reuse: {src} holds no study to take runs from ({src / STUDY_DIR / 'settings.json'} is "
                         f"missing)")
    theirs, ours = study_label(_record(src) or {}), study_label(settings)
    if theirs != ours and "study" not in (theirs, ours):
        raise ValueError(f"--reuse: {src} holds {describe(_record(src) or {})}, not a {ours}: it has no runs this "
                         f"study trains; pass the folder of a {ours}")
    if src.resolve() in (dst.resolve(), *dst.resolve().parents) or dst.resolve() in src.resolve().parents:
        raise ValueError(f"--reuse: {src} and --out {dst} must be separate folders (to continue a study, rerun it "
                         f"with its settings and --resume)")
    copied = []
    for folder in folders:
        rel = Path(folder).relative_to(dst)
        there = src / rel
        old, new = entry(before, rel), entry(settings, rel)
        done = finished(src, rel) if finished is not None else store_path(src / STUDY_DIR / "done",
                                                                          str(there)).is_file()
        if (dst / rel).exists() or old is None or new is None or not done or _relative(old, src) != _relative(new, dst):
            continue
        partial = (dst / rel).with_name(f".{rel.name}.copying")  # an interrupted copy never looks like a finished run
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(there, partial, ignore=shutil.ignore_patterns(".prisme-run.lock"))
        partial.rename(dst / rel)
        copied.append(str(folder))
        runs = {**reused_runs(dst), str(folder): str(src)}
        write_text_atomic(dst / STUDY_DIR / "reused.json", json.dumps({"runs": runs}, indent=1) + "\n")
    return copied


def reused_runs(out: str | Path) -> dict[str, str]:
    """The runs `reuse_runs` copied into the study folder `out`: {folder: the study it came from}."""
    record = Path(out) / STUDY_DIR / "reused.json"
    return json.loads(record.read_text())["runs"] if record.is_file() else {}
