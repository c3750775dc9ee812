"""The bundled example models: published shapes, meta builds, real tiny training steps.

examples/ is not a package, so each file is imported by path, the way ``fsdp-plan
examples/X.py`` loads a user's model file.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = ["llama", "gpt2", "vit", "mixed", "resnet", "deep_narrow"]

# its plans and predictions of the same small models share their analyses (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("facts_cache_per_file")


def load_example(name: str):
    path = EXAMPLES / f"{name}.py"
    module_name = f"_fsdp_plan_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses under `from __future__ import annotations` look their module up in
    # sys.modules while the class body is processed, so register before executing.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) parameters count once


def default_inputs(module, model: torch.nn.Module, batch_size: int, seq_len: int):
    """What the planner feeds (SPEC section 1): example_inputs, else token ids for an Embedding."""
    if hasattr(module, "example_inputs"):
        return module.example_inputs(batch_size, seq_len)
    first_leaf = next(m for m in model.modules() if not list(m.children()))
    assert isinstance(first_leaf, torch.nn.Embedding)
    return (torch.randint(0, first_leaf.num_embeddings, (batch_size, seq_len)),)


def default_loss(module, output) -> torch.Tensor:
    if hasattr(module, "loss_fn"):
        return module.loss_fn(output)
    return output.sum()


PUBLISHED = [
    ("llama", "8b", 8_030_261_248),
    ("llama", "70b", 70_553_706_496),
    ("llama", "405b", 405_853_388_800),
    ("gpt2", "small", 124_439_808),
    ("gpt2", "124m", 124_439_808),
    ("gpt2", "medium", 354_823_168),
    ("gpt2", "large", 774_030_080),
    ("gpt2", "xl", 1_557_611_200),
    ("vit", "base", 86_567_656),
    ("vit", "large", 304_326_632),
    ("vit", "huge", 632_045_800),
    ("mixed", "tiny", 301_680),
    ("mixed", "big", 19_200_896),
    ("resnet", "tiny", 175_634),
    ("resnet", "resnet50", 25_557_032),   # torchvision's resnet50, resnet101, resnet152
    ("resnet", "resnet101", 44_549_160),
    ("resnet", "resnet152", 60_192_808),
    ("deep_narrow", "tiny", 25_152),
    ("deep_narrow", "base", 1_663_232),
]


@pytest.mark.parametrize(("name", "size", "expected"), PUBLISHED,
                         ids=[f"{n}-{s}" for n, s, _ in PUBLISHED])
def test_parameter_count_on_meta(name, size, expected):
    module = load_example(name)
    with torch.device("meta"):
        model = module.build_model(size=size)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())
    assert n_params(model) == expected


def test_gpt2_head_is_tied_to_embedding():
    module = load_example("gpt2")
    for size in ("tiny", "xl"):
        with torch.device("meta"):
            model = module.build_model(size=size)
        assert model.lm_head.weight is model.wte.weight
        names = [name for name, _ in model.named_parameters()]
        assert "wte.weight" in names and "lm_head.weight" not in names  # deduplicated
        assert "lm_head.weight" in dict(model.named_parameters(remove_duplicate=False))


def test_vit_and_mixed_root_parameters_and_buffers():
    vit = load_example("vit").build_model("tiny")
    root_params = dict(vit.named_parameters(recurse=False))
    assert set(root_params) == {"cls_token", "pos_embed"}
    assert isinstance(next(m for m in vit.modules() if not list(m.children())), torch.nn.Conv2d)

    mixed = load_example("mixed").build_model("tiny")
    assert set(dict(mixed.named_parameters(recurse=False))) == {"scale"}
    assert set(dict(mixed.named_buffers())) == {"center", "pos_table"}
    assert "center" in mixed.state_dict() and "pos_table" not in mixed.state_dict()
    assert isinstance(mixed.branches, torch.nn.ModuleDict)


def test_mixed_shared_module_runs_twice_per_forward():
    module = load_example("mixed")
    model = module.build_model("tiny")
    calls = []
    model.shared_proj.register_forward_hook(lambda *_: calls.append(1))
    model(*module.example_inputs(2, 16))
    assert len(calls) == 2


@pytest.mark.parametrize("name", NAMES)
def test_unknown_size_names_the_valid_ones(name):
    module = load_example(name)
    with pytest.raises(ValueError) as info:
        module.build_model(size="no-such-size")
    for size in module.SIZES:
        assert size in str(info.value)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_trains_on_cpu_with_finite_gradients(name):
    torch.manual_seed(0)
    module = load_example(name)
    model = module.build_model(size="tiny")
    inputs = default_inputs(module, model, batch_size=2, seq_len=16)
    loss = default_loss(module, model(*inputs))
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, f"{name}: {param_name} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{name}: {param_name} has a non-finite grad"


@pytest.mark.parametrize("name", ["gpt2", "vit", "mixed", "resnet"])
def test_example_inputs_under_fake_tensor_mode(name):
    module = load_example(name)
    module.build_model(size="tiny")
    with FakeTensorMode():
        inputs = module.example_inputs(4, 32)
    assert isinstance(inputs, tuple) and len(inputs) == 1
    assert isinstance(inputs[0], FakeTensor)
    expected = (4, 3, 32, 32) if name in ("vit", "resnet") else (4, 32)  # tiny: 32px images
    assert tuple(inputs[0].shape) == expected


@pytest.mark.parametrize(("name", "size"), [("gpt2", "xl"), ("vit", "base"), ("vit", "huge"),
                                            ("mixed", "big"), ("resnet", "resnet50")])
def test_large_sizes_run_forward_on_meta(name, size):
    """Shapes line up at the published sizes (25 heads of GPT-2 XL, 14px ViT-H patches)."""
    module = load_example(name)
    with torch.device("meta"):
        model = module.build_model(size=size)
        inputs = module.example_inputs(2, 64)
        out = model(*inputs)
        loss = default_loss(module, out)
    assert out.device.type == "meta" and loss.dim() == 0
    if name in ("vit", "resnet"):
        assert inputs[0].shape[-1] == 224 and tuple(out.shape) == (2, 1000)


def test_gpt2_rejects_sequences_longer_than_n_positions():
    module = load_example("gpt2")
    with torch.device("meta"):
        module.build_model(size="xl")
    with pytest.raises(ValueError, match="1024"):
        module.example_inputs(1, 4096)


# ---------------------------------------------------------------------------------------------
# Every example's emitted plan takes real steps (2 gloo ranks, one launch for all)
# ---------------------------------------------------------------------------------------------

def _plan_example(name: str, folder: Path) -> tuple[dict, str]:
    """Plan the tiny example for 2 ranks in bf16 with a budget that makes it shard into several
    units where any multi-unit plan fits (3% under what the root alone needs), else the root
    alone; returns the plan document and the emitted policy module's text."""
    import json

    import yaml
    from test_measure_helpers import run_cli

    common = [str(EXAMPLES / f"{name}.py"), "--model-arg", "size=tiny", "--world-size", "2",
              "--batch-size", "2", "--seq-len", "16", "--param-dtype", "bf16",
              "--strategy", "full"]
    code, out, err = run_cli([*common, "--mem", "1GB", "--format", "json"])
    assert code == 0, err
    root_peak = max(c["peak_bytes"] for c in json.loads(out)["candidates"]
                    if c["name"] == "recipe: root only")
    plan_path, policy_path = folder / f"{name}.yaml", folder / f"{name}_policy.py"
    outputs = ["--plan", str(plan_path), "-o", str(policy_path)]
    code, _, err = run_cli([*common, "--mem", str(int(root_peak * 0.97 / 0.9)), *outputs])
    if code == 3:  # nothing smaller than the root alone fits (the mixed model)
        code, _, err = run_cli([*common, "--mem", "1GB", *outputs])
    assert code == 0, err
    return yaml.safe_load(plan_path.read_text()), policy_path.read_text()


@pytest.mark.slow
def test_every_example_plan_steps_on_gloo_with_the_predicted_collectives(tmp_path):
    """Each bundled example, planned in bf16 and applied through its emitted policy module
    (FSDP2 ``apply_fully_shard`` and FSDP1 ``auto_wrap_policy``), takes two forward, backward
    and optimizer steps on 2 gloo ranks, and the second step's collectives are the plan's."""
    from fsdp_plan.measure.collectives import count_collectives_many
    from fsdp_plan.model.load import ModelSource

    jobs, plans = [], {}
    for name in NAMES:
        document, policy = _plan_example(name, tmp_path)
        plans[name] = document
        model = document["model"]
        source = ModelSource(source=model["source"], entry=model["entry"], args=model["args"],
                             batch_size=model["batch_size"], seq_len=model["seq_len"],
                             kind=model.get("kind", "file"))
        for version in (2, 1):
            jobs.append({"plan": document, "policy_source": policy, "fsdp_version": version,
                         "source": source, "name": name})
    assert len(plans["llama"]["units"]) > 2 and len(plans["resnet"]["units"]) > 30
    assert sum(bool(u.get("mixed_precision")) for u in plans["resnet"]["units"]) == 29
    results = count_collectives_many(jobs[0]["source"], jobs, nproc=2, timeout_s=600)
    measured, predicted = {}, {}
    for job, ranks in zip(jobs, results):
        key = f"{job['name']} fsdp{job['fsdp_version']}"
        assert ranks[0] == ranks[1], (key, ranks)
        measured[key] = ranks[0]
        stored = job["plan"]["predicted"]
        predicted[key] = stored["collectives_per_step" if job["fsdp_version"] == 2
                                else "collectives_per_step_fsdp1"]
    print(measured)
    assert measured == predicted
