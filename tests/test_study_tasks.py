"""The studies' tasks: the plans of the recall study, of its frontier and of the text study list the runs they always
did, in the same order (the longest first), each described in its result as before; every task pickles (it travels
to a worker process). Planning trains nothing: these take a second."""

from __future__ import annotations

import json
import pickle
from contextlib import redirect_stderr
from io import StringIO
from pathlib import Path

import pytest

from prisme.config import PrismeConfig
from prisme.devices import spread
from prisme.studies import text
from prisme.studies.recall import ControlTask, ConvergedTask, SeedTask, plan_tasks, prepare_study, progress_printer
from prisme.studies.recall_frontier import DenseTask, FamilyTask
from prisme.studies.recall_setup import load_recipe, study_config
from prisme.studies.runner import Task


def recall_plan(tmp_path: Path, **overrides):
    cfg = study_config({"quick": True, "out_dir": str(tmp_path / "study"), **overrides})
    recipe, _ = load_recipe(cfg)
    return plan_tasks(cfg, recipe)


def described(kind: str, seed: int, folder: Path, name: str | None = None) -> dict:
    return {"kind": kind, "seed": seed, "folder": str(folder), "name": name}


def test_the_quick_recall_plan_is_the_controls_then_the_converged_case_then_the_seeds(tmp_path):
    """Controls (trained as long as stages 1 + 2: 24 steps) on the first seed, the converged case (stage 1 to 16
    steps) and the plain runs on every seed, in this order, each described by kind, seed, folder and name."""
    out = tmp_path / "study"
    tasks = recall_plan(tmp_path, seeds=[3, 1])
    want = [described("control", 3, out / f"control_{n}_seed3", n) for n in ("one_layer", "two_layer")]
    want += [described("converged", s, out / f"converged_seed{s}") for s in (3, 1)]
    want += [described("seed", s, out / f"seed{s}") for s in (3, 1)]
    assert [t.describe() for t in tasks] == want
    assert json.loads(json.dumps([t.describe() for t in tasks])) == want  # the result's "task", as JSON
    assert [type(t) for t in tasks] == [ControlTask] * 2 + [ConvergedTask] * 2 + [SeedTask] * 2
    assert [[s.steps for s in t.stages] for t in tasks] == [[24], [24], [16, 12, 6], [16, 12, 6], [12, 12, 6],
                                                            [12, 12, 6]]
    assert [t.model.n_layer for t in tasks] == [1, 2, 1, 1, 1, 1] and tasks[1].layers == 2
    assert tasks[0].stage_folders() == ["1_backbone"]
    assert tasks[2].stage_folders() == ["1_backbone", "2_workspace", "3_controller"]
    assert all(t.device == "auto" and t.study.seeds == [3, 1] for t in tasks)


def test_one_layer_controls_go_last_and_the_converged_case_can_be_left_out(tmp_path):
    """Two one-layer controls are short runs: they start after the others; without the converged case only the
    seeds' runs and the controls remain."""
    out = tmp_path / "study"
    tasks = recall_plan(tmp_path, seeds=[5, 0], control_layers=(1, 1))
    assert [t.describe() for t in tasks] == [
        *(described("converged", s, out / f"converged_seed{s}") for s in (5, 0)),
        *(described("seed", s, out / f"seed{s}") for s in (5, 0)),
        *(described("control", 5, out / f"control_{n}_seed5", n) for n in ("one_layer", "two_layer"))]
    tasks = recall_plan(tmp_path, seeds=[2], converged=False)
    assert [(t.kind, t.name) for t in tasks] == [("control", "one_layer"), ("control", "two_layer"), ("seed", None)]


def test_the_quick_frontier_plan_is_the_family_then_the_controls_then_the_dense_grid(tmp_path):
    """`--frontier --quick`: the first family size on every seed, the controls, then every depth x width backbone
    on every seed, each in `frontier/`; the controller runs are left out."""
    out = tmp_path / "study"
    tasks = recall_plan(tmp_path, seeds=[0, 2], frontier=True,
                        frontier_dense=[{"depths": [1, 2], "widths": [16, 32]}],
                        family=[[16, 32], [24, 32]])
    want = [described("family", s, out / "frontier" / f"prisme_d16_w32_seed{s}", "d16_w32") for s in (0, 2)]
    want += [described("control", 0, out / f"control_{n}_seed0", n) for n in ("one_layer", "two_layer")]
    want += [described("dense", s, out / "frontier" / f"dense_L{L}_d{d}_seed{s}", f"L{L}_d{d}")
             for L in (1, 2) for d in (16, 32) for s in (0, 2)]
    assert [t.describe() for t in tasks] == want
    family, dense = tasks[0], tasks[4:]
    assert isinstance(family, FamilyTask) and all(isinstance(t, DenseTask) for t in dense)
    assert (family.model.d_model, family.model.w, family.model.router) == (16, 32, True)
    assert [s.stage for s in family.stages] == ["backbone", "workspace", "router"]
    assert [(t.model.n_layer, t.model.d_model, t.model.use_workspace) for t in dense[::2]] == [
        (1, 16, False), (1, 32, False), (2, 16, False), (2, 32, False)]
    assert all([s.steps for s in t.stages] == [12] for t in dense)


def test_prepare_study_names_each_pool_task_by_its_folder_and_spreads_the_devices(tmp_path):
    """`prepare_study` (the quick study keeps its first seed): one pool task per run, named by its folder, whose one
    argument is the run with its device; a run folder already taken is refused before anything trains."""
    out = tmp_path / "study"
    cfg, _, tasks = prepare_study(study_config({"quick": True, "seeds": [4, 1], "out_dir": str(out)}))
    assert cfg.seeds == [4]
    assert [t.name for t in tasks] == [str(out / f) for f in ("control_one_layer_seed4", "control_two_layer_seed4",
                                                               "converged_seed4", "seed4")]
    assert [t.args[0].device for t in tasks] == [spread(i) for i in range(4)]
    assert all(t.args[0].folder == t.name and len(t.args) == 1 for t in tasks)
    (out / "seed4" / "2_workspace" / "latest").mkdir(parents=True)
    with pytest.raises(ValueError, match="seed4/2_workspace already holds a run"):
        prepare_study(study_config({"quick": True, "seeds": [4], "out_dir": str(out)}))


def test_progress_lines_name_the_run_and_its_headline_accuracy(tmp_path):
    """One line per finished run: the kind (and the name where the seed alone does not name it), the seed, and
    budget-1 accuracy (the family: its deployed accuracy)."""
    control, _, seed = recall_plan(tmp_path, seeds=[3], converged=False)
    family = recall_plan(tmp_path, seeds=[3], frontier=True)[0]
    show = progress_printer(True, 3, "recall ")
    err = StringIO()
    with redirect_stderr(err):
        for t, entry in ((seed, {"budget1_accuracy": 0.5, "accuracy": 0.1}), (control, {"accuracy": 0.25}),
                         (family, {"budget1_accuracy": 0.5, "accuracy": 0.75})):
            show(Task(t.folder, len, (t,)), {"task": t.describe(), "entry": entry}, 2.0)
    assert [line.split("] ")[1] for line in err.getvalue().splitlines()] == [
        "seed seed 3: accuracy 0.5000", "control one_layer seed 3: accuracy 0.2500",
        "family d16_w32 seed 3: accuracy 0.7500"]


def text_plan(tmp_path: Path):
    model = PrismeConfig.from_name("tiny", vocab_size=256)
    cfg = text.TextStudyConfig(sources=["residual", "embedding"], seeds=[3, 4], scale=0.01, jobs=1, progress=False,
                               frontier=[[1, None], [2, 16], [3, None]], out_dir=str(tmp_path / "text"))
    return model, text.prepare_study(cfg, model)


def test_the_text_plan_starts_each_seeds_chains_then_its_evaluations_after_what_they_read(tmp_path):
    """Per seed stage 1, each source's stages 2-3 and the frontier (deepest first), then that seed's matched
    backbone and each source's evaluations (held-out text, then validation), before the next seed's; named
    `s<seed>/<kind>[:<what>]`; an evaluation needs its source's stages, the matched backbone and every frontier
    model."""
    model, (_, stages, tasks) = text_plan(tmp_path)
    d = model.d_model
    frontier = [f"L1_d{d}", "L2_d16", f"L3_d{d}"]  # as listed; deepest first in the pool
    sources = ("residual", "embedding")
    want: list[tuple[str, tuple[str, ...], dict]] = []  # (name, needs, description)
    for s in (3, 4):
        want.append((f"s{s}/backbone", (), {"kind": "backbone", "what": None, "seed": s}))
        want += [(f"s{s}/source:{src}", (f"s{s}/backbone",), {"kind": "source", "what": src, "seed": s})
                 for src in sources]
        want += [(f"s{s}/frontier:{n}", (), {"kind": "frontier", "what": n, "seed": s}) for n in frontier[::-1]]
        want.append((f"s{s}/matched", (f"s{s}/backbone",), {"kind": "matched", "what": None, "seed": s}))
        want += [(f"s{s}/eval_{split}:{src}", (f"s{s}/source:{src}", f"s{s}/matched",
                                                *(f"s{s}/frontier:{n}" for n in frontier)),
                  {"kind": f"eval_{split}", "what": src, "seed": s})
                 for split in ("held_out", "val") for src in sources]
    assert [(t.name, t.needs, t.args[0].describe()) for t in tasks] == want
    assert [t.args[4] for t in tasks] == [spread(i) for i in range(len(tasks))]
    assert all(t.args[0].name == t.name and t.args[3] is stages[t.args[0].seed] for t in tasks)
    deepest = tasks[3].args[0]
    assert isinstance(deepest, text.FrontierTask) and (deepest.model.n_layer, deepest.model.d_model) == (3, d)
    assert all(f"frontier:{n}" in stages[3] for n in frontier)  # each frontier run trains with its own stage config
    assert [t.args[0].trains for t in tasks].count(False) == 8  # the evaluations: not in a seed's "training"


def test_every_task_round_trips_through_pickle(tmp_path):
    """The pool sends each task to a worker process: every kind pickles and comes back equal, its description too."""
    recall = recall_plan(tmp_path, seeds=[1]) + recall_plan(tmp_path, seeds=[1], frontier=True)
    _, (_, _, text_tasks) = text_plan(tmp_path)
    tasks = recall + [t.args[0] for t in text_tasks]
    kinds = {type(t).__name__ for t in tasks}
    assert kinds == {"ControlTask", "ConvergedTask", "SeedTask", "DenseTask", "FamilyTask", "BackboneTask",
                     "MatchedTask", "FrontierTask", "SourceTask", "EvalTask"}
    for t in tasks:
        back = pickle.loads(pickle.dumps(t))
        assert back == t and type(back) is type(t) and back.describe() == t.describe()
    with pytest.raises(AttributeError):
        tasks[0].seed = 2  # frozen
