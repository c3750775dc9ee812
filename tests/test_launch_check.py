"""The policy's ``check_launch`` (issue 30 item 1): a model as the framework prepared it is
compared with the plan before the first step.

On the fake process group at world 2 (one process, real CPU tensors): the plan applied by the
policy passes; no sharding, another wrap, a missing checkpoint, a framework that sees another
world size, DDP where FSDP was planned and DDP with other buckets each raise ``LaunchMismatch``
naming the difference. Real launches through the frameworks are in test_launch_frameworks.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_emit import load_llama
from test_measure_helpers import tiny_llama_plan

from fsdp_plan.plan.document import Plan
from fsdp_plan.plan.emit import load_policy_module, render_policy_module


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    yield
    dist.destroy_process_group()


def _load_file(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_hf_llama_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def policy_of(plan: Plan):
    return load_policy_module(render_policy_module(plan))


def sharded_plan() -> Plan:
    """Blocks 1 and 3 checkpointed, block 3 kept gathered, bf16 parameters reduced in fp32."""
    plan = tiny_llama_plan(world=2, ac=["layers.1", "layers.3"], batch_size=2, seq_len=16,
                           mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    plan.units[3].reshard_after_forward = False
    return plan


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return load_llama().build_model("tiny", n_layers=4)


def test_the_plan_applied_by_the_policy_passes() -> None:
    policy = policy_of(sharded_plan())
    model = policy.apply(tiny_llama())
    assert policy.check_launch(model, world_size=2) is model
    assert policy.launch_differences(model) == []


def test_a_model_nothing_sharded_is_stopped() -> None:
    policy = policy_of(sharded_plan())
    with pytest.raises(policy.LaunchMismatch, match="none of the plan's 5 FSDP units is "
                       "applied.*nothing shards it.*2 planned checkpointed module"):
        policy.check_launch(tiny_llama())


def test_another_wrap_is_named() -> None:
    """Every block resharded and its attention a unit of its own, bf16 reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = policy_of(sharded_plan())
    model = policy.apply_activation_checkpointing(tiny_llama())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    fully_shard(model.layers[0].attention, mp_policy=mp)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=True, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    with pytest.raises(policy.LaunchMismatch) as error:
        policy.check_launch(model)
    message = str(error.value)
    assert "FSDP units the plan does not have: 'layers.0.attention'" in message, message
    assert "reshard_after_forward differs from the plan: layers.3 reshards" in message
    assert "mixed precision differs: layers.0 computes in bfloat16 and reduces in bfloat16 " \
           "(planned bfloat16, float32)" in message
    assert "\n" not in message


def test_a_missing_checkpoint_and_a_selective_one_are_named() -> None:
    plan = sharded_plan()
    plan.activation_checkpointing = {"layers.1": "full", "layers.3": "full"}
    policy = policy_of(plan)
    model = tiny_llama()
    from fsdp_plan.policy_runtime import checkpoint_module
    model.layers[1] = checkpoint_module(model.layers[1], [torch.ops.aten.mm.default])
    differences = policy.launch_differences(model)
    assert "1 planned checkpointed module(s) are not checkpointed: 'layers.3'" in differences
    assert "checkpointing modes differ: layers.1 is selective, planned full" in differences


def test_a_framework_that_sees_world_one_is_stopped() -> None:
    policy = policy_of(sharded_plan())
    model = policy.apply(tiny_llama())
    with pytest.raises(policy.LaunchMismatch, match=r"accelerate sees a world of 1 process\(es\) "
                       "where torch.distributed has 2.*every rank trains the same batches.*"
                       "Set ACCELERATE_USE_CPU=true"):
        policy.check_launch(model, world_size=1, who="accelerate",
                            fix="Set ACCELERATE_USE_CPU=true.")


def test_ddp_where_fsdp_was_planned_is_stopped() -> None:
    """accelerate on a CPU (``MULTI_CPU``) wraps the model in DDP whatever its config says."""
    from torch.nn.parallel import DistributedDataParallel

    policy = policy_of(sharded_plan())
    model = DistributedDataParallel(tiny_llama())
    with pytest.raises(policy.LaunchMismatch, match="wrapped in DistributedDataParallel instead"):
        policy.check_launch(model)


def test_a_ddp_plan_checks_its_buckets() -> None:
    from torch.nn.parallel import DistributedDataParallel

    plan = tiny_llama_plan(world=2)
    plan.strategy, plan.units = "ddp", plan.units[-1:]
    plan.mesh.replicate, plan.mesh.shard = 2, 1
    plan.ddp = {"bucket_cap_mb": 10, "first_bucket_mb": 10, "gradient_as_bucket_view": True,
                "static_graph": False, "find_unused_parameters": False}
    policy = policy_of(plan)
    assert policy.launch_differences(policy.apply(tiny_llama())) == []
    wrong = DistributedDataParallel(tiny_llama())
    differences = policy.launch_differences(wrong)
    assert "DDP buckets are capped at 25 MB, the plan's at 10 MB" in differences, differences
    assert "DDP gradient_as_bucket_view is False, the plan's True" in differences
    assert policy.launch_differences(tiny_llama()) == [
        "the plan is DDP but the model is not wrapped in DistributedDataParallel"]


@pytest.mark.frameworks
def test_accelerates_own_fsdp2_of_a_restricted_hf_plan_passes(tmp_path, monkeypatch) -> None:
    """accelerate's ``fsdp2_prepare_model`` from the exported config of a ``--framework
    accelerate`` plan for a Hugging Face Llama (its units: each decoder layer, the input
    embedding, ``[model.norm, lm_head]`` kept gathered, the root) is the plan; the same
    preparation from a config naming ``Linear`` too is stopped."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    import types

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from test_framework_plan import accelerate_env
    from test_measure_helpers import ROOT, plan_file, run_cli
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_plan.plan.document import Mesh, Unit

    source = str(ROOT / "tests" / "fixtures" / "hf_llama_file.py")
    units = [Unit(modules=[name], reshard_after_forward=True)
             for name in ("model.embed_tokens", "model.layers.0", "model.layers.1")]
    units += [Unit(modules=["model.norm", "lm_head"], reshard_after_forward=False),
              Unit(modules=[""], reshard_after_forward=False)]
    plan = Plan(model={"source": source, "entry": "build_model", "args": {}, "batch_size": 2,
                       "seq_len": 16, "kind": "file"}, budget_bytes=10**9, world_size=2,
                mesh=Mesh(replicate=1, shard=2), strategy="full", units=units,
                optimizer="adamw", activation_checkpointing=[], predicted={},
                mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"})
    code, out, err = run_cli(["export", plan_file(tmp_path, plan), "--to", "accelerate",
                              "-o", str(tmp_path / "x")])
    assert code == 0 and "no code hook needed" in out, (out, err)
    policy = policy_of(plan)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))

    def prepared(classes: str | None = None):
        for key, value in accelerate_env(str(tmp_path / "x")).items():
            monkeypatch.setenv(key, value)
        if classes:
            monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", classes)
        plugin = FullyShardedDataParallelPlugin()
        plugin.set_mixed_precision("bf16")
        accelerator = types.SimpleNamespace(
            state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16",
            is_main_process=False, device=torch.device("cpu"), torch_device_mesh={("fsdp",): mesh},
            parallelism_config=types.SimpleNamespace(fsdp_dim_names=["fsdp"]))
        torch.manual_seed(0)
        return fsdp2_prepare_model(accelerator, _load_file(source).build_model())

    assert policy.launch_differences(prepared()) == []
    differences = policy.launch_differences(prepared("LlamaDecoderLayer,Linear"))
    extra = [d for d in differences if d.startswith("FSDP units the plan does not have: ")]
    assert extra and "'model.layers.0.mlp.down_proj'" in extra[0], differences
