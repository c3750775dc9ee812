"""What the user's model code may do to the planner's process: exit it, fork it.

[Note: user code and the process]
``load.user_code_output_to_stderr`` runs every call into the user's code inside
``process_guarded``, which adds what redirecting ``sys.stdout`` and catching ``SystemExit``
cannot see (issue 21):
- ``os._exit(n)`` ends a process at once, with no exception and no ``atexit``: a model
  calling it at import or in ``build_model`` made ``plan``, ``predict`` and ``verify`` exit 0
  having done nothing, so a CI ``verify`` "passed" (S3-20). While user code runs, ``os._exit``
  raises ``UserExit`` in the planner's own process instead; the caller turns it into a
  ``BadInput`` naming the call. Elsewhere (a worker's own exit, a forked child) it is the real one.
- ``os.fork()`` in user code made two planners: both planned, wrote and printed (S3-32), and
  the child could outlive the run, holding the output pipes open (S3-33). A forked child that
  comes back out of the user's code into the planner (its pid is not the planner's) ends at
  once with ``os._exit(0)``, flushing nothing (its buffers are copies of the parent's). The
  children forked while user code ran are recorded, and ``end_forked_children`` ends any still
  running when the command is done.
Processes started by exec (``subprocess``) are the user's own programs and are left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

from fsdp_plan.common.errors import Stop

_real_exit = os._exit
_real_fork = os.fork
_depth = 0
"""Nesting depth of ``process_guarded`` in this process (a forked child inherits it)."""
_owner = 0
"""The pid that entered the outermost ``process_guarded``: the planner's own process."""
_forked: list[int] = []
"""Children forked by user code, ended by ``end_forked_children``."""


class UserExit(Stop):
    """``os._exit(code)`` called by user code (a ``BaseException``, like ``SystemExit``, so
    the user's ``except Exception`` does not swallow it)."""

    def __init__(self, code: object) -> None:
        super().__init__(code)
        self.code = code


def _guarded_exit(code: int) -> None:
    if _depth and os.getpid() == _owner:
        raise UserExit(code)
    _real_exit(code)


def _recording_fork() -> int:
    pid = _real_fork()
    if pid > 0 and os.getpid() == _owner:
        _forked.append(pid)
    return pid


@contextlib.contextmanager
def process_guarded() -> Iterator[None]:
    """Run user code with ``os._exit`` refused and ``os.fork`` recorded ([Note: user code and
    the process]); a forked child leaving this block ends quietly."""
    global _depth, _owner
    pid = os.getpid()
    if _depth == 0:
        _owner = pid
    _depth += 1
    saved = os._exit, os.fork
    os._exit, os.fork = _guarded_exit, _recording_fork
    try:
        yield
    finally:
        if os.getpid() != pid:  # a child forked by user code, back in the planner
            _real_exit(0)
        os._exit, os.fork = saved
        _depth -= 1


def fork_planner_child() -> int:
    """``os.fork()`` for the planner's own children (facts/forked.py [Note: passes in forked
    children]), even while user code is guarded: not recorded as the model's, since the
    planner reaps them itself."""
    return _real_fork()


def end_planner_child(code: int) -> None:
    """End a child of ``fork_planner_child`` at once with ``code`` (``os._exit``, even while
    user code is guarded): no ``atexit`` handler of the planner's runs in it."""
    _real_exit(code)


def end_child(pid: int, *, exit_by: float = 0.0) -> bool:
    """Reap child ``pid``, letting it exit by itself until ``exit_by`` (``time.monotonic()``),
    then ending it (SIGKILL); whether it had to be ended. A pid already reaped, or not a
    child of this process, is left alone."""
    try:
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() >= exit_by:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return True
            time.sleep(0.001)
    except (ChildProcessError, ProcessLookupError):
        pass
    return False


def end_forked_children() -> list[int]:
    """End (SIGKILL) and reap the children that user code forked and that still run; returns
    their pids. Called when the command is done, planned or not."""
    ended = []
    while _forked:
        pid = _forked.pop()
        if end_child(pid):
            ended.append(pid)
    return ended
