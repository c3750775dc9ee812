"""fsdp-plan: plan PyTorch FSDP wrapping, prefetch, sharding and activation checkpointing.

The package is laid out as the pipeline it runs, each stage a subpackage that imports only
the stages before it:

    common/   ground floor: errors, limits, sizes, dtypes, file writing, progress
    model/    1 the user's model on ``meta``: where it comes from, loading it, fake tensors
    facts/    2 what the planner knows: the module tree and one analysed step (plain data)
    cost/     3 analytic models over the facts: hardware, memory, collectives, the clock
    search/   4 one search over layouts, handed its strategies; the micro-batch sweep
    plan/     5 the plan document and what is made from it: checks, policy module, report
    export/   5 framework files made from a plan (accelerate, Trainer, Lightning, torchtitan)
    measure/  6 ground truth: PyTorch's own trackers and counters on fake and real process groups
    api.py      composition of the stages (what this face re-exports)
    pictures/ 7 pictures made from a plan and its measurements: memory over the step, the
                memory viewer's snapshot, the frontier of budgets, one HTML page (--html)
    bench/    7 real runs, result files, tuning
    cli/      8 the command line: parse, call the library, print

``policy_runtime.py`` is the code every generated policy module runs (it imports only torch).
Importing this package does not import torch: planning from saved ``ModelFacts`` needs none.
See README.md and SPEC.md.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below, for type checkers; at run time ``__getattr__`` below
    from fsdp_plan.api import (
        PlanResult,
        Prediction,
        analyze_for_plan,
        make_plan,
        plan_from_facts,
        plan_hardware,
        predict,
        verify_by_measurement,
    )
    from fsdp_plan.common.errors import BadInput, CheckFailed, FsdpPlanError, NoFeasiblePlan
    from fsdp_plan.cost.hardware import Hardware, hardware_for, read_hardware_file
    from fsdp_plan.facts.analyze import Analyzed, analyze_loaded, analyze_model
    from fsdp_plan.facts.types import ModelFacts
    from fsdp_plan.model.source import ModelSource
    from fsdp_plan.plan.document import Plan, read_plan
    from fsdp_plan.search.request import PlanRequest, SearchOptions

_HOMES = {
    "fsdp_plan.api": ("PlanResult", "Prediction", "analyze_for_plan", "make_plan",
                      "plan_from_facts", "plan_hardware", "predict", "verify_by_measurement"),
    "fsdp_plan.common.errors": ("BadInput", "CheckFailed", "FsdpPlanError", "NoFeasiblePlan"),
    "fsdp_plan.cost.hardware": ("Hardware", "hardware_for", "read_hardware_file"),
    "fsdp_plan.facts.analyze": ("Analyzed", "analyze_loaded", "analyze_model"),
    "fsdp_plan.facts.types": ("ModelFacts",),
    "fsdp_plan.model.source": ("ModelSource",),
    "fsdp_plan.plan.document": ("Plan", "read_plan"),
    "fsdp_plan.search.request": ("PlanRequest", "SearchOptions"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (PEP 562): ``fsdp-plan --help``, ``emit`` and
    every ``fsdp_plan.cli`` start-up import this package, and need none of the search."""
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdp_plan' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME_OF])


__version__ = "0.1.0"

__all__ = [
    "Analyzed",
    "BadInput",
    "CheckFailed",
    "FsdpPlanError",
    "Hardware",
    "ModelFacts",
    "ModelSource",
    "NoFeasiblePlan",
    "Plan",
    "PlanRequest",
    "PlanResult",
    "Prediction",
    "SearchOptions",
    "analyze_for_plan",
    "analyze_loaded",
    "analyze_model",
    "hardware_for",
    "make_plan",
    "plan_from_facts",
    "plan_hardware",
    "predict",
    "read_hardware_file",
    "read_plan",
    "verify_by_measurement",
]
