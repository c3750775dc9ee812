"""``fsdp-plan trace`` refuses bad traces with one paragraph and exit 2, writing nothing; and
the interval sweeps it rests on agree with a brute-force grid."""

from __future__ import annotations

import gzip
import json
import random
import shutil
from pathlib import Path

import pytest

from fsdp_plan.cli.main import main
from fsdp_plan.measure import intervals, trace_read
from fsdp_plan.measure.trace_read import parse_trace_text

HTA = Path(__file__).parent / "data" / "hta"
GOOD = HTA / "sampled_rank-0.json.gz"


def _refused(capsys, tmp_path, *paths, match: str, extra=()):
    html = tmp_path / "out.html"
    code = main(["trace", *map(str, paths), "--html", str(html), *extra])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.startswith("fsdp-plan: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and match in err, err
    assert not html.exists()
    return err


def test_truncated_gzip(tmp_path, capsys):
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(GOOD.read_bytes()[:50_000])
    _refused(capsys, tmp_path, cut, match="damaged gzip")


def test_not_json_and_binary(tmp_path, capsys):
    text = tmp_path / "notes.json"
    text.write_text("this is not a trace\n")
    _refused(capsys, tmp_path, text, match="not a profiler trace")
    binary = tmp_path / "x.json"
    binary.write_bytes(bytes(range(256)) * 10)
    _refused(capsys, tmp_path, binary, match="neither JSON text nor gzip")
    half = tmp_path / "half.json"
    half.write_text(gzip.decompress(GOOD.read_bytes()).decode()[:200_000])
    _refused(capsys, tmp_path, half, match="not valid JSON")


def test_json_without_trace_events_or_work(tmp_path, capsys):
    other = tmp_path / "config.json"
    other.write_text(json.dumps({"model": "llama", "layers": [1, 2]}))
    _refused(capsys, tmp_path, other, match="no traceEvents list")
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": i * 10,
         "dur": 10, "pid": 1, "tid": 1} for i in range(3)]}))
    _refused(capsys, tmp_path, empty, match="no GPU kernels and no CPU operators")


def test_no_profiler_step_and_too_few_steps(tmp_path, capsys):
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5, "pid": 1, "tid": 1}]}))
    _refused(capsys, tmp_path, plain, match="no ProfilerStep#N")
    _refused(capsys, tmp_path, HTA / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz",
             match="none left once the first (warm-up)")


def test_mismatched_world_sizes_and_duplicate_ranks(tmp_path, capsys):
    data = json.loads(gzip.decompress(GOOD.read_bytes()))
    data["distributedInfo"]["world_size"] = 64
    other = tmp_path / "rank-1.json"
    other.write_text(json.dumps(data))
    _refused(capsys, tmp_path, GOOD, other, match="different world sizes")
    copy = tmp_path / "again.json.gz"
    shutil.copy(GOOD, copy)
    _refused(capsys, tmp_path, GOOD, copy, match="are both rank 0")


def test_huge_file_refused_before_parsing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trace_read, "MAX_TRACE_BYTES", 100_000)
    _refused(capsys, tmp_path, GOOD, match="more than")


def test_missing_paths_and_empty_folder(tmp_path, capsys):
    _refused(capsys, tmp_path, tmp_path / "nope.json", match="does not exist")
    folder = tmp_path / "empty"
    folder.mkdir()
    _refused(capsys, tmp_path, folder, match="holds no .json or .json.gz trace")


def _synthetic_text(events):
    """Kineto's layout (an event per line), one event with a list of objects over two lines
    and the device list after the events, so chunk boundaries fall inside both."""
    lines = [json.dumps(e) for e in events]
    lines[3] = lines[3][:-1] + ', "extra": [{"a": 1},\n  {"b": 2}]}'
    return ('{"schemaVersion": 1, "traceEvents": [\n' + ",\n".join(lines) + '\n],\n'
            '"deviceProperties": [{"name": "A"},\n  {"name": "B"}], "distributedInfo": '
            '{"rank": 3}}')


def test_streamed_reader_equals_json_load():
    """The chunked reader keeps exactly the events json.loads sees, in order, whatever the
    chunk size (boundaries land mid-array, inside nested lists and past the array's end)."""
    events = [{"ph": "X", "cat": "cpu_op" if i % 3 else "kernel", "name": f"op{i}", "ts": i,
               "dur": 1 + i % 5, "pid": 1, "tid": 1, "args": {"correlation": i}}
              for i in range(400)] + [{"ph": "i", "name": "marker"}, [1, 2]]
    text = _synthetic_text(events)
    want = [e for e in json.loads(text)["traceEvents"]
            if isinstance(e, dict) and e.get("ph") == "X"]
    for chunk in (1, 200, 1 << 12, 1 << 30):
        old = trace_read._CHUNK_CHARS
        trace_read._CHUNK_CHARS = chunk
        try:
            meta, kept = parse_trace_text(text)
        finally:
            trace_read._CHUNK_CHARS = old
        got = [k for k in kept if isinstance(k, trace_read.TraceEvent)]
        assert [(g.name, g.ts, g.dur, g.correlation) for g in got] == \
            [(e["name"], float(e["ts"]), float(e["dur"]), e["args"]["correlation"]) for e in want]
        assert meta["distributedInfo"]["rank"] == 3
        assert [d["name"] for d in meta["deviceProperties"]] == ["A", "B"]


def _grid(sets, size):
    masks = []
    for s in sets:
        m = [False] * size
        for a, b in s:
            for t in range(a, b):
                m[t] = True
        masks.append(m)
    return masks


def test_sweeps_match_a_grid():
    rng = random.Random(26)
    for _ in range(300):
        raw = [[(a, a + rng.randint(0, 9)) for a in (rng.randint(0, 60) for _ in range(
            rng.randint(0, 12)))] for _ in range(2)]
        a, b = intervals.union(raw[0]), intervals.union(raw[1])
        ga, gb = _grid(raw, 80)
        both = [x and y for x, y in zip(ga, gb)]
        only = [x and not y for x, y in zip(ga, gb)]
        assert intervals.length(a) == sum(ga)
        assert intervals.length(intervals.intersect(a, b)) == sum(both)
        assert intervals.length(intervals.minus(a, b)) == sum(only)
        lo, hi = sorted(rng.sample(range(80), 2))
        assert intervals.length(intervals.clip(a, lo, hi)) == sum(ga[lo:hi])
        cover = intervals.Cover(b)
        for start, end in raw[0]:
            if end > start:
                assert cover.overlaps(start, end) == any(gb[start:end])


def _kernel_trace(with_correlation: bool, drop_last_kernel: bool = False) -> dict:
    """Three steps, each launching a gemm and an all-reduce from the main thread."""
    events, n = [], 0
    for step in range(3):
        t0 = step * 1000
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}",
                       "ts": t0, "dur": 100, "pid": 1, "tid": 1})
        for offset, name, dur in ((10, "gemm", 300),
                                  (20, "ncclDevKernel_AllReduce_Sum_f32", 400)):
            n += 1
            launch = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                      "ts": t0 + offset, "dur": 5, "pid": 1, "tid": 1, "args": {}}
            stream = 7 if name == "gemm" else 8
            kernel = {"ph": "X", "cat": "kernel", "name": name, "ts": t0 + 200 + offset * 10,
                      "dur": dur, "pid": 0, "tid": stream,
                      "args": {"stream": stream, "In msg nelems": 256, "dtype": "Float"}}
            if with_correlation:
                launch["args"]["correlation"] = kernel["args"]["correlation"] = n
            else:  # only the ac2g flow ties them, as in traces that drop args.correlation
                events += [{"ph": "s", "cat": "ac2g", "id": n, "pid": 1, "tid": 1,
                            "ts": launch["ts"]},
                           {"ph": "f", "cat": "ac2g", "id": n, "pid": 0, "tid": stream,
                            "ts": kernel["ts"], "bp": "e"}]
            events.append(launch)
            if not (drop_last_kernel and step == 2 and name == "gemm"):
                events.append(kernel)
    return {"traceEvents": events, "distributedInfo": {"rank": 0, "world_size": 1}}


def test_flow_events_tie_kernels_to_launches_like_correlation(tmp_path):
    from fsdp_plan.measure.trace_ranks import analyze_traces
    docs = []
    for flag in (True, False):
        path = tmp_path / f"t{flag}.json"
        path.write_text(json.dumps(_kernel_trace(flag)))
        docs.append(analyze_traces([str(path)]).to_document()["ranks"][0])
    assert docs[0]["steps"] == docs[1]["steps"]
    step = docs[0]["steps"][0]
    # window [end of step 0's work = 800, 1800]: gemm [1300,1600], all-reduce [1400,1800]
    assert [s["step"] for s in docs[0]["steps"]] == [1, 2]
    assert step["step_s"] == pytest.approx(1000e-6)
    assert step["comm_s"] == pytest.approx(400e-6)
    assert step["hidden_comm_s"] == pytest.approx(200e-6)
    assert step["exposed_comm_s"] == pytest.approx(200e-6)
    assert step["idle_s"] == pytest.approx(500e-6)  # [800,1300]; launches at 1010/1020
    assert step["host_wait_s"] == pytest.approx(210e-6)  # [800,1010]: nothing launched yet


def test_a_cut_off_last_step_is_dropped(tmp_path):
    from fsdp_plan.measure.trace_ranks import analyze_traces
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(_kernel_trace(True, drop_last_kernel=True)))
    rank = analyze_traces([str(path)]).to_document()["ranks"][0]
    assert [s["step"] for s in rank["steps"]] == [1]  # step 2 launched a gemm never traced
