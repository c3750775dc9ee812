"""Real users' models, planned end to end and checked against PyTorch's own accounting.

Each architecture is planned through the command (``main([...])`` writing a plan and a policy
module), the EMITTED policy is applied to the model on the fake process group at the plan's
world size and ``FSDPMemTracker``'s steady-step peak must be within 5% of the prediction and
under the budget; the same policy then runs for real on 2 gloo workers and ``CommDebugMode``'s
counts must equal the predicted ``collectives_per_step``. One launch counts every model (worker
start-up dominates: about 20 s on 2 cores).

Hugging Face models (``examples/hf/*.json``, 2-3 layers, hidden 64) need the optional
``transformers`` extra: they are marked ``hf`` and skipped without it. The hand-written
``examples/mixed.py`` (a module used twice, a root parameter, buffers, an ``nn.ModuleDict`` and
layers of very different sizes) runs everywhere.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import sys

import pytest
import yaml

from fsdp_plan.cli.main import main
from fsdp_plan.cost.units import owner_unit
from fsdp_plan.measure.collectives import count_collectives_many
from fsdp_plan.measure.memory import measure_peak
from fsdp_plan.measure.runtime import source_from_plan
from fsdp_plan.model.load import load_model
from fsdp_plan.plan.document import read_plan
from fsdp_plan.plan.emit import load_policy_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = os.path.join(ROOT, "examples", "hf")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
HAVE_HF = importlib.util.find_spec("transformers") is not None
WORLD = 8
NPROC = 2

# name -> (command-line model arguments, --mem, more flags). Budgets are picked so the chosen
# plan is not just the root: per-block units, a separate lm_head unit, checkpointed blocks.
HF_CASES: dict[str, tuple[list[str], str, list[str]]] = {
    "llama": (["--hf-config", os.path.join(HF, "llama.json")], "1MB", ["--seq-len", "16"]),
    # Full sharding: with the host floor this tiny MoE step (its experts' many small ops and
    # parameter tensors) is the host's, and at 3 MB HSDP root-only wins, which 2 gloo workers
    # on a flat mesh cannot count.
    "mixtral": (["--hf-config", os.path.join(HF, "mixtral.json")], "3MB",
                ["--seq-len", "16", "--strategy", "full"]),
    "gpt2": (["--hf-config", os.path.join(HF, "gpt2.json")], "1MB", ["--seq-len", "16"]),
    "t5": (["--hf-config", os.path.join(HF, "t5.json")], "2MB", ["--seq-len", "16"]),
    "vit": (["--hf-config", os.path.join(HF, "vit.json")], "600kB", []),
    "bert": (["--hf-config", os.path.join(HF, "bert.json")], "1MB", ["--seq-len", "16"]),
    # The second way in: a model file that imports the class, with the default HF inputs.
    "llama-file": ([os.path.join(FIXTURES, "hf_llama_file.py")], "1MB", ["--seq-len", "16"]),
}
OTHER_CASES: dict[str, tuple[list[str], str, list[str]]] = {
    "mixed": ([os.path.join(ROOT, "examples", "mixed.py")], "4MB",
              ["--seq-len", "64", "--batch-size", "2"]),
}


def _plan(folder, model_args: list[str], mem: str, extra: list[str]) -> tuple[int, str, str, str]:
    plan, policy = str(folder / "plan.yaml"), str(folder / "policy.py")
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([*model_args, "--mem", mem, "--world-size", str(WORLD), "--plan", plan,
                     "-o", policy, "--format", "json", *extra])
    return code, plan, policy, err.getvalue()


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict[str, tuple[int, str, str, str]]:
    cases = {**(HF_CASES if HAVE_HF else {}), **OTHER_CASES}
    return {name: _plan(tmp_path_factory.mktemp(name), *case) for name, case in cases.items()}


@pytest.fixture(scope="module")
def counted(planned) -> dict[str, list[dict[str, int]]]:
    """Per model, each rank's collective counts for one steady fwd+bwd on 2 gloo workers."""
    jobs, names = [], []
    for name, (code, plan_path, policy_path, _) in planned.items():
        if code != 0:
            continue
        plan = read_plan(plan_path)
        with open(policy_path) as f:
            jobs.append({"plan": plan.to_dict(), "source": source_from_plan(plan),
                         "policy_source": f.read()})
        names.append(name)
    if not jobs:
        return {}
    results = count_collectives_many(jobs[0]["source"], jobs, nproc=NPROC, timeout_s=400)
    return dict(zip(names, results))


def _check_against_pytorch(name: str, planned, counted) -> None:
    code, plan_path, policy_path, err = planned[name]
    assert code == 0, err
    plan = read_plan(plan_path)
    loaded = load_model(source_from_plan(plan))
    measured = measure_peak(loaded, plan, load_policy_module(policy_path))
    predicted = plan.predicted["peak_bytes"]
    error = (predicted - measured.peak_bytes) / measured.peak_bytes
    assert abs(error) <= 0.05, (
        f"{name}: predicted {predicted} vs FSDPMemTracker {measured.peak_bytes} ({error:+.1%}); "
        f"predicted breakdown {plan.predicted['breakdown']} at {plan.predicted['peak_phase']}; "
        f"measured {measured.breakdown}")
    assert measured.peak_bytes <= plan.budget_bytes - plan.headroom_bytes
    ranks = counted[name]
    assert all(r == ranks[0] for r in ranks), ranks
    expected = {k: v for k, v in plan.predicted["collectives_per_step"].items() if v}
    assert {k: v for k, v in ranks[0].items() if v} == expected, (name, ranks[0], expected)


def _skip_without_static_experts() -> None:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers.PreTrainedModel, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no grouped_mm experts "
                    "implementation; Mixtral's eager loop cannot be traced")


@pytest.mark.hf
@pytest.mark.parametrize("name", list(HF_CASES))
def test_hf_architecture_matches_pytorch(name, planned, counted):
    pytest.importorskip("transformers")
    if name == "mixtral":
        _skip_without_static_experts()
    _check_against_pytorch(name, planned, counted)


def test_mixed_model_matches_pytorch(planned, counted):
    _check_against_pytorch("mixed", planned, counted)
    plan = read_plan(planned["mixed"][1])
    # The root parameter ``scale`` and the reused ``shared_proj`` belong to units that exist.
    units = {m: i for i, u in enumerate(plan.units) for m in u.modules}
    assert plan.units[-1].modules == [""]
    assert owner_unit("shared_proj", units) in range(len(plan.units))


def _owners(plan_path: str, fqns: list[str]) -> set[int]:
    plan = read_plan(plan_path)
    units = {m: i for i, u in enumerate(plan.units) for m in u.modules}
    return {owner_unit(f, units) for f in fqns}


@pytest.mark.hf
@pytest.mark.parametrize("name,tied", [
    ("gpt2", ["transformer.wte", "lm_head"]),
    ("t5", ["shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head"]),
])
def test_tied_embeddings_land_in_one_unit(name, tied, planned):
    pytest.importorskip("transformers")
    code, plan_path, _, err = planned[name]
    assert code == 0, err
    assert len(read_plan(plan_path).units) > 1, "the budget should force a plan with several units"
    assert len(_owners(plan_path, tied)) == 1


@pytest.mark.hf
def test_t5_is_planned_as_two_stacks(planned):
    pytest.importorskip("transformers")
    plan = read_plan(planned["t5"][1])
    keys = [u.key for u in plan.units]
    assert any(k.startswith("encoder.block.") for k in keys)
    assert any(k.startswith("decoder.block.") for k in keys)


@pytest.mark.hf
def test_hf_default_inputs_follow_the_architecture():
    pytest.importorskip("transformers")
    from fsdp_plan.model.load import ModelSource
    t5 = load_model(ModelSource(source=os.path.join(HF, "t5.json"), kind="hf-config"))
    args, kwargs = t5.make_inputs(2, 8)
    assert args == () and kwargs["input_ids"].shape == kwargs["decoder_input_ids"].shape == (2, 8)
    vit = load_model(ModelSource(source=os.path.join(HF, "vit.json"), kind="hf-config"))
    _, kwargs = vit.make_inputs(3, 4096)  # images: the size is the config's, not --seq-len
    assert tuple(kwargs["pixel_values"].shape) == (3, 3, 32, 32)
    llama = load_model(ModelSource(source=os.path.join(FIXTURES, "hf_llama_file.py")))
    _, kwargs = llama.make_inputs(1, 5)
    assert tuple(kwargs["input_ids"].shape) == (1, 5) and int(kwargs["input_ids"].max()) < 512


@pytest.mark.hf
def test_eager_mixtral_config_is_planned_with_the_routing_assumption_stated(tmp_path, capsys):
    _skip_without_static_experts()
    with open(os.path.join(HF, "mixtral.json")) as f:
        config = json.load(f)
    config["experts_implementation"] = "eager"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code = main(["--hf-config", str(path), "--mem", "20MB", "--world-size", "2", "--seq-len", "16",
                 "--plan", str(tmp_path / "plan.yaml")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "grouped_mm" in err and "router" in err
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert any("grouped_mm" in note for note in plan["model"]["notes"])


@pytest.mark.hf
def test_eager_mixtral_model_file_names_the_fix(tmp_path, capsys):
    _skip_without_static_experts()
    code = main([os.path.join(FIXTURES, "hf_mixtral_eager.py"), "--mem", "20MB", "--seq-len", "16",
                 "--plan", str(tmp_path / "plan.yaml")])
    err = capsys.readouterr().err
    assert code == 2
    assert "experts_implementation='grouped_mm'" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.hf
def test_sequence_longer_than_learned_positions_is_bad_input(tmp_path, capsys):
    pytest.importorskip("transformers")
    code = main(["--hf-config", os.path.join(HF, "gpt2.json"), "--mem", "20MB",
                 "--seq-len", "4096", "--plan", str(tmp_path / "plan.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "at most 256 tokens" in err and "--seq-len 256" in err
    assert not list(tmp_path.iterdir())


def test_hf_config_and_model_file_are_exclusive(tmp_path, capsys):
    code = main([os.path.join(ROOT, "examples", "mixed.py"), "--hf-config",
                 os.path.join(HF, "llama.json"), "--mem", "20MB"])
    assert code == 2 and "not both" in capsys.readouterr().err


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
