"""One ``fsdp-plan bench`` rank under torchrun, on any number of machines::

    torchrun --nnodes 2 --nproc-per-node 8 ... -m fsdp_plan.cli.bench_worker PLAN.yaml [MODEL] \\
        [--steps 20] [--warmup 3] [--fsdp1] [--out benchmarks/results]

The options are ``fsdp-plan bench``'s run options (cli/bench.py ``add_run_arguments``); the
rank itself is the library's (bench/worker.py ``bench_rank``), and rank 0 writes the result
as ``fsdp-plan bench`` does. This entry lives on the command line's floor so that the library
never imports the command line (tests/test_architecture.py).
"""

from __future__ import annotations

import argparse
import shutil
import sys

from fsdp_plan.bench import session
from fsdp_plan.bench.worker import bench_rank
from fsdp_plan.cli.bench import add_run_arguments, bench_request
from fsdp_plan.cli.process import end_process
from fsdp_plan.common.errors import BadInput, FsdpPlanError
from fsdp_plan.measure.launch import Terminated, context_from_env, stop_on_signals

PROG = "python -m fsdp_plan.cli.bench_worker"


def main(argv: list[str] | None = None) -> int:
    """One rank under torchrun, with the run's options; rank 0 writes the result. Errors are
    one paragraph on stderr and their exit code."""
    parser = argparse.ArgumentParser(prog=PROG,
                                     description="One fsdp-plan benchmark rank (under torchrun).")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    try:  # before anything else: a broken environment would fail or hang later
        ctx = context_from_env()
    except BadInput as e:
        sys.stderr.write(f"{PROG}: {e}\n")
        return e.exit_code
    prepared = None
    try:
        with stop_on_signals():  # torchrun ends its workers with SIGTERM
            prepared = session.prepare(bench_request(args), nproc=ctx.world_size)
            per_rank = bench_rank(ctx, prepared.payload)
            if ctx.rank != 0:
                return 0
            return session.finish(prepared, per_rank["ranks"])
    except FsdpPlanError as e:
        sys.stderr.write(f"fsdp-plan bench (rank {ctx.rank}): {e}\n")
        return e.exit_code
    except Terminated as e:
        sys.stderr.write(f"fsdp-plan bench (rank {ctx.rank}): {e}.\n")
        return e.exit_code
    finally:
        if prepared is not None:
            shutil.rmtree(prepared.payload["trace_dir"], ignore_errors=True)


if __name__ == "__main__":
    # os._exit after atexit and a flush ([Note: ending the process] in cli/process.py): the
    # process groups bench_rank kept are never destructed at interpreter exit, where a gloo
    # run loop freeing the last work's tensors would wait for the GIL ([Note: ending a
    # worker's process group] in measure/worker_setup.py)
    end_process(main())
