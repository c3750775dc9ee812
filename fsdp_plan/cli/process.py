"""The ``fsdp-plan`` process around a command: standard output kept for the report.

[Note: the report owns file descriptor 1]
``--format json`` promises one JSON document on stdout (and the table is the only thing there
otherwise). Redirecting ``sys.stdout`` while user code runs ([Note: calling user code] in
load.py) misses output that goes around it: ``os.write(1, ...)`` from C libraries,
``sys.__stdout__``, ``atexit`` handlers and threads the model started, and bench workers'
inherited descriptor (issue 21, S3-15 and S3-16). So for the whole command, file descriptor 1
is pointed at file descriptor 2, and the report is written through a duplicate of the
original descriptor 1: ``sys.stdout`` becomes a stream that sends the main thread's writes to
that duplicate and any other thread's to stderr. When the command returns, the duplicate is
closed and ``sys.stdout`` is stderr, so ``atexit`` output lands there too.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from typing import TextIO


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
        self._report.flush()

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
        sys.stdout = _MainThreadReport(self._report)

    def close(self) -> None:
        """The report is complete: flush and close it; later output (``atexit``, threads)
        goes to stderr."""
        if self._report is None:
            return
        with contextlib.suppress(OSError, ValueError):  # a reader that went away (head -c)
            self._report.flush()
        sys.stdout = sys.stderr
        with contextlib.suppress(OSError, ValueError):
            self._report.close()
        self._report = None

