"""The clock's floor (issue 18 item 5, [Note: the host floor] in cost/streams.py): the host
issues the device's work, and the device never runs ahead of it. Fixture-level, no torch, no
wall clock: hand-built units, and the tiny Llama fixture given op counters."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from layouts import evaluate as evaluate_layout

from fsdp_plan.cost.ddp_buckets import Bucket, ddp_step_time, event_times
from fsdp_plan.cost.hardware import Hardware, hardware_for
from fsdp_plan.cost.precision import Precision
from fsdp_plan.cost.step_time import Rates, UnitCost, issue_time, pass_time, simulate_step
from fsdp_plan.facts.types import Event, ModelFacts
from fsdp_plan.plan.report import ascii_timeline
from fsdp_plan.search.candidate import SearchSettings
from fsdp_plan.search.evaluator import Evaluator

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_llama_facts.json"
US = 1e-6


def gpu(**fields) -> Hardware:
    """A host that runs ahead of the device (``async_launch``), no contention unless given."""
    return dataclasses.replace(hardware_for("h100"), **{"contention": 0.0, **fields})


# --- the clock, by hand --------------------------------------------------------------------

def test_many_small_units_take_what_the_host_needs_to_issue_them():
    """Ten units whose device work is 1 us (forward) and 2 us (backward) but whose ops take the
    host 10 us and 20 us to issue: the device waits for the host at every unit, so the step is
    exactly the host's time, never the device's 30 us."""
    units = [UnitCost(key=f"u{i}", fw_compute_s=1 * US, bw_compute_s=2 * US, all_gather_s=0.0,
                      reduce_scatter_s=0.0, fw_host_s=10 * US, bw_host_s=20 * US)
             for i in range(10)]
    t = simulate_step(units, gpu(), optimizer_s=5 * US)
    assert t.step_s == pytest.approx(10 * (10 + 20) * US + 5 * US, rel=1e-12)
    assert t.host_wait_s == pytest.approx(10 * (10 - 1 + 20 - 2) * US, rel=1e-12)
    assert t.compute_s == pytest.approx(t.forward_s + t.backward_s + t.host_wait_s, rel=1e-12)
    assert t.exposed_comm_s == 0.0
    host = [(s, e) for lane, _, s, e in t.spans if lane == "host"]
    assert len(host) == 20 and host[-1][1] == pytest.approx(300 * US)
    assert "host    |" in ascii_timeline(t)


def test_the_host_runs_ahead_and_a_slow_unit_absorbs_its_lag():
    """Host 10 us per unit, device 1 us for three units then 100 us: the device waits for the
    host through the small units (30 us), then the host, already done, waits for nothing:
    the large unit ends 100 us after it starts, not after its host time."""
    sizes = [1, 1, 1, 100]
    units = [UnitCost(key=f"u{i}", fw_compute_s=d * US, bw_compute_s=0.0, all_gather_s=0.0,
                      reduce_scatter_s=0.0, fw_host_s=10 * US) for i, d in enumerate(sizes)]
    t = simulate_step(units, gpu())
    forward_end = max(e for lane, label, _, e in t.spans if lane == "compute"
                      and label.startswith("FW"))
    assert forward_end == pytest.approx(30 * US + 100 * US, rel=1e-12)
    assert t.host_wait_s == pytest.approx(3 * 9 * US, rel=1e-12)


def test_large_op_units_are_unchanged():
    """Device work far above the host's issue time: the step is the one without a host
    timeline, to the last bit, and nothing waits for the host."""
    units = [UnitCost(key=f"u{i}", fw_compute_s=1e-3, bw_compute_s=2e-3, all_gather_s=4e-4,
                      reduce_scatter_s=5e-4, fw_host_s=50 * US, bw_host_s=90 * US)
             for i in range(8)]
    bare = [dataclasses.replace(u, fw_host_s=0.0, bw_host_s=0.0) for u in units]
    hw = gpu(contention=0.1)
    for fwp, bwp in ((0, 1), (1, 2)):
        with_host = simulate_step(units, hw, forward_prefetch=fwp, backward_prefetch=bwp,
                                  optimizer_s=1e-3)
        without = simulate_step(bare, hw, forward_prefetch=fwp, backward_prefetch=bwp,
                                optimizer_s=1e-3)
        assert with_host.step_s == without.step_s
        assert with_host.exposed_comm_s == without.exposed_comm_s
        assert with_host.host_wait_s == 0.0


def test_a_cpu_issues_in_line_and_has_no_host_timeline():
    """``async_launch: false``: the per-op and per-unit costs are device time, as before."""
    cpu = dataclasses.replace(gpu(), async_launch=False, op_overhead_s=10 * US,
                              unit_overhead_s=100 * US)
    rates = Rates.of(cpu)
    ops = {"ops": 50.0, "memory_bytes": 1.0}
    assert issue_time(rates, ops, units=1) == 0.0
    device, host = pass_time(rates, ops, 0.0)
    assert host == 0.0
    assert device == pytest.approx(50 * 10 * US + 1.0 / rates.memory + 100 * US, rel=1e-12)
    on_gpu = Rates.of(dataclasses.replace(cpu, async_launch=True))
    assert pass_time(on_gpu, ops, 0.0) == pytest.approx((50 * 10 * US, 50 * 10 * US + 100 * US))


def test_ddp_backward_never_runs_ahead_of_the_host():
    """DDP on the same clock: events whose device time is nothing still take the host its
    ops' issue time, forward and backward, and a bucket becomes ready only once the host
    issued the ops before it."""
    hw = gpu(op_overhead_s=10 * US)
    kinds = ["pre_fw", "post_fw", "pre_bw", "post_bw", "pre_bw", "post_bw"]
    events = [Event(kind=k, module="m", level=0, peak=0, flops=0.0,
                    ops={"ops": 3.0} if i else None) for i, k in enumerate(kinds)]
    times = [0.0] * len(events)
    buckets = [Bucket(params=[0], nbytes=1 << 20, ready_event=3)]
    step, ready = ddp_step_time(buckets, events, hw, world_size=2, gpus_per_node=8,
                                optimizer_s=0.0, times=times)
    assert step.host_wait_s == pytest.approx(5 * 3 * 10 * US, rel=1e-12)
    assert ready == [pytest.approx(3 * 3 * 10 * US, rel=1e-12)]
    assert step.step_s >= 5 * 3 * 10 * US
    # with the events' own times (max(work, overhead) per event) the host is never behind
    real = event_times(events, hw, "bfloat16")
    step, _ = ddp_step_time(buckets, events, hw, world_size=2, gpus_per_node=8,
                            optimizer_s=0.0, times=real)
    assert step.host_wait_s == 0.0


# --- the evaluator on the tiny Llama fixture, given op counters ------------------------------

@pytest.fixture(scope="module")
def llama() -> ModelFacts:
    return ModelFacts.from_json(FIXTURE.read_text())


def with_ops(facts: ModelFacts, ops: float, memory_bytes: float) -> ModelFacts:
    """The fixture (written before op counters) with every module's own forward and backward
    ops given as ``ops`` memory-bound ops moving ``memory_bytes`` in all, and the same between
    any two boundaries of each analysed pass (so a checkpointed block's replay has ops)."""
    out = ModelFacts.from_json(facts.to_json())
    for comp in out.analysis.modules.values():
        comp.own_fw_ops = {"ops": ops, "memory_bytes": memory_bytes}
        comp.own_bw_ops = {"ops": 2 * ops, "memory_bytes": 2 * memory_bytes}
    for timeline in (out.analysis.timeline, out.analysis.checkpointed_timeline,
                     out.analysis.selective_timeline):
        for event in timeline.events if timeline else []:
            event.ops = {"ops": ops, "memory_bytes": memory_bytes}
    return out


def step(facts: ModelFacts, hw: Hardware, per_block: bool = True, k: int = 0):
    ev = Evaluator(facts.graph, facts.analysis, SearchSettings(
        budget_bytes=80 * 10**9, headroom_bytes=0, world_size=8, gpus_per_node=8,
        precision=Precision(orig_bytes=4, param_bytes=2, reduce_bytes=4), optimizer="adamw",
        hardware=hw))
    groups = [[b] for b in facts.graph.blocks] if per_block else []
    cand = evaluate_layout(ev, name="x", strategy="full", replicate=1, shard=8, groups=groups,
                           reshard=[True] * len(groups), root_reshard=False, k=k)
    return cand


def test_a_step_of_small_ops_is_never_below_what_the_host_needs(llama):
    """Every module's ops tiny (a byte each): whatever the layout and checkpointing, the
    predicted step is at least all ops x per-op dispatch plus units x 2 passes x FSDP's
    per-unit host cost, and the device waited for the host to get there."""
    small = with_ops(llama, ops=7, memory_bytes=7.0)
    hw = gpu(op_overhead_s=10 * US, unit_overhead_s=150 * US)
    total_ops = sum(sum(c.own_fw_ops.values()) - c.own_fw_ops["memory_bytes"]
                    + c.own_bw_ops["ops"] for c in small.analysis.modules.values())
    for per_block, k in ((True, 0), (False, 0), (True, len(small.graph.blocks))):
        cand = step(small, hw, per_block, k)
        units = len(cand.units)
        floor = total_ops * hw.op_overhead_s + units * 2 * hw.unit_overhead_s
        assert cand.time.step_s >= floor, (per_block, k)
        assert cand.time.host_wait_s > 0
        if k:  # the checkpointed blocks' replayed ops are issued again
            assert cand.time.step_s > step(small, hw, per_block, 0).time.step_s
    # FSDP's per-unit host cost lands on the host, not on the device: the device's own work
    # is the same without it, and the step grows by at most units x 2 x that cost (less
    # where the host's lead over the device, built while the device waited for all-gathers,
    # hid some of it)
    bare = step(small, dataclasses.replace(hw, unit_overhead_s=0.0))
    cand = step(small, hw)
    assert (cand.time.forward_s, cand.time.backward_s) == (bare.time.forward_s,
                                                           bare.time.backward_s)
    grown = cand.time.step_s - bare.time.step_s
    assert 0.5 * len(cand.units) * 2 * hw.unit_overhead_s < grown
    assert grown <= len(cand.units) * 2 * hw.unit_overhead_s * (1 + 1e-9)


def test_a_step_of_large_ops_is_unchanged_by_the_floor(llama):
    """Each module's ops move a gigabyte: the per-unit host cost (150 us) hides behind the
    device entirely, so the step equals the step without it, bit for bit."""
    large = with_ops(llama, ops=7, memory_bytes=1e9)
    hw = gpu(op_overhead_s=10 * US, unit_overhead_s=150 * US)
    for per_block, k in ((True, 0), (False, 0), (True, 2)):
        cand = step(large, hw, per_block, k)
        bare = step(large, dataclasses.replace(hw, unit_overhead_s=0.0), per_block, k)
        assert cand.time.step_s == bare.time.step_s
        assert cand.time.host_wait_s == 0.0


def test_on_a_cpu_each_parameter_and_checkpointed_block_costs_its_host_time(llama):
    """``async_launch: false`` (calibrate on a CPU): FSDP's per-parameter cost is paid in
    line, twice per parameter tensor (forward and backward), and each checkpointed block's
    wrapper once per step, on top of the ops it replays: the step grows by exactly that."""
    small = with_ops(llama, ops=7, memory_bytes=7.0)
    cpu = dataclasses.replace(gpu(), async_launch=False, op_overhead_s=10 * US,
                              unit_overhead_s=150 * US, comm_overlaps_compute=False,
                              param_overhead_s=0.0, checkpoint_overhead_s=0.0)
    params = sum(len(m.param_shapes) for m in small.graph.modules.values())
    blocks = len(small.graph.blocks)
    for per_block in (True, False):
        bare = step(small, cpu, per_block).time.step_s
        priced = step(small, dataclasses.replace(cpu, param_overhead_s=3 * US), per_block)
        assert priced.time.step_s == pytest.approx(bare + 2 * params * 3 * US, rel=1e-9)
    replayed = step(small, cpu, True, blocks).time.step_s
    wrapped = step(small, dataclasses.replace(cpu, checkpoint_overhead_s=500 * US), True, blocks)
    assert wrapped.time.step_s == pytest.approx(replayed + blocks * 500 * US, rel=1e-9)
    # on a GPU both are the host's: a step of tiny ops waits for them
    on_gpu = dataclasses.replace(cpu, async_launch=True, comm_overlaps_compute=True)
    floored = step(small, dataclasses.replace(on_gpu, param_overhead_s=3 * US), True)
    assert floored.time.step_s > step(small, on_gpu, True).time.step_s
