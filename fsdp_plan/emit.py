"""Emit a plan as the self-contained policy module of SPEC section 4.

The generated file imports only ``torch`` and the standard library, so it can be committed
next to a training script and used without fsdp-plan installed. It holds the plan as a
Python literal (``PLAN``) and a fixed body of code that reads ``PLAN``; nothing from the plan
is ever pasted into code (see [Note: untrusted strings]).

Example usage::

    write_policy_module(plan, "policies/llama70b.py")
    policy = load_policy_module("policies/llama70b.py")
    model = policy.apply_fully_shard(model)

[Note: untrusted strings]
Module names, the model source path and its arguments come from user files and may contain
quotes, newlines or code. They reach the generated file only (a) inside the ``PLAN`` literal,
written by ``pprint.pformat`` and checked with ``ast.literal_eval`` to read back equal, and
(b) in the docstring after ``_doc_safe`` has replaced every character outside a small
whitelist (no quotes, no backslashes). Numbers in the docstring are formatted from ints.

[Note: FSDP behaviour the generated code relies on] (read in torch 2.13, checked by tests)
- ``fully_shard([a, b])`` (lists accepted since torch 2.5; public ``torch.distributed.fsdp``
  since 2.6) builds one parameter group whose state is shared by ``a`` and ``b``; both become
  ``FSDPModule``. Prefetch targets of a grouped unit therefore use its first module.
- ``set_modules_to_backward_prefetch([])`` (or never calling it) keeps FSDP2's implicit
  backward prefetch of the previous unit; forward prefetch is explicit only.
- A 2-D mesh ``(W, 1)`` (strategy ``none``) is HSDP with one-rank shard groups: each rank
  holds full parameters, FSDP2 issues no all-gather and no reduce-scatter, and one gradient
  all-reduce per unit per backward (pure replication, like DDP).
- FSDP1's ``_recursive_wrap`` asks the policy about the root first (``recurse=True``) and never
  asks ``recurse=False`` about the root (``only_wrap_children``); the policy learns FQNs there.
"""

from __future__ import annotations

import ast
import hashlib
import linecache
import math
import os
import pprint
import re
import types
from typing import Any

from fsdp_plan.plan import Plan, atomic_write_text

_DOC_SAFE = re.compile(r"[^A-Za-z0-9_.,:/=+@ -]")


def render_policy_module(plan: Plan) -> str:
    """The Python source of the policy module for ``plan`` (SPEC section 4)."""
    document = plan.to_dict()
    literal = _plan_literal(document)
    source = (_docstring(document) + _HEADER + "PLAN = " + literal + "\n" + _BODY)
    compile(source, "<fsdp-plan policy>", "exec")
    return source


def write_policy_module(plan: Plan, path: str) -> None:
    """Render ``plan`` and write it to ``path`` atomically (never half-written)."""
    atomic_write_text(path, render_policy_module(plan))


def load_policy_module(source_or_path: str) -> types.ModuleType:
    """Execute a rendered policy module (its source, or the path of a file) into a new module.

    Text containing a newline is source; anything else is a path. The module is not put in
    ``sys.modules``, so loading two policies never mixes them.
    """
    if "\n" in source_or_path:
        source, name = source_or_path, "fsdp_plan_policy"
        filename = f"<fsdp-plan policy {hashlib.sha1(source.encode()).hexdigest()[:12]}>"
        # Let tracebacks show the generated lines, as they do for a file.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    else:
        with open(source_or_path) as f:
            source = f.read()
        filename = os.path.abspath(source_or_path)
        name = os.path.splitext(os.path.basename(source_or_path))[0] or "fsdp_plan_policy"
    module = types.ModuleType(name)
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - what loading means
    return module


def _plan_literal(document: dict[str, Any]) -> str:
    """``document`` as a Python literal that reads back equal (see [Note: untrusted strings])."""
    _check_literal_safe(document, "PLAN")
    # Line breaks in pformat's output fall between tokens, so indenting them under
    # "PLAN = " changes layout only.
    literal = pprint.pformat(document, sort_dicts=False, width=93).replace("\n", "\n       ")
    if ast.literal_eval(literal) != document:
        raise ValueError("the plan does not survive a round trip through a Python literal.")
    return literal


def _check_literal_safe(value: Any, where: str) -> None:
    """Only str/int/finite float/bool/None, lists and str-keyed dicts have exact literals."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value!r}; a plan holds only finite numbers.")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_literal_safe(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has the non-string key {key!r}.")
            _check_literal_safe(item, f"{where}[{key!r}]")
        return
    raise TypeError(f"{where} is a {type(value).__name__}; a plan holds only plain YAML data.")


def _doc_safe(value: Any, limit: int = 80) -> str:
    """``value`` as docstring text: whitelisted characters only, so it cannot end the string."""
    text = _DOC_SAFE.sub("?", str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if math.isfinite(value) else None


def _bytes_text(value: Any) -> str:
    num_bytes = _as_int(value)
    if num_bytes is None:
        return "unknown"
    return f"{num_bytes / 1e9:.1f} GB ({num_bytes / 2**30:.1f} GiB)"


def _docstring(document: dict[str, Any]) -> str:
    """The module docstring: what the plan is for, how to use it, FSDP1 caveats."""
    model = document.get("model") or {}
    args = model.get("args") or {}
    args_text = ", ".join(f"{k}={v}" for k, v in args.items()) if isinstance(args, dict) else ""
    mesh = document.get("mesh") or {}
    replicate, shard = _as_int(mesh.get("replicate")), _as_int(mesh.get("shard"))
    world_size = _as_int(document.get("world_size"))
    num_units = len(document.get("units") or [])
    num_checkpointed = len(document.get("activation_checkpointing") or [])
    predicted = document.get("predicted") or {}
    lines = [
        f"FSDP policy generated by fsdp-plan for {_doc_safe(model.get('source', 'a model'))}"
        + (f" ({_doc_safe(args_text)})" if args_text else "") + ".",
        "",
        (f"World size {world_size} on a mesh of {replicate} replicate x {shard} shard ranks "
         f"(strategy {_doc_safe(document.get('strategy'), 20)});"),
        f"{num_units} fully_shard units; {num_checkpointed} module(s) with activation checkpointing.",
        (f"Budget {_bytes_text(document.get('budget_bytes'))} per GPU, headroom "
         f"{_bytes_text(document.get('headroom_bytes'))};"),
        f"predicted peak {_bytes_text(predicted.get('peak_bytes'))} per rank.",
        "",
        "The exact plan is PLAN below; edit the plan and re-run fsdp-plan rather than this file.",
    ]
    return '"""' + "\n".join(lines) + "\n" + _USAGE + '"""\n'


_USAGE = r'''
FSDP2 (``fully_shard``), after ``torch.distributed.init_process_group(...)``::

    model = apply_fully_shard(model)                 # AC, units, prefetch, mixed precision
    model = apply_fully_shard(model, mesh=my_mesh)   # with your own (replicate, shard) mesh

``apply_fully_shard`` builds the plan's mesh when none is given: 1-D ``(shard,)`` when
replicate is 1, else 2-D ``(replicate, shard)`` named ("replicate", "shard") for HSDP.
Strategy "none" is the mesh ``(world, 1)``: full parameters on every rank, gradients
all-reduced, no all-gather or reduce-scatter.

FSDP1 (``FullyShardedDataParallel``)::

    model = FullyShardedDataParallel(model, auto_wrap_policy=auto_wrap_policy, **FSDP_KWARGS)
    apply_activation_checkpointing(model)            # after wrapping, for FSDP1

- A unit that groups several modules in FSDP2 cannot be one FSDP1 instance: FSDP1 wraps each
  listed module separately. ``FSDP1_UNITS`` lists the modules FSDP1 wraps ("" is the root).
- Hybrid sharding needs the 2-D mesh passed in (always on CPU, where node groups cannot be
  derived): ``FullyShardedDataParallel(model, auto_wrap_policy=auto_wrap_policy,
  **fsdp1_kwargs(build_device_mesh()))``.
- FSDP1 has no per-unit prefetch lists: ``backward_prefetch`` is BACKWARD_PRE when the plan
  prefetches in backward (else None, no backward prefetch at all, where FSDP2 would still
  prefetch one unit implicitly), and ``forward_prefetch`` is on when it prefetches in forward.
- Pass the whole model to ``FullyShardedDataParallel``: the policy matches FQNs from the root.
'''

_HEADER = r'''
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    MixedPrecision,
    ShardingStrategy,
)

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6 kept FSDP2 under _composable
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

'''

_BODY = r'''
# Wrapper layers that FSDP1 and activation checkpointing insert into module FQNs; a plan
# names modules without them.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
    "float64": torch.float64, "fp64": torch.float64,
}
_SHARDING_STRATEGIES = {
    "full": ShardingStrategy.FULL_SHARD,
    "hybrid": ShardingStrategy.HYBRID_SHARD,
    "grad-op": ShardingStrategy.SHARD_GRAD_OP,
    "none": ShardingStrategy.NO_SHARD,
}


def _check_plan() -> None:
    """Fail at import, naming the problem, when PLAN is not self-consistent."""
    if PLAN["strategy"] not in _SHARDING_STRATEGIES:
        raise ValueError(f"PLAN has the unknown strategy {PLAN['strategy']!r}.")
    if not PLAN["units"] or any(not unit["modules"] for unit in PLAN["units"]):
        raise ValueError("PLAN has no units, or a unit without modules.")
    if "" in PLAN["activation_checkpointing"]:
        raise ValueError("PLAN checkpoints the root module; only submodules can be wrapped.")
    unit_keys = {unit["modules"][0] for unit in PLAN["units"]}
    for kind in ("forward_prefetch", "backward_prefetch"):
        for key, targets in PLAN[kind].items():
            unknown = [name for name in [key, *targets] if name not in unit_keys]
            if unknown:
                raise ValueError(f"PLAN[{kind!r}] names {unknown!r}, which are not unit keys "
                                 "(a unit's first module FQN).")


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"PLAN names the unknown dtype {name!r}; expected one of "
                         f"{', '.join(_DTYPES)}.")
    return _DTYPES[name]


_check_plan()
PARAM_DTYPE = _dtype(PLAN["mixed_precision"].get("param_dtype"))
REDUCE_DTYPE = _dtype(PLAN["mixed_precision"].get("reduce_dtype"))

# FSDP1 wraps every module of a grouped unit separately, so these are its instances.
FSDP1_UNITS = [fqn for unit in PLAN["units"] for fqn in unit["modules"]]

FSDP_KWARGS = {
    "sharding_strategy": _SHARDING_STRATEGIES[PLAN["strategy"]],
    "backward_prefetch": (BackwardPrefetch.BACKWARD_PRE
                          if any(PLAN["backward_prefetch"].values()) else None),
    "forward_prefetch": any(PLAN["forward_prefetch"].values()),
    "limit_all_gathers": True,
    "mixed_precision": (MixedPrecision(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE,
                                       buffer_dtype=None)
                        if PARAM_DTYPE is not None or REDUCE_DTYPE is not None else None),
}


def fsdp1_kwargs(mesh: DeviceMesh | None = None) -> dict:
    """``FSDP_KWARGS``, plus ``device_mesh`` when given (needed for hybrid sharding on CPU)."""
    kwargs = dict(FSDP_KWARGS)
    if mesh is not None:
        kwargs["device_mesh"] = mesh
    return kwargs


def _plain_fqn(name: str) -> str:
    """A module FQN without the wrapper segments FSDP1 and checkpointing insert."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def _find_modules(model: nn.Module, fqns: list, deepest: bool) -> dict:
    """Map each plan FQN to ``(name in model, module)``.

    Several modules share a plain FQN once wrappers are in place (``layers.0`` is the wrapper
    and ``layers.0._checkpoint_wrapped_module`` the block). ``deepest=False`` picks the
    outermost (what ``fully_shard`` is given), ``deepest=True`` the innermost (what
    checkpointing wraps, inside an FSDP1 instance).
    """
    wanted = set(fqns)
    found = {}
    for name, module in model.named_modules():
        fqn = _plain_fqn(name)
        if fqn in wanted and (deepest or fqn not in found):
            found[fqn] = (name, module)
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(f"the model has no modules named {missing!r}; was this plan written "
                         "for this model?")
    return found


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Wrap each module in ``PLAN["activation_checkpointing"]`` with non-reentrant checkpointing.

    Each module is replaced in its parent (``setattr`` works for ``nn.ModuleList`` and
    ``nn.ModuleDict`` children too), so its forward is recomputed in backward. For FSDP2 call it
    before ``fully_shard`` (``apply_fully_shard`` does); for FSDP1 call it after wrapping, when
    the checkpoint wrapper goes inside the FSDP1 instance. Modules already wrapped are skipped.
    """
    found = _find_modules(model, PLAN["activation_checkpointing"], deepest=True)
    # Resolve every parent before replacing anything: a nested target's parent must be the
    # original module, not a wrapper put in place moments earlier.
    replacements = []
    for name, module in found.values():
        parent_name, _, attr = name.rpartition(".")
        if attr == "_checkpoint_wrapped_module":
            continue
        replacements.append((model.get_submodule(parent_name), attr, module))
    for parent, attr, module in replacements:
        setattr(parent, attr, checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    return model


def build_device_mesh() -> DeviceMesh:
    """The plan's mesh over all ranks: 2-D ``(replicate, shard)`` for HSDP, else 1-D.

    Build it outside ``FakeTensorMode``: mesh construction reads real tensors.
    """
    replicate, shard = PLAN["mesh"]["replicate"], PLAN["mesh"]["shard"]
    if dist.is_initialized() and dist.get_world_size() != replicate * shard:
        raise ValueError(f"PLAN is for {replicate * shard} ranks but the process group has "
                         f"{dist.get_world_size()}; pass apply_fully_shard a mesh of your own.")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if replicate > 1:
        return init_device_mesh(device_type, (replicate, shard),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (shard,), mesh_dim_names=("shard",))


def apply_fully_shard(model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
    """Apply the plan with FSDP2 and return ``model`` (changed in place).

    Activation checkpointing first, then one ``fully_shard`` call per unit in plan order
    (children first, root last) with the unit's ``reshard_after_forward`` and the plan's
    ``MixedPrecisionPolicy``, then explicit forward/backward prefetch between units. The mesh
    and the unit names are checked before the model is changed.
    """
    if mesh is None:
        mesh = build_device_mesh()
    _find_modules(model, FSDP1_UNITS, deepest=False)
    apply_activation_checkpointing(model)
    # Resolved again after checkpointing: a checkpointed unit is now its wrapper.
    found = _find_modules(model, FSDP1_UNITS, deepest=False)
    mp_policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE)
    for unit in PLAN["units"]:
        modules = [found[fqn][1] for fqn in unit["modules"]]
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                    reshard_after_forward=bool(unit["reshard_after_forward"]),
                    mp_policy=mp_policy)
    # Modules of a grouped unit share one FSDP state, so the first one stands for the unit.
    for key, targets in PLAN["forward_prefetch"].items():
        found[key][1].set_modules_to_forward_prefetch([found[t][1] for t in targets])
    for key, targets in PLAN["backward_prefetch"].items():
        found[key][1].set_modules_to_backward_prefetch([found[t][1] for t in targets])
    return model


class _PlanWrapPolicy:
    """FSDP1 auto-wrap policy that wraps exactly the plan's unit modules, found by FQN.

    FSDP1 calls a policy with ``(module, recurse, nonwrapped_numel)`` and no name. It asks
    about the root first (``recurse=True``), so on a module it does not know the policy maps
    every module below it to its FQN; weak references make a later model with reused object
    ids start afresh instead of reading stale names.
    """

    def __init__(self, fqns: list) -> None:
        self._wanted = frozenset(fqn for fqn in fqns if fqn != "")
        self._fqns = {}  # id(module) -> (weakref to module, plain FQN)

    def _fqn_of(self, module: nn.Module) -> str | None:
        entry = self._fqns.get(id(module))
        if entry is None or entry[0]() is not module:
            return None
        return entry[1]

    def _learn(self, root: nn.Module) -> None:
        self._fqns = {}
        seen = set()
        for name, module in root.named_modules():
            fqn = _plain_fqn(name)
            if fqn not in seen:  # the outermost module of a plain FQN, as in apply_fully_shard
                seen.add(fqn)
                self._fqns[id(module)] = (weakref.ref(module), fqn)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            if self._fqn_of(module) is None:
                self._learn(module)
            return True
        return self._fqn_of(module) in self._wanted


auto_wrap_policy = _PlanWrapPolicy(FSDP1_UNITS)
'''
