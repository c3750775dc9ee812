"""Benchmark a plan on real workers: collectives, step time, peak memory and exposed communication.

    fsdp-plan bench PLAN.yaml [MODEL] [--nproc N] [--steps 20] [--warmup 3] [--fsdp1]
                    [--compare OLD.json] [--threshold 0.10] [--timeout S] [--out benchmarks/results]
                    [--baseline no-overlap]

Launches ``--nproc`` local workers (gloo on CPU, NCCL on GPUs); across machines run the same
worker under torchrun (``python -m fsdp_plan.cli.bench_worker``, cli/bench_worker.py). Exit 0 when the counts match
the plan (and ``--compare`` found no regression), 1 otherwise or when a worker crashed or hung,
2 for bad input (every input is checked before a worker starts; ``fsdp_plan.bench.inputs``).
Each run writes one JSON result and a profiler trace under ``--out``, created only then.
SIGTERM, SIGHUP and Ctrl-C end the workers and remove the temporary folders; the exit code
is then 128 + the signal (143, 129, 130).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

import torch

from fsdp_plan.bench import session
from fsdp_plan.bench.inputs import BenchRequest, check_nproc, check_timeout
from fsdp_plan.bench.results import DEFAULT_RESULTS_DIR
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.progress import Steps
from fsdp_plan.measure.launch import (
    Terminated,
    WorkersFailed,
    launch,
    stop_on_signals,
)
from fsdp_plan.pictures import files as pictures
from fsdp_plan.plan.document import read_plan


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of one benchmark run, wherever it is launched from (``fsdp-plan bench`` and
    the torchrun worker entry, cli/bench_worker.py)."""
    parser.add_argument("plan", metavar="PLAN.yaml", help="a plan written by fsdp-plan --plan")
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None,
                        help="the model file (default: the source recorded in the plan)")
    parser.add_argument("--steps", type=int, default=20, help="timed steady steps, 1 to 100000 (default 20)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="warm-up steps skipped before measuring, 0 to 10000 (default 3)")
    parser.add_argument("--fsdp1", action="store_true",
                        help="apply the plan with FSDP1 FullyShardedDataParallel(auto_wrap_policy=...) "
                             "instead of FSDP2 fully_shard")
    parser.add_argument("--out", default=DEFAULT_RESULTS_DIR,
                        help=f"folder for the result JSON and trace (default {DEFAULT_RESULTS_DIR})")
    parser.add_argument("--compare", metavar="OLD.json", default=None,
                        help="a previous result: print both side by side, exit 1 on a regression")
    parser.add_argument("--threshold", type=float, default=0.10,
                        help="relative step-time / peak-memory regression that fails --compare "
                             "(default 0.10 = 10%%)")
    parser.add_argument("--predicted-trace", metavar="TRACE.json", default=None,
                        help="the planner's --trace output: also write one Perfetto trace with "
                             "the predicted and the measured step side by side")
    parser.add_argument("--refit", metavar="HW.yaml", default=None,
                        help="after the run, rewrite this hardware file (or write it from the "
                             "plan's GPU preset) so predictions match what was measured "
                             "(fsdp_plan/bench/refit.py); plan with --hardware HW.yaml next")
    parser.add_argument("--baseline", metavar="no-overlap", default=None,
                        help="also profile the plan with communication held until backward "
                             "compute is done, and report what overlap saves or costs")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    pictures.add_arguments(parser, measured=True)


def bench_request(args: argparse.Namespace) -> BenchRequest:
    """The run ``add_run_arguments``' options ask for (its numbers checked: ``BadInput``)."""
    return BenchRequest(plan_path=args.plan, model_path=args.model, steps=args.steps,
                        warmup=args.warmup, fsdp_version=1 if args.fsdp1 else 2, out=args.out,
                        threshold=args.threshold, format=args.format, compare=args.compare,
                        predicted_trace=args.predicted_trace, refit=args.refit,
                        html=args.html, memory_snapshot=args.memory_snapshot,
                        baseline=args.baseline)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)
    parser.add_argument("--nproc", type=int, default=None,
                        help="local worker processes (default: the plan's world size; at most "
                             "one per GPU, or 4 per CPU core and at least 8)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds (positive, finite) a worker may go without progress before "
                             "it counts as hung (default 300; importing torch at start-up may "
                             "take up to max(S, 180))")


def default_nproc(world_size: int) -> int:
    """The plan's world size, if this machine can run that many ranks."""
    if torch.cuda.is_available():
        if world_size > torch.cuda.device_count():
            raise BadInput(f"the plan is for {world_size} GPUs and this machine has "
                           f"{torch.cuda.device_count()}; pass --nproc (or run the worker under "
                           "torchrun across machines).")
        return world_size
    limit = max(4, 2 * (os.cpu_count() or 1))
    if world_size > limit:
        raise BadInput(f"the plan is for {world_size} ranks; running that many CPU workers here "
                       f"would take long. Pass --nproc 2 or 4 (counts per rank do not depend on "
                       "the world size).")
    return world_size


class _Progress:
    """The workers' progress as one bar on stderr (common/progress.py ``Steps``; nothing under
    ``--format json``): workers started, then rank 0's steps (warm-up, count, timed, profile)."""

    def __init__(self, total_ranks: int, quiet: bool) -> None:
        self.total_ranks = total_ranks
        self.quiet = quiet
        self.started: set[int] = set()
        self.bar: Steps | None = None

    def __call__(self, rank: int, progress: dict[str, Any]) -> None:
        # any report says the rank started: one forked from the fork server may be past its
        # "started" before the first poll (measure/launch.py [Note: starting workers])
        if rank not in self.started:
            self.started.add(rank)
            if len(self.started) == self.total_ranks and not self.quiet:
                print(f"bench: {self.total_ranks} worker(s) started", file=sys.stderr,
                      flush=True)
        if progress.get("phase") == "started":
            return
        if rank == 0 and "step" in progress:
            if self.bar is None:
                self.bar = Steps(total=int(progress["steps"]), quiet=self.quiet, what="bench")
            self.bar.step(f"step {progress['step']}/{progress['steps']} ({progress['phase']})",
                          to=int(progress["step"]) - 1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    """Check every input, launch the workers, write the result; SIGTERM/SIGHUP (like Ctrl-C)
    end the workers and remove the temporaries before exiting with 128 + the signal."""
    prepared = None
    try:
        with stop_on_signals():
            check_timeout(args.timeout)
            request = bench_request(args)
            if args.nproc is not None:
                check_nproc(args.nproc)
                nproc = args.nproc
            else:
                nproc = default_nproc(read_plan(args.plan).world_size)
            prepared = session.prepare(request, nproc=nproc)
            shown = _Progress(nproc, quiet=args.format == "json")
            try:
                results = launch("fsdp_plan.bench.worker:bench_rank", prepared.payload,
                                 nproc=nproc, timeout_s=args.timeout, on_progress=shown)
            except WorkersFailed as e:
                if getattr(args, "debug", False) and e.failures:
                    sys.stderr.write(e.failures[0].detail + "\n")
                raise
            finally:
                shown.close()
            return session.finish(prepared, results[0]["ranks"])
    except Terminated as e:
        sys.stderr.write(f"fsdp-plan bench: {e}; the workers were ended and the temporary "
                         "files removed.\n")
        return e.exit_code
    finally:
        if prepared is not None:
            shutil.rmtree(prepared.payload["trace_dir"], ignore_errors=True)

