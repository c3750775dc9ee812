"""The ``fsdp-plan`` process around a command: standard output kept for the report, and an
end that no model code can hold up.

[Note: the report owns file descriptor 1]
``--format json`` promises one JSON document on stdout (and the table is the only thing there
otherwise). Redirecting ``sys.stdout`` while user code runs ([Note: calling user code] in
load.py) misses output that goes around it: ``os.write(1, ...)`` from C libraries,
``sys.__stdout__``, ``atexit`` handlers and threads the model started, and bench workers'
inherited descriptor (issue 21, S3-15 and S3-16). So for the whole command, file descriptor 1
is pointed at file descriptor 2, and the report is written through a duplicate of the
original descriptor 1: ``sys.stdout`` becomes a stream that sends the main thread's writes to
that duplicate and any other thread's to stderr. When the command returns, the duplicate is
closed and ``sys.stdout`` is stderr, so ``atexit`` output lands there too. The main thread's
own calls into the model (analysis, verify's step, bench's memory step after the run) are
each inside ``user_code_output_to_stderr``, since their print()s would reach the report.

[Note: ending the process]
When the command is done: children that the model's code forked and that still run are ended
(model/user_process.py [Note: user code and the process]), and if threads the model started
(not daemon threads) are still alive, the interpreter would wait for them forever after the plan
was written (S3-23). Then fsdp-plan says so on stderr, runs the ``atexit`` handlers (temporary
files, multiprocessing's cleanup) and ends with ``os._exit`` and the command's exit code,
without joining them; a model thread's work is never part of a plan. Otherwise too the
``atexit`` handlers run, the streams are flushed and ``os._exit`` ends the process, since the
interpreter's teardown is all that is left: of torch's modules and objects where torch was
imported (a plan that traced, every GPU and gloo verb; 1.3-1.8 s of the 11 s that README's
first command took when it traced, issue 29), else of the facts and the search's caches (0.1 s
of that command from cached facts here). For the same reason the plan verb leaves the cycle
collector paused when it returns in such a process (``process_ends_after_command``): turned on
again, its first collection walked everything the run made, 0.4 s of README's first command
when it traced, before ``os._exit`` (stop 42). Every file fsdp-plan writes is complete and
closed (written atomically) before the command returns.

[Note: streams taken off sys.stdout stay alive]
CPython 3.11's ``print()`` holds ``sys.stdout`` as a borrowed reference while it writes and
flushes, with the GIL released around the write. A model's thread printing while the main
thread replaces ``sys.stdout`` (``ReportChannel.close`` at the end of every command) would so
write through a freed stream if the old one were released: the planner segfaulted at exit
after the plan was written (rc -11, 3 runs in 8 of
test_json_is_alone_on_stdout_whatever_the_model_writes[plan]). Every stream this module takes
off ``sys.stdout`` is therefore kept in ``_RETIRED_STREAMS`` to the end of the process (one
small object per command).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import sys
import threading
from typing import Any, TextIO

from fsdp_plan.model.user_process import end_forked_children

_RETIRED_STREAMS: list[Any] = []
"""Streams taken off ``sys.stdout``, never released ([Note: streams taken off sys.stdout stay
alive])."""


def _replace_stdout(stream: Any) -> None:
    """``sys.stdout = stream``, keeping the stream it replaces alive."""
    _RETIRED_STREAMS.append(sys.stdout)
    sys.stdout = stream


class _MainThreadReport(io.TextIOBase):
    """``sys.stdout`` during a command: the main thread's text goes to the report, every other
    thread's to stderr (a model's thread printing while the report is written)."""

    def __init__(self, report: TextIO) -> None:
        super().__init__()
        self._report = report

    def _target(self) -> TextIO:
        return self._report if threading.current_thread() is threading.main_thread() \
            else sys.stderr

    def write(self, text: str) -> int:  # type: ignore[override]
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def fileno(self) -> int:
        return self._report.fileno()

    def isatty(self) -> bool:
        return self._report.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._report.encoding

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return self._report.errors

    def writable(self) -> bool:
        return True


class ReportChannel:
    """File descriptor 1 kept for the report ([Note: the report owns file descriptor 1])."""

    def __init__(self) -> None:
        self._report: TextIO | None = None

    def open(self) -> None:
        """Point descriptor 1 at stderr and ``sys.stdout`` at a duplicate of the original; left
        as it is when either descriptor is closed (nothing to keep apart)."""
        out = sys.stdout
        if out is None or sys.stderr is None:
            return
        try:
            out.flush()
            saved = os.dup(1)
        except (OSError, ValueError):
            return
        try:
            os.dup2(2, 1)
        except OSError:
            os.close(saved)
            return
        encoding = getattr(out, "encoding", None) or "utf-8"
        errors = getattr(out, "errors", None) or "strict"
        self._report = open(saved, "w", encoding=encoding, errors=errors)  # noqa: SIM115
        _replace_stdout(_MainThreadReport(self._report))

    def close(self) -> None:
        """The report is complete: flush and close it; later output (``atexit``, threads)
        goes to stderr."""
        if self._report is None:
            return
        with contextlib.suppress(OSError, ValueError):  # a reader that went away (head -c)
            self._report.flush()
        _replace_stdout(sys.stderr)
        with contextlib.suppress(OSError, ValueError):
            self._report.close()
        self._report = None


def lingering_threads() -> list[threading.Thread]:
    """Threads that would keep the interpreter from exiting: alive, not daemon, not main."""
    return [t for t in threading.enumerate() if t.is_alive() and not t.daemon
            and t is not threading.main_thread()]


_ENDS_AFTER_COMMAND: list[bool] = []
"""Set by ``entry`` (the console script): the process ends once the command returns."""


def mark_process_ends_after_command() -> None:
    """The console script's process ends with ``end_process`` once the command returns."""
    _ENDS_AFTER_COMMAND.append(True)


def process_ends_after_command() -> bool:
    """Whether the process ends once the command returns (the console script), as opposed to
    a command run in process (``main()`` from tests or a notebook), whose process goes on."""
    return bool(_ENDS_AFTER_COMMAND)


def end_process(code: int) -> None:
    """End the process with ``code`` ([Note: ending the process]); never returns."""
    end_forked_children()
    waiting = lingering_threads()
    if not waiting:  # only the interpreter's teardown is left ([Note: ending the process])
        _run_exit_handlers()
        _flush_all()
        os._exit(code)
    names = ", ".join(repr(t.name) for t in waiting[:5]) + (
        f" and {len(waiting) - 5} more" if len(waiting) > 5 else "")
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"fsdp-plan: note: the model's code left {len(waiting)} thread(s) "
                         f"running ({names}); fsdp-plan does not wait for them and exits "
                         f"with code {code}. Start such threads with daemon=True, or only "
                         "under `if __name__ == \"__main__\":`.\n")
    _run_exit_handlers()
    _flush_all()
    os._exit(code)


def _flush_all() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()  # type: ignore[union-attr]


def _run_exit_handlers() -> None:
    run: Any = getattr(atexit, "_run_exitfuncs", None)
    if run is not None:
        run()
