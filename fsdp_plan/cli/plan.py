"""Plan FSDP wrapping, prefetch, sharding and checkpointing for MODEL within a per-GPU budget.

    fsdp-plan examples/llama.py --model-arg size=70b --mem 80GB --world-size 64 \
        -o policies/llama70b.py --plan policies/llama70b.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from typing import Any

from fsdp_plan.api import PlanRequest, make_plan, predict, verify_by_measurement
from fsdp_plan.cli.cache_flag import add_no_cache, facts_cache_of
from fsdp_plan.cli.process import process_ends_after_command
from fsdp_plan.common.autocast import AUTOCAST_DTYPES
from fsdp_plan.common.collector import cycle_collector_paused
from fsdp_plan.common.dtypes import canonical_dtype
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.files import check_outputs, check_writable
from fsdp_plan.common.limits import MAX_GPUS_PER_NODE, MAX_GRAD_ACCUM_STEPS, MAX_WORLD_SIZE
from fsdp_plan.common.sizes import format_bytes, parse_bytes, parse_share_of
from fsdp_plan.cost.hardware import GPUS, hardware_for, read_hardware_file
from fsdp_plan.cost.hardware.stored import file_origin
from fsdp_plan.cost.precision import OPTIMIZERS
from fsdp_plan.facts.cache import FactsCache
from fsdp_plan.model.source import (
    MAX_BATCH_SIZE,
    MAX_SEQ_LEN,
    TORCHTITAN_ENTRY,
    ModelSource,
    check_count,
    model_input_files,
    parse_model_args,
    source_kind,
    torchtitan_shorthand,
)
from fsdp_plan.pictures import files as pictures
from fsdp_plan.plan.report import (
    candidate_row,
    format_report,
    gather_mesh_rows,
    gather_module_rows,
)
from fsdp_plan.search.candidate import STRATEGY_CHOICES
from fsdp_plan.search.compile_choice import eager_facts
from fsdp_plan.search.framework import FRAMEWORKS
from fsdp_plan.search.frontier import Variant, compute_frontier, more_memory_line
from fsdp_plan.search.request import SearchOptions

# Nothing above imports torch: every flag is checked before the ~6 s torch import (run()).

MAX_TOP = 1000
"""Alternatives printed in the report."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="model file (.py) defining "
                        "build_model(**kwargs), package.module:attr, or torchtitan:NAME:FLAVOR (a model of "
                        "torchtitan's registry, e.g. torchtitan:llama3:8B); omit with --hf-config")
    parser.add_argument("--mem", required=True, help="per-GPU memory budget: 70GB (10^9 bytes), "
                        "70GiB (2^30 bytes), 70000MB or plain bytes (required)")
    parser.add_argument("--headroom", default=None,
                        help="memory kept free for the CUDA context, NCCL buffers and "
                        "fragmentation: a size in --mem's units or a share such as 15%%; 0 plans "
                        "up to the limit (default: 10%% of --mem)")
    parser.add_argument("--world-size", type=int, default=8,
                        help=f"GPUs in the whole job, 1..{MAX_WORLD_SIZE:,} (default: %(default)s)")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help=f"GPUs per node, 1..{MAX_GPUS_PER_NODE} (default: %(default)s)")
    parser.add_argument("--entry", default="build_model",
                        help="name of the factory function in the model file (default: %(default)s)")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the factory, value read as a YAML scalar "
                        "(int, float, bool, null/~, else text); repeatable")
    parser.add_argument("--hf-config", default=None, help="build a Hugging Face transformers "
                        "model from this config.json on the meta device (nothing downloaded)")
    parser.add_argument("--batch-size", type=_batch_size, default=None,
                        help=f"samples per micro-batch per GPU, 1..{MAX_BATCH_SIZE:,}, or auto "
                        "for the largest micro-batch that fits (the fastest if larger is not "
                        "faster); with --global-batch-size, the micro-batch to use (the "
                        "planner then derives the accumulation steps) (default: 1, or the "
                        "planner's choice with --global-batch-size)")
    parser.add_argument("--global-batch-size", type=int, default=None, metavar="N",
                        help="samples per optimizer step over all data-parallel ranks: the "
                        "planner chooses the micro-batch, gradient accumulation and when "
                        "gradients are reduced, for the most tokens/s per GPU (default: off)")
    parser.add_argument("--seq-len", type=int, default=4096,
                        help=f"tokens per sample, 1..{MAX_SEQ_LEN:,} (default: %(default)s)")
    parser.add_argument("--strategy", default="auto", choices=STRATEGY_CHOICES,
                        help="sharding strategy; auto picks the best that fits (default: %(default)s)")
    parser.add_argument("--param-dtype", default=None,
                        help="mixed-precision parameter dtype: bf16, fp16 or fp32 (default: bf16; "
                        "fp32 with --autocast)")
    parser.add_argument("--autocast", default=None, metavar="DTYPE",
                        help="compute under torch.autocast in DTYPE (bf16 or fp16) with float32 "
                        "parameters and communication, as HF Trainer/accelerate bf16 and "
                        "Lightning bf16-mixed train (plan records mixed_precision.autocast_dtype)")
    parser.add_argument("--reduce-dtype", default=None,
                        help="gradient reduction dtype: bf16, fp16, fp32, or auto to let the "
                        "planner reduce in bf16 where it pays (default: fp32; with --framework "
                        "the dtype its configuration reduces in)")
    parser.add_argument("--framework", default=None, choices=FRAMEWORKS,
                        help="keep the search to what this framework's own configuration says, "
                        "so `fsdp-plan export` writes no code hook; the report prints what that "
                        "costs against the unrestricted plan (default: none)")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS),
                        help="optimizer whose states are counted (default: %(default)s)")
    parser.add_argument("--gpu", default="h100", help=f"GPU preset for the time model: "
                        f"{', '.join(GPUS)} (default: %(default)s)")
    parser.add_argument("--hardware", default=None, metavar="HW.yaml",
                        help="YAML file overriding the preset's fields (peak_flops in FLOP/s, "
                        "bandwidths in bytes/s, latencies in seconds)")
    parser.add_argument("-o", "--output", default=None, metavar="POLICY.py",
                        help="write the policy module (.py) here (default: not written)")
    parser.add_argument("--plan", default=None, metavar="PLAN.yaml",
                        help="write the plan YAML here (default: not written)")
    parser.add_argument("--trace", default=None, metavar="TRACE.json",
                        help="write the predicted timeline as a Chrome trace (default: not written)")
    pictures.add_arguments(parser, measured=False)
    parser.add_argument("--format", default="table", choices=["table", "json"],
                        help="report on stdout as a table or one JSON document (default: %(default)s)")
    parser.add_argument("--top", type=int, default=5,
                        help=f"alternatives shown in the report, 0..{MAX_TOP} (default: %(default)s)")
    parser.add_argument("--verify", action="store_true",
                        help="measure the chosen plan with FSDPMemTracker before writing")
    parser.add_argument("--exact-analysis", action="store_true",
                        help="analyse every block instead of three per stack")
    add_no_cache(parser)
    parser.add_argument("--compile", nargs="?", const="on", default=None, metavar="auto",
                        help="plan each repeated block compiled as torchtitan does "
                        "(torch.compile(block.forward, fullgraph=True) after checkpointing, "
                        "before fully_shard): saved activations from the compiler's partition, "
                        "time from fused kernels; --compile auto plans eager and compiled and "
                        "keeps the faster plan that fits, saying what compile buys")
    parser.add_argument("--activation-memory-budget", type=float, default=None, metavar="B",
                        help="with --compile: torch._functorch.config.activation_memory_budget "
                        "(0..1) for the compiled blocks (default: the partitioner's own)")
    parser.add_argument("--optimizer-overlap", action="store_true",
                        help="the training loop lets each parameter step as soon as its "
                        "gradient is reduced, during backward (no clipping by the global norm, "
                        "no accumulation): the plan frees gradients early and hides the "
                        "optimizer, and the policy's apply installs it")
    parser.add_argument("--allow-lossy-hooks", action="store_true",
                        help="DDP plans may all-reduce gradients through a lossy communication "
                        "hook: fp16 or bf16 compression (half the bytes, fewer significant bits) "
                        "or PowerSGD (low-rank, error feedback); each is priced and the report "
                        "says what it changes numerically")
    parser.add_argument("--allow-offload", action="store_true",
                        help="when no plan fits on the GPU, plan FSDP2 CPU offload "
                        "(CPUOffloadPolicy: parameters, gradients and optimizer states in host "
                        "memory, optimizer step on the CPU; slower, PCIe-bound)")


def _batch_size(text: str) -> int | str:
    """``--batch-size``: a whole number or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number nor auto") from None


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """Check every input before any work (nothing imported from torch, no user code run);
    returns parsed values."""
    budget = parse_bytes(args.mem, "--mem")
    headroom = (parse_share_of(args.headroom, budget, "--headroom")
                if args.headroom is not None else budget // 10)
    if headroom >= budget:
        raise BadInput(f"--headroom {format_bytes(headroom)} leaves nothing of --mem {format_bytes(budget)}.")
    check_count(args.world_size, "--world-size", MAX_WORLD_SIZE,
                "GPUs in the whole job; FSDP's device mesh and this planner's per-rank model "
                "describe real clusters, and no cluster is larger")
    check_count(args.gpus_per_node, "--gpus-per-node", MAX_GPUS_PER_NODE,
                "GPUs sharing one node's fast links: 8 on DGX/HGX, 72 in an NVL72 rack")
    if args.batch_size not in ("auto", None):
        check_count(args.batch_size, "--batch-size", MAX_BATCH_SIZE,
                    "samples per micro-batch on one GPU; larger is a typing mistake")
    if args.global_batch_size is not None:
        check_count(args.global_batch_size, "--global-batch-size",
                    MAX_BATCH_SIZE * MAX_GRAD_ACCUM_STEPS,
                    "samples per optimizer step over all ranks")
        if args.global_batch_size % args.world_size:
            raise BadInput(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                           f"--world-size {args.world_size}: every rank takes the same number of "
                           f"samples per step (e.g. {max(1, args.global_batch_size // args.world_size) * args.world_size}).")
        fixed_accumulation(args)  # --batch-size N with it: N must divide each rank's share
    check_count(args.seq_len, "--seq-len", MAX_SEQ_LEN,
                "tokens per sample, beyond any model's context; larger is a typing mistake")
    if isinstance(args.top, bool) or not isinstance(args.top, int) or not 0 <= args.top <= MAX_TOP:
        raise BadInput(f"--top {args.top} is outside 0..{MAX_TOP} (alternatives shown in the report).")
    if args.world_size > args.gpus_per_node and args.world_size % args.gpus_per_node:
        raise BadInput(f"--world-size {args.world_size} is not a multiple of --gpus-per-node "
                       f"{args.gpus_per_node}; nodes must be full (e.g. --world-size "
                       f"{args.world_size // args.gpus_per_node * args.gpus_per_node or args.gpus_per_node}).")
    if not args.entry.isidentifier() or (args.entry.startswith("__") and args.entry.endswith("__")):
        raise BadInput(f"--entry {args.entry!r} is not the name of a factory function (a Python "
                       "identifier, not a __dunder__), e.g. --entry build_model.")
    parse_model_args(args.model_arg)  # refuses .nan/.inf and malformed pairs before any work
    outputs = [("-o", args.output), ("--plan", args.plan), ("--trace", args.trace),
               *pictures.outputs(args)]
    check_outputs([*model_input_files(args.model, args.hf_config), ("--hardware", args.hardware)],
                  outputs)
    overrides = read_hardware_file(args.hardware) if args.hardware else None
    hardware = hardware_for(args.gpu, overrides, where=f"--hardware {args.hardware!r}")
    # ``--autocast ""`` is a dtype that was given and is not one (issue 31, S4-11), not "off"
    autocast = canonical_dtype(args.autocast, "--autocast") if args.autocast is not None else None
    if autocast is not None and autocast not in AUTOCAST_DTYPES:
        raise BadInput(f"--autocast {args.autocast} is not a dtype torch.autocast computes in; "
                       "use bf16 or fp16.")
    param_dtype = canonical_dtype(args.param_dtype if args.param_dtype is not None
                                  else "fp32" if autocast else "bf16", "--param-dtype")
    if autocast is not None and param_dtype != "float32":
        raise BadInput(f"--autocast keeps float32 parameters (FSDP gathers them in float32 and "
                       f"autocast casts per op), so --param-dtype {args.param_dtype} cannot go "
                       "with it; leave --param-dtype out (or give fp32).")
    reduce_dtype = (None if args.reduce_dtype is None  # PlanRequest: fp32 or --framework's
                    else "auto" if args.reduce_dtype.lower() == "auto"
                    else canonical_dtype(args.reduce_dtype, "--reduce-dtype"))
    if args.output and not args.output.endswith(".py"):
        raise BadInput(f"-o {args.output!r} must name a .py file (the generated policy module).")
    for what, path in outputs:
        if path is not None:
            check_writable(path, what)
    pictures.check(args)
    origin = None
    if args.hardware:
        origin = file_origin(args.hardware)
    return {"budget": budget, "headroom": headroom, "hardware": hardware,
            "hardware_origin": origin,
            "param_dtype": param_dtype, "reduce_dtype": reduce_dtype, "autocast": autocast}


def fixed_accumulation(args: argparse.Namespace) -> int | None:
    """Accumulation steps for ``--batch-size N`` given with ``--global-batch-size G``, else
    None (the planner chooses the micro-batch).

    Both given is what DeepSpeed (``train_micro_batch_size_per_gpu`` with
    ``train_batch_size``) and torchtitan (``local_batch_size`` with ``global_batch_size``)
    mean: the micro-batch is N and accumulation makes up the rest, ``G / (world size * N)``
    steps. It was once ignored silently (issue 21, S3-26); a micro-batch that does not divide
    each rank's share is refused rather than rounded, since the optimizer would then see
    another batch than asked for."""
    if args.global_batch_size is None or args.batch_size in ("auto", None):
        return None
    per_rank = args.global_batch_size // args.world_size
    if per_rank % args.batch_size:
        raise BadInput(f"--batch-size {args.batch_size} does not divide the {per_rank:,} samples "
                       f"each rank takes per step (--global-batch-size {args.global_batch_size} "
                       f"over --world-size {args.world_size}); the micro-batch times the "
                       "accumulation steps must make up that share. Give a divisor (e.g. "
                       f"--batch-size {math.gcd(args.batch_size, per_rank)}), or leave "
                       "--batch-size out and the planner chooses the micro-batch.")
    steps = per_rank // args.batch_size
    if steps > MAX_GRAD_ACCUM_STEPS:
        raise BadInput(f"--batch-size {args.batch_size} with --global-batch-size "
                       f"{args.global_batch_size} over --world-size {args.world_size} needs "
                       f"{steps:,} accumulation steps, more than {MAX_GRAD_ACCUM_STEPS:,}; give "
                       "a larger --batch-size, or leave it out and the planner chooses.")
    return steps


def model_source(args: argparse.Namespace) -> ModelSource:
    """The model's source as the plan file records it (validated: see ``ModelSource``); the
    micro-batch is the planner's to choose with --batch-size auto or --global-batch-size
    alone."""
    batch = 1 if args.batch_size in ("auto", None) else args.batch_size
    if args.hf_config:
        return ModelSource(source=args.hf_config, entry="from_config", kind="hf-config",
                           args=parse_model_args(args.model_arg), batch_size=batch,
                           seq_len=args.seq_len)
    titan = torchtitan_shorthand(args.model)
    if titan is not None:  # torchtitan's RoPE caches are sized to training.seq_len
        return ModelSource(source=TORCHTITAN_ENTRY, kind="import", batch_size=batch,
                           seq_len=args.seq_len, args={**titan, "seq_len": args.seq_len,
                                                       **parse_model_args(args.model_arg)})
    return ModelSource(source=args.model, entry=args.entry, kind=source_kind(args.model),
                       args=parse_model_args(args.model_arg), batch_size=batch,
                       seq_len=args.seq_len)


def _compile_mode(args: argparse.Namespace) -> None:
    """``--compile`` takes an optional ``auto``; a word after a bare ``--compile`` that is not
    ``auto``/``on`` is the MODEL (``--compile model.py``), given back to it."""
    if args.compile in (None, "on", "auto"):
        return
    if args.model is None:
        args.model, args.compile = args.compile, "on"
        return
    raise BadInput(f"--compile {args.compile!r}: give --compile alone (compiled blocks) or "
                   "--compile auto (eager and compiled planned, the better kept).")


def run(args: argparse.Namespace) -> int:
    # one short process: [Note: pausing the cycle collector], [Note: ending the process]
    with cycle_collector_paused(collect_after=False, resume=not process_ends_after_command()):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    _compile_mode(args)
    values = validate(args)
    if not args.model and not args.hf_config:
        raise BadInput("give a MODEL file (or --hf-config config.json).")
    if args.model and args.hf_config:
        raise BadInput(f"give either MODEL ({args.model!r}) or --hf-config ({args.hf_config!r}), "
                       "not both: --hf-config builds the model from the config alone.")
    source = model_source(args)
    fixed_steps = fixed_accumulation(args)
    progress = (lambda m: sys.stderr.write(f"fsdp-plan: {m}\n")) if args.format == "table" else None
    request = PlanRequest(
        source=source, budget_bytes=values["budget"], headroom_bytes=values["headroom"],
        world_size=args.world_size, gpus_per_node=args.gpus_per_node, strategy=args.strategy,
        param_dtype=values["param_dtype"], reduce_dtype=values["reduce_dtype"],
        autocast_dtype=values["autocast"], optimizer=args.optimizer, hardware=values["hardware"],
        hardware_origin=values["hardware_origin"],
        allow_offload=args.allow_offload, allow_lossy_hooks=args.allow_lossy_hooks,
        optimizer_overlap=args.optimizer_overlap,
        # --batch-size N with --global-batch-size: N is the micro-batch (fixed_accumulation)
        global_batch_size=None if fixed_steps else args.global_batch_size,
        grad_accum_steps=fixed_steps or 1, compile_blocks=args.compile is not None,
        activation_memory_budget=args.activation_memory_budget, framework=args.framework,
        search=SearchOptions(exact_analysis=args.exact_analysis,
                             auto_batch=args.batch_size == "auto",
                             compile_auto=args.compile == "auto"))
    cache = facts_cache_for(args)
    with _user_code_guard(request, cache):
        result = make_plan(request, progress, facts_cache=cache)
        if args.verify and result.loaded is not None and result.plan.offload:
            if progress:  # [Note: offload as the last resort]: one memory on a CPU
                progress("verify: skipped, an offloaded plan's device peak can be measured on "
                         "a GPU only (python -m fsdp_plan.bench.gpu_check PLAN.yaml)")
        elif args.verify and result.loaded is not None:
            verify_by_measurement(result, result.loaded, progress)
    if fixed_steps:
        result.plan.predicted["global_batch_size"] = args.global_batch_size
        result.reasons = [(f"micro-batch {args.batch_size} as --batch-size gives, x "
                           f"{fixed_steps} accumulation step(s) to make up --global-batch-size "
                           f"{args.global_batch_size} over {args.world_size} ranks"),
                          *result.reasons]
    frontier = None
    if args.html or args.format == "table":  # the page's frontier, or the report's line
        if progress:
            progress("searching other budgets: what more memory would buy")
        frontier = plan_frontier(result, request, above_only=not args.html)
    extra = picture_files(args, result, values, frontier) if pictures.wanted(args) else []
    if args.plan:
        result.relocate_source(os.path.dirname(os.path.abspath(args.plan)))
    rows = ([candidate_row(c) for c in result.ranked[: args.top]]
            + [candidate_row(c) for c in result.recipes])
    # Write before printing: a write that fails (disk full) then leaves no report behind
    # that reads as success.
    written = result.write(policy=args.output, plan=args.plan, trace=args.trace, extra=extra)
    if args.format == "json":
        print(json.dumps({"plan": result.plan.to_dict(), "candidates": rows,
                          **({"framework": result.framework.line()} if result.framework else {}),
                          "reasons": result.reasons, "batch_options": result.batch_options,
                          "meshes": gather_mesh_rows(result.ranked),
                          "modules": gather_module_rows(result.facts.graph, result.facts.analysis),
                          **({"frontier": frontier.to_dict()} if frontier else {}),
                          "planning_seconds": round(result.seconds, 3)}, default=str))
    else:
        print(format_report(result, rows, model_name=args.model or args.hf_config,
                            hardware=values["hardware"], hardware_file=args.hardware,
                            more_memory=more_memory_line(frontier) if frontier else ""))
    for path in written if progress else ():
        progress(f"wrote {path}")
    return 0


def facts_cache_for(args: argparse.Namespace) -> FactsCache | None:
    """The facts cache ([Note: the facts cache] in facts/cache.py), unless ``--no-cache`` or
    ``FSDP_PLAN_NO_CACHE``, or the command needs the live model: ``--verify`` measures it
    (``--framework`` reads the model's outline, kept beside its facts)."""
    return None if args.verify else facts_cache_of(args)


def _user_code_guard(request: PlanRequest, cache: FactsCache | None):
    """The model's print()s kept off stdout while it is built and traced. Imported only when
    it is (model.load imports torch, about 6 s, and every flag was to be checked before that
    wait: see the note under the imports); facts from the cache run no model code."""
    one_batch = request.global_batch_size is None and not request.search.auto_batch
    if cache is not None and one_batch and not request.search.compile_auto and cache.has(
            request.source, request.analysis_options()) and (
            request.framework is None or cache.has_outline(request.source)):
        return contextlib.nullcontext()
    from fsdp_plan.model.load import user_code_output_to_stderr  # torch: see above
    return user_code_output_to_stderr()


def plan_frontier(result, request: PlanRequest, *, above_only: bool):
    """The frontier around the chosen plan (search/frontier.py): the request as the plan
    chose it (reduce dtype, gradient sync, accumulation), every micro-batch analysed."""
    import dataclasses

    plan = result.plan
    chosen = result.request or request
    chosen = chosen.at_its_micro_batch()
    variants = [Variant(micro_batch=b, grad_accum_steps=k, facts=facts)
                for b, (k, facts) in sorted(result.facts_by_micro_batch.items())] or [
        Variant(micro_batch=plan.model.batch_size, grad_accum_steps=plan.grad_accum_steps,
                facts=result.facts)]
    if result.compiled_facts:  # --compile auto: every budget weighs eager and compiled blocks
        variants = [dataclasses.replace(v, facts=f) for v in variants
                    for f in _eager_and_compiled(result.compiled_facts.get(v.micro_batch,
                                                                           v.facts))]
    return compute_frontier(variants, chosen.settings(), seq_len=plan.model.seq_len,
                            count=10 if not above_only else 3, above_only=above_only,
                            evaluator=result.evaluator)


def _eager_and_compiled(facts):
    """``facts`` with its compiled partitions and without (the eager model of the same
    analysis, search/compile_choice.py)."""
    if facts.analysis.compiled is None:
        return [facts]
    return [facts, eager_facts(facts)]


def picture_files(args: argparse.Namespace, result, values: dict[str, Any], frontier):
    """``--html`` and ``--memory-snapshot`` of the chosen plan, as predicted."""
    prediction = predict(result.plan, result.facts, hardware=values["hardware"],
                         gpus_per_node=args.gpus_per_node)
    model = " ".join([args.model or args.hf_config, *args.model_arg])
    return pictures.files(args, title=f"fsdp-plan: {model} on {args.world_size} GPUs",
                          plan=result.plan, facts=result.facts, prediction=prediction,
                          hardware=values["hardware"], hardware_file=args.hardware,
                          name=result.best.name, frontier=frontier)
