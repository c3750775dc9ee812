"""The plan's ``predicted`` section (SPEC 3): the planner's report, kept as written.

The figures predict, verify, bench and ``bench --refit`` read or compute with are checked
(issue 21, S3-21); the rest is read as written, keys of other fsdp-plan versions included
(SPEC: earlier plans stay readable), except a key one letter or so from a known one
(``peak_byte``): a misspelling whose figure every reader would miss (issue 31, S4-10).
"""

from __future__ import annotations

import copy
import difflib
from typing import Any

from fsdp_plan.common.limits import MAX_BYTES
from fsdp_plan.plan.checker import Checker, field
from fsdp_plan.plan.sections.cluster import check_gpus_per_node

PREDICTED_KEYS = ("peak_bytes", "collectives_per_step", "collectives_per_step_fsdp1",
                  "step_time_s", "exposed_comm_s", "comm_tail_s", "hidden_comm_s", "phases_s",
                  "compute_s", "total_comm_s", "peak_phase", "breakdown", "units",
                  "activation_checkpointing", "buckets", "host_bytes", "tokens_per_s", "mfu",
                  "global_batch_size", "measured_peak_bytes", "gpus_per_node")
"""What fsdp-plan writes under ``predicted`` (plan/build.py, api.py) and read there before
(``gpus_per_node``, now a top-level field)."""
SECONDS_KEYS = ("step_time_s", "exposed_comm_s", "hidden_comm_s", "comm_tail_s", "compute_s",
                "total_comm_s")


def check_predicted(check: Checker, value: Any, out: dict) -> dict[str, Any]:
    """The report, its checked figures well formed; returned as a copy."""
    fix = "predicted is what the planner wrote; re-plan to get it back, or remove the key"
    predicted = check.mapping(value, "predicted", fix, optional=True)
    for key in predicted:
        near = difflib.get_close_matches(key, PREDICTED_KEYS, n=1, cutoff=0.85)
        if key not in PREDICTED_KEYS and near:
            raise check.fail(field("predicted", key), "is not a key fsdp-plan writes",
                             f"did you mean {near[0]}? Fix the spelling, or remove it")
    if predicted.get("peak_bytes") is not None:
        check.integer(predicted["peak_bytes"], "predicted.peak_bytes", 0, MAX_BYTES,
                      "peak_bytes is a whole number of bytes >= 0")
    # predict read it before plans recorded gpus_per_node (issue 21, S3-04)
    check_gpus_per_node(check, predicted.get("gpus_per_node"), out, "predicted.gpus_per_node")
    for key in SECONDS_KEYS:
        if predicted.get(key) is not None:
            check.number(predicted[key], f"predicted.{key}", "write seconds as a number")
    # bench reports each phase beside its measurement and --refit divides by it (S3-21)
    phases = check.mapping(predicted.get("phases_s"), "predicted.phases_s", fix, optional=True)
    for name, seconds in phases.items():
        check.number(seconds, field("predicted.phases_s", name), "write seconds as a number")
    for key in ("collectives_per_step", "collectives_per_step_fsdp1"):
        counts = check.mapping(predicted.get(key), f"predicted.{key}", fix, optional=True)
        for name, count in counts.items():
            check.integer(count, field(f"predicted.{key}", name), 0, 2**40,
                          "a collective count is a whole number >= 0")
    breakdown = check.mapping(predicted.get("breakdown"), "predicted.breakdown", fix, optional=True)
    for name, size in breakdown.items():
        check.number(size, field("predicted.breakdown", name), "write bytes as a number")
    buckets = check.sequence(predicted.get("buckets"), "predicted.buckets", fix, optional=True)
    for i, size in enumerate(buckets):
        check.integer(size, f"predicted.buckets[{i}]", 0, MAX_BYTES,
                      "a DDP bucket size is a whole number of bytes >= 0")
    units = check.sequence(predicted.get("units"), "predicted.units", fix, optional=True)
    for i, unit in enumerate(units):
        unit = check.mapping(unit, f"predicted.units[{i}]", fix)
        if "key" in unit:
            check.fqn(unit["key"], f"predicted.units[{i}].key", root=True)
    return copy.deepcopy(predicted)
