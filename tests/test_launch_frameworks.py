"""Each export launched exactly as its README's CPU instructions say (issue 30 acceptance):
``torchrun --nproc_per_node 2 train.py`` on 2 gloo ranks with a tiny Hugging Face Llama
(tests/fixtures/launch_train.py is the ``train.py`` the README describes).

A launch as written passes the export's check, its ranks are fed different samples and the
loss falls over 10 steps; a launch as users get it wrong (accelerate without
``ACCELERATE_USE_CPU``, a configuration-only accelerate run on a CPU, the Trainer without
``use_cpu``, a Lightning model sharded otherwise) is stopped by the check with its message
before the first step. Marked ``frameworks``, ``hf`` (the model is a Hugging Face Llama) and ``slow``: each launch takes 60-90 s here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_measure_helpers import ROOT, plan_file, run_cli

from fsdp_plan.plan.document import Mesh, Plan, Unit

pytestmark = [pytest.mark.frameworks, pytest.mark.hf, pytest.mark.slow]
SCRIPT = str(ROOT / "tests" / "fixtures" / "launch_train.py")


def hf_plan() -> Plan:
    """Each decoder layer a unit, the root last, layer 1 checkpointed: beyond a class list,
    so every framework's export applies it through its hook."""
    units = [Unit(modules=[f"model.layers.{i}"], reshard_after_forward=True) for i in range(2)]
    units.append(Unit(modules=[""], reshard_after_forward=False))
    return Plan(model={"source": str(ROOT / "tests" / "fixtures" / "hf_llama_file.py"),
                       "entry": "build_model", "args": {}, "batch_size": 2, "seq_len": 16,
                       "kind": "file"},
                budget_bytes=10**9, world_size=2, mesh=Mesh(replicate=1, shard=2),
                strategy="full", units=units, optimizer="adamw", mixed_precision={},
                activation_checkpointing=["model.layers.1"], predicted={})


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("launch")
    path = plan_file(folder, hf_plan())
    for framework in ("accelerate", "trainer", "lightning"):
        code, _, err = run_cli(["export", path, "--to", framework, "-o", str(folder / framework)])
        assert code == 0, err
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(exports: Path, framework: str, mode: str, **env: str) -> list[dict]:
    """``torchrun --nproc_per_node 2 train.py`` as the README writes it (the master port comes
    from the environment, so parallel runs on this machine do not collide); each rank's
    record."""
    out = exports / f"out-{framework}-{mode}-{len(env)}"
    out.mkdir()
    environ = {key: value for key, value in os.environ.items() if key != "ACCELERATE_USE_CPU"}
    environ.update(env, PET_MASTER_PORT=str(_free_port()))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", SCRIPT,
               framework, mode, str(exports / framework), str(out)]
    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=500)
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)
               if (out / f"rank{r}.json").exists()]
    assert done.returncode == 0 and len(records) == 2, done.stderr[-3000:]
    return records


def assert_trained(records: list[dict]) -> None:
    for record in records:
        assert record["error"] is None, record["error"]
        losses = record["losses"]
        assert len(losses) == 10 and losses[-1] < losses[0] - 0.5, losses
    fed = [set(record["indices"]) for record in records]
    assert fed[0] and not fed[0] & fed[1], fed  # a distributed sampler split the data
    print(f"losses {records[0]['losses'][0]:.3f} -> {records[0]['losses'][-1]:.3f} (rank 0), "
          f"{records[1]['losses'][0]:.3f} -> {records[1]['losses'][-1]:.3f} (rank 1)")


def assert_stopped(records: list[dict], *words: str) -> None:
    for record in records:
        assert record["error"] is not None, record
        assert record["losses"] == [], record["losses"]  # before the first step
        for word in words:
            assert word in record["error"], record["error"]


def test_accelerate_launches_as_its_readme_says(exports: Path) -> None:
    pytest.importorskip("accelerate")
    assert "ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 train.py" in (
        exports / "accelerate" / "README.md").read_text()
    assert_trained(launch(exports, "accelerate", "hook", ACCELERATE_USE_CPU="true"))
    assert_stopped(launch(exports, "accelerate", "hook"),
                   "accelerate sees a world of 1 process(es) where torch.distributed has 2",
                   "ACCELERATE_USE_CPU=true")
    assert_stopped(launch(exports, "accelerate", "config_only", ACCELERATE_USE_CPU="true"),
                   "none of the plan's 3 FSDP units is applied",
                   "wrapped in DistributedDataParallel instead",
                   "accelerate applies no FSDP on a CPU")


def test_the_trainer_launches_as_its_readme_says(exports: Path) -> None:
    pytest.importorskip("transformers")
    assert_trained(launch(exports, "trainer", "hook"))
    assert_stopped(launch(exports, "trainer", "no_cpu_flag"),
                   "the Trainer sees a world of 1 process(es) where torch.distributed has 2",
                   "use_cpu=True")


def test_lightning_launches_as_its_readme_says(exports: Path) -> None:
    pytest.importorskip("lightning")
    assert_trained(launch(exports, "lightning", "hook"))
    assert_stopped(launch(exports, "lightning", "other_wrap"),
                   "1 planned checkpointed module(s) are not checkpointed: 'model.layers.1'")
