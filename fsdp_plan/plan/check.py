"""Validate a plan document (SPEC sections 3 and 6-8): the checkers of its fields.

A plan file is data that may come from anyone: ``fsdp_plan.plan.read`` reads it (size,
encoding, tags, aliases), then plan/schema.py ``check_plan_document`` walks the fields it
declares, each with its checker here: types (a bool is not an int; int fields refuse ``1.5``,
``.nan``, ``.inf`` and strings), ranges, the unit structure (children first, root last, each
module in one unit), prefetch targets and their uniform depth, the mesh against the world
size and strategy, the optimizer and the GPU. Each returns the normalised value
``Plan.from_dict`` stores. The sections with a type of their own (model, cluster, DDP, mixed
precision, offload, compile, predicted) keep their checkers beside it in plan/sections/.

Every refusal is a ``BadInput`` (exit 2) naming the field path (``units[3].modules[0]``) and
the fix, written for someone editing the plan file, never a command-line flag. Whether the
named modules exist is checked later, against the model's outline
(``fsdp_plan.plan.model_match.check_outline_matches``).

Unknown keys are refused at every level with the closest known key named (issue 31, S4-10);
only ``predicted``, the planner's report, keeps keys it does not know (other fsdp-plan
versions wrote them), unless one is a near miss of a key readers look for.
"""

from __future__ import annotations

from typing import Any

from fsdp_plan.common.limits import MAX_BYTES, MAX_GRAD_ACCUM_STEPS, MAX_WORLD_SIZE
from fsdp_plan.common.safe_yaml import clip
from fsdp_plan.cost.hardware.hardware import GPUS
from fsdp_plan.cost.hardware.stored import check_stored_block
from fsdp_plan.cost.optimizer_overlap import overlap_refusal
from fsdp_plan.cost.precision import OPTIMIZERS
from fsdp_plan.facts.checkpointing import DEFAULT_SELECTIVE_OPS
from fsdp_plan.plan.checker import Checker, closest, name_of, show
from fsdp_plan.plan.prefetch import uniform_depths
from fsdp_plan.plan.sections import check_ddp_strategy, check_unit_precision
from fsdp_plan.search.candidate import GRADIENT_SYNCS, STRATEGIES
from fsdp_plan.search.framework import FRAMEWORKS

FSDP_STRATEGIES = tuple(s for s in STRATEGIES if s != "ddp")
"""Strategies of a sharded plan's ``strategy`` field (``ddp`` is checked on its own)."""
CHECKPOINT_MODES = ("full", "selective")

_MESH_KEYS = ("replicate", "shard")
_UNIT_KEYS = ("modules", "reshard_after_forward", "mixed_precision")
MAX_MM_STRIDE = 1024


def _ancestors(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))] if fqn else []


# --- the checks, section by section -----------------------------------------------------------
# Each field's checker takes (check, value as written or the field's default, the fields
# checked so far) and returns the value ``Plan`` stores; plan/schema.py ``FIELDS`` says which
# checker reads which field, in what order, and from which plan version.

def check_framework(check: Checker, framework: Any, out: dict) -> str | None:
    """``framework: accelerate`` (SPEC 7, version 2): the framework the plan was made for
    (``--framework``); export writes its files by default. None when absent."""
    if framework is None:
        return None
    fix = (f"framework names the framework the plan was made for, one of {', '.join(FRAMEWORKS)}"
           "; remove it for a plan made for none")
    return check.choice(framework, "framework", FRAMEWORKS, fix)


def check_budget(check: Checker, value: Any, out: dict) -> int:
    return check.integer(value, "budget_bytes", 1, MAX_BYTES,
                         "budget_bytes is the per-GPU memory budget in bytes: a whole number "
                         "from 1 to 2**60 (more than any GPU holds), e.g. 80000000000")


def check_headroom(check: Checker, value: Any, out: dict) -> int:
    return check.integer(value, "headroom_bytes", 0, out["budget_bytes"] - 1,
                         "headroom_bytes is the part of budget_bytes kept free: a whole "
                         "number of bytes from 0 to budget_bytes - 1")


def check_mesh(check: Checker, value: Any, out: dict) -> dict[str, int]:
    fix = "mesh is {replicate: R, shard: S} with R * S = world_size (replicate: 1 is plain FSDP)"
    mesh = check.mapping(value, "mesh", fix)
    check.keys(mesh, "mesh", _MESH_KEYS)
    world = out["world_size"]
    replicate = check.integer(mesh.get("replicate", 1), "mesh.replicate", 1, MAX_WORLD_SIZE, fix)
    shard = check.integer(mesh.get("shard", world), "mesh.shard", 1, MAX_WORLD_SIZE, fix)
    if replicate * shard != world:
        raise check.fail("mesh", f"is {replicate}x{shard} = {replicate * shard} ranks but "
                         f"world_size is {world}", fix)
    return {"replicate": replicate, "shard": shard}


def check_units(check: Checker, value: Any, out: dict
                ) -> list[tuple[list[str], bool, dict[str, str | None] | None]]:
    fix = ("units is the list of fully_shard calls, children first and the root last, e.g. "
           "[{modules: [layers.0], reshard_after_forward: true}, {modules: [''], "
           "reshard_after_forward: false}]")
    units = check.sequence(value, "units", fix)
    if not units:
        raise check.fail("units", "is empty", fix)
    owner: dict[str, int] = {}
    out = []
    for i, unit in enumerate(units):
        path = f"units[{i}]"
        check.mapping(unit, path, fix)
        check.keys(unit, path, _UNIT_KEYS)
        if "modules" not in unit:
            raise check.fail(path, "has no modules", "give each unit modules: [FQN, ...]")
        modules = check.sequence(unit["modules"], f"{path}.modules",
                                 "list the module FQNs of this fully_shard call, e.g. [layers.0]")
        if not modules:
            raise check.fail(f"{path}.modules", "is empty", "a unit shards at least one module; "
                             "remove the unit or name its modules")
        for k, name in enumerate(modules):
            mpath = f"{path}.modules[{k}]"
            check.fqn(name, mpath, root=True)
            if name in owner:
                where = "this unit" if owner[name] == i else f"units[{owner[name]}]"
                raise check.fail(mpath, f"{name_of(name)} is already in {where}",
                                 "each module belongs to one unit; remove the repeat")
            if name == "" and (i != len(units) - 1 or len(modules) != 1):
                raise check.fail(mpath, "is the root module ''", "the root is a unit of its "
                                 "own, {modules: ['']}, and comes last (children first, root last)")
            for parent in _ancestors(name):
                if parent in owner:
                    raise check.fail(mpath, f"{name_of(name)} comes after its parent "
                                     f"{name_of(parent)} "
                                     f"(units[{owner[parent]}])", "list children before their "
                                     "parents (children first, root last)")
            owner[name] = i
        reshard = unit.get("reshard_after_forward", True)
        if not isinstance(reshard, bool):
            raise check.fail(f"{path}.reshard_after_forward", f"must be true or false, got "
                             f"{show(reshard)}", "write true (free parameters after forward) or "
                             "false (keep them for backward)")
        precision = check_unit_precision(check, unit.get("mixed_precision"),
                                         f"{path}.mixed_precision")
        out.append((list(modules), reshard, precision))
    if "" not in owner:
        raise check.fail(f"units[{len(units) - 1}]", "is not the root unit {modules: ['']}",
                         "end units with the root, {modules: [''], reshard_after_forward: "
                         "false}: fully_shard is applied to the root last")
    return out


def check_strategy(check: Checker, value: Any, out: dict) -> str:
    """``strategy`` against the mesh and resharding, accepting what the planner writes
    (``search/fsdp.meshes_for``: full and grad-op shard over all ranks, none replicates, hybrid
    may have one replica when the world fits in a node); absent, it follows from the mesh."""
    replicate, shard, units = out["mesh"]["replicate"], out["mesh"]["shard"], out["units"]
    if value is None:
        return "hybrid" if replicate > 1 and shard > 1 else "none" if shard == 1 < replicate \
            else "full"
    if value == "ddp":
        return check_ddp_strategy(check, shard, units)
    strategy = check.choice(value, "strategy", FSDP_STRATEGIES,
                            "full (FULL_SHARD), hybrid (HSDP), grad-op (SHARD_GRAD_OP) or none")
    if strategy in ("full", "grad-op") and replicate != 1:
        raise check.fail("strategy", f"is {strategy} but mesh.replicate is {replicate}",
                         f"{strategy} shards over all ranks (mesh.replicate: 1); for replicated "
                         "shard groups write strategy: hybrid")
    if strategy == "none" and shard != 1:
        raise check.fail("strategy", f"is none but mesh.shard is {shard}", "none replicates "
                         "every parameter: write mesh {replicate: world_size, shard: 1}, or "
                         "another strategy")
    if strategy == "grad-op":
        resharding = [i for i, (_, reshard, _) in enumerate(units) if reshard]
        if resharding:
            raise check.fail(f"units[{resharding[0]}].reshard_after_forward", "is true under "
                             "strategy grad-op", "grad-op (SHARD_GRAD_OP) keeps parameters "
                             "gathered from forward to backward: set every unit's "
                             "reshard_after_forward to false, or write strategy: full")
    return strategy


def check_checkpointing(check: Checker, value: Any, out: dict) -> list[str] | dict[str, str]:
    """The checkpointed FQNs as written: a list, or (version 2) a mapping to full | selective,
    read as the list when no module is selective."""
    path = "activation_checkpointing"
    if isinstance(value, dict):
        check.mapping(value, path, "map module FQNs to full or selective")
        selective = []
        for name, mode in value.items():
            check.fqn(name, f"{path}[{clip(name)!r}]", root=False)
            check.choice(mode, f"{path}[{clip(name)!r}]", CHECKPOINT_MODES,
                         "full recomputes the whole forward, selective saves the selective_ops")
            if mode == "selective":
                selective.append(name)
        names = dict(value)
    else:
        names = check.sequence(value, path, "list the module FQNs whose forward is recomputed "
                               "in backward ([] for none)", optional=True)
        seen: set[str] = set()
        for i, name in enumerate(names):
            check.fqn(name, f"{path}[{i}]", root=False)
            if name in seen:
                raise check.fail(f"{path}[{i}]", f"{name_of(name)} is listed twice",
                                 "list each checkpointed module once")
            seen.add(name)
        selective = []
    if isinstance(names, dict) and selective:
        return names
    return list(names)  # every module full: the version-1 list, applied the same


def check_selective_ops(check: Checker, ops: Any, out: dict) -> list[str]:
    """The ops selective checkpointing saves; a selective module needs at least one."""
    modes = out["activation_checkpointing"]
    selective = [m for m, mode in modes.items() if mode == "selective"] if isinstance(
        modes, dict) else []
    op_names = []
    for i, op in enumerate(check.sequence(ops, "selective_ops", "list op names such as "
                                          "aten.mm.default", optional=True)):
        name = check.string(op, f"selective_ops[{i}]", "an op name such as aten.mm.default")
        if not all(part.isidentifier() for part in name.split(".")):
            raise check.fail(f"selective_ops[{i}]", f"is {show(name)}, not an op name",
                             "write it as torch.ops spells it, e.g. aten.mm.default")
        if not _is_op(name):
            raise check.fail(f"selective_ops[{i}]", f"is {show(name)}, which names no op of "
                             "this PyTorch (torch.ops has no such op overload)", "list ops as "
                             "torch.ops spells them with their overload, e.g. aten.mm.default, "
                             "or write the list fsdp-plan writes")
        op_names.append(name)
    if selective and not op_names:
        raise check.fail(f"activation_checkpointing[{clip(selective[0])!r}]", "is selective "
                         "but selective_ops lists no ops", "list the ops whose outputs are "
                         "saved, e.g. selective_ops: [aten.mm.default]")
    return op_names


def _is_op(name: str) -> bool:
    """Whether ``selective_ops`` may hold ``name`` (issue 21, S3-18: ``os.system`` and
    ``aten.nonexistent_op.default`` passed, then the policy failed inside verify). The ops
    fsdp-plan writes are accepted as they are: they include GPU attention kernels an older or
    CPU-only PyTorch may lack, which the policy skips (``policy_runtime.resolve_ops``). Any
    other name must be an op overload of the installed PyTorch, found as the policy finds it."""
    if name in DEFAULT_SELECTIVE_OPS:
        return True
    # resolving needs torch (~6 s to import): only for names fsdp-plan itself never writes
    from fsdp_plan.policy_runtime import resolve_ops
    return bool(resolve_ops([name]))


def check_mm_stride(check: Checker, value: Any, out: dict) -> int:
    """``selective_mm_stride`` (SPEC 7): save every k-th ``aten.mm`` of a selective block."""
    return check.integer(value, "selective_mm_stride", 1, MAX_MM_STRIDE,
                           "selective_mm_stride k saves the 1st, (k+1)th, ... aten.mm of a "
                           "selectively checkpointed block (1 saves every one; torchtitan's op "
                           "policy is 2)")


def check_forward_prefetch(check: Checker, value: Any, out: dict) -> dict[str, list[str]]:
    return _check_prefetch(check, value, "forward_prefetch", {u[0][0] for u in out["units"]})


def check_backward_prefetch(check: Checker, value: Any, out: dict) -> dict[str, list[str]]:
    """The backward lists, and both kinds together a uniform depth (plan/prefetch.py): what
    fsdp-plan plans, predicts and tunes; emit, predict, verify, bench, export and tune all
    refuse the rest here, naming the field (issue 31, S4-20)."""
    backward = _check_prefetch(check, value, "backward_prefetch",
                               {u[0][0] for u in out["units"]})
    keys = [u[0][0] for u in out["units"]]
    if uniform_depths(keys, out["forward_prefetch"], backward) is None:
        raise check.fail("forward_prefetch", "and backward_prefetch are not a uniform depth",
                         "fsdp-plan plans, predicts and tunes uniform prefetch only: each unit "
                         "prefetching the next d units in forward (forward_prefetch), or the d "
                         "before it in backward (backward_prefetch, d > 1); write the lists as "
                         "fsdp-plan does, or leave them empty")
    return backward


def _check_prefetch(check: Checker, value: Any, kind: str, keys: set[str]) -> dict[str, list[str]]:
    fix = (f"{kind} maps a unit key (a unit's first module) to the unit keys it prefetches, "
           "e.g. {layers.0: [layers.1]}")
    mapping = check.mapping(value, kind, fix, optional=True)
    out = {}
    for key, targets in mapping.items():
        kpath = f"{kind}[{clip(key)!r}]"
        if key not in keys:
            raise check.fail(kpath, f"names {name_of(key)}, which is not a unit key", fix)
        targets = check.sequence(targets, kpath, fix)
        seen: set[str] = set()
        for i, target in enumerate(targets):
            tpath = f"{kpath}[{i}]"
            if not isinstance(target, str) or target not in keys:
                raise check.fail(tpath, f"is {name_of(target)}, which is not a unit key", fix)
            if target == key:
                raise check.fail(tpath, "is the unit itself", "a unit never prefetches itself; "
                                 "remove it")
            if target in seen:
                raise check.fail(tpath, f"{name_of(target)} is listed twice", "list it once")
            seen.add(target)
        out[key] = list(targets)
    return out


def check_accum_steps(check: Checker, value: Any, out: dict) -> int:
    """``grad_accum_steps``: micro-batches per optimizer step."""
    return check.integer(value, "grad_accum_steps", 1, MAX_GRAD_ACCUM_STEPS, "grad_accum_steps "
                         "counts micro-batches per optimizer step: a whole number >= 1")


def check_gradient_sync(check: Checker, value: Any, out: dict) -> str:
    """``gradient_sync``: reduce gradients after ``every`` micro-batch, or only the ``last``
    (``prepare_microbatch``)."""
    return check.choice(value, "gradient_sync", GRADIENT_SYNCS, "every reduces gradients after "
                        "each micro-batch, last only after the last one")


def check_optimizer(check: Checker, value: Any, out: dict) -> str:
    return check.choice(value, "optimizer", OPTIMIZERS,
                        "set optimizer to the one the training script uses")


def check_optimizer_overlap(check: Checker, value: Any, out: dict) -> bool:
    """``optimizer_overlap`` (SPEC 8): each parameter stepped in backward, only where the plan
    allows it (cost/optimizer_overlap.py ``overlap_refusal``)."""
    if not isinstance(value, bool):
        raise check.fail("optimizer_overlap", f"must be true or false, got {show(value)}",
                         "write true (step each parameter as its gradient is reduced) or false")
    if value:
        ddp = out["ddp"]
        why = overlap_refusal(strategy=out["strategy"], optimizer=out["optimizer"],
                              grad_accum_steps=out["grad_accum_steps"],
                              offload=out["offload"] is not None,
                              comm_hook=ddp.comm_hook if ddp is not None else None)
        if why:
            raise check.fail("optimizer_overlap", f"is true but {why}",
                             "set optimizer_overlap: false, or re-plan with --optimizer-overlap "
                             "for a plan that allows it")
    return value


def check_gpu(check: Checker, value: Any, out: dict) -> str:
    """The GPU the plan was made for: a bundled preset, whose figures time the plan; any
    other name (a calibrated machine's) only beside the ``hardware`` figures it names, which
    time the plan instead (issue 31, S4-20: ``gpu: </script>`` was emitted, then predict
    refused it as an unknown ``--gpu`` that nobody gave)."""
    gpu = check.string(value, "gpu", "name the GPU the plan was made for, e.g. h100")
    if out["hardware"] is None and gpu.lower() not in GPUS:
        raise check.fail("gpu", f"is {name_of(gpu)}, which is no bundled GPU preset",
                         f"{closest(gpu.lower(), list(GPUS))}name one of {', '.join(GPUS)}, or "
                         "keep the hardware figures the plan was made with (plan with "
                         "--hardware HW.yaml)")
    return gpu


def check_hardware(check: Checker, value: Any, out: dict) -> dict[str, Any] | None:
    return None if value is None else check_stored_block(value, check.where)
