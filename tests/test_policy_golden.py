"""Every evaluated row is what it was before the evaluation became one `Policy` interface: the rows, their paired
intervals, frontier gaps and slices, the report's tables, and the recall study's rows, recorded in
`data/golden_eval/rows_before_policy_refactor.json` by the code before the change on the same small trained models
(a tiny byte-level model trained through its three stages on Austen, a matched backbone, a three-layer reference) and
on seeded recall-study models, all in float64."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from prisme.checkpoint import load_model
from prisme.config import ADDED_CONFIG_FIELDS, MOVED_CONFIG_FIELDS
from prisme.evaluation.families import PolicySettings, standard_policies
from prisme.evaluation.run import EvalOptions, evaluate_policies
from prisme.model.prisme import PrismeModel
from prisme.studies.recall_eval import evaluate_run
from prisme.studies.recall_frontier import dense_config, evaluate_dense, evaluate_family, family_config
from prisme.studies.recall_setup import RecallStudyConfig, load_recipe
from prisme.training.config import StageConfig, build_dataset

DATA = Path(__file__).parent / "data" / "golden_eval"
GOLDEN = json.loads((DATA / "rows_before_policy_refactor.json").read_text())
UNRECORDED = {"tokens_per_s", "environment", "wall_s", "table", "scored_edit_share"}  # timing, or new since


def differences(old, new, path: str = "") -> list[str]:
    """Where `new` differs from `old`: floats beyond 1e-9 relative (float64 on another CPU), anything else at all. A
    slice's `share_of_gain` (its gain over the row's whole gain, which can be a small difference of larger ones: shares
    of -0.91 and +1.75 on one row) is compared to 1e-8 absolute: float64 losses that differ in the last bits between
    two CPUs' kernels move it by ~3e-9 on an x86 AMD vs Intel pair."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            if k in UNRECORDED:
                continue
            if k not in old and path.endswith("/config") and (new[k] in (False, None)
                                                              or new[k] == ADDED_CONFIG_FIELDS.get(k, ...)):
                continue  # a model option added since, off (or at the value that reproduces the record)
            if k not in new and path.endswith("/config") and old[k] == MOVED_CONFIG_FIELDS.get(k, ...):
                continue  # a field that left the model config since, at the value where it changed nothing
            if k not in old or k not in new:
                out.append(f"{path}/{k}: only in {'the record' if k in old else 'the new rows'}")
            else:
                out += differences(old[k], new[k], f"{path}/{k}")
        return out
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{path}: {len(old)} entries recorded, {len(new)} now"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, f"{path}[{i}]")]
    if isinstance(old, float) and isinstance(new, (int, float)) and not isinstance(new, bool):
        tol = 1e-8 if path.endswith("/share_of_gain") else 1e-12
        return [] if math.isclose(old, new, rel_tol=1e-9, abs_tol=tol) else [f"{path}: {old!r} -> {new!r}"]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def masked(table: str) -> list[str]:
    """The table's lines without the tokens/s column (wall time)."""
    return [re.sub(r"\s+\d+  (yes|no)", r" #  \1", line) for line in table.splitlines()]


@pytest.fixture(scope="module")
def text_models():
    torch.set_num_threads(1)
    return [load_model(DATA / name)[0].double() for name in ("3_controller", "matched", "L3")]


def text_reports(model, matched, ref):
    ds = build_dataset(StageConfig(dataset="austen", seq_len=32), 256)
    every = standard_policies(model, None, PolicySettings(oracle_positions=4), matched=matched,
                              references={"L3": ref})
    some = standard_policies(model, ["backbone", "fixed", "random", "controller", "oracle"], PolicySettings(
        lambdas=[0.0, 1e-4], oracle_lambdas=[0.0], budgets=[1, 2], ks=[1], controller_budget=2, kappa_risk=0.5,
        oracle_positions=None))
    return {"text_all": evaluate_policies(model, ds, every, EvalOptions(
                batch_size=4, seq_len=32, max_batches=3, seed=7, bootstrap_samples=200,
                frontier=["backbone", "backbone+matched", "L3"], slices=4)),
            "text_options": evaluate_policies(model, ds, some, EvalOptions(
                batch_size=4, seq_len=32, max_batches=2, seed=3, bootstrap_samples=100, bootstrap_seed=5))}


def test_text_rows_and_tables_are_unchanged_by_the_policy_interface(text_models):
    """Every family of the text evaluation (matched and reference rows, the frontier gaps, slices, the controller's
    equal-edits baselines, the oracle) gives the recorded rows, and the table the recorded lines."""
    for name, report in text_reports(*text_models).items():
        old = GOLDEN["text"][name]
        assert differences(old, report.to_json()) == [], name
        assert masked(report.table()) == masked(old["table"]), name


def test_the_golden_comparison_sees_a_changed_row(text_models):
    """Negative control: the same evaluation with the oracle on other positions (another seed) no longer matches."""
    model, matched, ref = text_models
    ds = build_dataset(StageConfig(dataset="austen", seq_len=32), 256)
    report = evaluate_policies(model, ds, standard_policies(model, None, PolicySettings(oracle_positions=4),
                                                            matched=matched, references={"L3": ref}),
                               EvalOptions(batch_size=4, seq_len=32, max_batches=3, seed=8, bootstrap_samples=200,
                                           frontier=["backbone", "backbone+matched", "L3"], slices=4))
    diffs = differences(GOLDEN["text"]["text_all"], report.to_json())
    assert "/seed: 7 -> 8" in diffs and any(d.startswith("/rows[") for d in diffs)


def seeded(cfg, seed: int) -> PrismeModel:
    """The recorded recall models: the config's model drawn after `torch.manual_seed(seed)`, in float64, with a
    readout, controller and router that act."""
    torch.manual_seed(seed)
    model = PrismeModel(cfg).double().eval()
    if cfg.use_workspace:
        torch.nn.init.normal_(model.readout.U.weight, std=0.3)
        torch.nn.init.normal_(model.controller.mlp[-1].weight, std=0.3)
        if cfg.router:
            torch.nn.init.normal_(model.router.head.weight, std=0.5)
            with torch.no_grad():
                model.router.head.bias.fill_(-0.3)
    return model


def test_recall_study_rows_are_unchanged_by_the_policy_interface():
    """The recall study scored through `evaluate_policies` at the query positions gives the recorded rows: a seed's
    forced, random, dense, controller and oracle rows with the calibrated price, a frontier family member's router
    rows, and a dense model's accuracy and ops."""
    torch.set_num_threads(1)
    cfg = RecallStudyConfig(eval_sequences=300, calibration_sequences=64, lambdas=[0.0, 0.1, 0.3],
                            router_lambdas=[0.01, 0.05, 0.2])
    recipe, _ = load_recipe(cfg)
    new = {"run": evaluate_run(seeded(recipe.model, 0), recipe.mqar, 3, cfg),
           "family": evaluate_family(seeded(family_config(recipe, 16, 32), 1), recipe.mqar, 4, cfg),
           "dense": evaluate_dense(seeded(dense_config(recipe, 2, 24), 2), recipe.mqar, 5, cfg)}
    assert differences(GOLDEN["recall"], new) == []
    new["run"]["fixed"][3]["accuracy"] += 1 / 1200  # negative control: one more query hit is seen
    assert differences(GOLDEN["recall"], new) == ["/run/fixed[3]/accuracy: 0.0175 -> 0.018333333333333333"]
