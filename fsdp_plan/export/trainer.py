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
HOOK_FILE = "fsdp_plan_trainer.py"
FILE_NAMES = (ARGS_FILE, FSDP_CONFIG_FILE, HOOK_FILE)
"""Every file of its own this export may write (with the policy module and README.md)."""
WHO = "the Trainer"


def config_gaps(shape: PlanShape) -> list[Gap]:
    """What ``TrainingArguments`` alone cannot say (see [Note: configuration reach])."""
    if shape.strategy == "ddp":
        ddp = shape.ddp or {}
        gaps = []
        first, cap = ddp.get("first_bucket_mb"), ddp.get("bucket_cap_mb")
        if (first, cap) != (1, 25) and first != cap:
            gaps.append(Gap("ddp buckets", f"a first bucket of {first} MB and {cap} MB after it",
                            f"{WHO}'s ddp_bucket_cap_mb sizes every bucket alike"))
        flags = [k for k in ("gradient_as_bucket_view", "static_graph") if ddp.get(k)]
        if flags or ddp.get("comm_hook"):
            gaps.append(Gap("ddp", ", ".join(flags + ([ddp["comm_hook"]] if ddp.get("comm_hook")
                                                      else [])), f"{WHO} leaves them off"))
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
    """``TrainingArguments.fsdp_config`` (FSDP version 2)."""
    return {
        "version": 2,
        "transformer_layer_cls_to_wrap": list(shape.block_classes),
        "reshard_after_forward": bool(shape.block_reshard and shape.block_reshard[-1]),
        "activation_checkpointing": bool(shape.checkpointed) and not hook,
    }


def training_args(shape: PlanShape, hook: bool) -> dict[str, Any]:
    """The ``TrainingArguments`` fields the plan implies (``output_dir`` is the user's)."""
    args: dict[str, Any] = {"per_device_train_batch_size": shape.micro_batch,
                            "gradient_accumulation_steps": shape.grad_accum_steps}
    if hook:  # the policy shards; bf16/fp16 are the plan's autocast (accelerate's native amp)
        precision = {"bfloat16": "bf16", "float16": "fp16"}.get(shape.autocast_dtype or "")
        args["save_only_model"] = True
    elif shape.strategy == "ddp":
        precision = {"bfloat16": "bf16", "float16": "fp16"}.get(shape.autocast_dtype or "")
        ddp = shape.ddp or {}
        if (ddp.get("first_bucket_mb"), ddp.get("bucket_cap_mb")) != (1, 25):
            args["ddp_bucket_cap_mb"] = ddp.get("bucket_cap_mb")
        args["ddp_find_unused_parameters"] = bool(ddp.get("find_unused_parameters"))
    else:
        precision = precision_name(shape)
        words = ["full_shard" if shape.block_reshard[-1:] != (False,) else "shard_grad_op",
                 "auto_wrap"] + (["offload"] if shape.offload else [])
        args["fsdp"] = " ".join(words)
        args["fsdp_config"] = fsdp_config(shape, hook)
    args["bf16"] = precision == "bf16"
    args["fp16"] = precision == "fp16"
    return args


_HOOK = '''"""fsdp-plan's hook for the Hugging Face Trainer: the model arrives sharded as planned.

    import fsdp_plan_trainer as plan
    model = plan.apply(model)              # before Trainer(...)
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=..., **ARGS), ...)

``ARGS`` is training_args.json (no ``fsdp``: the policy shards). The Trainer takes a model
marked ``is_distributed_loading_by_transformers`` as one that owns its placement and
gradient reduction: it neither wraps it in DistributedDataParallel nor shards it again.
Written by ``fsdp-plan export``.
"""

import fsdp_plan_policy as policy


def apply(model):
    """The plan applied to ``model`` (``policy.apply``), marked for the Trainer."""
    model = policy.apply(model)
    try:
        model.is_distributed_loading_by_transformers = True
    except AttributeError:  # a PreTrainedModel: a read-only property over this field
        model._is_distributed_loading_by_transformers = True
    return model
'''


def render(plan: Plan, shape: PlanShape, options: dict[str, Any]) -> Export:
    result = Export("trainer", config_gaps=config_gaps(shape))
    hook = result.needs_hook
    if hook:
        result.lost = lost_with_hook(shape)
    args = training_args(shape, hook)
    result.files[ARGS_FILE] = json.dumps(args, indent=2) + "\n"
    files = {ARGS_FILE: "`TrainingArguments` fields: batch, accumulation, precision"
                        + (", fsdp and fsdp_config" if "fsdp" in args else ""),
             POLICY_FILE: "the plan's policy module (imports only torch)"}
    if "fsdp_config" in args:
        result.files[FSDP_CONFIG_FILE] = json.dumps(args["fsdp_config"], indent=2) + "\n"
        files[FSDP_CONFIG_FILE] = "the same `fsdp_config`, for `--fsdp_config fsdp_config.json`"
    if hook:
        result.files[HOOK_FILE] = _HOOK
        files[HOOK_FILE] = "the code hook: `apply(model)` before `Trainer(...)`"
    launch = ("```python\nimport json\nfrom transformers import Trainer, TrainingArguments\n"
              f"args = TrainingArguments(output_dir=\"out\", **json.load(open(\"{ARGS_FILE}\")))\n"
              "```\n\nthen `torchrun --nproc_per_node GPUS_PER_NODE --nnodes NODES train.py` "
              f"({shape.world_size} processes in all).")
    hook_text = ("Put this folder on `PYTHONPATH` and shard before the Trainer:\n\n```python\n"
                 "import fsdp_plan_trainer as plan\nmodel = plan.apply(model)\n"
                 "trainer = Trainer(model=model, args=args, train_dataset=...)\n```\n\n"
                 f"`{ARGS_FILE}` then holds no `fsdp`: the policy applies the units, "
                 "checkpointing, prefetch and mixed precision; `bf16`/`fp16` are the plan's "
                 "autocast, and `save_only_model` is set because the Trainer does not "
                 "checkpoint the optimizer of a model sharded before it.")
    result.files["README.md"] = readme(f"HF Trainer export of {shape.model_source or 'a plan'}",
                                       result, launch, hook_text, files)
    return result
