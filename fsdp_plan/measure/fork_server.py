"""What the fork server that starts workers runs as it starts (measure/launch.py [Note: starting
workers]): it dies with the launcher that started it.

``multiprocessing``'s fork server is meant to exit when its launcher's end of a pipe closes,
but one that had imported torch lived on after its launcher was killed (SIGKILL), and so did
the workers it had forked, training on: the kernel's ``PR_SET_PDEATHSIG`` kills it instead,
as every worker is killed when its own parent dies. The server imports this module
(``WORKER_PRELOAD``); imported anywhere else it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def _imported_by_the_fork_server() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main``."""
    server = sys.modules.get("multiprocessing.forkserver")
    main = getattr(getattr(server, "main", None), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is main:
            return True
        frame = frame.f_back
    return False


def die_with_parent() -> int:
    """Be killed when the parent process dies (Linux, ``PR_SET_PDEATHSIG``), and exit now if
    it died already; returns the parent's pid. The fork server's rule here, and every worker's
    (measure/launch.py ``_die_with_parent``)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)
    return parent


if _imported_by_the_fork_server():
    die_with_parent()
