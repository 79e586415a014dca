"""The long-context recall study (`prisme study recall --frontier --context`): per length, a task whose every query's
pair lies beyond the largest attention window, the grid's runs in their own folders, bad lengths refused before
anything trains, and (slow set) a quick run's document and table."""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from contextlib import redirect_stdout
from io import StringIO

import pytest
import torch

from prisme import cli
from prisme.data.mqar import make_mqar_batch
from prisme.data.text import IGNORE_INDEX
from prisme.model.prisme import PrismeModel
from prisme.studies.recall import plan_tasks
from prisme.studies.recall_context import (
    context_mqar,
    costlier_than_passing,
    decided_by_running,
    largest_window,
    planned_ops,
    recipe_at,
)
from prisme.studies.recall_frontier import DenseTask, FamilyTask, evaluate_dense, reference_ops
from prisme.studies.recall_setup import RecallStudyConfig, load_recipe
from prisme.studies.runner import Task, run_tasks


def study(**overrides) -> RecallStudyConfig:
    return RecallStudyConfig(**{"frontier": True, "quick": True, "seeds": [0], **overrides}).validate()


def test_every_query_lies_beyond_every_window_of_the_grid():
    """At each length the queries start after 2N + W_max, so no local model's window (t-W+1 .. t) holds the queried
    pair; the task keeps its vocabulary and pairs, with `context_queries` queries. Negative control: the recipe's own
    T = 32 layout puts queries inside a 64-position window."""
    cfg = study(contexts=[96, 256])
    recipe, _ = load_recipe(cfg)
    W = largest_window(cfg)
    assert W == 64
    for T in cfg.contexts:
        mcfg = context_mqar(cfg, recipe, T)
        x, y = make_mqar_batch(mcfg, 64, torch.Generator().manual_seed(T))
        pos = (y != IGNORE_INDEX).nonzero()[:, 1]
        last_pair = 2 * mcfg.n_pairs - 1
        assert x.shape == (64, T) and int((y != IGNORE_INDEX).sum(1).min()) == cfg.context_queries
        assert bool((pos - W + 1 > last_pair).all())  # the window of every query starts after the pairs
    x, y = make_mqar_batch(recipe.mqar, 64, torch.Generator().manual_seed(0))
    assert bool(((y != IGNORE_INDEX).nonzero()[:, 1] - W + 1 <= 2 * recipe.mqar.n_pairs - 1).all())


def test_each_length_plans_the_grid_in_its_own_folder_at_its_length(tmp_path):
    """Per length: every `context_dense` configuration and `context_family` member, in frontier/T{T}/, the model's
    T_max and every stage's task at that length, at `context_batch_size`; the windows and key shifts are the
    models' own; the controls run as always."""
    cfg = study(contexts=[96, 128], out_dir=str(tmp_path))
    recipe, _ = load_recipe(cfg)
    tasks = plan_tasks(cfg, recipe)
    n_dense = sum(len(b["depths"]) * len(b["widths"]) for b in cfg.context_dense)
    for T in (96, 128):
        mine = [t for t in tasks if getattr(t, "context", None) == T]
        dense = [t for t in mine if isinstance(t, DenseTask)]
        family = [t for t in mine if isinstance(t, FamilyTask)]
        assert len(dense) == n_dense and len(family) == 1  # quick: the first family member
        assert all(t.folder.startswith(str(tmp_path / "frontier" / f"T{T}")) for t in mine)
        assert all(t.model.max_seq_len == T and t.mqar.seq_len == T for t in mine)
        first = {t.stages[0].to_dict()["mqar"]["seq_len"] for t in mine} | {t.stages[0].batch_size for t in mine}
        assert first == {recipe.mqar.seq_len, recipe.backbone.batch_size}  # the warm-up: the recipe's stage 1
        s1, s2_short, *at_T = family[0].stages  # the warm-ups at the short task, then the stages at T
        assert (s1.stage, s2_short.stage, s2_short.mqar["seq_len"]) == ("backbone", "workspace", recipe.mqar.seq_len)
        assert s2_short.batch_size == recipe.workspace.batch_size and [s.stage for s in at_T] == ["workspace", "router"]
        # every dense model trains as long at the short task as PRISME's stages there together, then at T
        assert all(len(t.stages) == 2 for t in dense)
        assert all(t.stages[0] == s1.replace(steps=s1.steps + s2_short.steps) for t in dense)
        assert all(s.mqar["seq_len"] == T and s.batch_size == cfg.context_batch_size for t in dense
                   for s in t.stages[1:])
        assert all(s.mqar["seq_len"] == T and s.batch_size == cfg.context_batch_size for s in at_T)
        assert {(t.model.key_shift, t.model.attn_window) for t in dense} == {(False, None), (True, None),
                                                                            (False, 64), (True, 64)}
        assert family[0].model.attn_window == 64 and family[0].model.router and family[0].model.key_shift
        assert family[0].model.router_token and family[0].name == f"T{T}_d8_w32_ks_win64_tok"
    assert sum(t.kind == "control" for t in tasks) == 2
    full = RecallStudyConfig(frontier=True, seeds=[0], contexts=[96], out_dir=str(tmp_path)).validate()
    steps = {t.kind: [s.steps for s in t.stages] for t in plan_tasks(full, recipe) if getattr(t, "context", None)}
    w, w2 = full.context_warmup_steps, full.context_workspace_warmup  # the study's own step counts, not the quick ones
    assert steps == {"family": [w, w2, full.context_workspace_steps, recipe.router.steps],
                     "dense": [w + w2, full.context_frontier_steps]}
    assert full.context_frontier_steps >= full.context_workspace_steps + recipe.router.steps  # as long at T too
    alone = study(contexts=[96], out_dir=str(tmp_path), context_workspace_warmup=0)  # no workspace warm-up: the
    mine = [t for t in plan_tasks(alone, recipe) if getattr(t, "context", None) == 96]  # dense warm-up is the
    s1 = next(t for t in mine if t.kind == "family").stages[0]  # family's stage 1 itself, its stage 2 at T alone
    assert all(t.stages[0] == s1 and [s.mqar["seq_len"] for s in t.stages[1:]] == [96] * (
        1 if t.kind == "dense" else 2) for t in mine)
    cold = study(contexts=[96], out_dir=str(tmp_path), context_warmup=False,
                 context_workspace_warmup=0)  # every stage at T, dense in one
    for t in plan_tasks(cold, recipe):
        if getattr(t, "context", None) == 96:
            assert all(s.mqar["seq_len"] == 96 for s in t.stages) and len(t.stages) == (1 if t.kind == "dense" else 3)
    assert recipe_at(cfg, recipe, 96).router.mqar["query_min_pos"] == 2 * recipe.mqar.n_pairs + 64
    shifted = study(contexts=[96], out_dir=str(tmp_path), context_family=[[16, 32, 64, True]])  # a list entry
    family = [t for t in plan_tasks(shifted, recipe) if isinstance(t, FamilyTask)]
    assert [(t.model.key_shift, t.model.attn_window, t.name) for t in family] == [(True, 64, "T96_d16_w32_ks_win64")]
    assert family[0].folder.endswith("prisme_d16_w32_ks_win64_seed0") and not family[0].model.router_token
    tok = study(contexts=[96], out_dir=str(tmp_path), context_family=[[16, 32, 64, True]], family_router_token=True)
    family = [t for t in plan_tasks(tok, recipe) if isinstance(t, FamilyTask)]
    assert family[0].model.router_token and family[0].folder.endswith("prisme_d16_w32_ks_win64_tok_seed0")
    assert all(not t.model.router_token for t in plan_tasks(tok, recipe) if isinstance(t, DenseTask))
    named = study(contexts=[96], out_dir=str(tmp_path), family_router_token=True,  # an object entry: its own
                  context_family=[{"d": 8, "w": 32, "attn_window": 32, "router_token": False}])  # value wins
    family = [t for t in plan_tasks(named, recipe) if isinstance(t, FamilyTask)]
    assert [(t.model.d_model, t.model.attn_window, t.model.key_shift, t.model.router_token, t.name) for t in family] \
        == [(8, 32, False, False, "T96_d8_w32_win32")]


def entry(accuracy: float) -> dict:
    return {"entry": {"accuracy": accuracy}}


def searched(tasks: list, passing: dict[str, list[float]], order=None, rule=costlier_than_passing
             ) -> tuple[set[str], str | None, str | None]:
    """Run the search over fake dense runs (accuracy per seed from `passing` by configuration): (the runs it trained
    per configuration, the cheapest passing among them, the cheapest passing of the whole grid)."""
    cfg = tasks[0].study
    dense = [t for t in tasks if isinstance(t, DenseTask)] if order is None else order
    accuracy = {t.folder: passing.get(t.key, [0.0] * len(cfg.seeds))[cfg.seeds.index(t.seed)] for t in dense}
    jobs = [Task(t.folder, entry, (accuracy[t.folder],)) for t in dense]
    got = run_tasks(jobs, jobs=1, prune=rule(cfg, dense, [t.folder for t in dense]))
    ops = {t.key: planned_ops(t) for t in dense}

    def cheapest(ran):  # the cheapest configuration passing on 4 of 5 of the runs in `ran`
        ok = [t.key for t in dense if t.folder in ran
              and sum(accuracy[u.folder] >= 0.95 for u in dense if u.key == t.key and u.folder in ran) >= 4]
        return min(ok, key=ops.get, default=None)

    runs = collections.Counter(t.key for t in dense if t.folder in got)
    return dict(runs), cheapest(got), cheapest(accuracy)


def test_the_cheapest_search_trains_in_increasing_ops_and_finds_the_grids_cheapest_passing_configuration(tmp_path):
    """`context_search="cheapest"`: the dense runs are planned in increasing ops (after the PRISME family), their
    planned ops are what their evaluation measures, and the search stops above the first configuration that passes on
    4 of 5 seeds: it finds the whole grid's cheapest passing configuration, and every configuration it does not train
    costs more. One passing seed too few prunes nothing. The order only saves work: in another order the rule finds
    the same configuration. Negative control: a rule that stops the search at the first pass, in that order, finds a
    costlier one."""
    cfg = study(contexts=[96], out_dir=str(tmp_path), seeds=[0, 1, 2, 3, 4])
    recipe, _ = load_recipe(cfg)
    tasks = [t for t in plan_tasks(cfg, recipe) if getattr(t, "context", None) == 96]
    kinds = [isinstance(t, DenseTask) for t in tasks]
    assert kinds == sorted(kinds)  # the family first, then the dense runs
    dense = [t for t in tasks if isinstance(t, DenseTask)]
    ops = [planned_ops(t) for t in dense]
    assert ops == sorted(ops) and len({t.key for t in dense}) == len(dense) // 5
    small = dataclasses.replace(cfg, eval_sequences=8)
    model = PrismeModel(dense[0].model).eval()
    assert evaluate_dense(model, dense[0].mqar, 0, small)["ops_per_token"] == pytest.approx(ops[0], rel=1e-12)
    by_ops = sorted({t.key: o for t, o in zip(dense, ops)}.items(), key=lambda kv: kv[1])
    third, sixth, last = by_ops[2][0], by_ops[5][0], by_ops[-1][0]
    passing = {third: [0.96, 0.97, 0.2, 0.99, 0.95], last: [1.0] * 5}
    trained, found, best = searched(tasks, passing)
    assert found == best == third
    assert set(trained) == {k for k, _ in by_ops[:3]}  # one run at a time: nothing above the third is started
    _, found, best = searched(tasks, {third: [0.96, 0.97, 0.2, 0.99, 0.5], last: [1.0] * 5})  # 3 of 5: no pass
    assert found == best == last
    grid_order = sorted(dense, key=lambda t: [k for k, _ in by_ops].index(t.key) if t.key != sixth else -1)
    both = {third: [1.0] * 5, sixth: [1.0] * 5}
    trained, found, best = searched(tasks, both, order=grid_order)
    assert found == best == third and sixth in trained

    def first_pass(cfg, dense, folders):  # the bug: "something passed, stop"
        rule = costlier_than_passing(cfg, dense, folders)
        return lambda done: set(folders) if rule(done) else set()

    _, found, best = searched(tasks, both, order=grid_order, rule=first_pass)
    assert best == third and found == sixth  # the sixth ran first and passed: the third was never trained


def test_the_cheapest_search_defers_the_seeds_its_running_ones_may_decide(tmp_path):
    """`decided_by_running`: a configuration's seeds wait while its running ones, should they fail, would decide it
    (with 5 seeds, two below 95% do): none with one running and none failed; all the others with two running, or one
    failed and one running; a passed seed does not count. Negative control: without the rule the two-worker search
    trains a third seed of a configuration that fails its first two; with it, that worker trains the next one."""
    cfg = study(contexts=[96], out_dir=str(tmp_path), seeds=[0, 1, 2, 3, 4])
    recipe, _ = load_recipe(cfg)
    dense = [t for t in plan_tasks(cfg, recipe) if getattr(t, "context", None) == 96 and isinstance(t, DenseTask)]
    folders = [t.folder for t in dense]
    defer = decided_by_running(cfg, dense, folders)
    first = [t.folder for t in dense if t.key == dense[0].key]  # its five seeds, in seed order
    assert defer({}, {first[0]}) == set()
    assert defer({}, set(first[:2])) == set(first[2:])
    assert defer({first[0]: entry(0.5)}, {first[1]}) == set(first[2:])
    assert defer({first[0]: entry(0.99)}, {first[1]}) == set()
    second = [t.folder for t in dense if t.key == dense[5].key]
    slow = {f: 1.0 if f in second or f == first[1] else 0.2 if f == first[0] else 0.0 for f in folders}
    jobs = [Task(t.folder, result_after, (slow[t.folder],)) for t in dense[:12]]
    rule = costlier_than_passing(cfg, dense[:12], folders[:12])
    without = run_tasks(jobs, jobs=2, prune=rule)
    with_rule = run_tasks(jobs, jobs=2, prune=rule, defer=decided_by_running(cfg, dense[:12], folders[:12]))
    assert first[2] in without and first[2] not in with_rule and set(first[:2]) <= set(with_rule)


def result_after(seconds: float) -> dict:
    time.sleep(seconds)
    return entry(0.0)


def test_the_cheapest_search_stops_a_configuration_once_it_can_no_longer_pass(tmp_path):
    """A configuration with two seeds below 95% (of 5, 4 needed) is decided: its other seeds are not trained, and the
    search still finds the grid's cheapest passing configuration. One failed seed decides nothing: a configuration
    that fails its first seed and passes the other four is trained on all five and found. Negative control: a rule
    that gives up on a configuration at its first failed seed misses that one and finds a costlier one."""
    cfg = study(contexts=[96], out_dir=str(tmp_path), seeds=[0, 1, 2, 3, 4])
    recipe, _ = load_recipe(cfg)
    tasks = [t for t in plan_tasks(cfg, recipe) if getattr(t, "context", None) == 96]
    dense = [t for t in tasks if isinstance(t, DenseTask)]
    by_ops = sorted({t.key: planned_ops(t) for t in dense}.items(), key=lambda kv: kv[1])
    first, second, third = (k for k, _ in by_ops[:3])
    passing = {first: [0.99, 0.2, 0.3, 1.0, 1.0], second: [0.2, 1.0, 1.0, 1.0, 1.0], third: [1.0] * 5}
    runs, found, best = searched(tasks, passing)
    assert found == best == second
    assert runs == {first: 3, second: 5}  # the first is decided after its third seed (its second failure)

    def gives_up_early(cfg, dense, folders):  # the bug: one failed seed decides
        rule = costlier_than_passing(cfg, dense, folders)
        key = {f: t.key for f, t in zip(folders, dense)}

        def prune(done):
            failed = {key[f] for f in done if done[f]["entry"]["accuracy"] < 0.95}
            return rule(done) | {f for f in folders if f not in done and key[f] in failed}
        return prune

    runs, found, best = searched(tasks, passing, rule=gives_up_early)
    assert best == second and found == third and runs[second] == 1
    assert reference_ops(recipe_at(cfg, recipe, 96), 96) > 0


def test_the_winners_decode_side_by_side_with_their_decode_state_bytes(tmp_path):
    """`decode_speed` at a long context: tokens/s of both winners at batch 1 and 2, and each one's decode state at the
    whole sequence: the dense model's K/V cache is 2 x layers x B x kv heads x T x head dim x 4 bytes (float32); the
    PRISME model on a W-window backbone keeps a ring of W slots, so its state is its global twin's less
    2 x layers x B x kv heads x (T - W) x head dim x 4 (its bank is the same)."""
    from prisme.checkpoint import TrainingState, save_checkpoint
    from prisme.model.state import DecodeState
    from prisme.studies.recall_frontier import decode_speed, dense_config, family_config

    cfg = study(contexts=[96])
    recipe, _ = load_recipe(cfg)
    r = recipe_at(cfg, recipe, 96)
    models = {"dense": dense_config(r, 1, 8, key_shift=False), "prisme": family_config(r, 16, 32, 16)}
    picks = {}
    for k, c in models.items():
        torch.manual_seed(0)
        path = save_checkpoint(tmp_path / k, PrismeModel(c), TrainingState(stage="backbone", step=1))
        picks[f"{k}_best"] = {"checkpoints": [str(path)], "lambda": [0.05]}
    got = decode_speed({"verdict": picks}, r.mqar, batches=(1, 2), repeats=1)
    for B in (1, 2):
        assert set(got[f"batch{B}"]) == {"dense", "prisme", "prisme_ids"} and min(got[f"batch{B}"].values()) > 0
        d = models["dense"]
        mem = got[f"memory_batch{B}"]
        assert mem["dense"] == 2 * d.n_layer * B * d.n_kv_head * 96 * d.head_dim * 4
        p = models["prisme"]
        twin = DecodeState(PrismeModel(p.replace(attn_window=None)), B, 96).nbytes
        assert twin - mem["prisme"] == 2 * p.n_layer * B * p.n_kv_head * (96 - 16) * p.head_dim * 4
        ring = 2 * p.n_layer * B * p.n_kv_head * 16 * p.head_dim * 4
        grams = B * p.vocab_size ** p.router_ngram  # the router's table of the n-grams each row holds (bools)
        assert mem["prisme_ids"] == ring + B * 96 * 8 + grams  # the window's ring and the ids: no bank entries


@pytest.mark.parametrize("argv, msg", [
    (["--frontier", "--context", "5000"], "T_max"),
    (["--frontier", "--context", "70"], "cannot hold"),
    (["--frontier", "--context", "256,256"], "--context"),
    (["--frontier", "--context", "a,b"], "--context"),
    (["--context", "256"], "needs --frontier"),
])
def test_a_bad_context_is_a_one_line_error_before_anything_trains(tmp_path, capsys, argv, msg):
    """Over the preset's T_max, too short for the queries beyond the windows, repeated, not numbers, or without
    --frontier: exit 2 with a message naming it, and no study folder."""
    out = tmp_path / "s"
    assert cli.main(["study", "recall", "--quick", "--out", str(out), "--no-progress", *argv]) == 2
    assert msg in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("source, msg", [("missing", "holds no study"), ("around", "separate folders")])
def test_a_bad_reuse_is_a_one_line_error_before_the_study_is_recorded(tmp_path, capsys, source, msg):
    """`--reuse` of a folder holding no study, or of a study whose folder holds --out: exit 2 naming it, and nothing
    recorded or trained in --out; with --evaluate-only it is refused too."""
    from prisme.studies.runner import record_study

    record_study(tmp_path / "other", {"runs": {}})
    src = {"missing": tmp_path / "none", "around": tmp_path / "other"}[source]
    out = tmp_path / "other" / "s"
    argv = ["study", "recall", "--quick", "--frontier", "--out", str(out), "--no-progress", "--reuse", str(src)]
    assert cli.main(argv) == 2
    assert msg in capsys.readouterr().err
    assert not out.exists()
    assert cli.main([*argv, "--evaluate-only"]) == 2
    assert "--evaluate-only" in capsys.readouterr().err


@pytest.mark.slow  # about 40 s: `make test-slow` (and CI) run it
def test_a_quick_long_context_study_writes_each_length_and_the_ratio(tmp_path):
    """`--frontier --quick --context 96,128`: the document holds each length's task and frontier (its longest as
    `frontier`), the ratio per length and the plot; the table shows both lengths."""
    out = tmp_path / "c"
    buf = StringIO()
    with redirect_stdout(buf):
        rc = cli.main(["study", "recall", "--frontier", "--quick", "--context", "96,128", "--jobs", "1", "--out",
                       str(out), "--no-progress"])
    assert rc == 0
    text = buf.getvalue()
    doc = json.loads(text[text.index("\n{") + 1:])
    assert [c["T"] for c in doc["contexts"]] == [96, 128] and [r["T"] for r in doc["ratio_by_context"]] == [96, 128]
    assert doc["frontier"] == doc["contexts"][-1]["frontier"]
    for c in doc["contexts"]:
        assert c["task"]["seq_len"] == c["T"] and c["frontier"]["dense"] and c["frontier"]["prisme"]
    assert "T = 96" in text and "T = 128" in text and (out / "recall_context_ratio.png").stat().st_size > 0
    assert all((out / f"recall_frontier_T{T}.png").stat().st_size > 0 for T in (96, 128))
    assert all(c["search"] == "cheapest" and isinstance(c["not_trained"], list) for c in doc["contexts"])


def test_the_recorded_frontier_keeps_every_entry_the_cheapest_passing_of_each_family_and_their_ratio():
    """`frontier_reference` (what `prisme demo` reads): per length every entry in words with its accuracy per seed and
    ops, sorted by ops, the verdict's cheapest passing configuration of each family and the ratio, and how it was
    made."""
    from prisme.studies.recall_context import frontier_reference

    def e(L, d, ops, acc, ks=False, win=None, w=None):
        return {"n_layer": L, "d_model": d, "w": w, "key_shift": ks, "attn_window": win, "ops_ratio": ops,
                "accuracy": acc, "seeds": list(range(len(acc))), "seeds_at_95": sum(a >= 0.95 for a in acc),
                "passes": sum(a >= 0.95 for a in acc) >= 4}

    window = e(1, 16, 0.058, [0.03, 0.03], win=64)
    winner = e(1, 16, 0.177, [0.97] * 5, ks=True)
    prisme = e(1, 16, 0.082, [1.0, 0.97, 1.0, 0.99, 0.99], ks=True, win=64, w=32)
    frontier = {"dense": [window, winner], "prisme": [prisme],
                "verdict": {"dense_best": winner, "prisme_best": prisme, "ops_ratio_prisme_over_dense": 0.082 / 0.177}}
    doc = {"scored": {"seeds": [0, 1, 2, 3, 4]}, "contexts": [{"T": 1024, "frontier": frontier}]}
    ref = frontier_reference(doc, "prisme study recall --frontier --context 1024", "a CPU")
    (c,) = ref["contexts"]
    assert (ref["command"], ref["cpu"], ref["seeds"], c["T"]) == ("prisme study recall --frontier --context 1024",
                                                                  "a CPU", [0, 1, 2, 3, 4], 1024)
    assert [x["ops_ratio"] for x in c["entries"]] == [0.058, 0.082, 0.177]  # sorted by ops, both families
    assert [x["name"] for x in c["entries"]] == ["1 layer d=16, 64-window",
                                                  "d=16 w=32, 64-window backbone + key shift, router",
                                                  "1 layer d=16 + key shift, global attention"]
    assert c["dense_best"]["ops_ratio"] == 0.177 and c["prisme_best"]["family"] == "PRISME"
    assert c["ratio"] == 0.082 / 0.177 and c["entries"][0]["accuracy"] == [0.03, 0.03]
    assert c["prisme_best"]["member"] == {"d": 16, "w": 32, "attn_window": 64, "key_shift": True,
                                          "router_token": False} and "member" not in c["dense_best"]


def test_the_frontier_prints_each_decode_speed_as_time_per_token_over_the_dense_winners_beside_the_ops_ratio():
    """The printed verdict puts the measured time next to the ops it claims: per batch, each PRISME path's time per
    token over the dense winner's (dense tokens/s over its tokens/s) and the ops ratio."""
    from prisme.studies.recall_frontier import format_frontier

    verdict = {"dense_best": None, "prisme_best": None, "ops_ratio_prisme_over_dense": 0.45}
    doc = {"frontier": {"reference": {"ops_per_token": 1000.0}, "seeds_needed": 4, "dense": [], "prisme": [],
                        "verdict": verdict, "router": None},
           "decode_speed": {"batch1": {"dense": 2000.0, "prisme": 1000.0, "prisme_ids": 1600.0},
                            "memory_batch1": {"dense": 131072, "prisme": 278528, "prisme_ids": 16384}}}
    text = format_frontier(doc)
    assert "decode tokens/s, batch 1: dense 2,000, prisme 1,000, prisme_ids 1,600" in text
    assert "decode state dense 128 KiB, prisme 272 KiB, prisme_ids 16 KiB" in text
    assert "time per token over the dense winner's: prisme 2.00, prisme_ids 1.25 (ops 0.450)" in text
    assert "batch 8" not in text


def test_at_a_long_context_the_workspace_stage_trains_what_the_study_says_and_reuse_keeps_every_dense_run(tmp_path):
    """`context_backbone_trains`: the family's workspace stage at a long context keeps the backbone frozen by default
    (as at T = 32), or trains its token embedding ("embedding"). Changing it changes the family's runs alone, so a
    study rerun with `--reuse` copies every dense run and the controls and trains the family again. Negative control:
    a study whose long-context batch size changed copies only the controls (at T = 32)."""
    from prisme.studies.recall import study_settings
    from prisme.studies.runner import STUDY_DIR, record_study, reuse_runs

    def planned(out, **kw):
        cfg = study(contexts=[96], out_dir=str(out), **kw)
        recipe, _ = load_recipe(cfg)
        tasks = plan_tasks(cfg, recipe)
        return tasks, study_settings(cfg, tasks)

    tasks, old = planned(tmp_path / "old")
    fam = [t for t in tasks if isinstance(t, FamilyTask)]
    assert [s.train_backbone_in_workspace_stage for s in fam[0].stages] == [False, False, False, False]
    new_tasks, new = planned(tmp_path / "new", context_backbone_trains="embedding")
    fam = [t for t in new_tasks if isinstance(t, FamilyTask)]
    assert [s.stage for s in fam[0].stages] == ["backbone", "workspace", "workspace", "router"]  # short task, then T
    assert [s.train_backbone_in_workspace_stage for s in fam[0].stages] == [False, True, True, False]
    assert fam[0].stages[1].backbone_trains == fam[0].stages[2].backbone_trains == "embedding"
    t32 = plan_tasks(study(out_dir=str(tmp_path / "t32"), context_backbone_trains="embedding"),
                     load_recipe(study())[0])
    assert not any(s.train_backbone_in_workspace_stage for t in t32 if isinstance(t, FamilyTask) for s in t.stages)

    record_study(tmp_path / "old", old)
    done = [Task(t.folder, _finished, (t.folder,)) for t in tasks]
    run_tasks(done, jobs=1, store=tmp_path / "old" / STUDY_DIR / "done")
    record_study(tmp_path / "new", new)
    copied = set(reuse_runs(tmp_path / "old", tmp_path / "new", new, [t.folder for t in new_tasks]))
    assert copied == {t.folder for t in new_tasks if not isinstance(t, FamilyTask)} and len(copied) > 0
    other_tasks, other = planned(tmp_path / "other", context_batch_size=8)
    record_study(tmp_path / "other", other)
    copied = set(reuse_runs(tmp_path / "old", tmp_path / "other", other, [t.folder for t in other_tasks]))
    assert copied == {t.folder for t in other_tasks if not isinstance(t, (DenseTask, FamilyTask))} and copied


def _finished(folder: str) -> str:
    from pathlib import Path

    Path(folder).mkdir(parents=True)
    return folder


def _strip_training(doc):
    """A document or kept result as written before training compute was recorded."""
    from prisme.studies.recall_training import FIELDS

    if isinstance(doc, list):
        return [_strip_training(v) for v in doc]
    if not isinstance(doc, dict):
        return doc
    return {k: _strip_training(v) for k, v in doc.items() if not k.startswith("training_") and k not in FIELDS}


def test_a_tiny_long_context_study_records_training_compute_plots_it_and_older_folders_still_load(tmp_path):
    """Each run's result holds the analytic ops of every stage it trained (warm-ups at T = 32 included) and its
    logged training time x threads; each frontier entry per seed and their mean; the table a column of each; the
    training-compute plots beside the frontier's. A folder made before these fields (kept results and document
    stripped of them) prints ("-" in the columns), plots, resumes and re-scores (`--evaluate-only`) with the same
    training compute as the study that made it."""
    from prisme.studies.recall import run_study
    from prisme.studies.recall_report import format_table, plot_frontier
    from prisme.studies.recall_setup import study_config
    from prisme.studies.runner import STUDY_DIR
    from prisme.training.compute import stage_compute

    out = tmp_path / "s"
    settings = {"frontier": True, "quick": True, "seeds": [0], "jobs": 1, "out_dir": str(out), "contexts": [96],
                "context_dense": [{"depths": [1], "widths": [8]}], "confirm_seeds": [], "eval_sequences": 32,
                "calibration_sequences": 32, "router_lambdas": [0.01, 0.1]}
    cfg = study_config(settings)
    doc = run_study(cfg, progress=False)
    planned = {t.folder: t for t in plan_tasks(cfg, load_recipe(cfg)[0]) if isinstance(t, (DenseTask, FamilyTask))}
    kept = {json.loads(p.read_text())["task"]["folder"]: json.loads(p.read_text())["entry"]
            for p in (out / STUDY_DIR / "done").glob("*.json")}
    stages = {"dense": [("backbone", 32), ("backbone", 96)],
              "family": [("backbone", 32), ("workspace", 32), ("workspace", 96), ("router", 96)]}
    for folder, t in planned.items():
        e = kept[folder]
        assert [(s["stage"], s["seq_len"]) for s in e["training_stages"]] == stages[t.kind]
        assert e["training_ops"] == pytest.approx(sum(stage_compute(t.model, s).ops for s in t.stages), rel=1e-12)
        assert e["training_s"] > 0 and e["training_core_s"] == e["training_s"] * e["threads"] == e["training_s"]
    f = doc["frontier"]
    for e in f["dense"] + f["prisme"]:
        assert e["training_ops"] == e["training_ops_per_seed"][0] > 0 and len(e["training_ops_per_seed"]) == 1
        assert e["training_core_s"] == e["training_core_s_per_seed"][0] > 0
    assert f["prisme"][0]["training_ops"] > f["dense"][0]["training_ops"] and "training_ops_prisme_over_dense" in f
    text = format_table(doc)
    assert "train ops" in text and "core-s" in text and f"{f['dense'][0]['training_ops']:.3g}" in text
    assert all((out / name).stat().st_size > 0 for name in ("recall_frontier_training.png",
                                                            "recall_frontier_training_T96.png"))

    old = _strip_training(doc)  # an older folder: its document and its kept results without the fields
    assert "train ops" in format_table(old) and "training_ops" not in json.dumps(old)
    plot_frontier(old, tmp_path / "old.png", training=True)
    assert (tmp_path / "old.png").stat().st_size > 0
    for p in (out / STUDY_DIR / "done").glob("*.json"):
        p.write_text(json.dumps(_strip_training(json.loads(p.read_text()))))
    want = [(e["training_ops"], e["training_core_s"]) for e in f["dense"] + f["prisme"]]
    resumed = run_study(cfg, progress=False, resume=True)["frontier"]
    assert [(e["training_ops"], e["training_core_s"]) for e in resumed["dense"] + resumed["prisme"]] == want
    again = run_study(study_config({**settings, "evaluate_only": True}), progress=False)["frontier"]
    assert [(e["training_ops"], e["training_core_s"]) for e in again["dense"] + again["prisme"]] == want
    assert [e["accuracy"] for e in again["dense"] + again["prisme"]] == \
        [e["accuracy"] for e in f["dense"] + f["prisme"]]
