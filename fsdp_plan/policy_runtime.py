"""The code of every generated policy module (SPEC section 4), as a real module.

``fsdp_plan.plan.emit`` writes a policy file as: a docstring describing the plan, then this file's
text after its docstring, with the ``PLAN: dict = {}`` line below the marker replaced by
``PLAN = <the plan as a Python literal>``. So this file must import only ``torch`` and the
standard library, never ``fsdp_plan``: the generated file has to work without fsdp-plan
installed. Because it is a real module, linters and type checkers read it, and the planner
imports it for the one rule both sides share (``plain_fqn``).

Imported from the package, ``PLAN`` is empty and nothing plan-dependent runs: the constants
below keep their empty defaults and ``_configure()`` (at the end) does nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
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
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

try:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6 kept FSDP2 under _composable
    from torch.distributed._composable.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

# The plan: in a generated policy module, fsdp-plan writes it here as a literal.
PLAN: dict = {}

# Wrapper layers that FSDP1 and activation checkpointing insert into module FQNs; a plan
# names modules without them.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_SHARDING_STRATEGIES = {
    "full": ShardingStrategy.FULL_SHARD,
    "hybrid": ShardingStrategy.HYBRID_SHARD,
    "grad-op": ShardingStrategy.SHARD_GRAD_OP,
    "none": ShardingStrategy.NO_SHARD,
    "ddp": ShardingStrategy.NO_SHARD,  # FSDP1 without sharding is the FSDP form of DDP
}
_UNIT_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype")

# Derived from PLAN by _configure() at the end of the module (empty while PLAN is).
PARAM_DTYPE: torch.dtype | None = None
REDUCE_DTYPE: torch.dtype | None = None
AUTOCAST_DTYPE: torch.dtype | None = None
"""The dtype forward and loss run in under ``torch.autocast`` (``autocast()``), None for none."""
FSDP1_UNITS: list[str] = []
"""The modules FSDP1 wraps: every module of a grouped unit separately ("" is the root)."""
FSDP_KWARGS: dict = {}
DDP_KWARGS: dict = {}
"""``DistributedDataParallel`` keyword arguments of a DDP plan (empty for FSDP plans)."""


def plain_fqn(name: str) -> str:
    """A module FQN without the wrapper segments FSDP1 and checkpointing insert."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def _dtype(name: str | None) -> torch.dtype | None:
    """``torch.<name>`` for a canonical floating dtype name (``bfloat16``), None for None."""
    if name is None:
        return None
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"PLAN names the unknown dtype {name!r}; expected a floating dtype "
                         "such as bfloat16, float16, float32 or float64.")
    return value


def _check_plan() -> None:
    """Fail at import, naming the problem, when PLAN is not self-consistent."""
    if PLAN["strategy"] not in _SHARDING_STRATEGIES:
        raise ValueError(f"PLAN has the unknown strategy {PLAN['strategy']!r}.")
    if not PLAN["units"] or any(not unit["modules"] for unit in PLAN["units"]):
        raise ValueError("PLAN has no units, or a unit without modules.")
    if "" in PLAN["activation_checkpointing"]:
        raise ValueError("PLAN checkpoints the root module; only submodules can be wrapped.")
    if "selective" in checkpoint_modes().values() and not resolve_ops(PLAN.get("selective_ops") or []):
        raise ValueError("PLAN checkpoints modules selectively but none of its selective_ops "
                         "is an op of this torch build; list ops such as aten.mm.default.")
    unit_keys = {unit["modules"][0] for unit in PLAN["units"]}
    for kind in ("forward_prefetch", "backward_prefetch"):
        for key, targets in PLAN[kind].items():
            unknown = [name for name in [key, *targets] if name not in unit_keys]
            if unknown:
                raise ValueError(f"PLAN[{kind!r}] names {unknown!r}, which are not unit keys "
                                 "(a unit's first module FQN).")
    for unit in PLAN["units"]:
        unknown = sorted(set(unit.get("mixed_precision") or {}) - set(_UNIT_PRECISION_KEYS))
        if unknown:
            raise ValueError(f"PLAN unit {unit['modules'][0]!r} has the unknown mixed_precision "
                             f"keys {unknown!r}; expected {', '.join(_UNIT_PRECISION_KEYS)}.")
        _unit_precision(unit)  # its dtype names must resolve


def _unit_precision(unit: dict) -> dict:
    """The unit's ``MixedPrecisionPolicy`` arguments: the plan's, overridden by the unit's own.

    A unit kept in full precision (batch norm under bf16) records ``param_dtype: float32``
    and ``output_dtype: bfloat16``: its inputs are cast up, its outputs back down, so the
    modules around it keep computing in the plan's dtype (what FSDP1 does for batch norm).
    """
    override = unit.get("mixed_precision") or {}
    param = override.get("param_dtype", PLAN["mixed_precision"].get("param_dtype"))
    if PLAN["mixed_precision"].get("autocast_dtype") and "param_dtype" not in override:
        # Under autocast FSDP keeps the float32 parameters and leaves each unit's inputs as
        # they come (an explicit float32 param_dtype would copy autocast's bf16 activations
        # to float32 at every unit boundary); autocast casts per op.
        param = None
    return {
        "param_dtype": _dtype(param),
        "reduce_dtype": _dtype(override.get("reduce_dtype",
                                            PLAN["mixed_precision"].get("reduce_dtype"))),
        "output_dtype": _dtype(override.get("output_dtype")),
    }


def fsdp1_kwargs(mesh: DeviceMesh | None = None) -> dict:
    """``FSDP_KWARGS``, plus ``device_mesh`` when given (needed for hybrid sharding on CPU)."""
    kwargs = dict(FSDP_KWARGS)
    if mesh is not None:
        kwargs["device_mesh"] = mesh
    return kwargs


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
        fqn = plain_fqn(name)
        if fqn in wanted and (deepest or fqn not in found):
            found[fqn] = (name, module)
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(f"the model has no modules named {missing!r}; was this plan written "
                         "for this model?")
    return found


def resolve_ops(names: list) -> list:
    """The ``OpOverload`` objects for op names as ``torch.ops`` spells them
    (``aten.mm.default``); names this torch build lacks (a GPU-only attention kernel on an
    old release) are skipped, since such an op can never run here."""
    ops = []
    for name in names:
        obj = torch.ops
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            continue
        if isinstance(obj, torch._ops.OpOverload):
            ops.append(obj)
    return ops


def selective_policy(ops: list, mm_stride: int = 1):
    """The per-op policy of one checkpointed call: save the outputs of ``ops`` (``OpOverload``
    objects), recompute the rest; of the ``aten.mm`` calls only the 1st, (k+1)th, (2k+1)th, ...
    (``mm_stride`` k) are saved, counted apart in the forward and in the recompute as
    torchtitan's op policy counts them. It counts, so ``context_fn`` makes one per call."""
    saved = frozenset(ops)
    mm = torch.ops.aten.mm.default
    mm_calls = {False: 0, True: 0}  # keyed by ctx.is_recompute

    def policy(ctx, op, *_args, **_kwargs):
        if op == mm:
            mm_calls[ctx.is_recompute] += 1
            if (mm_calls[ctx.is_recompute] - 1) % mm_stride:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


# Keyword arguments through which a block writes a KV cache (transformers' names across
# releases). See _no_cache_in_training.
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


def _no_cache_in_training(module: nn.Module, args: tuple, kwargs: dict):
    """Drop a KV cache from a selectively checkpointed block's call while training.

    [Note: selective checkpointing and KV caches]
    Selective checkpointing replays a block's ops in backward and hands back each saved
    output by op and invocation index, so the replay must issue exactly the ops the forward
    did. A block that appends to a KV cache (Hugging Face ``LlamaDecoderLayer`` with the
    config's default ``use_cache=True``) finds the cache already grown when it is replayed
    and slices it once more: "aten.slice.Tensor invocation index 4 encountered during
    backward but not found in storage". transformers' own gradient checkpointing drops the
    cache for the same reason; a training step never reads it.
    """
    if not (module.training and torch.is_grad_enabled()):
        return None
    if not any(kwargs.get(k) is not None for k in _CACHE_KWARGS) and not kwargs.get("use_cache"):
        return None
    kwargs = {**kwargs, **{k: None for k in _CACHE_KWARGS if k in kwargs}}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def checkpoint_module(module: nn.Module, selective_ops: list | None = None,
                      mm_stride: int = 1) -> nn.Module:
    """``module`` in a non-reentrant checkpoint wrapper: full recomputation, or per-op selective
    (``selective_ops``: ``OpOverload`` objects whose outputs are saved, every ``mm_stride``-th
    ``aten.mm``) when given."""
    if selective_ops is None:
        return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    wrapper = checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                 context_fn=lambda: create_selective_checkpoint_contexts(
                                     selective_policy(selective_ops, mm_stride)))
    wrapper.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)
    return wrapper


def checkpoint_modes() -> dict:
    """``{FQN: "full" | "selective"}`` for the plan's checkpointed modules (a version-1 list
    means full for each)."""
    value = PLAN["activation_checkpointing"]
    if isinstance(value, dict):
        return dict(value)
    return {fqn: "full" for fqn in value}


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Wrap each module in ``PLAN["activation_checkpointing"]`` with non-reentrant checkpointing.

    Each module is replaced in its parent (``setattr`` works for ``nn.ModuleList`` and
    ``nn.ModuleDict`` children too), so its forward is recomputed in backward: all of it for
    ``full``, all but the outputs of ``PLAN["selective_ops"]`` for ``selective``
    (``create_selective_checkpoint_contexts``). For FSDP2 call it before ``fully_shard``
    (``apply_fully_shard`` does); for FSDP1 call it after wrapping, when the checkpoint wrapper
    goes inside the FSDP1 instance. Modules already wrapped are skipped.
    """
    modes = checkpoint_modes()
    saved_ops = resolve_ops(PLAN.get("selective_ops") or [])
    found = _find_modules(model, list(modes), deepest=True)
    # Resolve every parent before replacing anything: a nested target's parent must be the
    # original module, not a wrapper put in place moments earlier.
    replacements = []
    for name, module in found.values():
        parent_name, _, attr = name.rpartition(".")
        if attr == "_checkpoint_wrapped_module":
            continue
        replacements.append((model.get_submodule(parent_name), attr, module,
                             modes[plain_fqn(name)] == "selective"))
    for parent, attr, module, selective in replacements:
        setattr(parent, attr, checkpoint_module(module, saved_ops if selective else None,
                                                int(PLAN.get("selective_mm_stride", 1))))
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


def compile_blocks(model: nn.Module, backend="inductor") -> nn.Module:
    """Compile each block of ``PLAN["compile"]["modules"]`` as torchtitan does and return
    ``model`` (changed in place); nothing when the plan has no ``compile``.

    ``block.forward = torch.compile(block.forward, fullgraph=True)``: the forward, not
    ``module.compile()``, so FSDP2's hooks on the block stay outside the graph. Call it after
    activation checkpointing (a checkpointed block's wrapper is compiled, checkpoint inside
    the graph) and before ``fully_shard`` (``apply_fully_shard`` does). With
    ``activation_memory_budget`` the partitioner runs under
    ``torch._functorch.config.activation_memory_budget`` for these graphs only. ``backend``:
    ``torch.compile``'s (fsdp-plan's verify passes one that runs on fake tensors).
    """
    compiled = PLAN.get("compile") or {}
    if not compiled.get("blocks"):
        return model
    budget = compiled.get("activation_memory_budget")
    found = _find_modules(model, list(compiled["modules"]), deepest=False)
    for _name, block in found.values():
        forward = torch.compile(block.forward, fullgraph=True, backend=backend)
        if budget is not None:
            forward = _under_budget(forward, float(budget))
        block.forward = forward
    return model


def _under_budget(forward, budget: float):
    """``forward`` called with the partitioner's activation memory budget set to ``budget``
    (the partition is made on the first call, so the budget must be in force then)."""
    def call(*args, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return forward(*args, **kwargs)
    return call


def apply_fully_shard(model: nn.Module, mesh: DeviceMesh | None = None,
                      compile_backend="inductor") -> nn.Module:
    """Apply the plan with FSDP2 and return ``model`` (changed in place).

    Activation checkpointing first, then the compiled blocks (``compile_blocks``, when the
    plan compiles them; ``compile_backend`` is ``torch.compile``'s backend), then one ``fully_shard`` call per unit in plan order
    (children first, root last) with the unit's ``reshard_after_forward`` and its
    ``MixedPrecisionPolicy`` (the plan's, or the unit's own override), then explicit
    forward/backward prefetch between units. The mesh and the unit names are checked before
    the model is changed. A DDP plan is refused: ``apply`` (or ``apply_ddp``) applies it.
    """
    if PLAN.get("strategy") == "ddp":
        raise ValueError("PLAN is a DDP plan (strategy ddp): apply it with apply(model), which "
                         "wraps DistributedDataParallel as planned, or apply_ddp(model); "
                         "apply_fully_shard would train FSDP2 on a replicate mesh instead.")
    if mesh is None:
        mesh = build_device_mesh()
    _find_modules(model, FSDP1_UNITS, deepest=False)
    apply_activation_checkpointing(model)
    compile_blocks(model, compile_backend)
    # Resolved again after checkpointing: a checkpointed unit is now its wrapper.
    found = _find_modules(model, FSDP1_UNITS, deepest=False)
    for unit in PLAN["units"]:
        modules = [found[fqn][1] for fqn in unit["modules"]]
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                    reshard_after_forward=bool(unit["reshard_after_forward"]),
                    mp_policy=MixedPrecisionPolicy(**_unit_precision(unit)), **_offload_kwargs())
    # Modules of a grouped unit share one FSDP state, so the first one stands for the unit.
    for key, targets in PLAN["forward_prefetch"].items():
        found[key][1].set_modules_to_forward_prefetch([found[t][1] for t in targets])
    for key, targets in PLAN["backward_prefetch"].items():
        found[key][1].set_modules_to_backward_prefetch([found[t][1] for t in targets])
    return model


def prepare_microbatch(model: nn.Module, index: int, count: int) -> None:
    """Call before micro-batch ``index`` (0-based) of ``count`` in one optimizer step (SPEC 6).

    With ``gradient_sync: last`` FSDP2 skips the reduce-scatter (and HSDP all-reduce) of every
    micro-batch but the last, accumulating unsharded gradients instead
    (``set_requires_gradient_sync``), and DDP skips its all-reduce as under ``no_sync()``
    (which sets ``require_backward_grad_sync``); with ``every`` (or one micro-batch) each
    backward reduces as usual. ``model`` is the root returned by ``apply_fully_shard`` or
    ``apply_ddp``."""
    if not 0 <= index < count:
        raise ValueError(f"micro-batch index {index} is outside 0..{count - 1}.")
    if PLAN.get("gradient_sync", "every") != "last":
        return
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(index == count - 1)
    elif hasattr(model, "require_backward_grad_sync"):  # DistributedDataParallel
        model.require_backward_grad_sync = index == count - 1


def _offload_kwargs() -> dict:
    """``offload_policy=CPUOffloadPolicy(...)`` for every unit when the plan offloads (SPEC 6):
    parameters, gradients and optimizer states on the host, the optimizer step on the CPU.
    Host memory is pinned when a GPU is present (the copies then overlap compute); on a
    CPU-only machine host and device are one memory and fake tensors cannot be pinned."""
    if not (PLAN.get("offload") or {}).get("params"):
        return {}
    return {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())}


def ddp_kwargs(ddp: dict) -> dict:
    """``DistributedDataParallel`` keyword arguments that build the buckets ``ddp`` describes.

    DDP caps its first bucket at 1 MiB only when ``bucket_cap_mb`` is left at its default
    (None: 25 MiB); an explicit ``bucket_cap_mb`` caps the first bucket like the others, and
    any other pair needs ``bucket_cap_mb_list=[first, cap]`` (torch >= 2.13). See
    [Note: DDP buckets] in fsdp-plan's cost/ddp_buckets.py, which reads this same rule."""
    kwargs = {key: bool(ddp[key]) for key in ("gradient_as_bucket_view", "static_graph",
                                              "find_unused_parameters")}
    first, cap = ddp["first_bucket_mb"], ddp["bucket_cap_mb"]
    if (first, cap) == (1, 25):
        kwargs["bucket_cap_mb"] = None
    elif first == cap:
        kwargs["bucket_cap_mb"] = cap
    else:
        kwargs["bucket_cap_mb_list"] = [first, cap]
    return kwargs


def apply_ddp(model: nn.Module, device_ids: list | None = None,
              device_mesh: DeviceMesh | None = None) -> nn.Module:
    """Apply a DDP plan: activation checkpointing first, then ``DistributedDataParallel`` with
    ``DDP_KWARGS`` and the plan's communication hook (``register_comm_hook``); returns the
    DDP module. On a GPU, move the model to ``local_device()`` and pass
    ``device_ids=[local_device().index]`` (``apply`` does both). DDP keeps float32 parameters:
    run forward and loss under ``autocast()``, which computes in ``PARAM_DTYPE`` when it is
    below float32. A sharded plan is refused: ``apply`` (or ``apply_fully_shard``) applies it."""
    from torch.nn.parallel import DistributedDataParallel

    if PLAN.get("strategy") != "ddp":
        raise ValueError(f"PLAN is a sharded plan (strategy {PLAN.get('strategy')!r}), not a DDP "
                         "plan: apply it with apply(model) or apply_fully_shard(model).")
    kwargs = dict(DDP_KWARGS)
    if "bucket_cap_mb_list" in kwargs and "bucket_cap_mb_list" not in (
            DistributedDataParallel.__init__.__code__.co_varnames):
        raise ValueError("PLAN caps the first DDP bucket apart from the others, which needs "
                         "bucket_cap_mb_list (torch >= 2.13); re-plan, or set first_bucket_mb "
                         "equal to bucket_cap_mb.")
    if device_mesh is not None:
        kwargs["device_mesh"] = device_mesh
    apply_activation_checkpointing(model)
    ddp = DistributedDataParallel(model, device_ids=device_ids, **kwargs)
    register_comm_hook(ddp)
    return ddp


def register_comm_hook(ddp: nn.Module) -> object | None:
    """Register the plan's ``ddp.comm_hook`` on a ``DistributedDataParallel`` module and return
    the hook's state (PowerSGD's ``PowerSGDState``, to checkpoint with the model; None for the
    others). ``fp16_compress`` / ``bf16_compress`` all-reduce in half precision; ``powersgd``
    all-reduces low-rank approximations from ``start_iter`` on (the plan's ``ddp.powersgd``),
    with PyTorch's defaults for the rest (error feedback and warm start on)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hook = PLAN["ddp"].get("comm_hook")
    if hook is None:
        return None
    backend = str(torch.distributed.get_backend()) if torch.distributed.is_initialized() else ""
    buckets = len((PLAN.get("predicted") or {}).get("buckets") or [])
    if hook == "powersgd" and backend == "gloo" and buckets != 1:
        raise ValueError(f"PLAN's ddp.comm_hook powersgd over {buckets or 'several'} buckets on "
                         "gloo: gloo completes each bucket's all-reduce on its own thread, where "
                         "PowerSGD issues the next one, so ranks can issue them in different "
                         "orders and abort. Plan one bucket (a bucket_cap_mb above the model's "
                         "gradient bytes) on a CPU, or run on NCCL.")
    if hook == "powersgd":
        settings = PLAN["ddp"].get("powersgd") or {}
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=settings.get("rank", 1),
            start_powerSGD_iter=settings.get("start_iter", 1000))
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    # every other kind is torch's default_hooks.<kind>_hook (fsdp-plan's cost/comm_hooks.py)
    function = getattr(default_hooks, f"{hook}_hook", None) if str(hook).isidentifier() else None
    if function is None:
        raise ValueError(f"PLAN's ddp.comm_hook {hook!r} is not a hook of this PyTorch "
                         f"(torch.distributed.algorithms.ddp_comm_hooks.default_hooks has no "
                         f"{hook}_hook, and it is not powersgd); regenerate it with fsdp-plan "
                         "emit")
    if hook == "bf16_compress" and backend not in ("nccl", "xccl"):
        raise ValueError(f"PLAN's ddp.comm_hook bf16_compress needs NCCL (or XCCL); this process "
                         f"group's backend is {backend or 'not initialised'} (gloo refuses it in "
                         "the first backward). Plan for this machine's hardware (a CPU plan "
                         "uses fp16_compress or none), or run on GPUs.")
    ddp.register_comm_hook(None, function)
    return None


def local_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` on a GPU machine (``torchrun`` sets LOCAL_RANK;
    without it, the current CUDA device), else the CPU.

    FSDP1 needs it on every device as ``device_id``: on a GPU without it FSDP1 shards on the
    CPU, and on a CPU without ``device_id=torch.device("cpu")`` it fails ("FSDP needs a non-CPU
    accelerator device")::

        FullyShardedDataParallel(model, auto_wrap_policy=auto_wrap_policy,
                                 device_id=local_device(), **FSDP_KWARGS)
    """
    if torch.cuda.is_available():
        local_rank = os.environ.get("LOCAL_RANK")
        return torch.device("cuda", int(local_rank) if local_rank is not None
                            else torch.cuda.current_device())
    return torch.device("cpu")


def apply(model: nn.Module, mesh: DeviceMesh | None = None,
          optimizer_kwargs: dict | None = None) -> nn.Module:
    """Apply the plan whatever its strategy and return the module to train.

    FSDP2 (full, grad-op, none and HSDP plans): ``apply_fully_shard(model, mesh)``, which
    returns ``model`` sharded in place. DDP plans: the model moves to ``local_device()`` on a
    GPU, then ``apply_ddp`` wraps it, and the ``DistributedDataParallel`` module is returned
    (``mesh``, when given, is passed as its 1-D ``device_mesh``). Train what this returns, and
    wrap forward and loss in ``autocast()``::

        model = apply(model)
        with autocast():
            loss = loss_fn(model(batch))
        loss.backward()

    A plan with ``optimizer_overlap: true`` also installs its optimizer in backward
    (``optimizer_in_backward(model, **optimizer_kwargs)``, see [Note: the optimizer in
    backward]); ``in_backward_optimizer(model)`` returns it for schedulers and checkpoints.
    """
    if PLAN.get("strategy") != "ddp":
        model = apply_fully_shard(model, mesh)
    else:
        device = local_device()
        if device.type != "cpu":
            model.to(device)
        model = apply_ddp(model, device_ids=[device.index] if device.type != "cpu" else None,
                          device_mesh=mesh)
    if PLAN.get("optimizer_overlap"):
        if optimizer_kwargs is None:
            warnings.warn(f"PLAN steps its {PLAN.get('optimizer')} optimizer in backward and "
                          "apply() was given no optimizer_kwargs: it uses torch's defaults (for "
                          "AdamW lr=0.001). Pass apply(model, optimizer_kwargs={'lr': ...}).",
                          stacklevel=2)
        optimizer_in_backward(model, **(optimizer_kwargs or {}))
    return model


# [Note: the optimizer in backward]
# With ``optimizer_overlap: true`` each parameter is stepped as soon as its gradient is
# reduced, by an optimizer of its own, and its gradient dropped: no step after backward, no
# gradient of the whole model alive at once. FSDP2 calls a sharded parameter's
# post-accumulate-grad hooks once its reduce-scatter has written the sharded gradient
# (``foreach_reduce``, on the reduce-scatter stream); DDP runs the optimizers of a bucket's
# parameters after the bucket's all-reduce (torch's ``_apply_optimizer_in_backward``, which DDP
# turns into its own communication hook at its first forward, so a plan with a ``comm_hook``
# cannot have it). Nothing may read gradients across parameters after backward: no clipping by
# the global norm, no accumulation over micro-batches. ``OptimizerInBackward`` stands for the
# per-parameter optimizers in a training loop: its ``step`` and ``zero_grad`` have nothing left
# to do, its ``param_groups`` are theirs (a learning-rate scheduler sets their ``lr``), and its
# ``state`` and ``state_dict`` gather theirs.

OPTIMIZER_CLASSES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
"""The ``torch.optim`` class of each plan ``optimizer`` (fsdp-plan's measurements make theirs
from it too); ``none`` has none."""
_IN_BACKWARD_ATTRIBUTE = "_fsdp_plan_in_backward_optimizer"


class OptimizerInBackward(torch.optim.Optimizer):
    """The per-parameter optimizers that step in backward, as one optimizer for a training
    loop: see [Note: the optimizer in backward]."""

    def __init__(self, optimizers: list) -> None:
        if not optimizers:
            raise ValueError("OptimizerInBackward needs at least one optimizer.")
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]],
                         dict(optimizers[0].defaults))
        self.optimizers = list(optimizers)  # from here on, the groups and state are theirs

    @property
    def param_groups(self) -> list:  # type: ignore[override]
        """The per-parameter optimizers' groups, read each time (``load_state_dict`` gives
        them new ones)."""
        return [g for o in getattr(self, "optimizers", ()) for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, value) -> None:  # Optimizer.__init__ sets it; the groups are theirs
        pass

    @property
    def state(self) -> dict:  # type: ignore[override]
        merged: dict = {}
        for optimizer in getattr(self, "optimizers", ()):
            merged.update(optimizer.state)
        return merged

    @state.setter
    def state(self, value) -> None:  # Optimizer.__init__ sets it; the state is the optimizers'
        pass

    @torch.no_grad()
    def step(self, closure=None):
        """Nothing to do: every parameter was stepped in backward (``closure`` runs if given)."""
        return closure() if closure is not None else None

    def state_dict(self) -> dict:
        return {"in_backward": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("in_backward") if isinstance(state_dict, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            raise ValueError(f"this state dict does not hold {len(self.optimizers)} in-backward "
                             "optimizers' states (it was not saved by OptimizerInBackward of "
                             "this model).")
        for optimizer, state in zip(self.optimizers, saved):
            optimizer.load_state_dict(state)


def optimizer_in_backward(model: nn.Module, optimizer_class: type | None = None,
                          **optimizer_kwargs) -> OptimizerInBackward:
    """Step every parameter of ``model`` (as ``apply`` returned it: FSDP2-sharded, or the
    ``DistributedDataParallel`` module before its first forward) in backward, each with its
    own ``optimizer_class(param, **optimizer_kwargs)`` (default: the plan's optimizer), and
    return them as one ``OptimizerInBackward``. See [Note: the optimizer in backward]."""
    if getattr(model, _IN_BACKWARD_ATTRIBUTE, None) is not None:
        raise ValueError("the model's optimizer already steps in backward "
                         "(in_backward_optimizer(model) returns it); install it once.")
    if optimizer_class is None:
        name = OPTIMIZER_CLASSES.get(str(PLAN.get("optimizer", "adamw")))
        if name is None:
            raise ValueError(f"PLAN's optimizer {PLAN.get('optimizer')!r} has no optimizer to "
                             "step in backward; pass optimizer_class.")
        optimizer_class = getattr(torch.optim, name)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters to step in backward.")
    if "foreach" in inspect.signature(optimizer_class).parameters:
        # one temporary of the parameter's size, as on a GPU (torch's default there); a CPU's
        # default single-tensor AdamW holds two (fsdp-plan's memory model counts one)
        optimizer_kwargs.setdefault("foreach", True)
    if hasattr(model, "reducer"):  # DistributedDataParallel
        if getattr(model, "_lazy_init_ran", False):
            raise ValueError("optimizer_in_backward on a DistributedDataParallel module that "
                             "already ran forward: DDP sets it up at its first forward; install "
                             "it right after apply().")
        optimizers = _ddp_steps_in_backward(model, params, optimizer_class, optimizer_kwargs)
    else:
        _require_fsdp2_hooks(model)
        optimizers = [_step_in_backward(p, optimizer_class, optimizer_kwargs) for p in params]
    wrapper = OptimizerInBackward(optimizers)
    setattr(model, _IN_BACKWARD_ATTRIBUTE, wrapper)
    return wrapper


def in_backward_optimizer(model: nn.Module) -> OptimizerInBackward | None:
    """The ``OptimizerInBackward`` that ``apply`` or ``optimizer_in_backward`` installed on
    ``model``, or None."""
    return getattr(model, _IN_BACKWARD_ATTRIBUTE, None)


def _step_in_backward(param: nn.Parameter, optimizer_class: type, kwargs: dict):
    """One FSDP2 sharded parameter's optimizer, stepped by its post-accumulate-grad hook."""
    optimizer = optimizer_class([param], **kwargs)

    def step(p: torch.Tensor) -> None:
        optimizer.step()
        p.grad = None
    param.register_post_accumulate_grad_hook(step)
    return optimizer


def _ddp_steps_in_backward(ddp: nn.Module, params: list, optimizer_class: type,
                           kwargs: dict) -> list:
    """DDP's parameters stepped after their bucket's all-reduce. On a GPU, torch's own
    ``_apply_optimizer_in_backward``: DDP turns it into its communication hook at its first
    forward, the steps on a stream of their own. Its hook needs an accelerator, so on a CPU
    this module registers the same hook: the bucket averaged and all-reduced, then each of its
    parameters given its gradient and stepped, and every gradient dropped once backward (and
    DDP's copy-back) is done. It waits for the all-reduce on the backward's thread (gloo's
    all-reduce takes the cores backward runs on anyway): stepped on gloo's callback thread,
    the steps would race the next bucket's and escape a memory tracker's dispatch mode."""
    if torch.cuda.is_available():
        from torch.distributed.optim import _apply_optimizer_in_backward

        _apply_optimizer_in_backward(optimizer_class, params, kwargs)
        return [o for p in params for o in p._in_backward_optimizers]
    optimizers = {p: optimizer_class([p], **kwargs) for p in params}
    queued = [False]

    def drop_gradients() -> None:
        for p in optimizers:
            p.grad = None
        queued[0] = False

    def all_reduce_then_step(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer().div_(dist.get_world_size(group))
        if not queued[0]:  # the hook runs on the backward's thread: the end of this backward
            torch.autograd.Variable._execution_engine.queue_callback(drop_gradients)
            queued[0] = True
        dist.all_reduce(buffer, group=group)
        for p, grad in zip(bucket.parameters(), bucket.gradients()):
            if p in optimizers:
                p.grad = grad
                optimizers[p].step()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done
    ddp.register_comm_hook(None, all_reduce_then_step)
    return list(optimizers.values())


def _require_fsdp2_hooks(model: nn.Module) -> None:
    """``model`` is sharded by FSDP2, whose sharded parameters' post-accumulate-grad hooks it
    runs (only some torch builds do)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("optimizer_in_backward steps parameters sharded by FSDP2 (apply or "
                         "apply_fully_shard) or wrapped by DistributedDataParallel (apply or "
                         "apply_ddp); this model is neither (FSDP1's FullyShardedDataParallel "
                         "cannot step its optimizer in backward).")

    if "_post_accumulate_grad_hooks" not in inspect.getsource(_fsdp_collectives.foreach_reduce):
        raise ValueError(f"this torch ({torch.__version__}) does not run post-accumulate-grad "
                         "hooks on FSDP2's sharded gradients, so the optimizer cannot step in "
                         "backward; upgrade torch or re-plan without --optimizer-overlap.")


def autocast() -> contextlib.AbstractContextManager:
    """The context a training loop wraps forward and loss in.

    ``torch.autocast(device_type, AUTOCAST_DTYPE)`` where the plan computes under autocast: its
    ``mixed_precision.autocast_dtype`` (parameters kept in float32 by FSDP, compute in a lower
    dtype), or a DDP plan whose ``param_dtype`` is below float32 (DDP keeps float32
    parameters). Otherwise a no-op (``contextlib.nullcontext()``): FSDP2's
    ``MixedPrecisionPolicy`` already casts each unit's parameters and inputs. The device type
    is that of ``local_device()``.
    """
    if AUTOCAST_DTYPE is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=local_device().type, dtype=AUTOCAST_DTYPE)


class LaunchMismatch(RuntimeError):
    """The run is not the plan: raised by ``check_launch``, its message one paragraph listing
    every difference found."""


# [Note: checking a launch]
# A framework configured from an export may still not run the plan: accelerate and the Trainer
# under torchrun on a CPU see world 1 without ACCELERATE_USE_CPU (no distributed sampler, every
# rank trains the same data), accelerate applies no FSDP on a CPU at all, a class list wraps
# other modules than the plan's units. ``check_launch`` reads the model after the framework
# prepared it and compares what it finds with PLAN: the FSDP units (FSDP2 ``FSDPModule``s or
# FSDP1 instances, by plain FQN) with their ``reshard_after_forward``, mixed precision and mesh;
# the checkpointed modules and their mode; DDP and its settings; the process group's size
# against the plan's and against the framework's own world size. FSDP2 keeps a unit's settings
# only on its state (``_get_fsdp_state()._fsdp_param_groups``, no public getter), so those are
# read there and a torch without that state skips the settings, never the units.

_WRAPPER_ATTRIBUTES = ("module", "_orig_mod", "_forward_module", "_original_module")
"""Attributes through which framework wrappers hold the network: DistributedDataParallel's and
accelerate's ``module``, ``torch.compile``'s ``_orig_mod``, Lightning's ``_forward_module``."""


def _planned_network(model: nn.Module) -> tuple[nn.Module, list]:
    """The module the plan's FQNs are names in (``model``, or the network inside wrappers or in
    a child such as a LightningModule's attribute), and the wrappers passed on the way."""
    wanted = ({fqn for unit in PLAN["units"] for fqn in unit["modules"] if fqn}
              | set(checkpoint_modes()))
    queue = [(model, [], 0)]
    seen = set()
    while queue:
        candidate, outer, depth = queue.pop(0)
        if id(candidate) in seen:
            continue
        seen.add(id(candidate))
        names = {plain_fqn(name) for name, _ in candidate.named_modules()} if wanted else set()
        inner = [getattr(candidate, a) for a in _WRAPPER_ATTRIBUTES
                 if isinstance(getattr(candidate, a, None), nn.Module)
                 and type(candidate).__name__ != "FullyShardedDataParallel"]
        if (wanted and wanted <= names) or (not wanted and not inner):
            return candidate, outer
        queue += [(module, [*outer, candidate], depth) for module in inner]
        if depth < 2:
            queue += [(child, outer, depth + 1) for child in candidate.children()]
    return model, []


def _fsdp2_units(network: nn.Module) -> dict:
    """``{plain FQNs of a unit's modules: (reshard_after_forward, (param, reduce dtype), mesh
    shape)}`` of the FSDP2 states holding parameters; a setting is None where unreadable."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return {}
    states: dict = {}  # id(state) -> (state, [plain FQNs])
    for name, module in network.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            states.setdefault(id(state), (state, []))[1].append(plain_fqn(name))
    units: dict = {}
    for state, fqns in states.values():
        groups = getattr(state, "_fsdp_param_groups", None)
        key = tuple(sorted(set(fqns)))
        if groups == [] and key in units:
            continue  # no parameters of its own (accelerate shards each checkpoint wrapper too)
        settings: tuple = (None, None, None)
        if groups:
            group = groups[0]
            root = "" in fqns
            reshard = (group.post_forward_mesh_info is not None
                       and not (root and getattr(state, "_auto_reshard_after_forward", False)))
            mp = group.mp_policy
            param = mp.param_dtype or torch.float32
            settings = (reshard, (param, mp.reduce_dtype or param),
                        tuple(group.mesh_info.mesh.shape))
        if groups != [] or key not in units:
            units[key] = settings  # a state holding parameters wins over an empty one
    return units


def _checkpointed(network: nn.Module) -> dict:
    """``{plain FQN: full | selective}`` of the checkpointed modules: checkpoint wrappers (per-op
    selective when given a ``context_fn``) and Hugging Face layers with their own gradient
    checkpointing switched on (full)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    found = {}
    for name, module in network.named_modules():
        if isinstance(module, CheckpointWrapper):
            keywords = getattr(module.checkpoint_fn, "keywords", {}) or {}
            found[plain_fqn(name)] = "selective" if keywords.get("context_fn") else "full"
        elif getattr(module, "gradient_checkpointing", False) is True and any(
                cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__):
            found.setdefault(plain_fqn(name), "full")
    return found


def _names(fqns) -> str:
    fqns = sorted(fqns)
    shown = ", ".join(repr(f) for f in fqns[:6])
    return shown + (f" and {len(fqns) - 6} more" if len(fqns) > 6 else "")


def _unit_differences(network: nn.Module, ddp) -> list:
    """How the model's FSDP units differ from the plan's (sharded plans)."""
    differences = []
    found = _fsdp2_units(network)
    fsdp1 = {plain_fqn(name): module for name, module in network.named_modules()
             if type(module).__name__ == "FullyShardedDataParallel"}
    if not found and not fsdp1:
        where = (" it is wrapped in DistributedDataParallel instead" if ddp is not None
                 else " nothing shards it")
        return [f"none of the plan's {len(PLAN['units'])} FSDP units is applied (no FSDPModule "
                f"or FullyShardedDataParallel in the model):{where}"]
    if fsdp1 and not found:
        missing, extra = set(FSDP1_UNITS) - set(fsdp1), set(fsdp1) - set(FSDP1_UNITS)
        if missing:
            differences.append(f"no FSDP1 instance at the planned units {_names(missing)}")
        if extra:
            differences.append(f"FSDP1 instances the plan does not have at {_names(extra)}")
        wrong = sorted(f for f, m in fsdp1.items()
                       if f in FSDP1_UNITS and m.sharding_strategy != FSDP_KWARGS["sharding_strategy"])
        if wrong:
            differences.append(f"FSDP1 units {_names(wrong)} shard with another strategy than "
                               f"{FSDP_KWARGS['sharding_strategy'].name}")
        return differences
    planned = {tuple(sorted(unit["modules"])): unit for unit in PLAN["units"]}
    missing = [key for key in planned if key not in found]
    extra = [key for key in found if key not in planned]
    if missing:
        differences.append(f"no FSDP unit for {_names(' + '.join(k) or 'the root' for k in missing)}")
    if extra:
        differences.append("FSDP units the plan does not have: "
                           f"{_names(' + '.join(k) or 'the root' for k in extra)}")
    replicate, shard = PLAN["mesh"]["replicate"], PLAN["mesh"]["shard"]
    mesh = (replicate, shard) if replicate > 1 else (shard,)
    reshard, precision, meshes = [], [], set()
    for key, unit in planned.items():
        if key not in found or found[key][0] is None:
            continue
        got_reshard, got_precision, got_mesh = found[key]
        name = " + ".join(key) or "the root"
        if got_reshard != bool(unit["reshard_after_forward"]):
            reshard.append(f"{name} {'reshards' if got_reshard else 'does not reshard'}")
        want = _unit_precision(unit)
        param = want["param_dtype"] or torch.float32
        if got_precision != (param, want["reduce_dtype"] or param):
            precision.append(f"{name} computes in {str(got_precision[0])[6:]} and reduces in "
                             f"{str(got_precision[1])[6:]} (planned {str(param)[6:]}, "
                             f"{str(want['reduce_dtype'] or param)[6:]})")
        if got_mesh != mesh:
            meshes.add(got_mesh)
    if reshard:
        differences.append("reshard_after_forward differs from the plan: " + "; ".join(reshard[:4])
                           + (f" and {len(reshard) - 4} more" if len(reshard) > 4 else ""))
    if precision:
        differences.append("mixed precision differs: " + "; ".join(precision[:3])
                           + (f" and {len(precision) - 3} more" if len(precision) > 3 else ""))
    if meshes:
        differences.append(f"units shard over a mesh of shape {sorted(meshes)}, the plan's is "
                           f"{mesh} (replicate x shard)")
    if ddp is not None:
        differences.append("the FSDP model is also wrapped in DistributedDataParallel")
    return differences


def _ddp_differences(ddp) -> list:
    """How the model's DistributedDataParallel differs from the plan's (DDP plans)."""
    if ddp is None:
        return ["the plan is DDP but the model is not wrapped in DistributedDataParallel"]
    differences = []
    kwargs = DDP_KWARGS
    cap_mb = (kwargs.get("bucket_cap_mb_list") or [None, kwargs.get("bucket_cap_mb")])[-1]
    cap = int((25 if cap_mb is None else cap_mb) * 1024 * 1024)
    if getattr(ddp, "bucket_bytes_cap", cap) != cap:
        differences.append(f"DDP buckets are capped at {ddp.bucket_bytes_cap / 2**20:g} MB, the "
                           f"plan's at {cap / 2**20:g} MB")
    for key in ("gradient_as_bucket_view", "find_unused_parameters", "static_graph"):
        if bool(getattr(ddp, key, kwargs[key])) != kwargs[key]:
            differences.append(f"DDP {key} is {bool(getattr(ddp, key))}, the plan's "
                               f"{kwargs[key]}")
    hook = (PLAN.get("ddp") or {}).get("comm_hook")
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks is not None and bool(hooks) != bool(hook):
        differences.append(f"the plan's DDP gradient hook is {hook or 'none'} but "
                           f"{len(hooks)} hook(s) are registered")
    return differences


def launch_differences(model: nn.Module, *, world_size: int | None = None,
                       who: str = "the framework") -> list:
    """What ``check_launch`` would report, as a list of sentences (empty: the run is the plan)."""
    from torch.nn.parallel import DistributedDataParallel

    differences = []
    if not dist.is_initialized():
        differences.append("torch.distributed is not initialized, so this process trains alone")
    else:
        ranks = dist.get_world_size()
        if ranks != PLAN["world_size"]:
            differences.append(f"the process group has {ranks} ranks, the plan is for "
                               f"{PLAN['world_size']}")
        if world_size is not None and int(world_size) != ranks:
            differences.append(f"{who} sees a world of {world_size} process(es) where "
                               f"torch.distributed has {ranks}: it neither shards nor splits "
                               "the data between ranks, so every rank trains the same batches")
    network, wrappers = _planned_network(model)
    ddp = next((w for w in wrappers if isinstance(w, DistributedDataParallel)), None)
    if PLAN["strategy"] == "ddp":
        differences += _ddp_differences(ddp)
    else:
        try:
            differences += _unit_differences(network, ddp)
        except ValueError as error:
            differences.append(str(error))
    planned, got = checkpoint_modes(), _checkpointed(network)
    missing = set(planned) - set(got)
    extra = set(got) - set(planned)
    modes = sorted(f for f in set(planned) & set(got) if planned[f] != got[f])
    if missing:
        differences.append(f"{len(missing)} planned checkpointed module(s) are not checkpointed: "
                           f"{_names(missing)}")
    if extra:
        differences.append(f"{len(extra)} module(s) the plan does not checkpoint are: "
                           f"{_names(extra)}")
    if modes:
        differences.append("checkpointing modes differ: " + "; ".join(
            f"{f} is {got[f]}, planned {planned[f]}" for f in modes[:4]))
    if PLAN.get("optimizer_overlap") and all(in_backward_optimizer(m) is None
                                             for m in (model, network, *wrappers)):
        differences.append("the plan steps each parameter in backward (optimizer_overlap), and "
                           "no optimizer does: install it with optimizer_in_backward(model, "
                           "lr=...) after apply (apply(model, optimizer_kwargs=...) does both)")
    return differences


def check_launch(model: nn.Module, *, world_size: int | None = None,
                 who: str = "the framework", fix: str = "") -> nn.Module:
    """Check that ``model``, as the framework prepared it, runs the plan; return it.

    Call it after the framework wrapped the model and before the first step (accelerate: after
    ``prepare``; the Trainer: a callback's ``on_train_begin``; Lightning: ``on_fit_start``).
    ``model`` may be the wrapper (DistributedDataParallel, accelerate's or Lightning's) or a
    module holding the network: the network is found by the plan's module names. Pass the
    framework's own ``world_size`` (accelerate's ``num_processes``, the Trainer's
    ``args.world_size``, Lightning's ``trainer.world_size``) to catch a framework that does not
    see the process group; ``who`` names the framework and ``fix`` is appended to the message.
    Raises ``LaunchMismatch`` listing every difference (see [Note: checking a launch])."""
    differences = launch_differences(model, world_size=world_size, who=who)
    if differences:
        raise LaunchMismatch("This run is not the plan (check_launch): " + "; ".join(differences)
                             + "." + (f" {fix}" if fix else ""))
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
        self._fqns: dict = {}  # id(module) -> (weakref to module, plain FQN)

    def _fqn_of(self, module: nn.Module) -> str | None:
        entry = self._fqns.get(id(module))
        if entry is None or entry[0]() is not module:
            return None
        return entry[1]

    def _learn(self, root: nn.Module) -> None:
        self._fqns = {}
        seen = set()
        for name, module in root.named_modules():
            fqn = plain_fqn(name)
            if fqn not in seen:  # the outermost module of a plain FQN, as in apply_fully_shard
                seen.add(fqn)
                self._fqns[id(module)] = (weakref.ref(module), fqn)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            if self._fqn_of(module) is None:
                self._learn(module)
            return True
        return self._fqn_of(module) in self._wanted


auto_wrap_policy = _PlanWrapPolicy([])


def _fsdp1_mixed_precision() -> MixedPrecision | None:
    """FSDP1's ``MixedPrecision`` for the plan.

    FSDP1 wraps every ``_BatchNorm`` separately in full precision by default
    (``_module_classes_to_ignore``); the plan lists those modules as units of their own
    whenever it computes below float32, so FSDP1 wraps the plan's units either way. Without a
    lower param dtype the plan has no such units, so FSDP1 is told not to add them.
    """
    if PARAM_DTYPE is None and REDUCE_DTYPE is None:
        return None
    if PARAM_DTYPE is None or PARAM_DTYPE.itemsize >= 4:
        return MixedPrecision(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE,
                              buffer_dtype=None, _module_classes_to_ignore=())
    return MixedPrecision(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE, buffer_dtype=None)


def _configure() -> None:
    """Check PLAN and derive the module-level constants from it (nothing when PLAN is empty)."""
    global PARAM_DTYPE, REDUCE_DTYPE, AUTOCAST_DTYPE, auto_wrap_policy
    if not PLAN:
        return
    _check_plan()
    PARAM_DTYPE = _dtype(PLAN["mixed_precision"].get("param_dtype"))
    REDUCE_DTYPE = _dtype(PLAN["mixed_precision"].get("reduce_dtype"))
    AUTOCAST_DTYPE = _dtype(PLAN["mixed_precision"].get("autocast_dtype"))
    if (AUTOCAST_DTYPE is None and PLAN["strategy"] == "ddp" and PARAM_DTYPE is not None
            and PARAM_DTYPE.itemsize < 4):
        AUTOCAST_DTYPE = PARAM_DTYPE  # DDP keeps float32 parameters and computes under autocast
    FSDP1_UNITS[:] = [fqn for unit in PLAN["units"] for fqn in unit["modules"]]
    FSDP_KWARGS.update({
        "sharding_strategy": _SHARDING_STRATEGIES[PLAN["strategy"]],
        "backward_prefetch": (BackwardPrefetch.BACKWARD_PRE
                              if any(PLAN["backward_prefetch"].values()) else None),
        "forward_prefetch": any(PLAN["forward_prefetch"].values()),
        "limit_all_gathers": True,
        "mixed_precision": _fsdp1_mixed_precision(),
        **({"cpu_offload": CPUOffload(offload_params=True)}
           if (PLAN.get("offload") or {}).get("params") else {}),
    })
    auto_wrap_policy = _PlanWrapPolicy(FSDP1_UNITS)
    if PLAN.get("ddp") is not None:
        DDP_KWARGS.update(ddp_kwargs(PLAN["ddp"]))


_configure()
