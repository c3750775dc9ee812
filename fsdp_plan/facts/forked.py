"""Analysis passes that need nothing from each other, run at once in forked children.

[Note: passes in forked children]
A plan's facts come from several fake passes over the model (analysis.py): plain, every block
checkpointed, every block selectively checkpointed (at the plan's matmul stride and at
torchtitan's), and, for models whose parameters and gradients fit the budget, the plain step
under autocast as DDP computes it. Each is a FakeTensor forward and backward (about 0.9 s of
CPU for the depth-cut 70B shape on a 2-core machine), and none reads another's result: what a
selective pass adds is worked out from the plain pass after both ran, and it is kept only when
the checkpointed pass succeeded. So every pass but the plain one starts in a forked child (a
copy of the process with the model loaded) while the planner runs the plain pass, and each
child sends its pass's result back, pickled, through a pipe (issue 29; the figures are in
benchmarks/results/planning_speed_stop40.txt). ``--compile``'s selective trace of each block
class is forked too, once the plain trace has warmed Dynamo up (compiled.py ``trace_modes``).

A child never changes what a pass returns or raises, only when it is known. If anything goes
otherwise (no ``fork`` on this system, one CPU, threads alive in the process that a fork
would copy in the middle of whatever they do, ``FSDP_PLAN_SERIAL_PASSES`` set, a child that
raises, exits, is killed, hangs past its deadline or sends nothing readable), the planner runs
that pass itself, as it did before; a pass that failed in a child fails again in process with
its own exception and message. The child runs inside the planner's guard on user code
([Note: user code and the process]), so the model's ``os._exit`` there ends only the child; it
sends back the notes its pass added to the model's (a causal mask it could not recognise), and
ends with ``os._exit`` after flushing stderr (the model's prints), running no ``atexit``
handler of the planner's and writing none of its buffers. Children still running when the
analysis ends (an error in the plain pass, Ctrl-C) are killed and reaped.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fsdp_plan.model.user_process import end_child, end_planner_child, fork_planner_child

T = TypeVar("T")

SERIAL_ENV = "FSDP_PLAN_SERIAL_PASSES"
"""Set to anything but ``""``/``0`` to run every pass in the planner's process."""

_MIN_WAIT_S = 60.0
"""A child's result is waited for at least this long after the first one is asked for..."""
_WAIT_FACTOR = 10.0
"""...or this many times as long as the planner's own work took before it asked."""
_EXIT_WAIT_S = 5.0
"""How long a child that sent its result may take to exit before it is killed."""


def forking_allowed() -> bool:
    """Whether passes may run in forked children here ([Note: passes in forked children])."""
    if os.environ.get(SERIAL_ENV, "") not in ("", "0"):
        return False
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False  # macOS forks a process that has loaded torch's frameworks badly
    if threading.active_count() > 1:
        return False
    return len(os.sched_getaffinity(0)) > 1  # the CPUs this process may run on (Linux)


@dataclass
class _Child:
    pid: int
    fd: int


class ForkedPasses:
    """Passes started in forked children (``start``) and collected later (``result``), as a
    context manager that ends every child still running when it exits."""

    def __init__(self, notes: list[str], *, enabled: bool | None = None) -> None:
        self._notes = notes
        """The model's notes (``LoadedModel.notes``): a child's pass may add to its copy."""
        self._enabled = forking_allowed() if enabled is None else enabled
        self._children: dict[str, _Child] = {}
        self._started = 0.0
        self._deadline: float | None = None

    def __enter__(self) -> ForkedPasses:  # noqa: PYI034 (a final class)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in list(self._children):
            self._end(name)

    def start(self, name: str, run: Callable[[], Any]) -> None:
        """Start ``run`` in a forked child, when forking is allowed; else do nothing (``result``
        runs it then)."""
        if not self._enabled or name in self._children:
            return
        for stream in (sys.stdout, sys.stderr):  # the child must not write them again
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        try:
            read, write = os.pipe()
        except OSError:
            return
        try:
            pid = fork_planner_child()
        except OSError:
            os.close(read)
            os.close(write)
            return
        if pid == 0:  # the child: never returns
            os.close(read)
            _run_in_child(run, write, self._notes)
        os.close(write)
        if not self._children:
            self._started = time.monotonic()
        self._children[name] = _Child(pid=pid, fd=read)

    def result(self, name: str, run: Callable[[], T]) -> T:
        """What ``run`` returns (or raises): the child's result for ``name`` when it sent one,
        else ``run()`` here."""
        child = self._children.get(name)
        if child is not None:
            if self._deadline is None:
                waited = time.monotonic() - self._started
                self._deadline = time.monotonic() + max(_MIN_WAIT_S, _WAIT_FACTOR * waited)
            payload = _read_all(child.fd, self._deadline)
            # a whole payload is the child's last act: it exits at once (else it is killed)
            self._end(name, time.monotonic() + _EXIT_WAIT_S if payload else 0.0)
            sent = _unpickled(payload) if payload else None
            if sent is not None:
                value, notes = sent
                self._notes.extend(n for n in notes if n not in self._notes)
                return value
        return run()

    def _end(self, name: str, exit_by: float = 0.0) -> None:
        """Stop waiting for ``name``'s child: let it exit until ``exit_by``, then kill it if it
        still runs, and reap it."""
        child = self._children.pop(name)
        os.close(child.fd)
        end_child(child.pid, exit_by=exit_by)


def _unpickled(payload: bytes) -> tuple[Any, list[str]] | None:
    """A child's ``(result, notes)``, or None when the bytes are not one."""
    try:
        value, notes = pickle.loads(payload)
    except Exception:  # noqa: BLE001  (anything unreadable: the pass runs in process)
        return None
    return value, notes


def _read_all(fd: int, deadline: float) -> bytes | None:
    """Everything written to ``fd`` until its writer closes it, or None past ``deadline``
    (``poll``, not ``select``: a process with 1,024 files open has descriptors ``select``
    cannot watch)."""
    chunks = []
    waiting = select.poll()
    waiting.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:  # an interrupted poll or read is retried by Python itself (PEP 475)
            if not waiting.poll(max(1, int(left * 1000))):
                return None
            chunk = os.read(fd, 1 << 20)
        except OSError:
            return None
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _run_in_child(run: Callable[[], Any], fd: int, notes: list[str]) -> None:
    """The child's whole life: run the pass, write ``(result, notes)`` pickled to ``fd``, end
    with status 0; with 1 on anything else (the parent then runs the pass itself)."""
    code = 1
    try:
        payload = pickle.dumps((run(), list(notes)), protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        code = 0
    except BaseException:  # noqa: BLE001  (whatever it was, the parent runs the pass again)
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            os.close(fd)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        end_planner_child(code)
