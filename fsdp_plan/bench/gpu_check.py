"""The prepared GPU check: one short run that holds predictions against a real GPU.

    python -m fsdp_plan.bench.gpu_check PLAN.yaml [PLAN.yaml ...] [--out benchmarks/results]

For each plan: the CUDA allocator's steady-step peak of rank 0 at the plan's real world size
(fake process group, real CUDA tensors; ``measure.allocator``), next to FSDPMemTracker's
figure (``measure.memory``) and the planner's prediction; then one real NCCL benchmark at
world 1 (``bench.timing``, the library behind ``fsdp-plan tune``). With ``--calibrate`` it first
runs ``fsdp-plan calibrate`` on every GPU (NCCL), writes the hardware file beside the result,
and records each plan's step time predicted at world 1 with that file next to the measured
one (issue 12: predicted vs measured on a real GPU). Writes
``gpu-check-<device>-<time>.json`` with the device name. Needs a GPU; nothing in the tests
runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from fsdp_plan.api import analyze_for_plan, predict
from fsdp_plan.bench.inputs import check_out_folder
from fsdp_plan.bench.results import DEFAULT_RESULTS_DIR, device_name, git_commit, plan_hash
from fsdp_plan.bench.timing import time_plans
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.files import atomic_write_text
from fsdp_plan.cost.hardware import Hardware, hardware_yaml
from fsdp_plan.measure import runtime
from fsdp_plan.measure.allocator import allocator_peak
from fsdp_plan.measure.calibrate import calibrate
from fsdp_plan.measure.peak import measured_peak
from fsdp_plan.plan.document import Mesh, read_plan


def check_plan(path: str) -> dict[str, Any]:
    """Allocator peak vs FSDPMemTracker vs prediction for one plan."""
    plan = read_plan(path)
    loaded = runtime.load_planned_model(plan, None, path)
    policy = runtime.load_policy(runtime.policy_source(plan))
    gpu = allocator_peak(loaded, plan, policy)
    # An offloaded plan's device peak has no CPU measurement (host and device are one memory
    # there): the allocator's figure is the only check of its prediction.
    offloaded = plan.offload is not None
    tracker = None if offloaded else measured_peak(loaded, plan, policy)
    tracker_peak = tracker.peak_bytes if tracker else None
    predicted = (plan.predicted or {}).get("peak_bytes")

    def rel(a: int | None, b: int) -> float | None:
        return None if a is None else round((a - b) / b, 4)
    return {"plan": path, "plan_hash": plan_hash(plan.to_dict()), "model": plan.model.to_dict(),
            "world_size": plan.world_size, "mesh": [plan.mesh.replicate, plan.mesh.shard],
            "allocator_peak_bytes": gpu.peak_bytes, "allocator_reserved_peak_bytes":
            gpu.reserved_peak_bytes, "allocator_step_start_bytes": gpu.step_start_bytes,
            "tracker_peak_bytes": tracker_peak, "predicted_peak_bytes": predicted,
            "tracker_vs_allocator": rel(tracker_peak, gpu.peak_bytes),
            "predicted_vs_allocator": rel(predicted, gpu.peak_bytes),
            "offload": plan.offload.to_dict() if plan.offload else None,
            "seconds": round(gpu.seconds + (tracker.seconds if tracker else 0.0), 2)}


def time_plan(path: str) -> dict[str, Any]:
    """One real NCCL run of the plan at world 1 (``bench.timing``): measured median step time
    beside the prediction. At world 1 there is no communication to wait for, so it checks
    the compute clock; the plan's own world size needs ``fsdp-plan bench`` under torchrun."""
    plan = read_plan(path)
    loaded = runtime.load_planned_model(plan, None, path)
    print(f"gpu_check: timing {path} on one GPU", file=sys.stderr, flush=True)
    times = time_plans(loaded.source, [plan], nproc=1, mesh=(1, 1), steps=10, warmup=3)[0][0]
    measured = statistics.median(times)
    predicted = (plan.predicted or {}).get("step_time_s")
    return {"plan": path, "nproc": 1, "step_times_s": times, "median_step_s": measured,
            "predicted_step_s_at_plan_world": predicted}


def predict_at_world(path: str, hardware: Hardware, world: int = 1) -> float:
    """The plan's step time predicted with ``hardware`` at ``world`` ranks of plain FSDP (what
    a world-1 bench measures: no communication to wait for)."""
    plan = read_plan(path)
    loaded = runtime.load_planned_model(plan, None, path)
    one = dataclasses.replace(plan, world_size=world, mesh=Mesh(replicate=1, shard=world),
                              strategy="full")
    facts = analyze_for_plan(one, loaded)
    return predict(one, facts, hardware=hardware, gpus_per_node=max(1, world)
                   ).predicted["step_time_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_plan.bench.gpu_check")
    parser.add_argument("plans", nargs="+", metavar="PLAN.yaml")
    parser.add_argument("--out", default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--no-bench", action="store_true", help="skip the NCCL world-1 bench")
    parser.add_argument("--calibrate", action="store_true",
                        help="calibrate the GPUs first and predict each plan with the result")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU.", file=sys.stderr)
        return 2
    try:
        check_out_folder(args.out)  # checked now, created only when the result is written
    except BadInput as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    checks = []
    for path in args.plans:
        print(f"gpu_check: allocator peak for {path}", file=sys.stderr, flush=True)
        checks.append(check_plan(path))
        print(json.dumps(checks[-1]), flush=True)
    calibration, hw_text = None, None
    if args.calibrate:
        print("gpu_check: calibrate (NCCL, every GPU)", file=sys.stderr, flush=True)
        hw, _raw = calibrate(nproc=torch.cuda.device_count(), backend="nccl")
        calibration = hw.to_dict()
        hw_text = hardware_yaml(hw, "Written by python -m fsdp_plan.bench.gpu_check --calibrate.")
    timings = [] if args.no_bench else [time_plan(path) for path in args.plans]
    if calibration is not None:
        for t in timings:
            t["predicted_step_s_calibrated_world1"] = predict_at_world(t["plan"], hw, 1)
            t["calibrated_error"] = round(t["predicted_step_s_calibrated_world1"]
                                          / t["median_step_s"] - 1, 4)
    doc = {"device_name": device_name(), "torch": torch.__version__, "git": git_commit(),
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "checks": checks,
           "timings": timings, "calibration": calibration}
    stem = device_name().replace(" ", "-").replace("/", "-")
    path = os.path.join(args.out, f"gpu-check-{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(args.out, exist_ok=True)
    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
    if hw_text is not None:
        atomic_write_text(path.removesuffix(".json") + ".hardware.yaml", hw_text)
    print(f"gpu_check: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
