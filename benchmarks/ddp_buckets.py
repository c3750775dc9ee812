"""Predicted DDP step time over ``bucket_cap_mb``: the U-shape, and the cap the planner chooses.

    python benchmarks/ddp_buckets.py                         # Llama 1B shape, 8 x H100
    python benchmarks/ddp_buckets.py --size 1b --world-size 8 --gpu h100 --seq-len 4096
    python benchmarks/ddp_buckets.py --hardware HW.yaml      # a calibrated hardware file
    # CPU closed loop: calibrate gloo first, then predicted vs measured on 2 gloo ranks
    fsdp-plan calibrate --nproc 2 -o /tmp/cpu.yaml
    python benchmarks/ddp_buckets.py --model examples/gpt2.py --size small --seq-len 128 \
        --world-size 2 --gpus-per-node 2 --param-dtype float32 --hardware /tmp/cpu.yaml \
        --gpu h100 --measure-steps 5

Small buckets start their all-reduces early but pay launch and latency per bucket; large ones
start late and leave a tail after backward. For each cap (first bucket as large) the script
prints the bucket count, the step time, the communication tail and the compute slowdown from
overlap, then the cap ``--strategy ddp`` chooses (over ``fsdp_plan.search.ddp.CAP_GRID_MB``, first
bucket as large or 1 MiB) and checks that it is at the curve's minimum. The model is analysed
once (fake tensors, three blocks analysed and repeated); the sweep is pure arithmetic.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP_MB = (1, 5, 25, 100, 400)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(ROOT, "examples", "llama.py"))
    parser.add_argument("--size", default="1b")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--hardware", default=None)
    parser.add_argument("--reduce-dtype", default="float32")
    parser.add_argument("--param-dtype", default="bfloat16")
    parser.add_argument("--measure-steps", type=int, default=0,
                        help="also run every cap on --world-size gloo ranks and time this many "
                        "steps (CPU closed loop; use a calibrated --hardware file)")
    args = parser.parse_args(argv)

    from fsdp_plan.api import PlanRequest, analyze_model
    from fsdp_plan.cost.ddp_buckets import MIB
    from fsdp_plan.cost.hardware import hardware_for, read_hardware_file
    from fsdp_plan.model.source import ModelSource
    from fsdp_plan.search.ddp import best_config, config_options, ddp_layout, label, sweep
    from fsdp_plan.search.evaluator import Evaluator
    started = time.perf_counter()
    source = ModelSource(source=args.model, args={"size": args.size}, batch_size=args.batch_size,
                         seq_len=args.seq_len)
    hw = hardware_for(args.gpu, read_hardware_file(args.hardware) if args.hardware else None)
    request = PlanRequest(source=source, budget_bytes=10**12, world_size=args.world_size,
                          gpus_per_node=args.gpus_per_node, strategy="ddp",
                          reduce_dtype=args.reduce_dtype, param_dtype=args.param_dtype,
                          hardware=hw)
    facts = analyze_model(source, param_dtype=request.param_dtype).facts
    settings = request.settings()
    g, a = facts.graph, facts.analysis
    print(f"{args.model} size={args.size}: {g.total_numel / 1e9:.2f}B parameters "
          f"({g.total_param_bytes / 2**30:.1f} GiB of fp32 gradients), batch {args.batch_size} x "
          f"{args.seq_len}, {args.world_size} x {hw.name}; analysed in "
          f"{time.perf_counter() - started:.1f} s")
    ev = Evaluator(g, a, settings)
    curve = sweep(ev, SWEEP_MB)
    chosen = best_config([ev.evaluate(ddp_layout(settings, c), label(c)) for c in config_options(
        g, a, compress=settings.precision.reduce_bytes < 4)])
    print(f"{'bucket_cap_mb':>13} {'buckets':>8} {'step ms':>9} {'tail ms':>8} "
          f"{'contention ms':>14} {'all-reduce ms':>14}")
    for cap, e in zip(SWEEP_MB, curve):
        t = e.time
        print(f"{cap:>13} {len(e.detail.buckets):>8} {t.step_s * 1e3:>9.2f} {t.exposed_comm_s * 1e3:>8.2f} "
              f"{t.contention_s * 1e3:>14.2f} {t.total_comm_s * 1e3:>14.2f}")
    c, t = chosen.detail.config, chosen.time
    print(f"chosen: bucket_cap_mb {c.bucket_cap_mb:g}, first bucket {c.first_bucket_mb:g} MiB: "
          f"{len(chosen.detail.buckets)} buckets (largest {max(b.nbytes for b in chosen.detail.buckets) / MIB:.1f}"
          f" MiB), step {t.step_s * 1e3:.2f} ms, tail {t.exposed_comm_s * 1e3:.2f} ms")
    steps = [e.time.step_s for e in curve]
    low = steps.index(min(steps))
    u_shape = 0 < low < len(steps) - 1 and steps[0] > steps[low] < steps[-1]
    at_min = chosen.time.step_s <= min(steps) + 1e-12
    print(f"U-shape: {'yes' if u_shape else 'no'} (minimum of the sweep at {SWEEP_MB[low]} MB); "
          f"chosen at or below the sweep's minimum: {'yes' if at_min else 'no'}")
    if args.measure_steps:
        return 0 if closed_loop(args, source, curve) else 1
    return 0 if u_shape and at_min else 1


def closed_loop(args: argparse.Namespace, source, curve) -> bool:
    """Measured median step time per cap on gloo ranks beside the prediction; True when the
    measured best cap is within one sweep step of the predicted best."""
    from fsdp_plan.cost.ddp_buckets import ddp_api_kwargs
    from fsdp_plan.measure.ddp import measure_ddp_many
    jobs = [{"source": source, "ddp_kwargs": ddp_api_kwargs(e.detail.config), "optimizer": "adamw",
             "steps": args.measure_steps} for e in curve]
    results = measure_ddp_many(jobs, nproc=args.world_size, timeout_s=1800)
    print(f"{'bucket_cap_mb':>13} {'predicted ms':>13} {'measured ms':>12}  (median over "
          f"{args.measure_steps} steps, slowest rank)")
    measured = []
    for cap, e, ranks in zip(SWEEP_MB, curve, results):
        per_step = [max(r["step_times_s"][i] for r in ranks) for i in range(args.measure_steps)]
        median = sorted(per_step)[len(per_step) // 2]
        measured.append(median)
        print(f"{cap:>13} {e.time.step_s * 1e3:>13.1f} {median * 1e3:>12.1f}")
    predicted_best = min(range(len(curve)), key=lambda i: curve[i].time.step_s)
    measured_best = min(range(len(measured)), key=measured.__getitem__)
    ok = abs(predicted_best - measured_best) <= 1
    print(f"best cap: predicted {SWEEP_MB[predicted_best]} MB, measured "
          f"{SWEEP_MB[measured_best]} MB: {'within' if ok else 'NOT within'} one sweep step")
    return ok


if __name__ == "__main__":
    sys.exit(main())
