"""``fsdp-plan export`` (SPEC section 7): framework files made from a plan.

Tier 1 (no framework installed): what a configuration can and cannot say, the files, the
errors. Tier 2 (pytest marker ``frameworks``, skipped without the package): each export is
read by the framework's own code, and real 2-process gloo runs through accelerate (with the
hook) and Lightning's ``ModelParallelStrategy`` end up with the plan's units, reshard flags,
checkpointed blocks and collectives, and train.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_emit import _comm_counts, _init_gloo, load_llama, run_ranks
from test_measure_helpers import LLAMA, plan_file, run_cli, tiny_llama_plan

from fsdp_plan.export import accelerate as acc_export
from fsdp_plan.export import plan_shape
from fsdp_plan.facts.graph import model_outline
from fsdp_plan.plan.document import Plan, Unit, read_plan

STEPS = 10
TITAN_BASE = "torchtitan.models.llama3.config_registry:llama3_debugmodel"

# its plans and predictions of the same small models share their analyses (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("facts_cache_per_file")


def predicted(plan: Plan) -> Plan:
    """``plan`` with the planner's own prediction (collective counts) filled in, from facts
    the file's earlier tests traced where they match (the file's facts cache, conftest)."""
    from fsdp_plan.api import analyze_for_plan, predict
    from fsdp_plan.facts.cache import FactsCache
    from fsdp_plan.measure import runtime

    loaded = runtime.load_planned_model(plan)
    facts = analyze_for_plan(plan, loaded, facts_cache=FactsCache.default())
    plan.predicted = predict(plan, facts).predicted
    return plan


def hook_plan() -> Plan:
    """More than a class-based config can say: layers.1 and layers.3 checkpointed, layers.3
    kept gathered after forward, reduction in float32 under bf16 parameters."""
    plan = tiny_llama_plan(world=2, ac=["layers.1", "layers.3"], batch_size=2, seq_len=16,
                           mixed_precision={"param_dtype": "bfloat16",
                                            "reduce_dtype": "float32"})
    plan.units[3].reshard_after_forward = False
    return predicted(plan)


def config_only_plan() -> Plan:
    """Exactly what accelerate's config says: every block a unit resharded after forward, the
    final norm a unit kept gathered (accelerate's ``_find_final_norm``), the root not resharded,
    no checkpointing, no prefetch, float32."""
    plan = tiny_llama_plan(world=2, batch_size=2, seq_len=16)
    plan.units.insert(-1, Unit(modules=["norm"], reshard_after_forward=False))
    return plan


def shape_of(plan: Plan):
    from fsdp_plan.measure import runtime
    return plan_shape(plan, model_outline(runtime.load_planned_model(plan).model))


def export(tmp_path: Path, plan: Plan, framework: str, *extra: str) -> Path:
    out = tmp_path / framework
    code, _, err = run_cli(["export", plan_file(tmp_path, plan, f"{framework}.yaml"),
                                 "--to", framework, "-o", str(out), *extra])
    assert code == 0, err
    return out


# ---------------------------------------------------------------------------------------------
# Tier 1: no framework needed
# ---------------------------------------------------------------------------------------------


def test_a_plan_the_config_can_say_needs_no_hook(tmp_path: Path) -> None:
    shape = shape_of(config_only_plan())
    assert shape.block_classes == ("TransformerBlock",) and shape.class_units
    assert acc_export.config_gaps(shape) == []
    out = export(tmp_path, config_only_plan(), "accelerate")
    # the hook module is written for the CPU (where accelerate applies no FSDP) and the check
    assert sorted(os.listdir(out)) == ["README.md", "accelerate_config.yaml",
                                       "fsdp_plan_accelerate.py", "fsdp_plan_policy.py"]
    config = yaml.safe_load((out / "accelerate_config.yaml").read_text())
    assert config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "TransformerBlock"
    assert config["fsdp_config"]["fsdp_reshard_after_forward"] is True
    readme = (out / "README.md").read_text()
    assert "Nothing in the plan is beyond this configuration" in readme
    assert "ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 train.py" in readme
    assert "accelerate applies no FSDP on a CPU" in readme
    assert "plan.check(model, accelerator)" in readme


def test_what_the_config_cannot_say_is_named_and_the_hook_keeps_it(tmp_path: Path) -> None:
    gaps = acc_export.config_gaps(shape_of(hook_plan()))
    assert [g.feature for g in gaps] == ["units", "reshard_after_forward",
                                         "activation_checkpointing", "mixed_precision"]
    out = export(tmp_path, hook_plan(), "accelerate")
    assert (out / "fsdp_plan_accelerate.py").exists()
    config = yaml.safe_load((out / "accelerate_config.yaml").read_text())
    # the policy applies checkpointing and precision; accelerate must not do either again
    assert config["fsdp_config"]["fsdp_activation_checkpointing"] is False
    assert config["mixed_precision"] == "no"
    readme = (out / "README.md").read_text()
    assert "2 module(s) checkpointed (full)" in readme
    assert "plan.apply(model)" in readme and "Nothing: launched as above" in readme


def test_trainer_args_say_batch_accumulation_and_precision(tmp_path: Path) -> None:
    plan = config_only_plan()
    plan.mixed_precision = {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}
    plan.grad_accum_steps, plan.gradient_sync = 4, "every"
    out = export(tmp_path, plan, "trainer")
    args = json.loads((out / "training_args.json").read_text())
    assert args == {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
                    "fsdp": True,
                    "fsdp_config": {"version": 2,
                                    "transformer_layer_cls_to_wrap": ["TransformerBlock"],
                                    "reshard_after_forward": True,
                                    "activation_checkpointing": False,
                                    "cpu_offload": False},
                    "bf16": True, "fp16": False}
    assert json.loads((out / "fsdp_config.json").read_text()) == args["fsdp_config"]
    cpu = json.loads((out / "training_args_cpu.json").read_text())
    assert cpu == {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
                   "save_only_model": True, "bf16": False, "fp16": False, "use_cpu": True}
    readme = (out / "README.md").read_text()
    assert "applies no FSDP on a CPU" in readme and "use_cpu=True" in readme
    assert "trainer.add_callback(plan.CheckLaunch(trainer))" in readme


def test_torchtitan_needs_its_base_config_and_bad_input_writes_nothing(tmp_path: Path) -> None:
    path = plan_file(tmp_path, hook_plan())
    code, _, err = run_cli(["export", path, "--to", "torchtitan", "-o", str(tmp_path / "t")])
    assert code == 2 and "--torchtitan-config" in err and "Traceback" not in err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = run_cli(["export", path, "--to", "lightning", "-o", str(blocker)])
    assert code == 2 and "is a file" in err
    doc = yaml.safe_load(Path(path).read_text())
    doc["units"][0]["modules"] = ["no.such.module"]
    Path(path).write_text(yaml.safe_dump(doc))
    code, _, err = run_cli(["export", path, "--to", "accelerate", "-o", str(tmp_path / "a")])
    assert code == 2 and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["file", "plan.yaml"]


# ---------------------------------------------------------------------------------------------
# Tier 2: the frameworks' own readers
# ---------------------------------------------------------------------------------------------


@pytest.mark.frameworks
def test_accelerate_reads_the_config_as_fsdp2_with_the_block_class(tmp_path: Path,
                                                                   monkeypatch) -> None:
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = str(export(tmp_path, config_only_plan(), "accelerate") / "accelerate_config.yaml")
    cluster = load_config_from_file(path)
    assert cluster.distributed_type == "FSDP" and cluster.num_processes == 2
    args = launch_command_parser().parse_args(["--config_file", path, "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)  # what `accelerate launch` hands the processes
    assert env["FSDP_VERSION"] == "2" and env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "TransformerBlock"
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["TransformerBlock"]
    assert plugin.activation_checkpointing is False


@pytest.mark.frameworks
def test_trainingarguments_take_the_fsdp_config(tmp_path: Path, caplog) -> None:
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    plan = config_only_plan()
    plan.activation_checkpointing = [f"layers.{i}" for i in range(4)]  # all blocks: sayable
    args = json.loads((export(tmp_path, plan, "trainer") / "training_args.json").read_text())
    training = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), **args)
    assert "deprecated" not in caplog.text  # fsdp=True with fsdp_config, transformers 5's form
    plugin = training.fsdp_plugin_args
    assert plugin["fsdp_version"] == 2 and plugin["reshard_after_forward"] is True
    assert plugin["transformer_cls_names_to_wrap"] == "TransformerBlock"
    assert plugin["activation_checkpointing"] is True
    assert training.per_device_train_batch_size == 2 and training.gradient_accumulation_steps == 1
    hooked = json.loads((export(tmp_path, hook_plan(), "trainer") / "training_args.json"
                         ).read_text())
    assert "fsdp" not in hooked and hooked["save_only_model"] is True
    transformers.TrainingArguments(output_dir=str(tmp_path / "out2"), **hooked)


@pytest.mark.frameworks
def test_lightning_builds_the_strategy_from_the_exported_arguments(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    import importlib

    config = yaml.safe_load((export(tmp_path, hook_plan(), "lightning")
                             / "lightning_config.yaml").read_text())["trainer"]
    module, _, name = config["strategy"]["class_path"].rpartition(".")
    strategy = getattr(importlib.import_module(module), name)(**config["strategy"]["init_args"])
    assert type(strategy).__name__ == "ModelParallelStrategy"
    assert strategy._data_parallel_size == 2 and strategy._tensor_parallel_size == 1
    assert config["precision"] == "32-true" and config["devices"] == 2
    assert config["accelerator"] == "auto"  # the CPU (gloo) where there is no GPU


@pytest.mark.frameworks
def test_torchtitan_parses_the_exported_config(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    plan = hook_plan()
    out = export(tmp_path, plan, "torchtitan", "--torchtitan-config", TITAN_BASE)
    monkeypatch.syspath_prepend(str(out))
    for name in ("fsdp_plan_torchtitan", "fsdp_plan_policy"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    config = ConfigManager().parse_args(["--module", "fsdp_plan_torchtitan",
                                         "--config", "fsdp_plan", "--training.steps", "3"])
    assert config.training.local_batch_size == 2 and config.training.seq_len == 16
    assert config.training.global_batch_size == 4 and config.training.steps == 3
    assert config.parallelism.data_parallel_shard_degree == 2
    assert config.parallelism.data_parallel_replicate_degree == 1
    assert config.activation_checkpoint is None
    assert config.model_spec.parallelize_fn.__module__ == "fsdp_plan_torchtitan"


# ---------------------------------------------------------------------------------------------
# Tier 2: real runs on 2 gloo ranks
# ---------------------------------------------------------------------------------------------


def _check_units(network: torch.nn.Module, plan_doc: dict) -> dict:
    """The FSDP2 units, reshard flags and checkpointed modules the run ended up with."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    from fsdp_plan.policy_runtime import plain_fqn

    states = {id(m._get_fsdp_state()) for m in network.modules() if isinstance(m, FSDPModule)}
    assert len(states) == len(plan_doc["units"]), len(states)
    for unit in plan_doc["units"]:
        module = network.get_submodule(unit["modules"][0]) if unit["modules"][0] else network
        (group,) = module._get_fsdp_state()._fsdp_param_groups
        assert (group.post_forward_mesh_info is not None) is unit["reshard_after_forward"]
    checkpointed = sorted(plain_fqn(n) for n, m in network.named_modules()
                          if isinstance(m, CheckpointWrapper))
    assert checkpointed == sorted(plan_doc["activation_checkpointing"]), checkpointed
    return {"units": len(states), "checkpointed": checkpointed}


def _batches(world_size: int) -> torch.Tensor:
    """Token ids for STEPS batches of 2 on each rank (the loaders split them between ranks)."""
    return torch.randint(0, 512, (STEPS * 2 * world_size, 16),
                         generator=torch.Generator().manual_seed(0))


def _accelerate_worker(rank: int, world_size: int, port: int, folder: str) -> None:
    from torch.distributed.tensor.debug import CommDebugMode

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    _init_gloo(rank, world_size, port)
    sys.path.insert(0, folder)
    import fsdp_plan_accelerate as plan  # the exported hook
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type == "MULTI_CPU"  # where prepare would wrap in DDP
    llama = load_llama()
    torch.manual_seed(0)
    model = plan.apply(llama.build_model("tiny", n_layers=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(_batches(world_size), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert type(model).__name__ == "FSDPLlama", type(model)  # not DistributedDataParallel
    seen = _check_units(model, plan.policy.PLAN)
    losses = []
    for step, batch in enumerate(loader):
        optimizer.zero_grad()
        with CommDebugMode() as mode:
            with plan.autocast():
                loss = llama.loss_fn(model(batch))
            accelerator.backward(loss)
        if step == 1:
            counts = _comm_counts(mode)
        optimizer.step()
        losses.append(loss.item())
    assert counts == plan.policy.PLAN["predicted"]["collectives_per_step"], counts
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    if rank == 0:
        print(f"accelerate: {seen}, collectives {counts}, loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f} over {STEPS} steps", flush=True)
    torch.distributed.destroy_process_group()


@pytest.mark.frameworks
@pytest.mark.slow
def test_accelerate_with_the_hook_trains_the_plan_on_gloo(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    out = export(tmp_path, hook_plan(), "accelerate")
    run_ranks(_accelerate_worker, 2, str(out), timeout_s=300)


def _lightning_worker(rank: int, world_size: int, port: int, folder: str) -> None:
    from torch.distributed.tensor.debug import CommDebugMode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), NODE_RANK="0",
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
                      TORCHELASTIC_RUN_ID="fsdp-plan-test")  # as torchrun launches
    torch.set_num_threads(1)
    sys.path.insert(0, folder)
    import fsdp_plan_lightning as plan  # the exported hook
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    config = yaml.safe_load(Path(folder, "lightning_config.yaml").read_text())["trainer"]
    llama = load_llama()
    policy = plan.policy
    record: dict = {"losses": []}

    class Module(plan.PlanMixin, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = llama.build_model("tiny", n_layers=4)

        def training_step(self, batch, index):
            with CommDebugMode() as mode:
                loss = llama.loss_fn(self.model(batch))
                self.manual_backward(loss)
            if index == 1:
                record["counts"] = _comm_counts(mode)
            self.optimizers().step()
            self.optimizers().zero_grad()
            record["losses"].append(loss.item())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    module = Module()
    module.automatic_optimization = False  # backward inside the counted region
    trainer = L.Trainer(accelerator="cpu", devices=config["devices"],
                        num_nodes=config["num_nodes"], precision=config["precision"],
                        strategy=ModelParallelStrategy(**config["strategy"]["init_args"]),
                        max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(_batches(world_size), batch_size=2)
    trainer.fit(module, loader)
    seen = _check_units(module.model, policy.PLAN)
    counts, losses = record["counts"], record["losses"]
    assert counts == policy.PLAN["predicted"]["collectives_per_step"], counts
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    if rank == 0:
        print(f"lightning: {seen}, collectives {counts}, loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f} over {STEPS} steps", flush=True)
    torch.distributed.destroy_process_group()


@pytest.mark.frameworks
@pytest.mark.slow
def test_lightning_model_parallel_strategy_trains_the_plan_on_gloo(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    out = export(tmp_path, hook_plan(), "lightning")
    run_ranks(_lightning_worker, 2, str(out), timeout_s=300)


def test_the_exported_plan_is_the_plan(tmp_path: Path) -> None:
    """The export's policy module holds the plan file's plan, as emit writes it."""
    plan = hook_plan()
    out = export(tmp_path, plan, "lightning")
    code, _, err = run_cli(["emit", str(tmp_path / "lightning.yaml"), "-o",
                            str(tmp_path / "p.py")])
    assert code == 0, err
    assert (out / "fsdp_plan_policy.py").read_bytes() == (tmp_path / "p.py").read_bytes()
    assert read_plan(str(tmp_path / "lightning.yaml")).to_dict() == plan.to_dict()
    assert LLAMA


def test_the_trainer_loses_no_gradient_sync_of_a_ddp_plan():
    """The Trainer accumulates under ``accelerator.accumulate`` (DDP's ``no_sync`` on every
    micro-batch but the last): a DDP plan's ``gradient_sync: last`` is what it does, while an
    FSDP2 plan's is lost (its loop cannot call ``prepare_microbatch``)."""
    import dataclasses

    from fsdp_plan.export import trainer
    fsdp = dataclasses.replace(shape_of(hook_plan()), gradient_sync="last", grad_accum_steps=4)
    assert [g.feature for g in trainer.lost_with_hook(fsdp)] == ["gradient_sync"]
    assert trainer.lost_with_hook(dataclasses.replace(fsdp, strategy="ddp")) == []


@pytest.mark.hf
def test_class_lists_name_block_classes_only(tmp_path: Path) -> None:
    """A Hugging Face plan giving ``lm_head`` a unit of its own: ``Linear`` alone in a class
    list would wrap every linear layer, so accelerate's and the Trainer's lists name the
    decoder layer only (issue 30)."""
    pytest.importorskip("transformers")
    from test_measure_helpers import ROOT

    from fsdp_plan.plan.document import Mesh

    units = [Unit(modules=[m], reshard_after_forward=True)
             for m in ("model.layers.0", "model.layers.1", "lm_head")]
    units.append(Unit(modules=[""], reshard_after_forward=False))
    plan = Plan(model={"source": str(ROOT / "tests" / "fixtures" / "hf_llama_file.py"),
                       "entry": "build_model", "args": {}, "batch_size": 2, "seq_len": 16,
                       "kind": "file"}, budget_bytes=10**9, world_size=2,
                mesh=Mesh(replicate=1, shard=2), strategy="full", units=units,
                optimizer="adamw", mixed_precision={}, activation_checkpointing=[],
                predicted={})
    assert shape_of(plan).block_classes == ("LlamaDecoderLayer", "Linear")
    config = yaml.safe_load((export(tmp_path, plan, "accelerate") / "accelerate_config.yaml")
                            .read_text())
    assert config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    from fsdp_plan.export import trainer
    fsdp = trainer.fsdp_config(shape_of(plan), hook=False)
    assert fsdp["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
