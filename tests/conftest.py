"""Shared test setup.

The plan, predict, verify and tune verbs read and write model facts in a cache on disk
(facts/cache.py). Tests must not depend on what earlier runs left there, nor write to the real
home cache: the cache is off for the suite (and for the CLI processes the tests start, which
inherit the environment). tests/test_facts_cache.py switches it on explicitly in a temporary
folder per test, and a test file that plans and predicts the same small model many times, none
of its tests about tracing itself, shares its analyses through a folder of its own
(``pytestmark = pytest.mark.usefixtures("facts_cache_per_file")``): the first test to trace a
model with given options writes the entry, the later ones in that file read it, in the file's
own order (pytest-xdist's ``--dist loadfile`` keeps a file on one worker), so no test depends on
another file or another run. What a cached plan gives is what tracing gives
(tests/test_facts_cache.py checks both ways).

The extras' markers (pyproject.toml) mean what they say: a test marked ``hf``, ``frameworks``
or ``html`` is skipped, with the reason, where its extra is not installed. CI's first run is
the README's bare ``python3 -m pytest -q`` in an environment with no extras, so a marked test
must never fail there for want of its package; the later ``-m EXTRA`` runs install it.

A hang must fail the suite, not outlive it. A test that runs past ``HANG_S`` stops the run with
every thread's stack on stderr (``faulthandler``), and worker processes a test left behind are
killed at the end of the session: CI once sat until its 90-minute limit after one failed test,
because Python's exit joins every non-daemon ``multiprocessing`` child and that test's ranks
were still blocked in gloo.
"""

import faulthandler
import importlib.util
import multiprocessing
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

os.environ["FSDP_PLAN_NO_CACHE"] = "1"
os.environ.pop("FSDP_PLAN_CACHE_DIR", None)

EXTRAS = {  # marker -> the modules its extra installs
    "hf": ("transformers",),
    "frameworks": ("accelerate", "lightning", "torchtitan"),
    "html": ("plotly",),
}


def _missing(marker: str) -> list[str]:
    return [name for name in EXTRAS[marker] if importlib.util.find_spec(name) is None]


def pytest_collection_modifyitems(config, items):
    missing = {marker: _missing(marker) for marker in EXTRAS}
    for item in items:
        for marker, names in missing.items():
            if names and item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs the {marker} extra ({', '.join(names)} not installed)"))
                break



@pytest.fixture(scope="module")
def facts_cache_per_file(tmp_path_factory):
    """The facts cache switched on, in a fresh folder, for the tests of one file (the module
    docstring says when a file asks for it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("FSDP_PLAN_NO_CACHE", raising=False)
        patch.setenv("FSDP_PLAN_CACHE_DIR", str(tmp_path_factory.mktemp("facts")))
        yield


@pytest.fixture
def short_tmp():
    """An empty folder with a short path, for the ``TMPDIR`` of a command that starts workers:
    multiprocessing's forkserver listens on an AF_UNIX socket in a folder it makes there, and
    such a path holds at most 107 bytes. ``tmp_path`` runs past that once pytest's run counter
    has three digits (``/tmp/pytest-of-root/pytest-104/popen-gw0/test_.../tmp/pymp-.../...``:
    ``AF_UNIX path too long``)."""
    folder = tempfile.mkdtemp(prefix="fsdp-plan-test-", dir="/tmp" if os.path.isdir("/tmp")
                              else None)
    yield pathlib.Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


HANG_S = 900
"""No test runs this long (the slowest, a framework launch on 2 gloo ranks, takes about a
minute); one that does is stuck."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_sessionfinish(session, exitstatus):
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=10)
