"""The Hugging Face Trainer export: ``fsdp_config`` JSON, the ``TrainingArguments`` fields it
implies, and, where the plan holds more, a hook that shards the model before the Trainer.

[Note: a model sharded before the Trainer] (read in transformers 5.24)
The Trainer prepares a model through accelerate (see [Note: accelerate and a model sharded
before prepare] in ``export/accelerate.py``). A model whose ``is_distributed_loading_by_transformers``
is true (transformers sets it on models sharded at load time) is prepared for autocast only:
no ``DistributedDataParallel``, no second sharding, no device move; the Trainer then needs
``save_only_model`` (its optimizer state is not checkpointed). The hook applies the plan and
sets that flag; ``bf16``/``fp16`` then mean exactly the plan's autocast.
"""

from __future__ import annotations

import json
from typing import Any

from fsdp_plan.cost.ddp_buckets import DDPConfig
from fsdp_plan.export.common import (
    POLICY_FILE,
    Export,
    Gap,
    PlanShape,
    class_wrap_gaps,
    precision_name,
    readme,
)
from fsdp_plan.plan.document import Plan

FSDP_CONFIG_FILE = "fsdp_config.json"
ARGS_FILE = "training_args.json"
CPU_ARGS_FILE = "training_args_cpu.json"
HOOK_FILE = "fsdp_plan_trainer.py"
FILE_NAMES = (ARGS_FILE, FSDP_CONFIG_FILE, HOOK_FILE)
"""Every file of its own this export may write (with the policy module and README.md)."""
WHO = "the Trainer"


def config_gaps(shape: PlanShape) -> list[Gap]:
    """What ``TrainingArguments`` alone cannot say (see [Note: configuration reach])."""
    if shape.strategy == "ddp":
        ddp = shape.ddp or DDPConfig()
        gaps = []
        first, cap = ddp.first_bucket_mb, ddp.bucket_cap_mb
        if not ddp.default_buckets and first != cap:
            gaps.append(Gap("ddp buckets", f"a first bucket of {first} MB and {cap} MB after it",
                            f"{WHO}'s ddp_bucket_cap_mb sizes every bucket alike"))
        flags = [k for k in ("gradient_as_bucket_view", "static_graph") if getattr(ddp, k)]
        if flags or ddp.comm_hook:
            gaps.append(Gap("ddp", ", ".join(flags + ([ddp.comm_hook] if ddp.comm_hook else [])),
                            f"{WHO} leaves them off"))
        if shape.checkpointed:
            gaps.append(Gap("activation_checkpointing", f"{len(shape.checkpointed)} checkpointed "
                            "module(s)", f"{WHO} has no checkpointing for a plain DDP module"))
        return gaps
    gaps = class_wrap_gaps(shape, WHO)
    if shape.strategy in ("hybrid", "none"):
        gaps.append(Gap("mesh", f"a {shape.replicate} x {shape.shard} (replicate x shard) mesh",
                        f"{WHO}'s FSDP2 arguments shard over all ranks"))
    return gaps


def lost_with_hook(shape: PlanShape) -> list[Gap]:
    """What the Trainer's own loop loses even with the hook. Under DDP nothing of the sync is
    lost: the Trainer accumulates inside ``accelerator.accumulate``, which runs every micro-batch
    but the last under DDP's ``no_sync``, exactly the plan's ``gradient_sync: last``."""
    if shape.gradient_sync == "last" and shape.grad_accum_steps > 1 and shape.strategy != "ddp":
        return [Gap("gradient_sync", "gradients reduced on the last micro-batch only",
                    f"{WHO}'s loop cannot call prepare_microbatch, so FSDP2 reduces after every "
                    "micro-batch (same result, more communication)")]
    return []


def fsdp_config(shape: PlanShape, hook: bool) -> dict[str, Any]:
    """``TrainingArguments.fsdp_config`` (FSDP version 2), the whole FSDP setting in the form
    transformers 5 asks for (``fsdp=True`` beside it; the word string is deprecated)."""
    return {
        "version": 2,
        "transformer_layer_cls_to_wrap": list(shape.wrap_classes),
        "reshard_after_forward": bool(shape.block_reshard and shape.block_reshard[-1]),
        "activation_checkpointing": bool(shape.checkpointed) and not hook,
        "cpu_offload": shape.offload,
    }


def training_args(shape: PlanShape, hook: bool, cpu: bool = False) -> dict[str, Any]:
    """The ``TrainingArguments`` fields the plan implies (``output_dir`` is the user's).
    ``cpu``: the fields for a CPU launch, where the Trainer (through accelerate) applies no
    FSDP and the hook shards instead."""
    hook = hook or (cpu and shape.strategy != "ddp")
    args: dict[str, Any] = {"per_device_train_batch_size": shape.micro_batch,
                            "gradient_accumulation_steps": shape.grad_accum_steps}
    if hook:  # the policy shards; bf16/fp16 are the plan's autocast (accelerate's native amp)
        precision = {"bfloat16": "bf16", "float16": "fp16"}.get(shape.autocast_dtype or "")
        args["save_only_model"] = True
    elif shape.strategy == "ddp":
        precision = {"bfloat16": "bf16", "float16": "fp16"}.get(shape.autocast_dtype or "")
        ddp = shape.ddp or DDPConfig()
        if not ddp.default_buckets:
            args["ddp_bucket_cap_mb"] = ddp.bucket_cap_mb
        args["ddp_find_unused_parameters"] = ddp.find_unused_parameters
    else:
        precision = precision_name(shape)
        args["fsdp"] = True
        args["fsdp_config"] = fsdp_config(shape, hook)
    args["bf16"] = precision == "bf16"
    args["fp16"] = precision == "fp16"
    if cpu:
        args["use_cpu"] = True  # else the Trainer sees world 1 under torchrun on a CPU
    return args


_HOOK = '''"""fsdp-plan's hook for the Hugging Face Trainer: the model arrives sharded as planned,
and a callback checks the run before the first step.

    import fsdp_plan_trainer as plan
    model = plan.apply(model)              # before Trainer(...)
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=..., **ARGS), ...)
    trainer.add_callback(plan.CheckLaunch(trainer))
    trainer.train()

``ARGS`` is training_args.json (no ``fsdp``: the policy shards). The Trainer takes a model
marked ``is_distributed_loading_by_transformers`` as one that owns its placement and
gradient reduction: it neither wraps it in DistributedDataParallel nor shards it again.
Written by ``fsdp-plan export``.
"""

from transformers import TrainerCallback

import fsdp_plan_policy as policy

LaunchMismatch = policy.LaunchMismatch


def apply(model):
    """The plan applied to ``model`` (``policy.apply``), marked for the Trainer."""
    model = policy.apply(model)
    try:
        model.is_distributed_loading_by_transformers = True
    except AttributeError:  # a PreTrainedModel: a read-only property over this field
        model._is_distributed_loading_by_transformers = True
    return model


class CheckLaunch(TrainerCallback):
    """At ``on_train_begin`` (after the Trainer prepared the model, before the first step)
    raise ``LaunchMismatch`` unless the prepared model runs the plan and the Trainer's
    ``args.world_size`` is torch.distributed's. Give it the trainer, whose ``model_wrapped``
    shows DistributedDataParallel; without it the callback's ``model`` is checked."""

    def __init__(self, trainer=None):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        wrapped = getattr(self.trainer, "model_wrapped", None) if self.trainer else None
        fix = ("Under torchrun on a CPU the Trainer sees one process unless use_cpu=True "
               "(training_args_cpu.json) or ACCELERATE_USE_CPU=true; on a CPU it applies no "
               "FSDP either, so shard with fsdp_plan_trainer.apply(model) (the export's README).")
        policy.check_launch(wrapped if wrapped is not None else model,
                            world_size=args.world_size, who="the Trainer", fix=fix)
'''


def render(plan: Plan, shape: PlanShape, options: dict[str, Any]) -> Export:
    result = Export("trainer", config_gaps=config_gaps(shape))
    hook = result.needs_hook
    if hook:
        result.lost = lost_with_hook(shape)
    args = training_args(shape, hook)
    result.files[ARGS_FILE] = json.dumps(args, indent=2) + "\n"
    result.files[CPU_ARGS_FILE] = json.dumps(training_args(shape, hook, cpu=True), indent=2) + "\n"
    files = {ARGS_FILE: "`TrainingArguments` fields on GPUs: batch, accumulation, precision"
                        + (", fsdp and fsdp_config" if "fsdp" in args else ""),
             CPU_ARGS_FILE: "the same for a CPU launch: `use_cpu`"
                            + (", no `fsdp` (the hook shards)" if shape.strategy != "ddp"
                               else ""),
             POLICY_FILE: "the plan's policy module (imports only torch)"}
    if "fsdp_config" in args:
        result.files[FSDP_CONFIG_FILE] = json.dumps(args["fsdp_config"], indent=2) + "\n"
        files[FSDP_CONFIG_FILE] = "the same `fsdp_config`, for `--fsdp_config fsdp_config.json`"
    result.files[HOOK_FILE] = _HOOK
    files[HOOK_FILE] = ("the code hook: `apply(model)` before `Trainer(...)`"
                        + ("" if hook or shape.strategy == "ddp" else " (needed on a CPU only)")
                        + ", and the `CheckLaunch` callback")
    result.files["README.md"] = readme(f"HF Trainer export of {shape.model_source or 'a plan'}",
                                       result, launch_text(shape, hook), hook_text(), files)
    return result


def _script(args_file: str, apply: bool) -> str:
    return ("```python\nimport json\nfrom transformers import Trainer, TrainingArguments\n"
            "import fsdp_plan_trainer as plan\n"
            + ("model = plan.apply(model)              # before Trainer(...)\n" if apply else "")
            + f"args = TrainingArguments(output_dir=\"out\", **json.load(open(\"{args_file}\")))\n"
            "trainer = Trainer(model=model, args=args, train_dataset=...)\n"
            "trainer.add_callback(plan.CheckLaunch(trainer))   # stops a run that is not the plan\n"
            "trainer.train()\n```")


def launch_text(shape: PlanShape, hook: bool) -> str:
    """How to launch on GPUs and on a CPU, and what the arguments alone do on each."""
    sharded = shape.strategy != "ddp"
    gpu = ("On GPUs, in `train.py`:\n\n" + _script(ARGS_FILE, hook) + "\n\nthen `torchrun "
           f"--nproc_per_node GPUS_PER_NODE --nnodes NODES train.py` ({shape.world_size} "
           "processes in all)." + ("" if hook else " There the arguments alone apply the plan."))
    cpu = ("On a CPU (gloo) the Trainer needs `use_cpu=True` (or `ACCELERATE_USE_CPU=true`): "
           "without it, under torchrun it sees one process while torch.distributed has N, so "
           "there is no distributed sampler and every rank trains the same data. "
           + ("Through accelerate it applies no FSDP on a CPU whatever `fsdp_config` says, so "
              f"there the code hook shards and `{CPU_ARGS_FILE}` holds no `fsdp`:\n\n"
              if sharded else f"`{CPU_ARGS_FILE}` sets it:\n\n")
           + _script(CPU_ARGS_FILE, sharded or hook)
           + f"\n\nthen `torchrun --nproc_per_node {shape.world_size} train.py`.")
    return (gpu + "\n\n" + cpu + "\n\n`CheckLaunch` raises `LaunchMismatch` at `on_train_begin`, "
            "naming each difference, when the prepared model is not the plan (no FSDP, other "
            "units, a missing checkpoint, the Trainer's world size not torch.distributed's).")


def hook_text() -> str:
    return ("Put this folder on `PYTHONPATH` and shard before the Trainer (on GPUs as on a "
            "CPU), as above with `plan.apply(model)`. "
            f"`{ARGS_FILE}` then holds no `fsdp`: the policy applies the units, "
            "checkpointing, prefetch and mixed precision; `bf16`/`fp16` are the plan's "
            "autocast, and `save_only_model` is set because the Trainer does not "
            "checkpoint the optimizer of a model sharded before it.")
