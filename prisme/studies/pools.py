"""Where a study's tasks run: `LocalPool`, worker processes of this machine (the default), or `RayPool`, Ray tasks on
a cluster (`--executor ray`). Both take one task at a time (`submit(task)`: a `concurrent.futures.Future` of
`task.fn(*task.args)`), give its result (`result`), pass a stop signal on to every running task (`interrupt`: a
training run saves and stops), and close (`shutdown`, or `kill` at once). The study's side of a signal
(`stop_on_signals`, `StudyInterrupted`) lives here too; `runner.run_tasks` drives either pool.

With Ray, the study folder must be on a filesystem that every node mounts at the same path (a single machine's
disk, NFS, ...): each task runs in the driver's working folder and writes its checkpoints there, and the driver keeps
the results in the study folder as with the local pool. A node where that folder does not exist fails the task with
a message that says so.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


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


class StudyInterrupted(KeyboardInterrupt):
    """A study stopped by SIGINT or SIGTERM (`signal` names it) once every running task had saved."""

    def __init__(self, signal_name: str = "SIGINT", message: str = ""):
        super().__init__(signal_name, message)
        self.signal = signal_name

    def __str__(self) -> str:
        return self.args[1] or f"{self.signal}: the study stopped"


RESUME_NOTE = ("every running task saved first; nothing was scored from an interrupted stage. Rerun the same command "
               "(the same settings and --out) with --resume to continue from what finished")
_POOLS: list[Any] = []  # the worker pools running in this process (a second signal goes on to their workers)
_WORKER: dict[str, Any] = {"busy": False, "stopped": None, "parent": None}  # in a worker: running a task; the stop
#   signal it got while idle; the study's pid


def _forward(signum: int) -> None:
    """Pass a signal on to every task of every running pool."""
    for pool in _POOLS:
        pool.interrupt(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """In the study's process: the first SIGINT or SIGTERM raises `StudyInterrupted` where the process is (a training
    run's own handler, `train_stage`'s, stops it at the step boundary and saves instead); a later one is passed on to
    the workers, which then stop at once. Nothing changes outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    state: dict[str, str | None] = {"signal": None}

    def handler(signum, frame):
        if state["signal"] is None:
            state["signal"] = signal.Signals(signum).name
            raise StudyInterrupted(state["signal"])
        _forward(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _worker_init(parent: int, guard: Callable[[int], Any]) -> None:
    """Worker initializer: `guard` (`die_with_parent`), a process group of its own (a terminal's Ctrl-C reaches the
    study, which passes it on once), and SIGINT / SIGTERM stopping the task it runs (`StudyInterrupted`; a training
    run saves first), or, while idle, the next task it is given."""
    guard(parent)
    _WORKER["parent"] = parent
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if _WORKER["busy"]:
            raise StudyInterrupted(name)
        if os.getppid() != parent:  # the study is gone (`die_with_parent`): nothing runs, nothing to save
            os._exit(128 + signum)
        _WORKER["stopped"] = name

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handler)


def _call(fn: Callable[..., Any], args: tuple) -> Any:
    """A task in a worker: not started once the worker was told to stop."""
    if _WORKER["stopped"]:
        raise StudyInterrupted(_WORKER["stopped"])
    _WORKER["busy"] = True
    try:
        return fn(*args)
    finally:
        _WORKER["busy"] = False
        if _WORKER.get("parent") not in (None, os.getppid()):  # the study died while this task ran (and saved)
            os._exit(128 + signal.SIGTERM)


class LocalPool:
    """`slots` worker processes of this machine (spawned, each in a process group of its own, `_worker_init`): the
    default executor."""

    def __init__(self, slots: int):
        self.slots = slots
        self._pool = cf.ProcessPoolExecutor(max_workers=slots, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_worker_init, initargs=(os.getpid(), die_with_parent))

    def submit(self, task: Any) -> cf.Future:
        return self._pool.submit(_call, task.fn, task.args)

    def result(self, future: cf.Future) -> Any:
        return future.result()

    def interrupt(self, signum: int) -> None:
        """The signal to every worker: a running task stops (a training run saves first), an idle one starts none."""
        for proc in list(getattr(self._pool, "_processes", {}).values()):
            with contextlib.suppress(ProcessLookupError, OSError):
                os.kill(proc.pid, signum)

    def shutdown(self) -> None:
        """Wait for the running tasks; the others are cancelled."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def kill(self) -> None:
        """Stop every worker at once."""
        for proc in list(getattr(self._pool, "_processes", {}).values()):
            proc.terminate()
        self.shutdown()


EXECUTORS = ("local", "ray")  # this machine's worker processes, or a Ray cluster
RAY_HINT = "pip install 'prisme[ray]'"


def check_executor(executor: Any, address: Any, need: Callable[[bool, str], None]) -> None:
    """A study's `executor` is one of `EXECUTORS`; an `address` goes with "ray"."""
    need(executor in EXECUTORS, f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    need(address is None or (executor == "ray" and isinstance(address, str) and address.strip() != ""),
         f"an address ({address!r}) names a Ray cluster: it needs executor 'ray'")


@dataclass(frozen=True)
class PoolOptions:
    """Where `runner.run_tasks` runs a study's tasks: this machine's worker processes ("local"), or Ray tasks ("ray")
    on the cluster at `address` (None: a local one, or the one `ray.init` already joined), each asking for `cpus`
    CPUs. Checked here, once: an unknown executor, or an address without "ray", is a ValueError."""

    executor: str = "local"  # one of `EXECUTORS`
    address: str | None = None  # a Ray cluster's address; only with executor "ray"
    cpus: int = 1  # CPUs each Ray task asks for

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.address is not None and self.executor != "ray":
            raise ValueError(f"an address ({self.address!r}) is for a Ray cluster: pass executor 'ray' with it")


def pool_options(cfg: Any) -> PoolOptions:
    """`runner.run_tasks`'s `pool` from a study config's `executor`, `address` and `threads`."""
    return PoolOptions(cfg.executor, cfg.address, cfg.threads)


def task_device(executor: str, i: int) -> str:
    """The device of a study's i-th task: on the local pool round-robin over this machine's GPUs (`devices.spread`);
    on Ray "auto" (each task is given a GPU of its own where the cluster has them)."""
    from prisme.devices import spread

    return spread(i) if executor == "local" else "auto"


def in_folder(cwd: str, fn: Callable[..., Any], args: tuple) -> Any:
    """A Ray task: `fn(*args)` in the driver's working folder `cwd` (a shared filesystem, at the same path)."""
    if not os.path.isdir(cwd):
        raise FileNotFoundError(f"--executor ray: the study's working folder {cwd} does not exist on node "
                                f"{socket.gethostname()}; every node must mount the study folder's filesystem at the "
                                f"same path")
    os.chdir(cwd)
    return fn(*args)


class RayPool:
    """Ray tasks on the cluster at `address` (None: the cluster this process already joined with `ray.init`, else
    `RAY_ADDRESS`'s, else a new local one), at most `jobs` at a time (0: as many as the cluster has CPUs for), each
    asking for `cpus` CPUs and, where the cluster has GPUs, one GPU. No task is retried (a failure stops the study as
    on the local pool); `interrupt` cancels the running tasks (Ray delivers SIGINT: a training run saves first)."""

    def __init__(self, jobs: int, n_tasks: int, address: str | None = None, cpus: int = 1):
        try:
            import ray
        except ImportError:
            raise ValueError(f"--executor ray needs Ray installed: {RAY_HINT}") from None
        self._ray = ray
        self._joined = not ray.is_initialized()
        if self._joined:
            ray.init(address=address, include_dashboard=False, logging_level="WARNING")
        resources = ray.cluster_resources()
        gpus = 1 if resources.get("GPU", 0) >= 1 else 0
        self.slots = max(1, min(jobs or int(resources.get("CPU", 1) // cpus), n_tasks))
        self._remote = ray.remote(in_folder)
        self._options = {"num_cpus": cpus, "num_gpus": gpus, "max_retries": 0}
        self._cwd = os.getcwd()
        self._refs: dict[cf.Future, Any] = {}
        self._interrupted = False

    def submit(self, task: Any) -> cf.Future:
        ref = self._remote.options(name=task.name, **self._options).remote(self._cwd, task.fn, task.args)
        future = ref.future()
        self._refs[future] = ref
        return future

    def result(self, future: cf.Future) -> Any:
        """The task's result; its own exception (not Ray's wrapper), with the remote traceback as a note."""
        self._refs.pop(future, None)
        try:
            return future.result()
        except self._ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if not isinstance(cause, Exception):
                raise
            if hasattr(cause, "add_note"):
                cause.add_note(f"on the Ray cluster:\n{e}")
            raise cause from None

    def interrupt(self, signum: int) -> None:
        """Cancel every running task: Ray raises KeyboardInterrupt in the task's Python code as SIGINT would (a
        training run saves at its step boundary and stops; a task inside one long C call notices when the call
        returns). A second call kills the tasks' workers at once."""
        for future, ref in list(self._refs.items()):
            if not future.done():
                with contextlib.suppress(Exception):
                    self._ray.cancel(ref, force=self._interrupted)
        self._interrupted = True

    def shutdown(self) -> None:
        """Cancel what has not finished (after a failed task the others stop at their next step and save, where the
        local pool lets its running tasks finish), wait for it to end, and leave the cluster this pool joined."""
        for future, ref in list(self._refs.items()):
            if not future.done():
                with contextlib.suppress(Exception):
                    self._ray.cancel(ref)
        cf.wait(list(self._refs))
        self._refs.clear()
        if self._joined and self._ray.is_initialized():
            self._ray.shutdown()

    def kill(self) -> None:
        """Cancel every task at once (its worker is killed)."""
        for ref in list(self._refs.values()):
            with contextlib.suppress(Exception):
                self._ray.cancel(ref, force=True)
        self.shutdown()
