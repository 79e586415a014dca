"""The recall study's settings and recipe: `RecallStudyConfig`, the recipe files (prisme/configs/recall_*.json),
the seeds, and what every task of the study shares (`RecallTask`)."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from prisme.checks import COMPILE_SETTINGS, check_choice, check_seeds, integer, is_int, parse_list
from prisme.config import PrismeConfig
from prisme.data.mqar import MQARConfig
from prisme.io import CONFIG_DIR, loads_config
from prisme.studies.pools import check_executor
from prisme.training.config import StageConfig, load_run_config

BACKBONE_TRAINS_AT_T = ("none", "embedding", "all")  # `context_backbone_trains`
CONTEXT_SEARCHES = ("cheapest", "grid")  # `context_search`: how much of each length's dense grid trains
EVAL_SEED, CALIBRATION_SEED, RANDOM_POLICY_SEED = 100_003, 200_003, 300_007  # + the run's seed

RECIPE_FILES = {"backbone": "recall_backbone.json", "workspace": "recall_workspace.json",
                "controller": "recall_controller.json", "router": "recall_router.json", "study": "recall_study.json"}
TARGET_ACCURACY = 0.95
DENSE_OPTIONS = {"key_shift": False, "attn_window": None}  # backbone options a dense grid block may set, defaults
CHUNK = 256  # sequences per evaluation forward


# ------------------------------------------------------------------------------------------------------------ config
@dataclass
class RecallStudyConfig:
    """The study's own settings (`prisme/configs/recall_study.json`) plus the command line's."""

    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    converged_backbone_steps: int = 600  # stage 1 of the converged case: the backbone trained to its plateau
    converged: bool = True  # run the converged case (`prisme demo` leaves it out for time)
    eval_sequences: int = 2048  # held-out sequences per model, drawn from the run's own seed
    calibration_sequences: int = 1024  # a separate set: the controller's lambda is chosen there
    lambdas: list[float] = field(default_factory=lambda: [0.0, 0.03, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4])
    accuracy_tolerance: float = 0.02  # the chosen lambda's calibration accuracy >= budget-1's minus this
    control_layers: tuple[int, int] = (1, 2)  # negative and positive control depths
    out_dir: str = "runs/recall"
    jobs: int = 0  # worker processes (0 = one per CPU core, at most one per task)
    threads: int = 1  # torch threads per worker
    executor: str = "local"  # where the tasks run: "local" (worker processes) or "ray" (a Ray cluster, `address`)
    address: str | None = None  # the Ray cluster's address (None: a local one, or RAY_ADDRESS's)
    quick: bool = False  # one seed, few steps: a smoke run of every phase
    bank_source: str | None = None  # override the recipe's bank source (and query source), e.g. "residual"
    config_dir: str | None = None  # where the recall_*.json recipe lives (default: the project's prisme/configs/)
    compile: str = "off"  # the editor under torch.compile in stages 2-3 and the evaluation ("auto" | "strict")
    # --- the dense frontier (`--frontier`): backbones alone over depths x widths, and the PRISME family
    frontier: bool = False  # run the frontier study instead of the controller runs (the controls run as always)
    evaluate_only: bool = False  # train nothing: score the checkpoints an earlier run of the same study left in out_dir
    reuse: str | None = None  # a study folder whose runs trained as this study's would are copied, not trained again
    frontier_dense: list[dict[str, Any]] = field(default_factory=lambda: [
        {"depths": [1, 2], "widths": [16, 24, 32, 64]},
        {"depths": [1, 2], "widths": [4, 8, 12, 16, 24], "key_shift": True}])
    #   the dense frontier's grid: blocks of depths x widths, each with its backbone options (`key_shift`,
    #   `attn_window`), e.g. {"depths": [1, 2], "widths": [8, 16], "key_shift": true}
    frontier_steps: int = 1500  # every dense model's steps: >= 1500 and >= the PRISME family's three stages together
    family: list[list[int]] = field(default_factory=lambda: [[16, 32], [24, 32], [32, 32]])  # [backbone d, w]
    family_workspace_steps: int = 1000  # the family's workspace stage (the recipe's 300 is too short below d = 64)
    family_router_token: bool = False  # every family member's router also reads a value per token (`router_token`)
    # --- long contexts (`--frontier --context`): the frontier at several sequence lengths, queries beyond every window
    contexts: list[int] | None = None  # the lengths of this run (None: the recipe's T = 32 alone)
    context_lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])  # `--context` without a list
    context_dense: list[dict[str, Any]] = field(default_factory=lambda: [
        {"depths": [1, 2], "widths": [8, 12, 16, 24, 32]},
        {"depths": [1, 2], "widths": [8, 12, 16, 24, 32], "key_shift": True},
        {"depths": [1, 2], "widths": [16, 32], "attn_window": 64},
        {"depths": [1, 2], "widths": [16, 32], "attn_window": 64, "key_shift": True}])
    # PRISME's members there (`FamilyEntry`: [d, w, window], or an object naming the backbone's and router's options);
    # a 16-window backbone fails (in its T = 32 warm-up the values lie beyond its window, `docs/recall.md`); d = 8,
    # 12 and 16 each pass on fresh seeds 30-34 at T = 1,024 (0.040x, 0.060x, 0.082x)
    context_family: list[Any] = field(default_factory=lambda: [
        {"d": d, "w": 32, "attn_window": 64, "key_shift": True, "router_token": True} for d in (8, 12, 16)])
    context_queries: int = 4  # queries per sequence, every one after the largest window (its pair out of reach)
    context_batch_size: int = 16  # sequences per step of every stage at a long context
    context_frontier_steps: int = 3000  # the dense models' steps there (>= the family's stages together)
    context_workspace_steps: int = 2000  # the family's workspace stage there
    # "cheapest": each length's dense configurations train in increasing ops; those costlier than the cheapest that
    # passes are not trained, nor the other seeds of one that can no longer pass (the cheapest passing configuration
    # is the whole grid's); "grid": all of them
    context_search: str = "cheapest"
    # every model of a long-context study, dense or PRISME, first trains as the recipe's stage 1 at its own short task
    # (T = 32, batch 128) for `context_warmup_steps`: PRISME's backbone is that stage, and each dense model continues
    # at T from it. 600, not the recipe's 200: in 200 steps some seeds' key-shift backbones have not yet learned the
    # lookup at T = 32, their key embeddings stay close, and their workspaces learn it only in part at T
    context_warmup: bool = True
    context_warmup_steps: int = 600
    # PRISME's workspace stage first trains this many steps at the recipe's short task (T = 32, its stage-2 batch),
    # where the lookup forms over a short bank, then at T; every dense model's warm-up trains as many steps more (so
    # every model trains as long at T = 32 as PRISME's stages there together). 0: the workspace trains at T alone
    context_workspace_warmup: int = 300
    # what of PRISME's backbone learns in its workspace stage at a long context: "none" (the default: frozen, as at
    # T = 32), "embedding" its token embedding (what the bank reads), "all" every weight. None of the three passes
    # on two sets of seeds (`docs/recall.md`): frozen, the keys' embeddings stay parallel and some seeds learn the
    # lookup only in part; with every weight the router cannot read the residual stream; with the embedding alone
    # more seeds never leave the stage-2 plateau
    context_backbone_trains: str = "none"
    router_lambdas: list[float] = field(default_factory=lambda: [0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                                                                 0.06, 0.07, 0.08, 0.1, 0.12, 0.15, 0.2])
    # the confirmation pass (`recall_confirm`): fresh seeds the verdict's models train again on; None or []: no pass
    confirm_seeds: list[int] | None = None  # (the command line's default: the 3 after the largest study seed)
    confirm_of: str | None = None  # confirm a recorded study (its JSON document) instead of running one

    def validate(self) -> RecallStudyConfig:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"recall study: {msg}")

        check_seeds(self.seeds, "recall study: ")
        for f in ("converged_backbone_steps", "eval_sequences", "calibration_sequences", "threads"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{f} must be an int >= 1, got {v!r}")
        need(isinstance(self.jobs, int) and self.jobs >= 0, f"jobs must be an int >= 0, got {self.jobs!r}")
        check_executor(self.executor, self.address, need)
        need(isinstance(self.control_layers, (tuple, list)) and len(self.control_layers) == 2
             and all(is_int(v) and v >= 1 for v in self.control_layers),
             f"control_layers must be two layer counts [negative, positive] >= 1, got {self.control_layers!r}")
        need(len(self.lambdas) > 0 and all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0
                                           for x in self.lambdas),
             f"lambdas must be a non-empty list of finite numbers >= 0, got {self.lambdas!r}")
        need(0 <= self.accuracy_tolerance < 1, f"accuracy_tolerance must be in [0, 1), got {self.accuracy_tolerance}")
        check_choice("compile", self.compile, COMPILE_SETTINGS, "recall study: ")
        positive = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
        check_grid("frontier_dense", self.frontier_dense, need)
        check_grid("context_dense", self.context_dense, need)
        for f in ("family", "context_family"):
            v = getattr(self, f)
            need(isinstance(v, list) and len(v) > 0, f"{f} must be a non-empty list of members, got {v!r}")
            for e in v:
                family_entry(e, f)
        for f in ("frontier_steps", "family_workspace_steps", "context_queries", "context_batch_size",
                  "context_frontier_steps", "context_workspace_steps", "context_warmup_steps"):
            need(positive(getattr(self, f)), f"{f} must be an int >= 1, got {getattr(self, f)!r}")
        need(isinstance(self.family_router_token, bool), f"family_router_token must be true or false, got "
                                                           f"{self.family_router_token!r}")
        need(isinstance(self.context_warmup, bool), f"context_warmup must be true or false, got "
                                                     f"{self.context_warmup!r}")
        need(is_int(self.context_workspace_warmup) and self.context_workspace_warmup >= 0,
             f"context_workspace_warmup must be an int >= 0, got {self.context_workspace_warmup!r}")
        need(self.context_warmup or not self.context_workspace_warmup, "context_workspace_warmup needs "
             "context_warmup (the dense models' matching steps at the short task are their warm-up's)")
        need(self.context_backbone_trains in BACKBONE_TRAINS_AT_T, f"context_backbone_trains must be one of "
             f"{list(BACKBONE_TRAINS_AT_T)}, got {self.context_backbone_trains!r}")
        need(self.context_search in CONTEXT_SEARCHES,
             f"context_search must be one of {list(CONTEXT_SEARCHES)}, got {self.context_search!r}")
        for f, v in (("context_lengths", self.context_lengths), ("--context", self.contexts)):
            need(v is None and f == "--context" or isinstance(v, list) and len(v) > 0
                 and all(positive(x) for x in v) and len(set(v)) == len(v),
                 f"{f} must be a non-empty list of distinct ints >= 1 (no length twice), got {v!r}")
        need(not (self.reuse and self.evaluate_only), "--reuse trains what it does not copy: it does not go with "
                                                        "--evaluate-only")
        need(self.contexts is None or self.frontier, "--context needs --frontier (the long-context study is a frontier "
                                                     "study)")
        fresh = self.confirm_seeds
        need(fresh is None or isinstance(fresh, list) and all(is_int(v) and v >= 0 for v in fresh)
             and len(set(fresh)) == len(fresh), f"--confirm-seeds must be distinct ints >= 0, got {fresh!r}")
        need(not fresh or self.frontier, "--confirm-seeds needs --frontier (the pass confirms the frontier's verdict)")
        need(self.confirm_of is None or self.frontier and bool(fresh),
             "--confirm-of needs --frontier and fresh seeds (--confirm-seeds, not none)")
        need(not (self.quick and self.confirm_of), "--quick trains smoke runs, whose accuracy cannot confirm or refute "
             "a recorded study's (--confirm-of): leave --quick out")
        ran = self.seeds[:1] if self.quick else self.seeds  # --quick trains the first seed alone
        need(not set(fresh or []) & set(ran), f"--confirm-seeds {','.join(map(str, fresh or []))} overlap the "
             f"study's seeds {','.join(map(str, ran))}{' (--quick trains the first alone)' if self.quick else ''}: the "
             f"confirmation pass trains on fresh seeds (or pass none for no pass)")
        need(len(self.router_lambdas) > 0 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                  and math.isfinite(x) and x >= 0 for x in self.router_lambdas),
             f"router_lambdas must be a non-empty list of finite numbers >= 0, got {self.router_lambdas!r}")
        return self


@dataclass(frozen=True)
class FamilyEntry:
    """One PRISME family member: backbone width `d`, workspace width `w`, the backbone's options (`attn_window`: a
    local window, the workspace still reading the whole bank; `key_shift`) and the router's (`router_token`; None:
    the study's `family_router_token`). In a study file: a list, [d, w], [d, w, window] or [d, w, window, key shift],
    or an object with these names, e.g. {"d": 16, "w": 32, "attn_window": 64, "key_shift": true}."""

    d: int
    w: int
    attn_window: int | None = None
    key_shift: bool = False
    router_token: bool | None = None


def family_entry(e: Any, name: str = "family") -> FamilyEntry:
    """A family member as written in the study file, checked; ValueError naming `name` (the field)."""
    fields = [f.name for f in dataclasses.fields(FamilyEntry)]
    shape = (f"{name} entries must be [d, w], [d, w, window], [d, w, window, key shift] or an object with "
             f"{fields} (d and w required)")
    if isinstance(e, (list, tuple)) and 2 <= len(e) <= 4:
        e = dict(zip(fields, e))
    if not isinstance(e, dict) or not {"d", "w"} <= set(e) or not set(e) <= set(fields):
        raise ValueError(f"recall study: {shape}, got {e!r}")
    entry = FamilyEntry(**e)
    bad = [f for f in ("d", "w") if not (is_int(getattr(entry, f)) and getattr(entry, f) >= 1)]
    bad += ["attn_window"] if entry.attn_window is not None and not (is_int(entry.attn_window)
                                                                      and entry.attn_window >= 1) else []
    bad += ["key_shift"] if not isinstance(entry.key_shift, bool) else []
    bad += ["router_token"] if entry.router_token is not None and not isinstance(entry.router_token, bool) else []
    if bad:
        raise ValueError(f"recall study: {name} entry {e!r}: {', '.join(bad)} must be ints >= 1 (d, w, attn_window) "
                         f"or true / false (key_shift, router_token)")
    return entry


def check_grid(name: str, grid: Any, need: Any) -> None:
    """A dense grid (`frontier_dense`, `context_dense`): blocks of depths x widths with their backbone options, no
    configuration twice; `need(ok, message)` raises."""
    positive = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
    need(isinstance(grid, list) and len(grid) > 0, f"{name} must be a non-empty list of grid blocks, got {grid!r}")
    seen: set[tuple] = set()
    for block in grid:
        need(isinstance(block, dict) and {"depths", "widths"} <= set(block)
             and set(block) <= {"depths", "widths", *DENSE_OPTIONS},
             f"{name} entries must be {{depths, widths[, {', '.join(DENSE_OPTIONS)}]}}, got {block!r}")
        for f in ("depths", "widths"):
            v = block[f]
            need(isinstance(v, list) and len(v) > 0 and all(positive(x) for x in v) and len(set(v)) == len(v),
                 f"{name} {f} must be a non-empty list of distinct ints >= 1, got {v!r}")
        need(isinstance(block.get("key_shift", False), bool),
             f"{name} key_shift must be true or false, got {block.get('key_shift')!r}")
        need(block.get("attn_window") is None or positive(block["attn_window"]),
             f"{name} attn_window must be an int >= 1 or null, got {block.get('attn_window')!r}")
        for L in block["depths"]:
            for d in block["widths"]:
                key = (L, d, *(block.get(o, DENSE_OPTIONS[o]) for o in DENSE_OPTIONS))
                need(key not in seen, f"{name} lists the configuration {key} twice")
                seen.add(key)


def parse_seeds(text: str, option: str = "--seeds") -> list[int]:
    """`--seeds 0,1,2` -> [0, 1, 2]; ValueError naming `option` for an empty list, a negative or non-integer entry, or
    a repeat (`checks.parse_list`)."""
    return parse_list(text, option, integer(0), example="0,1,2", distinct=True)


@dataclass
class Recipe:
    """The three stages of one run and the model they start from."""

    model: PrismeConfig
    backbone: StageConfig
    workspace: StageConfig
    controller: StageConfig
    mqar: MQARConfig
    router: StageConfig | None = None  # the PRISME family's third stage (`--frontier`)
    warmup: StageConfig | None = None  # at a long context: the recipe's own stage 1 at its short task, every model's
    #   first stage (`context_warmup`)
    workspace_warmup: StageConfig | None = None  # at a long context: the recipe's stage 2 at its short task, PRISME's
    #   before its workspace stage at T (`context_workspace_warmup`)


def load_recipe(cfg: RecallStudyConfig) -> tuple[Recipe, dict[str, Any]]:
    """The recipe `configs/recall_*.json` (or `cfg.config_dir`), with the study's overrides applied."""
    folder = Path(cfg.config_dir) if cfg.config_dir else CONFIG_DIR
    paths = {k: folder / v for k, v in RECIPE_FILES.items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise ValueError(f"the recall recipe is missing {missing}; pass --configs DIR holding "
                         f"{sorted(RECIPE_FILES.values())}")
    model, s1 = load_run_config(paths["backbone"])
    _, s2 = load_run_config(paths["workspace"])
    _, s3 = load_run_config(paths["controller"])
    _, s_router = load_run_config(paths["router"])
    if model is None:
        raise ValueError(f"{paths['backbone']} must name the model (a 'model' entry)")
    try:
        study = json.loads(paths["study"].read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{paths['study']} is not valid JSON: {e}") from None
    if cfg.bank_source is not None:
        model = model.replace(bank_source=cfg.bank_source, query_source=cfg.bank_source)
    mqar = MQARConfig(**s1.mqar)
    mqar.validate()
    check_long_task(cfg, mqar, paths)
    return Recipe(model, s1, s2, s3, mqar, s_router), study


def check_long_task(cfg: RecallStudyConfig, mqar: MQARConfig, paths: dict[str, Path]) -> None:
    """At long contexts (`--context`): every length holds `context_queries` queries after the pairs and the largest
    attention window (every query's pair out of reach), within the longest context the model takes; before anything
    trains, a ValueError naming what to change (the study file's field, the recipe's, or --context)."""
    if cfg.contexts is None:
        return
    t_max = PrismeConfig.from_name("recall_long").max_seq_len  # the long-context models' preset (`LONG_PRESET`)
    study, recipe = paths["study"], paths["backbone"]
    queries, pairs = cfg.context_queries, mqar.n_pairs
    if queries > pairs:
        raise ValueError(f"recall study: context_queries = {queries} (in {study}) is more than the task's n_pairs = "
                         f"{pairs} (mqar in {recipe}): each query asks for another pair; set context_queries to at "
                         f"most {pairs}")
    windows = [b.get("attn_window") or 0 for b in cfg.context_dense] + [
        family_entry(e, "context_family").attn_window or 0 for e in cfg.context_family]
    need = 2 * pairs + max(windows, default=0) + 2 * queries  # the pairs, the window, a key + answer per query
    if need > t_max:
        raise ValueError(f"recall study: the largest attention window, {max(windows)} (context_dense / "
                         f"context_family attn_window in {study}), leaves no room for {queries} queries within the "
                         f"longest context the model takes, T_max = {t_max:,} (they need {need:,} positions): lower "
                         f"that attn_window to at most {t_max - need + max(windows):,}")
    short = [T for T in cfg.contexts if T < need]
    if short:
        raise ValueError(f"recall study: --context {','.join(map(str, short))} cannot hold {queries} queries after the "
                         f"{pairs} pairs and the largest attention window, {max(windows)} (they need {need:,} "
                         f"positions): pass lengths of at least {need:,}")


def study_config(overrides: dict[str, Any], config_dir: str | None = None) -> RecallStudyConfig:
    """`RecallStudyConfig` from `recall_study.json` (its known fields) updated by `overrides` (the command line)."""
    folder = Path(config_dir) if config_dir else CONFIG_DIR
    path = folder / RECIPE_FILES["study"]
    base: dict[str, Any] = {}
    if path.is_file():
        try:
            raw = loads_config(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if not isinstance(raw, dict):
            kind = {list: "an array", str: "a string", bool: "true / false", type(None): "null"}.get(type(raw),
                                                                                                  "a number")
            raise ValueError(f"{path} must hold a JSON object of study settings ({{\"seeds\": [0, 1], ...}}), got "
                             f"{kind}")
        known = {f.name for f in dataclasses.fields(RecallStudyConfig)}
        unknown = sorted(set(raw) - known - {"description"})
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {unknown}; known: {sorted(known)}")
        base = {k: v for k, v in raw.items() if k in known}
        if isinstance(base.get("control_layers"), list):  # anything else is `validate`'s to name
            base["control_layers"] = tuple(base["control_layers"])
    base.update({k: v for k, v in overrides.items() if v is not None})
    base["config_dir"] = config_dir
    return RecallStudyConfig(**base).validate()


# ------------------------------------------------------------------------------------------------------------ tasks
def _quick(s: StageConfig, steps: int) -> StageConfig:
    return s.replace(steps=steps, warmup=min(s.warmup, max(1, steps // 4)))


@dataclass(frozen=True, kw_only=True)
class RecallTask:
    """One independent run of the recall study: its stages trained one after the other in `folder`, then the last
    checkpoint evaluated, in a worker process (every field pickles). Each kind of run is a subclass: it says how its
    model is scored (`evaluate`), which part of the document its entry belongs to (`section`) and how early it
    starts (`priority`)."""

    kind: ClassVar[str]  # the run's kind in its result's description (`describe`)
    section: ClassVar[str]  # the part of the study's document its entry goes to
    priority: ClassVar[int] = 0  # the larger the earlier it starts: the longest first, so that workers finish together
    compiles: ClassVar[bool] = True  # the evaluated model goes under `maybe_compile` (the study's `compile`)

    seed: int
    folder: str
    stages: tuple[StageConfig, ...]
    model: PrismeConfig  # the model stage 1 starts from
    mqar: MQARConfig
    study: RecallStudyConfig
    device: str = "auto"  # where stages set to "auto" run (`devices.spread`)

    @property
    def name(self) -> str | None:
        """The run's name among the runs of its kind on its seed (None: the seed alone names it)."""
        return None

    def stage_folders(self) -> list[str]:
        """The run folder of each stage: 1_backbone, 2_workspace, 3_controller (or 3_router)."""
        return [f"{i + 1}_{s.stage}" for i, s in enumerate(self.stages)]

    def stage_steps(self) -> dict[str, int]:
        """Each stage's steps by stage name; a stage that comes again is `name_2`, `name_3` (a dense model's long stage
        after its warm-up)."""
        out: dict[str, int] = {}
        seen: collections.Counter[str] = collections.Counter()
        for s in self.stages:
            seen[s.stage] += 1
            count = seen[s.stage]
            out[s.stage if count == 1 else f"{s.stage}_{count}"] = s.steps
        return out

    def describe(self) -> dict[str, Any]:
        """The run in its result (`{"kind", "seed", "folder", "name"}`), as JSON."""
        return {"kind": self.kind, "seed": self.seed, "folder": self.folder, "name": self.name}

    def evaluate(self, model: Any, checkpoint: str) -> dict[str, Any]:
        """The run's entry: its trained `model` (from `checkpoint`) scored on the held-out sequences."""
        raise NotImplementedError

    def phase(self, stage: str) -> str:
        """The phase of the study's wall time that this run's `stage` (or "evaluate") counts towards."""
        return stage

    def headline(self, entry: dict[str, Any]) -> float:
        """The accuracy a progress line shows for this run's entry."""
        return entry.get("budget1_accuracy", entry.get("accuracy"))


def own_settings(out: str, given: dict[str, Any]) -> dict[str, Any]:
    """The run-choosing settings (`given`'s keys) the study in `out` was run with (its record, or an older folder's
    recall.json), for those not given on the command line; a note on stderr names them."""
    from prisme.studies.runner import recorded_study

    before = recorded_study(out)
    study = before.get("study", {}) if before is not None else {}
    if before is None and (Path(out) / "recall.json").is_file():
        study = json.loads((Path(out) / "recall.json").read_text()).get("study", {})
    own = {k: study[k] for k, v in given.items() if v is None and k in study}
    if own:
        print(f"--evaluate-only: re-scoring with the settings the study in {out} was run with ("
              f"{', '.join(f'{k}={v}' for k, v in own.items())})", file=sys.stderr, flush=True)
    return own


def check_document_kind(cfg: RecallStudyConfig) -> None:
    """A study never replaces a recall.json of another kind (quick or full, controllers or frontier) in its folder."""
    path = Path(cfg.out_dir) / "recall.json"
    if not path.is_file():
        return
    try:
        study = json.loads(path.read_text()).get("study", {})
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return
    old = {"quick": bool(study.get("quick")), "frontier": bool(study.get("frontier"))}
    new = {"quick": cfg.quick, "frontier": cfg.frontier}
    if old != new:
        shown = ", ".join(f"{k} {old[k]} (asked {new[k]})" for k in old if old[k] != new[k])
        raise ValueError(f"{path} is a study document of another kind ({shown}); it is not replaced: pass the "
                         f"options it was made with, or another --out")
