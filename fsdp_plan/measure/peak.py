"""A plan's measured peak, whatever its strategy: the one place that chooses how to measure.

An FSDP2 plan is measured with ``FSDPMemTracker`` on the fake process group at its real world
size (``measure/memory.py``); a DDP plan holds the whole model on every rank, so a real
one-rank run measures it (``measure/ddp.py``, [Note: DDP peak on a CPU]). ``fsdp-plan verify``
and ``api.verify_by_measurement`` both ask here.
"""

from __future__ import annotations

import types

from fsdp_plan.measure.ddp import measure_ddp_peak
from fsdp_plan.measure.measured import MeasuredMemory
from fsdp_plan.measure.memory import measure_peak
from fsdp_plan.model.load import LoadedModel
from fsdp_plan.plan.document import Plan


def measured_peak(loaded: LoadedModel, plan: Plan, policy: types.ModuleType, *,
                  record: bool = False) -> MeasuredMemory:
    """One rank's steady-step peak of ``plan`` on ``loaded`` (the planned model on ``meta``).

    ``policy`` is the plan's generated policy module, which the FSDP2 measurement applies in
    this process; a DDP run renders its own for its worker (a module cannot be sent there).
    ``record``: keep the FSDP2 step's allocations for the pictures (a DDP run records none).
    """
    if plan.strategy == "ddp":
        return measure_ddp_peak(loaded, plan)
    return measure_peak(loaded, plan, policy, record=record)
