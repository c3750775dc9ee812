"""Predict memory, collectives and step time of a plan file as written, without a search.

    fsdp-plan predict PLAN.yaml [MODEL] [--gpu h100 | --hardware HW.yaml] [--gpus-per-node 8]
                      [--format table|json]

"Will my current config fit, and how fast is it?": write the setup you run today as a plan
file (for example torchtitan's one unit per block with every block checkpointed) and predict
it with the same memory model, collective rule and step-time model the planner searches with.
Exit 0 when the plan fits its ``budget_bytes - headroom_bytes``, 3 when it does not (the
prediction is printed either way), 2 for an invalid plan or model.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fsdp_plan.api import facts_for_plan, plan_hardware, predict
from fsdp_plan.cli.cache_flag import add_no_cache, facts_cache_of
from fsdp_plan.common.errors import BadInput, NoFeasiblePlan
from fsdp_plan.common.files import atomic_write_all, check_outputs
from fsdp_plan.common.limits import MAX_GPUS_PER_NODE
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.model.source import check_count
from fsdp_plan.pictures import files as pictures
from fsdp_plan.plan.document import Plan, read_plan
from fsdp_plan.plan.read import plan_input_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.yaml", help="a plan file, written by fsdp-plan or "
                        "by hand (SPEC section 3)")
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None,
                        help="the model file (default: the source recorded in the plan)")
    parser.add_argument("--gpu", default=None,
                        help="GPU preset for the step time (default: the figures the plan "
                        "stored under hardware, else its gpu key)")
    parser.add_argument("--hardware", default=None, metavar="HW.yaml",
                        help="YAML file overriding the preset's figures (default: the figures "
                        "the plan stored, if it was made with --hardware)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per node, for which collectives cross nodes (default: the "
                        "plan's gpus_per_node key, else 8)")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    add_no_cache(parser)
    pictures.add_arguments(parser, measured=False)


def gather_data(plan: Plan, predicted: dict[str, Any], limit_bytes: int, fits: bool
                ) -> dict[str, Any]:
    """The prediction beside what the plan file stored, as plain data."""
    stored = plan.predicted or {}
    return {"plan": {"world_size": plan.world_size,
                     "mesh": {"replicate": plan.mesh.replicate, "shard": plan.mesh.shard},
                     "strategy": plan.strategy, "units": len(plan.units),
                     "checkpointed": len(plan.activation_checkpointing)},
            "budget_bytes": plan.budget_bytes, "headroom_bytes": plan.headroom_bytes,
            "limit_bytes": limit_bytes, "fits": fits, "predicted": predicted,
            "stored_predicted": {k: stored[k] for k in ("peak_bytes", "step_time_s",
                                                        "exposed_comm_s", "collectives_per_step")
                                 if k in stored}}


def format_report(data: dict[str, Any]) -> str:
    p, stored = data["predicted"], data["stored_predicted"]
    mesh = data["plan"]["mesh"]
    counts = p["collectives_per_step"]

    def was(key: str, text) -> str:
        return f" (plan file says {text(stored[key])})" if key in stored and stored[key] != p[
            key] else ""

    lines = [
        (f"plan: {data['plan']['units']} units, {data['plan']['checkpointed']} checkpointed "
        f"modules, mesh {mesh['replicate']}x{mesh['shard']} ({data['plan']['strategy']}), "
        f"world size {data['plan']['world_size']}"),
        f"peak {format_bytes(p['peak_bytes'])} per rank at {p['peak_phase']}"
        + was("peak_bytes", format_bytes),
        f"limit {format_bytes(data['limit_bytes'])} (budget {format_bytes(data['budget_bytes'])}"
        f" - headroom {format_bytes(data['headroom_bytes'])}): "
        + ("fits" if data["fits"] else "DOES NOT FIT"),
        (f"collectives per step: all_gather {counts['all_gather']}, reduce_scatter "
        f"{counts['reduce_scatter']}, all_reduce {counts['all_reduce']}"),
        f"step {p['step_time_s']:.4f} s" + was("step_time_s", lambda v: f"{v:.4f} s")
        + f", exposed communication {p['exposed_comm_s']:.4f} s",
    ]
    return "\n".join(lines)


def check_gpus_per_node(flag: int | None, plan: Plan) -> int:
    """``--gpus-per-node``, else the plan's (``Plan.node_gpus``: ``gpus_per_node``, checked
    with the plan, else 8 for a plan written before it was recorded): bounded as planning bounds it, and filling whole nodes at the plan's world size
    (issue 21, S3-04: 0 and -4 were taken, and a 70B step became 14 s)."""
    if flag is not None:
        check_count(flag, "--gpus-per-node", MAX_GPUS_PER_NODE,
                    "GPUs sharing one node's fast links: 8 on DGX/HGX, 72 in an NVL72 rack")
    gpus_per_node = flag if flag is not None else plan.node_gpus
    world = plan.world_size
    if world > gpus_per_node and world % gpus_per_node:
        raise BadInput(f"the plan's world_size {world} is not a multiple of "
                       f"{'--gpus-per-node' if flag is not None else 'gpus_per_node'} "
                       f"{gpus_per_node}; nodes must be full: give --gpus-per-node that divides "
                       f"{world} (e.g. {_divisor_below(world, gpus_per_node)}).")
    return gpus_per_node


def _divisor_below(world: int, limit: int) -> int:
    return max(d for d in range(1, min(world, limit) + 1) if world % d == 0)


def run(args: argparse.Namespace) -> int:
    plan = read_plan(args.plan)  # data only: its model.source is an input too (S4-02)
    check_outputs([*plan_input_files(plan, args.plan, args.model), ("--hardware", args.hardware)],
                  pictures.outputs(args))
    pictures.check(args)
    hardware = plan_hardware(plan, gpu=args.gpu, hardware_file=args.hardware)
    gpus_per_node = check_gpus_per_node(args.gpus_per_node, plan)
    # torch (seconds) only where the model is built: --help and the flag checks answer at once
    facts = facts_for_plan(plan, model=args.model, plan_path=args.plan,
                           facts_cache=facts_cache_of(args))
    prediction = predict(plan, facts, hardware=hardware, gpus_per_node=gpus_per_node)
    data = gather_data(plan, prediction.predicted, prediction.limit_bytes, prediction.fits)
    files = []
    if prediction.fits and pictures.wanted(args):  # nothing is written unless exit 0
        frontier, notes = (pictures.frontier_of(plan, facts, prediction) if args.html
                           else (None, []))
        files = pictures.files(args, title=f"fsdp-plan predict: {args.plan}", plan=plan,
                               facts=facts, prediction=prediction, hardware=hardware,
                               hardware_file=args.hardware, frontier=frontier, notes=notes)
        atomic_write_all(files)
    print(json.dumps(data, indent=2) if args.format == "json" else format_report(data))
    for path, _ in files if args.format == "table" else ():
        print(f"fsdp-plan predict: wrote {path}", file=sys.stderr)
    if not prediction.fits:
        raise NoFeasiblePlan(f"the plan as written peaks at "
                             f"{format_bytes(prediction.predicted['peak_bytes'])} per rank, above "
                             f"its limit {format_bytes(prediction.limit_bytes)}; run fsdp-plan on "
                             "the model to find one that fits"
                             + (" (no picture was written)." if pictures.wanted(args) else "."),
                             smallest_peak_bytes=prediction.predicted["peak_bytes"])
    return 0
