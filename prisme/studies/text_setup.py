"""The text study's settings (`TextStudyConfig`), its bank sources and the stage configs of one training seed: the
demo recipe's three stages, the matched backbone, and the dense frontier (backbones alone, trained on as many tokens
as PRISME's stages together)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from prisme.checks import COMPILE_SETTINGS, check_choice, check_seeds
from prisme.config import PrismeConfig
from prisme.data.text import HELD_OUT_TEXT
from prisme.training.config import StageConfig

SOURCES = {  # name -> PrismeConfig overrides of the demo preset
    "residual": {},
    "embedding": dict(bank_source="embedding", bank_shift=True, controller_source="residual", controller_bank=True),
}
VAL_POLICIES = ["backbone", "matched", "fixed", "random", "dense", "controller", "oracle"]
HELD_OUT_POLICIES = ["backbone", "matched", "fixed", "controller", "oracle"]  # all of the text: the cheaper rows
DEFAULT_SEEDS = [1337, 1338, 1339]
# the dense frontier: [n_layer, d_model] backbones alone (None = the preset's width), from scratch on PRISME's tokens
DEFAULT_FRONTIER: list[list[int | None]] = [[1, None], [2, None], [3, None], [1, 96]]


@dataclass
class TextStudyConfig:
    """Settings of `prisme study text`."""

    sources: list[str] = field(default_factory=lambda: list(SOURCES))
    seeds: list[int] = field(default_factory=lambda: list(DEFAULT_SEEDS))  # training seeds: every run per seed
    frontier: list[list[int | None]] = field(default_factory=lambda: [list(f) for f in DEFAULT_FRONTIER])
    scale: float = 1.0  # multiplies every stage's steps (0.05: a smoke run)
    val_batches: int | None = 8  # validation batches of `eval_batch_size` x 128 (None: the whole split)
    held_out_batches: int | None = None  # batches of the held-out text (None: all of it)
    eval_batch_size: int = 64
    held_out: str = HELD_OUT_TEXT  # an embedded text's name, or a UTF-8 file / folder
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
    progress: bool = True
    backbone_keeps_learning: bool = False  # stage 2 also trains the backbone (from its own loss, the matched steps)
    compile: str = "off"  # the editor under torch.compile in stages 2-3 and the evaluation ("auto" | "strict")

    def validate(self, model_cfg: PrismeConfig | None = None) -> TextStudyConfig:
        """ValueError naming the option for bad settings (the frontier's widths against `model_cfg`'s heads)."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"text study: {msg}")

        def is_count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        need(len(self.sources) > 0 and all(s in SOURCES for s in self.sources),
             f"sources must be a non-empty list from {sorted(SOURCES)}, got {self.sources!r}")
        check_seeds(self.seeds, "text study: ")
        need(isinstance(self.frontier, list) and all(
            isinstance(f, (list, tuple)) and len(f) == 2 and is_count(f[0]) and (f[1] is None or is_count(f[1]))
            for f in self.frontier), f"frontier must be a list of [n_layer >= 1, d_model >= 1 or null], got "
             f"{self.frontier!r}")
        need(self.scale > 0 and math.isfinite(self.scale), f"scale must be > 0, got {self.scale}")
        for f in ("val_batches", "held_out_batches"):
            v = getattr(self, f)
            need(v is None or is_count(v), f"{f} must be an int >= 1 or None (all), got {v!r}")
        need(self.window is None or is_count(self.window), f"window must be an int >= 1 or None, got {self.window!r}")
        for f in ("eval_batch_size", "oracle_positions", "bootstrap_samples", "threads", "slice_ngram"):
            v = getattr(self, f)
            need(is_count(v), f"{f} must be an int >= 1, got {v!r}")
        need(isinstance(self.jobs, int) and self.jobs >= 0, f"jobs must be an int >= 0, got {self.jobs!r}")
        need(all(isinstance(n, int) and n >= 1 for n in self.fixed_budgets), "fixed_budgets must be ints >= 1")
        need(len(self.lambdas) > 0 and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                                           for v in self.lambdas), f"lambdas must be finite numbers >= 0, got "
             f"{self.lambdas!r}")
        need(is_count(self.controller_budget), f"controller_budget must be an int >= 1, got "
             f"{self.controller_budget!r}")
        need(isinstance(self.kappa_risk, (int, float)) and math.isfinite(self.kappa_risk) and self.kappa_risk >= 0,
             f"kappa_risk must be a finite number >= 0, got {self.kappa_risk!r}")
        check_choice("compile", self.compile, COMPILE_SETTINGS, "text study: ")
        if model_cfg is not None:
            need(self.window is None or self.window <= model_cfg.max_seq_len,
                 f"window={self.window} is longer than the preset's context T_max={model_cfg.max_seq_len}")
            for n_layer, d in self.frontier:
                frontier_config(model_cfg, n_layer, d)
        return self


def parse_frontier(text: str) -> list[list[int | None]]:
    """`--frontier 1,2,3,1x96` -> [[1, None], [2, None], [3, None], [1, 96]] (layers, or layers x width)."""
    out: list[list[int | None]] = []
    for item in (v.strip() for v in text.split(",") if v.strip()):
        layers, x, width = item.partition("x")
        try:
            out.append([int(layers), int(width) if x else None])
        except ValueError:
            raise ValueError(f"--frontier entries are LAYERS or LAYERSxWIDTH (e.g. 1,2,3,1x96), got {item!r}") from None
    if not out:
        raise ValueError("--frontier is empty")
    return out


def frontier_name(model_cfg: PrismeConfig, n_layer: int, d_model: int | None) -> str:
    return f"L{n_layer}_d{d_model or model_cfg.d_model}"


def frontier_config(model_cfg: PrismeConfig, n_layer: int, d_model: int | None) -> PrismeConfig:
    """The preset's backbone alone at another depth and width; ValueError naming `frontier`."""
    try:
        over = {"n_layer": n_layer, "use_workspace": False}
        if d_model is not None and d_model != model_cfg.d_model:
            over |= {"d_model": d_model, "ffn_hidden": None}
        return model_cfg.replace(**over, name=frontier_name(model_cfg, n_layer, d_model))
    except ValueError as e:
        raise ValueError(f"text study: frontier entry [{n_layer}, {d_model}] does not make a model: {e}") from None


def source_config(base: PrismeConfig, source: str) -> PrismeConfig:
    return base.replace(**SOURCES[source]) if SOURCES[source] else base


def stage_configs(cfg: TextStudyConfig, model_cfg: PrismeConfig, seed: int) -> dict[str, StageConfig]:
    """One training seed's runs in `<out>/seed<seed>`: the demo's recipe (`training.config.demo_stage_configs`,
    configs/demo_*.json) and every frontier backbone ("frontier:<name>"), trained from scratch with stage 1's
    settings on as many tokens as PRISME's three stages together."""
    from prisme.training.config import demo_stage_configs

    run = Path(cfg.out_dir) / f"seed{seed}"
    st = demo_stage_configs(run, cfg.scale, seed, cfg.backbone_keeps_learning,
                            seq_len=min(128, model_cfg.max_seq_len))
    s1 = st["backbone"]
    tokens = sum(st[k].steps * st[k].batch_size * st[k].seq_len for k in ("backbone", "workspace", "controller"))
    steps = math.ceil(tokens / (s1.batch_size * s1.seq_len))
    for n_layer, d in cfg.frontier:
        name = frontier_name(model_cfg, n_layer, d)
        st[f"frontier:{name}"] = s1.replace(steps=steps, out_dir=str(run / "frontier" / name))
    ws_stages = ("workspace", "controller")
    return {k: v.replace(progress=False, compile=cfg.compile if k in ws_stages else "off") for k, v in st.items()}
