"""The clock's floor with its figures measured in the same process as the steps they predict.

    python benchmarks/floor_in_process.py --hardware HW.yaml [--rounds 3] [--model "deep narrow"]
                                          [--out benchmarks/results/floor_in_process.txt]

On a shared 2-core machine the load moves by 2x within minutes, so a closed loop that
calibrates, then benches minutes later compares two different machines. Here one process on
the fake process group (world 2: the shard sizes of 2 ranks; its collectives cost nothing,
so gloo's load-driven latency is out of it) builds the three closed-loop plans of a model
(benchmarks/closed_loop.py: root only, one unit per block, and checkpointed) and, each round,
measures the host figures the floor uses (``op_overhead_s`` by calibrate's tiny-layer chain;
``unit_overhead_s``, ``param_overhead_s`` and ``checkpoint_overhead_s`` by calibrate's fake
process group probe; AdamW's seconds per DTensor parameter on that probe's units), then
times each plan's steps, and predicts them from ``--hardware`` (a calibrated file: its matmul,
memory and per-byte figures) with this round's host figures and free collectives. What it
checks is the model of the host's time ([Note: the host floor] in cost/streams.py), not the
collectives' fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from closed_loop import MODELS, SHORT_STEP, plans_for
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_plan.api import predict
from fsdp_plan.cost.hardware import hardware_for, read_hardware_file
from fsdp_plan.measure import runtime
from fsdp_plan.measure.calibrate import _op_overhead, _timed, fsdp_host_figures
from fsdp_plan.model.load import load_model


def adamw_per_tensor() -> float:
    """AdamW's seconds per parameter tensor of tiny FSDP2 units (calibrate's figure)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(16)])
    for layer in net:
        fully_shard(layer)
    fully_shard(net)
    net(torch.randn(4, 8)).sum().backward()
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    return _timed(opt.step, lambda: None, 3, inner=4) / len(params)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", default="deep narrow")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as bench workers run
    base = hardware_for("h100", read_hardware_file(args.hardware))
    source = {**MODELS, **SHORT_STEP}[args.model]
    plans, facts = plans_for(source, base, 2)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    mesh = runtime.make_mesh("cpu", 1, 2)
    loaded = load_model(source)
    inputs = loaded.make_inputs(source.batch_size, source.seq_len)
    workers = {}
    for name, plan in plans.items():
        policy = runtime.load_policy(runtime.policy_source(plan))
        model = policy.apply_fully_shard(runtime.build_real_model(loaded, torch.device("cpu")),
                                         mesh)
        workers[name] = (model, runtime.make_optimizer("adamw", model.parameters()), policy)

    def steps(model, optimizer, policy, n: int) -> float:
        times = []
        for _ in range(n):
            started = time.perf_counter()
            runtime.micro_batches(model, loaded, inputs, policy)
            runtime.finish_step(model, optimizer)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    for worker in workers.values():
        steps(*worker, 2)  # warm-up: optimizer states, allocator
    free = {kind: {g: {"latency_s": 0.0, "bus_bandwidth": 1e15} for g in fits}
            for kind, fits in base.collectives.items()}
    lines: list[str] = [(f"{args.model}, {args.steps} steps per plan per round, fake process "
                         f"group world 2, one thread; base figures: {base.source}")]
    errors: dict[str, list[float]] = {name: [] for name in plans}
    for r in range(1, args.rounds + 1):
        op, _ = _op_overhead(torch.device("cpu"), lambda: None, 3)
        host = fsdp_host_figures(3)
        per_tensor = adamw_per_tensor()
        hw = dataclasses.replace(
            base, op_overhead_s=op, collectives=free, collective_latency_s=0.0,
            optimizer_s_per_tensor={**base.optimizer_s_per_tensor, "adamw": per_tensor}, **host)
        lines.append(f"round {r} (load {os.getloadavg()[0]:.1f}): op {op * 1e6:.1f} us, unit "
                     f"{host['unit_overhead_s'] * 1e3:.2f} ms, parameter "
                     f"{host['param_overhead_s'] * 1e6:.1f} us per pass, checkpoint "
                     f"{host['checkpoint_overhead_s'] * 1e3:.2f} ms per block, AdamW "
                     f"{per_tensor * 1e6:.0f} us per tensor")
        for name, worker in workers.items():
            measured = steps(*worker, args.steps)
            with_all = predict(plans[name], facts, hardware=hw, gpus_per_node=2)
            without = predict(plans[name], facts, gpus_per_node=2, hardware=dataclasses.replace(
                hw, param_overhead_s=0.0, checkpoint_overhead_s=0.0))
            err = with_all.candidate.time.step_s / measured - 1
            errors[name].append(err)
            lines.append(f"  {name:15s} measured {measured * 1e3:7.1f} ms, predicted "
                         f"{with_all.candidate.time.step_s * 1e3:7.1f} ms ({err:+6.1%}); "
                         f"without the per-parameter and checkpoint figures "
                         f"{without.candidate.time.step_s / measured - 1:+6.1%}")
        print("\n".join(lines[-4:]), flush=True)
    for name, errs in errors.items():
        lines.append(f"{name:15s} median {statistics.median(errs):+6.1%}, rounds "
                     f"{', '.join(f'{e:+.1%}' for e in errs)}")
    print("\n".join(lines[-len(errors):]))
    dist.destroy_process_group()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
