"""The text study's tasks: one training run or one evaluation of one seed each (`TextTask`), run in a worker process
by `run_task` (the study's graph is `text.prepare_study`'s); the evaluation of one bank source on one split
(`evaluate`), with paired intervals to the backbone, the matched backbone and the dense frontier."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from prisme.checkpoint import load_model
from prisme.config import PrismeConfig
from prisme.data.text import TokenDataset
from prisme.rebase import rebase_backbone
from prisme.studies.runner import Task, train_stage_once
from prisme.studies.text_data import held_out_data, training_data
from prisme.studies.text_setup import (
    CONTEXT_POLICIES,
    EXACT_COPY,
    HELD_OUT_POLICIES,
    NO_COPY,
    SOURCES,
    VAL_POLICIES,
    TextStudyConfig,
    context_slice_edges,
    copy_config,
    final_folder,
    frontier_name,
    source_config,
)
from prisme.training.config import StageConfig


@dataclass(frozen=True)
class TextTask:
    """One unit of work of one training seed (a training run or an evaluation), `s<seed>/<key>` in the pool; it runs
    in a worker process, so every field pickles."""

    kind: ClassVar[str]  # also the phase of the study's wall time it counts towards
    trains: ClassVar[bool] = True  # a training run: its result is one of the seed's `training` entries
    seed: int

    @property
    def what(self) -> str | None:
        """The bank source, or the frontier model's name (None: the kind alone names the task)."""
        return None

    @property
    def key(self) -> str:
        """The task's name within its seed: `kind` or `kind:what` (its entry in the seed's `training`)."""
        return self.kind if self.what is None else f"{self.kind}:{self.what}"

    @property
    def name(self) -> str:
        return f"s{self.seed}/{self.key}"

    def describe(self) -> dict[str, Any]:
        """The task in its result: {"kind", "what", "seed"}."""
        return {"kind": self.kind, "what": self.what, "seed": self.seed}

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        """Train or evaluate; returns the task's result."""
        raise NotImplementedError


@dataclass(frozen=True)
class BackboneTask(TextTask):
    """Stage 1: the backbone, once per seed (both bank sources start from it)."""

    kind: ClassVar[str] = "backbone"

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        return _summary(train_stage_once(model_cfg, stages["backbone"], dataset=data))


@dataclass(frozen=True)
class MatchedTask(TextTask):
    """The backbone trained on as many extra tokens as stage 2 used."""

    kind: ClassVar[str] = "matched"

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        out = _summary(train_stage_once(None, stages["matched"], dataset=data))
        if not cfg.uses_copy:
            return out
        s = stages["matched_copy"]  # its copy head, as PRISME's backbone gets one
        init = rebase_backbone(stages["matched"].out_dir, copy_config(model_cfg), Path(s.out_dir) / "0_rebased",
                               s.seed).parent
        return {"matched": out, "copy": _summary(train_stage_once(None, s.replace(init_from=str(init)),
                                                                   dataset=data))}


@dataclass(frozen=True)
class FrontierTask(TextTask):
    """One dense frontier model (`frontier_config`), trained from scratch on PRISME's tokens."""

    kind: ClassVar[str] = "frontier"
    model: PrismeConfig

    @property
    def what(self) -> str:
        return self.model.name

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        scfg = stages[self.key]
        if not self.model.copy_head:
            return _summary(train_stage_once(self.model, scfg, dataset=data))
        plain = stages[f"frontier:{self.model.name.removesuffix('+copy')}"]  # its dense model, trained by its task
        init = rebase_backbone(plain.out_dir, self.model, Path(scfg.out_dir) / "0_rebased", scfg.seed).parent
        return _summary(train_stage_once(None, scfg.replace(init_from=str(init)), dataset=data))


@dataclass(frozen=True)
class SourceTask(TextTask):
    """Stages 2 and 3 for one bank source, from the seed's stage-1 backbone (rebased onto the source's config)."""

    kind: ClassVar[str] = "source"
    source: str

    @property
    def what(self) -> str:
        return self.source

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        folder = Path(cfg.out_dir) / f"seed{self.seed}" / self.source
        init = stages["backbone"].out_dir
        src = source_config(model_cfg, self.source)
        if cfg.uses_copy:  # its copy head, then the workspace on top of it
            src = copy_config(src)
        if SOURCES[self.source] or cfg.uses_copy:  # the same stage-1 backbone under this source's workspace config
            init = str(rebase_backbone(init, src, folder / "1_backbone", stages["backbone"].seed).parent)
        out: dict[str, Any] = {}
        if cfg.uses_copy:
            c = stages["copy"].replace(out_dir=str(folder / "1c_copy"), init_from=init)
            out["copy"] = _summary(train_stage_once(None, c, dataset=data))
            init = c.out_dir
        s2 = stages["workspace"].replace(out_dir=str(folder / "2_workspace"), init_from=init)
        r2 = train_stage_once(None, s2, dataset=data)
        s3 = stages["controller"].replace(out_dir=str(folder / final_folder(stages)), init_from=s2.out_dir)
        r3 = train_stage_once(None, s3, dataset=data)
        return {**out, "workspace": _summary(r2), "controller": _summary(r3)}


@dataclass(frozen=True)
class EvalTask(TextTask):
    """Every policy of one bank source on one split: "val" (the validation split) or "held_out" (the held-out text)."""

    trains: ClassVar[bool] = False
    source: str
    split: str

    @property
    def kind(self) -> str:
        return f"eval_{self.split}"

    @property
    def what(self) -> str:
        return self.source

    def run(self, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
            data: TokenDataset) -> dict[str, Any]:
        return evaluate(cfg, model_cfg, stages, self.seed, self.source, data, self.split)


def run_task(task: TextTask, cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig],
             device: str = "auto") -> dict[str, Any]:
    """Run one task of one training seed, in a worker process (on `device`, see `devices.spread`)."""
    torch.set_num_threads(cfg.threads)
    stages = {k: v.replace(device=device) if v.device == "auto" else v for k, v in stages.items()}
    t0 = time.perf_counter()
    data = training_data(cfg.corpus)
    out: dict[str, Any] = task.describe()
    out["result"] = task.run(cfg, model_cfg, stages, data)
    out["wall_s"] = time.perf_counter() - t0
    return out


def study_task(task: Task) -> TextTask:
    """The text task a pool task of the study runs."""
    return task.args[0]


def _summary(r: Any) -> dict[str, Any]:
    return {"steps": r.step, "tokens": r.tokens, "wall_s": round(r.wall_s, 1), "checkpoint": str(r.checkpoint),
            "val": r.val}


def evaluate(cfg: TextStudyConfig, model_cfg: PrismeConfig, stages: dict[str, StageConfig], seed: int, source: str,
             data: TokenDataset, split: str, models: list[str] | None = None) -> dict:
    """Every policy of one source on the validation split ("val") or the whole held-out text ("held_out"), with
    paired intervals to the backbone, the matched backbone and the dense frontier: every frontier model, or those
    named in `models` (the confirmation pass's, `text_confirm`)."""
    from prisme.evaluation.families import PolicySettings, standard_policies
    from prisme.evaluation.policies import ExactCopyRows
    from prisme.evaluation.run import EvalOptions, evaluate_policies
    from prisme.model.compiled_editor import maybe_compile

    run = Path(cfg.out_dir) / f"seed{seed}"
    model, _ = load_model(run / source / final_folder(stages))
    maybe_compile(model, cfg.compile)
    matched, _ = load_model(stages["matched_copy" if cfg.uses_copy else "matched"].out_dir)
    names = [n for n in (frontier_name(model_cfg, *f) for f in cfg.frontier_entries) if models is None or n in models]
    refs = {n: load_model(stages[f"frontier:{n}"].out_dir)[0] for n in names}
    T = cfg.eval_window or stages["workspace"].seq_len
    extra = []
    if cfg.uses_copy:  # PRISME's local backbone without a far read, and with the untrained exact copy (gates fitted
        #   on the validation split's windows, the same the validation rows are scored on)
        plain, _ = load_model(stages["backbone"].out_dir)
        refs[NO_COPY] = plain
        extra.append(ExactCopyRows(EXACT_COPY, plain, lambda: data.iter_eval(
            "val", cfg.context_eval_batch_size, T, cfg.val_batches)))
    long = cfg.context is not None  # the router's rows at budget 1 (`CONTEXT_POLICIES`), slices by its window
    if split == "val":
        ds, batches, policies, budgets, ks, oracle_pos, lam = (data, cfg.val_batches, VAL_POLICIES, cfg.fixed_budgets,
                                                               (1, 2), cfg.oracle_positions, list(cfg.lambdas))
    else:
        ds = held_out_data(cfg.held_out, T)
        batches, policies, budgets, ks, oracle_pos, lam = (cfg.held_out_batches, HELD_OUT_POLICIES,
                                                           cfg.held_out_budgets, (1,), cfg.held_out_oracle_positions,
                                                           list(cfg.held_out_lambdas))
    if long:
        policies, budgets, ks, lam = CONTEXT_POLICIES, [1], (1,), list(cfg.context_lambdas)
    t0 = time.perf_counter()
    settings = PolicySettings(budgets=budgets, ks=ks, lambdas=lam, oracle_lambdas=[0.0], oracle_positions=oracle_pos,
                              controller_budget=1 if long else cfg.controller_budget, kappa_risk=cfg.kappa_risk)
    rows = standard_policies(model, policies, settings, matched=matched, references=refs) + extra
    # the dense frontier: every dense model trained on PRISME's bytes (at 128 also PRISME's own backbone, alone and
    # with the matched bytes: the T = 128 study's frontier); at a long context PRISME's local backbone is a row
    frontier = names if long else ["backbone", "backbone+matched", *names]
    rep = evaluate_policies(model, ds, rows, EvalOptions(
        batch_size=cfg.context_eval_batch_size if long else cfg.eval_batch_size, seq_len=T, max_batches=batches,
        seed=seed, bootstrap_samples=cfg.bootstrap_samples, frontier=frontier, slices=cfg.slice_ngram,
        reference=EXACT_COPY if cfg.uses_copy else None,
        slices_window=context_slice_edges(model.cfg.attn_window, T) if long else None))
    if split == "held_out":
        rep.split = f"held-out text {Path(cfg.held_out).name} (all of it)"
    rep.plot(run / source / f"pareto_{split}.png")
    doc = rep.to_json()
    doc["wall_s"] = time.perf_counter() - t0
    doc["table"] = rep.table()
    return doc


