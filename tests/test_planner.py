"""The planner end to end, checked against PyTorch's own measurements.

- predicted peak vs FSDPMemTracker (fake process group at the plan's world size, FakeTensorMode,
  the plan applied through the generated ``apply_fully_shard``), within 5%;
- predicted collective counts vs CommDebugMode on real gloo runs (FSDP2 and FSDP1);
- exit codes: 3 when nothing fits, 2 for bad input, no files written on failure.
"""

from __future__ import annotations

import os

import pytest
import yaml

from fsdp_plan.cli.main import main
from fsdp_plan.measure.collectives import count_collectives
from fsdp_plan.measure.peak import measured_peak as measure_any_peak
from fsdp_plan.model.load import ModelSource, load_model, source_kind
from fsdp_plan.plan.document import read_plan
from fsdp_plan.plan.emit import load_policy_module, render_policy_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
VIT = os.path.join(ROOT, "examples", "vit.py")
GPT2 = os.path.join(ROOT, "examples", "gpt2.py")
MIXED = os.path.join(ROOT, "examples", "mixed.py")

# its plans and predictions of the same small models share their analyses (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("facts_cache_per_file")


def plan_for(tmp_path, model: str, *extra: str) -> str:
    out = tmp_path / "plan.yaml"
    code = main([model, "--plan", str(out), "-o", str(tmp_path / "policy.py"), "--format", "json",
                 *extra])
    assert code == 0
    return str(out)


def measured_peak(plan_path: str) -> tuple[int, int, int]:
    plan = read_plan(plan_path)
    m = plan.model
    source = ModelSource(source=m.source, entry=m.entry, args=m.args, batch_size=m.batch_size,
                         seq_len=m.seq_len, kind=source_kind(m.source))
    loaded = load_model(source)
    # a small model at 8 MB may come out DDP under auto: measure.peak dispatches on the strategy
    measured = measure_any_peak(loaded, plan, load_policy_module(render_policy_module(plan)))
    return plan.predicted["peak_bytes"], measured.peak_bytes, plan.budget_bytes - plan.headroom_bytes


CASES = [
    # model, args, budget, world size, extra flags
    (LLAMA, ["--model-arg", "size=tiny", "--batch-size", "2", "--seq-len", "64"], "3.2MB", 8, []),
    (LLAMA, ["--model-arg", "size=tiny", "--batch-size", "2", "--seq-len", "64"], "2.7MB", 8, []),
    (LLAMA, ["--model-arg", "size=small", "--seq-len", "512"], "60MB", 64, []),
    (LLAMA, ["--model-arg", "size=small", "--seq-len", "256", "--batch-size", "2"], "120MB", 16,
     ["--gpus-per-node", "4", "--strategy", "hybrid"]),
    (VIT, ["--model-arg", "size=tiny", "--batch-size", "4"], "2MB", 8, []),
    (GPT2, ["--model-arg", "size=tiny", "--seq-len", "128", "--batch-size", "2"], "6MB", 4, []),
    (MIXED, ["--seq-len", "32", "--batch-size", "2"], "6MB", 2, []),
    # every strategy, optimizer and precision the command offers
    (LLAMA, ["--model-arg", "size=tiny", "--seq-len", "64"], "8MB", 4, ["--strategy", "none"]),
    (LLAMA, ["--model-arg", "size=tiny", "--seq-len", "64"], "8MB", 4, ["--strategy", "grad-op"]),
    (LLAMA, ["--model-arg", "size=tiny", "--seq-len", "64"], "8MB", 4, ["--optimizer", "sgd"]),
    (LLAMA, ["--model-arg", "size=tiny", "--seq-len", "64"], "8MB", 4, ["--param-dtype", "fp32"]),
]


@pytest.mark.parametrize("model,args,mem,world,extra", CASES)
def test_predicted_peak_matches_fsdp_mem_tracker(tmp_path, model, args, mem, world, extra):
    path = plan_for(tmp_path, model, *args, "--mem", mem, "--world-size", str(world), *extra)
    predicted, measured, limit = measured_peak(path)
    assert abs(predicted - measured) / measured <= 0.05, (predicted, measured)
    assert measured <= limit, "an emitted plan must measure under its budget"


@pytest.mark.parametrize("nproc,mesh,extra", [
    (2, None, ["--strategy", "full"]),  # at 1 GB auto would replicate (DDP, tests/test_ddp.py)
    (4, None, ["--strategy", "full"]),
    (4, (2, 2), ["--gpus-per-node", "2", "--strategy", "hybrid"]),
])
def test_predicted_collectives_match_comm_debug_mode(tmp_path, nproc, mesh, extra):
    path = plan_for(tmp_path, LLAMA, "--model-arg", "size=tiny", "--seq-len", "32",
                    "--mem", "1GB", "--world-size", str(nproc), *extra)
    plan = read_plan(path)
    source = ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=1, seq_len=32, kind="file")
    for version, key in ((2, "collectives_per_step"), (1, "collectives_per_step_fsdp1")):
        counts = count_collectives(source, plan.to_dict(), nproc=nproc, fsdp_version=version,
                                   mesh=mesh)
        expected = {k: v for k, v in plan.predicted[key].items() if v}
        assert {k: v for k, v in counts.items() if v} == expected, (version, counts, expected)


def test_impossible_budget_exits_3_and_writes_nothing(tmp_path, capsys):
    code = main([LLAMA, "--model-arg", "size=tiny", "--seq-len", "64", "--mem", "200kB",
                 "--world-size", "8", "--plan", str(tmp_path / "p.yaml"), "-o", str(tmp_path / "p.py")])
    assert code == 3
    err = capsys.readouterr().err
    assert "smallest peak" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flags,needle", [
    (["--mem", "lots"], "not a memory size"),
    (["--mem", "0GB"], "larger than zero"),
    (["--mem=-5GB"], "not a memory size"),
    (["--world-size", "4"], "required: --mem"),
    (["--mem", "80GB", "--world-size", "12"], "multiple of --gpus-per-node"),
    (["--mem", "80GB", "--gpu", "tpu9"], "unknown --gpu"),
])
def test_bad_input_exits_2_without_traceback(tmp_path, capsys, flags, needle):
    code = main([LLAMA, "--model-arg", "size=tiny", "--plan", str(tmp_path / "p.yaml"), *flags])
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_existing_plan_file_untouched_when_planning_fails(tmp_path):
    target = tmp_path / "p.yaml"
    target.write_text("keep me\n")
    assert main([LLAMA, "--model-arg", "size=tiny", "--mem", "100kB", "--plan", str(target)]) == 3
    assert target.read_text() == "keep me\n"


def test_tied_embeddings_share_one_unit(tmp_path):
    path = plan_for(tmp_path, GPT2, "--model-arg", "size=tiny", "--seq-len", "64", "--mem", "4MB",
                    "--world-size", "4")
    plan = yaml.safe_load(open(path))
    owners = [u["modules"] for u in plan["units"] if "wte" in u["modules"] or "lm_head" in u["modules"]]
    # both tied modules are listed in the same unit, or both left to the root
    assert all(("wte" in m) == ("lm_head" in m) for m in owners)
