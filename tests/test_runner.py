"""The studies' worker pool (`prisme.studies.runner`): dependencies, priority, errors, and one pool for two studies."""

from __future__ import annotations

import math
import time

import pytest

from prisme.studies.pools import PoolOptions
from prisme.studies.runner import Task, check_tasks, prefixed, run_tasks, worker_count


def stamp(name: str, seconds: float) -> tuple[str, float, float]:
    """(name, start, end) after sleeping: when a task ran, as seen from another process."""
    start = time.time()
    time.sleep(seconds)
    return name, start, time.time()


def test_tasks_run_after_their_needs_and_the_first_listed_ready_task_first():
    order: list[str] = []
    tasks = [Task("eval", stamp, ("eval", 0), needs=("train", "baseline")), Task("train", stamp, ("train", 0)),
             Task("baseline", stamp, ("baseline", 0)), Task("late", stamp, ("late", 0), needs=("train",))]
    results = run_tasks(tasks, jobs=1, on_done=lambda t, r, s: order.append(t.name))
    assert order == ["train", "baseline", "eval", "late"]  # eval is listed before late: it goes first once ready
    assert set(results) == {"eval", "train", "baseline", "late"} and results["eval"][0] == "eval"


def test_two_workers_never_start_a_task_before_its_needs_finish():
    """Two processes: the slow need and the independent task run together; the dependent starts after its need ends,
    and the results equal the one-process run's."""
    tasks = [Task("slow", stamp, ("slow", 1.0)), Task("other", stamp, ("other", 0.2)),
             Task("after", stamp, ("after", 0), needs=("slow",))]
    got = run_tasks(tasks, jobs=2)
    assert got["after"][1] >= got["slow"][2]
    assert got["other"][1] < got["slow"][2]  # the two independent tasks overlapped
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in run_tasks(tasks, jobs=1).items()}


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failing_task_stops_the_run_and_its_error_is_raised(jobs):
    ran: list[str] = []
    tasks = [Task("bad", math.sqrt, (-1.0,)), Task("needs_bad", stamp, ("x", 0), needs=("bad",))]
    with pytest.raises(ValueError, match="math domain error"):
        run_tasks(tasks, jobs=jobs, on_done=lambda t, r, s: ran.append(t.name))
    assert ran == []


def test_bad_task_lists_are_refused_before_anything_runs():
    f = Task("a", stamp, ("a", 0))
    with pytest.raises(ValueError, match=r"repeated: \['a'\]"):
        check_tasks([f, f])
    with pytest.raises(ValueError, match=r"need \['missing'\]"):
        check_tasks([Task("a", stamp, ("a", 0), needs=("missing",))])
    with pytest.raises(ValueError, match="cycle"):
        run_tasks([Task("a", stamp, ("a", 0), needs=("b",)), Task("b", stamp, ("b", 0), needs=("a",))], jobs=1)


def test_prefixed_tasks_of_two_studies_share_one_pool():
    one = [Task("train", stamp, ("1", 0)), Task("eval", stamp, ("1e", 0), needs=("train",))]
    two = [Task("train", stamp, ("2", 0))]
    tasks = [prefixed(t, "a/") for t in one] + [prefixed(t, "b/") for t in two]
    assert [t.name for t in tasks] == ["a/train", "a/eval", "b/train"] and tasks[1].needs == ("a/train",)
    assert set(run_tasks(tasks, jobs=1)) == {"a/train", "a/eval", "b/train"}
    assert worker_count(0, 1) == 1 and worker_count(3, 10) == 3


def record_pid_and_sleep(path: str) -> None:
    import os
    import pathlib

    pathlib.Path(path).write_text(str(os.getpid()))
    time.sleep(120)


@pytest.mark.parametrize("guard", [True, False], ids=["die_with_parent", "negative_control"])
def test_killing_the_study_process_stops_its_workers(tmp_path, guard):
    """A study killed with SIGKILL (no cleanup of its own) leaves no worker running: each worker asked the kernel
    for SIGTERM when its parent dies (`die_with_parent`). Negative control: without it the workers go on, orphaned."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    tests, pid = str(Path(__file__).parent), str(tmp_path / "pid")
    off = "" if guard else "pools.die_with_parent = abs; "  # a picklable initializer that does nothing
    code = (f"import sys; sys.path.insert(0, {tests!r}); from test_runner import record_pid_and_sleep; "
            f"import prisme.studies.runner as runner, prisme.studies.pools as pools; {off}"
            f"runner.run_tasks([runner.Task(str(i), record_pid_and_sleep, ({pid!r} + str(i),)) for i in range(2)], "
            f"jobs=2)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    pids = []

    def running() -> list[int]:
        return [p for p in pids if Path(f"/proc/{p}").exists()
                and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"]

    try:
        deadline = time.time() + 60
        while len(pids) < 2 and time.time() < deadline:
            pids = [int(p.read_text()) for p in tmp_path.glob("pid*") if p.read_text()]
            time.sleep(0.2)
        assert len(pids) == 2
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.time() + (15 if guard else 3)
        while running() and time.time() < deadline:
            time.sleep(0.2)
        assert running() == ([] if guard else pids)
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass



def result(name: str, value: float, seconds: float = 0.0) -> dict:
    time.sleep(seconds)
    return {"name": name, "value": value}


def test_a_deferred_task_waits_for_the_running_ones_and_a_free_worker_takes_the_next():
    """`defer(results so far, running)`: with two workers, "a2" (whose need the running "a0" and "a1" decide) is
    started after "b0", and once both fail (while "b0" still runs), `prune` drops it: it never runs. It still runs
    when it is all that is left. Negative control: without `defer` the free worker starts "a2" as soon as "a0"
    ends."""
    tasks = [Task("a0", result, ("a0", 0.0, 0.1)), Task("a1", result, ("a1", 0.0, 1.0)),
             Task("a2", result, ("a2", 0.0)), Task("b0", result, ("b0", 0.0, 1.5))]  # b0 outlasts a1

    def prune(done):
        return {"a2"} if all(n in done and done[n]["value"] < 1 for n in ("a0", "a1")) else set()

    def defer(done, running):
        return {"a2"} if running & {"a0", "a1"} else set()

    assert set(run_tasks(tasks, jobs=2, prune=prune, defer=defer)) == {"a0", "a1", "b0"}
    assert set(run_tasks(tasks, jobs=2, prune=prune)) == {"a0", "a1", "a2", "b0"}  # started speculatively
    assert set(run_tasks(tasks[:3], jobs=2, defer=defer)) == {"a0", "a1", "a2"}  # nothing else ready: it runs
    # the workers are filled one task at a time: "a2" waits for a running "a0" even when both slots are free at once
    first = [Task("a0", result, ("a0", 0.0, 1.0)), Task("a2", result, ("a2", 0.0)),
             Task("b0", result, ("b0", 0.0, 1.5))]
    assert set(run_tasks(first, jobs=2, prune=lambda done: {"a2"} if "a0" in done else set(),
                         defer=lambda done, running: {"a2"} if "a0" in running else set())) == {"a0", "b0"}


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_pruned_task_is_not_started_and_neither_is_what_needs_it(jobs):
    """`prune(results so far)` names tasks no longer needed: once "cheap" returns a value over 1, "costly" (listed
    after it, not yet started: with two workers the first two run while it waits) and the task that needs it never
    run; "other" still does. Negative control: without `prune` every task runs."""
    tasks = [Task("cheap", result, ("cheap", 2.0)), Task("other", result, ("other", 0.0, 0.5 * (jobs - 1))),
             Task("costly", result, ("costly", 0.0)), Task("after_costly", result, ("after", 0.0), needs=("costly",))]

    def prune(done):
        return {"costly"} if done.get("cheap", {}).get("value", 0) > 1 else set()

    assert set(run_tasks(tasks, jobs=jobs, prune=prune)) == {"cheap", "other"}
    assert set(run_tasks(tasks, jobs=jobs)) == {"cheap", "costly", "after_costly", "other"}
    asked = []
    run_tasks(tasks, jobs=1, prune=lambda done: asked.append(set(done)) or set())
    assert asked[0] == set() and asked[-1] == {"cheap", "costly", "after_costly", "other"}  # before and after each


def test_a_study_recorded_before_a_config_field_existed_continues(tmp_path):
    """`open_study` compares the recorded settings with every model config completed by the fields added since
    (`config.ADDED_CONFIG_FIELDS`, at the values that reproduce the record): a record without `bank_key` continues.
    Negative controls: a record whose field differs (or whose added field is set to another value) is refused, naming
    it."""
    from prisme.config import PrismeConfig
    from prisme.studies.runner import open_study, record_study

    model = PrismeConfig.from_name("tiny").to_dict()
    now = {"runs": {"a": {"model": model, "steps": 10}}}
    old = {"runs": {"a": {"model": {k: v for k, v in model.items() if k != "bank_key"}, "steps": 10}}}
    record_study(tmp_path / "s", old)
    assert open_study(tmp_path / "s", now, resume=True)
    for changed in ({**model, "d_model": 64}, {**model, "bank_key": "preceding"}):
        with pytest.raises(ValueError, match="other settings .*runs.a"):
            open_study(tmp_path / "s", {"runs": {"a": {"model": changed, "steps": 10}}}, resume=True)


def test_a_study_recorded_before_decode_options_and_prices_left_the_config_continues(tmp_path):
    """A study recorded while PrismeConfig still held `bank_tables`, `bank_store`, `lambda_cost`, `kappa_risk` (each
    run's model config holds them, at their defaults, as every record did) continues with today's settings, which
    lack them, and `reuse_runs` copies its finished runs (`migrated` drops them where they changed nothing). Negative
    control: a record whose model held a price that changed something is refused naming the field, and not copied."""
    from prisme.config import MOVED_CONFIG_FIELDS, PrismeConfig
    from prisme.studies.runner import STUDY_DIR, open_study, record_study, reuse_runs

    model = PrismeConfig.from_name("tiny").to_dict()
    now = {"runs": {"a": {"model": model, "steps": 10}}}
    assert not set(MOVED_CONFIG_FIELDS) & set(model)
    for name, moved in (("before", MOVED_CONFIG_FIELDS), ("priced", {**MOVED_CONFIG_FIELDS, "lambda_cost": 0.1})):
        src = tmp_path / name
        record_study(src, {"runs": {"a": {"model": {**model, **moved}, "steps": 10}}})
        run_tasks([Task(str(src / "a"), make_run, (str(src / "a"),))], jobs=1, store=src / STUDY_DIR / "done")
        record_study(tmp_path / f"{name}_reused", now)
        copied = reuse_runs(src, tmp_path / f"{name}_reused", now, [str(tmp_path / f"{name}_reused" / "a")])
        if name == "before":
            assert open_study(src, now, resume=True)
            assert copied == [str(tmp_path / "before_reused" / "a")]
        else:
            with pytest.raises(ValueError, match="other settings .*runs.a.model.lambda_cost"):
                open_study(src, now, resume=True)
            assert copied == []


def make_run(folder: str) -> str:
    """A finished run's folder, as a study task leaves it."""
    from pathlib import Path

    Path(folder, "1_stage").mkdir(parents=True)
    Path(folder, "1_stage", "latest").write_text("ckpt_000010\n")
    return folder


def test_reuse_copies_exactly_the_finished_runs_that_trained_as_the_new_settings_would(tmp_path):
    """`reuse_runs`: a run of the source study is copied when its recorded entry equals the new one (paths read
    relative to each study folder) and its result was kept; the copy is the source's folder. Negative controls: a run
    whose stage config changed, one that never finished (no kept result) and one already in the new folder are not
    copied; a folder holding no study, or the study folder itself, is a ValueError."""
    from prisme.studies.runner import STUDY_DIR, record_study, reuse_runs, reused_runs

    src, dst = tmp_path / "old", tmp_path / "new"

    def entry(root, name, steps=10):
        return {"model": {"d_model": 16}, "stages": [{"steps": steps, "out_dir": f"{root}/{name}/1_stage"}]}

    names = ["same", "changed", "unfinished", "present"]
    record_study(src, {"runs": {n: entry(src, n) for n in names}})
    tasks = [Task(str(src / n), make_run, (str(src / n),)) for n in names if n != "unfinished"]
    run_tasks(tasks, jobs=1, store=src / STUDY_DIR / "done")
    make_run(str(src / "unfinished"))  # its folder exists, its result was never kept
    (src / "same" / "1_stage" / "metrics.jsonl").write_text("{}\n")
    new = {"runs": {**{n: entry(dst, n) for n in names}, "changed": entry(dst, "changed", steps=20)}}
    record_study(dst, new)
    (dst / "present").mkdir(parents=True)
    (dst / ".same.copying" / "1_stage").mkdir(parents=True)  # an interrupted copy: replaced, never taken as a run
    (dst / ".same.copying" / "1_stage" / "metrics.jsonl").write_text("half\n")
    copied = reuse_runs(src, dst, new, [str(dst / n) for n in names])
    assert not (dst / ".same.copying").exists()
    assert copied == [str(dst / "same")]
    assert (dst / "same" / "1_stage" / "metrics.jsonl").read_text() == "{}\n"
    assert not (dst / "changed").exists() and not (dst / "unfinished").exists()
    assert not (dst / "present" / "1_stage").exists()
    assert reused_runs(dst) == {str(dst / "same"): str(src)}
    assert reuse_runs(src, dst, new, [str(dst / n) for n in names]) == []  # a second call copies nothing more
    assert reused_runs(dst) == {str(dst / "same"): str(src)}
    with pytest.raises(ValueError, match="holds no study"):
        reuse_runs(tmp_path / "nothing", dst, new, [])
    with pytest.raises(ValueError, match="separate folders"):
        reuse_runs(dst, dst, new, [])


def test_a_study_recorded_before_a_stage_config_field_existed_continues(tmp_path):
    """`migrated` completes each recorded stage config with `ADDED_STAGE_FIELDS` at the values that reproduce it: a
    record without `backbone_trains` continues, and `reuse_runs` copies its runs. Negative control: a new stage that
    sets the added field to another value is refused (and not copied)."""
    from prisme.studies.runner import STUDY_DIR, open_study, record_study, reuse_runs
    from prisme.training.config import StageConfig

    stage = StageConfig(stage="workspace", steps=10).to_dict()
    old_stage = {k: v for k, v in stage.items() if k != "backbone_trains"}
    record_study(tmp_path / "s", {"runs": {"a": {"stages": [old_stage]}}})
    run_tasks([Task(str(tmp_path / "s" / "a"), make_run, (str(tmp_path / "s" / "a"),))], jobs=1,
              store=tmp_path / "s" / STUDY_DIR / "done")
    assert open_study(tmp_path / "s", {"runs": {"a": {"stages": [stage]}}}, resume=True)
    changed = {"runs": {"a": {"stages": [{**stage, "backbone_trains": "embedding"}]}}}
    with pytest.raises(ValueError, match="other settings .*runs.a"):
        open_study(tmp_path / "s", changed, resume=True)
    for name, now in (("same", {"runs": {"a": {"stages": [stage]}}}), ("other", changed)):
        record_study(tmp_path / name, now)
        copied = reuse_runs(tmp_path / "s", tmp_path / name, now, [str(tmp_path / name / "a")])
        assert copied == ([str(tmp_path / name / "a")] if name == "same" else [])


def test_nothing_imports_ray_unless_a_study_asks_for_it():
    """The package, its CLI and the studies' pools import without Ray; only `executor="ray"` imports it."""
    import subprocess
    import sys

    code = ("import sys, prisme, prisme.cli, prisme.studies.runner, prisme.studies.pools, prisme.studies.demo, "
            "prisme.studies.recall, prisme.studies.text; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_ray_executor_without_ray_installed_says_how_to_install_it(monkeypatch):
    """`PoolOptions("ray")` where Ray cannot be imported: a ValueError naming the extra, before any task runs; a local
    run of the same tasks does not need it (negative control)."""
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    ran: list[str] = []
    tasks = [Task("a", stamp, ("a", 0))]
    with pytest.raises(ValueError, match=r"pip install 'prisme\[ray\]'"):
        run_tasks(tasks, jobs=1, pool=PoolOptions("ray"), on_done=lambda t, r, s: ran.append(t.name))
    assert ran == []
    assert set(run_tasks(tasks, jobs=1, on_done=lambda t, r, s: ran.append(t.name))) == {"a"} and ran == ["a"]


def test_bad_executor_settings_are_refused_before_anything_runs(tmp_path):
    """An unknown executor, or a cluster address without `--executor ray`, is a ValueError naming it; nothing is
    written."""
    from prisme import cli

    with pytest.raises(ValueError, match="executor must be one of"):
        run_tasks([Task("a", stamp, ("a", 0))], pool=PoolOptions("slurm"))
    for argv in (["study", "recall", "--quick"], ["study", "text", "--scale", "0.01"]):
        args = cli.build_parser().parse_args([*argv, "--address", "auto", "--out", str(tmp_path / "x")])
        with pytest.raises(ValueError, match="needs executor 'ray'"):
            args.func(args)
    assert not (tmp_path / "x").exists()
