"""One benchmark rank: apply the plan to the real model and measure stable training steps.

Run by ``fsdp-plan bench`` on ``--nproc`` local workers, or directly under ``torchrun`` on
any number of machines (each rank reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``)::

    torchrun --nnodes 2 --nproc-per-node 8 ... -m fsdp_plan.cli.bench_worker PLAN.yaml [MODEL] \
        [--steps 20] [--warmup 3] [--fsdp1] [--out benchmarks/results]

Steps, in order: ``warmup`` steps (lazy initialisation, optimizer states, allocator warm-up)
that nothing measures; one step counted with ``CollectiveCounter`` (forward + backward, SPEC
5); ``steps`` timed steps (peak memory too on GPU); ``PROFILED_STEPS`` steps under
``torch.profiler``, read as ``fsdp-plan trace`` reads any run (measure/profile.py [Note:
bench's figures are the trace verb's]); with ``--baseline no-overlap``, the profiled steps
once more with communication held (measure/no_overlap.py). The counting and profiling steps
are kept out of the timings: both slow every op down.
Each rank's figures are gathered to rank 0, which returns (or, under torchrun, writes) them.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from fsdp_plan.common.autocast import autocast_context
from fsdp_plan.measure import runtime
from fsdp_plan.measure.collectives import CollectiveCounter
from fsdp_plan.measure.ddp import buckets_in_use, peak_of_step
from fsdp_plan.measure.launch import WorkerContext, maybe_inject_fault
from fsdp_plan.measure.no_overlap import hold_communication
from fsdp_plan.measure.profile import bench_figures
from fsdp_plan.measure.worker_setup import (
    PlannedWorker,
    build_planned_worker,
    end_worker_process_group,
    init_worker_process_group,
)
from fsdp_plan.model.load import load_model
from fsdp_plan.model.source import ModelSource


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _without_profiler_chatter(folder: str, rank: int) -> Iterator[None]:
    """Keep Kineto's ``USDT: ... profiler_start/stop`` lines (written by C++ straight to file
    descriptor 2, one pair per rank) off the user's terminal; every other line written
    meanwhile is passed on."""
    path = os.path.join(folder, f"rank{rank}.stderr.txt")
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "wb") as capture:
            os.dup2(capture.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)
        with contextlib.suppress(OSError):
            with open(path, "rb") as f:
                kept = [line for line in f if not line.startswith(b"USDT:")]
            os.unlink(path)
            if kept:
                sys.stderr.write(b"".join(kept).decode("utf-8", "replace"))
                sys.stderr.flush()


@dataclass
class _Steps:
    """One rank's planned model and its step counter: each step is announced to the launcher
    (progress) and numbered, which is where a test's fault is injected."""

    ctx: WorkerContext
    worker: PlannedWorker
    total: int
    number: int = 0

    def begin(self, phase: str) -> None:
        self.number += 1
        maybe_inject_fault(self.ctx.rank, self.number)
        self.ctx.report(phase=phase, step=self.number, steps=self.total)

    def micro_batches(self, before_each: Any = None) -> None:
        """Forward and backward of every micro-batch of one optimizer step (SPEC 6);
        ``before_each(index)`` runs before each (``peak_of_step``'s tracker reset)."""
        w = self.worker
        runtime.micro_batches(w.model, w.loaded, w.inputs, w.policy, before_each)

    def finish(self) -> None:
        runtime.finish_step(self.worker.model, self.worker.optimizer)


def _timed_steps(steps: _Steps, count: int) -> tuple[list[float], int | None]:
    """Seconds of ``count`` whole steps, each bracketed by a device sync, and the allocator's
    peak over them (a GPU; ``None`` on a CPU)."""
    device = steps.worker.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(count):
        steps.begin("timed")
        _sync(device)
        t0 = time.perf_counter()
        steps.micro_batches()
        steps.finish()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times, torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


PROFILED_STEPS = 3
"""Steps recorded under the profiler (after one the profiler runs unrecorded, its own warm-up):
the trace analysis drops the first as warm-up, the median of the others is bench's profiled
step."""


def profiled_steps(worker: PlannedWorker, folder: str, rank: int, name: str = "trace") -> str:
    """``PROFILED_STEPS`` steps under ``torch.profiler``, each closed by ``prof.step()`` (its
    ``ProfilerStep#N``, what the trace analysis cuts steps by); the Chrome trace's path.
    ``fsdp_plan.step`` marks each step for the side-by-side trace."""
    device = worker.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace_path = os.path.join(folder, f"rank{rank}.{name}.json")
    with (_without_profiler_chatter(folder, rank),
          profile(activities=activities, record_shapes=True,
                  schedule=schedule(wait=0, warmup=1, active=PROFILED_STEPS, repeat=1),
                  on_trace_ready=lambda p: p.export_chrome_trace(trace_path)) as prof):
        for _ in range(1 + PROFILED_STEPS):
            with record_function("fsdp_plan.step"):
                args, kwargs = worker.inputs
                with autocast_context(runtime.policy_autocast_dtype(worker.policy),
                                      device.type):
                    loss = worker.loaded.compute_loss(worker.model(*args, **kwargs))
                loss.backward()
                runtime.finish_step(worker.model, worker.optimizer)
                _sync(device)
            prof.step()
    return trace_path


def _snapshot_step(steps: _Steps, folder: str, rank: int) -> str | None:
    """One more steady step, run by every rank, while rank 0 records the CUDA allocator
    (``--memory-snapshot`` on GPUs); the path of rank 0's ``torch.cuda.memory._snapshot()``
    pickle."""
    steps.begin("memory snapshot")
    if rank == 0:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    steps.micro_batches()
    steps.finish()
    _sync(steps.worker.device)
    if rank != 0:
        return None
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    path = os.path.join(folder, "rank0.snapshot.pickle")
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return path


def _compiled_graphs(worker: PlannedWorker) -> int | None:
    """For a plan with compiled blocks (issue 22): how many graphs AOTAutograd compiled in this
    process (each a forward and backward pair, by inductor as in training; one per block class
    unless guards recompile); None for an eager plan.
    The blocks are compiled with ``fullgraph=True``, so a block either runs its compiled graph
    or the step fails: a count above zero says the measured steps ran compiled blocks."""
    if not (worker.policy.PLAN or {}).get("compile"):
        return None
    from torch._dynamo.utils import counters
    return int(counters["aot_autograd"]["total"])


def held_run(worker: PlannedWorker, folder: str, rank: int) -> dict[str, Any]:
    """``--baseline no-overlap``: the profiled steps again with communication held off the
    backward's compute (measure/no_overlap.py); their figures as the plan's own are read."""
    how = hold_communication(worker.model)
    trace_path = profiled_steps(worker, folder, rank, name="held.trace")
    comm, phases = bench_figures(trace_path)
    return {"kind": "no-overlap", "how": how, "comm": comm.to_dict(), "phases_s": phases,
            "trace": trace_path}


def bench_rank(ctx: WorkerContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Measure this rank; rank 0 returns every rank's figures under ``ranks``."""
    ctx.report(phase="imported")
    device = init_worker_process_group(ctx.local_rank)
    ctx.report(phase="process group up")
    worker = build_planned_worker(load_model(ModelSource(**payload["source"])), device,
                                  policy_source=payload["policy_source"], mesh=payload["mesh"],
                                  fsdp_version=payload["fsdp_version"],
                                  optimizer=payload["optimizer"], rank=ctx.rank)
    ctx.report(phase="model built")
    warmup, count = int(payload["warmup"]), int(payload["steps"])
    snapshot_step = bool(payload.get("memory_snapshot")) and device.type == "cuda"
    held = payload.get("baseline") == "no-overlap"
    ddp = worker.model if hasattr(worker.model, "_get_ddp_logging_data") else None
    # a DDP plan's steady step is its third: [Note: DDP's bucket rebuild] (measure/ddp.py)
    warm = max(warmup, 2 if ddp is not None else 0)
    steps = _Steps(ctx=ctx, worker=worker, total=warm + count + 2 + snapshot_step + held)

    for _ in range(warm):
        steps.begin("warm-up")
        steps.micro_batches()
        steps.finish()
    _sync(device)

    steps.begin("count")
    with CollectiveCounter() as counter:
        steps.micro_batches()
    steps.finish()
    counts = counter.counts()

    times, peak = _timed_steps(steps, count)
    peak_source, ddp_buckets = None, None
    if ddp is not None:  # a DDP plan: the buckets DDP really built
        ddp_buckets = buckets_in_use(ddp)
        if device.type != "cuda":  # no allocator peak: MemTracker over one more steady step
            peak, _ = peak_of_step(ddp, worker.optimizer, steps.micro_batches, worker.inputs)
            peak_source = ("MemTracker over a steady step of this real gloo run (a DDP rank "
                           "holds the whole model at any world size)")

    snapshot = (_snapshot_step(steps, payload["trace_dir"], ctx.rank) if snapshot_step
                else None)
    steps.begin("profile")
    trace_path = profiled_steps(worker, payload["trace_dir"], ctx.rank)
    comm, phases = bench_figures(trace_path)
    mine = {"rank": ctx.rank, "counts": counts, "step_times_s": times,
            "peak_bytes": peak, "comm": comm.to_dict(),
            "phases_s": phases, "trace": trace_path, "device": str(device),
            "peak_source": peak_source, "ddp_buckets": ddp_buckets, "snapshot": snapshot,
            "compiled_graphs": _compiled_graphs(worker)}
    if payload.get("baseline") == "no-overlap":  # last: the plan's own steps are all done
        steps.begin("profile, communication held")
        mine["baseline"] = held_run(worker, payload["trace_dir"], ctx.rank)
    ctx.report(phase="done", step=steps.total, steps=steps.total)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    dist.barrier()
    end_worker_process_group()
    return {"ranks": gathered} if ctx.rank == 0 else {"rank": ctx.rank}
