"""`prisme study code-screen`: a far-read design for code at T = 1,024 answered in minutes, before a full study.

The code backbones train once (cached): the dense frontier's L-layer models at PRISME's 64-byte window and with global
attention, both with the key shift, on the study's recipe and folder layout (`prisme study text --context 1024
--corpus python-stdlib`, so `--backbones` reuses a study's, and a study can `--reuse` the screen's). Each design
(`DESIGNS`) is then trained (a short stage, or none) on the window model, and where a dense model can carry the same
help, on the global one too ("the frontier gets the same help"). Every row is scored on fixed subsets: the first
`val_windows` windows of the corpus's validation split and `held_out_windows` windows of the held-out text spread
over all of it (None: every window), each split into slices by copy distance (`evaluation.slices`: within the
window, 64-256, 256-1,024, seen misses, the rest). The report gives each row's loss, its difference to the window
model alone, to the untrained exact-copy reference and to the global model with the same design (paired 95%
intervals over windows), its loss by slice, its capture of what global attention removes beyond the window
(`slices.capture_interval`), its ops (`prisme.costs`) and its wall time.

Designs are data: what trains (`Design.stages`: the copy stage, joint from scratch, a workspace stage) and with which
model options. `prisme study code-screen --designs copy,copy_stream` screens two; the screen's table in
docs/code.md records every design screened, what it changed and what it measured.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from prisme.checkpoint import load_model
from prisme.config import PrismeConfig
from prisme.costs.analytic import token_ops
from prisme.evaluation.far_reads import ContinuousCache, ExactCopy
from prisme.evaluation.slices import ar_slice_labels, capture_interval, slice_names
from prisme.io import write_text_atomic
from prisme.model.oracle import token_ce
from prisme.rebase import rebase_backbone
from prisme.stats import paired_bootstrap
from prisme.studies.runner import train_stage_once
from prisme.studies.text_data import held_out_data, training_data
from prisme.studies.text_setup import SOURCES, TextStudyConfig, frontier_config, frontier_name, stage_configs
from prisme.training.config import StageConfig

T = 1024  # the screen's context (the code study's)
JOINT_LR = 3e-4  # the backbone's lr where it learns after stage 1 (workspace_joint, copy_more)
WINDOW = 64  # PRISME's attention window
EDGES = (WINDOW, 256, T)  # the slices' copy-distance buckets


@dataclass(frozen=True)
class Design:
    """One screened design: what it changes (`what`), the model options it adds, the stages that train it after the
    backbone ("copy": the copy stage on the frozen backbone, "copy3" three times as long; "joint": the copy stage with
    the backbone learning, from scratch on the frontier's bytes; "workspace": a workspace stage after the copy stage,
    scored with one edit at every position), and whether a dense global model can carry it (`frontier`).
    Zero-training designs (`kind` "reference", "reference_any", "cache") fit a few numbers on validation."""

    name: str
    what: str
    kind: str = "trained"
    model: dict[str, Any] = field(default_factory=dict)
    stages: tuple[str, ...] = ()
    frontier: bool = True
    source: str | None = None  # the workspace's bank source (`text_setup.SOURCES`), for a workspace stage
    control: str | None = None  # the design it is compared with, paired, on the same twin (e.g. the same bytes
    #   given to the backbone)

    @property
    def edits(self) -> bool:
        """Whether it is scored with one workspace edit at every position (a workspace stage trained it)."""
        return "workspace" in self.stages or "workspace_joint" in self.stages


DESIGNS = {d.name: d for d in (
    Design("reference", "the untrained exact copy: the byte after the most recent far occurrence (beyond the 64-byte "
                        "window) of the longest >= 4-byte suffix match, 9 gates by match length fitted on validation",
           kind="reference"),
    Design("reference_any", "the same untrained copy from any earlier occurrence (within the window too)",
           kind="reference_any"),
    Design("cache", "zero training: a continuous cache on the frozen residual (keys h_{j-1}, values x_j beyond the "
                    "window, theta and lambda fitted on validation): are the stream's keys adequate?", kind="cache"),
    Design("copy", "the learned copy head (prisme.model.copy): a pointer over exact suffix matches (tables of match "
                   "length and distance) and a gate on the match and the model's own distribution, trained at every "
                   "position on the frozen backbone", model=dict(copy_head=True, copy_stream=0), stages=("copy",)),
    Design("copy_stream", "the copy head whose gate also reads 16 features of norm(H)",
           model=dict(copy_head=True, copy_stream=16), stages=("copy",)),
    Design("copy_wide", "the copy head whose gate reads 64 features of norm(H) through a 64-wide hidden layer, trained "
                        "three times as long: does a gate that sees more of the stream hold back on seen misses?",
           model=dict(copy_head=True, copy_stream=64, copy_hidden=64), stages=("copy3",), frontier=False),
    Design("copy_long", "the copy head's pointer over matches of >= 4 bytes only (shorter ones never read)",
           model=dict(copy_head=True, copy_stream=16, copy_min_len=4), stages=("copy",)),
    Design("copy_joint", "the copy head present from the first step: backbone and head trained together from scratch "
                         "on the frontier model's bytes (the read's loss reaches the backbone)",
           model=dict(copy_head=True, copy_stream=16), stages=("joint",)),
    Design("workspace", "the copy head (copy_stream), then PRISME's slot workspace (bank keys on the preceding "
                        "position, residual_preceding) trained on top of it and scored with one edit at every "
                        "position: what a sparse read adds beyond the copy",
           model=dict(copy_head=True, copy_stream=16), stages=("copy", "workspace"), frontier=False,
           source="residual_preceding"),
    Design("workspace_joint", "the workspace design with the backbone learning in the workspace stage (its bytes train "
                              "both, the backbone at lr 3e-4): do the workspace's bytes buy more than the same bytes "
                              "given to the backbone (copy_more)?",
           model=dict(copy_head=True, copy_stream=16), stages=("copy", "workspace_joint"), frontier=False,
           source="residual_preceding", control="copy_more"),
    Design("copy_more", "the control of workspace_joint: after the copy stage, the workspace stage's bytes given to "
                        "the backbone and its copy head (no workspace), the backbone at lr 3e-4",
           model=dict(copy_head=True, copy_stream=16), stages=("copy", "more"), frontier=False,
           source="residual_preceding"),
)}


@dataclass
class ScreenConfig:
    """Settings of `prisme study code-screen`."""

    designs: list[str] = field(default_factory=lambda: list(DESIGNS))
    seed: int = 1337
    depth: int = 2  # the backbones' layers (PRISME's and its twins')
    out_dir: str = "runs/code-screen"
    backbones: str | None = None  # a text study's (or screen's) folder whose seed<N>/frontier models are reused
    corpus: str = "python-stdlib"
    held_out: str = "click"
    val_windows: int = 64  # the first windows of the validation split
    held_out_windows: int | None = None  # windows of the held-out text, spread over it (None: all)
    steps: int = 500  # the copy stage's steps (batch `batch_size` x T)
    batch_size: int = 4
    workspace_steps: int = 400  # the workspace design's stage (batch 2 x T)
    bootstrap_samples: int = 1000
    threads: int = 1
    progress: bool = True

    def validate(self) -> ScreenConfig:
        unknown = [d for d in self.designs if d not in DESIGNS]
        if not self.designs or unknown:
            raise ValueError(f"code screen: --designs must name designs from {sorted(DESIGNS)}, got {self.designs!r}")
        for f in ("depth", "val_windows", "steps", "batch_size", "workspace_steps", "bootstrap_samples", "threads"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"code screen: {f} (--{f.replace('_', '-')}) must be an int >= 1, got {v!r}")
        if self.held_out_windows is not None and (not isinstance(self.held_out_windows, int)
                                                  or self.held_out_windows < 2):
            raise ValueError(f"code screen: --held-out-windows must be an int >= 2 or all, got "
                             f"{self.held_out_windows!r}")
        if self.depth > 3:
            raise ValueError(f"code screen: --depth {self.depth}: the study's frontier holds depths 1-3")
        return self

    def study(self) -> TextStudyConfig:
        """The text study whose recipe and folders the screen's backbones share."""
        return TextStudyConfig(context=T, corpus=self.corpus, held_out=self.held_out, prisme_layers=self.depth,
                               seeds=[self.seed], out_dir=self.backbones or self.out_dir, confirm_seeds=None,
                               copy_head=False)  # plain backbones: the designs add their own read


# ------------------------------------------------------------------------------------------------------ training
def twins(cfg: ScreenConfig) -> dict[str, tuple[PrismeConfig, StageConfig]]:
    """{"window": ..., "global": ...}: the depth's 64-window and global key-shift frontier models, (config, stage)."""
    study = cfg.study()
    base = study.study_model(PrismeConfig.from_name("demo"))
    stages = stage_configs(study, base, cfg.seed)
    out = {}
    for kind, entry in (("window", [cfg.depth, None, True, WINDOW]), ("global", [cfg.depth, None, True])):
        name = frontier_name(base, *entry)
        out[kind] = (frontier_config(base, *entry), stages[f"frontier:{name}"])
    return out


def train_twins(cfg: ScreenConfig) -> dict[str, Path]:
    """Each twin's run folder, trained where it is not yet (cached: a finished run is read back)."""
    data = training_data(cfg.corpus)
    return {k: Path(train_stage_once(m, s, dataset=data).out_dir) for k, (m, s) in twins(cfg).items()}


def copy_stage(cfg: ScreenConfig, out: Path, init: str | None, joint: bool, steps: int | None = None) -> StageConfig:
    """The copy stage of a design (`Design.stages`): `steps` of `batch_size` windows at lr 3e-3 on the frozen
    backbone, or joint (`train_backbone_in_workspace_stage`) from scratch with stage 1's schedule."""
    s = StageConfig(stage="copy", steps=steps or cfg.steps, batch_size=cfg.batch_size, seq_len=T, lr=3e-3,
                    min_lr=3e-4, warmup=20, eval_every=0, eval_batches=2, dataset=cfg.corpus, seed=cfg.seed,
                    out_dir=str(out), init_from=init, keep_last=1, progress=False)
    return s.replace(train_backbone_in_workspace_stage=True, backbone_lr=3e-3, backbone_min_lr=3e-4, batch_size=2,
                     warmup=40) if joint else s


def train_design(cfg: ScreenConfig, design: Design, twin: str, bb: Path) -> Path | None:
    """The checkpoint of `design` on the `twin` backbone (run folder `bb`), trained where it is not yet; None for a
    zero-training design."""
    if not design.stages:
        return None
    data = training_data(cfg.corpus)
    base, scfg1 = twins(cfg)[twin]
    folder = Path(cfg.out_dir) / f"seed{cfg.seed}" / "designs" / f"{design.name}_{twin}"
    mcfg = base.replace(**design.model)
    if design.source is not None:  # PRISME's model: the study's, with the workspace's bank source
        prisme_cfg = cfg.study().study_model(PrismeConfig.from_name("demo"))
        mcfg = prisme_cfg.replace(**SOURCES[design.source], **design.model)
    if "joint" in design.stages:  # from scratch on the frontier model's bytes (as many as the twin trained on)
        steps = scfg1.steps * scfg1.batch_size // 2
        return Path(train_stage_once(mcfg, copy_stage(cfg, folder / "joint", None, True, steps), dataset=data).out_dir)
    start = rebase_backbone(bb, mcfg, folder / "0_rebased", cfg.seed).parent
    steps = 3 * cfg.steps if "copy3" in design.stages else None  # "copy3": the copy stage three times as long
    run = Path(train_stage_once(None, copy_stage(cfg, folder / "copy", str(start), False, steps), dataset=data).out_dir)
    if design.edits:
        s2 = StageConfig(stage="workspace", steps=cfg.workspace_steps, batch_size=2, seq_len=T, lr=1e-3, min_lr=3e-4,
                         warmup=20, eval_every=0, eval_batches=2, dataset=cfg.corpus, seed=cfg.seed,
                         out_dir=str(folder / "workspace"), init_from=str(run), keep_last=1, progress=False,
                         max_budget=1, deep_supervision=0.0)
        if "workspace_joint" in design.stages:  # the backbone learns beside the workspace
            s2 = s2.replace(train_backbone_in_workspace_stage=True, backbone_lr=JOINT_LR, backbone_min_lr=JOINT_LR / 10)
        run = Path(train_stage_once(None, s2, dataset=data).out_dir)
    if "more" in design.stages:  # the same bytes as the workspace stage, given to the backbone and its copy head
        s3 = copy_stage(cfg, folder / "more", str(run), True, cfg.workspace_steps).replace(
            lr=JOINT_LR, min_lr=JOINT_LR / 10, backbone_lr=JOINT_LR, backbone_min_lr=JOINT_LR / 10, warmup=20)
        run = Path(train_stage_once(None, s3, dataset=data).out_dir)
    return run


# ------------------------------------------------------------------------------------------------------- scoring
def windows(cfg: ScreenConfig) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The fixed subsets: {"val": the first `val_windows` windows, "held_out": `held_out_windows` spread evenly (or
    every window)}, each a list of (x, y) `[1, T]`."""
    out = {}
    for split, ds, n in (("val", training_data(cfg.corpus), cfg.val_windows),
                         ("held_out", held_out_data(cfg.held_out, T), cfg.held_out_windows)):
        wins = [(x[i:i + 1], y[i:i + 1]) for x, y in ds.iter_eval("val", 8, T) for i in range(x.shape[0])]
        if split == "val":
            wins = wins[:n]
        elif n is not None and n < len(wins):
            wins = [wins[round(i * (len(wins) - 1) / (n - 1))] for i in range(n)]
        out[split] = wins
    return out


@dataclass
class Scored:
    """One row on one split: each window's summed loss per slice `[S, K]` and its targets per slice `[S, K]`."""

    loss: torch.Tensor
    n: torch.Tensor

    def total(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loss.sum(1), self.n.sum(1)

    def mean(self, cols: list[int] | None = None) -> float:
        c = slice(None) if cols is None else cols
        return float(self.loss[:, c].sum() / self.n[:, c].sum().clamp(min=1))


def _batched(wins: list[tuple[torch.Tensor, torch.Tensor]], size: int = 4):
    for i in range(0, len(wins), size):
        part = wins[i:i + size]
        yield torch.cat([x for x, _ in part]), torch.cat([y for _, y in part])


def score(nll_fn: Any, wins: list[tuple[torch.Tensor, torch.Tensor]]) -> Scored:
    """`nll_fn(x, y)` `[B, T]` (per-target NLL) summed per window and slice."""
    K = len(slice_names(EDGES))
    losses, counts = [], []
    with torch.no_grad():
        for x, y in _batched(wins):
            nll = nll_fn(x, y).double()
            lab = ar_slice_labels(x, y, 4, EDGES)  # [B, T]
            oh = F.one_hot(lab.clamp(min=0), K).double() * (lab >= 0).unsqueeze(-1)  # [B, T, K]
            losses.append((nll.unsqueeze(-1) * oh).sum(1))
            counts.append(oh.sum(1))
    return Scored(torch.cat(losses), torch.cat(counts))


def model_nll(model: Any, actions: bool = False):
    """Per-target NLL of a model's output (`model(x)`: its head, and its copy head where it has one); `actions`: one
    edit of slot 0 at every position (the workspace's fixed 1 x k1 row)."""
    def f(x, y):
        a = torch.zeros(*x.shape, 1, dtype=torch.long) if actions else None
        return token_ce(model(x, a).logits, y)
    return f


def zero_training_rows(cfg: ScreenConfig, design: Design, model: Any, wins: dict) -> dict[str, Scored]:
    """A zero-training design on `model`: its few numbers fitted on validation, then both splits scored."""
    def parts(x, y):
        H = model.backbone(x)
        logp = F.log_softmax(model.backbone.head(H).double(), -1)
        return H, logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)

    if design.kind == "cache":
        read = ContinuousCache(far=WINDOW)
        fit = []
        with torch.no_grad():
            for x, y in _batched(wins["val"]):
                H, lp = parts(x, y)
                fit.append((model.backbone.final_norm(H), x, y, lp))
        read.fit(fit)

        def nll(x, y):
            H, lp = parts(x, y)
            return read.nll(model.backbone.final_norm(H), x, y, lp)
    else:
        read = ExactCopy(far=WINDOW if design.kind == "reference" else None)
        ps, bs, cs, ys = [], [], [], []
        with torch.no_grad():
            for x, y in _batched(wins["val"]):
                _, lp = parts(x, y)
                b, c = read.match(x)
                ps.append(lp.exp().flatten()), bs.append(b.flatten()), cs.append(c.flatten()), ys.append(y.flatten())
        read.fit(torch.cat(ps), torch.cat(bs), torch.cat(cs), torch.cat(ys))

        def nll(x, y):
            _, lp = parts(x, y)
            return read.nll(lp, *read.match(x), y)
    return {split: score(nll, w) for split, w in wins.items()}


def ops_of(model_cfg: PrismeConfig, workspace: bool = False) -> float:
    """Mean analytic ops per token over the window's positions (context t + 1), the copy head's included where the
    model has one (`costs.analytic.copy_head_ops`); `workspace`: one single-slot edit at every position."""
    total = 0.0
    for t in range(T):
        total += token_ops(model_cfg, t + 1, ks=(1,) if workspace else (), controller_steps=0)["total"]
    return total / T


# ------------------------------------------------------------------------------------------------------- the run
def run_screen(cfg: ScreenConfig) -> dict[str, Any]:
    """Train what is not cached, score every row, write `<out>/screen.json`; returns the document."""
    cfg.validate()
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    say = (lambda m: print(f"[code screen {time.perf_counter() - t0:6.0f} s] {m}", file=sys.stderr, flush=True)) \
        if cfg.progress else (lambda m: None)
    say("backbones (trained once, then read back)")
    bbs = train_twins(cfg)
    wins = windows(cfg)
    rows: dict[str, dict[str, Scored]] = {}
    info: dict[str, dict[str, Any]] = {}
    for twin, path in bbs.items():
        model = load_model(path)[0]
        rows[f"{twin}"] = {s: score(model_nll(model), w) for s, w in wins.items()}
        info[twin] = {"design": None, "twin": twin, "ops": ops_of(model.cfg), "checkpoint": str(path)}
        say(f"{twin} backbone scored")
    for name in cfg.designs:
        design = DESIGNS[name]
        for twin, path in bbs.items():
            if twin == "global" and not design.frontier:
                continue
            t1 = time.perf_counter()
            ckpt = train_design(cfg, design, twin, path)
            model = load_model(path if ckpt is None else ckpt)[0]
            key = f"{twin}+{name}"
            if ckpt is None:
                rows[key] = zero_training_rows(cfg, design, model, wins)
            else:
                rows[key] = {s: score(model_nll(model, design.edits), w) for s, w in wins.items()}
            info[key] = {"design": name, "twin": twin, "ops": ops_of(model.cfg, design.edits),
                         "control": None if design.control is None else f"{twin}+{design.control}",
                         "wall_s": round(time.perf_counter() - t1, 1),
                         "checkpoint": None if ckpt is None else str(ckpt)}
            say(f"{key} done ({info[key]['wall_s']:.0f} s)")
    doc = assemble(cfg, rows, info, time.perf_counter() - t0)
    out = Path(cfg.out_dir) / "screen.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return doc


def assemble(cfg: ScreenConfig, rows: dict[str, dict[str, Scored]], info: dict[str, dict[str, Any]],
             wall_s: float) -> dict[str, Any]:
    """The document: per row and split its loss, slices, paired differences and capture."""
    names = list(slice_names(EDGES))
    beyond = [i for i, n in enumerate(names) if n.startswith("ar_hit") and n != "ar_hit_in_window"]
    B = cfg.bootstrap_samples
    ref_ops = info["window"]["ops"]
    doc: dict[str, Any] = {"settings": asdict(cfg), "slices": names, "rows": {}, "wall_s": round(wall_s, 1)}
    for key, splits in rows.items():
        r: dict[str, Any] = {**info[key], "relative_ops": info[key]["ops"] / ref_ops}
        for split, sc in splits.items():
            loss, n = sc.total()
            d: dict[str, Any] = {"loss": sc.mean(), "slices": {nm: sc.mean([i]) for i, nm in enumerate(names)},
                                 "share": {nm: float(sc.n[:, i].sum() / sc.n.sum()) for i, nm in enumerate(names)}}
            for ref in ("window", "window+reference", f"global+{info[key]['design']}" if info[key]["design"] else
                        None, info[key].get("control")):
                if ref and ref in rows and ref != key:
                    other = rows[ref][split].total()[0]
                    d[f"vs {ref}"] = paired_bootstrap(loss, other, n, B).to_dict()
            w, g = rows["window"][split], rows["global"][split]
            cap = capture_interval(sc.loss[:, beyond].sum(1), w.loss[:, beyond].sum(1), g.loss[:, beyond].sum(1),
                                   w.loss[:, beyond].sum(1), sc.n[:, beyond].sum(1), B)
            d["capture"] = {"value": cap.value, "lo": cap.lo, "hi": cap.hi, "removed": cap.removed,
                            "global_removed": cap.global_removed}
            d["seen_miss_rise"] = sc.mean([names.index("seen_miss")]) - w.mean([names.index("seen_miss")])
            r[split] = d
        doc["rows"][key] = r
    return doc


def format_screen(doc: dict[str, Any]) -> str:
    """The screen's table: per row, held-out and validation loss, the difference to the window model alone and to
    the reference (paired 95% intervals), capture beyond the window, the seen-miss rise, ops."""
    def ci(d: dict[str, Any] | None) -> str:
        return "-" if d is None else f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]"

    def cap(d: dict[str, Any]) -> str:
        c = d["capture"]
        return "undefined" if c["value"] is None else f"{c['value']:.0%}"

    s = doc["settings"]
    lines = [f"code screen: {s['corpus']} -> held-out {s['held_out']}, T = {T:,}, depth {s['depth']}, seed {s['seed']}"
             f" ({s['val_windows']} validation windows, {s['held_out_windows'] or 'all'} held-out windows)",
             f"{'row':<26} {'ops':>5} {'held-out':>8} {'vs window alone':>27} {'vs reference':>27} {'capture':>8} "
             f"{'seen miss':>9} {'val':>7} {'vs reference (val)':>27}"]
    for key, r in doc["rows"].items():
        h, v = r["held_out"], r["val"]
        lines.append(f"{key:<26} {r['relative_ops']:5.2f} {h['loss']:8.4f} {ci(h.get('vs window')):>27} "
                     f"{ci(h.get('vs window+reference')):>27} {cap(h):>8} {h['seen_miss_rise']:+9.3f} "
                     f"{v['loss']:7.4f} {ci(v.get('vs window+reference')):>27}")
    for key, r in doc["rows"].items():
        c = r.get("control")
        if c and f"vs {c}" in r["held_out"]:
            lines.append(f"{key} minus {c}: held-out {ci(r['held_out'][f'vs {c}'])}, val {ci(r['val'][f'vs {c}'])}")
    lines.append("ops: mean analytic ops per token over the window, relative to the window model alone; capture: the "
                 "loss a row removes beyond the window over what global attention removes there")
    return "\n".join(lines)


def main(args: Any) -> int:
    """`prisme study code-screen`."""
    from prisme.checks import one_of, parse_list

    designs = list(DESIGNS) if args.designs is None else parse_list(args.designs, "--designs", one_of(DESIGNS),
                                                                    example="copy,copy_stream", distinct=True)
    hw = None if str(args.held_out_windows).lower() == "all" else int(args.held_out_windows)
    cfg = ScreenConfig(designs=designs, seed=args.seed, depth=args.depth, out_dir=args.out, backbones=args.backbones,
                       held_out=args.held_out, val_windows=args.val_windows, held_out_windows=hw, steps=args.steps,
                       threads=args.threads, progress=not args.no_progress).validate()
    doc = run_screen(cfg)
    print(format_screen(doc))
    if args.json:
        write_text_atomic(Path(args.json), json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return 0 if all(math.isfinite(r["held_out"]["loss"]) for r in doc["rows"].values()) else 1
