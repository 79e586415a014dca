"""One worker pool for the studies: named tasks with dependencies, over `jobs` processes.

A task starts as soon as everything it needs has finished and a worker is free; among the ready tasks the one listed
first goes first (list the long chains first and the workers finish together). With `jobs` = 1 every task runs in
this process, in that order. The recall study, the text study and `prisme demo` (both studies in one pool, so that
one study's tasks fill the other's idle workers) run through `run_tasks`.

    tasks = [Task("backbone", train, (cfg,)), Task("eval", evaluate, (cfg,), needs=("backbone",))]
    results = run_tasks(tasks, jobs=2)  # {"backbone": ..., "eval": ...}

A study stops on SIGINT or SIGTERM (`stop_on_signals`): the signal goes on to every worker (each in its own process
group, so a terminal's Ctrl-C reaches the study alone and the study passes it on once), a training run finishes its
step and saves, and once every running task has ended `StudyInterrupted` is raised (`prisme` exits 130 / 143). A task
whose training was interrupted raises it too (`train_stage_once`): nothing is scored from an interrupted stage. With a
`store` (`records.record_study`), every finished task's result is kept in the study folder, and a rerun with the same
settings continues from what finished: the kept tasks are not run again, an interrupted stage resumes from its
checkpoint.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prisme.io import write_text_atomic
from prisme.studies.pools import _POOLS, RESUME_NOTE, LocalPool, PoolOptions, StudyInterrupted, stop_on_signals
from prisme.studies.records import (  # noqa: F401 - the folder's record, where the studies' callers found it
    STUDY_DIR,
    differences,
    migrated,
    open_study,
    record_study,
    recorded_study,
    reuse_runs,
    reused_runs,
    store_path,
)


@dataclass(frozen=True)
class Task:
    """`fn(*args)` in a worker process (so `fn` is a module-level function and `args` pickle), after `needs`; and
    after `after`, each finished or dropped (`run_tasks(prune=...)`): an order alone, for a task whose plan the
    others' results decide (a dropped need drops the task; a dropped `after` does not)."""

    name: str
    fn: Callable[..., Any]
    args: tuple = ()
    needs: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


def prefixed(task: Task, prefix: str) -> Task:
    """The task renamed `prefix + name`, its needs too: several studies' tasks in one pool."""
    return Task(prefix + task.name, task.fn, task.args, tuple(prefix + n for n in task.needs),
                tuple(prefix + n for n in task.after))


def check_tasks(tasks: Sequence[Task]) -> None:
    """ValueError for a repeated name, a need (or `after`) that is not a task, or needs that form a cycle (nothing
    would run)."""
    names = [t.name for t in tasks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"task names must be distinct, repeated: {repeated}")
    unknown = sorted({n for t in tasks for n in (*t.needs, *t.after) if n not in names})
    if unknown:
        raise ValueError(f"tasks need {unknown}, which are not tasks")
    done: set[str] = set()
    left = list(tasks)
    while left:
        ready = [t for t in left if all(n in done for n in (*t.needs, *t.after))]
        if not ready:
            raise ValueError(f"the needs of {sorted(t.name for t in left)} form a cycle")
        done.update(t.name for t in ready)
        left = [t for t in left if t.name not in done]


def _named(err: BaseException, name: str) -> None:
    """Note on a task's exception which task raised it (the traceback's last lines)."""
    if hasattr(err, "add_note"):
        err.add_note(f"(raised by the study's task {name!r}; its finished runs are kept: fix it and rerun the same "
                     f"command to continue)")


def train_stage_once(model_cfg: Any, scfg: Any, **kw: Any) -> Any:
    """`train_stage` in a study: a stage that finished in `scfg.out_dir` before (its checkpoint at `scfg.steps`, not
    saved by an interrupt) is not trained again, its result read back; an interrupted one resumes from its checkpoint;
    one that stopped before its first save starts again. Raises `StudyInterrupted` when the stage is interrupted: no
    score is computed from it."""
    from prisme import checkpoint as ckpt
    from prisme.training.resume import run_contents
    from prisme.training.trainer import TrainResult, train_stage

    out = Path(scfg.out_dir)
    found = ckpt.latest_checkpoint(out)
    if found is not None:
        meta = ckpt.read_meta(found)
        if scfg.spec.owns(meta.stage) and meta.step >= scfg.steps and not meta.metrics.get("interrupted"):
            return TrainResult(stage=scfg.stage, out_dir=out, checkpoint=found, step=meta.step, tokens=0,
                               train=meta.metrics.get("train") or {}, val=meta.metrics.get("val") or {}, wall_s=0.0)
        scfg = scfg.replace(resume=True)
    elif run_contents(out):
        scfg = scfg.replace(overwrite=True)
    res = train_stage(model_cfg, scfg, **kw)
    if res.interrupted:
        raise StudyInterrupted(res.signal or "SIGINT")
    return res


def _kept(result: Any, store: Path | None, name: str) -> Any:
    """`result` as the store keeps it (written there, and read back: a rerun gets exactly what this run got)."""
    if store is None:
        return result
    text = json.dumps(result, default=str)
    write_text_atomic(store_path(store, name), text + "\n")
    return json.loads(text)


def worker_count(jobs: int, n_tasks: int) -> int:
    """Worker processes for `n_tasks`: `jobs`, or one per CPU core when 0, and never more than the tasks."""
    return max(1, min(jobs or (os.cpu_count() or 1), n_tasks))


def stored_results(store: Path, tasks: Sequence[Task]) -> dict[str, Any]:
    """The results `store` (`record_study`) keeps of `tasks`, by name: those an earlier run finished."""
    return {t.name: json.loads(store_path(store, t.name).read_text()) for t in tasks
            if store_path(store, t.name).is_file()}


def run_tasks(tasks: Sequence[Task], jobs: int = 0,
              on_done: Callable[[Task, Any, float], None] | None = None, store: str | Path | None = None,
              resumed: bool = False, prune: Callable[[dict[str, Any]], Iterable[str]] | None = None,
              defer: Callable[[dict[str, Any], set[str]], Iterable[str]] | None = None,
              pool: PoolOptions | None = None) -> dict[str, Any]:
    """Run every task (`jobs` worker processes, 0 = one per core); returns {name: result}. `on_done(task, result,
    seconds since the start)` runs in this process as each task finishes. A task that raises stops the run: the tasks
    not started are cancelled, and its exception is raised once the running ones have finished. SIGINT or SIGTERM
    (`stop_on_signals`), or a task stopped by one, stops every task and raises `StudyInterrupted` once they have
    ended. `store` (`record_study`): each result is kept there, and the tasks kept by an earlier run are not run;
    `resumed`: the study is continued (a note on stderr says what is kept). `prune(results so far)`: the names of tasks
    no longer needed, asked after each result: those not started are not run (and have no result); tasks are started
    in list order, so a search orders its tasks cheapest first. `defer(results so far, names running)`: ready tasks to
    start after the other ready ones (work the running tasks' results may make unnecessary); they still start when
    nothing else is ready. `pool` (`PoolOptions`, default: this machine's worker processes): with executor "ray" the
    tasks run as Ray tasks (`pools.RayPool`) on the cluster at its `address` (None: a local one, or the one `ray.init`
    already joined), `jobs` at a time (0: as many as the cluster has CPUs for), each asking for its `cpus` CPUs; the
    task's exception raised here names the task that failed."""
    check_tasks(tasks)
    pool = pool if pool is not None else PoolOptions()
    t0 = time.perf_counter()
    store = Path(store) if store is not None else None
    done: dict[str, Any] = stored_results(store, tasks) if store is not None else {}
    if resumed:
        print(f"continuing the study in {store.parent.parent if store else '?'}: {len(done)} of {len(tasks)} tasks "
              f"had finished and are kept; interrupted stages resume from their checkpoints", file=sys.stderr,
              flush=True)
    running: dict[cf.Future, str] = {}
    dropped: set[str] = set()

    def drop() -> None:
        if prune is not None:
            dropped.update(n for n in prune(done) if n not in done and n not in running.values())
            grew = True
            while grew:  # a task that needs a dropped one is dropped too
                more = {t.name for t in tasks if t.name not in dropped and set(t.needs) & dropped}
                grew = bool(more)
                dropped.update(more)

    def ready() -> list[Task]:
        out = [t for t in tasks if t.name not in done and t.name not in running.values() and t.name not in dropped
               and all(n in done for n in t.needs) and all(n in done or n in dropped for n in t.after)]
        later = set(defer(done, set(running.values()))) if defer is not None and len(out) > 1 else set()
        return [t for t in out if t.name not in later] + [t for t in out if t.name in later]

    def left_to_run() -> bool:
        return len(done) + len(dropped) < len(tasks)

    def finish(task: Task, result: Any) -> None:
        done[task.name] = _kept(result, store, task.name)
        drop()
        if on_done is not None:
            on_done(task, done[task.name], time.perf_counter() - t0)

    drop()

    left = [t for t in tasks if t.name not in done and t.name not in dropped]
    workers: Any = None
    if pool.executor == "ray" and left:  # before our signal handlers: connecting to Ray installs its own
        from prisme.studies.pools import RayPool

        workers = RayPool(jobs, len(left), address=pool.address, cpus=pool.cpus)
    with stop_on_signals():
        if workers is None and (worker_count(jobs, len(left)) == 1 or not left):
            try:
                while left_to_run():
                    task = ready()[0]
                    try:
                        result = task.fn(*task.args)
                    except Exception as err:
                        _named(err, task.name)
                        raise
                    finish(task, result)
            except StudyInterrupted as e:
                raise StudyInterrupted(e.signal, f"{e.signal}: the study stopped; {RESUME_NOTE}") from None
            return done
        workers = workers or LocalPool(worker_count(jobs, len(left)))
        by_name = {t.name: t for t in tasks}
        _POOLS.append(workers)
        try:
            while left_to_run():
                while len(running) < workers.slots and (now := ready()):  # one at a time: `defer` sees each start
                    running[workers.submit(now[0])] = now[0].name
                finished, _ = cf.wait(list(running), return_when=cf.FIRST_COMPLETED)
                for f in finished:
                    name = running.pop(f)
                    try:
                        result = workers.result(f)
                    except StudyInterrupted:
                        raise
                    except Exception as err:
                        _named(err, name)
                        raise
                    finish(by_name[name], result)
        except StudyInterrupted as e:  # this process's signal, or a task a signal stopped: stop them all
            workers.interrupt(getattr(signal, e.signal, signal.SIGINT))
            for f in cf.as_completed(list(running)):  # every running task saves and ends
                if not f.cancelled() and f.exception() is None:
                    finish(by_name[running[f]], f.result())
            workers.shutdown()
            raise StudyInterrupted(e.signal, f"{e.signal}: the study stopped; {RESUME_NOTE}") from None
        except Exception:
            workers.shutdown()
            raise
        except BaseException:  # SystemExit, or a KeyboardInterrupt of another kind: stop the workers too
            workers.kill()
            raise
        finally:
            _POOLS.remove(workers)
            workers.shutdown()
    return done
