"""What a compiled block saves for backward: the AOTAutograd partition of one block per class.

[Note: compiled blocks]
``torch.compile(block.forward, fullgraph=True)`` (torchtitan's per-block compile) traces the
block's forward and backward as one joint graph and lets the min-cut partitioner
(``torch/_functorch/partitioners.py``, inductor's ``partition_fn``, with
``torch._functorch.config.activation_memory_budget`` as a knapsack on top) decide what the
forward keeps for backward and what the backward recomputes. That choice is plain Python
over FX graphs, so it is read here without a C++ compiler and without data: one block of
each distinct class is called, with the inputs it gets in the model, through a custom
``aot_autograd`` backend (inductor's decomposition table and partition function, compilers
that only keep the graphs) on the fake model under ``FakeTensorMode``.

From the partition:
- ``saved_bytes``: the forward graph's outputs that the backward takes (the backward graph's
  placeholders other than tangents), counted once per storage of their traced (fake) values:
  a saved view counts its base once, and saved tensors that alias a graph input (parameters, buffers, the block's input) count
  nothing, since they are alive anyway;
- ``kept_bytes``: every new storage the compiled forward leaves alive (the saved set and the
  block's output): the rise of the activation level over the block's forward, which the
  timeline composer uses for a compiled block (cost/timeline.py [Note: compiled timeline]);
- ``recomputed``: forward ops of the joint graph that the backward graph computes again;
- ``fw_ops`` / ``bw_ops``: the graphs' op-class counters per fused kernel (facts/fused.py
  [Note: fused regions]), which the step-time model times (cost/compiled_time.py).
- ``bw_peak_bytes``: the most new bytes the backward graph holds at once run op by op
  (``op_by_op_peak``), the floor of the block's backward transient in the timeline.

Each class is traced as it is and inside the policy's full and selective checkpoint wrappers
(``trace_modes``): the policy compiles the wrapper, so the checkpoint is inside the graph and
the partitioner recomputes the region (all of it, or what the selective policy does not save).

Modelled, not measured: the level inside a compiled block (fused-kernel transients) follows
the eager pass's shape; on a CPU, inductor's kernels cannot run on fake tensors, so verify
runs the same partitioned graphs op by op (``graph_backend(run=True)``).

Read only from the torch side of the analysis (facts/analysis.py).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.hub
from torch import fx, nn

from fsdp_plan.common.autocast import float32_autocast_as_on_cuda
from fsdp_plan.common.collector import cycle_collector_paused
from fsdp_plan.common.errors import BadInput
from fsdp_plan.facts.checkpointing import DEFAULT_SELECTIVE_OPS
from fsdp_plan.facts.depth import reduced_copy
from fsdp_plan.facts.forked import ForkedPasses
from fsdp_plan.facts.fused import fused_counters
from fsdp_plan.facts.graph import has_submodule, keeps_full_precision
from fsdp_plan.facts.types import CompiledBlock, CompiledBlocks
from fsdp_plan.model.fake import materialize_fake, new_fake_mode
from fsdp_plan.model.load import rebuild_meta
from fsdp_plan.model.transformer_masks import transformer_masks_traceable
from fsdp_plan.policy_runtime import checkpoint_module, resolve_ops


class _Captured(Exception):
    """Raised from the last block's pre-forward hook: the inputs are in, stop the forward."""


def graph_backend(sink: dict[str, Any] | None = None, *, run: bool = False) -> Any:
    """An ``aot_autograd`` backend with inductor's decompositions and partition function.

    ``sink`` receives the joint graph's forward node names (``joint_forward``) and the
    partition (``fw``, ``bw``); the compiled callables run the partitioned FX graphs op by op
    (``run=True``: what verify measures on fake tensors, where inductor kernels cannot run)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import partition_fn, select_decomp_table

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        if sink is not None:
            sink["joint_forward"] = _forward_names(joint)
        fw, bw = partition_fn(joint, joint_inputs, **kwargs)
        if sink is not None:
            sink["fw"], sink["bw"] = fw, bw
        return fw, bw

    def keep(gm: fx.GraphModule, _example_inputs: Any):
        if sink is not None:
            sink["ran"] = sink.get("ran", 0)
        return make_boxed_func(_counting(gm, sink) if run else gm)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=partition,
                        decompositions=select_decomp_table())


def _counting(gm: fx.GraphModule, sink: dict[str, Any] | None):
    """``gm`` as a callable that counts its calls in ``sink["ran"]`` (verify's check that
    the compiled graphs really ran)."""
    def call(*args: Any) -> Any:
        if sink is not None:
            sink["ran"] = sink.get("ran", 0) + 1
        return gm(*args)
    return call


def budget_patch(activation_memory_budget: float | None):
    """``torch._functorch.config.patch`` for the budget, or a no-op for the default."""
    if activation_memory_budget is None:
        return contextlib.nullcontext()
    return torch._functorch.config.patch(activation_memory_budget=activation_memory_budget)


def _forward_names(joint: fx.GraphModule) -> set[str]:
    """Nodes of the joint graph that do not depend on a tangent: the forward's ops."""
    backward: set[fx.Node] = set()
    out: set[str] = set()
    for node in joint.graph.nodes:
        if node.op == "placeholder":
            if "tangent" in node.name:
                backward.add(node)
            continue
        if any(a in backward for a in node.all_input_nodes):
            backward.add(node)
        elif node.op == "call_function":
            out.add(node.name)
    return out


def _storage(node: fx.Node) -> tuple[int, int] | None:
    """(identity, bytes) of the storage behind ``node``'s traced value: views and the items
    of ``split`` share their base's storage, as they do at run time."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    storage = value.untyped_storage()
    return storage._cdata, int(storage.nbytes())


def _new_bytes(nodes: list[fx.Node], inputs: list[fx.Node]) -> int:
    """Bytes of the distinct storages behind ``nodes`` that are not graph inputs'."""
    known = {s[0] for s in map(_storage, inputs) if s is not None}
    found = {s[0]: s[1] for s in map(_storage, nodes) if s is not None and s[0] not in known}
    return sum(found.values())


def read_partition(fw: fx.GraphModule, bw: fx.GraphModule, joint_forward: set[str],
                   *, block: str, class_name: str,
                   activation_memory_budget: float | None, mode: str = "none") -> CompiledBlock:
    """The figures of one partition (see [Note: compiled blocks])."""
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    saved_names = [n.name for n in bw.graph.find_nodes(op="placeholder")
                   if not n.name.startswith("tangents")]
    saved = [fw_nodes[name] for name in saved_names if name in fw_nodes]
    outputs = [a for a in fx.node.map_arg(fw.graph.output_node().args[0], lambda n: n)
               if isinstance(a, fx.Node)] if fw.graph.output_node().args else []
    inputs = list(fw.graph.find_nodes(op="placeholder"))
    saved_set = set(saved)
    user_outputs = [n for n in outputs if n not in saved_set]
    recomputed = collections.Counter(
        str(getattr(n.target, "__name__", n.target)) for n in bw.graph.nodes
        if n.op == "call_function" and n.name in joint_forward and n.target is not operator.getitem)
    return CompiledBlock(
        block=block, class_name=class_name, activation_memory_budget=activation_memory_budget,
        saved_bytes=_new_bytes(saved, inputs), kept_bytes=_new_bytes(saved + user_outputs, inputs),
        saved_input_tensors=len(saved) - len([n for n in saved if _new_bytes([n], inputs)]),
        saved_tensors=len(saved), recomputed=dict(sorted(recomputed.items())), mode=mode,
        fw_ops=fused_counters(fw), bw_ops=fused_counters(bw), bw_peak_bytes=op_by_op_peak(bw))


def _nbytes(value: Any) -> tuple[int, int] | None:
    """(identity, bytes) of a traced tensor's storage; a symbolic size counts its hint."""
    if not isinstance(value, torch.Tensor):
        return None
    storage = value.untyped_storage()
    size = storage.nbytes()
    if isinstance(size, torch.SymInt):
        size = size.node.hint or 0
    return storage._cdata, int(size)


def op_by_op_peak(gm: fx.GraphModule) -> int:
    """The most bytes of new storages alive at once while ``gm`` runs node by node, each
    storage freed once no later node reads a value on it (as FX's generated code drops each
    value after its last use); graph inputs are not counted.

    This is how the partitioned backward runs where verify measures it (op by op, inductor's
    decompositions materialising every intermediate, float32 upcasts included), and what a
    fully checkpointed block's backward holds while it recomputes the block and runs its
    backward: the eager pass's shape for it is the eager kernels', which can be far less
    (GPT-2's LayerNorm and tanh GELU are single kernels in eager, a dozen float32 tensors
    decomposed). Inductor's kernels fuse most of it away, so on a GPU this is an upper bound."""
    nodes = list(gm.graph.nodes)
    last_use: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_use[arg] = i
    holders: dict[int, int] = {}
    """Storage -> how many live nodes hold a value on it."""
    held: dict[fx.Node, list[int]] = {}
    size: dict[int, int] = {}
    inputs: set[int] = set()
    alive = peak = 0
    for i, node in enumerate(nodes):
        value = node.meta.get("val")
        values = value if isinstance(value, (list, tuple)) else [value]
        for one in map(_nbytes, values):
            if one is None:
                continue
            key, nbytes = one
            if node.op == "placeholder":
                inputs.add(key)
            elif key not in inputs and key not in size:
                size[key] = nbytes
                alive += nbytes
            if key in size and key not in held.get(node, []):
                held.setdefault(node, []).append(key)
                holders[key] = holders.get(key, 0) + 1
        peak = max(peak, alive)
        for arg in node.all_input_nodes:
            if last_use.get(arg) != i:
                continue
            for key in held.pop(arg, []):
                holders[key] -= 1
                if not holders[key]:
                    alive -= size.pop(key)
                    del holders[key]
    return peak


def trace_block(block: nn.Module, args: tuple, kwargs: dict, *, fqn: str,
                activation_memory_budget: float | None, mode: str = "none") -> CompiledBlock:
    """Compile ``block.forward`` through ``graph_backend`` on its captured (fake) inputs and
    read the partition. Call under the fake mode the inputs belong to. ``mode``: ``block``
    is the block in that checkpointing mode's wrapper (recorded in the result)."""
    sink: dict[str, Any] = {}
    torch._dynamo.reset()
    compiled = torch.compile(block.forward, backend=graph_backend(sink), fullgraph=True)
    try:
        with budget_patch(activation_memory_budget):
            compiled(*args, **kwargs)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise BadInput(f"block {fqn!r} ({type(block).__name__}) does not compile with "
                       f"torch.compile(fullgraph=True) ({type(e).__name__}: {first}); plan it "
                       "without --compile.") from e
    finally:
        torch._dynamo.reset()
    if "bw" not in sink:
        raise BadInput(f"block {fqn!r} ({type(block).__name__}) compiled without a backward "
                       "graph (no input or parameter needs a gradient); nothing to plan with "
                       "--compile.")
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    return read_partition(sink["fw"], sink["bw"], sink["joint_forward"], block=fqn,
                          class_name=type(inner).__name__,
                          activation_memory_budget=activation_memory_budget, mode=mode)


def trace_modes(block: nn.Module, args: tuple, kwargs: dict, *, fqn: str,
                activation_memory_budget: float | None,
                selective_mm_stride: int = 1) -> dict[str, CompiledBlock]:
    """``trace_block`` for ``block`` as it is and in each checkpointing mode's wrapper (the
    policy's ``checkpoint_module``, selective with the plan's ``selective_mm_stride``: the
    wrapper is what the policy compiles, checkpoint inside the graph). A checkpointed mode that
    does not compile is left out (not offered). The plain trace runs first: it warms Dynamo up
    (some 2.5 s of lazy set-up in a fresh process, which a child forked before it would pay
    again), then the selective mode is traced in a forked child while the full mode is traced
    here (forked.py [Note: passes in forked children]; ``_no_tqdm_monitor`` keeps the process
    free of threads for it)."""
    def in_mode(mode: str, ops: list | None) -> Callable[[], CompiledBlock]:
        def trace() -> CompiledBlock:
            wrapped = checkpoint_module(block, ops, mm_stride=selective_mm_stride)
            with _quiet_selective_warning():
                return trace_block(wrapped, args, kwargs, fqn=fqn,
                                   activation_memory_budget=activation_memory_budget, mode=mode)
        return trace

    modes = {"full": in_mode("full", None),
             "selective": in_mode("selective", resolve_ops(list(DEFAULT_SELECTIVE_OPS)))}
    with _no_tqdm_monitor():
        out = {"none": trace_block(block, args, kwargs, fqn=fqn,
                                   activation_memory_budget=activation_memory_budget)}
        with ForkedPasses([]) as passes:
            passes.start("selective", modes["selective"])
            passes.launch()
            for mode, trace in modes.items():
                try:
                    out[mode] = passes.result(mode, trace)  # "full" was not started: runs here
                except BadInput:
                    continue
    return out


@contextlib.contextmanager
def _no_tqdm_monitor():
    """fx's ``Interpreter.run`` makes a (disabled) ``tqdm`` bar, and tqdm starts its monitor
    thread with the first bar of the process; a thread alive keeps the process from forking
    (forked.py [Note: passes in forked children]). With the monitor's interval 0 tqdm starts
    none; the interval is restored after."""
    bar = getattr(torch.hub, "tqdm", None)  # tqdm's own class, or torch's stand-in without it
    interval = getattr(bar, "monitor_interval", None)
    if interval is None:
        yield
        return
    bar.monitor_interval = 0
    try:
        yield
    finally:
        bar.monitor_interval = interval


@contextlib.contextmanager
def _quiet_selective_warning():
    """Dynamo warns once per process, on stderr, that a selective policy under compile must not
    meet in-place ops: advice for whoever writes the policy, noise in a plan's output. The
    policy is fsdp-plan's own, and the trace does not depend on the warning."""
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def capture_block_inputs(model: nn.Module, fqns: list[str], run_forward) -> dict[str, tuple]:
    """``{fqn: (args, kwargs)}``: what each listed block gets in ``run_forward()`` (a forward
    of ``model`` under fake mode), inputs detached and needing gradients as they did. The
    forward stops at the last listed block."""
    wanted = set(fqns)
    got: dict[str, tuple] = {}

    def hook(name: str, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        def detach(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value.detach().requires_grad_(value.requires_grad)
            return value
        got[name] = (tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()})
        if set(got) >= wanted:
            raise _Captured
    handles = [model.get_submodule(f).register_forward_pre_hook(
        functools.partial(hook, f), with_kwargs=True) for f in fqns]
    try:
        run_forward()
    except _Captured:
        pass
    finally:
        for h in handles:
            h.remove()
    return got


def one_per_class(model: nn.Module, blocks: list[str]) -> list[str]:
    """The first block of each distinct class (the one traced for all of its class)."""
    seen: dict[str, str] = {}
    for fqn in blocks:
        seen.setdefault(type(model.get_submodule(fqn)).__name__, fqn)
    return list(seen.values())


def analyze_compiled(loaded: Any, *, param_dtype: torch.dtype | None, blocks: list[str],
                     activation_memory_budget: float | None = None,
                     selective_mm_stride: int = 1) -> CompiledBlocks:
    """Trace one block of each class of ``blocks`` compiled (see [Note: compiled blocks]).

    A copy of the model on ``meta`` (cut to three blocks per stack when it is deep,
    facts/depth.py) is given fake storage, its parameters cast to ``param_dtype`` as the
    analysis does, and run forward until every traced block has its inputs."""
    # the cut copies only the blocks it keeps and leaves the loaded model as it was, as the
    # eager passes use it (analysis.py ``_PassSpec.run``); a whole copy only when nothing is cut
    reduced = reduced_copy(loaded.model, blocks)
    model = reduced[0] if reduced is not None else rebuild_meta(loaded)
    present = [b for b in blocks if has_submodule(model, b)]
    traced = one_per_class(model, present)
    fake_mode = new_fake_mode()
    materialize_fake(model, fake_mode)
    kept = {id(p) for m in model.modules() if keeps_full_precision(m)
            for p in m.parameters(recurse=False)}
    # [Note: float32 autocast regions]: a block's float32 region traced as a GPU runs it
    with fake_mode, cycle_collector_paused(), float32_autocast_as_on_cuda():
        if param_dtype is not None:
            for p in model.parameters():
                if p.is_floating_point() and id(p) not in kept:
                    p.data = p.data.to(param_dtype)
        # nn.Transformer's causal-mask check reads values: answered as the eager passes
        # answer it ([Note: causal masks on fake tensors]), the blocks then get the hint
        with transformer_masks_traceable(loaded.notes):
            args, kwargs = loaded.make_inputs(loaded.source.batch_size, loaded.source.seq_len)
            if param_dtype is not None:
                cast = functools.partial(_cast_floating, dtype=param_dtype)
                args, kwargs = cast(args), cast(kwargs)
            inputs = capture_block_inputs(model, traced, lambda: model(*args, **kwargs))
        by_mode: dict[str, dict[str, CompiledBlock]] = {}
        for fqn in traced:
            if fqn not in inputs:
                raise BadInput(f"block {fqn!r} did not run in the model's forward; it cannot be "
                               "traced compiled. Plan without --compile.")
            block_args, block_kwargs = inputs[fqn]
            modes = trace_modes(model.get_submodule(fqn), block_args, block_kwargs, fqn=fqn,
                                activation_memory_budget=activation_memory_budget,
                                selective_mm_stride=selective_mm_stride)
            for mode, one in modes.items():
                by_mode.setdefault(mode, {})[one.class_name] = one
    by_class = by_mode.pop("none", {})
    # a mode is offered only when every traced class compiled in it
    by_mode = {m: per for m, per in by_mode.items() if set(per) == set(by_class)}
    return CompiledBlocks(activation_memory_budget=activation_memory_budget, by_class=by_class,
                          block_class={b: type(loaded.model.get_submodule(b)).__name__
                                       for b in blocks}, by_mode=by_mode)




def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)
