"""The module graph: the module tree with parameter counts, tied parameters and repeated blocks.

Built from a model on ``meta`` (nothing is allocated) as the plain ``ModuleGraph`` of
facts/types.py (a ``ModuleInfo`` per module, ``""`` the root), which is what the rest of the
pipeline reads.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fsdp_plan.facts.types import ModelOutline, ModuleGraph, ModuleInfo


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def keeps_full_precision(module: nn.Module) -> bool:
    """Batch norm with parameters: a float32 unit of its own under a lower param dtype
    ([Note: batch norm in full precision] in units.py)."""
    return isinstance(module, _BatchNorm) and any(True for _ in module.parameters(recurse=False))


def has_submodule(model: nn.Module, fqn: str) -> bool:
    """Whether ``model`` has a submodule named ``fqn`` (a depth-cut copy lacks the blocks it
    cut)."""
    try:
        model.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def build_module_graph(model: nn.Module) -> ModuleGraph:
    """Walk ``model`` (on meta) once and describe its tree."""
    modules: dict[str, ModuleInfo] = {}
    owner_of_param: dict[int, str] = {}
    users_of_param: dict[int, set[str]] = defaultdict(set)
    for fqn, module in model.named_modules(remove_duplicate=False):
        for _, param in module.named_parameters(recurse=False):
            users_of_param[id(param)].add(fqn)
    for fqn, module in model.named_modules():
        parent = fqn.rpartition(".")[0] if fqn else None
        by_dtype: Counter[str] = Counter()
        numel = 0
        shapes: list[list[int]] = []
        for _, param in module.named_parameters(recurse=False):
            if id(param) in owner_of_param:
                continue
            owner_of_param[id(param)] = fqn
            numel += param.numel()
            by_dtype[dtype_name(param.dtype)] += param.numel() * param.element_size()
            shapes.append(list(param.shape))
        buffers = sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
        modules[fqn] = ModuleInfo(
            fqn=fqn, class_name=type(module).__name__, parent=parent, children=[],
            direct_numel=numel, subtree_numel=0, direct_bytes_by_dtype=dict(by_dtype),
            buffer_bytes=buffers, param_shapes=shapes,
            keeps_full_precision=keeps_full_precision(module),
        )
        if parent is not None:
            parent = parent if parent in modules else _nearest_known(parent, modules)
            modules[fqn].parent = parent
            modules[parent].children.append(fqn)
    for fqn in reversed(list(modules)):
        info = modules[fqn]
        info.subtree_numel = info.direct_numel + sum(modules[c].subtree_numel for c in info.children)
    tied = [sorted(users) for users in users_of_param.values() if len(users) > 1]
    tied_groups = _merge_overlapping(tied)
    return ModuleGraph(
        modules=modules,
        tied_groups=tied_groups,
        blocks=find_repeated_blocks(modules),
        total_numel=sum(m.direct_numel for m in modules.values()),
        total_param_bytes=sum(sum(m.direct_bytes_by_dtype.values()) for m in modules.values()),
        total_buffer_bytes=sum(m.buffer_bytes for m in modules.values()),
        hf_embeddings=hf_embeddings(model),
    )


def model_outline(model: nn.Module, graph: ModuleGraph | None = None) -> ModelOutline:
    """What ``model`` (on ``meta``) says for reading a plan against it (``ModelOutline``);
    ``graph``: its ``build_module_graph``, when built already."""
    modules = dict(model.named_modules())
    return ModelOutline(
        graph=graph if graph is not None else build_module_graph(model),
        torch_classes=sorted({type(m).__name__ for m in modules.values()
                              if type(m).__module__.startswith("torch.")}),
        no_split_modules=[str(n) for n in getattr(model, "_no_split_modules", None) or ()],
        has_input_embeddings=callable(getattr(model, "get_input_embeddings", None)),
        containers=[fqn for fqn, m in modules.items()
                    if isinstance(m, (nn.ModuleList, nn.ModuleDict))
                    and type(m).forward is nn.Module.forward])


def hf_embeddings(model: nn.Module) -> dict | None:
    """The modules accelerate 1.15's ``fsdp2_prepare_model`` gives units of their own in a model
    with ``get_input_embeddings`` (Hugging Face): the input embedding, and the final norm (the
    last direct child of the base model whose class name contains "Norm") with the output
    embedding, as FQNs; ``tied`` when the two embeddings share their weight. None for other
    models, or when an embedding is not a submodule."""
    get_input = getattr(model, "get_input_embeddings", None)
    if not callable(get_input):
        return None
    try:
        inputs = get_input()
        outputs = getattr(model, "get_output_embeddings", lambda: None)()
    except (AttributeError, NotImplementedError):
        return None
    names = {id(module): fqn for fqn, module in model.named_modules()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else model
    norm = None
    if isinstance(base, nn.Module):
        for child in base.children():
            if "Norm" in type(child).__name__:
                norm = names.get(id(child))
    weight_in = getattr(inputs, "weight", None)
    return {"input": names.get(id(inputs)) if inputs is not None else None,
            "output": names.get(id(outputs)) if outputs is not None else None,
            "final_norm": norm,
            "tied": weight_in is not None and weight_in is getattr(outputs, "weight", None)}


def _nearest_known(fqn: str, modules: dict[str, ModuleInfo]) -> str:
    while fqn and fqn not in modules:
        fqn = fqn.rpartition(".")[0]
    return fqn


def _merge_overlapping(groups: list[list[str]]) -> list[list[str]]:
    merged: list[set[str]] = []
    for group in groups:
        current = set(group)
        for other in [m for m in merged if m & current]:
            current |= other
            merged.remove(other)
        merged.append(current)
    return [sorted(g) for g in merged]


def find_repeated_blocks(modules: dict[str, ModuleInfo]) -> list[str]:
    """The natural FSDP units: siblings of one container sharing a class and a parameter count.

    Takes the container with the most parameters in such runs (a decoder's ``layers``); a model
    with two stacks (encoder and decoder) yields both, in module order.
    """
    runs: list[list[str]] = []
    for info in modules.values():
        by_kind: dict[tuple[str, int], list[str]] = defaultdict(list)
        for child in info.children:
            c = modules[child]
            if c.subtree_numel > 0 and c.children:
                by_kind[(c.class_name, c.subtree_numel)].append(child)
        runs.extend(run for run in by_kind.values() if len(run) >= 2)
    if not runs:
        return []
    total = sum(m.direct_numel for m in modules.values()) or 1
    # Keep every run that holds a real share of the model, dropping runs nested in another run.
    kept = [r for r in runs if sum(modules[f].subtree_numel for f in r) >= 0.05 * total]
    kept = [r for r in kept if not any(
        o is not r and any(f.startswith(b + ".") for f in r for b in o) for o in kept)]
    order = {fqn: i for i, fqn in enumerate(modules)}
    return sorted((f for r in kept for f in r), key=order.__getitem__)
