"""Plan FSDP wrapping, prefetch, sharding and checkpointing for MODEL within a per-GPU budget.

    fsdp-plan examples/llama.py --model-arg size=70b --mem 80GB --world-size 64 \
        -o policies/llama70b.py --plan policies/llama70b.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

from fsdp_plan.cost import hardware_for
from fsdp_plan.errors import BadInput
from fsdp_plan.memory import OPTIMIZER_STATES, canonical_dtype
from fsdp_plan.outputs import check_writable
from fsdp_plan.sizes import format_bytes, parse_bytes
from fsdp_plan.source import ModelSource, parse_model_args, source_kind

# Nothing above imports torch: every flag is checked before the ~6 s torch import (run()).

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="model file (.py), "
                        "package.module:attr, or (with --hf-config) omitted")
    parser.add_argument("--mem", required=True, help="per-GPU memory budget: 70GB, 70GiB, 70000MB or bytes")
    parser.add_argument("--headroom", default=None,
                        help="memory kept free for the CUDA context, NCCL buffers and "
                        "fragmentation (default 10%% of --mem)")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--entry", default="build_model")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--hf-config", default=None, help="build a transformers model from config.json")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--strategy", default="auto", choices=["auto", "full", "hybrid", "grad-op", "none"])
    parser.add_argument("--param-dtype", default="bf16")
    parser.add_argument("--reduce-dtype", default="fp32")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--hardware", default=None, help="YAML file overriding GPU/link figures")
    parser.add_argument("-o", "--output", default=None, help="write the policy module here")
    parser.add_argument("--plan", default=None, help="write the plan YAML here")
    parser.add_argument("--trace", default=None, help="write the predicted timeline (Chrome trace)")
    parser.add_argument("--format", default="table", choices=["table", "json"])
    parser.add_argument("--top", type=int, default=5, help="alternatives shown in the report")
    parser.add_argument("--verify", action="store_true",
                        help="measure the chosen plan with FSDPMemTracker before writing")
    parser.add_argument("--exact-analysis", action="store_true",
                        help="analyse every block instead of three per stack")


def _dtype(name: str, flag: str) -> str:
    return canonical_dtype(name, flag)


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """Check every input before any work; returns parsed values."""
    budget = parse_bytes(args.mem, "--mem")
    headroom = parse_bytes(args.headroom, "--headroom") if args.headroom else budget // 10
    if headroom >= budget:
        raise BadInput(f"--headroom {format_bytes(headroom)} leaves nothing of --mem {format_bytes(budget)}.")
    if args.world_size <= 0:
        raise BadInput(f"--world-size must be a positive number of GPUs, got {args.world_size}.")
    if args.gpus_per_node <= 0:
        raise BadInput(f"--gpus-per-node must be positive, got {args.gpus_per_node}.")
    if args.world_size > args.gpus_per_node and args.world_size % args.gpus_per_node:
        raise BadInput(f"--world-size {args.world_size} is not a multiple of --gpus-per-node "
                       f"{args.gpus_per_node}; nodes must be full (e.g. --world-size "
                       f"{args.world_size // args.gpus_per_node * args.gpus_per_node or args.gpus_per_node}).")
    overrides = None
    if args.hardware:
        try:
            with open(args.hardware) as f:
                overrides = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise BadInput(f"--hardware {args.hardware!r} cannot be read as YAML: {e}.") from e
        if not isinstance(overrides, dict):
            raise BadInput(f"--hardware {args.hardware!r} must hold a mapping of field: value.")
    hardware = hardware_for(args.gpu, overrides)
    param_dtype = _dtype(args.param_dtype, "--param-dtype")
    reduce_dtype = _dtype(args.reduce_dtype, "--reduce-dtype")
    for path, what in ((args.output, "-o"), (args.plan, "--plan"), (args.trace, "--trace")):
        if path:
            check_writable(path, what)
    if args.output and not args.output.endswith(".py"):
        raise BadInput(f"-o {args.output!r} must name a .py file (the generated policy module).")
    return dict(budget=budget, headroom=headroom, hardware=hardware, param_dtype=param_dtype,
                reduce_dtype=reduce_dtype)


def model_source(args: argparse.Namespace) -> ModelSource:
    if args.hf_config:
        return ModelSource(source=args.hf_config, entry="from_config", kind="hf-config",
                           args=parse_model_args(args.model_arg), batch_size=args.batch_size,
                           seq_len=args.seq_len)
    return ModelSource(source=args.model, entry=args.entry, kind=source_kind(args.model),
                       args=parse_model_args(args.model_arg), batch_size=args.batch_size,
                       seq_len=args.seq_len)


def run(args: argparse.Namespace) -> int:
    values = validate(args)
    if not args.model and not args.hf_config:
        raise BadInput("give a MODEL file (or --hf-config config.json).")
    if args.model and args.hf_config:
        raise BadInput(f"give either MODEL ({args.model!r}) or --hf-config ({args.hf_config!r}), "
                       "not both: --hf-config builds the model from the config alone.")
    source = model_source(args)
    from fsdp_plan.api import PlanRequest, make_plan, verify_by_measurement
    from fsdp_plan.report import candidate_row, gather_module_rows

    progress = (lambda m: sys.stderr.write(f"fsdp-plan: {m}\n")) if args.format == "table" else None
    request = PlanRequest(
        source=source, budget_bytes=values["budget"], headroom_bytes=values["headroom"],
        world_size=args.world_size, gpus_per_node=args.gpus_per_node, strategy=args.strategy,
        param_dtype=values["param_dtype"], reduce_dtype=values["reduce_dtype"],
        optimizer=args.optimizer, hardware=values["hardware"], exact_analysis=args.exact_analysis)
    result = make_plan(request, progress)
    if args.verify and result.loaded is not None:
        verify_by_measurement(result, result.loaded, progress)
    rows = ([candidate_row(c) for c in result.ranked[: args.top]]
            + [candidate_row(c) for c in result.recipes])
    if args.format == "json":
        print(json.dumps({"plan": result.plan.to_dict(), "candidates": rows,
                          "modules": gather_module_rows(result.facts.graph, result.facts.analysis),
                          "planning_seconds": round(result.seconds, 3)}, default=str))
    else:
        print_report(result, rows, values, args)
    written = result.write(policy=args.output, plan=args.plan, trace=args.trace)
    for path in written if progress else ():
        progress(f"wrote {path}")
    return 0


def print_report(result, rows: list[dict[str, Any]], values: dict[str, Any],
                 args: argparse.Namespace) -> None:
    from tabulate import tabulate

    from fsdp_plan.report import (
        ascii_timeline,
        format_breakdown,
        format_candidates,
        gather_module_rows,
    )
    graph, analysis, best = result.facts.graph, result.facts.analysis, result.best
    total = graph.total_numel
    print(f"model: {args.model or args.hf_config}  parameters: {total:,} "
          f"({format_bytes(total * 4)} fp32)  batch {args.batch_size} x seq {args.seq_len}")
    shard_states = total * 4 * (1 + OPTIMIZER_STATES.get(args.optimizer, 0)) / args.world_size
    print(f"budget {format_bytes(values['budget'])}, headroom {format_bytes(values['headroom'])}; "
          f"model states fully sharded over {args.world_size} GPUs: {format_bytes(shard_states)} per rank")
    print()
    mods = gather_module_rows(graph, analysis, max_depth=1 if len(graph.modules) > 60 else 2)
    print(tabulate([[r["module"], r["class"], f"{r['params']:,}", format_bytes(r["saved_activation_bytes"]),
                     f"{r['fw_flops'] / 1e12:.2f}", f"{r['bw_flops'] / 1e12:.2f}"] for r in mods[:40]],
                   headers=["module", "class", "params", "saved activations", "fw TFLOP", "bw TFLOP"]))
    print()
    print(format_candidates(rows))
    print()
    print(f"chosen: {best.name}; peak {format_bytes(best.memory.peak_bytes)} at {best.memory.phase}")
    print(format_breakdown(best.memory.breakdown))
    print()
    print(ascii_timeline(best.time))
    print(f"\nplanned in {result.seconds:.1f} s")
