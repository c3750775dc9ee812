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

from fsdp_plan.cost.ddp_buckets import DDPConfig
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
    if shape.strategy == "ddp" and shape.ddp and shape.ddp.comm_hook:
        gaps.append(Gap("ddp", f"the {shape.ddp.comm_hook} gradient hook",
                        "DDPStrategy's YAML cannot name a hook function"))
    if shape.gradient_sync == "last" and shape.grad_accum_steps > 1 and shape.strategy != "ddp":
        gaps.append(Gap("gradient_sync", "gradients reduced on the last micro-batch only",
                        "ModelParallelStrategy reduces after every micro-batch"))
    return gaps


def lost_with_hook(shape: PlanShape) -> list[Gap]:
    if shape.strategy == "ddp" and shape.ddp and shape.ddp.comm_hook:
        return [Gap("ddp", f"the {shape.ddp.comm_hook} gradient hook", "register it in "
                    "your script: DDPStrategy(ddp_comm_hook=...)")]
    return []


def trainer_config(plan: Plan, shape: PlanShape) -> dict[str, Any]:
    """LightningCLI's ``trainer:`` section for the plan."""
    # torch.distributed's FSDP and DDP (~1 s): only for a Lightning export
    from fsdp_plan.policy_runtime import ddp_kwargs

    gpus_per_node = min(shape.world_size, plan.node_gpus)
    if shape.strategy == "ddp":
        strategy = {"class_path": "lightning.pytorch.strategies.DDPStrategy",
                    "init_args": ddp_kwargs((shape.ddp or DDPConfig()).to_dict())}
    else:
        strategy = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                    "init_args": {"data_parallel_size": shape.world_size,
                                  "tensor_parallel_size": 1}}
    return {"trainer": {
        "accelerator": "auto",  # the GPUs where there are, else the CPU (gloo)
        "devices": gpus_per_node,
        "num_nodes": max(1, shape.world_size // gpus_per_node),
        "strategy": strategy,
        "precision": _PRECISION.get(shape.autocast_dtype, "32-true"),
        "accumulate_grad_batches": shape.grad_accum_steps,
    }}


_HOOK = '''"""fsdp-plan's hook for Lightning: ``configure_model`` applies the plan, ``on_fit_start``
checks the run.

    import fsdp_plan_lightning as plan

    class MyModule(plan.PlanMixin, L.LightningModule):   # the mixin first
        plan_attribute = "model"                         # the attribute holding the network

For a configuration-only launch (a DDP plan), ``callbacks=[plan.CheckLaunch()]`` checks it.
Written by ``fsdp-plan export``.
"""

import lightning.pytorch as pl

import fsdp_plan_policy as policy

LaunchMismatch = policy.LaunchMismatch


def check(trainer):
    """Raise ``LaunchMismatch`` unless the strategy's model runs the plan and Lightning's
    world size is torch.distributed's."""
    policy.check_launch(trainer.strategy.model, world_size=trainer.world_size, who="Lightning",
                        fix="Apply the plan in configure_model through plan.PlanMixin, and "
                            "launch with the export README's command (devices x num_nodes "
                            "processes, accelerator auto).")


class CheckLaunch(pl.Callback):
    """``on_fit_start`` (the model configured and wrapped, before the first step): ``check``."""

    def on_fit_start(self, trainer, pl_module):
        check(trainer)


class PlanMixin:
    """``configure_model`` applies the plan to ``getattr(self, plan_attribute)`` (sharded
    plans: ``policy.apply`` on the strategy's ``device_mesh``, FSDP2 units; DDP plans: the
    checkpointing, as DDPStrategy wraps the module itself); ``on_fit_start`` checks the run
    (``check``); before each training batch the micro-batch's gradient sync is set as planned
    (``policy.prepare_microbatch``)."""

    plan_attribute = "model"

    def configure_model(self):
        if getattr(self, "_fsdp_plan_applied", False):  # Lightning may call this twice
            return
        network = getattr(self, self.plan_attribute)
        if policy.PLAN["strategy"] == "ddp":
            policy.apply_activation_checkpointing(network)
        else:
            setattr(self, self.plan_attribute, policy.apply(network, mesh=self._plan_mesh()))
        self._fsdp_plan_applied = True

    def _plan_mesh(self):
        """The strategy's data-parallel mesh (ModelParallelStrategy's ``device_mesh``) for a
        1-D plan; None (the policy builds its own) for an HSDP plan, which needs two axes."""
        mesh = getattr(self, "device_mesh", None)
        if mesh is None or policy.PLAN["mesh"]["replicate"] > 1:
            return None
        return mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh

    def on_fit_start(self):
        check(self.trainer)

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
    result.files[HOOK_FILE] = _HOOK
    files[HOOK_FILE] = ("the code hook: `PlanMixin.configure_model` applies the plan, its "
                        "`on_fit_start` checks the run (`CheckLaunch` for configuration-only "
                        "launches)")
    launch = launch_text(shape)
    hook_text = ("Put this folder on `PYTHONPATH` and mix the hook into your module:\n\n"
                 "```python\nimport fsdp_plan_lightning as plan\n\n"
                 "class MyModule(plan.PlanMixin, L.LightningModule):\n"
                 "    plan_attribute = \"model\"   # self.model is the network the plan is for\n"
                 "```\n\n`precision` in the config is the plan's autocast (`32-true` when FSDP2's "
                 "MixedPrecisionPolicy alone sets the dtypes).")
    result.files["README.md"] = readme(f"Lightning export of {shape.model_source or 'a plan'}",
                                       result, launch, hook_text, files)
    return result


def launch_text(shape: PlanShape) -> str:
    """How to launch on GPUs and on a CPU: ``accelerator: auto`` picks the device."""
    batch = (f"Per process: micro-batch {shape.micro_batch}"
             + (f", sequence length {shape.seq_len}" if shape.seq_len else "")
             + " (your DataLoader's batch size).")
    return (f"```bash\npython train.py fit --config {CONFIG_FILE}   # LightningCLI\n```\n\n"
            "or pass the same values to `lightning.Trainer(...)`. `accelerator: auto` takes the "
            "GPUs where there are and the CPU (gloo) otherwise, with the same command on both; "
            "Lightning starts `devices` processes per node itself (or run it under `torchrun "
            "--nproc_per_node DEVICES`). On GPUs and on a CPU alike the plan is applied by the "
            "hook (FSDP2 on the strategy's device mesh)"
            + (" for a sharded plan" if shape.strategy != "ddp" else "")
            + f". {batch} The hook's `on_fit_start` raises `LaunchMismatch`, naming each "
            "difference, when the run is not the plan"
            + ("; a configuration-only launch adds `callbacks=[plan.CheckLaunch()]`."
               if shape.strategy == "ddp" else "."))
