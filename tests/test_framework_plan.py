"""``fsdp-plan --framework NAME`` (issue 19 item 4, SPEC 7): plans a framework's own
configuration runs with no code hook.

Tier 1 (no framework installed): the restricted plans have no ``Gap`` for their framework (the
export's own reading of the configuration), export writes no hook for them, the report prices
the restriction, what a configuration cannot say is refused with exit 2, and the plan file
records the framework. Tier 2 (marker ``frameworks``): on 2 gloo ranks, accelerate's own FSDP2
preparation (``Accelerator.prepare``) driven by the exported configuration alone ends with the
plan's units, reshard flags, checkpointed blocks and collectives, and trains; under
FSDPMemTracker on the fake process group it reaches the peak the policy does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from test_emit import _comm_counts, _init_gloo, load_llama, run_ranks
from test_measure_helpers import LLAMA, ROOT, run_cli

from fsdp_plan import ModelSource, PlanRequest
from fsdp_plan.api import plan_from_facts
from fsdp_plan.common.errors import BadInput
from fsdp_plan.export import accelerate as acc_export
from fsdp_plan.export import torchtitan as titan_export
from fsdp_plan.export import trainer as trainer_export
from fsdp_plan.export.common import framework_gaps, plan_shape
from fsdp_plan.facts.analyze import analyze_model
from fsdp_plan.facts.graph import model_outline
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.plan.document import Plan, read_plan
from fsdp_plan.search.candidate import Layout
from fsdp_plan.search.framework import LIMITS

TITAN_SHAPED = str(ROOT / "tests" / "fixtures" / "titan_shaped.py")
BUDGET = "5MB"
"""Tiny Llama, micro-batch 2 x 128 on 2 ranks: accelerate's configuration fits only with every
block checkpointed. On the h100 preset this step is the host's (13.7 ms, 6 ms of it waiting for
the host), so full and grad-op sharding tie on time and the search keeps the lower peak."""
SMALL = ["--model-arg", "size=tiny", "--mem", BUDGET, "--world-size", "2",
         "--gpus-per-node", "2", "--seq-len", "128", "--batch-size", "2"]
STEPS = 10

# its plans and predictions of the same small models share their analyses (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("facts_cache_per_file")


@pytest.fixture(scope="module")
def accelerate_plan(tmp_path_factory) -> tuple[Path, str]:
    """The tiny Llama planned with ``--framework accelerate`` (plan file, report)."""
    folder = tmp_path_factory.mktemp("accelerate")
    code, out, err = run_cli([LLAMA, *SMALL, "--framework", "accelerate",
                              "--plan", str(folder / "plan.yaml")])
    assert code == 0, err
    return folder / "plan.yaml", out


@pytest.fixture(scope="module")
def tiny_facts() -> tuple[ModelSource, ModelFacts, torch.nn.Module]:
    """One analysis of the tiny Llama at the size above, for planning from facts."""
    source = ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=2, seq_len=128)
    analyzed = analyze_model(source, param_dtype="bfloat16")
    return source, analyzed.facts, analyzed.loaded.model


def _request(source: ModelSource, framework: str | None, **extra) -> PlanRequest:
    fields = {"budget_bytes": 5 * 10**6, "world_size": 2, "gpus_per_node": 2,
              "reduce_dtype": None, **extra}
    return PlanRequest(source=source, framework=framework, **fields)


# ---------------------------------------------------------------------------------------------
# Tier 1
# ---------------------------------------------------------------------------------------------


def test_the_accelerate_plan_is_what_its_config_says(accelerate_plan, tmp_path: Path) -> None:
    path, report = accelerate_plan
    plan = read_plan(str(path))
    assert plan.framework == "accelerate" and plan.fsdp_plan_version == 2
    # accelerate's units: every TransformerBlock with one reshard flag, the final norm kept
    # gathered, the root not resharded
    assert [u.modules for u in plan.units] == ([[f"layers.{i}"] for i in range(4)]
                                               + [["norm"], [""]])
    # (on the h100 preset this tiny step is the host's: full and grad-op sharding take the
    # same time, and which one the search keeps is not what this test is about)
    blocks = {u.reshard_after_forward for u in plan.units[:4]}
    assert len(blocks) == 1
    assert not plan.units[4].reshard_after_forward and not plan.units[5].reshard_after_forward
    assert plan.activation_checkpointing == [f"layers.{i}" for i in range(4)]
    assert plan.mixed_precision.to_dict() == {"param_dtype": "bfloat16",
                                              "reduce_dtype": "bfloat16"}
    assert not any(plan.forward_prefetch.values())
    assert all(len(t) <= 1 for t in plan.backward_prefetch.values())
    assert "restricted to accelerate's configuration: +" in report
    assert "step time" in report and "needs no code hook" in report
    # export reads the plan the same way: no gap, so no hook; --to comes from the plan
    out = tmp_path / "export"
    code, stdout, err = run_cli(["export", str(path), "-o", str(out)])
    assert code == 0, err
    # the hook module is there for CPUs (accelerate applies no FSDP there) and its check
    assert sorted(os.listdir(out)) == ["README.md", "accelerate_config.yaml",
                                       "fsdp_plan_accelerate.py", "fsdp_plan_policy.py"]
    assert "no code hook needed" in stdout
    assert "Nothing in the plan is beyond this configuration" in (out / "README.md").read_text()
    config = yaml.safe_load((out / "accelerate_config.yaml").read_text())
    assert config["mixed_precision"] == "bf16"
    assert config["fsdp_config"]["fsdp_activation_checkpointing"] is True
    assert config["fsdp_config"]["fsdp_reshard_after_forward"] is blocks.pop()


def test_each_restricted_plan_has_no_gap_for_its_framework(tiny_facts) -> None:
    """accelerate and the Trainer on the example Llama, torchtitan on the Llama named as
    torchtitan names it: the search keeps to exactly what export's config_gaps accepts."""
    source, facts, model = tiny_facts
    for framework, module in (("accelerate", acc_export), ("trainer", trainer_export)):
        result = plan_from_facts(facts, _request(source, framework))
        assert result.plan.framework == framework
        assert module.config_gaps(plan_shape(result.plan, model_outline(model))) == [], framework
        assert framework_gaps(framework, result.plan, model_outline(model)) == []
    titan_source = ModelSource(source=TITAN_SHAPED, batch_size=2, seq_len=128)
    titan = analyze_model(titan_source, param_dtype="bfloat16")
    result = plan_from_facts(titan.facts, _request(titan_source, "torchtitan",
                                                   budget_bytes=10**8))
    plan = result.plan
    assert [u.modules for u in plan.units] == ([["tok_embeddings"]]
                                               + [[f"layers.{i}"] for i in range(4)]
                                               + [["norm", "lm_head"], [""]])
    assert plan.mixed_precision.to_dict() == {"param_dtype": "bfloat16",
                                              "reduce_dtype": "float32"}
    shape = plan_shape(plan, model_outline(titan.loaded.model))
    assert titan_export.config_gaps(shape) == []
    assert titan_export.reshard_policy(shape) in ("always", "default", "never")


def test_the_unrestricted_search_finds_plans_configs_cannot_say(tiny_facts) -> None:
    """The restriction is real: at a roomier budget the unrestricted plan has gaps for
    accelerate, the restricted one none, and it is no faster."""
    source, facts, model = tiny_facts
    free = plan_from_facts(facts, _request(source, None, budget_bytes=10**8))
    kept = plan_from_facts(facts, _request(source, "accelerate", budget_bytes=10**8))
    assert framework_gaps("accelerate", free.plan, model_outline(model)) != []
    assert framework_gaps("accelerate", kept.plan, model_outline(model)) == []
    # at the same precision the restricted space is a subset of the unrestricted one
    same = plan_from_facts(facts, PlanRequest(source=source, budget_bytes=10**8, world_size=2,
                                              gpus_per_node=2, reduce_dtype="bfloat16"))
    assert same.best.time.step_s <= kept.best.time.step_s


def test_lightning_plans_without_restriction_and_says_why(tiny_facts) -> None:
    source, facts, _ = tiny_facts
    free = plan_from_facts(facts, _request(source, None))
    lightning = plan_from_facts(facts, _request(source, "lightning"))
    assert lightning.plan.framework == "lightning"
    assert lightning.plan.units == free.plan.units
    assert lightning.plan.mixed_precision == free.plan.mixed_precision
    assert LIMITS["lightning"].restricts is False


def test_lightning_report_names_the_hook(tmp_path: Path) -> None:
    code, out, err = run_cli([LLAMA, *SMALL, "--framework", "lightning"])
    assert code == 0, err
    assert "--framework lightning: Lightning's ModelParallelStrategy applies FSDP2 only in" in out
    assert "writes the code hook" in out


@pytest.mark.hf
@pytest.mark.parametrize("framework", ["accelerate", "trainer"])
def test_a_hugging_face_model_is_planned_as_the_framework_wraps_it(tmp_path: Path,
                                                                  framework: str) -> None:
    """accelerate (and the Trainer through it) gives a Hugging Face model's input embedding a
    unit and its final norm with the output head another, kept gathered: the restricted search
    plans exactly those units, one reshard flag, and the export needs no code hook (issue 30)."""
    pytest.importorskip("transformers")
    model = str(ROOT / "tests" / "fixtures" / "hf_llama_file.py")
    flags = ["--mem", "2GB", "--world-size", "2", "--gpus-per-node", "2", "--seq-len", "64"]
    code, out, err = run_cli([model, *flags, "--framework", framework,
                              "--plan", str(tmp_path / "p.yaml")])
    assert code == 0, err
    assert f"restricted to {framework}'s configuration" in out, out
    plan = read_plan(str(tmp_path / "p.yaml"))
    assert plan.framework == framework
    units = {tuple(u.modules): u.reshard_after_forward for u in plan.units}
    blocks = {units.pop(("model.embed_tokens",)), units.pop(("model.layers.0",)),
              units.pop(("model.layers.1",))}
    assert len(blocks) == 1
    assert units == {("model.norm", "lm_head"): False, ("",): False}
    assert plan.activation_checkpointing in ([], ["model.layers.0", "model.layers.1"])
    code, out, err = run_cli(["export", str(tmp_path / "p.yaml"), "-o", str(tmp_path / "x")])
    assert code == 0 and "no code hook needed" in out, (out, err)
    readme = (tmp_path / "x" / "README.md").read_text()
    assert "Nothing in the plan is beyond this configuration" in readme
    if framework == "accelerate":
        config = yaml.safe_load((tmp_path / "x" / "accelerate_config.yaml").read_text())
        assert config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    else:
        args = json.loads((tmp_path / "x" / "training_args.json").read_text())
        assert args["fsdp"] is True
        assert args["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]


@pytest.mark.frameworks
def test_the_frameworks_read_the_hugging_face_exports(tmp_path: Path, monkeypatch) -> None:
    """accelerate's own launcher and FSDP plugin, and ``TrainingArguments``, read the exported
    configurations of a restricted Hugging Face plan: block class LlamaDecoderLayer only."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from accelerate.utils import FullyShardedDataParallelPlugin

    model = str(ROOT / "tests" / "fixtures" / "hf_llama_file.py")
    flags = ["--mem", "2GB", "--world-size", "2", "--gpus-per-node", "2", "--seq-len", "64"]
    for framework in ("accelerate", "trainer"):
        assert run_cli([model, *flags, "--framework", framework,
                        "--plan", str(tmp_path / f"{framework}.yaml")])[0] == 0
        assert run_cli(["export", str(tmp_path / f"{framework}.yaml"),
                        "-o", str(tmp_path / framework)])[0] == 0
    for key, value in accelerate_env(str(tmp_path / "accelerate")).items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.transformer_cls_names_to_wrap == [
        "LlamaDecoderLayer"]
    args = json.loads((tmp_path / "trainer" / "training_args.json").read_text())
    assert args["bf16"] is True  # the GPU form: on this CPU bf16 is refused without use_cpu
    training = transformers.TrainingArguments(output_dir=str(tmp_path / "out"),
                                              **{**args, "use_cpu": True})
    assert training.fsdp_plugin_args["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
    cpu = json.loads((tmp_path / "trainer" / "training_args_cpu.json").read_text())
    assert "fsdp" not in cpu and cpu["use_cpu"] is True
    transformers.TrainingArguments(output_dir=str(tmp_path / "out2"), **cpu)


@pytest.mark.parametrize("flags, words", [
    (["--framework", "accelerate", "--reduce-dtype", "fp32"], "--reduce-dtype fp32 cannot be said"),
    (["--framework", "torchtitan", "--param-dtype", "fp16"], "torchtitan cannot compute in"),
    (["--framework", "accelerate", "--strategy", "none"], "--strategy none cannot be said"),
    (["--framework", "accelerate", "--compile"], "--compile with --framework accelerate"),
    (["--framework", "deepspeed"], "invalid choice"),
])
def test_what_a_configuration_cannot_say_is_refused(tmp_path: Path, flags, words) -> None:
    plan = tmp_path / "p.yaml"
    code, _, err = run_cli([LLAMA, *SMALL, *flags, "--plan", str(plan)])
    assert code == 2 and words in err and "Traceback" not in err, err
    assert not plan.exists()


def test_reduce_dtype_follows_the_framework() -> None:
    source = ModelSource(source=LLAMA, args={"size": "tiny"})
    assert _request(source, "accelerate").reduce_dtype == "bfloat16"
    assert _request(source, "accelerate", param_dtype="fp32").reduce_dtype == "float32"
    assert _request(source, "torchtitan").reduce_dtype == "float32"
    assert _request(source, None).reduce_dtype == "float32"
    auto = PlanRequest(source=source, budget_bytes=10**9, framework="trainer",
                       reduce_dtype="auto")
    assert auto.reduce_dtype == "bfloat16"
    assert auto.unrestricted().reduce_dtype == "auto"
    assert _request(source, "accelerate").unrestricted().reduce_dtype == "float32"


def test_limits_refuse_layouts_their_config_cannot_say() -> None:
    """On the analysed tiny Llama's facts (a fixture): a unit per block with one reshard flag
    and the final norm kept gathered is sayable; keeping the last block gathered, resharding
    the norm, leaving it in the root, grouping, partial or selective checkpointing, explicit
    prefetch, a resharded root and strategy none are not."""
    facts = ModelFacts.from_json((ROOT / "tests" / "fixtures" / "tiny_llama_facts.json"
                                  ).read_text())
    graph = facts.graph
    accelerate = LIMITS["accelerate"]
    blocks = tuple((b,) for b in graph.blocks)
    groups = (*blocks, ("norm",))
    base = Layout(strategy="full", mesh=(1, 2), groups=groups,
                  reshard=(*(True for _ in blocks), False))
    assert accelerate.allows(base, graph, True)
    assert accelerate.allows(dataclasses.replace(base, full=frozenset(range(len(blocks)))),
                             graph, True)
    refused = [
        dataclasses.replace(base, reshard=(*base.reshard[:-2], False, False)),
        dataclasses.replace(base, reshard=tuple(True for _ in groups)),
        dataclasses.replace(base, groups=blocks, reshard=base.reshard[:-1]),
        dataclasses.replace(base, groups=groups[:1] + groups[2:], reshard=base.reshard[1:]),
        dataclasses.replace(base, full=frozenset({0})),
        dataclasses.replace(base, selective=frozenset(range(len(blocks)))),
        dataclasses.replace(base, forward_prefetch=1),
        dataclasses.replace(base, root_reshard=True),
        dataclasses.replace(base, strategy="none", mesh=(2, 1)),
    ]
    assert [accelerate.allows(layout, graph, True) for layout in refused] == [False] * 9
    assert accelerate.unit_layouts(graph, True) == {"class": [list(g) for g in groups]}


def test_the_plan_file_checks_its_framework(tmp_path: Path) -> None:
    from test_measure_helpers import tiny_llama_plan

    plan = tiny_llama_plan()
    plan.framework, plan.fsdp_plan_version = "accelerate", 2
    assert Plan.from_dict(plan.to_dict()).framework == "accelerate"
    assert list(plan.to_dict()).index("framework") == list(plan.to_dict()).index("strategy") + 1
    for value, version, words in (("deepspeed", 2, "not one of accelerate"),
                                  ("accelerate", 1, "needs fsdp_plan_version: 2"),
                                  (["accelerate"], 2, "not one of")):
        document = {**plan.to_dict(), "framework": value, "fsdp_plan_version": version}
        with pytest.raises(BadInput, match=words):
            Plan.from_dict(document)
    assert "framework" not in tiny_llama_plan().to_dict()  # plans for no framework unchanged
    code, _, err = run_cli(["export", str(_plan_path(tmp_path, tiny_llama_plan())),
                            "-o", str(tmp_path / "x")])
    assert code == 2 and "give --to" in err and not (tmp_path / "x").exists()


def _plan_path(tmp_path: Path, plan: Plan) -> Path:
    from test_measure_helpers import plan_file
    return Path(plan_file(tmp_path, plan))


def test_json_report_carries_the_cost(tmp_path: Path) -> None:
    code, out, err = run_cli([LLAMA, *SMALL, "--framework", "trainer", "--format", "json"])
    assert code == 0, err
    data = json.loads(out)
    assert data["plan"]["framework"] == "trainer"
    assert data["framework"].startswith("restricted to trainer's configuration")


# ---------------------------------------------------------------------------------------------
# Tier 2: accelerate's own FSDP2 preparation from the exported configuration, no hook
# ---------------------------------------------------------------------------------------------


def accelerate_env(folder: str) -> dict[str, str]:
    """What ``accelerate launch --config_file`` hands each process for the exported config."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", os.path.join(folder, "accelerate_config.yaml"), "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_"))}


def accelerate_fsdp2(accelerator) -> None:
    """Make ``accelerator`` take its FSDP2 path on a CPU.

    [Note: accelerate's FSDP on a CPU]
    accelerate picks ``DistributedType.FSDP`` only on an accelerator device; with ``cpu=True``
    it is ``MULTI_CPU`` (plain DDP) whatever the config says. Here the state is set as
    ``AcceleratorState`` sets it on a GPU from the same environment (``distributed_type
    FSDP``, the plugin read from ``FSDP_*``, its mixed precision from ``ACCELERATE_MIXED_
    PRECISION``), so ``Accelerator.prepare`` runs its own ``fsdp2_apply_ac`` and
    ``fsdp2_prepare_model`` with gloo."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    if accelerator.state.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.state.mixed_precision)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2


def _config_only_worker(rank: int, world_size: int, port: int, folder: str) -> None:
    from torch.distributed.tensor.debug import CommDebugMode

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ.update(accelerate_env(folder))
    _init_gloo(rank, world_size, port)
    sys.path.insert(0, folder)
    import fsdp_plan_policy as policy  # for its PLAN only: nothing of it is applied
    from accelerate import Accelerator

    plan = policy.PLAN
    accelerator = Accelerator(cpu=True)
    accelerate_fsdp2(accelerator)
    llama = load_llama()
    torch.manual_seed(0)
    model = llama.build_model("tiny")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = torch.randint(0, 512, (STEPS * 2 * world_size, 128),
                            generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(batches, batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for step, batch in enumerate(loader):
        optimizer.zero_grad()
        with CommDebugMode() as mode:
            loss = llama.loss_fn(model(batch))
            accelerator.backward(loss)
        if step == 1:
            counts = _comm_counts(mode)
        optimizer.step()
        losses.append(loss.item())
    seen = units_built(model, plan)  # after a step: the root's reshard flag is set lazily
    assert counts == plan["predicted"]["collectives_per_step"], counts
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    if rank == 0:
        print(f"accelerate config only: {seen}, collectives {counts}, loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f} over {STEPS} steps", flush=True)
    torch.distributed.destroy_process_group()


def units_built(network: torch.nn.Module, plan_doc: dict) -> dict:
    """The FSDP2 units accelerate built, as the plan writes them: each ``fully_shard`` state
    that holds parameters (accelerate also shards each ``CheckpointWrapper``, whose block
    already holds its parameters: an empty state, see [Note: framework limits]), its modules,
    its reshard flag, and the checkpointed modules."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    from fsdp_plan.policy_runtime import plain_fqn

    units = {}
    for name, module in network.named_modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                units[plain_fqn(name)] = group.post_forward_mesh_info is not None
    planned = {unit["modules"][0]: unit["reshard_after_forward"] for unit in plan_doc["units"]}
    assert all(len(unit["modules"]) == 1 for unit in plan_doc["units"])
    assert units == planned, (units, planned)
    checkpointed = sorted(plain_fqn(n) for n, m in network.named_modules()
                          if isinstance(m, CheckpointWrapper))
    assert checkpointed == sorted(plan_doc["activation_checkpointing"]), checkpointed
    return {"units": len(units), "checkpointed": checkpointed}


@pytest.mark.frameworks
@pytest.mark.slow
def test_the_exported_accelerate_config_alone_trains_the_plan_on_gloo(accelerate_plan,
                                                                       tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    out = tmp_path / "export"
    code, _, err = run_cli(["export", str(accelerate_plan[0]), "-o", str(out)])
    assert code == 0, err
    assert "Nothing in the plan is beyond" in (out / "README.md").read_text()
    run_ranks(_config_only_worker, 2, str(out), timeout_s=300)


def accelerate_policy(folder: str, plan: Plan, monkeypatch) -> types.ModuleType:
    """A stand-in for the policy module whose ``apply_fully_shard`` is accelerate's own FSDP2
    preparation from the exported config (``fsdp2_apply_ac`` then ``fsdp2_prepare_model``),
    so ``measure_peak`` measures what accelerate builds."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model

    for key, value in accelerate_env(folder).items():
        monkeypatch.setenv(key, value)
    mixed = yaml.safe_load(Path(folder, "accelerate_config.yaml").read_text())["mixed_precision"]
    plugin = FullyShardedDataParallelPlugin()
    if mixed != "no":
        plugin.set_mixed_precision(mixed)

    def apply_fully_shard(model, mesh):
        accelerator = types.SimpleNamespace(
            state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision=mixed,
            is_main_process=False, device=torch.device("cpu"),
            torch_device_mesh={("fsdp",): mesh},
            parallelism_config=types.SimpleNamespace(fsdp_dim_names=["fsdp"]))
        plugin.set_auto_wrap_policy(model)
        if plugin.activation_checkpointing:
            model = fsdp2_apply_ac(accelerator, model)
        return fsdp2_prepare_model(accelerator, model)

    return types.SimpleNamespace(apply_fully_shard=apply_fully_shard, PLAN=plan.to_dict())


@pytest.mark.frameworks
@pytest.mark.slow
def test_accelerates_own_sharding_reaches_the_policys_peak(accelerate_plan, tmp_path: Path,
                                                            monkeypatch) -> None:
    """FSDPMemTracker on the fake process group: accelerate's preparation from the exported
    config and the policy's apply reach the same peak, within the plan's prediction's 3%."""
    pytest.importorskip("accelerate")
    from fsdp_plan.measure import runtime
    from fsdp_plan.measure.memory import measure_peak
    from fsdp_plan.plan.emit import load_policy_module, render_policy_module

    out = tmp_path / "export"
    assert run_cli(["export", str(accelerate_plan[0]), "-o", str(out)])[0] == 0
    plan = read_plan(str(accelerate_plan[0]))
    loaded = runtime.load_planned_model(plan, None, str(accelerate_plan[0]))
    by_policy = measure_peak(loaded, plan, load_policy_module(render_policy_module(plan)))
    by_accelerate = measure_peak(loaded, plan, accelerate_policy(str(out), plan, monkeypatch))
    assert by_accelerate.peak_bytes == by_policy.peak_bytes, (by_accelerate, by_policy)
    predicted = plan.predicted["peak_bytes"]
    print(f"FSDPMemTracker: accelerate {by_accelerate.peak_bytes:,} B, policy "
          f"{by_policy.peak_bytes:,} B, predicted {predicted:,} B")
    assert abs(predicted - by_accelerate.peak_bytes) <= 0.03 * by_accelerate.peak_bytes
