"""The accelerate export: an ``accelerate launch`` config (FSDP version 2) and, where the plan
holds more than that config can say, a hook that shards with the policy before ``prepare``.

[Note: accelerate and a model sharded before prepare] (read in accelerate 1.15)
``Accelerator.prepare`` wraps a model in ``DistributedDataParallel`` under ``MULTI_GPU`` and
``MULTI_CPU`` (accelerate never uses FSDP on a CPU), which fails on a model whose parameters
are FSDP2 DTensors ("aten.cat.default got mixed torch.Tensor and DTensor"); under ``FSDP``
version 2 it shards what is not yet an ``FSDPModule`` and applies its own activation
checkpointing when the config asks for it. ``prepare_model`` returns a model at once when its
``_is_accelerate_prepared`` is set (accelerate's guard against double wrapping), so the hook
applies the plan and sets it, and a hook-mode config turns accelerate's own checkpointing and
mixed precision off: the policy applies both, and the loop runs forward under its
``autocast()``.
"""

from __future__ import annotations

from typing import Any

import yaml

from fsdp_plan.cost.ddp_buckets import DDPConfig
from fsdp_plan.export.common import (
    POLICY_FILE,
    Export,
    Gap,
    PlanShape,
    carriable_class_name,
    class_wrap_gaps,
    precision_name,
    readme,
)
from fsdp_plan.plan.document import Plan

CONFIG_FILE = "accelerate_config.yaml"
HOOK_FILE = "fsdp_plan_accelerate.py"
FILE_NAMES = (CONFIG_FILE, HOOK_FILE)
"""Every file of its own this export may write (with the policy module and README.md)."""
WHO = "accelerate"


def ddp_gaps(shape: PlanShape, who: str = WHO) -> list[Gap]:
    """What an accelerate config cannot say about a DDP plan (its DDP arguments live in code,
    ``DistributedDataParallelKwargs``, and it has no first-bucket size)."""
    ddp = shape.ddp or DDPConfig()
    gaps = []
    if not ddp.default_buckets:
        gaps.append(Gap("ddp buckets", f"buckets of {ddp.bucket_cap_mb} MB, the first "
                        f"{ddp.first_bucket_mb} MB", f"{who} keeps DDP's 25 MB (first 1 MB)"))
    flags = [k for k in ("gradient_as_bucket_view", "static_graph", "find_unused_parameters")
             if getattr(ddp, k)]
    if flags:
        gaps.append(Gap("ddp", ", ".join(flags), f"{who}'s config leaves them off"))
    if ddp.comm_hook:
        gaps.append(Gap("ddp", f"the {ddp.comm_hook} gradient hook", f"{who} registers none"))
    if shape.checkpointed:
        gaps.append(Gap("activation_checkpointing", f"{len(shape.checkpointed)} checkpointed "
                        "module(s)", f"{who} checkpoints nothing under DDP"))
    return gaps


def config_gaps(shape: PlanShape) -> list[Gap]:
    """What ``accelerate_config.yaml`` alone cannot say (see [Note: configuration reach])."""
    if shape.strategy == "ddp":
        return ddp_gaps(shape)
    gaps = class_wrap_gaps(shape, WHO)
    if shape.strategy == "none":
        gaps.append(Gap("mesh", f"strategy none (a {shape.replicate} x 1 replicate mesh)",
                        f"{WHO}'s FSDP2 config shards over its shard axis"))
    return gaps


def config(plan: Plan, shape: PlanShape, hook: bool) -> dict[str, Any]:
    """The ``accelerate launch --config_file`` document. With the hook, accelerate's own
    checkpointing and mixed precision are off (the policy applies them)."""
    gpus_per_node = plan.node_gpus
    document: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if shape.strategy == "ddp":
        document["distributed_type"] = "MULTI_GPU"
    else:
        document["distributed_type"] = "FSDP"
        document["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            # block classes only (wrap_classes); with the hook accelerate wraps nothing (the
            # model arrives prepared): only the names its comma-separated list can carry (S4-09)
            "fsdp_transformer_layer_cls_to_wrap": ",".join(
                name for name in shape.wrap_classes if carriable_class_name(name)),
            "fsdp_reshard_after_forward": bool(shape.block_reshard and shape.block_reshard[-1]),
            "fsdp_activation_checkpointing": bool(shape.checkpointed) and not hook,
            "fsdp_offload_params": shape.offload,
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
        if shape.replicate > 1 and shape.strategy == "hybrid":
            document["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": shape.replicate,
                "parallelism_config_dp_shard_size": shape.shard,
            }
    document.update({
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": "no" if hook else (precision_name(shape) or "no"),
        "num_machines": max(1, shape.world_size // gpus_per_node),
        "num_processes": shape.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    })
    return document


_HOOK = '''"""fsdp-plan's hook for accelerate: apply the plan before ``Accelerator.prepare``,
check the run after it.

    import fsdp_plan_accelerate as plan
    model = plan.apply(model)               # before prepare, before the optimizer
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    plan.check(model, accelerator)          # before the first step
    with plan.autocast():
        loss = loss_fn(model(batch))
    accelerator.backward(loss)

``prepare`` would wrap a sharded model in DistributedDataParallel (it fails on FSDP2's
DTensors) or shard it again; a model marked ``_is_accelerate_prepared`` is taken as it is.
On a CPU accelerate applies no FSDP from its config (it wraps in DDP), so there ``apply`` is
what applies the plan. Written by ``fsdp-plan export``.
"""

import fsdp_plan_policy as policy

autocast = policy.autocast
prepare_microbatch = policy.prepare_microbatch
LaunchMismatch = policy.LaunchMismatch


def apply(model):
    """The plan applied to ``model`` (``policy.apply``: FSDP2 units, HSDP mesh or DDP),
    marked so that ``accelerator.prepare`` neither wraps nor shards it again."""
    model = policy.apply(model)
    model._is_accelerate_prepared = True
    return model


def check(model, accelerator):
    """Raise ``LaunchMismatch`` unless ``model`` as ``accelerator.prepare`` returned it runs
    the plan: its units, checkpointing, precision and mesh, and accelerate's world (its
    ``num_processes``) equal to torch.distributed's. Call it after ``prepare``."""
    fix = []
    if accelerator.num_processes == 1 and str(accelerator.distributed_type).endswith("NO"):
        fix.append("Under torchrun on a CPU accelerate sees one process unless "
                   "ACCELERATE_USE_CPU=true is set (or Accelerator(cpu=True)).")
    sharded = any(type(m).__name__.startswith("FSDP") for m in model.modules())
    if accelerator.device.type == "cpu" and policy.PLAN["strategy"] != "ddp" and not sharded:
        fix.append("accelerate applies no FSDP on a CPU: apply the plan with "
                   "fsdp_plan_accelerate.apply(model) before prepare (the export's README).")
    return policy.check_launch(model, world_size=accelerator.num_processes, who="accelerate",
                               fix=" ".join(fix))
'''


def render(plan: Plan, shape: PlanShape, options: dict[str, Any]) -> Export:
    result = Export("accelerate", config_gaps=config_gaps(shape))
    hook = result.needs_hook
    result.files[CONFIG_FILE] = yaml.safe_dump(config(plan, shape, hook), sort_keys=False)
    files = {CONFIG_FILE: "`accelerate launch --config_file` configuration (FSDP version 2)"
                          if shape.strategy != "ddp" else "`accelerate launch` configuration",
             POLICY_FILE: "the plan's policy module (imports only torch)"}
    result.files[HOOK_FILE] = _HOOK
    files[HOOK_FILE] = ("the code hook: `apply(model)` before `accelerator.prepare`"
                        + ("" if hook else " (needed on a CPU only)")
                        + ", and `check(model, accelerator)` after it")
    result.files["README.md"] = readme(f"accelerate export of {shape.model_source or 'a plan'}",
                                       result, launch_text(plan, shape, hook),
                                       hook_text(plan), files)
    return result


def _loop(accum: int, apply: bool) -> str:
    """The training script's lines around ``prepare``, with or without the hook's apply."""
    return ("```python\nimport fsdp_plan_accelerate as plan\n"
            + ("model = plan.apply(model)                 # before prepare and the optimizer\n"
               if apply else "")
            + "optimizer = torch.optim.AdamW(model.parameters(), lr=...)\n"
            "model, optimizer, loader = accelerator.prepare(model, optimizer, loader)\n"
            "plan.check(model, accelerator)            # stops a run that is not the plan\n"
            "for index, batch in enumerate(loader):\n"
            + (f"    plan.prepare_microbatch(model, index % {accum}, {accum})\n"
               if accum > 1 and apply else "")
            + ("    with plan.autocast():\n        loss = loss_fn(model(batch))\n" if apply
               else "    loss = loss_fn(model(batch))\n")
            + "    accelerator.backward(loss)\n```")


def launch_text(plan: Plan, shape: PlanShape, hook: bool) -> str:
    """How to launch on GPUs and on a CPU, and what the configuration alone does on each
    (see [Note: accelerate and a model sharded before prepare])."""
    accum = plan.grad_accum_steps
    batch = (f"Per process: micro-batch {shape.micro_batch}"
             + (f", sequence length {shape.seq_len}" if shape.seq_len else "")
             + (f", {accum} micro-batches per optimizer step (`Accelerator("
                f"gradient_accumulation_steps={accum})`)" if accum > 1 else "") + ".")
    gpu = (f"On GPUs:\n\n```bash\naccelerate launch --config_file {CONFIG_FILE} train.py\n```\n\n"
           + ("There the configuration alone applies the whole plan; check the run after "
              "`prepare`:\n\n" + _loop(accum, False) if not hook
              else "with the code hook below in `train.py`.") + f"\n\n{batch}")
    cpu = ("On a CPU (gloo), start the processes with torchrun and tell accelerate it runs on "
           "the CPU: without `ACCELERATE_USE_CPU=true` (or `Accelerator(cpu=True)`) accelerate "
           "sees one process while torch.distributed has N, so there is no distributed "
           "sampler and every rank trains the same data (`accelerate launch --cpu` may start "
           "one process):\n\n```bash\nACCELERATE_USE_CPU=true torchrun --nproc_per_node "
           f"{shape.world_size} train.py\n```\n\n")
    if shape.strategy != "ddp":
        cpu += ("accelerate applies no FSDP on a CPU whatever its configuration says (it wraps "
                f"the model in DistributedDataParallel, and no `accelerate launch` reads "
                f"`{CONFIG_FILE}` there): on a CPU the code hook is what applies the plan, "
                "`plan.apply(model)` before `prepare`:\n\n" + _loop(accum, True))
    else:
        cpu += "accelerate's DDP on a CPU is the plan's DDP; check the run after `prepare`."
    return (gpu + "\n\n" + cpu + "\n\n`plan.check` raises `LaunchMismatch`, naming each "
            "difference, when the prepared model is not the plan (no FSDP, other units, a "
            "missing checkpoint, accelerate's world size not torch.distributed's).")


def hook_text(plan: Plan) -> str:
    """The README's code-hook section: the hook is needed on GPUs too."""
    return ("Put this folder on `PYTHONPATH` and, in `train.py` (on GPUs as on a CPU):\n\n"
            + _loop(plan.grad_accum_steps, True) + "\n\n"
            "The policy applies the units, checkpointing, prefetch and mixed precision, so "
            f"`{CONFIG_FILE}` turns accelerate's own checkpointing and mixed precision off.")
