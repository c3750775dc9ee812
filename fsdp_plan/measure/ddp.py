"""Ground truth for DDP plans: the buckets DDP really builds, its collectives, step time and peak.

``measure_ddp_many(jobs, nproc=2)`` runs every job on one set of gloo workers (start-up is
paid once, as ``count_collectives_many`` does). Each job builds the real model, applies
``DistributedDataParallel`` (through a plan's policy module, ``apply_ddp``, or with explicit
keyword arguments), and then:

1. runs one step (the reducer records the order gradients became ready);
2. runs a second step, whose forward rebuilds the buckets;
3. counts one more forward + backward with ``CollectiveCounter`` (``c10d.allreduce_``) and
   reads the buckets in use (see [Note: DDP's bucket rebuild]), unless the job asks for its
   peak alone (``memory_only``: verify's real run, a step shorter);
4. times ``steps`` further steps, and measures the peak of one steady step with
   ``MemTracker`` (see [Note: DDP peak on a CPU]).

[Note: DDP's bucket rebuild]
DDP first buckets the gradients in the parameters' order, records the order in which they
become ready during the first backward, and rebuilds its buckets in that order in the second
forward, broadcasting the new assignment from rank 0 (two more broadcasts). The step training
repeats, with the buckets and collectives it keeps, is therefore the third: every count of a
DDP plan (here, ``measure/collectives.py``, ``bench/worker.py``) warms up two steps. The
logger holds ``_get_ddp_logging_data()["rebuilt_bucket_sizes"]`` (bytes, comma separated)
from the forward after the rebuild, not from the rebuild itself; a DDP that never rebuilds
(``find_unused_parameters``) keeps its first bucketing, ``bucket_sizes`` (``buckets_in_use``).

[Note: DDP peak on a CPU]
A DDP rank holds the whole model whatever the world size, so a real run at world size 1 or 2
has exactly the per-rank memory of the planned job (no fake process group needed, unlike
FSDP, whose shards depend on the world size). ``torch.distributed._tools.mem_tracker
.MemTracker`` (FSDPMemTracker's base class) counts every tensor storage created under it by
category (parameters, gradients, optimizer states, activations, temporaries); the model,
DDP's bucket storage and the optimizer states exist before the measured step, so they are
registered with ``track_external`` (the buckets through the gradients that view them, and
``reducer``-owned tensors otherwise invisible are added from the logging data's bucket bytes
only if not seen). Its peak over the second steady step is the truth the prediction is
held against. ``torch.cuda.max_memory_allocated`` would be the GPU equivalent. The optimizer
step is measured as a GPU runs it: a GPU's AdamW takes the foreach path by default (one
gradient-sized temporary, which the model predicts), a CPU's loops per tensor, so
``peak_of_step`` turns ``foreach`` on for the measured step.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_plan.common.autocast import autocast_context, plan_autocast_dtype
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.cost.memory_categories import mem_tracker_to_breakdown
from fsdp_plan.measure import runtime
from fsdp_plan.measure.collectives import CollectiveCounter
from fsdp_plan.measure.launch import launch
from fsdp_plan.measure.measured import MeasuredMemory
from fsdp_plan.measure.worker_setup import (
    end_worker_process_group,
    init_worker_process_group,
    source_payload,
)
from fsdp_plan.model.load import LoadedModel, load_model
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.document import Plan


def _bucket_sizes(ddp: Any, key: str = "rebuilt_bucket_sizes") -> list[int]:
    data = ddp._get_ddp_logging_data()
    text = str(data.get(key, "") or "")
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def _run_job(job: dict[str, Any], loaded: Any, device: Any, rank: int) -> dict[str, Any]:
    """One job on this rank: see the module docstring for the steps."""
    model = runtime.build_real_model(loaded, device)
    if job.get("policy_source"):
        policy = runtime.load_policy(job["policy_source"])
        ddp = policy.apply_ddp(model)
        optimizer = runtime.plan_optimizer(policy, ddp)
    else:
        ddp = DDP(model, **job["ddp_kwargs"])
        optimizer = runtime.make_optimizer(job.get("optimizer", "adamw"), ddp.parameters())
    torch.manual_seed(1 + rank)
    src = loaded.source
    inputs = runtime.to_device(loaded.make_inputs(src.batch_size, src.seq_len), device)

    def forward_backward(before_each: Any = None) -> None:
        """One micro-batch (``before_each``: peak_of_step's hook, unused for one)."""
        # a DDP plan computing below float32 runs its forward under autocast (apply_ddp's note)
        args, kwargs = inputs
        with autocast_context(job.get("autocast"), device.type):
            loss = loaded.compute_loss(ddp(*args, **kwargs))
        loss.backward()

    def step() -> None:
        forward_backward()
        runtime.finish_step(ddp, optimizer)
    step()
    step()  # its forward rebuilds the buckets: see [Note: DDP's bucket rebuild]
    counts: dict[str, int] = {}
    first: list[int] = []
    rebuilt: list[int] = []
    hook_all_reduces = 0
    if not job.get("memory_only"):  # verify's peak reads none of it: a whole step spared
        with CollectiveCounter() as counter, _python_all_reduces() as hook_calls:
            forward_backward()
        runtime.finish_step(ddp, optimizer)
        counts, hook_all_reduces = counter.counts(), len(hook_calls)
        first = _bucket_sizes(ddp, "bucket_sizes")
        rebuilt = buckets_in_use(ddp)
    times = []
    for _ in range(int(job.get("steps", 0))):
        dist.barrier()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    peak, breakdown = (peak_of_step(ddp, optimizer, forward_backward, inputs) if job.get("memory")
                       else (None, {}))
    return {"rebuilt_bucket_sizes": rebuilt, "bucket_sizes": first, "counts": counts,
            "step_times_s": times, "peak_bytes": peak, "peak_breakdown": breakdown,
            "comm_hook": registered_hook(ddp), "hook_all_reduces": hook_all_reduces}


@contextlib.contextmanager
def _python_all_reduces() -> Any:
    """Every ``torch.distributed.all_reduce`` called from Python while the block runs, from any
    thread. A communication hook's all-reduces go through it, and on gloo PowerSGD issues its P
    and Q all-reduces from the callbacks gloo runs on its own thread, where ``CommDebugMode``
    (a thread-local dispatch mode) does not see them: whether it counted 1 or 3 per bucket
    depended on whether the first all-reduce had finished before its callback was attached."""
    calls: list[int] = []
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)
    dist.all_reduce = counted
    try:
        yield calls
    finally:
        dist.all_reduce = original


def registered_hook(ddp: Any) -> dict[str, Any] | None:
    """The communication hook DDP runs and what it keeps: the hook's name, and for PowerSGD
    its rank, start iteration and the bytes of its error, P and Q tensors (the state
    cost/comm_hooks.py ``hook_state_bytes`` predicts)."""
    hooks = getattr(ddp, "_comm_hooks", None) or []
    if not hooks:
        return None
    hook, state = hooks[-1]
    out: dict[str, Any] = {"hook": getattr(hook, "__name__", repr(hook))}
    if state is not None and hasattr(state, "error_dict"):
        def nbytes(tensors: dict) -> int:
            return sum(t.numel() * t.element_size() for t in tensors.values())
        out.update(rank=state.matrix_approximation_rank, start_iter=state.start_powerSGD_iter,
                   state_bytes=nbytes(state.error_dict) + nbytes(state.p_memory_dict)
                   + nbytes(state.q_memory_dict))
    return out


def _ddp_worker(ctx: Any, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Worker target: each job's buckets in use, counts, step time and peak."""
    device = init_worker_process_group(ctx.local_rank)
    models: dict[str, Any] = {}
    results = []
    for job in payload["jobs"]:
        ctx.report(phase="job", step=len(results) + 1, steps=len(payload["jobs"]))
        key = repr(sorted(job["source"].items()))
        if key not in models:
            models[key] = load_model(ModelSource(**job["source"]))
        results.append(_run_job(job, models[key], device, ctx.rank))
    dist.barrier()
    end_worker_process_group()
    return results


TRACKER_TO_PLAN = mem_tracker_to_breakdown()
"""``MemTracker``'s categories -> the DDP prediction's breakdown keys (cost/memory_categories.py)."""


def peak_of_step(ddp: Any, optimizer: Any, forward_backward: Any, inputs: Any = None
                 ) -> tuple[int, dict[str, int]]:
    """Peak of one steady step (optimizer step, forward, backward, optimizer step) under
    ``MemTracker``, and its categories at that peak (``TRACKER_TO_PLAN`` keys).

    Registered first, while the gradients exist: the model, its gradients (under
    ``gradient_as_bucket_view`` views of DDP's bucket storage, which the reducer allocated
    before and the tracker would otherwise never see), the optimizer states and the inputs.
    ``forward_backward(before_each)`` runs one step's micro-batches, calling
    ``before_each(index)`` before each: a later one resets the tracker's module statistics,
    without which ``MemTracker`` refuses the root's second forward (the peak is kept)."""
    forward_backward()
    tracker = MemTracker()

    def before_each(index: int) -> None:
        if index:
            tracker.reset_mod_stats()
    tensors = []
    if inputs is not None:
        args, kwargs = inputs
        tensors = [t for t in (*args, *kwargs.values()) if hasattr(t, "untyped_storage")]
    tracker.track_external(ddp, *([optimizer] if optimizer is not None else []), *tensors)
    # the GPU's optimizer step (foreach), see [Note: DDP peak on a CPU]
    saved = [group.get("foreach") for group in optimizer.param_groups] if optimizer else []
    for group in optimizer.param_groups if optimizer else []:
        if "foreach" in group:
            group["foreach"] = True
    with tracker:
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        forward_backward(before_each)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for group, foreach in zip(optimizer.param_groups if optimizer else [], saved):
        if "foreach" in group:
            group["foreach"] = foreach
    snapshot = tracker.get_tracker_snapshot("peak")
    by_device = max(snapshot.values(), key=lambda d: d.get("Total", 0))
    breakdown: dict[str, int] = {}
    for category, nbytes in by_device.items():
        name = str(getattr(category, "value", category))
        if name != "Total" and nbytes:
            key = TRACKER_TO_PLAN.get(name, name)
            breakdown[key] = breakdown.get(key, 0) + int(nbytes)
    return int(by_device.get("Total", 0)), breakdown


def measure_ddp_many(jobs: list[dict[str, Any]], *, nproc: int = 2,
                     timeout_s: float = 600.0) -> list[list[dict[str, Any]]]:
    """Run DDP jobs on ``nproc`` gloo workers; per job, each rank's result.

    A job is ``{"source": ModelSource, "ddp_kwargs": {...}}`` or ``{"source": ...,
    "policy_source": text}`` (a plan's policy module; ``apply_ddp`` is used), with optional
    ``optimizer`` (default adamw), ``steps`` (timed steps, default 0), ``memory`` (True:
    measure one steady step's peak with MemTracker) and ``memory_only`` (True: no counts and
    no buckets, only the peak)."""
    prepared = []
    for job in jobs:
        item = {k: v for k, v in job.items() if k != "source"}
        item["source"] = source_payload(job["source"])
        prepared.append(item)
    per_rank = launch("fsdp_plan.measure.ddp:_ddp_worker", {"jobs": prepared}, nproc=nproc,
                      timeout_s=timeout_s)
    return [[rank_result[i] for rank_result in per_rank] for i in range(len(jobs))]


MAX_REAL_RUN_BYTES = 8 << 30
"""The largest predicted peak ``verify`` measures with a real CPU run (a DDP rank holds the
whole model: a bigger one belongs on a GPU, ``fsdp-plan bench``)."""


def measure_ddp_peak(loaded: LoadedModel, plan: Plan, *, timeout_s: float = 600.0
                     ) -> MeasuredMemory:
    """A DDP plan's per-rank steady-step peak: a real gloo run of one rank with ``MemTracker``
    (see [Note: DDP peak on a CPU])."""
    expected = (plan.predicted or {}).get("peak_bytes") or 0
    if expected > MAX_REAL_RUN_BYTES:
        raise BadInput(f"verify measures a DDP plan with a real run of one rank on this CPU (a "
                       f"DDP rank holds the whole model whatever the world size), and this plan "
                       f"predicts {format_bytes(expected)}, more than the "
                       f"{format_bytes(MAX_REAL_RUN_BYTES)} verify allows itself; measure it on "
                       "a GPU with fsdp-plan bench PLAN.yaml.")
    autocast = plan_autocast_dtype(plan)  # [Note: autocast precision]
    started = time.perf_counter()
    job = {"source": loaded.source, "policy_source": runtime.policy_source(plan),
           "optimizer": plan.optimizer, "memory": True, "memory_only": True,
           "autocast": autocast}
    result = measure_ddp_many([job], nproc=1, timeout_s=timeout_s)[0][0]
    notes = [("measured with MemTracker on a real one-rank gloo run of the model (a DDP "
              "rank's memory does not depend on the world size)")]
    if autocast:
        notes.append(f"the forward ran under torch.autocast({autocast}), as apply_ddp asks of "
                     "a plan computing below float32")
    return MeasuredMemory(peak_bytes=int(result["peak_bytes"]),
                          breakdown=dict(result["peak_breakdown"]), step_start_bytes=0,
                          world_size=1, mesh=(1, 1), seconds=time.perf_counter() - started,
                          notes=notes, where="on a real one-rank gloo run (MemTracker)")


def buckets_in_use(ddp: Any) -> list[int]:
    """Bytes of each bucket DDP uses after its first iteration (read after the third
    forward): the rebuilt ones, or the first bucketing when it never rebuilds ([Note: DDP's
    bucket rebuild])."""
    data = ddp._get_ddp_logging_data()
    return _bucket_sizes(ddp) if data.get("has_rebuilt_buckets") else _bucket_sizes(
        ddp, "bucket_sizes")
