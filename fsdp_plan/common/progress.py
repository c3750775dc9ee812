"""How long steps say what they are doing: a callable taking one line (the CLI prints it to
stderr; the library's default is silence), and the long verbs' bars (verify, bench,
calibrate, tune: ``Steps``, with tqdm).

[Note: progress bars]
A bar says how far a run is and what it is doing now. It writes to stderr only, so a report
on stdout stays parseable, and nothing at all under ``--format json`` (``quiet``). When stderr
is not a terminal (a log file, CI, a test reading it), a bar's carriage returns would make one
endless line: each step is then one plain line, ``what: message``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

Progress = Callable[[str], None]


class Steps:
    """A bar of ``total`` steps: ``step(message)`` starts the next one and shows what it is."""

    def __init__(self, *, total: int, quiet: bool, what: str, unit: str = "step") -> None:
        self._bar: Any = None
        self._lines = not quiet and not sys.stderr.isatty()
        self._what = what
        if not quiet and not self._lines:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=what, unit=unit, file=sys.stderr, leave=False,
                             dynamic_ncols=True, bar_format="{desc}: {n_fmt}/{total_fmt} "
                             "[{elapsed}] {postfix}")
        self._started = False

    def step(self, message: str, to: int | None = None) -> None:
        """Mark the previous step done (or move to step ``to``) and show ``message``."""
        if self._lines:
            print(f"{self._what}: {message}", file=sys.stderr, flush=True)
            return
        if self._bar is None:
            return
        if to is not None:
            self._bar.update(max(0, to - self._bar.n))
        elif self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_postfix_str(message, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(max(0, self._bar.total - self._bar.n))
            self._bar.close()
            self._bar = None
