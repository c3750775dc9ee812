"""Op-class counters of a compiled graph, memory-bound ops counted per fused kernel.

[Note: fused regions]
Inductor turns the partitioned forward and backward graphs of a compiled block into kernels:
matrix multiplies and attention stay library calls, while chains of memory-bound ops
(pointwise ops, norms' reductions, casts, the residual adds) are fused into far fewer
kernels, each reading its inputs and writing its outputs once instead of materialising every
intermediate. This module counts a graph the way the eager analysis counts ops
(facts/types.py [Note: op classes]), with the fusion applied as PyTorch's own estimator does
(``torch/_inductor/fx_passes/fusion_regions.py``): contiguous spans of fusible nodes (nodes
with an inductor lowering that are not fallbacks, collectives or FLOP-counted ops), split
into connected components (the items of a tuple-valued op such as ``var_mean`` stay in its
span, where inductor's estimator would cut it); each component is one kernel whose bytes
are the tensors crossing its boundary (read from outside it, or used outside it). A fusible node alone in
its component is one kernel with its own inputs and outputs; views move nothing; FLOP-counted
ops (``mm``, ``addmm``, ``bmm``, SDPA) are counted by FLOPs and shape class as in eager.

So the counters are a roofline of the compiled graph (FLOPs at the matmul and attention
rates, boundary bytes at the memory bandwidth, one launch per kernel): the step-time model
times them with the eager rates (cost/compiled_time.py). Inductor also fuses across
non-contiguous spans and into reductions' epilogues, so on a GPU the kernels can be fewer
still; the regions here are the conservative, local ones.

Read only from the torch side of the analysis (facts/compiled.py).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from fsdp_plan.facts.op_classes import ATTENTION_PACKETS, FLOP_RULES, mm_class


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _bytes(values: list[Any]) -> int:
    """Bytes of the distinct tensors among ``values`` (a tensor read twice moves once)."""
    leaves, _ = tree_flatten(values)
    seen: set[int] = set()
    total = 0
    for t in leaves:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _is_view(node: fx.Node) -> bool:
    """Views and tuple items: no kernel, no bytes of their own."""
    target = node.target
    return target is operator.getitem or (isinstance(target, torch._ops.OpOverload)
                                          and target.is_view)


def _fusible(node: fx.Node) -> bool:
    """Inductor's own test (``fusion_regions.is_fusible_node``) where it exists."""
    try:
        from torch._inductor.fx_passes.fusion_regions import is_fusible_node
    except ImportError:  # pragma: no cover - other torch versions: pointwise aten ops fuse
        return (isinstance(node.target, torch._ops.OpOverload)
                and node.target.namespace in ("aten", "prims")
                and node.target._overloadpacket not in FLOP_RULES)
    return is_fusible_node(node)


def _components(span: list[fx.Node]) -> list[list[fx.Node]]:
    """Connected components of ``span`` by direct data dependencies (a union-find)."""
    parent = {n: n for n in span}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in span:
        for inp in n.all_input_nodes:
            if inp in parent:
                parent[find(n)] = find(inp)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in span:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())


def _region_bytes(region: list[fx.Node]) -> int:
    """Bytes a fused kernel moves: inputs from outside ``region``, and outputs used outside."""
    inside = set(region)
    reads = [_val(i) for n in region for i in n.all_input_nodes if i not in inside]
    writes = [_val(n) for n in region if not _is_view(n)
              and (not n.users or any(u not in inside for u in n.users))]
    return _bytes(reads) + _bytes(writes)


def _unwrap_rng(node: fx.Node) -> tuple[Any, tuple, Any]:
    """(op, its arguments, its value) of ``node``, looking through the RNG wrappers
    AOTAutograd puts around random ops in a checkpointed region (``run_and_save_rng_state(op,
    *args)`` in forward, ``run_with_rng_state(state, op, *args)`` in the recompute: SDPA,
    whose dropout makes it random, is one)."""
    name = getattr(node.target, "__name__", "")
    if name == "run_and_save_rng_state" and node.args:
        value = _val(node)
        return node.args[0], tuple(node.args[1:]), value[1] if isinstance(value, tuple) else None
    if name == "run_with_rng_state" and len(node.args) > 1:
        return node.args[1], tuple(node.args[2:]), _val(node)
    return node.target, tuple(node.args), _val(node)


def fused_counters(gm: fx.GraphModule) -> dict[str, float]:
    """The op-class counters of ``gm`` with memory-bound ops fused ([Note: fused regions])."""
    out: dict[str, float] = {}

    def count(key: str, value: float) -> None:
        out[key] = out.get(key, 0.0) + value

    span: list[fx.Node] = []

    def close_span() -> None:
        for region in _components(span):
            if all(_is_view(n) for n in region):
                continue
            count("ops", 1)
            count("memory_bytes", _region_bytes(region))
        span.clear()

    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem and span:
            span.append(node)  # an item of a fused op's tuple (var_mean's): no kernel, no break
            continue
        target, node_args, value = _unwrap_rng(node)
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            if node.op == "call_function" and span:
                close_span()
            continue
        rule = FLOP_RULES.get(target._overloadpacket)
        if rule is None and target is node.target and _fusible(node):
            span.append(node)
            continue
        close_span()
        if rule is not None:
            args = [_val(a) for a in node_args]
            kwargs = {k: _val(v) for k, v in node.kwargs.items()}
            flops = float(rule(*args, **kwargs, out_val=value))
            count("ops", 1)
            count("attention" if target._overloadpacket in ATTENTION_PACKETS
                  else mm_class(target, tuple(args)), flops)
        elif not _is_view(node):  # a fallback kernel: its own launch, its own bytes
            count("ops", 1)
            count("memory_bytes", _bytes([_val(i) for i in node.all_input_nodes])
                  + _bytes([_val(node)]))
    close_span()
    return out
