"""Plan FSDP wrapping, prefetch, sharding and checkpointing for MODEL within a per-GPU budget.

    fsdp-plan examples/llama.py --model-arg size=70b --mem 80GB --world-size 64 \
        -o policies/llama70b.py --plan policies/llama70b.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
import yaml

from fsdp_plan.analysis import analyze
from fsdp_plan.cost import hardware_for
from fsdp_plan.errors import BadInput, NoFeasiblePlan
from fsdp_plan.graph import build_module_graph
from fsdp_plan.load import ModelSource, load_model, parse_model_args, source_digest, source_kind
from fsdp_plan.memory import DTYPE_BYTES, OPTIMIZER_STATES, Precision
from fsdp_plan.plan import Mesh, Plan, Unit, atomic_write_all, check_writable, plan_to_yaml
from fsdp_plan.report import (
    ascii_timeline,
    candidate_row,
    chrome_trace,
    format_breakdown,
    format_candidates,
    gather_module_rows,
)
from fsdp_plan.search import Candidate, Evaluator, SearchSettings, choose, search, standard_recipes
from fsdp_plan.sizes import format_bytes, parse_bytes

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


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
    key = name.lower()
    if key not in DTYPES:
        raise BadInput(f"{flag} {name!r} is not a dtype fsdp-plan knows; use bf16, fp16 or fp32.")
    return DTYPES[key]


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


def to_plan(best: Candidate, source: ModelSource, digest: str, numel: int, values: dict[str, Any],
            args: argparse.Namespace) -> Plan:
    """The SPEC plan document for the chosen candidate."""
    block_units = [u.key for u in best.units if u.key]
    forward_prefetch = {}
    if best.forward_prefetch:
        forward_prefetch = {a: [b] for a, b in zip(block_units, block_units[1:])}
    backward_prefetch = {}
    if best.backward_prefetch > 1:
        rev = list(reversed(block_units))
        backward_prefetch = {a: rev[i + 1: i + 1 + best.backward_prefetch]
                             for i, a in enumerate(rev) if rev[i + 1: i + 1 + best.backward_prefetch]}
    return Plan(
        model={"source": source.source, "entry": source.entry, "args": source.args,
               "batch_size": source.batch_size, "seq_len": source.seq_len, "params": numel,
               "kind": source.kind, "digest": digest},
        budget_bytes=values["budget"], headroom_bytes=values["headroom"],
        world_size=args.world_size, mesh=Mesh(replicate=best.replicate, shard=best.shard),
        strategy=best.strategy,
        units=[Unit(modules=u.modules, reshard_after_forward=u.reshard_after_forward) for u in best.units],
        activation_checkpointing=list(best.checkpointed),
        forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch,
        mixed_precision={"param_dtype": values["param_dtype"], "reduce_dtype": values["reduce_dtype"]},
        optimizer=args.optimizer, gpu=values["hardware"].name,
        predicted={
            "peak_bytes": int(best.memory.peak_bytes),
            "collectives_per_step": best.collectives,
            "collectives_per_step_fsdp1": best.collectives_fsdp1,
            "step_time_s": round(best.time.step_s, 6),
            "exposed_comm_s": round(best.time.exposed_comm_s, 6),
            "hidden_comm_s": round(best.time.hidden_comm_s, 6),
            "peak_phase": best.memory.phase,
            "breakdown": {k: int(v) for k, v in best.memory.breakdown.items()},
            "units": [{"key": u.key, "params": u.numel, "shard_numel": u.shard_numel}
                      for u in best.units],
        },
    )


def suggestions(smallest: Candidate, values: dict[str, Any], args: argparse.Namespace) -> str:
    limit = values["budget"] - values["headroom"]
    states = smallest.memory.breakdown.get("sharded_params", 0) + smallest.memory.breakdown.get(
        "optimizer_states", 0)
    tips = []
    if states > limit:
        need = int(args.world_size * states / max(limit, 1)) + 1
        tips.append(f"more GPUs (the sharded parameters and optimizer states alone take "
                    f"{format_bytes(states)} per rank; about {need} GPUs would hold them)")
    else:
        tips.append("more GPUs (--world-size) to shard the model states further")
    if args.batch_size > 1:
        tips.append("a smaller --batch-size (with gradient accumulation)")
    tips.append("a shorter --seq-len")
    tips.append("CPU offload of parameters and optimizer states (FSDP2 CPUOffloadPolicy)")
    if not smallest.checkpointed:
        tips.append("activation checkpointing inside blocks")
    return "; ".join(tips)


def check_by_measurement(plan: Plan, loaded, limit_bytes: int, progress) -> None:
    """``--verify``: measure the chosen plan with FSDPMemTracker on the fake process group."""
    from fsdp_plan.emit import load_policy_module, render_policy_module
    from fsdp_plan.measure.memory import measure_peak
    measured = measure_peak(loaded, plan, load_policy_module(render_policy_module(plan)))
    predicted = plan.predicted["peak_bytes"]
    plan.predicted["measured_peak_bytes"] = int(measured.peak_bytes)
    if progress:
        progress(f"verify: predicted peak {format_bytes(predicted)}, FSDPMemTracker measured "
                 f"{format_bytes(measured.peak_bytes)} "
                 f"({(predicted - measured.peak_bytes) / measured.peak_bytes:+.1%})")
    if measured.peak_bytes > limit_bytes:
        raise NoFeasiblePlan(f"the chosen plan measured {format_bytes(measured.peak_bytes)} under "
                             f"FSDPMemTracker, above the limit {format_bytes(limit_bytes)}; nothing "
                             "was written. Lower --mem's headroom use or add GPUs.",
                             smallest_peak_bytes=measured.peak_bytes)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    values = validate(args)
    if not args.model and not args.hf_config:
        raise BadInput("give a MODEL file (or --hf-config config.json).")
    if args.model and args.hf_config:
        raise BadInput(f"give either MODEL ({args.model!r}) or --hf-config ({args.hf_config!r}), "
                       "not both: --hf-config builds the model from the config alone.")
    source = model_source(args)
    progress = (lambda m: sys.stderr.write(f"fsdp-plan: {m}\n")) if args.format == "table" else None
    loaded = load_model(source)
    for note in loaded.notes if progress else ():
        progress(f"note: {note}")
    graph = build_module_graph(loaded.model)
    if graph.total_numel == 0:
        raise BadInput(f"model {source.source!r} has no parameters; there is nothing to shard.")
    if progress:
        progress(f"analysing {graph.total_numel:,} parameters, batch {source.batch_size} x "
                 f"sequence {source.seq_len}")
    analysis = analyze(loaded, param_dtype=getattr(torch, values["param_dtype"]), blocks=graph.blocks,
                       exact=args.exact_analysis)
    precision = Precision(orig_bytes=4, param_bytes=DTYPE_BYTES[values["param_dtype"]],
                          reduce_bytes=DTYPE_BYTES[values["reduce_dtype"]])
    settings = SearchSettings(budget_bytes=values["budget"], headroom_bytes=values["headroom"],
                              world_size=args.world_size, gpus_per_node=args.gpus_per_node,
                              strategy=args.strategy, precision=precision, optimizer=args.optimizer,
                              hardware=values["hardware"])
    evaluator = Evaluator(graph, analysis, settings)
    recipes = standard_recipes(evaluator)
    ranked = choose(search(evaluator), recipes, args.strategy)
    elapsed = time.perf_counter() - started
    best = ranked[0]
    if not best.fits:
        smallest = min(ranked + recipes, key=lambda c: c.memory.peak_bytes)
        raise NoFeasiblePlan(
            f"no plan fits --mem {format_bytes(values['budget'])} minus headroom "
            f"{format_bytes(values['headroom'])} (limit {format_bytes(settings.limit_bytes)}) at "
            f"world size {args.world_size}: the smallest peak any plan reached is "
            f"{format_bytes(smallest.memory.peak_bytes)} ({smallest.name}). To fit, try: "
            f"{suggestions(smallest, values, args)}.", smallest_peak_bytes=smallest.memory.peak_bytes)
    plan = to_plan(best, source, source_digest(source), graph.total_numel, values, args)
    if loaded.notes:
        plan.model["notes"] = list(loaded.notes)
    if args.verify:
        check_by_measurement(plan, loaded, settings.limit_bytes, progress)
    rows = [candidate_row(c) for c in ranked[: args.top]] + [candidate_row(c) for c in recipes]
    if args.format == "json":
        print(json.dumps({"plan": plan.to_dict(), "candidates": rows,
                          "modules": gather_module_rows(graph, analysis),
                          "planning_seconds": round(elapsed, 3)}, default=str))
    else:
        print_report(graph, analysis, best, rows, values, args, elapsed)
    outputs: list[tuple[str, str]] = []
    if args.output:
        from fsdp_plan.emit import render_policy_module
        outputs.append((args.output, render_policy_module(plan)))
    if args.plan:
        outputs.append((args.plan, plan_to_yaml(plan)))
    if args.trace:
        outputs.append((args.trace, chrome_trace(best.time)))
    atomic_write_all(outputs)
    for path, _ in outputs:
        if progress:
            progress(f"wrote {path}")
    return 0


def print_report(graph, analysis, best: Candidate, rows, values, args, elapsed: float) -> None:
    from tabulate import tabulate
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
    print(f"\nplanned in {elapsed:.1f} s")
