"""The recall study's dense frontier (`prisme study recall --frontier`): what PRISME costs against backbones alone.

Two families, every member trained on every seed of the study and scored on the same held-out sequences:

* **dense**: backbones alone over each `frontier_dense` block's depths x widths, with its backbone options (a key
  shift, an attention window: every help the workspace's bank gets, the dense family gets too; the recipe's stage 1 at
  `frontier_steps`,
  at least 1,500 and at least as many as the PRISME family's three stages together: trained to what it can do);
* **PRISME**: the recipe at each `family` size (backbone width d x workspace width w; one layer), stage 2 at
  `family_workspace_steps`, then the router stage (configs/recall_router.json), deployed with the router at budget 1
  and the price chosen on the calibration set (the cheapest within `accuracy_tolerance` of budget 1's accuracy).

Every model's ops per token come from the same cost model (`prisme.costs.analytic.trace_cost` over all T positions of
its actual traces, each at its own context) and are divided by the same reference: the recipe's one-layer d = 64
backbone alone. The verdict compares the cheapest configuration of each family that reaches 95% on at least 4 of 5
seeds (`seeds_needed`: all but one when fewer than five).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from prisme.config import PrismeConfig
from prisme.costs.analytic import router_ops, router_share_of_layer
from prisme.costs.traces import trace_cost
from prisme.data.mqar import MQARConfig, make_mqar_batch
from prisme.devices import TimedPath, time_paths
from prisme.evaluation.policies import BackboneRows
from prisme.studies import recall_training as training
from prisme.studies.recall_eval import calibrated_policy, forced_row, score
from prisme.studies.recall_setup import (
    DENSE_OPTIONS,
    EVAL_SEED,
    TARGET_ACCURACY,
    RecallStudyConfig,
    RecallTask,
    Recipe,
    _quick,
    family_entry,
)


def seeds_needed(n_seeds: int) -> int:
    """Seeds a configuration must pass: 4 of 5 (all but one), and all of them with fewer than two."""
    return max(1, n_seeds - 1)


def margins(accuracy: list[float], need: int) -> dict[str, Any]:
    """How far a configuration's pass stands from the bar: its worst passing accuracy (None: no seed passes), that
    minus the 95% bar, and `spare_seeds`: its seeds at 95% beyond the `need` it must pass (0: one passing seed fewer
    and it fails; below 0: the passing seeds it lacks)."""
    passing = [a for a in accuracy if a >= TARGET_ACCURACY]
    worst = min(passing, default=None)
    return {"worst_passing": worst, "margin": None if worst is None else worst - TARGET_ACCURACY,
            "spare_seeds": len(passing) - need}


def margin_text(m: dict[str, Any]) -> str:
    """`margins` in words: "worst passing seed 0.966 (+0.016 over the bar), 1 seed to spare"."""
    worst = "no seed passes" if m["worst_passing"] is None else \
        f"worst passing seed {m['worst_passing']:.3f} ({m['margin']:+.3f} over the bar)"
    n = m["spare_seeds"]
    return worst + (f", {n} seed{'s' if n != 1 else ''} to spare" if n >= 0 else f", {-n} passing seed(s) short")


def dense_name(n_layer: int, d: int, key_shift: bool = False, attn_window: int | None = None) -> str:
    """`L{n_layer}_d{d}`, `_ks` with a key shift, `_win{W}` with an attention window."""
    return f"L{n_layer}_d{d}" + ("_ks" if key_shift else "") + (f"_win{attn_window}" if attn_window else "")


def dense_config(recipe: Recipe, n_layer: int, d: int, key_shift: bool = False,
                 attn_window: int | None = None) -> PrismeConfig:
    """The recipe's backbone at another depth and width (and backbone options), without a workspace; ValueError naming
    the grid field."""
    options = {k: v for k, v in (("key_shift", key_shift), ("attn_window", attn_window)) if v != DENSE_OPTIONS[k]}
    try:
        return recipe.model.replace(n_layer=n_layer, d_model=d, use_workspace=False,
                                    name=f"dense_{dense_name(n_layer, d, key_shift, attn_window)}", **options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"recall study: frontier_dense entry (n_layer={n_layer}, d_model={d}, {options}) does not "
                         f"make a model: {e}") from None


def family_name(d: int, w: int, attn_window: int | None = None, key_shift: bool = False,
                router_token: bool = False) -> str:
    """`d{d}_w{w}`, `_ks` on a key-shift backbone, `_win{W}` on a local-window backbone, `_tok` with a router that
    reads the token too."""
    return (f"d{d}_w{w}" + ("_ks" if key_shift else "") + (f"_win{attn_window}" if attn_window else "")
            + ("_tok" if router_token else ""))


def family_config(recipe: Recipe, d: int, w: int, attn_window: int | None = None,
                  key_shift: bool = False, router_token: bool = False) -> PrismeConfig:
    """The recipe's model at backbone width d and workspace width w, with the router (and a local-window backbone
    whose workspace still reads the whole bank; a backbone whose attention keys read the previous position too; a
    router that reads the token's own value too, `family_router_token`); ValueError naming `family`."""
    options = {k: v for k, v in (("key_shift", key_shift), ("attn_window", attn_window)) if v != DENSE_OPTIONS[k]}
    options |= {"router_token": True} if router_token else {}
    try:
        return recipe.model.replace(d_model=d, w=w, ws_head_dim=min(recipe.model.ws_head_dim, w), router=True,
                                    name=f"prisme_{family_name(d, w, attn_window, key_shift, router_token)}",
                                    **options)
    except ValueError as e:
        raise ValueError(f"recall study: family entry [{d}, {w}{', ' + str(attn_window) if attn_window else ''}"
                         f"{', true' if key_shift else ''}] does not make a model: {e}") from None


def frontier_stages(cfg: RecallStudyConfig, recipe: Recipe) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(the dense models' stages, the family's stages) with the study's step counts; ValueError if the dense frontier
    would be trained for fewer steps than 1,500 or than the family's stages together. With a warm-up stage (the
    recipe's stage 1 at its short task, `Recipe.warmup`) every model starts with it: it is the family's stage 1, and
    each dense model's first stage before its `frontier_steps` at the recipe's length. With a workspace warm-up (the
    recipe's stage 2 at its short task, `Recipe.workspace_warmup`) the family trains it before its workspace stage,
    and every dense model's warm-up trains as many steps more: each model trains as long at the short task."""
    s1, s2, s3 = recipe.warmup or recipe.backbone, recipe.workspace.replace(steps=cfg.family_workspace_steps), \
        recipe.router
    s2w = recipe.workspace_warmup if recipe.warmup else None
    # the dense models' steps at the study's length against the family's there (with a warm-up, both train as long at
    # the short task: the dense warm-up is the family's stage 1 plus its workspace warm-up)
    family_steps = s2.steps + s3.steps + (0 if recipe.warmup else s1.steps)
    if not cfg.quick and cfg.frontier_steps < max(1500, family_steps):
        raise ValueError(f"recall study: frontier_steps={cfg.frontier_steps} must be >= 1500 and >= the PRISME "
                         f"family's stages at the same length together ({family_steps}): the dense frontier is "
                         f"trained to what it can do")
    b = recipe.backbone
    dense = b.replace(steps=cfg.frontier_steps, warmup=min(b.warmup, cfg.frontier_steps))
    if cfg.quick:
        dense, s1, s2, s3 = _quick(dense, 12), _quick(s1, 12), _quick(s2, 12), _quick(s3, 6)
        s2w = s2w and _quick(s2w, 6)
    if not recipe.warmup:
        return (dense,), (s1, s2, s3)
    dense_warmup = s1.replace(steps=s1.steps + (s2w.steps if s2w else 0))  # the recipe's lr is constant after warm-up
    return (dense_warmup, dense), ((s1, s2w, s2, s3) if s2w else (s1, s2, s3))


def plan_frontier(cfg: RecallStudyConfig, recipe: Recipe, out, grid: list[dict[str, Any]] | None = None,
                  family: list[list[int]] | None = None, context: int | None = None) -> list[FrontierMember]:
    """The frontier's runs: every dense configuration (`grid`, default `frontier_dense`) and every family size
    (`family`: `FamilyEntry` as written in the study file, default the study's), on every seed; `context`:
    the sequence length a long-context study (`recall_context`) runs them at, in `frontier/T{context}/`."""
    dense, stages = frontier_stages(cfg, recipe)
    family = cfg.family if family is None else family
    family = family[:1] if cfg.quick else family
    at = {} if context is None else {"context": context}
    out = Path(out) / "frontier" if context is None else Path(out) / "frontier" / f"T{context}"
    tasks: list[FrontierMember] = []
    for block in cfg.frontier_dense if grid is None else grid:
        options = {k: block.get(k, v) for k, v in DENSE_OPTIONS.items()}
        for L in block["depths"]:
            for d in block["widths"]:
                model = dense_config(recipe, L, d, **options)
                for seed in cfg.seeds:
                    tasks.append(DenseTask(n_layer=L, d_model=d, **options, seed=seed, model=model, stages=dense,
                                           folder=str(out / f"dense_{dense_name(L, d, **options)}_seed{seed}"),
                                           mqar=recipe.mqar, study=cfg, **at))
    for e in family:
        d, w, window, ks, tok = dataclasses.astuple(family_entry(e, "family" if context is None else "context_family"))
        tok = cfg.family_router_token if tok is None else tok
        model, name = family_config(recipe, d, w, window, ks, tok), family_name(d, w, window, ks, tok)
        for seed in cfg.seeds:
            tasks.append(FamilyTask(d_model=d, w=w, attn_window=window, key_shift=ks, seed=seed, model=model,
                                    stages=stages, folder=str(out / f"prisme_{name}_seed{seed}"),
                                    mqar=recipe.mqar, study=cfg, **at))
    return tasks


def reference_ops(recipe: Recipe, T: int) -> float:
    """Ops per token of the reference: the recipe's one-layer d = 64 backbone alone, over contexts 1..T."""
    ref = recipe.model.replace(n_layer=1, d_model=64, use_workspace=False, name="reference")
    return trace_cost(ref, None, torch.arange(1, T + 1)).ops_per_token


@torch.no_grad()
def evaluate_dense(model: torch.nn.Module, mcfg: MQARConfig, seed: int, cfg: RecallStudyConfig) -> dict[str, Any]:
    """A backbone alone: query accuracy on the held-out sequences and its ops per token."""
    row = score(model, mcfg, EVAL_SEED + seed, cfg.eval_sequences, [BackboneRows()]).rows[0]
    return {"accuracy": row.accuracy, "ops_per_token": row.ops_per_token}


@torch.no_grad()
def evaluate_family(model: torch.nn.Module, mcfg: MQARConfig, seed: int, cfg: RecallStudyConfig) -> dict[str, Any]:
    """A PRISME family member: budget-1 accuracy, and the router deployed at budget 1 at its calibrated price."""
    budget1 = forced_row(model, mcfg, EVAL_SEED + seed, cfg.eval_sequences, "fixed_1xk1", "fixed", 1, 1)
    rows, chosen = calibrated_policy(model, mcfg, seed, cfg, cfg.router_lambdas, budget=1)
    return {"budget1_accuracy": budget1["accuracy"], "budget1_ops_per_token": budget1["ops_per_token"],
            "router": chosen, "routers": rows, "accuracy": chosen["accuracy"],
            "ops_per_token": chosen["ops_per_token"]}


def _entry(cfg_model: dict[str, Any], runs: list[dict[str, Any]], ref: float, need: int) -> dict[str, Any]:
    acc = [r["accuracy"] for r in runs]
    ops = sum(r["ops_per_token"] for r in runs) / len(runs)
    return {"n_layer": cfg_model["n_layer"], "d_model": cfg_model["d_model"], "w": None, "ops_per_token": ops,
            "ops_ratio": ops / ref, "accuracy": acc, "seeds": [r["seed"] for r in runs],
            "seeds_at_95": sum(a >= TARGET_ACCURACY for a in acc),
            "passes": sum(a >= TARGET_ACCURACY for a in acc) >= need} | training.training_entry(runs)


# ------------------------------------------------------------------------------------------------------------ tasks
@dataclass(frozen=True, kw_only=True)
class FrontierMember(RecallTask):
    """One member of one of the frontier's families on one seed; its runs over the seeds make one entry of the
    document's `frontier.<section>` (of its context's frontier in a long-context study)."""

    context: int | None = None  # the sequence length of a long-context study's run (None: the recipe's)

    @property
    def key(self) -> str:
        """The member's configuration, whatever its seed (its name within its context)."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        return self.key if self.context is None else f"T{self.context}_{self.key}"

    def describe(self) -> dict[str, Any]:
        """The run in its result, with the sequence length it trained at (a long-context study's; `study lengths`
        reads it)."""
        return super().describe() | ({} if self.context is None else {"context": self.context})

    def score(self, model: torch.nn.Module) -> dict[str, Any]:
        """The member's accuracy and ops per token on the held-out sequences."""
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, checkpoint: str) -> dict[str, Any]:
        return self.score(model) | {"seed": self.seed, "checkpoint": checkpoint, "model": model.cfg.to_dict(),
                                    "steps": self.stage_steps()} | training.training_record(self)

    def frontier_entry(self, cfg_model: dict[str, Any], runs: list[dict[str, Any]], ref: float,
                       need: int) -> dict[str, Any]:
        """The member's entry from its runs' entries (in seed order): accuracy per seed, mean ops against `ref`, and
        whether it passes (>= 95% on `need` seeds)."""
        return _entry(cfg_model, runs, ref, need)


@dataclass(frozen=True, kw_only=True)
class DenseTask(FrontierMember):
    """A backbone alone, `n_layer` layers of width `d_model` (`dense_config`)."""

    kind: ClassVar[str] = "dense"
    section: ClassVar[str] = "dense"
    n_layer: int
    d_model: int
    key_shift: bool = False
    attn_window: int | None = None

    @property
    def key(self) -> str:
        return dense_name(self.n_layer, self.d_model, self.key_shift, self.attn_window)

    def score(self, model: torch.nn.Module) -> dict[str, Any]:
        return evaluate_dense(model, self.mqar, self.seed, self.study)

    def frontier_entry(self, cfg_model: dict[str, Any], runs: list[dict[str, Any]], ref: float,
                       need: int) -> dict[str, Any]:
        return super().frontier_entry(cfg_model, runs, ref, need) | {"key_shift": self.key_shift,
                                                                      "attn_window": self.attn_window}


@dataclass(frozen=True, kw_only=True)
class FamilyTask(FrontierMember):
    """A PRISME family member: backbone width `d_model`, workspace width `w`, with its router (`family_config`)."""

    kind: ClassVar[str] = "family"
    section: ClassVar[str] = "prisme"
    priority: ClassVar[int] = 3
    d_model: int
    w: int
    attn_window: int | None = None  # a local-window backbone (the workspace reads the whole bank)
    key_shift: bool = False  # its attention keys read the previous position too

    @property
    def key(self) -> str:
        return family_name(self.d_model, self.w, self.attn_window, self.key_shift, self.model.router_token)

    def score(self, model: torch.nn.Module) -> dict[str, Any]:
        return evaluate_family(model, self.mqar, self.seed, self.study)

    def frontier_entry(self, cfg_model: dict[str, Any], runs: list[dict[str, Any]], ref: float,
                       need: int) -> dict[str, Any]:
        return super().frontier_entry(cfg_model, runs, ref, need) | {
            "w": cfg_model["w"], "attn_window": self.attn_window, "key_shift": self.key_shift,
            "router_token": self.model.router_token,
            "budget1_accuracy": [r["budget1_accuracy"] for r in runs],
            "lambda": [r["router"]["lambda"] for r in runs],
            "edits_per_token": [r["router"]["edits_per_token"] for r in runs],
            "query_edit_share": [r["router"]["query_edit_share"] for r in runs],
            "ops_ratio_per_seed": [r["ops_per_token"] / ref for r in runs]}

    def headline(self, entry: dict[str, Any]) -> float:
        return entry.get("accuracy", entry.get("budget1_accuracy"))


def assemble_frontier(cfg: RecallStudyConfig, recipe: Recipe, done: list[tuple[RecallTask, dict[str, Any]]],
                      context: int | None = None) -> dict[str, Any]:
    """`frontier`: both families' entries, the verdict and the deployed router's cost (the issue's JSON layout), from
    the finished (task, entry) pairs of `context` (None: the recipe's own length; `recipe` is the one at it)."""
    T = recipe.mqar.seq_len
    ref = reference_ops(recipe, T)
    need = seeds_needed(len(cfg.seeds))
    groups: dict[tuple[str, str], list[tuple[FrontierMember, dict[str, Any]]]] = {}
    for t, e in done:
        if isinstance(t, FrontierMember) and t.context == context:
            groups.setdefault((t.section, t.name), []).append((t, e))
    parts: dict[str, list[dict[str, Any]]] = {"dense": [], "prisme": []}
    first_models = []  # (entry, the model of its first run)
    for (section, _), members in groups.items():
        runs = sorted((training.with_training(t, e) for t, e in members), key=lambda e: cfg.seeds.index(e["seed"]))
        entry = members[0][0].frontier_entry(members[-1][1]["model"], runs, ref, need) | {
            "checkpoints": [e["checkpoint"] for e in runs]}
        parts[section].append(entry)
        first_models.append((entry, members[0][1]["model"]))
    dense, family = parts["dense"], parts["prisme"]
    dense.sort(key=lambda e: e["ops_ratio"])
    family.sort(key=lambda e: e["ops_ratio"])
    best_d = next((e for e in dense if e["passes"]), None)
    best_p = next((e for e in family if e["passes"]), None)
    ratio = best_p["ops_ratio"] / best_d["ops_ratio"] if best_d and best_p else None
    deployed = best_p or (family[0] if family else None)
    router = None
    if deployed is not None:
        rc = PrismeConfig.from_dict(next(m for e, m in first_models if e is deployed))
        router = {"n_layer": rc.n_layer, "d_model": rc.d_model, "w": rc.w,
                  "ops_per_position": router_ops(rc, rc.cost_context), "context": rc.cost_context,
                  "share_of_backbone_layer": router_share_of_layer(rc)}
    return {"reference": {"n_layer": 1, "d_model": 64, "ops_per_token": ref,
                          "note": "ops per token over contexts 1..T of the recipe's one-layer d=64 backbone alone"},
            "seeds_needed": need, "target_accuracy": TARGET_ACCURACY, "dense": dense, "prisme": family,
            "verdict": {"dense_best": best_d, "prisme_best": best_p, "ops_ratio_prisme_over_dense": ratio},
            "margins": {k: e and margins(e["accuracy"], need) for k, e in (("dense", best_d), ("prisme", best_p))},
            "router": router, "training_ops_prisme_over_dense": training.training_ratio(best_d, best_p)}


@torch.no_grad()
def decode_speed(frontier: dict[str, Any], mcfg: MQARConfig, batches: tuple[int, ...] = (1, 8),
                 repeats: int = 3) -> dict[str, Any]:
    """Tokens/s of batched greedy decoding (`prisme.generate`) of the two winners' first-seed checkpoints, side by
    side: held-out MQAR prompts (the pairs and the first query slot), then the rest of the sequence; the PRISME
    model with its router at budget 1 and its calibrated price. Median over `repeats`, the two models alternating.
    `memory_batch{B}`: each model's decode state at the whole sequence, exact payload bytes (the backbone's K/V cache,
    a ring of W slots under a window, and PRISME's source bank). A PRISME winner whose bank reads the embeddings also
    decodes as `prisme_ids`: the same weights, its bank served from tables and kept as token ids (`bank_store="ids"`:
    the same numbers, K and V looked up where the router fires)."""
    from prisme.checkpoint import load_model
    from prisme.decoding.generate import generate
    from prisme.model.policy import Controller
    from prisme.model.prisme import PrismeModel
    from prisme.model.state import DecodeState
    from prisme.options import DecodeOptions, Runtime

    v = frontier["verdict"]
    picks = {k: v[f"{k}_best"] for k in ("dense", "prisme") if v[f"{k}_best"] is not None}
    if not picks:
        return {}
    models = {k: load_model(e["checkpoints"][0])[0].eval() for k, e in picks.items()}
    runtimes = dict.fromkeys(models, Runtime())
    if "prisme" in models and set(models["prisme"].cfg.bank_terms) == {"embedding"}:  # the same model, kept as ids
        models["prisme_ids"], picks["prisme_ids"] = models["prisme"], picks["prisme"]
        runtimes["prisme_ids"] = Runtime(decode=DecodeOptions(bank_tables=True, bank_store="ids"))
    P = mcfg.query_start + 1
    new = mcfg.seq_len - P
    out: dict[str, Any] = {"prompt_tokens": P, "new_tokens": new, "repeats": repeats,
                           "threads": torch.get_num_threads()}
    for B in batches:
        x, _ = make_mqar_batch(mcfg, B, torch.Generator().manual_seed(EVAL_SEED + 99))
        def path(k: str, m: PrismeModel, prompt: torch.Tensor = x[:, :P]) -> TimedPath:
            kw = dict(policy=Controller(1, lambda_cost=picks[k]["lambda"][0])) if k != "dense" else {}
            return k, lambda: None, lambda _: generate(m, prompt, new, runtime=runtimes[k], **kw)

        times = time_paths([path(k, m) for k, m in models.items()], 1, repeats, inference=False)  # ms
        out[f"batch{B}"] = {k: B * new * 1000.0 / sorted(t)[len(t) // 2] for k, t in times.items()}
        out[f"memory_batch{B}"] = {k: DecodeState(m, B, mcfg.seq_len, options=runtimes[k].decode).nbytes
                                   for k, m in models.items()}
    return out


def _options(e: dict[str, Any]) -> str:
    """An entry's options in the table's family column: "+ks" (key shift), "+winW" (window W), "+tok" (a router that
    reads the token too)."""
    return (("+ks" if e.get("key_shift") else "") + (f"+win{e['attn_window']}" if e.get("attn_window") else "")
            + ("+tok" if e.get("router_token") else ""))


def format_frontier(doc: dict[str, Any]) -> str:
    """The frontier table, the verdict and the router's cost, for humans."""
    f = doc["frontier"]
    lines = [f"dense frontier and PRISME family (ops/token / the 1-layer d=64 backbone's "
             f"{f['reference']['ops_per_token']:,.0f}; pass = >= 95% on >= {f['seeds_needed']} seeds)", ""]
    wide = max([8] + [len(k + _options(e)) + 1 for k in ("dense", "prisme") for e in f[k]])
    head = (f"{'family':<{wide}}{'L':>3}{'d':>5}{'w':>5}{'ops':>8}{training.TABLE_HEAD}  {'accuracy per seed':<44}"
            f"{'@95':>4}  extra")
    lines += [head, "-" * (len(head) + 30)]
    for kind, entries in (("dense", f["dense"]), ("prisme", f["prisme"])):
        for e in entries:
            acc = " ".join(f"{a:.3f}" for a in e["accuracy"])
            extra = ""
            if kind == "prisme":
                extra = (f"budget1 {min(e['budget1_accuracy']):.3f}-{max(e['budget1_accuracy']):.3f}, edits/token "
                         f"{min(e['edits_per_token']):.3f}-{max(e['edits_per_token']):.3f}, on queries "
                         f"{min(e['query_edit_share']):.2f}-{max(e['query_edit_share']):.2f}")
            w = e["w"] if e["w"] else "-"
            lines.append(f"{kind + _options(e):<{wide}}{e['n_layer']:>3}{e['d_model']:>5}{w:>5}"
                         f"{e['ops_ratio']:>8.3f}{training.table_cells(e)}  {acc:<44}{e['seeds_at_95']:>4}  {extra}")
    v = f["verdict"]

    def name(e: dict[str, Any] | None) -> str:
        if e is None:
            return "none reaches 95%"
        return (f"L{e['n_layer']} d{e['d_model']}" + (f" w{e['w']}" if e["w"] else "")
                + (" with key shift" if e.get("key_shift") else "")
                + (f" window {e['attn_window']}" if e.get("attn_window") else "") + f" at {e['ops_ratio']:.3f}x")

    lines += ["", f"cheapest dense passing: {name(v['dense_best'])}; cheapest PRISME passing: {name(v['prisme_best'])}"]
    shown = [f"{k} {margin_text(m)}" for k, m in (f.get("margins") or {}).items() if m]
    if shown:
        lines.append("margins: " + "; ".join(shown))
    if v["ops_ratio_prisme_over_dense"] is not None:
        r = v["ops_ratio_prisme_over_dense"]
        verdict = "beats" if r < 1 else "does not beat"
        lines.append(f"PRISME / dense ops: {r:.3f} -> PRISME {verdict} the dense frontier")
    lines += training.ratio_line(f)
    if f["router"]:
        rt = f["router"]
        lines.append(f"router: {rt['ops_per_position']} ops per position at T={rt['context']} = "
                     f"{100 * rt['share_of_backbone_layer']:.2f}% of one backbone layer (d={rt['d_model']})")
    sp = doc.get("decode_speed") or {}
    for B in (1, 8):
        if f"batch{B}" in sp:
            speeds = ", ".join(f"{k} {v:,.0f}" for k, v in sp[f"batch{B}"].items())
            memory = ", ".join(f"{k} {v / 1024:,.0f} KiB" for k, v in sp.get(f"memory_batch{B}", {}).items())
            lines.append(f"decode tokens/s, batch {B}: {speeds}" + (f"; decode state {memory}" if memory else ""))
            r, got = v["ops_ratio_prisme_over_dense"], sp[f"batch{B}"]
            if r is not None and "dense" in got:
                times = ", ".join(f"{k} {got['dense'] / got[k]:.2f}" for k in got if k != "dense")
                lines.append(f"  time per token over the dense winner's: {times} (ops {r:.3f})")
    return "\n".join(lines)
