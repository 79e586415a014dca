"""The text study's confirmation pass (`prisme.studies.text_confirm`): which runs train again on which fresh seeds and
when, the verdicts restated from them with fake evaluations (nothing trains), a tiny study that runs the pass, the
fresh seeds never overlapping the study's, and a study recorded before the pass continuing with `--resume`."""

from __future__ import annotations

from pathlib import Path

import pytest

from prisme import cli
from prisme.config import PrismeConfig
from prisme.studies import text
from prisme.studies.cli import text_config
from prisme.studies.records import open_study, record_study
from prisme.studies.runner import Task, run_tasks
from prisme.studies.text_confirm import confirmation_block, confirmation_prune, deciding_rows, study_document
from prisme.studies.text_report import confirmation_text, format_report, seed_summary
from prisme.studies.text_tasks import study_task

TINY = PrismeConfig.from_name("tiny", vocab_size=256)
DENSE = [f"L2_d{TINY.d_model}", "L1_d16"]  # the tiny study's dense frontier, by name


def tiny_study(tmp_path, **kw) -> text.TextStudyConfig:
    held = tmp_path / "held.txt"
    held.write_text("Abasement, n. A decent and customary mental attitude in the presence of wealth. " * 6)
    return text.TextStudyConfig(**{"sources": ["residual"], "seeds": [3], "frontier": [[2, None], [1, 16]],
                                   "scale": 0.01, "val_batches": 1, "held_out": str(held), "jobs": 1,
                                   "progress": False, "bootstrap_samples": 20, "eval_batch_size": 8,
                                   "out_dir": str(tmp_path / "text"), **kw})


def ci(hi: float, at: str = "L1_d16") -> dict:
    """A frontier gap whose 95% interval ends at `hi`, interpolated at the dense model `at` alone."""
    return {"mean": hi - 0.01, "lo": hi - 0.02, "hi": hi, "n_sequences": 10, "n_tokens": 100, "at": {at: 1.0}}


def evaluation(fixed_hi: float, controller_hi: float) -> dict:
    """One source's evaluation on one split: the dense models, the fixed row and the controller with their gaps."""
    row = lambda policy, family, ops, gap=None: {"policy": policy, "family": family, "deployable": True,  # noqa: E731
                                                 "relative_ops": ops, "loss": 1.0, "frontier_gap": gap}
    return {"rows": [row("backbone", "backbone", 1.0), row(DENSE[0], "reference", 1.9),
                     row(DENSE[1], "reference", 0.6), row("fixed_1xk1", "fixed", 1.3, ci(fixed_hi)),
                     row("controller(lambda=0.1)", "controller", 1.1, ci(controller_hi))]}


def evaluations(cfg: text.TextStudyConfig, seeds: list[int], gaps: dict[str, tuple[float, float]]) -> dict:
    """Every evaluation task's kept result on `seeds`, by task name: per split (fixed's upper end, the controller's)."""
    return {f"s{seed}/eval_{split}:residual": {"result": evaluation(*gaps[split])} for seed in seeds
            for split in ("val", "held_out")}


def test_the_confirmation_trains_the_deciding_runs_on_the_fresh_seeds_once_the_study_has_scored(tmp_path):
    """Plan: on fresh seed 5, PRISME's chain (stage 1, the source's stages 2-3, the matched backbone) without a wait,
    every dense model and evaluation after every study evaluation, each run an ordinary task `s5/<key>` trained into
    `seed5/`. Run through the runner with fake results: once the study's evaluations show that each verdict's row
    is compared with the 1-layer d = 16 model alone, the 2-layer model's fresh run is dropped and never runs; the
    fresh evaluations come after the study's. Without fresh seeds nothing more is planned."""
    cfg = tiny_study(tmp_path, seeds=[3, 4], confirm_seeds=[5])
    model_cfg, stages, tasks = text.prepare_study(cfg, TINY)
    assert sorted(stages) == [3, 4, 5] and stages[5]["backbone"].out_dir == str(tmp_path / "text" / "seed5" /
                                                                                 "1_backbone")
    settings = text.study_settings(cfg, model_cfg, stages)
    assert settings["study"]["confirm_seeds"] == [5] and sorted(settings["stages"]) == ["3", "4", "5"]
    by = {t.name: t for t in tasks}
    study_evals = {n for n in by if n.startswith(("s3/eval", "s4/eval"))}
    fresh = [n for n in by if n.startswith("s5/")]
    assert sorted(fresh) == sorted(["s5/backbone", "s5/source:residual", "s5/matched", f"s5/frontier:{DENSE[0]}",
                                    "s5/frontier:L1_d16", "s5/eval_val:residual", "s5/eval_held_out:residual"])
    for n in ("s5/backbone", "s5/source:residual", "s5/matched"):
        assert by[n].after == ()
    for n in (f"s5/frontier:{DENSE[0]}", "s5/eval_val:residual"):
        assert study_evals <= set(by[n].after)
    assert set(by["s5/eval_val:residual"].needs) == {"s5/source:residual", "s5/matched"}
    assert f"s5/frontier:{DENSE[0]}" in by["s5/eval_val:residual"].after

    study = evaluations(cfg, [3, 4], {"val": (-0.01, 0.02), "held_out": (-0.02, 0.03)})
    fake = [Task(t.name, lambda name: study.get(name, {"result": {}}), (t.name,), t.needs, t.after) for t in tasks]
    order: list[str] = []
    done = run_tasks(fake, jobs=1, prune=confirmation_prune(cfg, model_cfg, tasks),
                     on_done=lambda task, res, s: order.append(task.name))
    assert f"s5/frontier:{DENSE[0]}" not in done and "s5/frontier:L1_d16" in done and "s5/eval_val:residual" in done
    last_study = max(order.index(n) for n in study_evals)
    assert order.index("s5/frontier:L1_d16") > last_study and order.index("s5/eval_val:residual") > last_study
    rows = deciding_rows(study_document(cfg, done), DENSE)
    assert [(r["split"], r["policy"], r["frontier_models"]) for r in rows] == [
        ("val", "fixed_1xk1", ["L1_d16"]), ("held_out", "fixed_1xk1", ["L1_d16"])]
    off = tiny_study(tmp_path, seeds=[3, 4], out_dir=str(tmp_path / "off"))
    assert not any(study_task(t).seed == 5 for t in text.prepare_study(off, TINY)[2])


def test_the_verdict_is_confirmed_only_where_it_holds_on_both_sets_of_seeds(tmp_path):
    """Scoring with fake evaluations (study seeds 3, 4; fresh seeds 5, 6): the fixed row beats the frontier on every
    seed of both sets on the validation split -> confirmed; on the held-out text it beats it on the study's seeds and
    not on fresh seed 6 -> unstable, not confirmed (the negative control), its worst seed named with its upper end;
    with the controller as the only row and above the frontier everywhere -> confirmed negative. The text names the
    worst seed."""
    cfg = tiny_study(tmp_path, seeds=[3, 4], confirm_seeds=[5, 6])
    done = evaluations(cfg, [3, 4], {"val": (-0.01, 0.02), "held_out": (-0.02, 0.03)})
    fresh = evaluations(cfg, [5], {"val": (-0.03, 0.02), "held_out": (-0.01, 0.02)})
    fresh |= evaluations(cfg, [6], {"val": (-0.002, 0.02), "held_out": (0.004, 0.02)})
    doc = study_document(cfg, done)
    doc["summary"] = seed_summary(doc)
    block = confirmation_block(cfg, TINY, doc, {**done, **fresh})
    assert block["seeds"] == [5, 6] and block["study_seeds"] == [3, 4]
    val, held = block["rows"]
    assert (val["split"], val["policy"], val["verdict"], val["confirmed"]) == ("val", "fixed_1xk1", "confirmed", True)
    assert val["study"]["upper"] == [-0.01, -0.01] and val["fresh"]["upper"] == [-0.03, -0.002]
    assert val["margin"] == {"set": "fresh", "seed": 6, "upper": -0.002}
    assert held["verdict"] == "unstable" and not held["confirmed"] and held["stable"] is False
    assert held["study"]["beats"] and not held["fresh"]["beats"] and held["fresh"]["below"] == 1
    assert held["margin"] == {"set": "fresh", "seed": 6, "upper": 0.004}
    assert block["confirmed"] == ["val, residual: fixed_1xk1"]

    for rows in (r["result"]["rows"] for r in {**done, **fresh}.values()):
        rows[:] = [r for r in rows if r["policy"] != "fixed_1xk1"]  # the controller alone: above the frontier
    doc = study_document(cfg, done)
    doc["summary"] = seed_summary(doc)
    negative = confirmation_block(cfg, TINY, doc, {**done, **fresh})["rows"]
    assert [(r["policy"], r["verdict"], r["confirmed"]) for r in negative] == [
        ("controller(lambda=0.1)", "confirmed negative", False)] * 2
    report = confirmation_text(block)
    assert "confirmation on fresh seeds 5, 6 (the study's: 3, 4)" in report
    assert "-> unstable: beats the dense frontier on every study seed, not on every fresh seed; worst seed 6 (fresh)" \
        in report


@pytest.mark.parametrize("argv, want", [
    (["--seeds", "1,2", "--confirm-seeds", "2,3"], "--confirm-seeds 2,3 overlap the study's seeds (--seeds) 1,2"),
    (["--confirm-seeds", "4,4"], "--confirm-seeds '4,4' lists 4 twice"),
    (["--confirm-seeds", "-1"], "--confirm-seeds")])
def test_fresh_seeds_that_overlap_the_study_s_are_an_error_naming_the_option(argv, want, tmp_path, capsys,
                                                                             monkeypatch):
    """A fresh seed that is a study seed (or a bad list) is an error naming --confirm-seeds before anything trains
    or is written; the default is the 3 seeds after the largest study seed, and none turns the pass off."""
    monkeypatch.setattr(text, "run_tasks", lambda *a, **k: pytest.fail("the study started"))
    out = tmp_path / "study"
    assert cli.main(["study", "text", "--scale", "0.01", "--out", str(out), *argv]) == 2
    assert want in capsys.readouterr().err and not out.exists()
    with pytest.raises(ValueError, match="--confirm-seeds 3 overlap"):
        text.TextStudyConfig(seeds=[3], confirm_seeds=[3]).validate()
    args = lambda *a: cli.build_parser().parse_args(["study", "text", "--out", str(out), *a])  # noqa: E731
    assert text_config(args("--seeds", "3,1")).confirm_seeds == [4, 5, 6]
    assert text_config(args()).confirm_seeds == [1340, 1341, 1342]
    assert text_config(args("--confirm-seeds", "none")).confirm_seeds == []


def test_a_text_study_started_before_the_confirmation_pass_continues_with_resume(tmp_path, capsys):
    """A study recorded without the pass (its settings hold no confirm_seeds and no fresh seed's stages, as before
    the option existed) continues with `--resume` and no new option: the default is off for it, the settings match.
    A folder started with the pass keeps its fresh seeds by default. Negative control: asking a folder recorded
    without the pass for one is a change of settings, named."""
    cfg = tiny_study(tmp_path, seeds=[3])
    model_cfg, stages, _ = text.prepare_study(cfg, TINY)
    settings = text.study_settings(cfg, model_cfg, stages)
    assert "confirm_seeds" not in settings["study"] and list(settings["stages"]) == ["3"]
    record_study(cfg.out_dir, settings, "text study")
    argv = ["study", "text", "--seeds", "3", "--out", cfg.out_dir, "--resume"]
    again = text_config(cli.build_parser().parse_args(argv))
    assert again.confirm_seeds == [] and "started without a confirmation pass" in capsys.readouterr().err
    resumed = text.TextStudyConfig(**{**cfg.__dict__, "confirm_seeds": again.confirm_seeds})
    assert text.prepare_study(resumed, TINY, resume=True)[2]
    with pytest.raises(ValueError, match="study.confirm_seeds: was None, now \\[4\\]"):
        text.prepare_study(text.TextStudyConfig(**{**cfg.__dict__, "confirm_seeds": [4]}), TINY, resume=True)
    on = tiny_study(tmp_path, seeds=[3], confirm_seeds=[7, 9], out_dir=str(tmp_path / "on"))
    model_cfg, stages, _ = text.prepare_study(on, TINY)
    record_study(on.out_dir, text.study_settings(on, model_cfg, stages), "text study")
    assert text_config(cli.build_parser().parse_args(["study", "text", "--seeds", "3", "--out", on.out_dir])
                       ).confirm_seeds == [7, 9]
    assert open_study(on.out_dir, text.study_settings(on, model_cfg, stages))


def test_a_tiny_text_study_restates_its_verdicts_from_a_fresh_seed(tmp_path, monkeypatch):
    """`run_study` with one study seed and one fresh seed (byte-level tiny, a few steps): the fresh seed trains
    PRISME's runs and only the dense models a verdict is compared with, its evaluations score the deciding rows, the
    document's `confirmation` block restates each verdict from both seeds, and the report prints it; the same
    settings again keep every task, and `--reuse` copies the fresh seed's runs into another study (nothing trains)."""
    import prisme.training.trainer as trainer

    cfg = tiny_study(tmp_path, seeds=[3], confirm_seeds=[4])
    doc = text.run_study(cfg, TINY)
    block = doc["confirmation"]
    assert list(doc["seeds"]) == ["3"] and block["seeds"] == [4] and block["study_seeds"] == [3]
    assert {(r["source"], r["split"]) for r in block["rows"]} == {("residual", "val"), ("residual", "held_out")}
    wanted = {m for r in block["rows"] for m in r["frontier_models"]}
    for m in DENSE:
        assert (tmp_path / "text" / "seed4" / "frontier" / m / "latest").exists() == (m in wanted)
    for r in block["rows"]:
        assert r["fresh"]["seeds"] == [4] and len(r["fresh"]["upper"]) == 1 and r["margin"]["seed"] in (3, 4)
        assert r["verdict"] in ("confirmed", "confirmed negative", "unstable")
        assert r["confirmed"] == (r["study"]["beats"] and r["fresh"]["beats"])
    assert "confirmation on fresh seeds 4 (the study's: 3)" in format_report(doc)
    assert text.run_study(cfg, TINY)["confirmation"] == block  # the same settings again: every task kept
    monkeypatch.setattr(trainer, "train_stage", lambda *a, **k: pytest.fail("a run trained again"))
    copy = text.run_study(text.TextStudyConfig(**{**cfg.__dict__, "reuse": cfg.out_dir,
                                                  "out_dir": str(tmp_path / "copy")}), TINY)
    assert {"seed4/1_backbone", "seed4/residual", *(f"seed4/frontier/{m}" for m in wanted)} <= {
        Path(k).relative_to(tmp_path / "copy").as_posix() for k in copy["reused"]}
    assert [r["verdict"] for r in copy["confirmation"]["rows"]] == [r["verdict"] for r in block["rows"]]
