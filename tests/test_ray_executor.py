"""Studies on a Ray cluster (`--executor ray`, `studies/pools.py`): the same task graph as the local pool, the same
numbers, a failing task named and the study stopped, Ctrl-C cancelling the cluster's tasks and a rerun continuing.

The slow set (`make test-slow` installs the `ray` extra); `make test` never imports ray. One local cluster of 2 CPUs
for the module, which every driver here joins (`--address`): the study folder is on this machine's disk, the shared
filesystem of a one-node cluster.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

from prisme import cli  # noqa: E402
from prisme.studies.pools import PoolOptions  # noqa: E402
from prisme.studies.runner import Task, run_tasks  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs; its address (the tests' drivers join it)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    if started:
        ray.shutdown()


def _rows(out: Path) -> dict:
    """recall.json without what differs between two runs of the same study: times, where it ran, its folder."""
    doc = json.loads((out / "recall.json").read_text())

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("wall_s", "study")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x.replace(str(out), "<out>") if isinstance(x, str) else x

    return strip({k: doc[k] for k in ("controls", "seeds", "converged", "summary")})


def test_recall_quick_on_ray_gives_the_local_pools_rows(tmp_path, cluster):
    """`prisme study recall --quick --executor ray` on the cluster: every row as the local pool's on the same seed
    (same accuracies, ops and lambdas: each run is deterministic per seed), in the same --out layout."""
    local, remote = tmp_path / "local", tmp_path / "ray"
    base = ["study", "recall", "--quick", "--seeds", "0", "--jobs", "2", "--no-progress"]
    assert cli.main([*base, "--out", str(local)]) == 0
    assert cli.main([*base, "--out", str(remote), "--executor", "ray", "--address", cluster]) == 0
    assert _rows(remote) == _rows(local)
    assert sorted(p.name for p in remote.iterdir()) == sorted(p.name for p in local.iterdir())
    assert ray.is_initialized()  # the study left the cluster it joined as it found it


def test_a_failing_task_on_ray_is_named_and_stops_the_run(tmp_path, cluster):
    """The task's own exception (not Ray's wrapper) with a note naming the task; the task that needs it never runs,
    the finished one is kept in the store, the failed one is not."""
    store = tmp_path / "store"
    ran: list[str] = []
    tasks = [Task("fine", math.sqrt, (4.0,)), Task("bad", math.sqrt, (-1.0,), needs=("fine",)),
             Task("after_bad", math.sqrt, (9.0,), needs=("bad",))]
    with pytest.raises(ValueError, match="math domain error") as e:
        run_tasks(tasks, jobs=2, store=store, on_done=lambda t, r, s: ran.append(t.name),
                  pool=PoolOptions("ray", address=cluster))
    assert not isinstance(e.value, ray.exceptions.RayError)
    assert any("'bad'" in n for n in getattr(e.value, "__notes__", []))
    assert ran == ["fine"] and sorted(p.name for p in store.iterdir()) == ["fine.json"]


DRIVER = """
import os, pathlib, sys, time
from prisme.studies.runner import Task, run_tasks
from prisme.studies.pools import PoolOptions, StudyInterrupted
folder, address, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])


def sleep_in_steps(name):  # defined in __main__: Ray's workers get it by value
    pathlib.Path(folder, name + ".started").write_text(str(os.getpid()))
    try:
        t0 = time.time()
        while time.time() - t0 < seconds:
            time.sleep(0.05)
    except KeyboardInterrupt:
        pathlib.Path(folder, name + ".stopped").write_text(str(time.time() - t0))
        raise
    return name


long = [Task(f"long{i}", sleep_in_steps, (f"long{i}",), needs=("quick",)) for i in range(2)]
try:
    run_tasks([Task("quick", abs, (-1,)), *long], jobs=2, store=f"{folder}/store",
              pool=PoolOptions("ray", address))
except StudyInterrupted as e:
    print(e, file=sys.stderr)
    sys.exit(130)
"""


def test_ctrl_c_cancels_the_clusters_tasks_and_a_rerun_continues(tmp_path, cluster):
    """SIGINT to the driver while two tasks run on the cluster: each is interrupted there (a KeyboardInterrupt in its
    worker, as a training run's SIGINT: it saves and stops) long before its 120 s, the driver exits 130 naming
    --resume, the finished task is kept; rerun, the kept task is not run again and the others run. Negative control:
    before the signal the tasks run on, uninterrupted."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), cluster, "120"], env=env,
                              stderr=subprocess.PIPE, text=True)
    started = [tmp_path / f"long{i}.started" for i in range(2)]
    stopped = [tmp_path / f"long{i}.stopped" for i in range(2)]
    deadline = time.time() + 120
    while not all(p.is_file() for p in started) and time.time() < deadline:
        assert driver.poll() is None, driver.stderr.read()
        time.sleep(0.2)
    time.sleep(1.0)
    assert all(p.is_file() for p in started) and not any(p.exists() for p in stopped)  # negative control
    t0 = time.time()
    driver.send_signal(signal.SIGINT)
    _, err = driver.communicate(timeout=90)
    assert driver.returncode == 130 and "--resume" in err, err
    assert all(p.is_file() for p in stopped) and time.time() - t0 < 90
    assert max(float(p.read_text()) for p in stopped) < 100  # stopped by the signal, not by the end of its sleep
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["quick.json"]
    ran: list[str] = []
    got = run_tasks([Task("quick", abs, (-1,)), Task("long0", abs, (-2,), needs=("quick",)),
                     Task("long1", abs, (-3,), needs=("quick",))], jobs=2, store=tmp_path / "store",
                    on_done=lambda t, r, s: ran.append(t.name), pool=PoolOptions("ray", cluster))
    assert sorted(ran) == ["long0", "long1"] and got == {"quick": 1, "long0": 2, "long1": 3}
