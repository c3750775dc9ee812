"""Measure this machine with micro-benchmarks and write a hardware file for --hardware.

    fsdp-plan calibrate [--nproc 2] [--backend gloo|nccl] [--repeat 5] -o HW.yaml

Launches ``--nproc`` local workers (as bench does) that time matmuls, attention, memory-bound
ops, host-to-device copies (GPUs), the optimizer step, collectives over message sizes (fitted
to latency + size / bandwidth), the slowdown of compute under a concurrent collective, and
FSDP's host cost per unit ([Note: calibration] in fsdp_plan/measure/calibrate.py). Writes ``-o`` (a
hardware file, SPEC section 6) only when every worker succeeded; exit 2 for bad input, 1 when
a worker failed or hung.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fsdp_plan.bench.inputs import check_nproc, check_timeout
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.files import atomic_write_all, check_writable
from fsdp_plan.common.progress import Steps
from fsdp_plan.cost.hardware import Hardware, hardware_yaml
from fsdp_plan.measure.launch import Terminated, stop_on_signals

PHASES = ("compute", "collectives", "overlap", "fsdp units")
"""What a calibration worker reports, in order (fsdp_plan/calibrate.py)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", required=True, metavar="HW.yaml",
                        help="the hardware file to write (read back with --hardware HW.yaml)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="worker processes, 1 to the local limit (default: 2 on a CPU, every "
                             "GPU with nccl); collectives are fitted at this group size")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="gloo (CPU workers) or nccl (one worker per GPU); default: nccl "
                             "when CUDA GPUs are present, else gloo")
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed samples per figure, 1 to 100 (median taken; default 5)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a worker may go without progress before it counts as hung")
    parser.add_argument("--format", choices=("table", "json"), default="table")


def _summary(hw: Hardware) -> str:
    lines = [f"calibrated {hw.source}"]
    for dtype, classes in hw.matmul_flops.items():
        shown = ", ".join(f"{c} {v / 1e9:,.1f}" for c, v in classes.items())
        lines.append(f"  matmul {dtype}: {shown} GFLOP/s")
    lines.append("  attention: " + ", ".join(f"{d} {v / 1e9:,.1f} GFLOP/s"
                                             for d, v in hw.attention_flops.items()))
    lines.append(f"  memory-bound ops: {hw.memory_bandwidth / 1e9:,.2f} GB/s; op overhead "
                 f"{hw.op_overhead_s * 1e6:.1f} us; FSDP unit overhead "
                 f"{hw.unit_overhead_s * 1e6:.1f} us per pass and "
                 f"{hw.param_overhead_s * 1e6:.1f} us per parameter tensor and pass; "
                 f"checkpointing {hw.checkpoint_overhead_s * 1e6:.1f} us per block")
    for kind, sizes in hw.fsdp_s_per_byte.items():
        shown = ", ".join(f"{int(b) / 2**20:g} MiB {v * 1e9:.2f}" for b, v in sizes.items())
        lines.append(f"  FSDP around {kind} (ns per byte, by unit size): {shown}")
    lines.append("  host-to-device: " + (f"{hw.h2d_bandwidth / 1e9:.1f} GB/s"
                                         if hw.h2d_bandwidth else "skipped (no device on a CPU)"))
    for kind, groups in hw.collectives.items():
        for g, fit in groups.items():
            lines.append(f"  {kind} x{g}: latency {fit['latency_s'] * 1e6:.0f} us, bus "
                         f"bandwidth {fit['bus_bandwidth'] / 1e9:.2f} GB/s")
    beside = (f"runs, slowed {hw.contention:.0%}" if hw.comm_overlaps_compute
              else "waits (no overlap)")
    lines.append(f"  compute beside a collective: {beside}")
    lines.append("  optimizer: " + ", ".join(
        f"{o} {v * 1e9:.2f} ns/param + {hw.optimizer_s_per_tensor.get(o, 0.0) * 1e6:.0f} us/tensor"
        for o, v in hw.optimizer_s_per_param.items()))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    # calibration imports torch (~6 s): deferred so --help and the flag checks answer at once
    import torch

    from fsdp_plan.measure.calibrate import calibrate
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise BadInput("--backend nccl needs CUDA GPUs and this machine has none; use "
                       "--backend gloo to calibrate the CPU.")
    nproc = args.nproc if args.nproc is not None else (
        torch.cuda.device_count() if backend == "nccl" else 2)
    check_nproc(nproc)
    check_timeout(args.timeout)
    if isinstance(args.repeat, bool) or not 1 <= args.repeat <= 100:
        raise BadInput(f"--repeat {args.repeat} is outside 1..100 (timed samples per figure).")
    if not args.output.endswith((".yaml", ".yml")):
        raise BadInput(f"-o {args.output!r} must name a .yaml file (a hardware file).")
    check_writable(args.output, "-o")
    try:
        with stop_on_signals():
            steps = Steps(total=len(PHASES), quiet=args.format == "json", what="calibrate",
                          unit="phase")

            def show(rank: int, progress: dict[str, Any]) -> None:
                phase = progress.get("phase")
                if rank == 0 and phase not in (None, "started"):
                    steps.step(str(phase), to=PHASES.index(phase) if phase in PHASES else None)
            try:
                hw, raw = calibrate(nproc=nproc, backend=backend, repeat=args.repeat,
                                    timeout_s=args.timeout, on_progress=show)
            finally:
                steps.close()
            notes = sorted({n for r in raw["ranks"] for n in r.get("notes", [])})
            header = "\n".join([
                "Hardware file written by fsdp-plan calibrate (SPEC section 6); read it with",
                "--hardware. Figures are medians over the ranks of what this machine reached.",
                *notes])
            atomic_write_all([(args.output, hardware_yaml(hw, header))])
    except Terminated as e:
        sys.stderr.write(f"fsdp-plan calibrate: {e}; the workers were ended.\n")
        return e.exit_code
    if args.format == "json":
        print(json.dumps({"hardware": hw.to_dict(), "raw": raw}, indent=2, default=str))
    else:
        print(_summary(hw))
    print(f"hardware file written to {args.output}", file=sys.stderr)
    return 0
