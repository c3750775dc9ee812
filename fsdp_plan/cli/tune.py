"""Tune a plan by measurement: the tuning order, one knob family per stage, keeping what beats
the noise.

    fsdp-plan tune PLAN.yaml [MODEL] [--nproc N] [--budget-minutes 10] [--steps 8]
                   [--warmup 2] [--baseline no-overlap|none] [--allow-lossy-hooks]
                   [--optimizer-overlap] [--out benchmarks/results]

Benches the plan as the baseline with its no-overlap twin (communication held) in the same
launch, for the overlap verdict; then the stages of bench/tune_stages.py [Note: the tuning
order]: topology (a check, no run), buckets, contention, hooks, optimizer overlap, prefetch,
checkpointing, reshard. Each stage's proposals (one knob of its family changed) that fit the
budget are benched, predicted fastest first, on one set of workers with the same seed and
data, between two runs of the best so far; a change is kept only when it beats that by more
than the noise measured on the baseline. Lossy DDP hooks are proposed only with
``--allow-lossy-hooks`` and optimizer overlap only with ``--optimizer-overlap``, the
planner's permissions. Writes the best plan, the rollback plan (the baseline) and a result
JSON with every stage, its reason, its measurements and its outcome, which plan and which
PyTorch produced it, under ``--out``; prints the stages in order. Exit 0 when tuning ran, 2
for bad input, 1 when a worker failed; SIGTERM, SIGHUP and Ctrl-C end the workers and remove
their temporary folders (exit 143, 129, 130).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import time
from typing import Any

from tabulate import tabulate

from fsdp_plan.api import analyze_for_plan, plan_hardware, predict
from fsdp_plan.bench.inputs import check_nproc, check_out_folder
from fsdp_plan.bench.overlap import overlap_figures, report_lines
from fsdp_plan.bench.results import DEFAULT_RESULTS_DIR, plan_hash
from fsdp_plan.bench.tune import HeldBaseline, tune
from fsdp_plan.bench.tune_stages import STAGES, Permissions
from fsdp_plan.cli.cache_flag import add_no_cache, facts_cache_of
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.files import atomic_write_all, check_outputs, write_failed
from fsdp_plan.common.progress import Steps
from fsdp_plan.measure.launch import Terminated, stop_on_signals
from fsdp_plan.pictures import files as pictures
from fsdp_plan.plan.document import Plan, plan_to_yaml, read_plan
from fsdp_plan.plan.read import plan_input_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.yaml", help="the baseline plan")
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None,
                        help="the model file (default: the source recorded in the plan)")
    parser.add_argument("--nproc", type=int, default=2,
                        help="local worker processes, 1 to the local limit (one per GPU, or 4 per "
                        "CPU core and at least 8; default: %(default)s)")
    parser.add_argument("--budget-minutes", type=float, default=10.0,
                        help="stop starting new rounds after this many minutes (default: "
                        "%(default)s)")
    parser.add_argument("--steps", type=int, default=8,
                        help="timed steady steps per plan, 4..1000 (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="warm-up steps per plan, excluded, 1..100 (default: %(default)s)")
    parser.add_argument("--out", default=DEFAULT_RESULTS_DIR,
                        help="folder for the best and rollback plans and the result JSON "
                        "(default: %(default)s)")
    parser.add_argument("--hardware", default=None, metavar="HW.yaml",
                        help="hardware file (fsdp-plan calibrate) whose figures order the "
                        "proposals (default: the figures the plan stored under hardware, "
                        "else its GPU preset)")
    parser.add_argument("--baseline", choices=("no-overlap", "none"), default="no-overlap",
                        help="no-overlap (default): the baseline's launch also profiles the plan "
                        "with communication held until backward compute is done, as bench "
                        "--baseline no-overlap does, for the overlap verdict the contention "
                        "stage reads; none: the baseline alone")
    parser.add_argument("--allow-lossy-hooks", action="store_true",
                        help="DDP plans: the hooks stage may try lossy communication hooks "
                        "(fp16/bf16 compression, PowerSGD), as planning with this flag does")
    parser.add_argument("--optimizer-overlap", action="store_true",
                        help="the training loop lets each parameter step in backward (no "
                        "clipping by the global norm): the optimizer overlap stage may try it")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    add_no_cache(parser)
    pictures.add_arguments(parser, measured=False)


def _check(args: argparse.Namespace) -> Plan:
    """Every flag and path checked before any work; returns the plan read."""
    if not (math.isfinite(args.budget_minutes) and args.budget_minutes > 0):
        raise BadInput(f"--budget-minutes must be a positive number, got {args.budget_minutes}.")
    if not 4 <= args.steps <= 1000:
        raise BadInput(f"--steps {args.steps} is outside 4..1000 (the noise needs quartiles).")
    if not 1 <= args.warmup <= 100:
        raise BadInput(f"--warmup {args.warmup} is outside 1..100.")
    check_out_folder(args.out)  # before any measuring, as bench does (issue 21, S3-11)
    plan = read_plan(args.plan)  # data only: its model.source is an input too (S4-02)
    check_outputs([*plan_input_files(plan, args.plan, args.model), ("--hardware", args.hardware)],
                  pictures.outputs(args))
    pictures.check(args)
    check_nproc(args.nproc)  # capped as bench and calibrate cap it (S3-31)
    return plan


def run(args: argparse.Namespace) -> int:
    """Tune; SIGTERM and SIGHUP (like Ctrl-C) end the workers and remove their temporary
    folders, then exit with 128 + the signal, as bench and calibrate do (issue 21, S3-12)."""
    try:
        with stop_on_signals():
            return _run(args)
    except Terminated as e:
        sys.stderr.write(f"fsdp-plan tune: {e}; the workers were ended and their temporary "
                         "files removed.\n")
        return e.exit_code


def _run(args: argparse.Namespace) -> int:
    plan = _check(args)
    # timing and loading import torch (~6 s): deferred so --help and the flag checks answer at
    # once
    import torch

    from fsdp_plan.bench import timing
    from fsdp_plan.measure import runtime
    loaded = runtime.load_planned_model(plan, args.model, args.plan)
    facts = analyze_for_plan(plan, loaded, facts_cache=facts_cache_of(args))
    replicate, shard = plan.mesh.replicate, plan.mesh.shard
    mesh = (1, args.nproc) if replicate == 1 else (args.nproc // shard, shard)
    if mesh[0] * mesh[1] != args.nproc:
        raise BadInput(f"--nproc {args.nproc} cannot hold the plan's HSDP shard groups of "
                       f"{shard}; use a multiple of {shard}.")

    # the baseline's launch, its result, then one launch per benching stage at most
    steps = Steps(total=2 + sum(stage.benches for stage in STAGES),
                  quiet=args.format == "json", what="tune", unit="launch")

    def progress(message: str) -> None:
        steps.step(message)

    def bench(plans):
        return timing.time_plans(loaded.source, plans, nproc=args.nproc, mesh=mesh,
                                 steps=args.steps, warmup=args.warmup)

    def bench_held(plan: Plan) -> HeldBaseline:
        times, overlapped, held = timing.time_with_held_twin(
            loaded.source, plan, nproc=args.nproc, mesh=mesh, steps=args.steps,
            warmup=args.warmup)
        return HeldBaseline(step_times_s=times, figures=overlap_figures(overlapped, held),
                            how=held["how"])
    hardware = plan_hardware(plan, hardware_file=args.hardware) if args.hardware else None
    allow = Permissions(lossy_hooks=args.allow_lossy_hooks,
                        optimizer_overlap=args.optimizer_overlap,
                        accelerator=torch.cuda.is_available())
    steps.step("benching the baseline" + (" and its no-overlap twin"
                                          if args.baseline == "no-overlap" else ""))
    try:
        result = tune(plan, facts, bench, budget_s=args.budget_minutes * 60, hardware=hardware,
                      bench_held=bench_held if args.baseline == "no-overlap" else None,
                      allow=allow, run_mesh=mesh, warmup_steps=args.warmup, progress=progress)
    finally:
        steps.close()
    os.makedirs(args.out, exist_ok=True)
    best_path, rollback_path, record_path = reserve_output_names(args.out)
    try:
        record: dict[str, Any] = {
            "fsdp_plan_tune_version": 2, "plan": os.path.abspath(args.plan),
            "plan_hash": plan_hash(plan.to_dict()), "torch": torch.__version__,
            "nproc": args.nproc, "mesh": list(mesh), "noise": result.noise,
            "rounds": result.rounds, "stopped": result.stopped,
            "baseline_p50_s": result.baseline.p50_s, "best_p50_s": result.best.p50_s,
            "gain": result.gain,
            "best_plan": best_path, "rollback_plan": rollback_path,
            "order": [s.name for s in result.stages],
            "overlap": ({"how": result.overlap_note, **result.overlap.to_dict()}
                        if result.overlap else {"skipped": result.overlap_note}),
            "stages": [s.to_dict() for s in result.stages],
            "trials": [{**t.row(), "plan_hash": plan_hash(t.plan.to_dict()),
                        "step_times_s": t.step_times_s} for t in result.trials]}
        files = [(best_path, plan_to_yaml(result.best.plan)),
                 (rollback_path, plan_to_yaml(plan)), (record_path, json.dumps(record, indent=2))]
        if pictures.wanted(args):  # the best plan, as predicted, with what tuning measured
            best = result.best.plan
            drawn_on = hardware or plan_hardware(best)
            prediction = predict(best, facts, hardware=drawn_on)
            frontier, notes = (pictures.frontier_of(best, facts, prediction) if args.html
                               else (None, []))
            notes.append(f"tuned: baseline {result.baseline.p50_s:.4g} s -> best "
                         f"{result.best.p50_s:.4g} s per step measured on {args.nproc} local "
                         f"rank(s) ({result.gain:.1%} faster; noise {result.noise:.1%}); "
                         f"stopped: {result.stopped}")
            files += pictures.files(args, title=f"fsdp-plan tune: best plan for {args.plan}",
                                    plan=best, facts=facts, prediction=prediction,
                                    hardware=drawn_on, hardware_file=args.hardware,
                                    frontier=frontier, notes=notes)
        atomic_write_all(files)
    finally:  # the reservation, if the record did not replace it
        if os.path.isfile(record_path) and os.path.getsize(record_path) == 0:
            os.unlink(record_path)
    if args.format == "json":
        print(json.dumps(record, indent=2))
    else:
        print(format_table(record))
    return 0


def reserve_output_names(out: str, stamp: str | None = None) -> tuple[str, str, str]:
    """The best plan's, the rollback plan's and the result JSON's paths in ``out``, named
    ``tune-STAMP[-N]`` (the second the run ended, then the first free ``N``), none of which
    exists (issue 21, S3-13: two runs in one second wrote the same names, and a run could
    replace its own input plan). The JSON is created empty here with ``O_EXCL``, so a run
    ending in the same second takes the next ``N``; the caller replaces it with the record
    (or removes it). Existing files, links included, are never chosen, so no output can be
    an input."""
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 10_000):
        stem = os.path.join(out, f"tune-{stamp}" + (f"-{n}" if n > 1 else ""))
        best, rollback, record = f"{stem}-best.yaml", f"{stem}-rollback.yaml", f"{stem}.json"
        if os.path.lexists(best) or os.path.lexists(rollback):
            continue
        try:
            os.close(os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        except OSError as e:
            raise write_failed(record, e, "tune's result") from e
        return best, rollback, record
    raise BadInput(f"--out {out!r} already holds 9,999 tune results from this second; choose "
                   "another folder.")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def format_table(record: dict[str, Any]) -> str:
    """The stages in the order they ran: each with its reason, its trials (predicted, measured,
    the best so far re-measured in the same launch) and its outcome; the baseline with its
    overlap verdict; then the gain and the two plans written."""
    def wrapped(text: str, indent: str = "    ") -> str:
        return textwrap.fill(text, width=100, initial_indent=indent, subsequent_indent=indent)
    order = " -> ".join(record["order"])
    lines = [wrapped(f"tuning order: {order} (one knob family per stage; each stage's plans "
                     "benched in one launch between two runs of the best so far, same seed and "
                     "data)", indent=""), ""]
    for number, stage in enumerate(record["stages"]):
        lines.append(f"{number}. {stage['stage']}: {stage['outcome']}")
        lines.append(wrapped(f"why: {stage['reason']}"))
        rows = [[t["knob"], t["change"], _seconds(t["predicted_step_s"]),
                 _seconds(t["p50_step_s"]), _seconds(t["reference_p50_s"]),
                 _seconds(t["p99_step_s"]), t["slowest_rank"], "kept" if t["kept"] else ""]
                for t in stage["trials"]]
        if rows:
            table = tabulate(rows, headers=["knob", "change", "predicted s",
                                            "P50 s (slowest rank)", "best so far, same launch",
                                            "P99 s", "slowest rank", ""])
            lines += ["    " + line for line in table.splitlines()]
        for dropped in stage["dropped"]:
            lines.append(wrapped(f"not benched: {dropped['knob']} ({dropped['change']}): "
                                 f"{dropped['why']}"))
        if stage["stage"] == "baseline" and "verdict" in record["overlap"]:
            lines += ["    " + line for line in report_lines(record["overlap"])]
    gain = record["gain"]
    lines += [
        "",
        (f"baseline {record['baseline_p50_s']:.4g} s -> best {record['best_p50_s']:.4g} s "
         f"({gain:.1%} faster, chained from same-launch comparisons); noise "
         f"{record['noise']:.1%}; {record['rounds']} round(s), stopped: {record['stopped']}."),
        f"best plan: {record['best_plan']}", f"rollback plan: {record['rollback_plan']}"]
    return "\n".join(lines)
