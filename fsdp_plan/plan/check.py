"""Validate a plan document (SPEC sections 3 and 6-8): the checkers of its fields.

A plan file is data that may come from anyone: ``fsdp_plan.plan.read`` reads it (size,
encoding, tags, aliases), then plan/schema.py ``check_plan_document`` walks the fields it
declares, each with its checker here: types (a bool is not an int; int fields refuse ``1.5``,
``.nan``, ``.inf`` and strings), ranges, the unit structure (children first, root last, each
module in one unit), prefetch targets and their uniform depth, the mesh against the world
size and strategy, dtypes, the optimizer, the GPU and the model recipe. Each returns the
normalised value ``Plan.from_dict`` stores.

Every refusal is a ``BadInput`` (exit 2) naming the field path (``units[3].modules[0]``) and
the fix, written for someone editing the plan file, never a command-line flag. Whether the
named modules exist is checked later, once the model is built
(``fsdp_plan.measure.runtime.check_model_matches``).

Unknown keys are refused at every level with the closest known key named (issue 31, S4-10);
only ``predicted``, the planner's report, keeps keys it does not know (other fsdp-plan
versions wrote them), unless one is a near miss of a key readers look for.
"""

from __future__ import annotations

import copy
import difflib
import math
from typing import Any

from fsdp_plan.common.dtypes import PLAN_DTYPE_NAMES
from fsdp_plan.common.limits import (
    MAX_BATCH_SIZE,
    MAX_BYTES,
    MAX_GPUS_PER_NODE,
    MAX_GRAD_ACCUM_STEPS,
    MAX_SEQ_LEN,
    MAX_TOKENS,
    MAX_WORLD_SIZE,
)
from fsdp_plan.common.safe_yaml import clip
from fsdp_plan.cost.comm_hooks import COMM_HOOKS, POWERSGD_DEFAULT_START_ITER
from fsdp_plan.cost.hardware.hardware import GPUS
from fsdp_plan.cost.hardware.stored import check_stored_block
from fsdp_plan.cost.precision import OPTIMIZERS
from fsdp_plan.facts.checkpointing import DEFAULT_SELECTIVE_OPS
from fsdp_plan.plan.checker import Checker, closest, field, name_of, show
from fsdp_plan.plan.prefetch import uniform_depths
from fsdp_plan.search.candidate import GRADIENT_SYNCS, STRATEGIES
from fsdp_plan.search.framework import FRAMEWORKS

FSDP_STRATEGIES = tuple(s for s in STRATEGIES if s != "ddp")
"""Strategies of a sharded plan's ``strategy`` field (``ddp`` is checked on its own)."""
MODEL_KINDS = ("file", "import", "hf-config")
CHECKPOINT_MODES = ("full", "selective")

_MESH_KEYS = ("replicate", "shard")
_UNIT_KEYS = ("modules", "reshard_after_forward", "mixed_precision")
_PRECISION_KEYS = ("param_dtype", "reduce_dtype")
_PLAN_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "autocast_dtype")
AUTOCAST_DTYPE_NAMES = ("bfloat16", "bf16", "float16", "fp16")
MAX_MM_STRIDE = 1024
_UNIT_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype")


def _ancestors(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))] if fqn else []


def _plain_arg(check: Checker, value: Any, path: str) -> Any:
    """A model argument: a scalar, or a list/mapping of them (as ``--model-arg`` and YAML give)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise check.fail(path, f"is {show(value)}", "a model argument is a finite number; quote "
                         "it to pass text")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, list):
        return [_plain_arg(check, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _plain_arg(check, v, field(path, k))
                for k, v in check.mapping(value, path, "use names as keys").items()}
    raise check.fail(path, f"is {show(value)}", "model arguments are strings, numbers, booleans, "
                     "null, or lists and mappings of them")


# --- the checks, section by section -----------------------------------------------------------
# Each field's checker takes (check, value as written or the field's default, the fields
# checked so far) and returns the value ``Plan`` stores; plan/schema.py ``FIELDS`` says which
# checker reads which field, in what order, and from which plan version.

def check_compile(check: Checker, value: Any, out: dict) -> dict[str, Any] | None:
    """``compile: {blocks: true, activation_memory_budget: B | null, modules: [FQN, ...]}``
    (SPEC 7, version 2); None when absent or ``blocks: false``."""
    if value is None:
        return None
    fix = ("compile is {blocks: true, activation_memory_budget: null or a number in 0..1, "
           "modules: [the repeated blocks' FQNs]}")
    mapping = check.mapping(value, "compile", fix)
    check.keys(mapping, "compile", ("blocks", "activation_memory_budget", "modules"))
    blocks = mapping.get("blocks", False)
    if not isinstance(blocks, bool):
        raise check.fail("compile.blocks", f"must be true or false, got {show(blocks)}",
                         "write true or false")
    if not blocks:
        return None
    budget = mapping.get("activation_memory_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not 0 <= budget <= 1):
        raise check.fail("compile.activation_memory_budget", f"must be null or a number from 0 "
                         f"to 1, got {show(budget)}", "write null (the partitioner's default) or "
                         "a fraction such as 0.5")
    modules = mapping.get("modules")
    if (not isinstance(modules, list) or not modules
            or not all(isinstance(m, str) and m for m in modules) or len(set(modules)) < len(modules)):
        raise check.fail("compile.modules", f"must be a non-empty list of distinct module FQNs, "
                         f"got {show(modules)}", "list the blocks to compile, e.g. [layers.0, "
                         "layers.1]")
    return {"blocks": True,
            "activation_memory_budget": None if budget is None else float(budget),
            "modules": list(modules)}


def check_framework(check: Checker, framework: Any, out: dict) -> str | None:
    """``framework: accelerate`` (SPEC 7, version 2): the framework the plan was made for
    (``--framework``); export writes its files by default. None when absent."""
    if framework is None:
        return None
    fix = (f"framework names the framework the plan was made for, one of {', '.join(FRAMEWORKS)}"
           "; remove it for a plan made for none")
    return check.choice(framework, "framework", FRAMEWORKS, fix)


def check_offload(check: Checker, offload: Any, out: dict) -> dict[str, bool] | None:
    """``offload: {params: bool, optimizer: bool}`` (SPEC 6); None when absent or all false.
    FSDP2's ``CPUOffloadPolicy`` moves parameters, gradients and optimizer states together.
    A version-2 field, refused in a version-1 plan even when all false (issue 21, S3-28)."""
    if offload is None:
        return None
    mapping = check.mapping(offload, "offload", "offload is {params: bool, optimizer: bool}")
    check.keys(mapping, "offload", ("params", "optimizer"))
    for key, flag in mapping.items():
        if not isinstance(flag, bool):
            raise check.fail(f"offload.{key}", f"must be true or false, got {show(flag)}",
                             "write true or false")
    flags = {"params": mapping.get("params", False), "optimizer": mapping.get("optimizer", False)}
    if flags["params"] != flags["optimizer"]:
        raise check.fail("offload", f"sets params: {str(flags['params']).lower()} and optimizer: "
                         f"{str(flags['optimizer']).lower()}", "FSDP2's CPUOffloadPolicy "
                         "offloads parameters, gradients and optimizer states together; set "
                         "both to true (or both to false)")
    return flags if flags["params"] else None


MODEL_KEYS = ("source", "entry", "args", "batch_size", "seq_len", "kind", "params", "digest",
              "notes", "grad_accum_steps")
"""What ``model`` may hold: the recipe (model/source.py ``to_plan_dict``), what the planner
adds (``params``, ``digest``, ``notes``), and the key plans before accumulation had."""


def check_model(check: Checker, value: Any, out: dict) -> dict[str, Any]:
    fix = ("model records how to rebuild the planned model: {source: path/to/model.py, entry: "
           "build_model, args: {...}, batch_size: 1, seq_len: 4096}")
    model = check.mapping(value, "model", fix)
    check.keys(model, "model", MODEL_KEYS)
    if "source" not in model:
        raise check.fail("model", "has no source", "add source: path/to/model.py (the model "
                         "file the plan was made for), or pass the model as MODEL")
    check.string(model["source"], "model.source", "give the model file's path, e.g. "
                 "examples/llama.py")
    entry = model.get("entry", "build_model")
    if (not isinstance(entry, str) or not entry.isidentifier()
            or entry.startswith("__") and entry.endswith("__")):
        # Dunders name Python's machinery (__class__, __loader__), never a model factory.
        raise check.fail("model.entry", f"is {show(entry)}, not a model factory's name",
                         "name the factory function in the model file, e.g. build_model")
    if "kind" in model and model["kind"] is not None:
        check.choice(model["kind"], "model.kind", MODEL_KINDS,
                     "file for a .py model file, hf-config for a config.json")
    args = check.mapping(model.get("args"), "model.args", "write the factory's keyword "
                         "arguments as a mapping, e.g. args: {size: 70b}", optional=True)
    for key in args:
        if not key.isidentifier():
            raise check.fail(field("model.args", key), "is not a Python keyword-argument name",
                             "use identifiers such as size or n_layers")
    _plain_arg(check, args, "model.args")
    batch = check.integer(model.get("batch_size", 1), "model.batch_size", 1, MAX_BATCH_SIZE,
                          f"batch_size is the samples in one micro-batch: a whole number from 1 "
                          f"to {MAX_BATCH_SIZE}, e.g. batch_size: 1")
    seq = check.integer(model.get("seq_len", 4096), "model.seq_len", 1, MAX_SEQ_LEN,
                        f"seq_len is the tokens per sample: a whole number from 1 to "
                        f"{MAX_SEQ_LEN}, e.g. seq_len: 4096")
    if batch * seq > MAX_TOKENS:
        raise check.fail("model.batch_size", f"{batch} x model.seq_len {seq} is {batch * seq:,} "
                         f"tokens per micro-batch, more than {MAX_TOKENS:,}",
                         "no GPU holds such a micro-batch; lower batch_size or seq_len")
    if model.get("params") is not None:
        check.integer(model["params"], "model.params", 0, MAX_BYTES,
                      "params is the planned model's parameter count; remove it to skip the check")
    if model.get("digest") is not None:
        check.string(model["digest"], "model.digest", "digest is written by fsdp-plan; remove it "
                     "to skip the model-code check")
    for i, note in enumerate(check.sequence(model.get("notes"), "model.notes",
                                            "notes is a list of strings", optional=True)):
        check.string(note, f"model.notes[{i}]", "notes is a list of strings", allow_empty=True)
    if model.get("grad_accum_steps") not in (None, 1):
        raise check.fail("model.grad_accum_steps", f"is {show(model['grad_accum_steps'])}",
                         "this fsdp-plan cannot apply gradient accumulation yet; remove it or "
                         "set it to 1")
    checked = copy.deepcopy(model)
    # absent means the defaults above; every reader of a checked plan may rely on both
    checked["batch_size"], checked["seq_len"] = batch, seq
    return checked


def check_budget(check: Checker, value: Any, out: dict) -> int:
    return check.integer(value, "budget_bytes", 1, MAX_BYTES,
                         "budget_bytes is the per-GPU memory budget in bytes: a whole number "
                         "from 1 to 2**60 (more than any GPU holds), e.g. 80000000000")


def check_headroom(check: Checker, value: Any, out: dict) -> int:
    return check.integer(value, "headroom_bytes", 0, out["budget_bytes"] - 1,
                         "headroom_bytes is the part of budget_bytes kept free: a whole "
                         "number of bytes from 0 to budget_bytes - 1")


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
        precision = None
        if unit.get("mixed_precision") is not None:
            precision = _check_precision(check, unit["mixed_precision"],
                                         f"{path}.mixed_precision", _UNIT_PRECISION_KEYS)
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
        return _check_ddp_strategy(check, shard, units)
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


def check_plan_precision(check: Checker, value: Any, out: dict) -> dict[str, str | None]:
    """The plan's ``mixed_precision``; its ``autocast_dtype`` (SPEC 7, version 2) is a dtype
    autocast computes in, with float32 parameters (FSDP keeps them; autocast casts per op)."""
    precision = _check_precision(check, value, keys=_PLAN_PRECISION_KEYS)
    dtype = precision.get("autocast_dtype")
    if dtype is None:
        return precision
    path = "mixed_precision.autocast_dtype"
    check.choice(dtype, path, AUTOCAST_DTYPE_NAMES, "torch.autocast computes in bfloat16 or "
                 "float16; remove the key to compute in float32")
    param = precision.get("param_dtype")
    if param not in (None, "float32", "fp32"):
        raise check.fail("mixed_precision.param_dtype", f"is {param!r} beside "
                         f"autocast_dtype {dtype!r}", "under autocast FSDP keeps float32 "
                         "parameters: write param_dtype: float32 (autocast casts per op)")
    return precision


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


def _check_precision(check: Checker, value: Any, path: str = "mixed_precision",
                     keys: tuple[str, ...] = _PRECISION_KEYS) -> dict[str, str | None]:
    """The plan's ``mixed_precision`` (or a unit's own, which may also set ``output_dtype``)."""
    fix = "mixed_precision is {param_dtype: bfloat16, reduce_dtype: float32} (null keeps fp32)"
    mapping = check.mapping(value, path, fix, optional=True)
    check.keys(mapping, path, keys)
    out: dict[str, str | None] = {}
    for key, dtype in mapping.items():
        if dtype is not None:
            check.choice(dtype, f"{path}.{key}", PLAN_DTYPE_NAMES,
                         "FSDP casts to floating dtypes only: use bfloat16, float16 or float32, "
                         "or null to keep the parameters' dtype")
        out[key] = dtype
    return out


PREDICTED_KEYS = ("peak_bytes", "collectives_per_step", "collectives_per_step_fsdp1",
                  "step_time_s", "exposed_comm_s", "comm_tail_s", "hidden_comm_s", "phases_s",
                  "compute_s", "total_comm_s", "peak_phase", "breakdown", "units",
                  "activation_checkpointing", "buckets", "host_bytes", "tokens_per_s", "mfu",
                  "global_batch_size", "measured_peak_bytes", "gpus_per_node")
"""What fsdp-plan writes under ``predicted`` (plan/build.py, api.py) and read there before
(``gpus_per_node``, now a top-level field)."""


def check_predicted(check: Checker, value: Any, out: dict) -> dict[str, Any]:
    """The numbers predict, verify, bench and ``bench --refit`` read or compute with are checked
    (issue 21, S3-21); the rest is the planner's report. The report is read as written, keys of
    other fsdp-plan versions included (SPEC: earlier plans stay readable), except a key one
    letter or so from a known one (``peak_byte``): that is a misspelling whose figure every
    reader would miss (issue 31, S4-10)."""
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
    for key in ("step_time_s", "exposed_comm_s", "hidden_comm_s", "comm_tail_s", "compute_s",
                "total_comm_s"):
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


# --- DDP (SPEC 6) -----------------------------------------------------------------------------

DDP_FLAGS = ("gradient_as_bucket_view", "static_graph", "find_unused_parameters")
DDP_COMM_HOOKS = tuple(COMM_HOOKS)
_DDP_KEYS = ("bucket_cap_mb", "first_bucket_mb", *DDP_FLAGS, "comm_hook", "powersgd")
MAX_POWERSGD_RANK = 1 << 16
MAX_POWERSGD_START_ITER = 1 << 40
MAX_BUCKET_MB = 1 << 20


def _check_ddp_strategy(check: Checker, shard: int,
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


def check_ddp(check: Checker, value: Any, out: dict) -> dict[str, Any] | None:
    """The ``ddp`` mapping: bucket caps in MiB (as ``bucket_cap_mb``), booleans, the optional
    ``comm_hook`` (a kind of cost/comm_hooks.py) and, for ``powersgd``, its ``powersgd: {rank,
    start_iter}``; only with ``strategy: ddp`` (defaults filled in when it is absent)."""
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
    check.keys(mapping, "ddp", _DDP_KEYS)
    out: dict[str, Any] = {"bucket_cap_mb": 25, "first_bucket_mb": 1,
                           "gradient_as_bucket_view": True, "static_graph": False,
                           "find_unused_parameters": False}
    for key in ("bucket_cap_mb", "first_bucket_mb"):
        if key in mapping:
            size = check.number(mapping[key], f"ddp.{key}", "a bucket cap in MiB, e.g. 25")
            if not 0 < size <= MAX_BUCKET_MB:
                raise check.fail(f"ddp.{key}", f"is {show(size)}", f"a bucket cap is more than 0 "
                                 f"and at most {MAX_BUCKET_MB} MiB")
            out[key] = size
    if out["first_bucket_mb"] > out["bucket_cap_mb"]:
        raise check.fail("ddp.first_bucket_mb", f"is {show(out['first_bucket_mb'])}, more than "
                         f"bucket_cap_mb {show(out['bucket_cap_mb'])}", "the first bucket is at "
                         "most as large as the others")
    for key in DDP_FLAGS:
        if key in mapping:
            if not isinstance(mapping[key], bool):
                raise check.fail(f"ddp.{key}", f"must be true or false, got {show(mapping[key])}",
                                 "write true or false")
            out[key] = mapping[key]
    if mapping.get("comm_hook") is not None:
        out["comm_hook"] = check.choice(mapping["comm_hook"], "ddp.comm_hook", DDP_COMM_HOOKS,
                                        "fp16_compress and bf16_compress all-reduce gradients in "
                                        "half precision, powersgd as low-rank matrices; remove "
                                        "the key for DDP's own all-reduce")
    if out.get("comm_hook") == "powersgd":
        out["powersgd"] = _check_powersgd(check, mapping.get("powersgd"))
    elif mapping.get("powersgd") is not None:
        raise check.fail("ddp.powersgd", "is present but ddp.comm_hook is not powersgd",
                         "write comm_hook: powersgd, or remove the powersgd key")
    return out


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
    return {"rank": rank, "start_iter": start}
