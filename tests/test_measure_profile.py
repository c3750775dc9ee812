"""Communication timing from hand-made traces, where hidden and exposed time are known."""

from __future__ import annotations

import json

import pytest

from fsdp_plan.measure.profile import analyze_trace


def X(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "cat": cat,
            "args": args}


def regions(fw=(0, 100), bw=(100, 300), opt=(300, 350)):
    return [X("fsdp_plan.step", 0, 350), X("fsdp_plan.forward", fw[0], fw[1] - fw[0]),
            X("fsdp_plan.backward", bw[0], bw[1] - bw[0]),
            X("fsdp_plan.optimizer", opt[0], opt[1] - opt[0])]


def test_cpu_trace_gloo_threads_against_aten_ops(tmp_path):
    events = regions() + [
        # compute on the main thread (tid 1): [0,60] forward, [120,200] and [210,260] backward
        X("aten::mm", 0, 60), X("aten::addmm", 10, 20),  # nested: counted once
        X("aten::mm", 120, 80), X("aten::mm", 210, 50),
        # the collective's own aten ops inside c10d:: calls are not compute
        X("c10d::_allgather_base_", 60, 30), X("aten::empty", 65, 10),
        # gloo threads: [50,90] half hidden under [0,60]; [150,190] hidden; [250,290] 10 hidden
        X("gloo:all_gather", 50, 40, tid=7), X("gloo:all_reduce", 150, 40, tid=7),
        X("gloo:all_reduce", 250, 40, tid=8),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    t = analyze_trace(str(path))
    assert t.source == "cpu" and t.num_comm_events == 3
    assert t.comm_s == pytest.approx(120e-6)
    assert t.exposed_s == pytest.approx((30 + 0 + 30) * 1e-6)
    assert t.hidden_s == pytest.approx(60e-6)
    assert t.compute_s == pytest.approx((60 + 80 + 50) * 1e-6)
    assert t.exposed_by_phase_s["forward"] == pytest.approx(30e-6)
    assert t.exposed_by_phase_s["backward"] == pytest.approx(30e-6)
    assert t.tail_exposed_s == pytest.approx((290 - 260) * 1e-6)
    assert t.step_s == pytest.approx(350e-6)


def test_gpu_trace_nccl_kernels_and_overlap_slowdown():
    # Kernels on stream tid 20 (compute) and 21 (NCCL); phases from their CPU launches.
    events = regions() + [
        X("cudaLaunchKernel", 5, 1, correlation=1, cat="cuda_runtime"),
        X("cudaLaunchKernel", 110, 1, correlation=2, cat="cuda_runtime"),
        X("cudaLaunchKernel", 120, 1, correlation=3, cat="cuda_runtime"),
        X("cudaLaunchKernel", 130, 1, correlation=4, cat="cuda_runtime"),
        X("cudaLaunchKernel", 140, 1, correlation=5, cat="cuda_runtime"),
        X("gemm", 10, 50, tid=20, cat="kernel", correlation=1),  # alone: 50
        X("gemm", 200, 80, tid=20, cat="kernel", correlation=3),  # overlapped: 30 too slow
        X("ncclDevKernel_AllGather_RING_LL", 150, 100, tid=21, cat="kernel", correlation=2),
        X("ncclDevKernel_ReduceScatter_RING_LL", 300, 40, tid=21, cat="kernel", correlation=4),
        X("gemm", 350, 50, tid=20, cat="kernel", correlation=5),  # alone: 50
    ]
    t = analyze_trace({"traceEvents": events})
    assert t.source == "gpu" and t.num_comm_events == 2
    assert t.comm_s == pytest.approx(140e-6)
    assert t.exposed_s == pytest.approx((50 + 40) * 1e-6)   # [150,200] and [300,340]
    assert t.exposed_by_phase_s["backward"] == pytest.approx(90e-6)
    assert t.tail_exposed_s == pytest.approx(0.0)  # a backward gemm ends after the last comm
    assert t.backward_overlap_slowdown_s == pytest.approx(30e-6)


def test_no_communication_means_nothing_exposed():
    t = analyze_trace({"traceEvents": regions() + [X("aten::mm", 0, 100)]})
    assert (t.comm_s, t.exposed_s, t.tail_exposed_s, t.num_comm_events) == (0.0, 0.0, 0.0, 0)
