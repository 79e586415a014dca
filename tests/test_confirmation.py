"""The frontier study's confirmation pass (`prisme.studies.recall_confirm`, `recall_verdict`): which models train again
on which fresh seeds, when, and the verdict restated from them, with fake accuracies (nothing trains); the fresh seeds
never overlap the study's; a recorded study's deciding models come from the study's grid by name, in the folders a
study on those seeds uses (so `--reuse` copies its runs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from prisme import cli
from prisme.studies import recall
from prisme.studies.confirm import parse_confirm_seeds, seeds_after
from prisme.studies.recall import plan_tasks, study_settings
from prisme.studies.recall_confirm import (
    confirmation_prune,
    is_fresh,
    waits_for,
)
from prisme.studies.recall_frontier import DenseTask, FamilyTask, FrontierMember, assemble_frontier
from prisme.studies.recall_setup import RecallStudyConfig, load_recipe, study_config
from prisme.studies.recall_verdict import confirm_study, format_confirmation
from prisme.studies.runner import Task, run_tasks

REFERENCE = Path(__file__).resolve().parent.parent / "prisme" / "reference" / "recall_context_frontier.json"
OPS = {"L1_d8_ks": 8000.0, "L1_d12_ks": 12000.0, "L1_d16_ks": 16000.0, "d16_w32": 10000.0, "d24_w32": 14000.0}
STUDY = {"L1_d8_ks": [0.30, 0.31, 0.29, 0.30, 0.32], "L1_d12_ks": [0.96, 0.97, 0.99, 0.94, 0.98],
         "L1_d16_ks": [1.0] * 5, "d16_w32": [0.978, 0.978, 0.972, 0.966, 0.974], "d24_w32": [0.99] * 5}
FRESH = {"L1_d8_ks": [0.30, 0.40, 0.35], "L1_d12_ks": [0.97, 0.96, 0.99], "L1_d16_ks": [1.0] * 3,
         "d16_w32": [0.98, 0.97, 0.99], "d24_w32": [0.99, 0.98, 0.99]}


def small_study(**kw) -> RecallStudyConfig:
    """A T = 32 frontier study over a cut grid: three dense rungs with the key shift, two PRISME sizes."""
    return RecallStudyConfig(**{"frontier": True, "seeds": [0, 1, 2, 3, 4], "confirm_seeds": [5, 6, 7],
                                "frontier_dense": [{"depths": [1], "widths": [8, 12, 16], "key_shift": True}],
                                "family": [[16, 32], [24, 32]], **kw}).validate()


def fake_run(t: FrontierMember, accuracy: float) -> dict:
    """What a run's task returns, without training: its accuracy and ops (`OPS`), as `run_task` writes them."""
    entry = {"accuracy": accuracy, "ops_per_token": OPS[t.key], "seed": t.seed, "checkpoint": f"{t.folder}/ckpt",
             "model": t.model.to_dict(), "steps": t.stage_steps(), "wall_s": {"evaluate": 0.0}}
    if isinstance(t, FamilyTask):
        entry |= {"budget1_accuracy": accuracy, "router": {"lambda": 0.05, "edits_per_token": 0.12,
                                                           "query_edit_share": 1.0}}
    return {"task": t.describe(), "entry": entry}


def run_fake(cfg: RecallStudyConfig, fresh: dict[str, list[float]], study: dict[str, list[float]] = STUDY
             ) -> tuple[list[str], list, dict]:
    """The study's frontier runs (accuracies `study`) and its confirmation pass (`fresh`) through the runner (one
    process, `fake_run`): (the runs in the order they finished, the (task, entry) pairs, the confirmation block)."""
    recipe, _ = load_recipe(cfg)
    planned = [t for t in plan_tasks(cfg, recipe) if isinstance(t, FrontierMember)]
    names = [t.folder for t in planned]
    after = waits_for(cfg, planned, names)
    accuracy = {t.folder: (fresh[t.key][cfg.confirm_seeds.index(t.seed)] if is_fresh(cfg, t)
                           else study[t.key][cfg.seeds.index(t.seed)]) for t in planned}
    tasks = [Task(t.folder, fake_run, (t, accuracy[t.folder]), after=after.get(t.folder, ())) for t in planned]
    order: list[str] = []
    got = run_tasks(tasks, jobs=1, prune=confirmation_prune(cfg, planned, names),
                    on_done=lambda task, res, s: order.append(task.name))
    done = [(t, got[t.folder]["entry"]) for t in planned if t.folder in got]
    frontier = assemble_frontier(cfg, recipe, [d for d in done if not is_fresh(cfg, d[0])])
    return order, done, confirm_study(cfg, recipe, {None: frontier}, done)


def test_the_confirmation_trains_the_deciding_models_on_the_fresh_seeds_after_their_familys_study_runs():
    """Plan: every member on every fresh seed, in `<member>_seed<S>` beside the study's runs, each waiting for its
    family's study runs; once those have decided, only the models that decide the verdict train: each family's
    cheapest passing configuration, the next cheaper one and the next costlier passing one (the dense L1 d = 8 with
    the shift fails, d = 12 passes 4/5, d = 16 passes; PRISME d = 16 and d = 24 pass), on seeds 5, 6, 7, each after
    every study run of its family. Without fresh seeds nothing more is planned."""
    cfg = small_study(out_dir="/x")
    recipe, _ = load_recipe(cfg)
    planned = plan_tasks(cfg, recipe)
    fresh = [t for t in planned if is_fresh(cfg, t)]
    assert {(t.key, t.seed) for t in fresh} == {(k, s) for k in OPS for s in (5, 6, 7)}
    folder = lambda k, s: f"/x/frontier/{'dense' if k.startswith('L') else 'prisme'}_{k}_seed{s}"  # noqa: E731
    assert {t.folder for t in fresh} == {folder(k, s) for k in OPS for s in (5, 6, 7)}
    after = waits_for(cfg, planned, [t.folder for t in planned])
    d12 = after[folder("L1_d12_ks", 6)]
    assert set(d12) == {folder(k, s) for k in ("L1_d8_ks", "L1_d12_ks", "L1_d16_ks") for s in range(5)}
    assert not [t for t in plan_tasks(dataclasses.replace(cfg, confirm_seeds=[]), recipe) if is_fresh(cfg, t)]

    order, done, _ = run_fake(cfg, FRESH)
    trained = {(t.key, t.seed) for t, _ in done if is_fresh(cfg, t)}
    assert trained == {(k, s) for k in OPS for s in (5, 6, 7)}  # all five decide: 3 dense, 2 PRISME
    for t, _ in done:
        if is_fresh(cfg, t):
            assert all(order.index(n) < order.index(t.folder) for n in after[t.folder])
    less = dict(STUDY, L1_d16_ks=[0.5] * 5, d24_w32=[0.5] * 5)  # no fallback: dense d = 16, PRISME d = 24 fail
    _, done, _ = run_fake(cfg, FRESH, less)
    assert {t.key for t, _ in done if is_fresh(cfg, t)} == {"L1_d8_ks", "L1_d12_ks", "d16_w32"}


def test_the_verdict_is_restated_from_the_fresh_seeds_and_an_unstable_member_confirms_nothing():
    """Score: with every deciding model passing on both sets, the confirmed verdict is the study's (dense L1 d = 12,
    PRISME d = 16) and the confirmed ratio their fresh ops' ratio; the margins give the worst passing seed (dense:
    0.96 over both sets, no seed to spare on the study's 4/5). Negative control: PRISME d = 16 passes on the study's
    seeds (0.966-0.978) and fails on the fresh ones (0.972 / 0.941 / 0.937), and so does its fallback: both are
    reported unstable with their accuracies, nothing is confirmed for PRISME and no confirmed ratio is printed, only
    why. Should the fallback pass on both sets, the confirmed verdict takes it, and says so."""
    cfg = small_study(out_dir="/x")
    _, _, block = run_fake(cfg, FRESH)
    (c,) = block["contexts"]
    assert (block["seeds"], block["seeds_needed"], block["study_seeds_needed"], c["T"]) == ([5, 6, 7], 2, 4, 32)
    roles = {m["key"]: m["role"] for m in c["models"]}
    assert roles == {"L1_d8_ks": "next_cheaper", "L1_d12_ks": "cheapest_passing", "L1_d16_ks": "fallback",
                     "d16_w32": "cheapest_passing", "d24_w32": "fallback"}
    assert all(m["stable"] for m in c["models"])
    v = c["verdict"]
    assert (v["dense"], v["prisme"], v["why"], v["caveats"]) == ("L1_d12_ks", "d16_w32", None, [])
    assert v["confirmed_ratio"] == pytest.approx(10000 / 12000) and v["study_ratio"] == pytest.approx(10000 / 12000)
    d = c["margins"]["dense"]
    assert (d["key"], d["worst_passing"], d["spare_seeds"]) == ("L1_d12_ks", 0.96, {"study": 0, "fresh": 1})
    assert d["margin"] == pytest.approx(0.01)
    assert "confirmed ratio PRISME / dense: 0.833" in format_confirmation(block)

    bad = dict(FRESH, d16_w32=[0.972, 0.941, 0.937], d24_w32=[0.93, 0.99, 0.94])
    _, _, block = run_fake(cfg, bad)
    (c,) = block["contexts"]
    m = {m["key"]: m for m in c["models"]}
    assert m["d16_w32"]["stable"] is False and m["d16_w32"]["study"]["passes"] and not m["d16_w32"]["fresh"]["passes"]
    assert m["d16_w32"]["status"] == "unstable: passes on the study's seeds, fails on the fresh ones"
    assert m["d16_w32"]["fresh"]["accuracy"] == [0.972, 0.941, 0.937] and m["d16_w32"]["fresh"]["pass_rate"] == "1/3"
    v = c["verdict"]
    assert v["prisme"] is None and v["confirmed_ratio"] is None and v["dense"] == "L1_d12_ks"
    assert "PRISME d=16 w=32, router is unstable: 5/5" in v["why"] and "1/3: 0.972 0.941 0.937" in v["why"]
    text = format_confirmation(block)
    assert "confirmed ratio PRISME / dense" not in text and "no confirmed ratio" in text and "PRISME none" in text
    assert c["margins"]["prisme"]["confirmed"] is False

    _, _, block = run_fake(cfg, dict(bad, d24_w32=[0.99, 0.98, 0.99]))
    v = block["contexts"][0]["verdict"]
    assert v["prisme"] == "d24_w32" and v["confirmed_ratio"] == pytest.approx(14000 / 12000)
    assert any("takes d=24 w=32" in x for x in v["caveats"]) and any("unstable" in x for x in v["caveats"])


def test_fresh_seeds_overlapping_the_studys_are_an_error_naming_the_option(tmp_path, capsys, monkeypatch):
    """`--confirm-seeds` sharing a seed with `--seeds` is a ValueError naming the option (exit 2 from the command line,
    nothing written); the default is the 3 seeds after the largest study seed; none or 0 turns the pass off."""
    with pytest.raises(ValueError, match="--confirm-seeds 34,35 overlap the study's seeds"):
        study_config({"frontier": True, "seeds": [30, 31, 32, 33, 34], "confirm_seeds": [34, 35]})
    out = tmp_path / "s"
    argv = ["study", "recall", "--frontier", "--seeds", "30,31", "--out", str(out), "--no-progress"]
    assert cli.main([*argv, "--confirm-seeds", "31,40"]) == 2
    assert "--confirm-seeds" in capsys.readouterr().err and not out.exists()
    assert seeds_after([30, 31, 32, 33, 34]) == [35, 36, 37] and seeds_after([0, 1, 2, 3, 4]) == [5, 6, 7]
    assert parse_confirm_seeds("none") == [] and parse_confirm_seeds(None) is None
    assert parse_confirm_seeds("0") == [0]  # seed 0, as in --seeds; "none" alone turns the pass off
    seen: list[RecallStudyConfig] = []
    monkeypatch.setattr(recall, "run_study", lambda cfg, **kw: seen.append(cfg) or {})
    monkeypatch.setattr(recall, "emit_study", lambda *a: 0)
    assert cli.main(argv) == 0 and seen[-1].confirm_seeds == [32, 33, 34]
    assert cli.main([*argv, "--confirm-seeds", "none"]) == 0 and seen[-1].confirm_seeds == []
    with pytest.raises(ValueError, match="--confirm-seeds needs --frontier"):
        study_config({"seeds": [0], "confirm_seeds": [1]})


def cut_grid(**kw) -> RecallStudyConfig:
    """The long-context grid cut to the T = 1,024 verdict's models: dense one layer d = 12, 16 with the key shift;
    PRISME d = 8, 12 on a 64-window key-shift backbone."""
    family = [{"d": d, "w": 32, "attn_window": 64, "key_shift": True, "router_token": True} for d in (8, 12)]
    return RecallStudyConfig(**{"frontier": True, "contexts": [1024], "context_search": "grid",
                                "context_dense": [{"depths": [1], "widths": [12, 16], "key_shift": True}],
                                "context_family": family, **kw}).validate()


def test_a_recorded_study_confirms_its_deciding_models_in_the_folders_a_study_on_the_fresh_seeds_trains(tmp_path):
    """`--confirm-of` the recorded T = 1,024 frontier: its deciding models found from the document and taken from the
    grid by name (PRISME d = 8, the cheapest passing, and d = 12, the next passing; dense one layer d = 16 with the
    shift and d = 12, the next cheaper the grid holds), alone, on seeds 35-37; the recorded models the grid lacks are
    listed, not confirmed. Their folders and configs are those of a study run on seeds 35-37 over the same grid, so
    `--reuse` copies its finished runs. Negative control: a grid without the recorded dense winner is a ValueError
    naming it."""
    from prisme.studies.recall_confirm import plan_grid, recorded_rows
    from prisme.studies.runner import STUDY_DIR, record_study, reuse_runs

    cfg = cut_grid(seeds=[30, 31, 32, 33, 34], confirm_seeds=[35, 36, 37], confirm_of=str(REFERENCE),
                   out_dir=str(tmp_path / "new"))
    recipe, _ = load_recipe(cfg)
    planned = plan_tasks(cfg, recipe)
    assert all(is_fresh(cfg, t) for t in planned)
    assert {(t.key, t.seed) for t in planned} == {(k, s) for k in ("d8_w32_ks_win64_tok", "d12_w32_ks_win64_tok",
                                                                  "L1_d12_ks", "L1_d16_ks") for s in (35, 36, 37)}
    rows = recorded_rows(cfg, plan_grid(cfg, recipe, cfg.out_dir))[1024]
    outside = {r["name"] for r in rows if r["key"] is None}
    assert outside == {"1 layer d=8 + key shift, global attention", "2 layers d=16 + key shift, 64-window",
                       "2 layers d=8 + key shift, global attention",
                       "d=16 w=32, 64-window backbone + key shift, router"}
    assert {r["key"]: r["role"] for r in rows if r["role"]} == {
        "d8_w32_ks_win64_tok": "cheapest_passing", "d12_w32_ks_win64_tok": "fallback",
        "L1_d16_ks": "cheapest_passing", "L1_d12_ks": "next_cheaper"}

    old = cut_grid(seeds=[35, 36, 37], out_dir=str(tmp_path / "old"))  # the study on the fresh seeds, run before
    old_tasks = plan_tasks(old, recipe)
    record_study(tmp_path / "old", study_settings(old, old_tasks))
    run_tasks([Task(t.folder, _finished, (t.folder,)) for t in old_tasks], jobs=1,
              store=tmp_path / "old" / STUDY_DIR / "done")
    new = study_settings(cfg, planned)
    record_study(tmp_path / "new", new)
    copied = reuse_runs(tmp_path / "old", tmp_path / "new", new, [t.folder for t in planned])
    assert sorted(copied) == sorted(t.folder for t in planned)

    with pytest.raises(ValueError, match="--confirm-of .*'1 layer d=16 \\+ key shift, global attention'.*not in"):
        plan_tasks(dataclasses.replace(cfg, context_dense=[{"depths": [1], "widths": [12], "key_shift": True}]),
                   recipe)
    assert not [t for t in planned if isinstance(t, DenseTask) and t.key == "L1_d8_ks"]


def test_a_task_after_others_starts_once_they_have_finished_or_been_dropped():
    """`Task.after` orders without needing: "late" waits for "first" (still to run) and for "dropped", which `prune`
    drops; it still runs, after "first". Negative control: a task that needs the dropped one never runs."""
    tasks = [Task("late", _finished_name, ("late",), after=("first", "dropped")),
             Task("first", _finished_name, ("first",)), Task("dropped", _finished_name, ("dropped",)),
             Task("needs", _finished_name, ("needs",), needs=("dropped",))]
    order: list[str] = []
    got = run_tasks(tasks, jobs=1, prune=lambda done: {"dropped"}, on_done=lambda t, r, s: order.append(t.name))
    assert order == ["first", "late"] and set(got) == {"first", "late"}


def _finished(folder: str) -> str:
    Path(folder).mkdir(parents=True)
    return folder


def _finished_name(name: str) -> str:
    return name


def fake_task(task, accuracy: dict[tuple[str, int], float]) -> dict:
    """`recall.run_task` without training: a control at chance (one layer) or solved (two), a frontier member at
    `accuracy[(key, seed)]`."""
    t = task
    if not isinstance(t, FrontierMember):
        entry = {"accuracy": 0.25 if t.layers == 1 else 1.0, "layers": t.layers, "steps": 1, "seed": t.seed,
                 "checkpoint": "-", "wall_s": {"backbone": 0.0}}
        return {"task": t.describe(), "entry": entry}
    return fake_run(t, accuracy[(t.key, t.seed)])


def test_a_frontier_study_writes_the_confirmation_block_in_its_document_and_table_and_resumes_it(tmp_path, monkeypatch):
    """`run_study` end to end with fake runs: the document's `confirmation` block and the table's confirmation lines;
    the confirmation's runs are kept in the study's store, so a rerun with `--resume` trains nothing and writes the
    same block. A recorded study's confirmation (`confirm_of`) trains its deciding models alone and its document is
    the block."""
    import json

    from prisme.studies.recall_report import format_table

    accuracy = {(k, s): a for k, acc in STUDY.items() for s, a in zip(range(5), acc)}
    accuracy |= {(k, s): a for k, acc in FRESH.items() for s, a in zip((5, 6, 7), acc)}
    ran: list[str] = []
    monkeypatch.setattr(recall, "run_task", lambda t: ran.append(t.folder) or fake_task(t, accuracy))
    monkeypatch.setattr(recall, "decode_speed", lambda *a: {})
    cfg = small_study(out_dir=str(tmp_path / "s"), jobs=1)
    doc = recall.run_study(cfg, progress=False)
    block = doc["confirmation"]
    assert block["seeds"] == [5, 6, 7] and block["contexts"][0]["verdict"]["dense"] == "L1_d12_ks"
    assert json.loads((tmp_path / "s" / "recall.json").read_text())["confirmation"] == block
    assert len([f for f in ran if f.endswith(("_seed5", "_seed6", "_seed7"))]) == 15
    text = format_table(doc)
    assert "confirmation on fresh seeds 5,6,7" in text and "confirmed ratio PRISME / dense: 0.833" in text
    assert "margins: dense worst passing seed 0.960 (+0.010 over the bar), 0 seeds to spare; prisme" in text
    ran.clear()
    again = recall.run_study(cfg, progress=False, resume=True)
    assert ran == [] and again["confirmation"] == block

    rec = {"seeds": [0, 1, 2, 3, 4], "frontier": doc["frontier"]}  # a recorded study: its JSON
    (tmp_path / "doc.json").write_text(json.dumps(rec))
    other = small_study(out_dir=str(tmp_path / "c"), jobs=1, confirm_of=str(tmp_path / "doc.json"))
    confirmed = recall.run_study(other, progress=False)
    assert len(ran) == 15 and all(f.endswith(("_seed5", "_seed6", "_seed7")) for f in ran)
    assert confirmed["confirmation"]["contexts"][0]["verdict"] == block["contexts"][0]["verdict"]
    assert format_table(confirmed).startswith("confirmation on fresh seeds 5,6,7")
