"""Plans and runners shared by the measurement tests, and the fast tests of small rules.

The plans are written by hand (per-block units, root last) so the measurement tests do not
depend on the planner; the policy module is the one ``fsdp_plan.plan.emit`` renders, which is
what users import and what ``verify``/``bench`` apply.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from fsdp_plan.bench.session import run_mesh
from fsdp_plan.common.errors import BadInput
from fsdp_plan.measure.collectives import normalise_counts
from fsdp_plan.plan.document import Mesh, Plan, Unit, write_plan

ROOT = Path(__file__).resolve().parent.parent
LLAMA = str(ROOT / "examples" / "llama.py")
MIXED = str(ROOT / "examples" / "mixed.py")


def tiny_llama_plan(*, world: int = 2, replicate: int = 1, n_layers: int = 4,
                    root_reshard: bool = False, block_reshard: bool = True,
                    optimizer: str = "adamw", batch_size: int = 2, seq_len: int = 32,
                    mixed_precision: dict | None = None, ac: list[str] | None = None,
                    predicted: dict | None = None) -> Plan:
    """Tiny Llama, one unit per block and the root last."""
    units = [Unit(modules=[f"layers.{i}"], reshard_after_forward=block_reshard)
             for i in range(n_layers)]
    units.append(Unit(modules=[""], reshard_after_forward=root_reshard))
    return Plan(model={"source": LLAMA, "entry": "build_model",
                       "args": {"size": "tiny", "n_layers": n_layers}, "batch_size": batch_size,
                       "seq_len": seq_len, "kind": "file"},
                budget_bytes=10**9, world_size=world,
                mesh=Mesh(replicate=replicate, shard=world // replicate),
                strategy="hybrid" if replicate > 1 else "full", units=units,
                optimizer=optimizer, mixed_precision=mixed_precision or {},
                activation_checkpointing=ac or [], predicted=predicted or {})


def plan_file(tmp_path: Path, plan: Plan, name: str = "plan.yaml") -> str:
    path = tmp_path / name
    write_plan(plan, str(path))
    return str(path)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``fsdp-plan ARGV`` in-process: (exit code, stdout, stderr)."""
    from fsdp_plan.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_normalise_counts_folds_every_spelling_and_keeps_surprises():
    raw = {torch.ops.c10d._allgather_base_: 5, torch.ops.c10d.allgather_: 4,
           torch.ops.c10d._reduce_scatter_base_: 5, torch.ops.c10d.allreduce_: 3,
           torch.ops.c10d.broadcast_: 1, torch.ops.c10d.alltoall_: 2}
    # DDP's per-forward buffer broadcast has a name of its own; any other stays visible
    assert normalise_counts(raw) == {"all_gather": 9, "reduce_scatter": 5, "all_reduce": 3,
                                     "broadcast": 1, "c10d.alltoall_": 2}
    assert normalise_counts({}) == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}


def test_run_mesh_keeps_the_plan_mesh_or_shrinks_it():
    assert run_mesh(tiny_llama_plan(world=4, replicate=2), 4)[0] == (2, 2)
    mesh, notes = run_mesh(tiny_llama_plan(world=64), 2)
    assert mesh == (1, 2) and "made for 64" in notes[0]
    assert run_mesh(tiny_llama_plan(world=16, replicate=8), 4)[0] == (2, 2)
    with pytest.raises(BadInput, match="multiple of 2"):
        run_mesh(tiny_llama_plan(world=16, replicate=8), 3)
