"""The plan's cluster fields (SPEC 3, 8): ``world_size`` and ``gpus_per_node``, which say which
collectives cross nodes and how ``export`` lays out machines."""

from __future__ import annotations

from typing import Any

from fsdp_plan.common.limits import MAX_GPUS_PER_NODE, MAX_WORLD_SIZE
from fsdp_plan.plan.checker import Checker

DEFAULT_GPUS_PER_NODE = 8
"""What a plan written before it recorded ``gpus_per_node`` was made for (``--gpus-per-node``'s
default)."""


def check_world_size(check: Checker, value: Any, out: dict) -> int:
    return check.integer(value, "world_size", 1, MAX_WORLD_SIZE,
                         f"world_size is the number of GPUs the plan is for: a whole number from "
                         f"1 to {MAX_WORLD_SIZE} (2**20); verify simulates that many ranks in "
                         "one process and no real cluster has more than a million GPUs")


def check_gpus_per_node(check: Checker, value: Any, out: dict,
                        path: str = "gpus_per_node") -> int | None:
    """``gpus_per_node`` (SPEC 8): bounded as ``--gpus-per-node`` is, and nodes full at the
    plan's world size; None when absent (a plan written before it was recorded)."""
    if value is None:
        return None
    what = (f"gpus_per_node is the GPUs sharing one node's fast links: a whole number from 1 "
            f"to {MAX_GPUS_PER_NODE}, e.g. 8")
    gpus = check.integer(value, path, 1, MAX_GPUS_PER_NODE, what)
    world = out["world_size"]
    if world > gpus and world % gpus:
        raise check.fail(path, f"is {gpus}, which does not divide world_size {world}",
                         "nodes are full: write a gpus_per_node that divides world_size")
    return gpus
