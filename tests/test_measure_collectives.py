"""Collective counts on real gloo workers, against counts derived by reasoning about FSDP.

Tiny Llama, 4 blocks + root, one unit each (root last). Per steady forward + backward:
- forward: every unit all-gathers once -> 5;
- backward: units with reshard_after_forward=True all-gather again (4 blocks; the root kept
  its parameters) -> 4 more; every unit reduce-scatters its gradients once -> 5;
- HSDP (replicate > 1) adds one all-reduce per unit across replicas -> 5;
- a shard group of 1 (HSDP 2x1) has nothing to gather or scatter: only the 5 all-reduces.
FSDP1 issues the same numbers (list-form ``allgather_``): its root does not reshard after
forward either.

examples/mixed.py runs ``shared_proj`` twice per forward; a unit with no parameters (a GELU)
issues nothing. With units [GELU, shared_proj, branches.narrow, root(no reshard)]:
forward 1 + 2 (shared_proj's two uses, resharded in between) + 1 = 4 all-gathers; backward
2 (shared_proj's two uses) + 1 = 3; one reduce-scatter per unit with parameters = 3.
With shared_proj not resharding after forward: forward 1 + 1, and still 1 in backward (its
post-backward after the second use reshards, the first use gathers again); 2 reduce-scatters.
"""

from __future__ import annotations

import pytest
from test_measure_helpers import MIXED, tiny_llama_plan

from fsdp_plan.measure import collectives
from fsdp_plan.measure.runtime import source_from_plan
from fsdp_plan.plan.document import Mesh, Plan, Unit

pytestmark = pytest.mark.slow


def counts(ag: int, rs: int, ar: int) -> dict[str, int]:
    return {"all_gather": ag, "reduce_scatter": rs, "all_reduce": ar}


def _job(plan, fsdp_version=2):
    return {"plan": plan.to_dict(), "fsdp_version": fsdp_version,
            "mesh": (plan.mesh.replicate, plan.mesh.shard)}


def _mixed_job(units):
    plan = Plan(model={"source": MIXED, "entry": "build_model", "args": {"size": "tiny"},
                       "batch_size": 2, "seq_len": 16, "kind": "file"},
                budget_bytes=10**9, world_size=2, mesh=Mesh(replicate=1, shard=2), units=units)
    return {**_job(plan), "source": source_from_plan(plan)}


def test_counts_on_two_ranks_fsdp2_fsdp1_and_shard_size_one():
    jobs = {
        "fsdp2": (_job(tiny_llama_plan(world=2)), counts(9, 5, 0)),
        "fsdp2 no reshard": (_job(tiny_llama_plan(world=2, block_reshard=False)), counts(5, 5, 0)),
        "fsdp2 root reshards": (_job(tiny_llama_plan(world=2, root_reshard=True)), counts(10, 5, 0)),
        "fsdp1": (_job(tiny_llama_plan(world=2), fsdp_version=1), counts(9, 5, 0)),
        "hsdp 2x1": (_job(tiny_llama_plan(world=2, replicate=2)), counts(0, 0, 5)),
        "mixed, reused module": (_mixed_job([
            Unit(modules=["branches.wide.1"]), Unit(modules=["shared_proj"]),
            Unit(modules=["branches.narrow"]), Unit(modules=[""], reshard_after_forward=False)]),
            counts(7, 3, 0)),
        "mixed, reused module kept": (_mixed_job([
            Unit(modules=["shared_proj"], reshard_after_forward=False),
            Unit(modules=[""], reshard_after_forward=False)]), counts(3, 2, 0)),
    }
    source = source_from_plan(tiny_llama_plan(world=2))
    measured = collectives.count_collectives_many(source, [j for j, _ in jobs.values()], nproc=2,
                                                  timeout_s=120)
    for (name, (_, expected)), ranks in zip(jobs.items(), measured):
        assert ranks[0] == ranks[1], name
        assert ranks[0] == expected, name


def test_counts_on_four_ranks_fsdp2_and_hsdp_2x2():
    source = source_from_plan(tiny_llama_plan(world=4))
    fsdp, hsdp = collectives.count_collectives_many(
        source, [_job(tiny_llama_plan(world=4)), _job(tiny_llama_plan(world=4, replicate=2))],
        nproc=4, timeout_s=180)
    assert all(rank == counts(9, 5, 0) for rank in fsdp)
    assert all(rank == counts(9, 5, 5) for rank in hsdp)


def test_count_collectives_defaults_to_a_flat_mesh_and_rejects_disagreeing_ranks(monkeypatch):
    plan = tiny_llama_plan(world=2)
    with pytest.raises(ValueError, match="does not have 4 ranks"):
        collectives.count_collectives_many(source_from_plan(plan), [{"plan": plan.to_dict(),
                                                                     "mesh": (1, 2)}], nproc=4)
    seen = {}

    def fake_many(source, jobs, *, nproc, timeout_s):
        seen.update(jobs[0], nproc=nproc)
        return [[counts(9, 5, 0), counts(9, 5, 1)]]

    monkeypatch.setattr(collectives, "count_collectives_many", fake_many)
    with pytest.raises(ValueError, match="different collectives"):
        collectives.count_collectives(source_from_plan(plan), plan.to_dict(), nproc=2)
    assert seen["mesh"] == (1, 2) and seen["fsdp_version"] == 2
