"""Run one function on N local worker processes and notice, within a timeout, when one fails.

``launch(target, payload, nproc=N, timeout_s=T)`` starts N ``torch.multiprocessing`` processes
([Note: starting workers]) with the usual ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``
environment, so the target initialises its process group exactly as under ``torchrun``.
Each worker reports progress and its result through small files in a private folder; the
parent polls them, so it needs no process group of its own and never blocks on a dead peer.

[Note: failure detection]
- A worker whose target raises writes its traceback to ``rank{r}.error.json`` and exits 1.
  Any worker exiting non-zero ends the run: every other worker is killed by pid and the report
  names the rank whose error came FIRST (a crash makes its peers fail in their next collective
  a moment later, and those secondary errors must not hide the cause).
- A worker that dies without Python's help (signal, ``os._exit``) is reported by exit code.
- Rank 0 exits only after every other rank has left its result (``_wait_for_peers``): it
  hosts the store and its exit can strand a peer still finishing its last collective.
- A hang is a rank that has reported no progress for ``timeout_s`` seconds. Before its first
  report after imports, a rank gets ``max(timeout_s, startup_s)``: importing torch in N fresh
  processes on a busy machine takes tens of seconds and says nothing while it does.
  Before killing, the parent asks every live worker for its Python stack (``faulthandler`` on
  SIGUSR1) and names the ranks with the least progress, with the frame each one is stuck in.

[Note: starting workers]
A worker that starts fresh (``spawn``) imports torch, ``torch.distributed.fsdp`` (and with it
Dynamo) and fsdp-plan's measuring code before it does anything: about 4 s of CPU per rank on
this machine, 8 of the 2-rank bench of a tiny model. So where the platform has it, workers
start from ``multiprocessing``'s fork server: one process per launcher, started at its first
launch, that imports those modules once (``WORKER_PRELOAD``) and forks each worker from
itself. It is forked before any CUDA or process group exists and runs no threads, so its
children start as clean as spawned ones, with the launcher's ``sys.path`` and working
directory (``multiprocessing``'s preparation data) and, passed with each start, its current
environment (the fork server's own is the launcher's at the first launch). Every later launch
of the same process (``tune``'s rounds, the test suite) starts its workers in milliseconds.
Where there is no fork server (not on Linux or macOS) workers are spawned as before.

[Note: stopping]
- Each worker leads its own process group, so ending a worker ends whatever it started too
  (``os.killpg``), and asks the kernel to kill it when its parent dies
  (``PR_SET_PDEATHSIG``): a launcher killed with SIGKILL leaves no worker training on. (A
  worker's parent is the fork server where there is one, which is itself killed when its
  launcher dies: measure/fork_server.py.)
- SIGTERM, SIGHUP and SIGINT are held while a worker starts and let through once it is
  listed (``_start_whole``), so a signal never cuts its start-up pipe half-written (the
  worker would print an ``EOFError`` traceback) and ``kill_all`` knows every worker.
- ``stop_on_signals()`` turns SIGTERM and SIGHUP into ``Terminated`` (as Python turns SIGINT
  into ``KeyboardInterrupt``), so ``launch`` kills its workers and every ``finally`` and
  ``with`` removes its temporary folder before the command exits with 128 + the signal.
  Further signals are ignored while that cleanup runs.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fsdp_plan.common.autocast import float32_autocast_as_on_cuda
from fsdp_plan.common.errors import BadInput, CheckFailed, Stop
from fsdp_plan.common.limits import MAX_WORLD_SIZE
from fsdp_plan.common.safe_yaml import clip
from fsdp_plan.common.torch_warnings import artefacts_hidden
from fsdp_plan.measure.fork_server import die_with_parent
from fsdp_plan.model.user_process import end_forked_children

FAULT_ENV = "FSDP_PLAN_BENCH_FAULT"
"""Test-only fault injection: ``crash:rank=1:step=2``, ``hang:rank=1:step=2`` or ``exit:...``."""

_POLL_S = 0.05


@dataclass(kw_only=True)
class RankFailure:
    """What went wrong on one rank."""

    rank: int
    kind: str
    """``error`` (Python exception), ``exit`` (died with a code or signal) or ``hang``."""
    error: str
    """One line: the exception's last line, the exit code, or where the rank is stuck."""
    detail: str = ""
    """The full traceback or stack dump, for ``--debug`` and the report's tail."""
    last_progress: dict[str, Any] = field(default_factory=dict)


class WorkersFailed(CheckFailed):
    """A worker crashed or hung; carries every rank's failure, the cause first."""

    def __init__(self, message: str, failures: list[RankFailure]) -> None:
        super().__init__(message)
        self.failures = failures


@dataclass(kw_only=True)
class WorkerContext:
    """Handed to the target in each worker: who it is and how to report progress."""

    rank: int
    world_size: int
    local_rank: int
    workdir: str | None = None
    """The launcher's private folder (``None`` under torchrun)."""
    reports: int = 0
    """How many progress reports this rank made: the hang report's measure of progress."""

    def report(self, **progress: Any) -> None:
        """Record progress (e.g. ``phase="step", step=3, steps=20``); the parent prints rank 0's."""
        self.reports += 1
        if self.workdir is None:
            return
        progress.update(time=time.time(), order=self.reports)
        _atomic_json(_rank_file(self.workdir, self.rank, "progress.json"), progress)


class Terminated(Stop):
    """SIGTERM or SIGHUP arrived (see [Note: stopping]); a ``BaseException`` so that no
    ``except Exception`` in library code swallows it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        """``128 + signal``, what a shell reports for a process the signal ended (143, 129)."""
        return 128 + self.signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_HELD_SIGNALS = (*STOP_SIGNALS, signal.SIGINT)
"""Held while a worker starts (``_start_whole``)."""


@contextlib.contextmanager
def stop_on_signals(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Raise ``Terminated`` in the main thread on ``signals`` while the block runs; later
    signals (and SIGINT) are ignored once one arrived, so cleanup is not cut short. Handlers
    are restored on exit. Does nothing outside the main thread (signals go to it alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    watched = (*signals, signal.SIGINT)

    def handler(signum: int, frame: object) -> None:
        for sig in watched:
            signal.signal(sig, signal.SIG_IGN)
        raise Terminated(signum)

    previous = {sig: signal.getsignal(sig) for sig in watched}
    for sig in signals:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for each worker, and what ``init_process_group`` reads."""
_TORCHRUN_HINT = ("start the worker under torchrun (torchrun --nproc-per-node 2 -m "
                  "fsdp_plan.cli.bench_worker PLAN.yaml), which sets "
                  + ", ".join(TORCHRUN_VARIABLES) + "; on one machine, fsdp-plan bench PLAN.yaml "
                  "starts the workers itself")


def context_from_env(environ: Mapping[str, str] | None = None) -> WorkerContext:
    """The context of a worker started by ``torchrun``, its environment checked first: every
    variable of ``TORCHRUN_VARIABLES`` set, numbers in ASCII digits, ``0 <= RANK <
    WORLD_SIZE``. Otherwise ``BadInput`` naming the variable (issue 21, S3-17: ``WORLD_SIZE=abc``
    was a traceback and ``RANK=5 WORLD_SIZE=2`` waited forever for peers that never come)."""
    env = os.environ if environ is None else environ
    missing = [name for name in TORCHRUN_VARIABLES if not env.get(name, "").strip()]
    if missing:
        raise BadInput(f"this worker's environment lacks {', '.join(missing)}: it runs one rank "
                       f"of a benchmark and finds its peers through them. To fix, "
                       f"{_TORCHRUN_HINT}.")

    def whole(name: str, low: int, high: int) -> int:
        text = env[name].strip()
        if not re.fullmatch(r"[0-9]{1,10}", text):
            raise BadInput(f"{name}={clip(text)!r} in this worker's environment is not a whole "
                           f"number from {low} to {high}; {_TORCHRUN_HINT}.")
        value = int(text)
        if not low <= value <= high:
            raise BadInput(f"{name}={value} in this worker's environment is outside {low}.."
                           f"{high}; {_TORCHRUN_HINT}.")
        return value
    world_size = whole("WORLD_SIZE", 1, MAX_WORLD_SIZE)
    rank = whole("RANK", 0, world_size - 1)
    local_rank = whole("LOCAL_RANK", 0, world_size - 1)
    whole("MASTER_PORT", 1, 65535)
    return WorkerContext(rank=rank, world_size=world_size, local_rank=local_rank)


def maybe_inject_fault(rank: int, step: int) -> None:
    """Test hook: crash, hang or exit on ``rank`` at ``step`` when ``FSDP_PLAN_BENCH_FAULT`` says so."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    kind, *fields = spec.split(":")
    opts = dict(f.split("=", 1) for f in fields if "=" in f)
    if int(opts.get("rank", -1)) != rank or int(opts.get("step", -1)) != step:
        return
    if kind == "crash":
        raise RuntimeError(f"injected fault: rank {rank} crashed at step {step} ({FAULT_ENV})")
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "exit":
        os._exit(int(opts.get("code", 3)))


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_file(workdir: str, rank: int, kind: str) -> str:
    """Where rank ``rank`` leaves its ``kind`` file (``progress.json``, ``result.json``,
    ``error.json``, ``stack.txt``) for the parent to read."""
    return os.path.join(workdir, f"rank{rank}.{kind}")


def _atomic_json(path: str, data: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, default=str)
    os.replace(tmp, path)


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _die_with_parent(launcher_pid: int) -> int:
    """Lead a process group of our own and be killed when our parent dies (Linux): the
    launcher, or the fork server that dies with it ([Note: starting workers]). Returns the
    parent's pid."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    parent = die_with_parent()
    if not _alive(launcher_pid):  # the launcher died before the fork server's rule took hold
        os._exit(1)
    return parent


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, owned by another user
        return True
    return True


WORKER_PRELOAD = ("fsdp_plan.measure.fork_server", "torch", "torch.distributed",
                  "torch.distributed.fsdp", "torch.distributed._tools", "fsdp_plan.measure.launch",
                  "fsdp_plan.bench.worker", "fsdp_plan.bench.timing",
                  "fsdp_plan.measure.collectives", "fsdp_plan.measure.ddp",
                  "fsdp_plan.measure.calibrate")
"""What the fork server imports once for every worker it forks ([Note: starting workers]):
first measure/fork_server.py (the server dies with its launcher), then torch's distributed and
FSDP code and the workers' own modules (one that fails to import is left to the worker, as
``multiprocessing`` does)."""


def _worker_context() -> Any:
    """``torch.multiprocessing``'s fork server context where the platform has one (its
    preload set before its first start), else spawn ([Note: starting workers])."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(WORKER_PRELOAD))
    return ctx


def _child_main(rank: int, nproc: int, port: int, target: str, payload: Any, workdir: str,
                parent_pid: int | None = None, environ: Mapping[str, str] | None = None
                ) -> None:
    """Entry point of each worker: environment, stack dumps on SIGUSR1, run, report.
    ``environ``: the launcher's environment when the worker started ([Note: starting
    workers])."""
    import faulthandler

    if environ is not None and dict(os.environ) != dict(environ):
        os.environ.clear()
        os.environ.update(environ)
    if parent_pid is not None:
        parent_pid = _die_with_parent(parent_pid)
    # The parent's stdout is its report (--format json must stay one document): whatever the
    # model or torch prints in a worker goes to stderr.
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = WorkerContext(rank=rank, world_size=nproc, local_rank=rank, workdir=workdir)
    ctx.report(phase="started")
    stack_file = open(_rank_file(workdir, rank, "stack.txt"), "w")  # noqa: SIM115
    stack_file.write(f"{_MAIN_THREAD}{threading.get_ident():#x}\n")
    stack_file.flush()
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        module_name, _, func_name = target.partition(":")
        # a CPU worker computes a model's float32 regions as a GPU does, as the plan analysed
        # them ([Note: float32 autocast regions] in common/autocast.py), and prints no warning
        # of the measuring machinery ([Note: warnings of the planner's passes])
        with float32_autocast_as_on_cuda(), artefacts_hidden():
            result = getattr(importlib.import_module(module_name), func_name)(ctx, payload)
        _atomic_json(_rank_file(workdir, rank, "result.json"), result)
    except BaseException as e:  # noqa: BLE001 - report everything, KeyboardInterrupt included
        lines = traceback.format_exception_only(type(e), e)
        _atomic_json(_rank_file(workdir, rank, "error.json"), {
            "time": time.time(), "error": (lines[-1] if lines else repr(e)).strip(),
            "traceback": traceback.format_exc()})
        stack_file.flush()
        end_forked_children()
        os._exit(1)  # skip atexit/process-group teardown, which can block on dead peers
    stack_file.flush()
    if rank == 0:
        _wait_for_peers(workdir, nproc, parent_pid)
    end_forked_children()  # a child the model forked does not outlive its worker
    os._exit(0)


def _wait_for_peers(workdir: str, nproc: int, parent_pid: int | None) -> None:
    """Rank 0 leaves last: it waits until every other rank has left its result or error file.

    Rank 0 hosts the TCPStore and one end of every gloo pair. A peer still in the target's
    last collective or in ``destroy_process_group`` when rank 0 exits can lose the message it
    was reading with the closed socket and wait forever: CI saw rank 1 hang after "done" (its
    result never written) while rank 0 had returned and exited. The wait needs no limit of its
    own: a peer that hangs or dies without a file is the parent's to notice, and the parent
    then kills every worker; if the parent itself is gone, rank 0 stops waiting."""
    pending = set(range(1, nproc))
    while pending and (parent_pid is None or os.getppid() == parent_pid):
        pending = {r for r in pending
                   if not any(os.path.exists(_rank_file(workdir, r, kind))
                              for kind in ("result.json", "error.json"))}
        if pending:
            time.sleep(_POLL_S)


_MAIN_THREAD = "main thread "
"""The first line of a worker's stack file, before any dump: its main thread's id, in hex."""


def _stuck_frame(stack_text: str) -> str:
    """The innermost frame of the main thread in a faulthandler dump (``file:line in func``).

    The signal is handled by whichever thread the kernel picks, often one of gloo's, so the
    dump's "Current thread" need not be the main one: the main thread is the block headed by
    the id the worker wrote first (``_MAIN_THREAD``). Before that line existed a hang in a
    C++ destructor read "stuck at unknown frame": the first block was another Python thread's,
    with no frame."""
    head, _, dump = stack_text.partition("\n")
    main_id = None
    if head.startswith(_MAIN_THREAD):
        main_id = int(head[len(_MAIN_THREAD):], 16)
    else:
        dump = stack_text
    blocks = [b for b in dump.split("\n\n") if "most recent call first" in b]
    if main_id is not None:
        blocks = [b for b in blocks if _thread_id(b) == main_id] or blocks
    for block in blocks:
        for line in block.splitlines():
            line = line.strip()
            if line.startswith("File "):
                return line.replace("File ", "", 1)
    return "unknown frame"


def _thread_id(block: str) -> int | None:
    """The thread id heading a faulthandler dump block (``Thread 0x... (most recent ...``)."""
    match = re.search(r"[Tt]hread (0x[0-9a-fA-F]+)", block)
    return int(match.group(1), 16) if match else None


class _Run:
    """The state of one launch: the processes, their folder and the failure analysis."""

    def __init__(self, nproc: int, timeout_s: float, workdir: str, startup_s: float = 0.0) -> None:
        self.nproc, self.timeout_s, self.workdir = nproc, timeout_s, workdir
        self.startup_s = max(timeout_s, startup_s)
        self.procs: list[Any] = []
        self.killed: set[int] = set()
        self.last_seen: dict[int, tuple[float, Any]] = {}

    def allowed(self, progress: dict[str, Any]) -> float:
        """Seconds of silence allowed after ``progress`` (more while still importing)."""
        return self.startup_s if progress.get("phase", "started") == "started" else self.timeout_s

    def progress(self, rank: int) -> dict[str, Any]:
        return _read_json(_rank_file(self.workdir, rank, "progress.json")) or {}

    def kill_all(self) -> None:
        """End every live worker and its process group (SIGKILL), then reap it."""
        for p in self.procs:
            if p.pid is None or p.pid in self.killed:
                continue
            self.killed.add(p.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # the worker leads its group: see [Note: stopping]
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)  # not yet its own group leader
        for p in self.procs:
            p.join(timeout=10)

    def crashed(self) -> list[RankFailure]:
        failures = []
        for rank, p in enumerate(self.procs):
            if p.exitcode in (None, 0):
                continue
            err = _read_json(_rank_file(self.workdir, rank, "error.json"))
            if err:
                failures.append(RankFailure(rank=rank, kind="error", error=err["error"],
                                            detail=err["traceback"],
                                            last_progress=self.progress(rank)))
                failures[-1].last_progress["error_time"] = err["time"]
            else:
                code = p.exitcode
                what = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                failures.append(RankFailure(rank=rank, kind="exit", last_progress=self.progress(rank),
                                            error=f"{what} without a Python error"))
        # The cause first: the earliest Python error, then deaths without one.
        failures.sort(key=lambda f: (f.kind != "exit", f.last_progress.get("error_time", 0.0)))
        return failures

    def hung(self) -> list[RankFailure]:
        """Ranks silent for ``timeout_s``, with their stacks; least progress first."""
        live = [r for r, p in enumerate(self.procs) if p.exitcode is None]
        for rank in live:
            try:
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        failures = []
        for rank in live:
            try:
                with open(_rank_file(self.workdir, rank, "stack.txt")) as f:
                    stack = f.read()
            except OSError:
                stack = ""
            prog = self.progress(rank)
            failures.append(RankFailure(
                rank=rank, kind="hang", detail=stack, last_progress=prog,
                error=f"no progress for {self.allowed(prog):g} s after {_describe(prog)}; "
                      f"stuck at {_stuck_frame(stack)}"))
        failures.sort(key=lambda f: _progress_key(f.last_progress))
        return failures


def _describe(progress: dict[str, Any]) -> str:
    if not progress:
        return "start-up"
    phase = progress.get("phase", "?")
    if "step" in progress:
        return f"{phase} {progress['step']}/{progress.get('steps', '?')}"
    return str(phase)


def _progress_key(progress: dict[str, Any]) -> tuple[int, float]:
    return (int(progress.get("order", 0)), float(progress.get("time", 0.0)))


def launch(target: str, payload: Any, *, nproc: int, timeout_s: float = 300.0,
           startup_s: float = 180.0, on_progress: Callable[[int, dict[str, Any]], None] | None = None) -> list[Any]:
    """Run ``target`` (``"package.module:function"``, called as ``fn(ctx, payload)``) on ``nproc``
    workers ([Note: starting workers]); return each rank's (JSON) result in rank order.

    ``on_progress(rank, progress)`` is called whenever a rank reports something new.
    Raises ``WorkersFailed`` (exit code 1) naming the failing rank and its error when a worker
    raises, dies, or reports no progress for ``timeout_s`` seconds (``startup_s`` while it
    imports, see [Note: failure detection]); all workers are then killed.
    """
    ctx = _worker_context()
    with tempfile.TemporaryDirectory(prefix="fsdp-plan-workers-") as workdir:
        run = _Run(nproc, timeout_s, workdir, startup_s)
        port = free_port()
        start = time.time()
        try:
            for rank in range(nproc):
                p = ctx.Process(target=_child_main, args=(rank, nproc, port, target, payload,
                                                          workdir, os.getpid(),
                                                          dict(os.environ)),
                                daemon=True, name=f"fsdp-plan-rank{rank}")
                _start_whole(p, run.procs)
            while True:
                time.sleep(_POLL_S)
                now = time.time()
                for rank in range(nproc):
                    prog = run.progress(rank)
                    stamp = prog.get("time", start)
                    if run.last_seen.get(rank, (None,))[0] != stamp:
                        run.last_seen[rank] = (stamp, now)
                        if prog and on_progress is not None:
                            on_progress(rank, prog)
                failures = run.crashed()
                if failures:
                    run.kill_all()
                    raise WorkersFailed(_failure_message(failures), failures)
                if all(p.exitcode == 0 for p in run.procs):
                    break
                silent = [r for r, p in enumerate(run.procs) if p.exitcode is None
                          and now - run.last_seen.get(r, (None, start))[1]
                          > run.allowed(run.progress(r))]
                if silent:
                    failures = run.hung()
                    run.kill_all()
                    raise WorkersFailed(_failure_message(failures), failures)
        except BaseException:
            run.kill_all()
            raise
        results = []
        for rank in range(nproc):
            result = _read_json(_rank_file(workdir, rank, "result.json"))
            if result is None:
                raise WorkersFailed(f"rank {rank} exited cleanly but left no result.",
                                    [RankFailure(rank=rank, kind="exit", error="no result file")])
            results.append(result)
        return results


def _start_whole(process: Any, started: list[Any]) -> None:
    """Start ``process`` with the stopping signals held until it is in ``started`` ([Note:
    stopping]): a signal that arrived while ``start`` was writing the worker's pickled
    payload closed the pipe half-written, and the new worker, not yet listed for
    ``kill_all``, printed an ``EOFError`` traceback after the command's last words (issue 31,
    S4-13). A signal that arrives meanwhile is recorded, then handed to the handler that was
    in place (``Terminated``, ``KeyboardInterrupt``, or the default action) once the worker
    is listed. (Python runs signal handlers in the main thread, so this holds however many
    threads torch started; a thread mask would not.)"""
    if threading.current_thread() is not threading.main_thread():
        process.start()
        started.append(process)
        return
    arrived: list[int] = []

    def hold(signum: int, frame: object) -> None:
        arrived.append(signum)
    previous = {sig: signal.signal(sig, hold) for sig in _HELD_SIGNALS}
    try:
        process.start()
        started.append(process)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if arrived:
        handler = previous[arrived[0]]
        if callable(handler):
            handler(arrived[0], None)  # raises Terminated or KeyboardInterrupt
        elif handler != signal.SIG_IGN:
            os.kill(os.getpid(), arrived[0])  # the default action, now that it is listed


def _failure_message(failures: list[RankFailure]) -> str:
    first = failures[0]
    if first.kind == "hang":
        head = (f"rank {first.rank} hung: {first.error}. All workers were killed.")
    else:
        head = (f"rank {first.rank} failed (last progress: {_describe(first.last_progress)}): "
                f"{first.error}. All workers were killed.")
    others = [f"rank {f.rank}: {f.error}" for f in failures[1:]]
    if others:
        head += " Then: " + "; ".join(others[:3]) + ("; ..." if len(others) > 3 else "") + "."
    return head
