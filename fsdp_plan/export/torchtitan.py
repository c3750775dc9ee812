"""The torchtitan export: a config module for the torchtitan on PyPI (0.3: configs are Python
functions, ``--module M --config F``) derived from one of torchtitan's own configs, with a
``parallelize`` function that applies the plan where torchtitan's options cannot say it.

[Note: torchtitan configs] (read in torchtitan 0.3.0)
``python -m torchtitan.train --module M --config F`` imports ``M`` (a dotted module path, or
``M.config_registry``) and calls ``F()`` for a ``Trainer.Config``; command-line flags override
fields after that. The model comes from the base config's ``model_spec``; its
``parallelize_fn(model, *, parallel_dims, training, parallelism, compile_config, ac_config,
dump_folder)`` shards the model built on ``meta``. torchtitan's own parallelize
(``apply_fsdp_to_decoder``) wraps ``tok_embeddings``, each block and ``[norm, lm_head]``
under one ``fsdp_reshard_after_forward`` policy (``default`` keeps ``[norm, lm_head]``
gathered, ``always`` does not, ``never`` keeps all), checkpoints every block or none,
computes in ``mixed_precision_param`` (bf16 or fp32) and reduces in float32, and runs
autocast only without sharding. The plan's units are module FQNs, so the plan must be
made for the torchtitan model itself.
"""

from __future__ import annotations

from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.cost.ddp_buckets import DDPConfig
from fsdp_plan.export.common import (
    NOTHING_LOST,
    POLICY_FILE,
    Export,
    Gap,
    PlanShape,
    md_text,
    plain_text,
    readme,
)
from fsdp_plan.model.source import TORCHTITAN_ENTRY
from fsdp_plan.model.torchtitan_models import base_config, flex_differences
from fsdp_plan.plan.document import Plan
from fsdp_plan.plan.emit import doc_safe
from fsdp_plan.search.framework import TITAN_TAIL, TITAN_TIED_TAIL

MODULE_FILE = "fsdp_plan_torchtitan.py"
FILE_NAMES = (MODULE_FILE,)
"""Every file of its own this export may write (with the policy module and README.md)."""
CONFIG_FUNCTION = "fsdp_plan"
WHO = "torchtitan"


def reshard_policy(shape: PlanShape) -> str | None:
    """torchtitan's ``fsdp_reshard_after_forward`` that gives the plan's flags: ``always``
    (every unit), ``default`` (all but [norm, lm_head]), ``never``; None: no policy does."""
    tails = (TITAN_TAIL, TITAN_TIED_TAIL)  # [tok_embeddings, norm, lm_head] when tied
    tail = {flag for unit, flag in zip(shape.unit_modules, shape.unit_reshard, strict=True)
            if unit in tails}
    rest = {flag for unit, flag in zip(shape.unit_modules, shape.unit_reshard, strict=True)
            if unit not in tails}
    policies = {(True, True): "always", (True, False): "default", (False, False): "never"}
    if len(rest) > 1 or len(tail) > 1:
        return None
    flag = next(iter(rest), True)
    return policies.get((flag, next(iter(tail), flag)))


def config_gaps(shape: PlanShape) -> list[Gap]:
    """What torchtitan's options alone cannot say (its own parallelize, see the Note and
    search/framework.py [Note: framework limits])."""
    if shape.strategy == "ddp":
        return []
    gaps = []
    if not shape.titan_units or sorted(shape.unit_modules) != sorted(shape.titan_units):
        gaps.append(Gap("units", f"{shape.units} units of its own choosing",
                        f"{WHO} wraps tok_embeddings, each block of layers, [norm, lm_head] "
                        "and the root"))
    if reshard_policy(shape) is None or shape.root_reshard:
        gaps.append(Gap("reshard_after_forward", "reshard flags no fsdp_reshard_after_forward "
                        "policy gives", f"{WHO} reshards all units (always), all but [norm, "
                        "lm_head] (default) or none (never), the root never"))
    blocks = {unit[0] for unit in shape.titan_units if unit[0].startswith("layers.")}
    modes = set(shape.checkpointed.values())
    if shape.checkpointed and (modes != {"full"} or set(shape.checkpointed) != blocks):
        gaps.append(Gap("activation_checkpointing", f"{len(shape.checkpointed)} of "
                        f"{len(blocks)} blocks checkpointed ({'/'.join(sorted(modes))})",
                        f"{WHO} checkpoints every block fully or none (its selective "
                        "policy saves every other matmul, not the plan's selective ops)"))
    if shape.forward_prefetch or shape.deep_backward_prefetch:
        gaps.append(Gap("prefetch", "explicit prefetch lists", f"{WHO} sets none for dense models"))
    if shape.param_dtype not in (None, "float32", "bfloat16") or shape.reduce_dtype not in (
            None, "float32"):
        gaps.append(Gap("mixed_precision", f"param_dtype {shape.param_dtype}, reduce_dtype "
                        f"{shape.reduce_dtype}", f"{WHO} computes in bf16 or fp32 and reduces "
                        "in fp32"))
    return gaps


def lost_with_hook(shape: PlanShape) -> list[Gap]:
    """What torchtitan's training loop loses even with the plan's parallelize."""
    lost = []
    if shape.strategy == "ddp":
        ddp = shape.ddp or DDPConfig()
        lost.append(Gap("ddp", f"DDP buckets of {ddp.bucket_cap_mb} MB (first "
                        f"{ddp.first_bucket_mb} MB)"
                        + (", checkpointed modules" if shape.checkpointed else ""),
                        f"{WHO} replicates with its own data parallelism "
                        "(data_parallel_replicate_degree) and its own settings"))
    elif shape.autocast_dtype:
        lost.append(Gap("autocast", f"forward under {shape.autocast_dtype} autocast",
                        f"{WHO} runs autocast only without sharding"))
    if shape.gradient_sync == "last" and shape.grad_accum_steps > 1:
        lost.append(Gap("gradient_sync", "gradients reduced on the last micro-batch only",
                        f"{WHO} reduces after every micro-batch"))
    if shape.offload:
        lost.append(Gap("offload", "parameters and optimizer states on the host",
                        f"{WHO} offloads through its own training.enable_cpu_offload, set here"))
    return lost


def _module_text(plan: Plan, shape: PlanShape, base: str, hook: bool) -> str:
    """The config module (see [Note: torchtitan configs]); the base config is named in it."""
    precision = shape.param_dtype if shape.param_dtype in ("bfloat16", "float32") else "float32"
    replicate, shard = ((shape.world_size, 1) if shape.strategy == "ddp"
                        else (shape.replicate, shape.shard))
    global_batch = shape.micro_batch * shape.grad_accum_steps * shape.world_size
    assignments = [
        f"config.training.local_batch_size = {shape.micro_batch}",
        f"config.training.global_batch_size = {global_batch}",
        *([f"config.training.seq_len = {int(shape.seq_len)}"] if shape.seq_len else []),
        f"config.training.mixed_precision_param = {precision!r}",
        "config.training.mixed_precision_reduce = 'float32'",
        f"config.training.enable_cpu_offload = {shape.offload}",
        f"config.parallelism.data_parallel_replicate_degree = {replicate}",
        f"config.parallelism.data_parallel_shard_degree = {shard}",
    ]
    if hook:
        assignments += ["config.activation_checkpoint = None  # the policy checkpoints",
                        "config.model_spec.parallelize_fn = parallelize"]
    else:
        reshard = reshard_policy(shape) or "default"
        ac = "FullAC" if shape.checkpointed else ""
        assignments.append(f"config.parallelism.fsdp_reshard_after_forward = {reshard!r}")
        assignments.append("config.activation_checkpoint = "
                           + (f"activation_checkpoint.{ac}.Config()" if ac else "None"))
    body = "\n".join(f"    {line}" for line in assignments)
    ac_import = ("" if hook else
                 "\nfrom torchtitan.distributed import activation_checkpoint  # noqa: F401\n")
    parallelize = '''

def parallelize(model, *, parallel_dims, **_options):
    """torchtitan's parallelize_fn: the plan's units, checkpointing, prefetch and mixed
    precision on torchtitan's data-parallel mesh (dp_replicate x fsdp), checked against the
    plan (``check_launch``) before torchtitan's first step."""
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    model = policy.apply(model, mesh=parallel_dims.get_mesh(names))
    return policy.check_launch(model, world_size=parallel_dims.world_size, who="torchtitan")
''' if hook else ""
    source = doc_safe(shape.model_source or "a model", 60)  # S4-01: never pasted raw
    return f'''"""torchtitan config made by fsdp-plan from the plan for {source}.

    python -m torchtitan.train --module fsdp_plan_torchtitan --config {CONFIG_FUNCTION}

BASE names the torchtitan config this one starts from (the model, data, optimizer and steps
are its); the plan sets batch, sequence, precision and data parallelism{", and parallelize"
" applies the plan's units" if hook else ""}. Written by ``fsdp-plan export``.
"""

import importlib
{ac_import}
import fsdp_plan_policy as policy

BASE = {base!r}
{parallelize}

def {CONFIG_FUNCTION}():
    """torchtitan's config for the plan: BASE with the plan's settings."""
    module, _, function = BASE.partition(":")
    config = getattr(importlib.import_module(module), function)()
{body}
    return config

'''


def check_config_name(base: str | None) -> str:
    """``--torchtitan-config``: given, and ``MODULE:FUNCTION`` with a dotted module path and a
    function name, since the config module imports the one and calls the other (anything else
    could not be imported, and would reach the generated files as text)."""
    if not base:
        raise BadInput("--to torchtitan needs --torchtitan-config MODULE:FUNCTION, the torchtitan "
                       "config of the model this plan is for (torchtitan trains its own model "
                       "definitions), e.g. torchtitan.models.llama3.config_registry:llama3_8b.")
    module, colon, function = base.partition(":")
    if not (colon and function.isidentifier() and all(p.isidentifier() for p in module.split("."))):
        raise BadInput(f"--torchtitan-config {plain_text(base)!r} is not MODULE:FUNCTION (a dotted "
                       "module path, a colon and a function name), e.g. "
                       "torchtitan.models.llama3.config_registry:llama3_8b.")
    return base


def titan_model(plan: Plan) -> dict[str, Any] | None:
    """The factory arguments when the plan is of torchtitan's own model
    (model/torchtitan_models.py), else None."""
    model = plan.model
    args = model.args or {}
    if model.source != TORCHTITAN_ENTRY or not args.get("name") or not args.get("flavor"):
        return None
    return {"name": str(args["name"]), "flavor": str(args["flavor"]),
            "batch_size": model.batch_size, "seq_len": model.seq_len,
            "rope_sized": args.get("seq_len") == model.seq_len}


def render(plan: Plan, shape: PlanShape, options: dict[str, Any]) -> Export:
    titan = titan_model(plan)
    base = options.get("torchtitan_config")
    if not base and titan is not None:  # torchtitan's own config of the planned flavour
        base = base_config(titan["name"], titan["flavor"])
    base = check_config_name(base)
    result = Export("torchtitan", config_gaps=config_gaps(shape))
    result.lost = lost_with_hook(shape)
    result.files[MODULE_FILE] = _module_text(plan, shape, base, result.needs_hook)
    files = {MODULE_FILE: f"the torchtitan config (`--config {CONFIG_FUNCTION}`)"
                          + (" and `parallelize`, the plan's parallelize_fn"
                             if result.needs_hook else ""),
             POLICY_FILE: "the plan's policy module (imports only torch)"}
    launch = ("```bash\nPYTHONPATH=. torchrun --nproc_per_node GPUS_PER_NODE --nnodes NODES "
              f"-m torchtitan.train --module fsdp_plan_torchtitan --config {CONFIG_FUNCTION}\n```"
              f"\n\n({shape.world_size} processes in all; run it from this folder.) The model "
              f"is BASE's (`{base}`): plan that model, since the plan names its modules.")
    hook_text = ("`parallelize` replaces BASE's parallelize_fn: it applies the plan through "
                 "the policy on torchtitan's data-parallel mesh, and torchtitan's own activation "
                 "checkpointing is off (the policy applies the plan's).")
    text = readme(f"torchtitan export of {shape.model_source or 'a plan'}", result, launch,
                  hook_text, files)
    if titan is not None:
        differences = flex_differences(titan["name"], titan["flavor"], titan["batch_size"],
                                       titan["seq_len"], titan["rope_sized"])
        if differences:
            text = text.replace(NOTHING_LOST, "Nothing the configuration loses; the analysed "
                                "step differs from torchtitan's as below.")
            text += ("\n## How the planned step differs from torchtitan's\n\n"
                     + "".join(f"- {md_text(line)}\n" for line in differences))
    result.files["README.md"] = text
    return result
