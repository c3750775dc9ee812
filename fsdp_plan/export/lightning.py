"""The Lightning export: Trainer arguments (``ModelParallelStrategy`` for sharded plans,
``DDPStrategy`` with the plan's DDP arguments for DDP plans) in LightningCLI's YAML, and a
``configure_model`` hook that applies the plan.

``ModelParallelStrategy`` shards nothing by itself: the LightningModule's ``configure_model``
applies FSDP2, so a sharded plan always comes with the hook. ``DDPStrategy`` passes its keyword
arguments to ``DistributedDataParallel``, so a DDP plan's buckets fit its configuration;
checkpointing then needs the hook.
"""

from __future__ import annotations

from typing import Any

import yaml

from fsdp_plan.export.common import POLICY_FILE, Export, Gap, PlanShape, readme
from fsdp_plan.plan.document import Plan

CONFIG_FILE = "lightning_config.yaml"
HOOK_FILE = "fsdp_plan_lightning.py"
FILE_NAMES = (CONFIG_FILE, HOOK_FILE)
"""Every file of its own this export may write (with the policy module and README.md)."""
_PRECISION = {None: "32-true", "bfloat16": "bf16-mixed", "float16": "16-mixed"}


def config_gaps(shape: PlanShape) -> list[Gap]:
    """What ``lightning_config.yaml`` alone cannot say."""
    gaps = []
    if shape.strategy != "ddp":
        gaps.append(Gap("units", f"{shape.units} fully_shard units",
                        "ModelParallelStrategy shards nothing unless configure_model does"))
    elif shape.checkpointed:
        gaps.append(Gap("activation_checkpointing", f"{len(shape.checkpointed)} checkpointed "
                        "module(s)", "DDPStrategy checkpoints nothing"))
    if shape.strategy == "ddp" and (shape.ddp or {}).get("comm_hook"):
        gaps.append(Gap("ddp", f"the {shape.ddp['comm_hook']} gradient hook",
                        "DDPStrategy's YAML cannot name a hook function"))
    if shape.gradient_sync == "last" and shape.grad_accum_steps > 1 and shape.strategy != "ddp":
        gaps.append(Gap("gradient_sync", "gradients reduced on the last micro-batch only",
                        "ModelParallelStrategy reduces after every micro-batch"))
    return gaps


def lost_with_hook(shape: PlanShape) -> list[Gap]:
    if shape.strategy == "ddp" and (shape.ddp or {}).get("comm_hook"):
        return [Gap("ddp", f"the {shape.ddp['comm_hook']} gradient hook", "register it in "
                    "your script: DDPStrategy(ddp_comm_hook=...)")]
    return []


def trainer_config(plan: Plan, shape: PlanShape) -> dict[str, Any]:
    """LightningCLI's ``trainer:`` section for the plan."""
    from fsdp_plan.policy_runtime import ddp_kwargs

    gpus_per_node = min(shape.world_size, plan.node_gpus)
    if shape.strategy == "ddp":
        strategy = {"class_path": "lightning.pytorch.strategies.DDPStrategy",
                    "init_args": ddp_kwargs(shape.ddp or {})}
    else:
        strategy = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                    "init_args": {"data_parallel_size": shape.world_size,
                                  "tensor_parallel_size": 1}}
    return {"trainer": {
        "accelerator": "gpu",
        "devices": gpus_per_node,
        "num_nodes": max(1, shape.world_size // gpus_per_node),
        "strategy": strategy,
        "precision": _PRECISION.get(shape.autocast_dtype, "32-true"),
        "accumulate_grad_batches": shape.grad_accum_steps,
    }}


_HOOK = '''"""fsdp-plan's hook for Lightning: ``configure_model`` applies the plan.

    import fsdp_plan_lightning as plan

    class MyModule(plan.PlanMixin, L.LightningModule):   # the mixin first
        plan_attribute = "model"                         # the attribute holding the network

Written by ``fsdp-plan export``.
"""

import fsdp_plan_policy as policy


class PlanMixin:
    """``configure_model`` applies the plan to ``getattr(self, plan_attribute)`` (sharded
    plans: ``policy.apply``, FSDP2 units on the plan's mesh; DDP plans: the checkpointing, as
    DDPStrategy wraps the module itself); before each training batch the micro-batch's gradient
    sync is set as planned (``policy.prepare_microbatch``)."""

    plan_attribute = "model"

    def configure_model(self):
        if getattr(self, "_fsdp_plan_applied", False):  # Lightning may call this twice
            return
        network = getattr(self, self.plan_attribute)
        if policy.PLAN["strategy"] == "ddp":
            policy.apply_activation_checkpointing(network)
        else:
            setattr(self, self.plan_attribute, policy.apply(network))
        self._fsdp_plan_applied = True

    def on_train_batch_start(self, batch, batch_idx):
        count = self.trainer.accumulate_grad_batches
        if count > 1 and policy.PLAN["strategy"] != "ddp":
            policy.prepare_microbatch(getattr(self, self.plan_attribute), batch_idx % count,
                                      count)
'''


def render(plan: Plan, shape: PlanShape, options: dict[str, Any]) -> Export:
    result = Export("lightning", config_gaps=config_gaps(shape))
    if result.needs_hook:
        result.lost = lost_with_hook(shape)
    result.files[CONFIG_FILE] = yaml.safe_dump(trainer_config(plan, shape), sort_keys=False)
    files = {CONFIG_FILE: "Lightning Trainer arguments (LightningCLI `--config`)",
             POLICY_FILE: "the plan's policy module (imports only torch)"}
    if result.needs_hook:
        result.files[HOOK_FILE] = _HOOK
        files[HOOK_FILE] = "the code hook: `PlanMixin.configure_model` applies the plan"
    launch = (f"```bash\npython train.py fit --config {CONFIG_FILE}   # LightningCLI\n```\n\n"
              "or pass the same values to `lightning.Trainer(...)`. Per process: micro-batch "
              f"{shape.micro_batch}" + (f", sequence length {shape.seq_len}" if shape.seq_len
                                        else "") + " (your DataLoader's batch size).")
    hook_text = ("Put this folder on `PYTHONPATH` and mix the hook into your module:\n\n"
                 "```python\nimport fsdp_plan_lightning as plan\n\n"
                 "class MyModule(plan.PlanMixin, L.LightningModule):\n"
                 "    plan_attribute = \"model\"   # self.model is the network the plan is for\n"
                 "```\n\n`precision` in the config is the plan's autocast (`32-true` when FSDP2's "
                 "MixedPrecisionPolicy alone sets the dtypes).")
    result.files["README.md"] = readme(f"Lightning export of {shape.model_source or 'a plan'}",
                                       result, launch, hook_text, files)
    return result
