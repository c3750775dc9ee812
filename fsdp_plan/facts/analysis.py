"""Activation and compute analysis: one fake forward + backward of the unwrapped model.

[Note: activation timeline]
The analysis runs the model once under ``FakeTensorMode`` with parameters in the planned
``param_dtype`` (what FSDP's mixed precision computes with) and records, at every module
boundary (pre/post forward, pre/post backward, in execution order), the bytes of every live
tensor that is *not* a parameter or a parameter's gradient, and the highest such figure
since the previous boundary. Those bytes (activations saved for backward, transient
temporaries, activation gradients, the loss) do not depend on how the model is sharded,
so the memory model composes any FSDP plan's peak as this timeline plus the sharded states
plus the unsharded parameters and gradients that plan keeps live at each boundary.
Cumulative FLOPs (PyTorch's ``flop_registry``, the rules ``FlopCounterMode`` uses; the mode
itself keeps recomputed tensors alive under checkpointing) are recorded at the same boundaries, giving each module's forward and
backward compute. With activation checkpointing the timeline changes inside the
checkpointed blocks only; a second pass with every repeated block fully checkpointed and a
third with every repeated block selectively checkpointed supply those segments (``Timeline``
per pass; see timeline.py for the composition, checkpointing.py for the modes).
"""

from __future__ import annotations

import contextlib
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from fsdp_plan.common.autocast import autocast_context, float32_autocast_as_on_cuda
from fsdp_plan.common.errors import BadInput, Stop
from fsdp_plan.facts.checkpointing import DEFAULT_SELECTIVE_OPS
from fsdp_plan.facts.compiled import analyze_compiled
from fsdp_plan.facts.depth import expand_pass, reduced_copy
from fsdp_plan.facts.dtypes import DtypeChecker, running_modules
from fsdp_plan.facts.forked import ForkedPasses
from fsdp_plan.facts.graph import has_submodule, keeps_full_precision
from fsdp_plan.facts.op_classes import ATTENTION_PACKETS as _ATTENTION_PACKETS
from fsdp_plan.facts.op_classes import CPU_ATTENTION_FLOP_RULES  # noqa: F401 (tests import it here)
from fsdp_plan.facts.op_classes import FLOP_RULES as _FLOP_RULES
from fsdp_plan.facts.op_classes import mm_class as _mm_class
from fsdp_plan.facts.types import (
    AUTOCAST_EXIT,
    Analysis,
    Event,
    ModuleCompute,
    SelectivePass,
    Timeline,
    fill_flops,
)
from fsdp_plan.model.fake import materialize_fake, new_fake_mode
from fsdp_plan.model.load import (
    LoadedModel,
    base_exception_refusal,
    rebuild_meta,
    user_code_location,
)
from fsdp_plan.model.transformer_masks import MaskOrigins, transformer_masks_traceable
from fsdp_plan.policy_runtime import checkpoint_module, plain_fqn, resolve_ops

# Drops the wrapper segments FSDP1 and checkpointing insert, as the emitted policy does.
normalize_fqn = plain_fqn


_GATHERS = {torch.ops.aten.embedding, torch.ops.aten.index_select, torch.ops.aten.gather,
            torch.ops.aten.index}
_METADATA_ONLY = {torch.ops.aten._unsafe_view, torch.ops.aten.detach, torch.ops.aten.alias,
                  torch.ops.aten.lift_fresh, torch.ops.aten.empty, torch.ops.aten.empty_like,
                  torch.ops.aten.empty_strided, torch.ops.aten.new_empty,
                  torch.ops.aten.new_empty_strided, torch.ops.aten.set_}


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` in ``tree_flatten``'s order. An op's arguments and outputs
    are tensors, plain tuples, lists and dicts of them, or scalars, walked here without pytree
    (which cost a tenth of each pass: it builds a spec and a wrapper per call); anything
    else (named tuples, ``torch.return_types``, other containers) goes through
    ``tree_flatten``."""
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    _collect(value, found)
    return found


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif type(value) is tuple or type(value) is list:
        for item in value:
            _collect(item, found)
    elif type(value) is dict:  # pytree's order: the values in insertion order
        for item in value.values():
            _collect(item, found)
    elif value is None or type(value) in _SCALARS:
        return
    else:
        found.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


_SCALARS = frozenset({int, float, bool, str, torch.dtype, torch.device, torch.layout,
                      torch.memory_format})


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


class _ActivationMeter(TorchDispatchMode):
    """Counts bytes of live non-parameter storages, with the peak since the last ``mark``,
    FLOPs, and the op-class counters of [Note: op classes] (facts/types.py) since ``take_ops``,
    while ``measuring``; and is the pass's one dispatch mode ([Note: one dispatch mode per
    pass]): it feeds the mask origins (``watching``) and runs the dtype check.

    [Note: one dispatch mode per pass]
    Each ``TorchDispatchMode`` on the stack costs every op a trip through torch's dispatcher
    (the mode popped and pushed back) and through the ``_disable_dynamo`` wrapper torch puts
    on every ``__torch_dispatch__``, whatever the mode then does. A pass once stacked three
    (the dtype check, this meter, the causal-mask origins) over the fake mode; they are one
    now, each op seen once: the check before the op runs, the origins and the meter after.
    The mask origins are fed from the inputs on, the rest only while ``measuring``, as each
    mode once was entered. DtypeChecker and the origins stay modes of their own where
    ``measure/memory.py`` uses them. With the tensor walk (``_tensors``), one pass of the
    depth-cut 70B shape went from 0.33 s to 0.235 s (issue 29, stop 47)."""

    def __init__(self, excluded: set[int]) -> None:
        super().__init__()
        self.excluded = excluded
        self.masks: MaskOrigins | None = None
        self.checker: DtypeChecker | None = None
        """Set while ops are measured and checked (``measuring``)."""
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.current = 0
        self.peak_since_mark = 0
        self.flops = 0.0
        self.ops: dict[str, float] = {}
        self.where: Callable[[], str] | None = None
        """The module running (set by ``run_pass``): who made each storage (``made_in``)."""
        self.made_in: dict[int, str] = {}

    def take_ops(self) -> dict[str, float] | None:
        """The op-class counters since the previous call (``None`` when no op ran), reset."""
        ops, self.ops = self.ops, {}
        return ops or None

    def _count(self, key: str, value: float) -> None:
        self.ops[key] = self.ops.get(key, 0.0) + value

    def track(self, tensor: torch.Tensor) -> None:
        st = tensor.untyped_storage()
        key = id(st)
        if key in self.excluded or key in self.live:
            return
        nbytes = st.nbytes()
        ref = weakref.ref(st, lambda _r, k=key: self._free(k))
        self.live[key] = (ref, nbytes)
        if self.where is not None:
            self.made_in[key] = self.where()
        self.current += nbytes
        self.peak_since_mark = max(self.peak_since_mark, self.current)

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        self.made_in.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def untrack(self, tensor: torch.Tensor) -> None:
        """Reclassify a storage as a parameter gradient: it leaves the activation side."""
        key = id(tensor.untyped_storage())
        self._free(key)
        self.excluded.add(key)

    def mark(self) -> int:
        peak = max(self.peak_since_mark, self.current)
        self.peak_since_mark = self.current
        return peak

    @contextlib.contextmanager
    def watching(self, masks: MaskOrigins) -> Iterator[None]:
        """The mode entered, feeding ``masks`` every op (``transformer_masks_traceable``
        with ``watch=False``)."""
        self.masks = masks
        try:
            with self:
                yield
        finally:
            self.masks = None

    @contextlib.contextmanager
    def measuring(self, checker: DtypeChecker) -> Iterator[None]:
        """Ops measured and checked by ``checker`` within the block (the mode already
        entered: ``watching``)."""
        self.checker = checker
        try:
            yield
        finally:
            self.checker = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        checker = self.checker
        if checker is not None:
            checker.check(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.masks is not None:
            self.masks.record(func, args, kwargs, out)
        if checker is not None:
            self._measure(func, args, kwargs, out)
        return out

    def _measure(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        for tensor in _tensors(out):
            self.track(tensor)
        count = _FLOP_RULES.get(func._overloadpacket)
        if count is not None:
            flops = count(*args, **kwargs, out_val=out)
            self.flops += flops
            self._count("ops", 1)
            self._count("attention" if func._overloadpacket in _ATTENTION_PACKETS
                        else _mm_class(func, args), flops)
        elif (not func.is_view and func.namespace == "aten"
              and func._overloadpacket not in _METADATA_ONLY):
            self._count("ops", 1)
            moved = _tensor_bytes(out)  # a lookup reads the rows it writes, not its whole table
            self._count("memory_bytes", 2 * moved if func._overloadpacket in _GATHERS
                        else moved + _tensor_bytes((args, kwargs)))


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def _storages(value: Any) -> dict[int, int]:
    """The distinct storages of the tensors in ``value``: their ids and bytes."""
    leaves, _ = tree_flatten(value)
    return {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in leaves
            if isinstance(t, torch.Tensor)}


def _bytes_of(value: Any) -> int:
    return sum(_storages(value).values())


def run_pass(loaded: LoadedModel, *, param_dtype: torch.dtype | None,
             checkpoint: list[str] | None = None, model: nn.Module | None = None,
             selective_ops: list[str] | None = None, autocast_dtype: torch.dtype | None = None,
             selective_mm_stride: int = 1
             ) -> tuple[Timeline, dict[str, ModuleCompute], int]:
    """One fake forward + backward; returns the timeline, per-module figures and input bytes.

    ``checkpoint``: modules wrapped for full recomputation, or for selective checkpointing
    saving ``selective_ops`` (op names, every ``selective_mm_stride``-th ``aten.mm``) when
    given. ``autocast_dtype``: parameters stay as built (float32) and forward and loss run
    under ``torch.autocast`` ([Note: autocast precision] in autocast.py)."""
    if autocast_dtype is not None and param_dtype is not None and param_dtype.itemsize < 4:
        raise ValueError("autocast keeps float32 parameters: pass param_dtype None with it")
    started = time.perf_counter()
    model = model if model is not None else rebuild_meta(loaded)
    fake_mode = new_fake_mode()
    materialize_fake(model, fake_mode)
    if checkpoint:
        apply_checkpointing(model, checkpoint, selective_ops, selective_mm_stride)
    # Batch norm stays float32, its inputs cast up and outputs back, as the plan applies it.
    full = [m for m in model.modules() if keeps_full_precision(m)] if (
        param_dtype is not None and param_dtype.itemsize < 4) else []
    kept = {id(p) for m in full for p in m.parameters(recurse=False)}
    if param_dtype is not None:
        with fake_mode:
            for p in model.parameters():
                if p.is_floating_point() and id(p) not in kept:
                    p.data = p.data.to(param_dtype)
    casts = [h for m in full for h in (
        m.register_forward_pre_hook(lambda _m, a: _cast_floating(a, torch.float32)),
        m.register_forward_hook(lambda _m, _a, out: _cast_floating(out, param_dtype)))]
    param_storages = {id(p.untyped_storage()) for p in model.parameters()}
    param_storages |= {id(b.untyped_storage()) for b in model.buffers()}
    meter = _ActivationMeter(set(param_storages))
    modules: dict[str, ModuleCompute] = {}
    events: list[Event] = []
    stack: list[str] = []
    names = {id(m): normalize_fqn(n) for n, m in model.named_modules()}

    def record(kind: str, module: nn.Module) -> None:
        fqn = names.get(id(module))
        if fqn is None:
            return
        events.append(Event(kind=kind, module=fqn, level=meter.current, peak=meter.mark(),
                            flops=float(meter.flops), ops=meter.take_ops()))

    def pre_fw(module: nn.Module, _inputs: Any) -> None:
        record("pre_fw", module)
        fqn = names.get(id(module))
        if fqn is not None:
            stack.append(fqn)

    def post_fw(module: nn.Module, _inputs: Any, outputs: Any) -> None:
        fqn = names.get(id(module))
        if fqn is not None and not failed_in and sys.exc_info()[0] is not None:
            failed_in.append(fqn)  # hooks run on the way out of a raising forward: innermost first
        if fqn is not None and stack and stack[-1] == fqn:
            stack.pop()
            comp = modules.setdefault(fqn, ModuleCompute())
            comp.calls += 1
            comp.output_bytes = _bytes_of(outputs)
        record("post_fw", module)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = id(t.untyped_storage())
        if key not in meter.excluded and key not in saved_seen and stack:
            saved_seen.add(key)
            modules.setdefault(stack[-1], ModuleCompute()).saved_bytes += t.untyped_storage().nbytes()
        return t

    saved_seen: set[int] = set()
    failed_in: list[str] = []
    released: dict[str, int] = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: meter.untrack(p.grad))
             for p in model.parameters() if p.requires_grad]
    tracker = ModTracker()
    tracker.register_user_hooks(pre_fw, post_fw, lambda m, g: record("pre_bw", m),
                                lambda m, g: record("post_bw", m))
    # nn.Transformer's causal-mask check reads values: [Note: causal masks on fake tensors];
    # [Note: one dispatch mode per pass]; float32 regions compute as on a GPU, in backward's
    # recompute too ([Note: float32 autocast regions] in common/autocast.py)
    with fake_mode, transformer_masks_traceable(loaded.notes, watch=False) as masks, \
            meter.watching(masks), float32_autocast_as_on_cuda():
        args, kwargs = loaded.make_inputs(loaded.source.batch_size, loaded.source.seq_len)
        fed_storages = _storages((args, kwargs))
        input_bytes = sum(fed_storages.values())  # as the loop feeds them
        # the inputs are counted once, as inputs: a forward that saves one as it was fed (a
        # float32 input to a float32 matmul or convolution) adds no activation
        meter.excluded |= fed_storages.keys()
        try:
            checker = DtypeChecker(running_modules(tracker))  # fake kernels accept mixed dtypes
            with tracker, meter.measuring(checker), torch.autograd.graph.saved_tensors_hooks(
                    pack, lambda t: t):
                meter.where = lambda: stack[-1] if stack else ""
                # FSDP's root casts floating inputs to param_dtype (cast_forward_inputs): the
                # copies are the step's, kept only where backward saves them
                fed = ((_cast_floating(args, param_dtype), _cast_floating(kwargs, param_dtype))
                       if param_dtype is not None else (args, kwargs))
                with autocast_context(_dtype_name(autocast_dtype)):
                    output = model(*fed[0], **fed[1])
                    del fed
                    checker.raise_if_mismatched()
                    loss = loaded.compute_loss(output)
                    del output
                    held = ({k: (n, meter.made_in.get(k, "")) for k, (_, n) in meter.live.items()}
                            if autocast_dtype is not None else {})
                meter.where = None
                if autocast_dtype is not None:  # what leaving autocast freed, and when
                    for key, (nbytes, owner) in held.items():
                        if key not in meter.live:
                            released[owner] = released.get(owner, 0) + nbytes
                    events.append(Event(kind=AUTOCAST_EXIT, module="", level=meter.current,
                                        peak=meter.mark(), flops=float(meter.flops),
                                        ops=meter.take_ops()))
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise BadInput("loss_fn must return a scalar tensor; got "
                                   f"{type(loss).__name__} of shape {getattr(loss, 'shape', None)}.")
                loss.backward()
                del loss
                events.append(Event(kind="end", module="", level=meter.current, peak=meter.mark(),
                                    flops=float(meter.flops), ops=meter.take_ops()))
        except BadInput:
            raise
        except Exception as e:
            where = failed_in[0] if failed_in else stack[-1] if stack else None
            raise _explain_trace_failure(e, loaded, where, _shapes(args, kwargs),
                                         _dtype_name(autocast_dtype)) from e
        except (KeyboardInterrupt, SystemExit, Stop):
            raise
        except BaseException as e:  # the model's own BaseException subclass, GeneratorExit
            raise base_exception_refusal("the model's forward, loss or backward", e,
                                         user_code_location(e, loaded)) from e
        finally:
            for h in hooks + casts:
                h.remove()
            tracker.clear_user_hooks()
    fill_flops(events, modules)
    timeline = Timeline(events=events, checkpointed=list(checkpoint or []),
                        final_level=meter.current, seconds=time.perf_counter() - started,
                        autocast_released=released)
    return timeline, modules, input_bytes


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def _shapes(args: tuple, kwargs: dict) -> str:
    """``[2, 16] int64, mask=[2, 16] bool``: what the model was fed, for error messages."""
    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        return type(value).__name__
    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])


def _explain_trace_failure(error: Exception, loaded: LoadedModel,
                           module: str | None = None, given: str = "",
                           autocast: str | None = None) -> BadInput:
    """The one-paragraph refusal for a pass that failed; ``autocast``: the dtype the pass's
    forward ran under ``torch.autocast`` in (the likelier cause, then, is the precision)."""
    name = type(error).__name__
    text = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else name
    if "DynamicOutputShape" in name or "data-dependent" in str(error).lower():
        config = getattr(loaded.model, "config", None)
        if getattr(config, "_experts_implementation", None) == "eager":
            return BadInput(
                f"the model's mixture-of-experts layers use transformers' eager experts loop, "
                f"which routes tokens with data-dependent shapes ({name}: {text}) that fake "
                "tensors cannot trace. Build it with the static grouped_mm implementation: pass "
                "experts_implementation='grouped_mm' to its config, or call "
                "model.set_experts_implementation('grouped_mm') in build_model (--hf-config "
                "does this for you).")
        return BadInput(
            f"the model's forward uses data-dependent shapes ({name}: {text}), which fake tensors "
            "cannot trace, e.g. mixture-of-experts routing with nonzero(). Use a static-shape "
            "implementation (for transformers MoE models, the grouped_mm experts implementation) "
            "or route tokens with fixed capacity in example mode.")
    inside = ""
    if module:
        kind = (type(loaded.model.get_submodule(module)).__name__
                if has_submodule(loaded.model, module) else "")
        inside = f" in module {module!r}" + (f" ({kind})" if kind else "")
    elif module == "":
        inside = " in the root module's forward"
    at = user_code_location(error, loaded)  # the user's file and line, when the error is theirs
    if "_local_scalar_dense" in text or "DataDependentOutput" in name:
        return BadInput(
            f"the model reads a tensor's value{inside}{at} ({name}: {text}): .item(), .tolist(), "
            "int()/float()/bool() of a tensor and `if tensor:` need real values, and planning runs "
            "on fake tensors, which have none. Compute the value from shapes or the config.")
    check = "example_inputs and --batch-size/--seq-len against what the model's forward expects"
    advice = f"Check {check}." if autocast is None else (
        f"The forward ran under torch.autocast({autocast}) with float32 parameters (--autocast), "
        "where only the ops on autocast's lists are cast down: a kernel that takes only "
        "low-precision inputs fails there. Plan without --autocast (FSDP's mixed precision "
        f"casts the parameters instead), or check {check}.")
    return BadInput(
        f"the model failed on its example inputs (batch {loaded.source.batch_size}, sequence "
        f"{loaded.source.seq_len}{'; given ' + given if given else ''}){inside}{at} with {name}: "
        f"{text}. {advice}")


def apply_checkpointing(model: nn.Module, fqns: list[str],
                        selective_ops: list[str] | None = None, mm_stride: int = 1) -> None:
    """Wrap each listed module in PyTorch's non-reentrant checkpoint wrapper, in place: the
    policy module's own wrapper (``checkpoint_module``), selective when ``selective_ops``
    (saving every ``mm_stride``-th ``aten.mm``)."""
    ops = resolve_ops(selective_ops) if selective_ops is not None else None
    for fqn in fqns:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, checkpoint_module(getattr(parent, child), ops, mm_stride))


@dataclass(frozen=True)
class _Compute:
    """How a pass computes: parameters cast to ``param_dtype`` (FSDP mixed precision), or kept
    float32 under ``torch.autocast(autocast)`` ([Note: autocast precision])."""

    param_dtype: torch.dtype | None
    autocast: torch.dtype | None = None


def analyze(loaded: LoadedModel, *, param_dtype: torch.dtype | None, blocks: list[str],
            with_checkpointing: bool = True, exact: bool = False,
            progress: Callable[[str], None] | None = None, compile_blocks: bool = False,
            activation_memory_budget: float | None = None,
            autocast_dtype: torch.dtype | None = None, selective_mm_stride: int = 1,
            selective_strides: tuple[int, ...] = (), ddp_autocast: bool = False) -> Analysis:
    """Run the plain pass and, when the model has repeated blocks, the all-blocks-checkpointed pass.

    ``compile_blocks``: the blocks run compiled (``--compile``); one block of each class is
    traced through the AOTAutograd partitioner (facts/compiled.py), whose saved set replaces
    the eager one in the plan's timeline (cost/timeline.py [Note: compiled timeline]), in each
    checkpointing mode that compiles.

    [Note: eager passes beside the compiled traces]
    Compiling, the planner's own work is the compiled traces: the plain one alone (2 s for
    the 70B shape, Dynamo's lazy set-up in it), then the checkpointed ones beside a child.
    The eager passes (plain, checkpointed, selective: 1 s in a child) used to run first,
    the planner taking its share; now a child runs all of them while the planner traces the
    plain compiled block, and their results are there when it asks. ``make_plan`` of the
    70B with ``--compile``: 5.2-5.4 s -> 4.9 s (stop 47). An error of the compiled traces
    (any ``Exception``) is raised after the eager passes', as when they ran first: a model
    that reads a tensor's value gets the plain pass's clear refusal, not the fake tensor's
    exception from the run that captures the blocks' inputs.

    Deep models are analysed on a copy cut to three blocks per stack and the middle block's
    segments are repeated (see depth.py); ``exact=True`` runs every block instead.
    ``autocast_dtype``: every pass keeps float32 parameters and computes under
    ``torch.autocast`` (``param_dtype`` must then be None or float32). The selective pass
    saves every ``selective_mm_stride``-th matmul; ``selective_strides`` adds passes at other
    strides (``Analysis.selective_variants``). ``ddp_autocast``: with ``param_dtype`` below
    float32, also the plain pass under autocast at that dtype (``Analysis.ddp_analysis``).
    """
    compute = _Compute(param_dtype=None if autocast_dtype is not None else param_dtype,
                       autocast=autocast_dtype)
    checkpointed = with_checkpointing and bool(blocks)
    under_autocast = ddp_autocast and autocast_dtype is None and param_dtype is not None and (
        param_dtype.itemsize < 4)
    full = _PassSpec(compute, tuple(blocks))

    def selective_spec(stride: int) -> _PassSpec:
        return _PassSpec(compute, tuple(blocks), tuple(DEFAULT_SELECTIVE_OPS), stride)

    # how DDP computes: float32 parameters under autocast
    under_ddp = _PassSpec(_Compute(None, param_dtype))

    def run(spec: _PassSpec) -> Callable[[], Pass]:
        return lambda: spec.run(loaded, blocks, exact)

    def result(name: str, spec: _PassSpec) -> Pass:
        """Pass ``name``: a child's, when one ran it, else run here."""
        return passes.result(name, run(spec))

    def selective_at(stride: int) -> tuple[Timeline | None, dict[str, float], str]:
        """The selective pass at ``stride`` (a child's, when started), after the plain one."""
        return _selective_pass(loaded, blocks, modules,
                               lambda: result(f"selective {stride}", selective_spec(stride)))

    ckpt = None
    selective: tuple[Timeline | None, dict[str, float], str] = (None, {}, "")
    variants: list[SelectivePass] = []
    compiled = None
    compile_error: Exception | None = None
    ddp, ddp_unavailable = None, ""
    plain = _PassSpec(compute)
    refusal = (_compile_refusal(loaded.model, blocks, param_dtype, autocast_dtype)
               if compile_blocks else None)
    compiling = compile_blocks and refusal is None
    # the passes after the plain one run beside it: [Note: passes in forked children]
    with ForkedPasses(loaded.notes) as passes:
        # compiled blocks are partitioned for the plan's own selective policy only
        other_strides = ([] if compile_blocks
                         else sorted(set(selective_strides) - {selective_mm_stride}))
        if compiling:  # [Note: eager passes beside the compiled traces]
            passes.start("plain", run(plain))
        if checkpointed:
            passes.start("full", run(full))
            for stride in [selective_mm_stride, *other_strides]:
                passes.start(f"selective {stride}", run(selective_spec(stride)))
        if under_autocast:
            passes.start("autocast", run(under_ddp))
        # the children run their share while the planner runs the plain pass (or, compiling,
        # the compiled traces)
        passes.launch(planner_busy=compiling)
        if compiling:
            if progress:
                progress("tracing the compiled blocks' partition")
            try:
                compiled = analyze_compiled(loaded, param_dtype=param_dtype, blocks=blocks,
                                            activation_memory_budget=activation_memory_budget,
                                            selective_mm_stride=selective_mm_stride)
            except Exception as e:  # noqa: BLE001  (raised once the eager passes' own errors
                compile_error = e  # had their turn: a model they refuse is refused for that)
        timeline, modules, input_bytes = result("plain", plain)
        if checkpointed:
            if progress:
                progress("analysing activation checkpointing")
            try:
                ckpt, _, _ = result("full", full)
            except BadInput:
                ckpt = None  # checkpointing cannot be traced here: plan without it
            if ckpt is not None:
                selective = selective_at(selective_mm_stride)
            for stride in other_strides:
                if selective[0] is None:
                    break
                other = selective_at(stride)
                if other[0] is not None:
                    variants.append(SelectivePass(mm_stride=stride, timeline=other[0],
                                                  recompute_flops=other[1]))
        if refusal is not None:
            raise BadInput(refusal)
        if compile_error is not None:
            raise compile_error
        if under_autocast:
            if progress:
                progress("analysing the step under torch.autocast (how DDP computes)")
            try:
                ddp = _plain_analysis(*result("autocast", under_ddp),
                                      dtype=param_dtype, autocast=True)
            except BadInput as e:  # e.g. a kernel that takes bfloat16 only, fed float32
                cause = e.__cause__ if e.__cause__ is not None else e
                text = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else ""
                ddp_unavailable = (f"DDP computes under torch.autocast with float32 parameters, "
                                   f"where this model fails ({type(cause).__name__}: {text}); "
                                   "DDP is not planned")
    analysis = _plain_analysis(timeline, modules, input_bytes,
                               dtype=autocast_dtype or param_dtype,
                               autocast=autocast_dtype is not None)
    analysis.checkpointed_timeline = ckpt
    analysis.selective_timeline = selective[0]
    analysis.selective_ops = list(DEFAULT_SELECTIVE_OPS) if selective[0] else []
    analysis.selective_recompute_flops = selective[1]
    analysis.selective_unavailable = selective[2]
    analysis.selective_mm_stride = selective_mm_stride
    analysis.selective_variants = variants
    analysis.ddp_analysis = ddp
    analysis.ddp_unavailable = ddp_unavailable
    analysis.compiled = compiled
    return analysis


def _compile_refusal(model: nn.Module, blocks: list[str], param_dtype: torch.dtype | None,
                     autocast_dtype: torch.dtype | None) -> str | None:
    """Why ``--compile`` cannot be planned for this model and precision (None: it can).

    Below float32, each batch norm with parameters is a float32 FSDP unit of its own
    ([Note: batch norm in full precision] in cost/units.py). One inside a block would be
    unsharded by FSDP2's hooks in the middle of the block's compiled forward, and Dynamo
    refuses those (``fullgraph=True``: "Attempted to call function marked as skipped"), so
    the step would fail at its first forward."""
    if not blocks:
        return ("--compile compiles the model's repeated blocks, and this model has none (no "
                "container of same-class children); plan without --compile.")
    if autocast_dtype is not None:
        return ("--compile with --autocast is not modelled: the compiled blocks' partition is "
                "traced with the parameters in param_dtype. Plan compiled blocks with "
                "--param-dtype bf16, or autocast without --compile.")
    lowered = param_dtype is not None and param_dtype.itemsize < 4
    held = next(((block, f"{block}.{name}", module) for block in blocks if lowered
                 for name, module in model.get_submodule(block).named_modules()
                 if keeps_full_precision(module)), None)
    if held is not None:
        block, norm, module = held
        return (f"--compile compiles each repeated block whole (fullgraph=True), and block "
                f"{block!r} holds batch norm {norm} ({type(module).__name__}), which runs in "
                "float32 as an FSDP unit of its own below --param-dtype float32; FSDP2's hooks "
                "on that unit cannot run inside the compiled graph, so the step would fail. "
                "Plan without --compile, or with --param-dtype fp32.")
    return None


def _plain_analysis(timeline: Timeline, modules: dict[str, ModuleCompute], input_bytes: int, *,
                    dtype: torch.dtype | None, autocast: bool) -> Analysis:
    """The ``Analysis`` of one plain pass (no checkpointed timelines)."""
    root = modules.get("", ModuleCompute())
    end = timeline.events[-1].flops if timeline.events else 0.0
    name = _dtype_name(dtype) or "float32"
    return Analysis(
        timeline=timeline, modules=modules, input_bytes=input_bytes, param_dtype=name,
        total_fw_flops=root.fw_flops, total_bw_flops=max(0.0, end - root.fw_flops),
        autocast_dtype=name if autocast else None)


def _selective_pass(loaded: LoadedModel, blocks: list[str], plain: dict[str, ModuleCompute],
                    run: Callable[[], tuple[Timeline, dict[str, ModuleCompute], int]]
                    ) -> tuple[Timeline | None, dict[str, float], str]:
    """The pass with every block selectively checkpointed (the replay probe; ``run`` runs it),
    each block's recompute FLOPs (its backward FLOPs over the plain pass's), and why it is
    unavailable."""
    kind = type(loaded.model.get_submodule(blocks[0])).__name__
    try:
        timeline, modules, _ = run()
    except BadInput as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        text = text.split(". ")[0].rstrip(".")[:200]  # the first sentence: what did not replay
        return None, {}, (f"selective checkpointing of {kind} blocks does not replay in backward "
                          f"({type(cause).__name__}: {text}); full checkpointing only")
    recompute = {b: max(0.0, modules[b].bw_flops - plain[b].bw_flops)
                 for b in blocks if b in modules and b in plain}
    return timeline, recompute, ""


Pass = tuple[Timeline, dict[str, ModuleCompute], int]
"""A pass at the model's full depth: its timeline, per-module figures and input bytes."""


@dataclass(frozen=True)
class _PassSpec:
    """One pass: how it computes, which blocks it checkpoints and how (``selective_ops``
    saved, every ``mm_stride``-th matmul), run by the process that traces it (``run``).

    [Note: who expands a forked pass]
    A deep model's pass runs on a copy cut to three blocks per stack (depth.py), and
    expanding its result to every block is work of its own: 16 ms for the checkpointed 70B
    shape (6,097 events), 0.19 s for the 10,006-module model (40,000). A child once sent
    the pass as traced for the planner to expand: the 70B's analysis ended 20 ms sooner
    (its child is the slower process), the 10,006-module model's 0.13 s later (the planner
    expanded three passes one after another while the child stood idle). So the process
    that traces a pass expands it, in parallel (stop 47)."""

    compute: _Compute
    checkpoint: tuple[str, ...] = ()
    selective_ops: tuple[str, ...] | None = None
    mm_stride: int = 1

    def run(self, loaded: LoadedModel, blocks: list[str], exact: bool) -> Pass:
        """The pass on the depth-cut copy, expanded to full depth, when there is one and it
        traces and expands; else on the whole model."""
        options = {"param_dtype": self.compute.param_dtype,
                   "autocast_dtype": self.compute.autocast,
                   "selective_ops": list(self.selective_ops) if self.selective_ops else None,
                   "selective_mm_stride": self.mm_stride}
        if not exact:
            reduced = reduced_copy(loaded.model, blocks)
            if reduced is not None:
                model, cut = reduced
                kept = [b for b in self.checkpoint if b in cut.kept_blocks]
                try:
                    traced = run_pass(loaded, checkpoint=kept, model=model, **options)
                except BadInput:
                    traced = None  # the forward may index blocks by count: analyse every block
                expanded = expand_pass(*traced, cut) if traced is not None else None
                if expanded is not None:
                    expanded[0].checkpointed = list(self.checkpoint)
                    return expanded
        return run_pass(loaded, checkpoint=list(self.checkpoint) or None, **options)
