"""What the user's model code may do to the planner's process: exit it.

[Note: user code and the process]
``load.user_code_output_to_stderr`` runs every call into the user's code inside
``process_guarded``, which adds what redirecting ``sys.stdout`` and catching ``SystemExit``
cannot see (issue 21):
- ``os._exit(n)`` ends a process at once, with no exception and no ``atexit``: a model
  calling it at import or in ``build_model`` made ``plan``, ``predict`` and ``verify`` exit 0
  having done nothing, so a CI ``verify`` "passed" (S3-20). While user code runs, ``os._exit``
  raises ``UserExit`` in the planner's own process instead; the caller turns it into a
  ``BadInput`` naming the call. Elsewhere (a worker's own exit, a forked child) it is the real one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_real_exit = os._exit
_depth = 0
"""Nesting depth of ``process_guarded`` in this process (a forked child inherits it)."""
_owner = 0
"""The pid that entered the outermost ``process_guarded``: the planner's own process."""


class UserExit(BaseException):
    """``os._exit(code)`` called by user code (a ``BaseException``, like ``SystemExit``, so
    the user's ``except Exception`` does not swallow it)."""

    def __init__(self, code: object) -> None:
        super().__init__(code)
        self.code = code


def _guarded_exit(code: int) -> None:
    if _depth and os.getpid() == _owner:
        raise UserExit(code)
    _real_exit(code)


@contextlib.contextmanager
def process_guarded() -> Iterator[None]:
    """Run user code with ``os._exit`` refused ([Note: user code and the process])."""
    global _depth, _owner
    pid = os.getpid()
    if _depth == 0:
        _owner = pid
    _depth += 1
    saved = os._exit
    os._exit = _guarded_exit
    try:
        yield
    finally:
        os._exit = saved
        _depth -= 1

