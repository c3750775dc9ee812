"""Ground truth for memory: the steady-step peak of one rank, measured with PyTorch's own
``FSDPMemTracker`` on the ``fake`` process group at the plan's real world size (SPEC 5).

The model is rebuilt on ``meta``, given fake storage, sharded by the generated policy module
on a CPU device mesh of the plan's shape, and trained for two steps under ``FakeTensorMode``:
no real memory, no real communication, any world size in one process. The tracker is
``GroupAwareMemTracker`` (``measure/tracker.py``): grouped units need their FSDP2 group hooks
kept, see [Note: FSDPMemTracker and grouped units]. FSDP2 plans only: a DDP plan has no
shards and is measured by a real run (``measure/ddp.py``); ``measure/peak.py`` chooses.

[Note: the steady step]
Step 1 is warm-up: the optimizer creates its states lazily inside it, so its peak is not the
peak of training. ``FSDPMemTracker`` keeps one running peak across steps, and
``reset_mod_stats()`` clears only the per-module statistics. So the steady step (step 2:
forward, backward, optimizer step, ``zero_grad(set_to_none=True)``) runs under a FRESH
tracker: on entry it registers what is alive (sharded parameters, optimizer states, buffers,
the tracked inputs) and starts its peak there, using public API only. Tests check this equals
restarting the first tracker's private ``_peak_mem`` from its current snapshot.

[Note: measuring compiled blocks]
A plan with ``compile`` is measured with its blocks compiled by the policy's
``compile_blocks`` through ``facts.compiled.graph_backend(run=True)``: Dynamo, inductor's
decompositions and partitioner as in training, the partitioned FX graphs run op by op (inductor's
generated kernels cannot run on fake tensors). The tracker is ``CompiledStepMemTracker``
(Dynamo ignores it while compiling), the dtype checker is left out (a dispatch mode Dynamo would
not ignore), and the backend counts graph calls: a step in which the compiled graphs did not
all run raises instead of measuring an eager step.

Known limitations: FSDP1 cannot be measured here (``FSDPMemTracker`` tracks ``fully_shard``
modules only); CPU attention kernels can keep more than GPU ones (dropout > 0 takes the math
path), see ``cpu_gpu_differences``.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch import nn

from fsdp_plan.common.autocast import GPU_DIFFERENCE, float32_autocast_as_on_cuda
from fsdp_plan.common.errors import BadInput
from fsdp_plan.facts.compiled import graph_backend
from fsdp_plan.facts.dtypes import DtypeChecker, running_modules
from fsdp_plan.measure import runtime
from fsdp_plan.measure.fake_shards import one_empty_shard
from fsdp_plan.measure.measured import MeasuredMemory
from fsdp_plan.measure.recording import RecordingMemTracker
from fsdp_plan.measure.tracker import CompiledStepMemTracker, GroupAwareMemTracker
from fsdp_plan.model.fake import materialize_fake, new_fake_mode
from fsdp_plan.model.load import LoadedModel, rebuild_meta
from fsdp_plan.model.transformer_masks import transformer_masks_traceable
from fsdp_plan.plan.document import Plan
from fsdp_plan.plan.sections import CompiledBlocks

_TOTAL = "Total"


@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """The ``fake`` default process group for the duration of the block, then destroyed, so
    measurements can follow each other in one process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a default process group already exists in this process; measure "
                           "memory in a process without one (not inside a training worker).")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _total(snapshot: dict[Any, dict[Any, int]]) -> int:
    return int(sum(per_device[_TOTAL] for per_device in snapshot.values()))


def _plain(snapshot: dict[Any, int]) -> dict[str, int]:
    """Tracker enum keys -> their names (``Sharded Param``), ``Total`` dropped."""
    out: dict[str, int] = {}
    for key, value in snapshot.items():
        name = getattr(key, "value", str(key))
        if name != _TOTAL:
            out[name] = out.get(name, 0) + int(value)
    return out


def _module_peaks(tracker: Any, root: nn.Module) -> dict[str, int]:
    """Per-module local peaks, keyed by FQN relative to the root (tracker names are prefixed
    by the root's class name)."""
    names = {id(m): fqn for fqn, m in root.named_modules()}
    peaks: dict[str, int] = {}
    for module, stats in getattr(tracker, "memory_tracking", {}).items():
        fqn = names.get(id(module))
        if fqn is None or not getattr(stats, "local_peak", None):
            continue
        peaks[fqn.replace("._checkpoint_wrapped_module", "")] = max(stats.local_peak.values())
    return peaks


@contextmanager
def _fresh_dynamo(compiled: bool) -> Iterator[None]:
    """Dynamo's caches cleared before and after a compiled measurement (its graphs hold the
    fake tensors of this measurement)."""
    if not compiled:
        yield
        return
    import torch._dynamo

    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


def _check_compiled_ran(calls: int, compiled: CompiledBlocks, plan: Plan) -> str:
    """Refuse a compiled measurement in which the compiled graphs did not run: each block's
    forward and backward graph once per micro-batch of the steady step."""
    expected = 2 * len(compiled.modules) * max(1, plan.grad_accum_steps)
    if calls != expected:
        raise RuntimeError(f"the compiled blocks' graphs ran {calls} times in the measured step, "
                           f"not {expected} (forward and backward of {len(compiled.modules)} "
                           "blocks): Dynamo skipped or fell back to eager, so this would not "
                           "measure the compiled step.")
    return (f"compiled blocks: {len(compiled.modules)} blocks ran their compiled forward and "
            f"backward graphs ({calls} graph calls), executed op by op (inductor's kernels cannot "
            "run on fake tensors), so transients inside a block are the unfused graph's.")


def cpu_gpu_differences(model: nn.Module) -> list[str]:
    """Where the CPU measurement is known to differ from a GPU run (SPEC 5): named, not hidden."""
    notes = []
    with_dropout = [fqn for fqn, m in model.named_modules()
                    if (isinstance(m, nn.Dropout) and m.p > 0)
                    or (isinstance(getattr(m, "dropout", None), float) and m.dropout > 0)]
    if with_dropout:
        notes.append(f"{len(with_dropout)} module(s) use dropout (e.g. {with_dropout[0]!r}): "
                     "attention with dropout > 0 takes the math path on CPU and keeps the whole "
                     "attention matrix, which GPU flash attention does not, so this CPU peak can "
                     "overstate the GPU peak.")
    return notes


def measure_peak(loaded: LoadedModel, plan: Plan, policy_module: types.ModuleType, *,
                 fsdp_version: int = 2, record: bool = False) -> MeasuredMemory:
    """The steady-step peak of one rank of ``plan``, measured on the fake process group.

    ``policy_module`` is the generated module (``apply_fully_shard(model, mesh)``); the mesh is
    the plan's (1-D shard mesh, or 2-D ``("replicate", "shard")``) at its real world size.
    ``record``: also keep the steady step's allocations and module boundaries
    (recording.py [Note: recording the measured step]; not for compiled blocks).
    """
    if plan.strategy == "ddp":
        raise BadInput("measure_peak measures FSDP2 plans; a DDP plan has no shards and is "
                       "measured by a real one-rank run (measure.peak.measured_peak chooses).")
    if fsdp_version != 2:
        raise BadInput("verify measures FSDP2 (fully_shard) plans only: PyTorch's FSDPMemTracker "
                       "does not track FSDP1 modules. Use bench --fsdp1 on GPUs for FSDP1 memory.")
    if plan.offload is not None:
        raise BadInput("the plan offloads to the CPU (offload: params/optimizer true); on a CPU "
                       "host and device memory are the same, so its device peak cannot be "
                       "measured here. Measure it on a GPU: python -m fsdp_plan.bench.gpu_check "
                       "PLAN.yaml.")

    started = time.perf_counter()
    replicate, shard = runtime.mesh_shape(plan.mesh)
    source = loaded.source
    compiled = plan.compile
    ran: dict[str, Any] = {}  # [Note: measuring compiled blocks]
    tracker_class = CompiledStepMemTracker if compiled else GroupAwareMemTracker
    # one_empty_shard: FSDP2's padding in one step, so any world size is fast
    with fake_process_group(plan.world_size), _fresh_dynamo(compiled is not None), one_empty_shard():
        fake_mode = new_fake_mode()
        model = materialize_fake(rebuild_meta(loaded), fake_mode)
        notes = cpu_gpu_differences(model)
        if runtime.policy_autocast_dtype(policy_module):
            notes.append(GPU_DIFFERENCE)
        mesh = runtime.make_mesh("cpu", replicate, shard)  # outside fake mode: see make_mesh
        # [Note: causal masks on fake tensors]: nn.Transformer's mask check, as analysed
        # float32 regions as on a GPU ([Note: float32 autocast regions]), as analysed
        with fake_mode, transformer_masks_traceable(notes), float32_autocast_as_on_cuda():
            if compiled:
                model = policy_module.apply_fully_shard(
                    model, mesh, compile_backend=graph_backend(ran, run=True))
            else:
                model = policy_module.apply_fully_shard(model, mesh)
            optimizer = runtime.plan_optimizer(policy_module, model)
            inputs = loaded.make_inputs(source.batch_size, source.seq_len)
            warmup = tracker_class(model, optimizer)
            warmup.track_inputs(inputs)
            def training_step(tracker) -> None:
                # every micro-batch of one optimizer step (SPEC 6), then the step itself;
                # the tracker takes one forward per module at a time (its overall peak stays)
                runtime.micro_batches(model, loaded, inputs, policy_module,
                                      lambda index: index and tracker.reset_mod_stats())
                runtime.finish_step(model, optimizer)
            with warmup:  # step 1: lazy optimizer states, first-step FSDP initialisation
                training_step(warmup)
            steady = RecordingMemTracker if record and not compiled else tracker_class
            tracker = steady(model, optimizer)  # see [Note: the steady step]
            tracker.track_inputs(inputs)
            checker = DtypeChecker(running_modules(getattr(tracker, "_mod_tracker", None)))
            ran["ran"] = 0
            with tracker, checker if not compiled else contextlib.nullcontext():
                step_start = _total(tracker.get_tracker_snapshot("current"))
                training_step(tracker)
            if compiled:
                notes.append(_check_compiled_ran(ran.get("ran", 0), compiled, plan))
            peak_snap = tracker.get_tracker_snapshot("peak")
            module_peaks = _module_peaks(tracker, model)
    peak = _total(peak_snap)
    breakdown: dict[str, int] = {}
    for snap in peak_snap.values():
        for name, value in _plain(snap).items():
            breakdown[name] = breakdown.get(name, 0) + value
    return MeasuredMemory(peak_bytes=int(peak), breakdown=breakdown, step_start_bytes=step_start,
                          module_peaks=module_peaks, world_size=plan.world_size,
                          mesh=(replicate, shard), seconds=time.perf_counter() - started,
                          notes=notes, dtype_mismatches=checker.mismatches,
                          record=getattr(tracker, "record", None))
