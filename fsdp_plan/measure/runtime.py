"""What every measurement does the same way: rebuild the planned model, build the mesh, apply
the plan through the generated policy module, make the optimizer, run one training step.

``verify`` (fake process group), ``count_collectives`` and ``bench`` (real workers) all go
through these helpers, so a difference between them is a difference in what they measure,
never in how the plan was applied.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from fsdp_plan.common.autocast import autocast_context, device_type_of, plan_autocast_dtype
from fsdp_plan.common.errors import BadInput
from fsdp_plan.cost.precision import OPTIMIZERS
from fsdp_plan.facts.graph import model_outline
from fsdp_plan.facts.types import ModelOutline
from fsdp_plan.model.load import LoadedModel, load_model
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.document import Plan
from fsdp_plan.plan.emit import load_policy_module, render_policy_module
from fsdp_plan.plan.model_match import (
    check_outline_matches,
    source_from_plan,
)
from fsdp_plan.policy_runtime import OPTIMIZER_CLASSES


def check_model_matches(plan: Plan, loaded: LoadedModel) -> None:
    """Refuse to measure a model other than the planned one (plan/model_match.py), before
    anything is applied."""
    check_outline_matches(plan, model_outline(loaded.model), loaded.source)


def built_outline(source: ModelSource) -> ModelOutline:
    """The outline of the model ``source`` builds on ``meta`` (``export`` reads a plan against
    it, when none is kept on disk)."""
    return model_outline(load_model(source).model)


def load_planned_model(plan: Plan, model_path: str | None = None,
                       plan_path: str | None = None) -> LoadedModel:
    """Load the plan's model on ``meta`` and check it is the one that was planned."""
    loaded = load_model(source_from_plan(plan, model_path, plan_path))
    check_model_matches(plan, loaded)
    return loaded


def policy_source(plan: Plan) -> str:
    """The policy module's text, rendered as ``fsdp-plan -o`` writes it (what users import)."""
    return render_policy_module(plan)


def load_policy(source_text: str) -> types.ModuleType:
    """Import a rendered policy module from its text."""
    return load_policy_module(source_text)


def mesh_shape(plan_mesh: Any) -> tuple[int, int]:
    """``(replicate, shard)`` from a ``Mesh``, a plan dict's ``mesh`` or a pair."""
    if isinstance(plan_mesh, (tuple, list)):
        return int(plan_mesh[0]), int(plan_mesh[1])
    if isinstance(plan_mesh, dict):
        return int(plan_mesh.get("replicate", 1)), int(plan_mesh["shard"])
    return int(plan_mesh.replicate), int(plan_mesh.shard)


def make_mesh(device_type: str, replicate: int, shard: int):
    """A 1-D ``("shard",)`` mesh for plain FSDP, 2-D ``("replicate", "shard")`` for HSDP.

    Built outside any ``FakeTensorMode``: the mesh's rank map is data-dependent.
    """
    from torch.distributed.device_mesh import init_device_mesh
    if replicate == 1:
        return init_device_mesh(device_type, (shard,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def apply_plan(model: nn.Module, policy: types.ModuleType, mesh: Any, *, fsdp_version: int,
               device: torch.device) -> nn.Module:
    """Apply the plan: FSDP2 ``apply_fully_shard(model, mesh)`` or FSDP1 wrapping + checkpointing."""
    if fsdp_version == 2:
        return policy.apply_fully_shard(model, mesh)
    if fsdp_version != 1:
        raise BadInput(f"fsdp_version must be 1 or 2, got {fsdp_version!r}.")
    from torch.distributed.fsdp import FullyShardedDataParallel
    # HSDP needs the 2-D mesh passed explicitly: node groups cannot be derived from CPU devices.
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=policy.auto_wrap_policy,
                                       device_id=device, **policy.fsdp1_kwargs(mesh))
    policy.apply_activation_checkpointing(wrapped)
    return wrapped


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer | None:
    """The plan's optimizer with default hyper-parameters (the state it keeps is what matters)."""
    name = (name or "none").lower()
    if name == "none":
        return None
    if name in OPTIMIZER_CLASSES:
        return getattr(torch.optim, OPTIMIZER_CLASSES[name])(params, lr=1e-4)
    raise BadInput(f"the plan's optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}.")


def plan_optimizer(policy: types.ModuleType, model: nn.Module, name: str | None = None
                   ) -> torch.optim.Optimizer | None:
    """The optimizer a policy's plan trains ``model`` (as the plan applied it) with: its
    per-parameter optimizers stepped in backward when the plan says ``optimizer_overlap``
    (the policy's ``optimizer_in_backward``, whose ``step`` has nothing left to do), else
    ``make_optimizer`` of ``name`` (default: the plan's optimizer)."""
    plan = getattr(policy, "PLAN", None) or {}
    if plan.get("optimizer_overlap"):
        return policy.optimizer_in_backward(model, lr=1e-4)
    return make_optimizer(name or plan.get("optimizer", "adamw"), model.parameters())


def forward_backward(model: nn.Module, loaded: LoadedModel, inputs: tuple[tuple, dict],
                     autocast_dtype: str | None = None) -> None:
    """One forward and backward: the part of a step that issues FSDP's collectives. Forward
    and loss run under ``torch.autocast(autocast_dtype)`` when given, as training does."""
    args, kwargs = inputs
    with autocast_context(autocast_dtype, device_type_of(inputs)):
        loss = loaded.compute_loss(model(*args, **kwargs))
    loss.backward()


def policy_autocast_dtype(policy: types.ModuleType | None) -> str | None:
    """The dtype a policy module's plan computes in under ``torch.autocast`` (or None):
    [Note: autocast precision] in common/autocast.py."""
    plan = getattr(policy, "PLAN", None)
    return plan_autocast_dtype(plan) if plan else None


def micro_batches(model: nn.Module, loaded: LoadedModel, inputs: tuple[tuple, dict],
                  policy: types.ModuleType, before_each: Any = None) -> None:
    """Forward and backward of every micro-batch of one optimizer step, as the plan says
    (``grad_accum_steps``; the policy's ``prepare_microbatch`` sets gradient sync before each).
    ``before_each(index)`` runs first (a memory tracker resets its module stats there)."""
    steps = int((getattr(policy, "PLAN", None) or {}).get("grad_accum_steps", 1) or 1)
    autocast = policy_autocast_dtype(policy)
    for index in range(steps):
        if before_each is not None:
            before_each(index)
        if steps > 1:
            policy.prepare_microbatch(model, index, steps)
        forward_backward(model, loaded, inputs, autocast)


def finish_step(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Optimizer step, then drop the gradients (``set_to_none``) as a training loop does."""
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)


def to_device(inputs: tuple[tuple, dict], device: torch.device) -> tuple[tuple, dict]:
    """Move example inputs to the worker's device."""
    def move(x: Any) -> Any:
        return x.to(device) if isinstance(x, torch.Tensor) else x
    args, kwargs = inputs
    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def build_real_model(loaded: LoadedModel, device: torch.device, seed: int = 0) -> nn.Module:
    """The real model on ``device``, initialised identically on every rank (same seed)."""
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            return loaded.factory(**loaded.source.args)
    except Exception as e:
        raise BadInput(f"building the real model on {device} failed: {type(e).__name__}: {e}.") from e
