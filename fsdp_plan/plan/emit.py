"""Emit a plan as the self-contained policy module of SPEC section 4.

The generated file imports only ``torch`` and the standard library, so it can be committed
next to a training script and used without fsdp-plan installed. It holds the plan as a
Python literal (``PLAN``) and the code of ``fsdp_plan/policy_runtime.py`` (a real module,
linted and tested like any other), which reads ``PLAN``; nothing from the plan is ever pasted
into code (see [Note: untrusted strings]).

Example usage::

    write_policy_module(plan, "policies/llama70b.py")
    policy = load_policy_module("policies/llama70b.py")
    model = policy.apply(model)          # FSDP2, HSDP or DDP, as planned
    with policy.autocast():              # torch.autocast where the plan computes under it
        loss = loss_fn(model(batch))

[Note: untrusted strings]
Module names, the model source path and its arguments come from user files and may contain
quotes, newlines or code. They reach the generated file only (a) inside the ``PLAN`` literal,
written by ``pprint.pformat`` and checked with ``ast.literal_eval`` to read back equal, and
(b) in the docstring after ``doc_safe`` has replaced every character outside a small
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
- A unit's ``MixedPrecisionPolicy`` casts its forward inputs to its ``param_dtype``
  (``cast_forward_inputs``) and its outputs to ``output_dtype``: a batch norm unit with
  ``param_dtype=float32, output_dtype=bfloat16`` runs in float32 between bf16 convolutions,
  which is what FSDP1's default ``_module_classes_to_ignore`` hooks do (checked on gloo).
- FSDP1's ``_recursive_wrap`` asks the policy about the root first (``recurse=True``) and never
  asks ``recurse=False`` about the root (``only_wrap_children``); the policy learns FQNs there.
- A DDP plan (``strategy: ddp``, SPEC 6) is applied with ``apply_ddp(model, device_ids=None)``
  (``apply`` calls it for DDP plans and ``apply_fully_shard`` for the others):
  activation checkpointing first, then ``DistributedDataParallel(model, **DDP_KWARGS)``.
  ``bucket_cap_mb=None`` is DDP's default (25 MiB buckets, the first capped at 1 MiB); an
  explicit ``bucket_cap_mb`` caps the first bucket like the rest; other pairs need
  ``bucket_cap_mb_list`` (torch >= 2.13). The buckets DDP builds after its first iteration are
  the plan's ``predicted.buckets`` (checked on gloo; ``fsdp_plan/cost/ddp_buckets.py`` [Note: DDP buckets]).
  ``FSDP_KWARGS`` of a DDP plan is FSDP1 ``NO_SHARD``, its nearest FSDP form.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import linecache
import math
import os
import pprint
import re
import types
from pathlib import Path
from typing import Any

from fsdp_plan.plan.document import Plan, atomic_write_text

_DOC_SAFE = re.compile(r"[^A-Za-z0-9_.,:/=+@ -]")


def render_policy_module(plan: Plan) -> str:
    """The Python source of the policy module for ``plan`` (SPEC section 4)."""
    document = plan.to_dict()
    head, tail = _runtime_parts()
    source = _docstring(document) + head + "PLAN = " + _plan_literal(document) + "\n" + tail
    compile(source, "<fsdp-plan policy>", "exec")
    return source


_PLAN_PLACEHOLDER = "PLAN: dict = {}\n"


@functools.cache
def _runtime_parts() -> tuple[str, str]:
    """The text of ``policy_runtime.py`` after its docstring, split around ``PLAN``'s line.

    The generated module is exactly this text with its own docstring and ``PLAN`` literal,
    so the runtime that tests and linters read is the code every policy file runs.
    """
    text = Path(__file__).parent.parent.joinpath("policy_runtime.py").read_text()
    tree = ast.parse(text)
    if ast.get_docstring(tree, clean=False) is None:
        raise RuntimeError("policy_runtime.py must start with its docstring.")
    first = tree.body[0]
    lines = text.splitlines(keepends=True)
    code = "".join(lines[first.end_lineno:])
    if code.count(_PLAN_PLACEHOLDER) != 1:
        raise RuntimeError(f"policy_runtime.py must hold the line {_PLAN_PLACEHOLDER!r} once.")
    head, _, tail = code.partition(_PLAN_PLACEHOLDER)
    return head, tail


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


def doc_safe(value: Any, limit: int = 80) -> str:
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
        f"FSDP policy generated by fsdp-plan for {doc_safe(model.get('source', 'a model'))}"
        + (f" ({doc_safe(args_text)})" if args_text else "") + ".",
        "",
        (f"World size {world_size} on a mesh of {replicate} replicate x {shard} shard ranks "
         f"(strategy {doc_safe(document.get('strategy'), 20)});"),
        f"{num_units} fully_shard units; {num_checkpointed} module(s) with activation checkpointing.",
        (f"Budget {_bytes_text(document.get('budget_bytes'))} per GPU, headroom "
         f"{_bytes_text(document.get('headroom_bytes'))};"),
        f"predicted peak {_bytes_text(predicted.get('peak_bytes'))} per rank.",
        "",
        "The exact plan is PLAN below; edit the plan and re-run fsdp-plan rather than this file.",
    ]
    if document.get("optimizer_overlap") is True:
        lines += [
            "",
            "The optimizer steps in backward (optimizer_overlap): model = apply(model,",
            "optimizer_kwargs={'lr': ...}) gives every parameter its own optimizer, stepped as",
            "soon as its gradient is reduced; optimizer = in_backward_optimizer(model) stands",
            "for them in the loop (its step and zero_grad have nothing left to do; a scheduler",
            "sets its param_groups' lr). No gradient clipping across parameters after backward,",
            "no accumulation over micro-batches.",
        ]
    return '"""' + "\n".join(lines) + "\n" + _USAGE + '"""\n'


_USAGE = r'''
One training loop for every plan (FSDP2, HSDP or DDP), after
``torch.distributed.init_process_group(...)``::

    model = apply(model)                             # the plan, whatever its strategy
    optimizer = torch.optim.AdamW(model.parameters())  # after apply: parameters are sharded
    with autocast():                                 # torch.autocast where the plan computes
        loss = loss_fn(model(batch))                 # under it, else a no-op
    loss.backward()
    optimizer.step()

``apply`` calls ``apply_fully_shard`` (FSDP2: AC, units, prefetch, mixed precision) or, for a
DDP plan, ``apply_ddp`` (AC, then ``DistributedDataParallel`` with ``DDP_KWARGS``); each of
those two refuses the other kind of plan. ``apply(model, mesh=my_mesh)`` uses your own
(replicate, shard) mesh.

A unit may carry its own ``mixed_precision`` (each batch norm is a float32 unit under bf16:
its weights meet float32 running statistics); ``apply_fully_shard`` applies it to that unit.

``apply_fully_shard`` builds the plan's mesh when none is given: 1-D ``(shard,)`` when
replicate is 1, else 2-D ``(replicate, shard)`` named ("replicate", "shard") for HSDP.
Strategy "none" is the mesh ``(world, 1)``: full parameters on every rank, gradients
all-reduced, no all-gather or reduce-scatter.

FSDP1 (``FullyShardedDataParallel``)::

    model = FullyShardedDataParallel(model, auto_wrap_policy=auto_wrap_policy,
                                     device_id=local_device(), **FSDP_KWARGS)
    apply_activation_checkpointing(model)            # after wrapping, for FSDP1
    # forward and loss under autocast() as above

- ``device_id`` is needed on every device: ``local_device()`` is ``cuda:LOCAL_RANK`` on a GPU
  (without it FSDP1 shards on the CPU) and ``torch.device("cpu")`` on a CPU (without it FSDP1
  fails: "FSDP needs a non-CPU accelerator device"; gloo runs it).
- A unit that groups several modules in FSDP2 cannot be one FSDP1 instance: FSDP1 wraps each
  listed module separately. ``FSDP1_UNITS`` lists the modules FSDP1 wraps ("" is the root).
- Hybrid sharding needs the 2-D mesh passed in (always on CPU, where node groups cannot be
  derived): ``FullyShardedDataParallel(model, auto_wrap_policy=auto_wrap_policy,
  device_id=local_device(), **fsdp1_kwargs(build_device_mesh()))``.
- FSDP1 has no per-unit prefetch lists: ``backward_prefetch`` is BACKWARD_PRE when the plan
  prefetches in backward (else None, no backward prefetch at all, where FSDP2 would still
  prefetch one unit implicitly), and ``forward_prefetch`` is on when it prefetches in forward.
- Pass the whole model to ``FullyShardedDataParallel``: the policy matches FQNs from the root.
'''
