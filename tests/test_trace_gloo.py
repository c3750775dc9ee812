"""``fsdp-plan trace`` on traces recorded here: DDP on gloo with 2 processes and a known model,
profiled by torch.profiler's own tensorboard_trace_handler (gzip), with no annotation of ours.
The buckets read back must be DDP's own (``_get_ddp_logging_data()["rebuilt_bucket_sizes"]``),
in its order, and ``--plan`` must name the ``bucket_cap_mb`` that built them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fsdp_plan.cli.main import main

MODEL = textwrap.dedent("""
    import torch

    def build_model():
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 10))

    def example_inputs(batch_size, seq_len):
        return (torch.randn(batch_size, 64),)
""")

RECORD = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from model import build_model

    def worker(rank, out, cap, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        torch.manual_seed(0)
        torch.set_num_threads(1)
        model = DDP(build_model(), bucket_cap_mb=cap)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(32, 64)
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=5, repeat=1)
        handler = torch.profiler.tensorboard_trace_handler(out, worker_name=f"rank{rank}",
                                                           use_gzip=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    schedule=schedule, on_trace_ready=handler,
                                    record_shapes=True) as prof:
            for _ in range(7):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        if rank == 0:
            sizes = model._get_ddp_logging_data()["rebuilt_bucket_sizes"]
            with open(os.path.join(out, "buckets.txt"), "w") as f:
                f.write(str(sizes))
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1], float(sys.argv[2]), int(sys.argv[3])), nprocs=2)
""")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp")
    (folder / "model.py").write_text(MODEL)
    (folder / "record.py").write_text(RECORD)
    traces = folder / "traces"
    port = 29600 + os.getpid() % 300
    subprocess.run([sys.executable, str(folder / "record.py"), str(traces), "0.1", str(port)],
                   check=True, timeout=300, capture_output=True)
    sizes = [int(s) for s in (traces / "buckets.txt").read_text().split(",")]
    (traces / "buckets.txt").unlink()
    return folder, traces, sizes


def _trace(capsys, *args):
    code = main(["trace", *map(str, args)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_buckets_are_ddps_own_in_its_order(recorded, capsys):
    _, traces, sizes = recorded
    assert len(sizes) == 2  # the cap of 0.1 MiB splits this model's 340 KB of gradients
    doc = json.loads(_trace(capsys, traces, "--format", "json"))
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert all(r["world_size"] == 2 and r["device"] == "cpu" for r in doc["ranks"])
    for rank in doc["ranks"]:
        # 5 profiled steps: the first dropped as warm-up, none cut off
        assert [s["step"] for s in rank["steps"]] == [2, 3, 4, 5]
        buckets = rank["ddp_buckets"]
        assert [b["bytes"] for b in buckets] == sizes
        assert all(b["ready_s"] <= b["start_s"] < b["end_s"] for b in buckets)
        assert buckets[0]["ready_s"] < buckets[1]["ready_s"]  # DDP's order: as they got ready
        for s in rank["steps"]:
            assert s["comm_s"] > 0 and s["backward_s"] > 0 and s["forward_s"] > 0
            parts = sum(s[k] for k in ("forward_s", "backward_s", "optimizer_s", "comm_tail_s",
                                       "idle_s"))
            assert parts == pytest.approx(s["step_s"], abs=1e-6)
        assert rank["step_s_p50"] <= rank["step_s_p99"]
    assert doc["bucket_cap_mb"] is None and doc["predicted"] is None
    assert sorted(s["rank"] for s in doc["stragglers"]) == [0, 1]


def test_plan_names_the_cap_that_built_them(recorded, capsys, tmp_path):
    folder, traces, sizes = recorded
    plan = tmp_path / "p.yaml"
    code = main([str(folder / "model.py"), "--mem", "1GB", "--world-size", "2",
                 "--optimizer", "sgd", "--param-dtype", "fp32", "--batch-size", "32",
                 "-o", str(tmp_path / "p.py"), "--plan", str(plan)])
    capsys.readouterr()
    assert code == 0
    doc = json.loads(_trace(capsys, traces, "--plan", plan, folder / "model.py",
                            "--format", "json"))
    low, high = doc["predicted"]["bucket_cap_mb_range"]
    assert low < 0.1 <= high  # the cap the run was made with
    assert low < doc["bucket_cap_mb"] <= high
    # DDP itself builds the measured buckets with the cap reported
    from fsdp_plan.cost.ddp_buckets import MIB, assign_by_size
    from fsdp_plan.cli.trace_plan import ready_ordered_sizes
    from fsdp_plan.plan.document import read_plan
    order = ready_ordered_sizes(read_plan(str(plan)), str(plan), str(folder / "model.py"))
    cap = int(doc["bucket_cap_mb"] * MIB)
    assert [sum(order[i] for i in g) for g in assign_by_size(order, [cap, cap])] == sizes
    assert doc["predicted"]["ddp_buckets"] == [sum(order)]  # the plan's own cap: 25 MiB
    table = _trace(capsys, traces, "--plan", plan, folder / "model.py")
    assert "bucket_cap_mb that built these buckets: 0.1" in table and "predicted" in table


def _shortest_all_reduce_us(traces: Path) -> dict[int, float]:
    """{bytes: shortest gloo:all_reduce} over both ranks' steps after the first, by hand; a
    record that ends after the next ProfilerStep began ends there (the host had moved on)."""
    import bisect
    import gzip
    shortest: dict[int, float] = {}
    for path in traces.glob("*.json.gz"):
        events = json.load(gzip.open(path))["traceEvents"]
        starts = sorted(e["ts"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
        for e in events:
            if e.get("name") == "gloo:all_reduce" and e["ts"] >= starts[1]:
                nbytes = e["args"]["Input Dims"][0][0] * 4  # float32
                later = starts[bisect.bisect_right(starts, e["ts"]):]
                end = min([e["ts"] + e["dur"], *later[:1]])
                shortest[nbytes] = min(shortest.get(nbytes, float("inf")), end - e["ts"])
    return shortest


def test_refit_writes_a_hardware_file_that_replays_the_collectives(recorded, capsys, tmp_path):
    _, traces, sizes = recorded
    hw_path = tmp_path / "hw.yaml"
    out = _trace(capsys, traces, "--refit", hw_path)
    assert f"wrote {hw_path}" in out
    from fsdp_plan.cost.hardware import hardware_for, read_hardware_file
    from fsdp_plan.cost.step_time import collective_time
    hw = hardware_for("h100", read_hardware_file(str(hw_path)))  # what --hardware reads
    fit = hw.collectives["all_reduce"]["2"]
    assert fit["latency_s"] > 0 and fit["bus_bandwidth"] > 0
    shortest = _shortest_all_reduce_us(traces)
    assert sorted(shortest) == sorted(sizes)
    (small, t_small), (large, t_large) = sorted(shortest.items())
    if t_large > t_small:  # two sizes, time rising with bytes: the line through both...
        bus = 2 * (2 - 1) / 2  # an all-reduce over 2 ranks moves this many bus bytes per byte
        slope = (t_large - t_small) * 1e-6 / (bus * (large - small))
        assert fit["bus_bandwidth"] == pytest.approx(1 / slope, rel=1e-3)
        if t_small * 1e-6 - slope * bus * small > 1e-9:
            for nbytes, us in shortest.items():
                predicted = collective_time(hw, nbytes, 2, "all_reduce") - hw.launch_overhead_s
                assert predicted == pytest.approx(us * 1e-6, rel=1e-3, abs=1e-7)
        else:  # ...unless it meets zero bytes below zero seconds (a loaded CPU slowed the
            # larger bucket): the latency's floor
            assert fit["latency_s"] == pytest.approx(1e-9)
    else:  # a loaded CPU made the smaller bucket slower: the start's latency is kept and the
        # largest size fixes the bandwidth
        assert fit["latency_s"] == hardware_for("h100").collective_latency_s
        assert fit["bus_bandwidth"] == pytest.approx(large / (t_large * 1e-6 - fit["latency_s"]),
                                                     rel=1e-6)
    assert "refit by fsdp-plan trace" in hw.source


FSDP_RECORD = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from model import build_model

    def worker(rank, out, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        torch.manual_seed(0)
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (2,))
        model = build_model()
        for i in (0, 2):
            fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(32, 64)
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=4, repeat=1)
        handler = torch.profiler.tensorboard_trace_handler(out, worker_name=f"rank{rank}")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    schedule=schedule, on_trace_ready=handler,
                                    record_shapes=True) as prof:
            for _ in range(6):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                prof.step()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
""")


def test_fsdp2_collectives_map_to_their_units(tmp_path, capsys):
    """FSDP2 (fully_shard on Linear 0, Linear 2 and the root) on gloo, plain .json traces:
    each unit's all-gathers and reduce-scatters are found from FSDP2's own annotations
    (gloo runs the reduce-scatter as an all-reduce; it is reported as the reduce-scatter)."""
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "record.py").write_text(FSDP_RECORD)
    traces = tmp_path / "traces"
    port = 29900 + os.getpid() % 90
    subprocess.run([sys.executable, str(tmp_path / "record.py"), str(traces), str(port)],
                   check=True, timeout=300, capture_output=True)
    from fsdp_plan.measure.trace_ranks import analyze_traces
    analysis = analyze_traces([str(traces)])
    assert [r.rank for r in analysis.ranks] == [0, 1]
    for rank in analysis.ranks:
        # the root keeps its parameters after forward: one all-gather; the others gather
        # again for backward; every unit reduce-scatters its gradients once
        assert rank.collectives_by_unit == {"": {"all_gather": 1, "reduce_scatter": 1},
                                            "0": {"all_gather": 2, "reduce_scatter": 1},
                                            "2": {"all_gather": 2, "reduce_scatter": 1}}
        assert rank.collectives_per_step == {"all_gather": 5, "reduce_scatter": 3}
        assert rank.ddp_buckets == []  # no all-reduce in backward: not DDP
    table = _trace(capsys, traces)
    assert "FSDP units: <root> all_gather 1, reduce_scatter 1; 0 all_gather 2" in table
