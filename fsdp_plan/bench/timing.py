"""Time several plans of one model on one set of real workers (start-up paid once).

``fsdp-plan tune`` compares neighbouring plans, so each is built from the same seed, fed the
same data and timed the same way: warm-up steps excluded, then ``steps`` whole optimizer
steps (every micro-batch and the optimizer step), each bracketed by a device sync.

[Note: interleaved timing]
Plans timed one after another see different machines when the machine drifts: on a shared
2-core host the same GPT-2 plan measured 2.5 s and 3.2 s twenty minutes apart, far more than
the 2-5% that separates the plans being ranked. ``interleave=True`` builds every plan's model
first and then runs one step of each in turn, so drift lands on all of them alike and their
medians can be ranked (a paired comparison). It holds every model at once: for small models
(the CPU closed loop), not for a large model on a full GPU.

[Note: the baseline and its held twin in one launch]
``tune``'s first round (bench/tune_stages.py [Note: the tuning order]) times the plan as given
and then, on the same workers, profiles it as ``bench --baseline no-overlap`` does
(bench/worker.py ``profiled_steps``, then ``held_run``: communication held until backward
compute is done, measure/no_overlap.py): the timed steps come first, since profiling slows
every op, and the held run last, since holding cannot be undone on a built model. Rank 0's
two profiled runs give the overlap verdict (bench/overlap.py ``overlap_figures``).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from fsdp_plan.bench.worker import held_run, profiled_steps
from fsdp_plan.measure import runtime
from fsdp_plan.measure.launch import launch
from fsdp_plan.measure.profile import bench_figures
from fsdp_plan.measure.worker_setup import (
    build_planned_worker,
    end_worker_process_group,
    init_worker_process_group,
    source_payload,
)
from fsdp_plan.model.load import load_model
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.document import Plan


def _time_worker(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Worker target: for each job, build the planned model and time its steady steps
    (``times``); with ``held_twin``, the one job then profiled as written and with its
    communication held (``overlap``: [Note: the baseline and its held twin in one launch])."""
    device = init_worker_process_group(ctx.local_rank)
    loaded = load_model(ModelSource(**payload["source"]))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    def time_step(worker: Any) -> float:
        sync()
        started = time.perf_counter()
        runtime.micro_batches(worker.model, worker.loaded, worker.inputs, worker.policy)
        runtime.finish_step(worker.model, worker.optimizer)
        sync()
        return time.perf_counter() - started

    def build(n: int, job: dict[str, Any]) -> Any:
        ctx.report(phase="plan", step=n + 1, steps=len(payload["jobs"]))
        return build_planned_worker(loaded, device, policy_source=job["policy_source"],
                                    mesh=job["mesh"], fsdp_version=2,
                                    optimizer=job["optimizer"], rank=ctx.rank)

    results: list[list[float]] = []
    overlap = None
    if payload.get("held_twin"):  # [Note: the baseline and its held twin in one launch]
        worker = build(0, payload["jobs"][0])
        times = [time_step(worker) for _ in range(payload["warmup"] + payload["steps"])]
        results.append(times[payload["warmup"]:])
        folder = payload["trace_dir"]
        overlapped_comm, overlapped_phases = bench_figures(
            profiled_steps(worker, folder, ctx.rank))
        overlap = {"overlapped": {"comm": overlapped_comm.to_dict(),
                                  "phases_s": overlapped_phases},
                   "held": held_run(worker, folder, ctx.rank)}
        del worker
    elif payload.get("interleave"):  # [Note: interleaved timing]
        workers = [build(n, job) for n, job in enumerate(payload["jobs"])]
        for worker in workers:
            for _ in range(payload["warmup"]):
                time_step(worker)
        results = [[] for _ in workers]
        for _ in range(payload["steps"]):
            for times, worker in zip(results, workers):
                times.append(time_step(worker))
        del workers
    else:
        for n, job in enumerate(payload["jobs"]):
            worker = build(n, job)
            times = [time_step(worker) for _ in range(payload["warmup"] + payload["steps"])]
            results.append(times[payload["warmup"]:])
            del worker
    end_worker_process_group()
    return {"times": results, "overlap": overlap}


def time_plans(source: ModelSource, plans: list[Plan], *, nproc: int, mesh: tuple[int, int],
               steps: int, warmup: int, timeout_s: float = 300.0,
               interleave: bool = False) -> list[list[list[float]]]:
    """Per plan, per rank, the steady steps' seconds; ``interleave`` times the plans' steps in
    turn on models built side by side ([Note: interleaved timing])."""
    jobs = [{"policy_source": runtime.policy_source(plan), "mesh": list(mesh),
             "optimizer": plan.optimizer} for plan in plans]
    payload = {"source": source_payload(source), "jobs": jobs, "steps": steps,
               "warmup": warmup, "interleave": interleave}
    per_rank = launch("fsdp_plan.bench.timing:_time_worker", payload, nproc=nproc,
                      timeout_s=timeout_s)
    return [[rank_result["times"][i] for rank_result in per_rank] for i in range(len(plans))]


def time_with_held_twin(source: ModelSource, plan: Plan, *, nproc: int,
                        mesh: tuple[int, int], steps: int, warmup: int,
                        timeout_s: float = 300.0
                        ) -> tuple[list[list[float]], dict[str, Any], dict[str, Any]]:
    """``plan`` timed as ``time_plans`` times it, then profiled as written and with its
    communication held, on the same workers ([Note: the baseline and its held twin in one
    launch]): per rank the steady steps' seconds, and rank 0's two profiled runs (each
    ``{"comm": ..., "phases_s": ...}``, the held one with ``how``), as
    bench/overlap.py ``overlap_figures`` reads them."""
    job = {"policy_source": runtime.policy_source(plan), "mesh": list(mesh),
           "optimizer": plan.optimizer}
    folder = tempfile.mkdtemp(prefix="fsdp-plan-traces-")
    try:
        payload = {"source": source_payload(source), "jobs": [job], "steps": steps,
                   "warmup": warmup, "held_twin": True, "trace_dir": folder}
        per_rank = launch("fsdp_plan.bench.timing:_time_worker", payload, nproc=nproc,
                          timeout_s=timeout_s)
    finally:  # the traces were read on the workers; nothing of them is kept
        shutil.rmtree(folder, ignore_errors=True)
    overlap = per_rank[0]["overlap"]
    return [r["times"][0] for r in per_rank], overlap["overlapped"], overlap["held"]
