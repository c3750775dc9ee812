"""Analysis passes that need nothing from each other, run at once in forked children.

[Note: passes in forked children]
A plan's facts come from several fake passes over the model (analysis.py): plain, every block
checkpointed, every block selectively checkpointed (at the plan's matmul stride and at
torchtitan's), and, for models whose parameters and gradients fit the budget, the plain step
under autocast as DDP computes it. Each is a FakeTensor forward and backward (about 0.9 s of
CPU for the depth-cut 70B shape on a 2-core machine), and none reads another's result: what a
selective pass adds is worked out from the plain pass after both ran, and it is kept only when
the checkpointed pass succeeded. So the passes after the plain one are shared out with forked
children (copies of the process with the model loaded; one per spare CPU, [Note: a child per
spare CPU]) that run while the planner runs the plain pass, and each child sends each pass's
result back, pickled, as soon as it is done (at the model's full depth: [Note: who expands
a forked pass] in analysis.py) (issue 29; the figures are in
benchmarks/results/planning_speed_stop40.txt and _stop41.txt; [Note: results beside the
pipe]). ``--compile``'s selective trace
of each block class is forked too, once the plain trace has warmed Dynamo up (compiled.py
``trace_modes``), and so are the HTML page's frontier budgets (search/frontier.py [Note: the
page's budgets beside the planner]).

A child never changes what a pass returns or raises, only when it is known. If anything goes
otherwise (no ``fork`` on this system, one CPU, threads alive in the process that a fork
would copy in the middle of whatever they do, ``FSDP_PLAN_SERIAL_PASSES`` set, a pass that
raises in a child or returns what cannot be pickled, a child that exits, is killed, hangs past
its deadline or sends nothing readable), the planner runs that pass (and those the child did
not send) itself, as it did before; a pass that failed in a child fails again in process with
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
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fsdp_plan.common.collector import cycle_collector_paused
from fsdp_plan.model.user_process import end_child, end_planner_child, fork_planner_child

T = TypeVar("T")

SERIAL_ENV = "FSDP_PLAN_SERIAL_PASSES"
"""Set to anything but ``""``/``0`` to run every pass (and every budget of the page's frontier,
search/frontier.py) in the planner's process."""

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


def spare_cpus() -> int:
    """CPUs this process may run on beside the one the planner uses (Linux affinity)."""
    return len(os.sched_getaffinity(0)) - 1


def shares(passes: int, spare: int, *, planner_busy: bool = False) -> tuple[int, list[int]]:
    """How ``passes`` passes (in the order the planner asks for them) are shared out with
    ``spare`` CPUs beside the planner's: how many of the first ones the planner runs itself
    after its own (the plain pass), and how many of the rest each child runs, in turn.
    ``planner_busy``: the planner has work of its own meanwhile and no pass of its own
    (``--compile``'s block traces: [Note: eager passes beside the compiled traces] in
    analysis.py), so the children take every pass.

    [Note: a child per spare CPU]
    A child's pass costs about 1.5 times its CPU in process (copy-on-write faults as Python
    touches the parent's objects) and its result must be unpickled by the planner, so more
    processes than CPUs only add work: five passes in four children on two CPUs planned the
    10,006-module model 1.7 s slower than one process. So there is one child per spare CPU at
    most, and the ``passes + 1`` passes (the plain one too) are split into that many shares
    plus the planner's: the planner takes the first passes it asks for (it runs them while
    the children run the later ones, which are done or nearly so when it asks), the children
    the rest, a contiguous run each, sending each result as soon as it is done."""
    children = max(0, min(spare, passes))
    if children == 0:
        return passes, []
    own = 0 if planner_busy else -(-(passes + 1) // (children + 1)) - 1
    # ceil((passes + 1) / processes) - plain, when the planner runs the plain pass
    each, extra = divmod(passes - own, children)
    return own, [each + (i < extra) for i in range(children)]


@dataclass
class _Child:
    pid: int
    fd: int
    names: list[str]
    """The passes it runs, in order."""
    received: dict[str, tuple[Any, list[str]] | None] = field(default_factory=dict)
    """What it sent for each pass read so far: (result, notes), or None where the pass is
    left to the planner (it failed there, or the child stopped before it)."""
    buffer: bytearray = field(default_factory=bytearray)
    store: int | None = None
    """The anonymous file the child writes its results into (None: they come in the pipe's
    frames; [Note: results beside the pipe])."""


class ForkedPasses:
    """Passes queued (``start``), started in forked children (``launch``: [Note: a child per
    spare CPU]) and collected later (``result``), as a context manager that ends every child
    still running when it exits."""

    def __init__(self, notes: list[str], *, enabled: bool | None = None) -> None:
        self._notes = notes
        """The model's notes (``LoadedModel.notes``): a child's pass may add to its copy."""
        self._enabled = forking_allowed() if enabled is None else enabled
        self._queued: list[tuple[str, Callable[[], Any]]] = []
        self._children: list[_Child] = []
        self._started = 0.0
        self._deadline: float | None = None

    def __enter__(self) -> ForkedPasses:  # noqa: PYI034 (a final class)
        return self

    def __exit__(self, *exc: object) -> None:
        for child in list(self._children):
            self._end(child)

    def start(self, name: str, run: Callable[[], Any]) -> None:
        """Queue ``run`` for a child at ``launch``, when forking is allowed; else do nothing
        (``result`` runs it then). Passes are queued in the order ``result`` asks for them."""
        if self._enabled and all(name != queued for queued, _ in self._queued):
            self._queued.append((name, run))

    def launch(self, *, planner_busy: bool = False) -> None:
        """Fork the children for the queued passes: the planner keeps the first ones, which
        ``result`` runs here ([Note: a child per spare CPU]); ``planner_busy``: the children
        take them all (``shares``)."""
        queued, self._queued = self._queued, []
        if not queued:
            return
        own, runs = shares(len(queued), spare_cpus(), planner_busy=planner_busy)
        for stream in (sys.stdout, sys.stderr):  # the children must not write them again
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        at = own
        for count in runs:
            mine, at = queued[at:at + count], at + count
            try:
                read, write = os.pipe()
            except OSError:
                return
            store = _result_store()
            try:
                pid = fork_planner_child()
            except OSError:
                for fd in (read, write) if store is None else (read, write, store):
                    os.close(fd)
                return
            if pid == 0:  # the child: never returns
                os.close(read)
                _run_in_child(mine, write, self._notes, store)
            os.close(write)
            if not self._children:
                self._started = time.monotonic()
            self._children.append(_Child(pid=pid, fd=read, names=[n for n, _ in mine],
                                         store=store))

    def result(self, name: str, run: Callable[[], T]) -> T:
        """What ``run`` returns (or raises): a child's result for ``name`` when it sent one,
        else ``run()`` here. Launches what is queued first."""
        self.launch()
        child = next((c for c in self._children if name in c.names), None)
        if child is not None:
            if self._deadline is None:
                waited = time.monotonic() - self._started
                self._deadline = time.monotonic() + max(_MIN_WAIT_S, _WAIT_FACTOR * waited)
            sent = self._receive(child, name)
            if sent is not None:
                value, notes = sent
                self._notes.extend(n for n in notes if n not in self._notes)
                return value
        return run()

    def _receive(self, child: _Child, name: str) -> tuple[Any, list[str]] | None:
        """What ``child`` sent for ``name``, reading its results in order until that one;
        None when it failed there or the child stopped sending (killed past the deadline):
        the passes it did not send run here. The child is ended once all are read."""
        stopped = False
        while name not in child.received:
            frame = _read_frame(child, self._deadline or 0.0)
            if frame is not None and child.store is not None:
                frame = _stored(child.store, frame)
            sent = _unpickled(frame) if frame is not None else None
            if sent is None:  # it sends nothing more: killed below
                stopped = True
                child.received.update((n, None) for n in child.names if n not in child.received)
                break
            done, ok, value, notes = sent
            child.received[done] = (value, notes) if ok else None
        if len(child.received) == len(child.names):
            # a last result was its last act: it exits at once (else it is killed); one that
            # stopped sending is killed now
            self._end(child, 0.0 if stopped else time.monotonic() + _EXIT_WAIT_S)
        found = child.received[name]
        child.received[name] = None  # each result is taken once
        return found

    def _end(self, child: _Child, exit_by: float = 0.0) -> None:
        """Stop waiting for ``child``: let it exit until ``exit_by``, then kill it if it still
        runs, and reap it."""
        if child in self._children:
            self._children.remove(child)
            os.close(child.fd)
            if child.store is not None:
                os.close(child.store)
            end_child(child.pid, exit_by=exit_by)


_LENGTH = 8
"""Bytes of the length that leads each frame a child writes (big-endian)."""


# [Note: results beside the pipe]
# A pipe holds 64 KiB (1 MiB at most, /proc/sys/fs/pipe-max-size), and a pass's result is
# more: 0.5 MB for the depth-cut 70B shape, 0.8 MB for 405B, 4.5 MB for 10,006 modules. A
# child writing one into the pipe waited, blocked, until the planner read it, which the
# planner does only once its own passes are done: the 70B's child stood idle 0.4 s between
# its two passes. So each child writes its results into an anonymous in-memory file
# (``os.memfd_create``, made by the planner before the fork, so both hold it) and sends in
# the pipe only where each one lies (offset and length, 16 bytes: a pipe never blocks on
# that). Only the child writes the file (its own offset, at the end), the planner only reads
# it at given offsets (``os.pread``, which moves no offset), so the two never race. Where no
# such file can be made, the results go through the pipe as before.


def _result_store() -> int | None:
    """A new anonymous in-memory file for a child's results, or None (no ``memfd_create``
    here, or it failed)."""
    make = getattr(os, "memfd_create", None)
    if make is None:
        return None
    try:
        return make("fsdp-plan-pass-results", getattr(os, "MFD_CLOEXEC", 0))
    except OSError:
        return None


def _where(offset: int, size: int) -> bytes:
    """The frame that tells the planner where a result lies in the store."""
    return offset.to_bytes(_LENGTH, "big") + size.to_bytes(_LENGTH, "big")


def _stored(store: int, frame: bytes) -> bytes | None:
    """The result bytes ``frame`` (``_where``) points at in ``store``; None when the frame
    is not such a pointer or the bytes are not all there (the pass then runs here)."""
    if len(frame) != 2 * _LENGTH:
        return None
    offset, size = int.from_bytes(frame[:_LENGTH], "big"), int.from_bytes(frame[_LENGTH:], "big")
    chunks, got = [], 0
    try:
        while got < size:
            chunk = os.pread(store, size - got, offset + got)
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
    except OSError:
        return None
    return b"".join(chunks)


def _unpickled(payload: bytes) -> tuple[str, bool, Any, list[str]] | None:
    """A child's frame, ``(pass name, whether it ran, result, notes)``, or None when the bytes
    are not one."""
    try:
        # a result is many small objects and no cycle: [Note: pausing the cycle collector]
        with cycle_collector_paused(collect_after=False):
            name, ok, value, notes = pickle.loads(payload)
    except Exception:  # noqa: BLE001  (anything unreadable: the pass runs in process)
        return None
    return name, ok, value, notes


def _read_frame(child: _Child, deadline: float) -> bytes | None:
    """The next frame ``child`` wrote to its pipe, or None when it closed the pipe first or
    ``deadline`` passed (``poll``, not ``select``: a process with 1,024 files open has
    descriptors ``select`` cannot watch)."""
    waiting = select.poll()
    waiting.register(child.fd, select.POLLIN)
    buffer = child.buffer
    while True:
        if len(buffer) >= _LENGTH:
            size = int.from_bytes(buffer[:_LENGTH], "big")
            if len(buffer) >= _LENGTH + size:
                frame = bytes(buffer[_LENGTH:_LENGTH + size])
                del buffer[:_LENGTH + size]
                return frame
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:  # an interrupted poll or read is retried by Python itself (PEP 475)
            if not waiting.poll(max(1, int(left * 1000))):
                return None
            chunk = os.read(child.fd, 1 << 20)
        except OSError:
            return None
        if not chunk:
            return None
        buffer += chunk


def _run_in_child(runs: list[tuple[str, Callable[[], Any]]], fd: int, notes: list[str],
                  store: int | None = None) -> None:
    """The child's whole life: run its passes in turn, writing a frame for each (its length,
    then ``(name, ok, result, notes)`` pickled; ``ok`` False where the pass raised or its
    result cannot be pickled: the parent runs that one itself), and end with status 0; with 1
    when a frame cannot be written (the parent runs what it did not get). With a ``store``
    the pickled bytes go there and the frame says where ([Note: results beside the pipe])."""
    code = 1
    try:
        offset = 0
        for name, run in runs:
            try:
                payload = pickle.dumps((name, True, run(), list(notes)),
                                       protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException:  # noqa: BLE001  (the parent runs this pass again)
                payload = pickle.dumps((name, False, None, []))
            if store is not None:
                _write_all(store, payload)
                payload, offset = _where(offset, len(payload)), offset + len(payload)
            _write_all(fd, len(payload).to_bytes(_LENGTH, "big") + payload)
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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
