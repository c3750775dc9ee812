"""The plan's ``ddp`` section (SPEC 6): ``DistributedDataParallel``'s arguments, checked and
typed as cost/ddp_buckets.py ``DDPConfig`` (the one description the clock, the memory model,
the search and the policy read)."""

from __future__ import annotations

from typing import Any

from fsdp_plan.cost.comm_hooks import COMM_HOOKS, POWERSGD_DEFAULT_START_ITER
from fsdp_plan.cost.ddp_buckets import DDPConfig
from fsdp_plan.plan.checker import Checker, show

DDP_FLAGS = ("gradient_as_bucket_view", "static_graph", "find_unused_parameters")
DDP_KEYS = ("bucket_cap_mb", "first_bucket_mb", *DDP_FLAGS, "comm_hook", "powersgd")
MAX_POWERSGD_RANK = 1 << 16
MAX_POWERSGD_START_ITER = 1 << 40
MAX_BUCKET_MB = 1 << 20


def check_ddp_strategy(check: Checker, shard: int,
                       units: list[tuple[list[str], bool, Any]]) -> str:
    """A DDP plan replicates everything: mesh ``{replicate: world_size, shard: 1}`` and the
    root as its one "unit"."""
    if shard != 1:
        raise check.fail("strategy", f"is ddp but mesh.shard is {shard}", "DDP replicates every "
                         "parameter: write mesh {replicate: world_size, shard: 1}")
    if [modules for modules, _, _ in units] != [[""]]:
        raise check.fail("units", "lists modules other than the root under strategy ddp",
                         "a DDP plan has one unit, [{modules: ['']}]; DDP wraps the whole model")
    return "ddp"


def check_ddp(check: Checker, value: Any, out: dict) -> DDPConfig | None:
    """The ``ddp`` mapping: bucket caps in MiB (as ``bucket_cap_mb``), booleans, the optional
    ``comm_hook`` (a kind of cost/comm_hooks.py) and, for ``powersgd``, its ``powersgd: {rank,
    start_iter}``; only with ``strategy: ddp`` (defaults filled in when it is absent)."""
    if isinstance(value, DDPConfig):
        value = value.to_dict()
    fix = ("ddp is {bucket_cap_mb: 25, first_bucket_mb: 1, gradient_as_bucket_view: true, "
           "static_graph: false, find_unused_parameters: false}")
    strategy = out["strategy"]
    if strategy != "ddp":
        if value is not None:
            raise check.fail("ddp", f"is present but strategy is {strategy}",
                             "ddp configures DistributedDataParallel: write strategy: ddp, or "
                             "remove the ddp key")
        return None
    mapping = check.mapping(value, "ddp", fix, optional=True)
    check.keys(mapping, "ddp", DDP_KEYS)
    config = DDPConfig()
    sizes = {}
    for key in ("bucket_cap_mb", "first_bucket_mb"):
        sizes[key] = getattr(config, key)
        if key in mapping:
            size = check.number(mapping[key], f"ddp.{key}", "a bucket cap in MiB, e.g. 25")
            if not 0 < size <= MAX_BUCKET_MB:
                raise check.fail(f"ddp.{key}", f"is {show(size)}", f"a bucket cap is more than 0 "
                                 f"and at most {MAX_BUCKET_MB} MiB")
            sizes[key] = size
    if sizes["first_bucket_mb"] > sizes["bucket_cap_mb"]:
        raise check.fail("ddp.first_bucket_mb", f"is {show(sizes['first_bucket_mb'])}, more than "
                         f"bucket_cap_mb {show(sizes['bucket_cap_mb'])}", "the first bucket is at "
                         "most as large as the others")
    flags = {}
    for key in DDP_FLAGS:
        if key in mapping:
            if not isinstance(mapping[key], bool):
                raise check.fail(f"ddp.{key}", f"must be true or false, got {show(mapping[key])}",
                                 "write true or false")
            flags[key] = mapping[key]
    hook = None
    if mapping.get("comm_hook") is not None:
        hook = check.choice(mapping["comm_hook"], "ddp.comm_hook", tuple(COMM_HOOKS),
                            "fp16_compress and bf16_compress all-reduce gradients in half "
                            "precision, powersgd as low-rank matrices; remove the key for DDP's "
                            "own all-reduce")
    powersgd = {}
    if hook == "powersgd":
        powersgd = _check_powersgd(check, mapping.get("powersgd"))
    elif mapping.get("powersgd") is not None:
        raise check.fail("ddp.powersgd", "is present but ddp.comm_hook is not powersgd",
                         "write comm_hook: powersgd, or remove the powersgd key")
    return DDPConfig(**sizes, **flags, comm_hook=hook, **powersgd)


def _check_powersgd(check: Checker, value: Any) -> dict[str, int]:
    """PowerSGD's ``matrix_approximation_rank`` and ``start_powerSGD_iter``."""
    mapping = check.mapping(value, "ddp.powersgd", "ddp.powersgd is {rank: 1, start_iter: "
                            f"{POWERSGD_DEFAULT_START_ITER}}}", optional=True)
    check.keys(mapping, "ddp.powersgd", ("rank", "start_iter"))
    rank = check.integer(mapping.get("rank", 1), "ddp.powersgd.rank", 1, MAX_POWERSGD_RANK,
                         "PowerSGD's matrix_approximation_rank: 1 or more (1-4 is usual)")
    start = check.integer(mapping.get("start_iter", POWERSGD_DEFAULT_START_ITER),
                          "ddp.powersgd.start_iter", 2, MAX_POWERSGD_START_ITER,
                          "iterations of plain all-reduce before compression; PyTorch needs at "
                          "least 2 with error feedback")
    return {"powersgd_rank": rank, "powersgd_start_iter": start}
