"""Pictures (issue 20): memory over the step, the predicted and measured snapshots, the frontier,
the HTML page in a real browser, and the report's small fixes.

The snapshot's peak is held to the plan's ``predicted.peak_bytes`` exactly (predicted) and to
FSDPMemTracker's own peak (measured), replayed the way PyTorch's memory viewer replays it;
the page is rendered by headless Chromium (Debian's ``chromium``), marked ``html`` and skipped
without it or plotly.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from fsdp_plan.api import plan_from_facts, predict
from fsdp_plan.cost.memory import estimate_peak, memory_timeline
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.model.source import ModelSource
from fsdp_plan.pictures.series import event_times, plan_timeline, step_series
from fsdp_plan.pictures.snapshot import active_peak, measured_snapshot, predicted_snapshot
from fsdp_plan.search.frontier import Variant, compute_frontier, more_memory_line, round_budgets
from fsdp_plan.search.request import PlanRequest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_llama_facts.json"
SOURCE = ModelSource(source=str(ROOT / "examples" / "llama.py"), args={"size": "tiny"},
                     batch_size=2, seq_len=64)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# its plans and predictions of the same small models share their analyses (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("facts_cache_per_file")


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    return ModelFacts.from_json(FIXTURE.read_text())


PLANS = {
    "ddp": {"budget_bytes": 10**8, "world_size": 4},
    "fsdp root": {"budget_bytes": 10**8, "world_size": 4, "strategy": "full"},
    "checkpointed": {"budget_bytes": 3 * 10**6, "world_size": 4, "strategy": "full"},
    "accumulated": {"budget_bytes": 10**8, "world_size": 4, "strategy": "full",
                    "grad_accum_steps": 3},
    "sync last": {"budget_bytes": 10**8, "world_size": 4, "strategy": "full",
                  "grad_accum_steps": 3, "gradient_sync": "last"},
    "hsdp": {"budget_bytes": 10**8, "world_size": 8, "strategy": "hybrid", "gpus_per_node": 2},
    "grad-op": {"budget_bytes": 10**8, "world_size": 4, "strategy": "grad-op"},
}


def _planned(facts: ModelFacts, **kw):
    result = plan_from_facts(facts, PlanRequest(source=SOURCE, **kw))
    return result, predict(result.plan, facts, gpus_per_node=kw.get("gpus_per_node", 8))


def test_memory_timeline_peaks_where_the_sweep_does_for_every_candidate(facts):
    """memory_timeline walks estimate_peak's own points: its highest total is the peak of
    every candidate the search evaluated (all layouts, prefetch, checkpointing, meshes)."""
    from fsdp_plan.search.evaluator import Evaluator
    request = PlanRequest(source=SOURCE, budget_bytes=3 * 10**6, world_size=8, gpus_per_node=4)
    result = plan_from_facts(facts, request)
    evaluator = Evaluator(facts.graph, facts.analysis, request.settings())
    checked = 0
    for c in result.ranked + result.recipes:
        if c.strategy == "ddp":
            continue
        profile, ctx = evaluator.profile_of(c), evaluator.step_context(c.shard)
        kw = {"forward_prefetch": c.forward_prefetch, "backward_prefetch": c.backward_prefetch}
        timeline = memory_timeline(profile, c.units, ctx, **kw)
        assert timeline.peak_bytes == estimate_peak(profile, c.units, ctx, **kw).peak_bytes \
            == c.memory.peak_bytes, c.name
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("case", sorted(PLANS))
def test_predicted_snapshot_peaks_at_the_plans_predicted_peak(facts, case):
    result, prediction = _planned(facts, **PLANS[case])
    timeline = plan_timeline(result.plan, facts, prediction)
    series = step_series(timeline, prediction.candidate.time)
    snapshot = predicted_snapshot(timeline, event_times(timeline, prediction.candidate.time))
    peak = result.plan.predicted["peak_bytes"]
    assert series.peak_bytes == peak
    assert active_peak(snapshot) == peak  # as the memory viewer replays it
    _check_snapshot_shape(snapshot)
    import torch.cuda._memory_viz as memory_viz
    assert "snapshot.pickle" in memory_viz.trace_plot(pickle.loads(pickle.dumps(snapshot)))


def _check_snapshot_shape(snapshot: dict) -> None:
    """What MemoryViz.js relies on: blocks tile their segment, every free follows an alloc
    of the same address or frees a block that existed before the trace, sizes positive."""
    for seg in snapshot["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == addr and b["size"] > 0
            addr += b["size"]
    live = {b["address"] for s in snapshot["segments"] for b in s["blocks"]
            if b["state"] == "active_allocated"}
    allocated: set[int] = set()
    for e in snapshot["device_traces"][0]:
        assert e["size"] > 0 and e["action"] in ("alloc", "free_requested", "free_completed")
        if e["action"] == "alloc":
            assert e["addr"] not in allocated
            allocated.add(e["addr"])
        elif e["action"] == "free_completed":
            allocated.discard(e["addr"])
    assert allocated <= live  # what was allocated in the trace and not freed is at the end


def test_an_offloaded_plans_snapshot_peaks_at_its_device_peak(facts):
    result = plan_from_facts(facts, PlanRequest(source=SOURCE, budget_bytes=2 * 10**6,
                                                  world_size=4, strategy="full",
                                                  allow_offload=True))
    assert result.plan.offload
    prediction = predict(result.plan, facts)
    timeline = plan_timeline(result.plan, facts, prediction)
    assert active_peak(predicted_snapshot(timeline)) == result.plan.predicted["peak_bytes"]


def test_the_measured_snapshot_peaks_at_fsdpmemtrackers_peak():
    """The recorded step replays to PyTorch's own measurement of the steady step, and the
    measured curve follows the predicted one boundary by boundary."""
    from fsdp_plan.api import make_plan
    from fsdp_plan.measure.memory import measure_peak
    from fsdp_plan.plan.emit import load_policy_module
    result = make_plan(PlanRequest(source=SOURCE, budget_bytes=10**8, world_size=4,
                                   strategy="full"))
    measured = measure_peak(result.loaded, result.plan,
                            load_policy_module(result.policy_source()), record=True)
    snapshot = measured_snapshot(measured.record)
    assert active_peak(snapshot) == measured.peak_bytes
    _check_snapshot_shape(snapshot)
    assert sum(e["size"] for e in measured.record.initial) == measured.step_start_bytes
    from fsdp_plan.pictures.series import measured_curve
    prediction = predict(result.plan, result.facts)
    series = step_series(plan_timeline(result.plan, result.facts, prediction),
                         prediction.candidate.time)
    xs, ys = measured_curve(measured.record, series)
    assert len(xs) > 20 and max(ys) == measured.peak_bytes
    assert xs == sorted(xs)


def test_the_more_memory_line_agrees_with_replanning_at_that_budget(facts):
    request = PlanRequest(source=SOURCE, budget_bytes=3_000_000, world_size=4, strategy="full")
    here = plan_from_facts(facts, request)
    frontier = compute_frontier([Variant(micro_batch=2, grad_accum_steps=1, facts=facts)],
                                request.settings(), seq_len=64)
    assert frontier.at_user_budget.name == here.best.name
    assert frontier.at_user_budget.step_s == here.best.time.step_s
    better = frontier.more_memory()
    assert better is not None and better.step_s < here.best.time.step_s
    again = plan_from_facts(facts, PlanRequest(source=SOURCE, budget_bytes=better.budget_bytes,
                                                 world_size=4, strategy="full"))
    assert (again.best.name, again.best.time.step_s) == (better.name, better.step_s)
    line = more_memory_line(frontier)
    gain = f"{better.step_s / here.best.time.step_s - 1:+.1%}"
    assert line.startswith("more memory: at ") and gain in line
    # the range starts where the smallest plan (all blocks checkpointed) fits, below which
    # nothing fits, and ends above the user's budget
    fits = [p for p in frontier.points if p.fits]
    assert fits[0] is frontier.points[0] and fits[0].full + fits[0].selective == 4
    assert fits[-1].budget_bytes > request.budget_bytes
    assert [p.budget_bytes for p in frontier.points] == sorted(p.budget_bytes
                                                               for p in frontier.points)
    assert frontier.plans_evaluated > 0 and frontier.searches >= len(frontier.points)


def test_round_budgets_are_round_and_inside_the_range():
    budgets = round_budgets(32_349_448_342, 177_387_661_462, 10)
    assert budgets[0] >= 32_349_448_342 and budgets[-1] <= 177_387_661_462
    assert all(b % 10**10 == 0 for b in budgets) and 5 <= len(budgets) <= 15


# --- the page in a browser --------------------------------------------------------------------

def _png_colours(path: Path) -> int:
    """Distinct RGB colours of an 8-bit RGB/RGBA PNG (zlib and the PNG filters, no PIL)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    previous = bytearray(stride)
    colours = set()
    for row in range(height):
        start = row * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = previous[i]
            c = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if row % 4 == 0:
            colours.update(bytes(line[i:i + 3]) for i in range(0, stride, channels * 4))
        previous = line
    return len(colours)


def _plotly_available() -> bool:
    try:
        import plotly  # noqa: F401
    except ImportError:
        return False
    return True


RECORDER = ("<script>window.__errors=[];window.onerror=function(m){window.__errors.push(String(m))};"
            "window.addEventListener('load',function(){setTimeout(function(){var d=document."
            "createElement('pre');d.id='fsdp-plan-check';d.textContent=JSON.stringify({errors:"
            "window.__errors,resources:performance.getEntriesByType('resource').map(function(r)"
            "{return r.name}),plots:document.querySelectorAll('.js-plotly-plot .main-svg')."
            "length});document.body.appendChild(d)},500)});</script>")


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "fsdp_plan.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900, check=False)


@pytest.mark.html
@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium")
@pytest.mark.skipif(not _plotly_available(), reason="needs the html extra (plotly)")
def test_the_html_page_renders_in_chromium_with_no_error_and_loads_nothing(tmp_path):
    page = tmp_path / "report.html"
    done = _run_cli(str(ROOT / "examples" / "llama.py"), "--model-arg", "size=tiny", "--seq-len",
                    "64", "--batch-size", "2", "--mem", "3MB", "--world-size", "4",
                    "--strategy", "full", "--html", str(page), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    import re
    # Outside the inlined scripts no tag or style names a URL (plotly.js's own code holds
    # map-tile and logo URLs that these plots never load: the browser check below says so).
    markup = re.sub(r"<script[^>]*>.*?</script>", "<script></script>", text, flags=re.DOTALL)
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", markup,
                         re.IGNORECASE)
    assert not re.search(r"""url\(\s*["']?\s*(?:https?:)?//|@import""", markup, re.IGNORECASE)
    assert not re.search(r"<script[^>]+src=", text, re.IGNORECASE)
    checked = tmp_path / "checked.html"
    checked.write_text(text.replace("<head>", "<head>" + RECORDER, 1))
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                          "--virtual-time-budget=5000", "--dump-dom", checked.as_uri()],
                         capture_output=True, text=True, timeout=120, check=False).stdout
    found = re.search(r'<pre id="fsdp-plan-check">(.*?)</pre>', dom, re.DOTALL)
    assert found, dom[-2000:]
    import html
    import json
    report = json.loads(html.unescape(found.group(1)))
    assert report["errors"] == [], report
    assert [r for r in report["resources"] if r.startswith(("http:", "https:"))] == []
    assert report["plots"] >= 3  # memory, frontier, timeline drawn
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                    f"--screenshot={shot}", "--window-size=1200,1600",
                    "--virtual-time-budget=5000", page.as_uri()],
                   capture_output=True, timeout=120, check=False)
    assert shot.exists()
    assert _png_colours(shot) > 50  # a blank page has one colour; plots have hundreds


def test_html_without_plotly_is_bad_input_naming_the_extra(tmp_path, monkeypatch, capsys):
    from fsdp_plan.cli.main import main
    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly raises ImportError
    page = tmp_path / "r.html"
    code = main([str(ROOT / "examples" / "llama.py"), "--model-arg", "size=tiny", "--mem", "3MB",
                 "--html", str(page), "--plan", str(tmp_path / "p.yaml")])
    assert code == 2
    assert "pip install 'fsdp-plan[html]'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# --- the snapshots of plan, verify and bench through the command line ------------------------

@pytest.mark.slow
def test_trace_plot_accepts_the_snapshots_of_plan_verify_and_bench(tmp_path):
    import torch.cuda._memory_viz as memory_viz
    done = _run_cli(str(ROOT / "examples" / "llama.py"), "--model-arg", "size=tiny", "--seq-len",
                    "64", "--batch-size", "2", "--mem", "20MB", "--world-size", "2",
                    "--strategy", "full", "--plan", "p.yaml", "--memory-snapshot", "plan.pickle",
                    "--format", "json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    predicted_peak = __import__("yaml").safe_load((tmp_path / "p.yaml").read_text())[
        "predicted"]["peak_bytes"]
    done = _run_cli("verify", "p.yaml", "--memory-snapshot", "verify.pickle", "--format", "json",
                    cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "verify:" not in done.stderr  # no progress under --format json
    verified = __import__("json").loads(done.stdout)["measured_peak_bytes"]
    done = _run_cli("bench", "p.yaml", "--nproc", "2", "--steps", "2", "--warmup", "1",
                    "--out", "results", "--memory-snapshot", "bench.pickle", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    peaks = {}
    for name in ("plan", "verify", "bench"):
        with open(tmp_path / f"{name}.pickle", "rb") as f:
            snapshot = pickle.load(f)
        assert "snapshot.pickle" in memory_viz.trace_plot(snapshot)
        peaks[name] = active_peak(snapshot)
    assert peaks == {"plan": predicted_peak, "verify": verified, "bench": verified}


# --- bench --compare and the noise ----------------------------------------------------------

def _result(median: float, steps: list[list[float]]) -> dict:
    return {"fsdp_plan_bench_version": 1, "plan": {"hash": "h"}, "run": {"torch": "t"},
            "collectives": {"measured": {"all_gather": 3}},
            "step_time": {"median_s": median, "p99_s": max(max(s) for s in steps),
                          "per_rank": [{"rank": i, "steps_s": s} for i, s in enumerate(steps)]},
            "memory": {"peak_bytes": 1000}, "comm": {"rank0": {"exposed_s": 0.1}}}


def test_compare_of_one_plan_on_a_busy_machine_is_within_noise():
    from fsdp_plan.bench.results import compare
    busy_a = [[1.0, 1.9, 1.1, 2.2, 1.05, 2.4, 1.2, 1.6]]  # steps of a shared machine
    busy_b = [[1.7, 2.9, 1.4, 1.8, 3.1, 1.6, 2.6, 1.5]]
    table, problems = compare(_result(1.0, busy_a), _result(1.62, busy_b), threshold=0.10)
    assert problems == [] and "within noise" in table and "+62.0%" in table
    quiet = [[1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.01]]
    table, problems = compare(_result(1.0, quiet), _result(1.5, [[t * 1.5 for t in quiet[0]]]),
                              threshold=0.10)
    assert problems == ["step time median regressed +50.0% (threshold 10%, noise ±4%)"]
    old = _result(1.0, quiet)
    grown = copy.deepcopy(old)
    grown["memory"]["peak_bytes"] = 2000  # memory does not vary between runs: no noise excuse
    assert compare(old, grown, threshold=0.10)[1] == [("peak memory regressed +100.0% "
                                                        "(threshold 10%)")]


# --- the text report's small fixes ----------------------------------------------------------

def test_small_sizes_and_flops_print_with_a_unit():
    from fsdp_plan.common.sizes import format_gb
    from fsdp_plan.plan.report import format_flops, plan_name_legend
    assert format_gb(62_550_637_716) == "62.55" and format_gb(4_293_092) == "4.29 MB"
    assert format_gb(1024) == "1.02 kB" and format_gb(0) == "0.00"
    assert format_flops(70.27e12) == "70.27 T" and format_flops(67_108_864) == "67.11 M"
    legend = plan_name_legend("full per-block+top keep-last fwp1 bwp1 ac23 sac57")
    for word in ("full =", "per-block+top =", "keep-last =", "fwp1 =", "bwp1 =", "ac23 =",
                 "sac57 ="):
        assert word in legend


def test_bench_says_which_way_the_measurement_is_off():
    from fsdp_plan.bench.results import _versus
    assert _versus(0.04031, 0.00329) == "measured 12.3x the predicted time"
    assert _versus(1.1, 1.0) == "measured 10.0% slower than predicted"
    assert _versus(0.9, 1.0) == "measured 10.0% faster than predicted"
