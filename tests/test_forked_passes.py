"""The checkpointed analysis passes in forked children (facts/forked.py [Note: passes in forked
children]): the same facts as in process, and every way a child can fail falls back to the
pass run in process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fsdp_plan.facts import forked
from fsdp_plan.facts.forked import SERIAL_ENV, ForkedPasses, forking_allowed

LLAMA = str(Path(__file__).resolve().parents[1] / "examples" / "llama.py")

needs_fork = pytest.mark.skipif(not forking_allowed(),
                                reason="passes run in process here (one CPU, or not Linux)")


def _gone(pid: int) -> bool:
    """Reaped (not a child of this process any more)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


_SAME_FACTS = """
import dataclasses, os, sys
from fsdp_plan.facts import forked
from fsdp_plan.facts.analyze import analyze_model
from fsdp_plan.model.source import ModelSource

sent = []
unpickled = forked._unpickled
forked._unpickled = lambda payload: sent.append(unpickled(payload)) or sent[-1]
# eight layers: analysed on a copy cut to three (facts/depth.py)
source = ModelSource(source=sys.argv[1], args={"size": "small"}, batch_size=2, seq_len=32)
os.environ[forked.SERIAL_ENV] = "1"
options = dict(ddp_limit_bytes=10**12, selective_strides=(2,))
serial = analyze_model(source, **options).facts.analysis
assert sent == [], sent
os.environ[forked.SERIAL_ENV] = "0"
assert forked.forking_allowed()
forked.spare_cpus = lambda: int(sys.argv[2])  # the CPUs the children are shared out by
both = analyze_model(source, **options).facts.analysis
assert serial.ddp_analysis is not None and both.ddp_analysis is not None
assert serial.checkpointed_timeline is not None and serial.selective_timeline is not None
assert [v.mm_stride for v in serial.selective_variants] == [2]

def timed_nothing(value):  # a pass's wall time is the one figure that may differ
    if hasattr(value, "seconds"):
        return dataclasses.replace(value, seconds=0.0)
    if isinstance(value, list):
        return [timed_nothing(v) for v in value]
    if dataclasses.is_dataclass(value) and hasattr(value, "timeline"):
        return dataclasses.replace(value, timeline=timed_nothing(value.timeline))
    return value

for a, b in ((serial, both), (serial.ddp_analysis, both.ddp_analysis)):
    for f in dataclasses.fields(a):
        if f.name != "ddp_analysis":
            x, y = timed_nothing(getattr(a, f.name)), timed_nothing(getattr(b, f.name))
            assert x == y, f.name
# a child sends its passes expanded to the model's full depth, from its depth-cut copy
# ([Note: who expands a forked pass] in facts/analysis.py)
for name, ok, value, notes in sent:
    full_depth = (serial.ddp_analysis.timeline if name == "autocast"
                  else serial.checkpointed_timeline)
    assert ok and len(value[0].events) == len(full_depth.events), name
print("children", len(sent))
"""


@needs_fork
@pytest.mark.parametrize(("spare", "from_children"), [(8, 4), (1, 2)])
def test_forked_passes_give_the_facts_of_the_passes_in_process(spare, from_children):
    """In a fresh process (no thread of the suite's alive), with CPUs for a child per pass or
    for one child: the checkpointed pass, the selective passes (the plan's stride and another)
    and DDP's autocast pass come from children (one child: the last two, the planner runs the
    first two itself), and every fact equals the serial analysis's."""
    done = subprocess.run([sys.executable, "-c", _SAME_FACTS, LLAMA, str(spare)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["children", str(from_children)], done.stdout


@pytest.mark.parametrize(("passes", "spare", "expected"), [
    (4, 1, (2, [2])),              # 2 CPUs, 5 passes: plain + 2 here, 2 in one child
    (3, 1, (1, [2])),              # README's 70B: plain and full here, both selective there
    (1, 1, (0, [1])),              # --compile's selective trace
    (2, 1, (1, [1])),
    (5, 2, (1, [2, 2])),
    (4, 8, (0, [1, 1, 1, 1])),     # a child per pass, the planner runs the plain one
    (4, 0, (4, [])),               # no spare CPU: every pass here
    (0, 3, (0, [])),
])
def test_passes_are_shared_with_a_child_per_spare_cpu(passes, spare, expected):
    own, children = forked.shares(passes, spare)
    assert (own, children) == expected
    assert own + sum(children) == passes


@pytest.mark.parametrize(("passes", "spare", "expected"), [
    (3, 1, (0, [3])),              # --compile's 70B: plain, full and selective in one child
    (4, 2, (0, [2, 2])),
    (2, 8, (0, [1, 1])),
    (3, 0, (3, [])),               # no spare CPU: every pass here, after the planner's work
])
def test_a_busy_planner_leaves_every_pass_to_the_children(passes, spare, expected):
    """While the planner traces the compiled blocks ([Note: eager passes beside the compiled
    traces] in facts/analysis.py) the children take the eager plain pass too."""
    assert forked.shares(passes, spare, planner_busy=True) == expected


@needs_fork
def test_a_child_sends_each_result_when_done_and_what_it_did_not_send_runs_here(monkeypatch):
    """One child with the last three of five passes: its first result comes back while it
    still runs, a pass that raises there runs here, and the pass it never finished runs here
    once the child is past its deadline (killed and reaped)."""
    monkeypatch.setattr(forked, "spare_cpus", lambda: 1)
    monkeypatch.setattr(forked, "_MIN_WAIT_S", 3.0)
    monkeypatch.setattr(forked, "_WAIT_FACTOR", 0.0)

    def fails():
        raise ValueError("only in the child")

    with ForkedPasses([], enabled=True) as passes:
        for name, run in [("here", os.getpid), ("here too", os.getpid), ("pid", os.getpid),
                          ("fails", fails), ("hangs", lambda: time.sleep(600))]:
            passes.start(name, run)
        passes.launch()
        (child,) = passes._children
        assert child.names == ["pid", "fails", "hangs"]  # the planner keeps the first two
        assert passes.result("here", os.getpid) == os.getpid()
        assert passes.result("here too", os.getpid) == os.getpid()
        assert passes.result("pid", lambda: pytest.fail("ran in process")) == child.pid
        assert passes.result("fails", lambda: "in process") == "in process"
        started = time.monotonic()
        assert passes.result("hangs", lambda: "in process") == "in process"
        assert time.monotonic() - started < 10
        assert passes._children == []
    assert _gone(child.pid)


@needs_fork
def test_a_childs_result_is_its_own_and_its_notes_come_back():
    notes = ["kept"]

    def run():
        notes.append("from the child")
        notes.append("kept")
        return os.getpid()

    with ForkedPasses(notes, enabled=True) as passes:
        passes.start("pid", run)
        assert notes == ["kept"]  # the child changed its own copy
        pid = passes.result("pid", lambda: pytest.fail("ran in process"))
    assert pid != os.getpid() and _gone(pid)
    assert notes == ["kept", "from the child"]  # new notes once, in order


@needs_fork
@pytest.mark.parametrize("how", ["raises", "exits", "unpicklable"])
def test_a_child_that_sends_nothing_usable_leaves_the_pass_to_the_process(how):
    def run():
        if how == "raises":
            raise ValueError("only in the child")
        if how == "exits":
            os._exit(0)
        return threading.Lock()  # cannot be pickled

    with ForkedPasses([], enabled=True) as passes:
        passes.start("pass", run)
        assert passes.result("pass", lambda: "in process") == "in process"


@needs_fork
def test_a_child_past_its_deadline_is_killed_and_the_pass_runs_here(monkeypatch):
    monkeypatch.setattr(forked, "_MIN_WAIT_S", 0.5)
    monkeypatch.setattr(forked, "_WAIT_FACTOR", 0.0)
    pids = []
    with ForkedPasses([], enabled=True) as passes:
        passes.start("hangs", lambda: time.sleep(600))
        passes.launch()
        pids.extend(c.pid for c in passes._children)
        started = time.monotonic()
        assert passes.result("hangs", lambda: "in process") == "in process"
        assert time.monotonic() - started < 10
    assert _gone(pids[0])


@needs_fork
def test_children_still_running_when_the_work_fails_are_ended(monkeypatch):
    monkeypatch.setattr(forked, "spare_cpus", lambda: 2)  # a child each
    pids = []
    with pytest.raises(RuntimeError), ForkedPasses([], enabled=True) as passes:
        passes.start("a", lambda: time.sleep(600))
        passes.start("b", lambda: time.sleep(600))
        passes.launch()
        pids.extend(c.pid for c in passes._children)
        raise RuntimeError("the plain pass failed")
    assert len(pids) == 2 and all(_gone(pid) for pid in pids)


@needs_fork
@pytest.mark.parametrize("store", [True, False], ids=["beside the pipe", "in the pipe"])
def test_results_larger_than_a_pipe_come_back_whole(monkeypatch, store):
    """Results of several MB (a deep model's pass is 4.5 MB) arrive whole, beside the pipe
    ([Note: results beside the pipe]) or, where no anonymous file can be made, in it."""
    if not store:
        monkeypatch.setattr(forked, "_result_store", lambda: None)
    monkeypatch.setattr(forked, "spare_cpus", lambda: 1)
    big = [bytes([i]) * (3 << 20) for i in range(2)]
    with ForkedPasses([], enabled=True) as passes:
        passes.start("here", os.getpid)  # the planner keeps the first
        passes.start("first", lambda: big[0])
        passes.start("second", lambda: big[1])
        passes.launch()
        assert (passes._children[0].store is not None) == store
        assert passes.result("first", lambda: pytest.fail("ran in process")) == big[0]
        assert passes.result("second", lambda: pytest.fail("ran in process")) == big[1]


@needs_fork
def test_a_child_goes_on_while_the_planner_has_not_read_its_large_result(monkeypatch):
    """A child whose first result is more than a pipe holds starts its next pass at once,
    not when the planner, busy with its own passes, reads the first."""
    monkeypatch.setattr(forked, "spare_cpus", lambda: 1)
    with ForkedPasses([], enabled=True) as passes:
        passes.start("here", os.getpid)  # the planner keeps the first
        passes.start("large", lambda: b"x" * (3 << 20))
        passes.start("when", time.monotonic)
        passes.launch()
        time.sleep(2.0)  # the planner's own pass
        asked = time.monotonic()
        assert len(passes.result("large", lambda: pytest.fail("ran in process"))) == 3 << 20
        started = passes.result("when", lambda: pytest.fail("ran in process"))
    assert started < asked - 1.0


def a_store_that_lies(store, frame):
    return None


@needs_fork
def test_a_result_the_store_does_not_hold_runs_here(monkeypatch):
    monkeypatch.setattr(forked, "_stored", a_store_that_lies)
    with ForkedPasses([], enabled=True) as passes:
        passes.start("pass", os.getpid)
        assert passes.result("pass", lambda: "in process") == "in process"


def test_no_fork_with_threads_alive_or_when_asked_not_to(monkeypatch):
    monkeypatch.delenv(SERIAL_ENV, raising=False)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        assert not forking_allowed()  # a fork would copy a thread mid-way (a held lock)
    finally:
        stop.set()
        thread.join()
    monkeypatch.setenv(SERIAL_ENV, "1")
    assert not forking_allowed()
    with ForkedPasses([]) as passes:  # not enabled: start does nothing, result runs here
        passes.start("pass", lambda: pytest.fail("forked"))
        assert passes.result("pass", lambda: 7) == 7


@needs_fork
def test_a_result_comes_back_to_a_process_with_many_files_open():
    """A child's pipe above descriptor 1,023 (a process with many files open): ``select``
    cannot watch it, ``poll`` can."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"at most {hard} open files here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with ForkedPasses([], enabled=True) as passes:
            passes.start("pid", os.getpid)
            passes.launch()
            assert max(c.fd for c in passes._children) > 1023
            assert passes.result("pid", lambda: pytest.fail("ran in process")) != os.getpid()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


_COMPILED_MODES = """
import os, sys, threading
import torch
from fsdp_plan.facts import forked
from fsdp_plan.facts.analyze import _torch_stages
from fsdp_plan.facts.compiled import analyze_compiled
from fsdp_plan.model.source import ModelSource

sent = []
unpickled = forked._unpickled
forked._unpickled = lambda payload: sent.append(1) or unpickled(payload)
_, graph_of, load = _torch_stages()
loaded = load.load_model(ModelSource(source=sys.argv[1], args={"size": "tiny"}, batch_size=2,
                                     seq_len=32))
blocks = graph_of.build_module_graph(loaded.model).blocks
result = {}
for serial in ("1", "0"):
    os.environ[forked.SERIAL_ENV] = serial
    result[serial] = analyze_compiled(loaded, param_dtype=torch.bfloat16, blocks=blocks)
assert result["1"] == result["0"]
assert sorted(result["0"].by_mode) == ["full", "selective"]
print("children", len(sent), "threads", threading.active_count())
"""


@needs_fork
def test_compiled_selective_mode_comes_from_a_child_and_tqdm_starts_no_thread():
    """--compile's selective trace runs in a child once the plain one has warmed Dynamo up: fx's
    disabled tqdm bar must not have started tqdm's monitor thread (which turns forking off),
    and the partitions equal the serial ones."""
    done = subprocess.run([sys.executable, "-c", _COMPILED_MODES, LLAMA], capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["children", "1", "threads", "1"], done.stdout
