"""The text study's settings (`TextStudyConfig`), its bank sources and the stage configs of one training seed: the
demo recipe's three stages, the matched backbone, and the dense frontier (backbones alone, trained on as many tokens
as PRISME's stages together)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prisme.checks import COMPILE_SETTINGS, check_choice, check_seeds, parse_list
from prisme.config import PrismeConfig
from prisme.data.corpora import resolve_corpus
from prisme.data.text import HELD_OUT_TEXT
from prisme.studies.pools import check_executor
from prisme.training.config import StageConfig

SOURCES = {  # name -> PrismeConfig overrides of the demo preset
    "residual": {},
    "embedding": dict(bank_source="embedding", bank_shift=True, controller_source="residual", controller_bank=True),
    # an induction-style bank: entry j's key also reads H_{j-1} (the context before byte j), its value H_j (byte j),
    # so a query matching a context reads the byte that followed it
    "residual_shift": dict(bank_shift=True),
    # the one-step induction read (`bank_key="preceding"`): entry j's key reads position j-1 alone, its value j, so a
    # query that matches what preceded byte j reads byte j; the query from H (residual) or the token (embedding)
    "residual_preceding": dict(bank_key="preceding"),
    "embedding_preceding": dict(bank_source="embedding", bank_key="preceding", controller_source="residual",
                                controller_bank=True),
}
DEFAULT_SOURCES = ["residual", "embedding"]
VAL_POLICIES = ["backbone", "matched", "fixed", "random", "dense", "controller", "oracle"]
CONTEXT_POLICIES = ["backbone", "matched", "fixed", "controller", "oracle"]  # `--context`: its deployed rows are the
#   router's at budget 1 (the "controller" family of a router model), beside one fixed edit everywhere and the oracle
HELD_OUT_POLICIES = ["backbone", "matched", "fixed", "controller", "oracle"]  # all of the text: the cheaper rows
DEFAULT_SEEDS = [1337, 1338, 1339]
SLICE_BUCKETS = (256, 1024)  # `--context`: the AR hits beyond PRISME's window split at these copy distances (those
#   below T)
MAX_CONTEXT = 4096  # `--context`: the longest window of the project's presets (recall_long's and prisme_459m's T_max)
# the dense frontier: backbones alone, from scratch on PRISME's tokens; an entry is [n_layer, d_model] (None = the
# preset's width), optionally [.., key_shift, attn_window] (`FRONTIER_OPTIONS`). Every help PRISME's bank gets the dense
# family gets too: the key shift (its bank reads the previous token; the shifted key is the cheapest dense induction)
DEFAULT_FRONTIER: list[list[Any]] = [[1, None], [2, None], [3, None], [1, 96], [1, None, True], [2, None, True],
                                     [3, None, True]]
FRONTIER_OPTIONS = {"key_shift": False, "attn_window": None, "copy_head": False}  # a frontier entry's options after
#   [L, d]: the key shift, a causal attention window, the copy head (`prisme.model.copy`: the copy stage on the model)
NO_COPY = "local_backbone"  # a copy-head study's row: PRISME's stage-1 backbone alone, no far read
EXACT_COPY = "exact_copy_reference"  # ... and with the untrained exact copy (`evaluation.policies.ExactCopyRows`)
COPY_STEPS = 500  # the copy stage's steps of 4 x T bytes (`copy_stage`), PRISME's and every dense model's alike


@dataclass
class TextStudyConfig:
    """Settings of `prisme study text`."""

    sources: list[str] = field(default_factory=lambda: list(DEFAULT_SOURCES))
    seeds: list[int] = field(default_factory=lambda: list(DEFAULT_SEEDS))  # training seeds: every run per seed
    frontier: list[list[Any]] = field(default_factory=lambda: [list(f) for f in DEFAULT_FRONTIER])
    scale: float = 1.0  # multiplies every stage's steps (0.05: a smoke run)
    val_batches: int | None = 8  # validation batches of `eval_batch_size` x 128 (None: the whole split)
    held_out_batches: int | None = None  # batches of the held-out text (None: all of it)
    eval_batch_size: int = 64
    corpus: str = "austen"  # the training text (its validation split too): a corpus name, a UTF-8 file or folder, or
    #   a folder `prisme data prepare` wrote (`data.corpora.resolve_corpus`)
    held_out: str = HELD_OUT_TEXT  # the held-out text, scored whole: a corpus name, a file or a folder (the same)
    lambdas: list[float] = field(default_factory=lambda: [0.001, 0.003])  # the controller's prices (validation)
    held_out_lambdas: list[float] = field(default_factory=lambda: [0.003])  # ... on the held-out text (all of it)
    controller_budget: int = 1  # edits per position the deployed controller may make (its workspace trained 1..4)
    kappa_risk: float = 0.3  # its risk aversion: value - lambda cost - kappa risk (docs/workspace_training.md)
    oracle_positions: int = 4  # labelled positions per sequence the oracle samples (validation)
    held_out_oracle_positions: int = 1  # ... and on the held-out text (all of it: more sequences)
    fixed_budgets: list[int] = field(default_factory=lambda: [1])  # n of the fixed/random/dense rows (validation)
    held_out_budgets: list[int] = field(default_factory=lambda: [1])  # ... on the held-out text (single slots only)
    bootstrap_samples: int = 1000
    slice_ngram: int = 4  # n of the AR-hit / seen-miss / other slices (`evaluation.slices`)
    window: int | None = None  # evaluation windows (default: the workspace stage's 128; at most the preset's T_max)
    out_dir: str = "runs/text"
    jobs: int = 0  # worker processes (0 = one per CPU core)
    threads: int = 1  # torch threads per worker
    executor: str = "local"  # where the tasks run: "local" (worker processes) or "ray" (a Ray cluster, `address`)
    address: str | None = None  # the Ray cluster's address (None: a local one, or RAY_ADDRESS's)
    progress: bool = True
    backbone_keeps_learning: bool = False  # stage 2 also trains the backbone (from its own loss, the matched steps)
    compile: str = "off"  # the editor under torch.compile in stages 2-3 and the evaluation ("auto" | "strict")
    reuse: str | None = None  # a text study folder whose finished runs trained as this study's would: copied, not
    #   trained again (every run is scored anew: another held-out text, other scoring settings)
    confirm_seeds: list[int] | None = None  # the confirmation pass's fresh seeds (`text_confirm`): the runs that decide
    #   the verdicts train again on them (None or []: no pass; the command line's default: the 3 after the largest seed)
    # --- long contexts (`--context T`): windows of T bytes; PRISME's backbone is local (`context_model`: a 64-byte
    # attention window with the key shift) and its workspace reads the whole context where its router fires
    context: int | None = None  # None: the T = 128 study above
    context_model: dict[str, Any] = field(default_factory=lambda: {
        "attn_window": 64, "key_shift": True, "router": True, "router_ngram": 4, "w": 32, "ws_head_dim": 16})
    # the dense frontier there: global attention (1-3 layers, with the key shift; one layer without) and local
    # windows (the same, at PRISME's window): every model trained from scratch on PRISME's bytes
    context_frontier: list[list[Any]] = field(default_factory=lambda: [
        [1, None], [1, None, True], [2, None, True], [3, None, True],
        [1, None, False, 64], [1, None, True, 64], [2, None, True, 64], [3, None, True, 64]])
    context_router_steps: int = 100  # the router stage (its value head regressed on the oracle's loss drops)
    context_oracle_positions: int = 64  # positions per training sequence where the router stage runs every action
    context_eval_batch_size: int = 8  # windows of T per evaluation batch
    context_lambdas: list[float] = field(default_factory=lambda: [0.003, 0.01, 0.03])  # the router's prices
    prisme_layers: int | None = None  # PRISME's backbone depth at `--context` (None: the preset's, 1); the frontier
    #   must hold that depth's global model and its window twin (the capture's reference)
    workspace_steps: int | None = None  # the workspace stage's steps at `--context`, times `scale` (None: the
    #   recipe's 240 of 2 x T bytes); the matched run and every frontier model train on the added bytes too
    copy_head: bool | None = None  # `--context`: PRISME's backbone gets the copy head (`prisme.model.copy`: its copy
    #   stage after stage 1), and every dense model of the frontier a twin with the same head ("+copy"); None: on for
    #   a corpus split by whole files (code, a folder of files), off otherwise
    copy_steps: int = COPY_STEPS  # the copy stage's steps (times `scale`), PRISME's and each dense twin's

    def validate(self, model_cfg: PrismeConfig | None = None) -> TextStudyConfig:
        """ValueError naming the option for bad settings (the frontier's widths against `model_cfg`'s heads)."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"text study: {msg}")

        def is_count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        need(len(self.sources) > 0 and all(s in SOURCES for s in self.sources),
             f"sources (--sources) must be a non-empty list from {sorted(SOURCES)}, got {self.sources!r}")
        check_seeds(self.seeds, "text study: ")
        fresh = self.confirm_seeds or []
        need(isinstance(fresh, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in fresh)
             and len(set(fresh)) == len(fresh), f"--confirm-seeds must be distinct ints >= 0, got "
             f"{self.confirm_seeds!r}")
        need(not set(fresh) & set(self.seeds), f"--confirm-seeds {','.join(map(str, fresh))} overlap the study's seeds "
             f"(--seeds) {','.join(map(str, self.seeds))}: the confirmation pass trains on fresh seeds")
        need(isinstance(self.frontier, list) and len(self.frontier) > 0 and all(frontier_entry_ok(f)
                                                                           for f in self.frontier),
             f"frontier (--frontier) must be a non-empty list of [n_layer >= 1, d_model >= 1 or null(, key_shift "
             f"true/false(, attn_window >= 1 or null))], got {self.frontier!r}")
        need(isinstance(self.scale, (int, float)) and self.scale > 0 and math.isfinite(self.scale),
             f"scale (--scale) must be a finite number > 0, got {self.scale}")
        for f in ("val_batches", "held_out_batches"):
            v = getattr(self, f)
            need(v is None or is_count(v), f"{f}{OPTIONS.get(f, '')} must be an int >= 1 or None (all), got {v!r}")
        need(self.window is None or is_count(self.window), f"window (--window) must be an int >= 1 or None, got "
                                                            f"{self.window!r}")
        for f in ("eval_batch_size", "oracle_positions", "bootstrap_samples", "threads", "slice_ngram"):
            v = getattr(self, f)
            need(is_count(v), f"{f}{OPTIONS.get(f, '')} must be an int >= 1, got {v!r}")
        need(isinstance(self.jobs, int) and self.jobs >= 0, f"jobs (--jobs) must be an int >= 0, got {self.jobs!r}")
        check_executor(self.executor, self.address, need)
        need(all(isinstance(n, int) and n >= 1 for n in self.fixed_budgets), "fixed_budgets must be ints >= 1")
        need(len(self.lambdas) > 0 and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                                           for v in self.lambdas), f"lambdas must be finite numbers >= 0, got "
             f"{self.lambdas!r}")
        need(is_count(self.controller_budget), f"controller_budget must be an int >= 1, got "
             f"{self.controller_budget!r}")
        need(isinstance(self.kappa_risk, (int, float)) and math.isfinite(self.kappa_risk) and self.kappa_risk >= 0,
             f"kappa_risk must be a finite number >= 0, got {self.kappa_risk!r}")
        check_choice("compile", self.compile, COMPILE_SETTINGS, "text study: ")
        need(self.context is None or is_count(self.context) and self.context >= 2,
             f"--context must be an int >= 2 (bytes per window), got {self.context!r}")
        need(self.context is None or self.context <= MAX_CONTEXT, f"--context {self.context} is longer than "
             f"{MAX_CONTEXT:,}, the longest context of the project's models: pass {MAX_CONTEXT} or less")
        need(self.context is None or self.window is None, "--window and --context are two ways to set the window "
             "length: give one")
        need(isinstance(self.context_model, dict), f"context_model must be an object of model fields, got "
             f"{self.context_model!r}")
        need(isinstance(self.context_frontier, list) and len(self.context_frontier) > 0
             and all(frontier_entry_ok(f) for f in self.context_frontier),
             f"context_frontier must be a non-empty list of frontier entries, got {self.context_frontier!r}")
        for f in ("context_router_steps", "context_oracle_positions", "context_eval_batch_size"):
            need(is_count(getattr(self, f)), f"{f} must be an int >= 1, got {getattr(self, f)!r}")
        need(self.copy_head is None or isinstance(self.copy_head, bool), f"copy_head (--copy-head) must be true, false "
             f"or None (auto), got {self.copy_head!r}")
        need(is_count(self.copy_steps), f"copy_steps (--copy-steps) must be an int >= 1, got {self.copy_steps!r}")
        need(not self.copy_head or self.context is not None, "--copy-head goes with --context (the long-context "
                                                            "study's PRISME)")
        for f in ("prisme_layers", "workspace_steps"):
            v = getattr(self, f)
            need(v is None or is_count(v), f"{f} (--{f.replace('_', '-')}) must be an int >= 1, got {v!r}")
            need(v is None or self.context is not None,
                 f"--{f.replace('_', '-')} goes with --context (the long-context study's PRISME)")
        for f, name in (("corpus", "--corpus"), ("held_out", "--held-out")):
            try:
                resolve_corpus(getattr(self, f))
            except ValueError as e:
                raise ValueError(f"text study: {name}: {e}") from None
        need(len(self.context_lambdas) > 0 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   and math.isfinite(v) and v >= 0 for v in self.context_lambdas),
             f"context_lambdas must be finite numbers >= 0, got {self.context_lambdas!r}")
        if model_cfg is not None:
            need(self.window is None or self.window <= model_cfg.max_seq_len,
                 f"--window {self.window} is longer than the preset's context T_max={model_cfg.max_seq_len}")
            model_cfg = self.study_model(model_cfg)
            if self.context is not None:
                least = shortest_context(self, model_cfg)
                need(self.context >= least, f"--context {self.context} is too short for PRISME's model: {least} "
                     f"bytes at least (more than its backbone's attention window, context_model attn_window = "
                     f"{model_cfg.attn_window}, and than its n-grams: the router's router_ngram = "
                     f"{model_cfg.router_ngram if model_cfg.router else '-'}, --ngram {self.slice_ngram})")
            T = self.eval_window or min(128, model_cfg.max_seq_len)
            need(self.slice_ngram < T, f"--ngram {self.slice_ngram}: an n-gram as long as the {T}-byte windows occurs "
                                       f"in none; pass --ngram {T - 1} or less")
            for f in self.frontier_entries:
                frontier_config(model_cfg, *f)
            if self.context is not None and self.prisme_layers is not None:
                check_twins(self.context_frontier, self.prisme_layers, model_cfg.attn_window)
        return self

    @property
    def uses_copy(self) -> bool:
        """Whether the study's models get the copy head (`copy_head`, resolved: on by default at `--context` for a
        corpus split by whole files)."""
        if self.copy_head is not None:
            return bool(self.copy_head)
        if self.context is None:
            return False
        try:
            return resolve_corpus(self.corpus).by_files
        except ValueError:
            return False

    @property
    def frontier_entries(self) -> list[list[Any]]:
        """The dense frontier this study trains: `frontier`, or at a long context `context_frontier`; where the study
        gives PRISME the copy head, each entry without one and its twin with it (the dense family gets the same
        help)."""
        base = self.frontier if self.context is None else self.context_frontier
        if not self.uses_copy:
            return base
        out: list[list[Any]] = []
        for f in base:
            o = frontier_options(f)
            plain = [f[0], f[1], o["key_shift"], o["attn_window"]]
            out += [plain, [*plain, True]] if not o["copy_head"] else [plain, list(f)]
        return [list(e) for e in dict.fromkeys(tuple(e) for e in out)]

    @property
    def eval_window(self) -> int | None:
        """The evaluation windows' length (None: the workspace stage's)."""
        return self.context or self.window

    def study_model(self, preset: PrismeConfig) -> PrismeConfig:
        """The model the study trains: the preset, or at a long context the preset at T_max >= T with
        `context_model` (ValueError naming `context_model`)."""
        if self.context is None:
            return preset
        depth = {} if self.prisme_layers is None else {"n_layer": self.prisme_layers}
        try:
            return preset.replace(max_seq_len=max(preset.max_seq_len, self.context), **self.context_model, **depth)
        except (TypeError, ValueError) as e:
            raise ValueError(f"text study: context_model {self.context_model!r} does not make a model: {e}") from None


OPTIONS = {"val_batches": " (--val-batches)", "threads": " (--threads)", "slice_ngram": " (--ngram)"}  # fields the
#   command line sets, named with their option in errors


def check_twins(frontier: list[list[Any]], depth: int, window: int | None) -> None:
    """ValueError unless the frontier holds a global-attention model of PRISME's depth and its window twin (the same
    entry at PRISME's attention window): the pair PRISME's capture is measured against."""
    entries = [[*f[:2], *list(frontier_options(f).values())[:2]] for f in frontier]  # [L, d, key_shift, window]
    if not any(f[0] == depth and f[3] is None and [*f[:3], window] in entries for f in entries):
        raise ValueError(f"text study: --prisme-layers {depth}: the dense frontier holds no {depth}-layer global model "
                         f"with its {window}-window twin (e.g. {depth}ks and {depth}w{window}ks in --frontier): "
                         f"PRISME's capture is measured against that pair")


def context_slice_edges(window: int | None, T: int) -> int | tuple[int, ...] | None:
    """The slices' window at `--context T`: PRISME's attention window, then the `SLICE_BUCKETS` edges between it and T
    (`evaluation.slices.slice_edges`); None without a window."""
    if window is None:
        return None
    return (window, *(e for e in SLICE_BUCKETS if window < e < T))


def shortest_context(cfg: TextStudyConfig, model_cfg: PrismeConfig) -> int:
    """The shortest `--context` the long-context study can run: longer than PRISME's attention window (nothing would
    lie beyond it) and than its n-grams (the router's `router_ngram`, the slices' `slice_ngram`)."""
    return max(2, (model_cfg.attn_window or 0) + 1, (model_cfg.router_ngram if model_cfg.router else 0) + 1,
               cfg.slice_ngram + 1)


def frontier_entry_ok(f: Any) -> bool:
    """Whether `f` is a frontier entry: [n_layer, d_model] (d None: the preset's), optionally + [key_shift(,
    attn_window(, copy_head))]."""
    count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
    return (isinstance(f, (list, tuple)) and 2 <= len(f) <= 5 and count(f[0]) and (f[1] is None or count(f[1]))
            and (len(f) < 3 or isinstance(f[2], bool)) and (len(f) < 4 or f[3] is None or count(f[3]))
            and (len(f) < 5 or isinstance(f[4], bool)))


def frontier_options(f: Any) -> dict[str, Any]:
    """A frontier entry's backbone options (`FRONTIER_OPTIONS`), defaults filled in."""
    return {k: (f[2 + i] if len(f) > 2 + i else v) for i, (k, v) in enumerate(FRONTIER_OPTIONS.items())}


_FRONTIER_ITEM = re.compile(r"(\d+)(?:x(\d+))?(?:w(\d+))?(ks)?(\+copy)?")


def parse_frontier(text: str) -> list[list[Any]]:
    """`--frontier 1,2,1x96,2ks,1w64ks,2w64ks+copy` -> [[1, None], [2, None], [1, 96], [2, None, True], [1, None,
    True, 64], [2, None, True, 64, True]]: LAYERS[xWIDTH][wWINDOW][ks][+copy] (a width, a causal attention window,
    the key shift, the copy head)."""
    return parse_list(text, "--frontier", frontier_item, example="1,2,1x96,2ks,1w64ks,2w64ks+copy")


def frontier_item(item: str) -> list[Any]:
    """One `--frontier` entry, LAYERS[xWIDTH][wWINDOW][ks][+copy], as a frontier entry (`parse_frontier`)."""
    m = _FRONTIER_ITEM.fullmatch(item)
    if m is None:
        raise ValueError(f"entries are LAYERS[xWIDTH][wWINDOW][ks][+copy], got {item!r}")
    layers, width, window, ks, copy = m.groups()
    entry: list[Any] = [int(layers), int(width) if width else None]
    if ks or window or copy:
        entry.append(bool(ks))
    if window or copy:
        entry.append(int(window) if window else None)
    if copy:
        entry.append(True)
    return entry


def frontier_name(model_cfg: PrismeConfig, n_layer: int, d_model: int | None, *options: Any) -> str:
    """L<layers>_d<width>[_w<window>][_ks][+copy]: a frontier entry's folder and row name."""
    o = frontier_options([n_layer, d_model, *options])
    return (f"L{n_layer}_d{d_model or model_cfg.d_model}" + (f"_w{o['attn_window']}" if o["attn_window"] else "")
            + ("_ks" if o["key_shift"] else "") + ("+copy" if o["copy_head"] else ""))


def frontier_config(model_cfg: PrismeConfig, n_layer: int, d_model: int | None, *options: Any) -> PrismeConfig:
    """The preset's backbone alone at another depth and width, with the entry's backbone options (a backbone the
    preset's own options do not set: neither key shift nor window unless the entry says so); ValueError naming
    `frontier`."""
    try:
        over = {"n_layer": n_layer, "use_workspace": False, "router": False, **frontier_options([n_layer, d_model,
                                                                                                  *options])}
        if d_model is not None and d_model != model_cfg.d_model:
            over |= {"d_model": d_model, "ffn_hidden": None}
        return model_cfg.replace(**over, name=frontier_name(model_cfg, n_layer, d_model, *options))
    except ValueError as e:
        raise ValueError(f"text study: frontier entry {[n_layer, d_model, *options]} does not make a model: {e}"
                         ) from None


def source_config(base: PrismeConfig, source: str) -> PrismeConfig:
    return base.replace(**SOURCES[source]) if SOURCES[source] else base


def stage_configs(cfg: TextStudyConfig, model_cfg: PrismeConfig, seed: int) -> dict[str, StageConfig]:
    """One training seed's runs in `<out>/seed<seed>`: the demo's recipe (`training.config.demo_stage_configs`,
    configs/demo_*.json) and every frontier backbone ("frontier:<name>"), trained from scratch with stage 1's
    settings on as many tokens as PRISME's stages together. With the copy head (`uses_copy`): PRISME's copy stage
    ("copy", after stage 1; each source runs it in its own folder), the matched backbone's ("matched_copy") and each
    "+copy" frontier twin's (its dense model's checkpoint, then the copy stage: "frontier:<name>+copy")."""
    from prisme.training.config import demo_stage_configs

    run = Path(cfg.out_dir) / f"seed{seed}"
    st = demo_stage_configs(run, cfg.scale, seed, cfg.backbone_keeps_learning,
                            seq_len=min(128, model_cfg.max_seq_len))
    if cfg.context is not None:
        st = context_stages(cfg, st)
    s1 = st["backbone"]
    if cfg.uses_copy:
        st["copy"] = copy_stage(cfg, s1, run / "copy")
        st["matched_copy"] = copy_stage(cfg, s1, run / "matched_copy").replace(init_from=st["matched"].out_dir)
    tokens = sum(st[k].steps * st[k].batch_size * st[k].seq_len for k in ("backbone", "workspace", "controller",
                                                                          "copy") if k in st)
    steps = math.ceil(tokens / (s1.batch_size * s1.seq_len))
    for f in cfg.frontier_entries:
        name = frontier_name(model_cfg, *f)
        folder = run / "frontier" / name
        st[f"frontier:{name}"] = copy_stage(cfg, s1, folder) if frontier_options(f)["copy_head"] else \
            s1.replace(steps=steps, out_dir=str(folder))
    ws_stages = ("workspace", "controller")
    return {k: v.replace(progress=False, compile=cfg.compile if k in ws_stages else "off", dataset=cfg.corpus)
            for k, v in st.items()}


def copy_stage(cfg: TextStudyConfig, s1: StageConfig, out_dir: Path) -> StageConfig:
    """The copy stage (`prisme.model.copy`, `training.objectives.CopyObjective`): `copy_steps` (x `scale`) of
    4,096 bytes (4 windows at T = 1,024) on a frozen backbone, lr 3e-3 to 3e-4, the seed's data order."""
    n = max(2, round(cfg.copy_steps * cfg.scale))
    return s1.replace(stage="copy", steps=n, batch_size=max(1, 4096 // s1.seq_len), lr=3e-3, min_lr=3e-4,
                      warmup=min(20, n), eval_every=n, out_dir=str(out_dir), init_from=None)


def plain_entry(f: list[Any]) -> list[Any]:
    """A "+copy" frontier entry's dense model without the copy head (the checkpoint its copy stage starts from)."""
    o = frontier_options(f)
    return [f[0], f[1], o["key_shift"], o["attn_window"]]


def copy_config(model_cfg: PrismeConfig) -> PrismeConfig:
    """PRISME's model with the copy head (the study's `copy_head`)."""
    return model_cfg.replace(copy_head=True)


FINAL_FOLDERS = {"controller": "4_controller", "router": "3_router"}


def final_folder(stages: dict[str, StageConfig]) -> str:
    """The folder of a source's last stage: the controller's (4_controller), or at a long context the router's."""
    return FINAL_FOLDERS[stages["controller"].stage]


def context_stages(cfg: TextStudyConfig, st: dict[str, StageConfig]) -> dict[str, StageConfig]:
    """The demo's stages at windows of T = `cfg.context` bytes, each step as many bytes as at 128 (batch 16 x 128 ->
    2 x 1,024), and its third stage the router's (`context_router_steps` of one window, the oracle's loss drops at
    `context_oracle_positions` positions each, budget 1); the workspace stage `workspace_steps` steps where set (times
    `scale`); the matched run as many bytes as stage 2."""
    T = cfg.context
    out = {k: s.replace(seq_len=T, batch_size=max(1, s.batch_size * s.seq_len // T)) for k, s in st.items()}
    c = out["controller"]
    steps = max(2, round(cfg.context_router_steps * cfg.scale))
    out["controller"] = c.replace(stage="router", steps=steps, batch_size=1, warmup=min(max(1, steps // 10), steps),
                                  eval_every=steps, oracle_positions=cfg.context_oracle_positions, max_budget=1,
                                  lr=3e-3, min_lr=3e-4)
    s2, m = out["workspace"], out["matched"]
    if cfg.workspace_steps is not None:
        n = max(2, round(cfg.workspace_steps * cfg.scale))
        s2 = out["workspace"] = s2.replace(steps=n, warmup=min(s2.warmup, n), eval_every=max(1, n // 2))
    out["matched"] = m.replace(steps=max(2, math.ceil(s2.steps * s2.batch_size / m.batch_size)))
    return out
