"""One worker pool for the studies: named tasks with dependencies, over `jobs` processes.

A task starts as soon as everything it needs has finished and a worker is free; among the ready tasks the one listed
first goes first (list the long chains first and the workers finish together). With `jobs` = 1 every task runs in
this process, in that order. The recall study, the text study and `prisme demo` (both studies in one pool, so that
one study's tasks fill the other's idle workers) run through `run_tasks`.

    tasks = [Task("backbone", train, (cfg,)), Task("eval", evaluate, (cfg,), needs=("backbone",))]
    results = run_tasks(tasks, jobs=2)  # {"backbone": ..., "eval": ...}
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    """`fn(*args)` in a worker process (so `fn` is a module-level function and `args` pickle), after `needs`."""

    name: str
    fn: Callable[..., Any]
    args: tuple = ()
    needs: tuple[str, ...] = ()


def prefixed(task: Task, prefix: str) -> Task:
    """The task renamed `prefix + name`, its needs too: several studies' tasks in one pool."""
    return Task(prefix + task.name, task.fn, task.args, tuple(prefix + n for n in task.needs))


def check_tasks(tasks: Sequence[Task]) -> None:
    """ValueError for a repeated name, a need that is not a task, or needs that form a cycle (nothing would run)."""
    names = [t.name for t in tasks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"task names must be distinct, repeated: {repeated}")
    unknown = sorted({n for t in tasks for n in t.needs if n not in names})
    if unknown:
        raise ValueError(f"tasks need {unknown}, which are not tasks")
    done: set[str] = set()
    left = list(tasks)
    while left:
        ready = [t for t in left if all(n in done for n in t.needs)]
        if not ready:
            raise ValueError(f"the needs of {sorted(t.name for t in left)} form a cycle")
        done.update(t.name for t in ready)
        left = [t for t in left if t.name not in done]


def die_with_parent(parent: int) -> None:
    """Worker initializer: on Linux the worker gets SIGTERM when the process that started it dies, however it dies
    (`prctl(PR_SET_PDEATHSIG)`), so a killed study leaves no orphan runs behind (a training run saves a checkpoint on
    SIGTERM and exits)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def worker_count(jobs: int, n_tasks: int) -> int:
    """Worker processes for `n_tasks`: `jobs`, or one per CPU core when 0, and never more than the tasks."""
    return max(1, min(jobs or (os.cpu_count() or 1), n_tasks))


def run_tasks(tasks: Sequence[Task], jobs: int = 0,
              on_done: Callable[[Task, Any, float], None] | None = None) -> dict[str, Any]:
    """Run every task (`jobs` worker processes, 0 = one per core); returns {name: result}. `on_done(task, result,
    seconds since the start)` runs in this process as each task finishes. A task that raises stops the run: the tasks
    not started are cancelled, and its exception is raised once the running ones have finished. An interrupt (Ctrl-C,
    or this process exiting) sends SIGTERM to the running tasks' workers: a training run saves and exits."""
    check_tasks(tasks)
    t0 = time.perf_counter()
    done: dict[str, Any] = {}
    jobs = worker_count(jobs, len(tasks))

    def ready() -> list[Task]:
        return [t for t in tasks if t.name not in done and t.name not in running.values()
                and all(n in done for n in t.needs)]

    running: dict[cf.Future, str] = {}
    if jobs == 1:
        while len(done) < len(tasks):
            task = ready()[0]
            done[task.name] = task.fn(*task.args)
            if on_done is not None:
                on_done(task, done[task.name], time.perf_counter() - t0)
        return done
    by_name = {t.name: t for t in tasks}
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        try:
            while len(done) < len(tasks):
                for task in ready()[:jobs - len(running)]:
                    running[pool.submit(task.fn, *task.args)] = task.name
                finished, _ = cf.wait(list(running), return_when=cf.FIRST_COMPLETED)
                for f in finished:
                    name = running.pop(f)
                    done[name] = f.result()
                    if on_done is not None:
                        on_done(by_name[name], done[name], time.perf_counter() - t0)
        except Exception:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        except BaseException:  # KeyboardInterrupt, SystemExit: stop the workers too
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return done
