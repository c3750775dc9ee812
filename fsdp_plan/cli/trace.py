"""Read your own run's profiler traces: step split, exposed communication, buckets, stragglers.

    fsdp-plan trace TRACES... [--plan P.yaml] [MODEL] [--html R.html] [--refit HW.yaml]
                    [--format table|json]

TRACES are ``torch.profiler`` traces (``export_chrome_trace`` or ``tensorboard_trace_handler``
output, ``.json`` or ``.json.gz``), one per rank, or folders of them, from any training loop:
no annotation of fsdp-plan's is needed, only ``prof.step()`` once per step. ``--format json``
prints SPEC 8's document. Exit 2 for an unreadable trace, with nothing written.
"""

from __future__ import annotations

import argparse
import json
import os

from fsdp_plan.bench.trace_refit import refit_text
from fsdp_plan.cli.cache_flag import add_no_cache, facts_cache_of
from fsdp_plan.cli.trace_plan import attach_plan
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.files import atomic_write_all, check_writable
from fsdp_plan.measure.trace_ranks import TraceAnalysis, analyze_traces, median_of
from fsdp_plan.pictures.trace_page import trace_page

_MS = 1e3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", metavar="TRACES",
                        help="profiler trace files (.json, .json.gz), one per rank, or folders "
                        "of them; a model file (.py) given last is the MODEL")
    parser.add_argument("--plan", default=None, metavar="P.yaml",
                        help="a plan file: its prediction is shown beside the measured figures "
                        "and its model says which bucket_cap_mb built DDP's buckets")
    parser.add_argument("--html", default=None, metavar="R.html",
                        help="write a page with one stable step's measured timeline")
    parser.add_argument("--refit", default=None, metavar="HW.yaml",
                        help="write a hardware file fitted from the trace (read by --hardware); "
                        "with --plan, its compute and optimizer rates too")
    parser.add_argument("--format", choices=("table", "json"), default="table",
                        help="table (default): a summary per rank; json: SPEC 8's document")
    add_no_cache(parser)  # the model's facts, for --plan's DDP bucket cap
    # TRACES... --plan P.yaml MODEL: positionals on both sides of a flag (SPEC 8's order),
    # which plain parse_args refuses ("unrecognized arguments: MODEL")
    parser.parse_args = parser.parse_intermixed_args  # type: ignore[method-assign]


def _split_model(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """(trace paths, MODEL): a trailing ``.py`` file or ``module:attr`` is the model."""
    traces = list(args.traces)
    if len(traces) > 1 and (traces[-1].endswith(".py") or (":" in traces[-1]
                                                           and not os.path.exists(traces[-1]))):
        return traces[:-1], traces[-1]
    return traces, None


def _check_outputs(args: argparse.Namespace, traces: list[str]) -> None:
    for flag, path in (("--html", args.html), ("--refit", args.refit)):
        if path is None:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise BadInput(f"{flag} {path!r}: the folder {parent!r} does not exist.")
        if os.path.isdir(path):
            raise BadInput(f"{flag} {path!r} is a folder; give a file name.")
        if os.path.abspath(path) in {os.path.abspath(t) for t in traces}:
            raise BadInput(f"{flag} {path!r} would overwrite a trace; choose another name.")


def gather_data(args: argparse.Namespace) -> TraceAnalysis:
    """The analysis of the traces given, with the plan's prediction when ``--plan`` is."""
    traces, model = _split_model(args)
    _check_outputs(args, traces)
    if model is not None and args.plan is None:
        raise BadInput(f"MODEL {model!r} is read with --plan (the plan records the input "
                       "shape and DDP settings the buckets are predicted with); give --plan.")
    analysis = analyze_traces(traces)
    if args.plan is not None:
        attach_plan(analysis, args.plan, model, facts_cache_of(args))
    return analysis


def advice(analysis: TraceAnalysis) -> str:
    """One line: where the median step's time goes and what would help."""
    exposed = median_of(analysis.ranks, "exposed_comm_s")
    delaying = median_of(analysis.ranks, "exposed_delaying_compute_s")
    host = median_of(analysis.ranks, "host_wait_s")
    step = median_of(analysis.ranks, "step_s")
    tail = median_of(analysis.ranks, "comm_tail_s")
    gpu = any(r.source == "gpu" for r in analysis.ranks)
    if gpu and exposed > 0 and host >= exposed - delaying and delaying < 0.5 * exposed:
        return ("nothing to gain from overlap here: the GPU waits for the host "
                f"({host * _MS:.2f} ms/step idle with nothing launched; compute waited for "
                f"communication {delaying * _MS:.2f} of {exposed * _MS:.2f} ms exposed)")
    if not gpu:  # a CPU run: no launch queue tells waiting compute apart ([Note: the measured
        # step split]); idle is Python between ops, exposed is the gloo collectives' own time
        # the tail runs to the last collective's end, so it holds the host's work before
        # that collective too and can be longer than the communication itself
        return (f"a CPU (gloo) run: {exposed * _MS:.2f} ms/step of communication with no op "
                f"beside it; the last collective ends {tail * _MS:.2f} ms after backward (the "
                f"tail); {host * _MS:.2f} ms/step no op ran (the host's own work)")
    if delaying > 0.1 * step:
        return (f"compute waits for communication {delaying * _MS:.2f} ms/step "
                f"({delaying / step:.0%}): more overlap (prefetch, smaller buckets or units) "
                f"or less traffic would shorten the step; the tail alone is {tail * _MS:.2f} ms")
    if host > 0.1 * step:
        return (f"the host is the bottleneck: {host * _MS:.2f} ms/step ({host / step:.0%}) the "
                "device had nothing launched (CUDA graphs, torch.compile or a larger batch help)")
    return "communication is mostly hidden; compute is the step's cost"


def _row(label: str, value_s: float, predicted: float | None = None) -> str:
    line = f"  {label:<28}{value_s * _MS:10.3f} ms"
    if predicted is not None:
        line += f"   predicted {predicted * _MS:10.3f} ms"
    return line


def render_table(analysis: TraceAnalysis) -> str:
    plan = analysis.predicted or {}
    predicted = plan.get("step") or {}
    lines = []
    for r in analysis.ranks:
        m = r.median()
        lines.append(f"rank {r.rank} of {r.world_size} ({r.device}, {r.source} trace "
                     f"{os.path.basename(r.path)}): {len(r.steps)} stable steps, step p50 "
                     f"{r.step_s_p50 * _MS:.3f} ms, p99 {r.step_s_p99 * _MS:.3f} ms")
        lines.append(f" median step {m.step}:")
        for name in ("step_s", "forward_s", "backward_s", "optimizer_s", "comm_tail_s",
                     "idle_s", "host_wait_s", "comm_s", "hidden_comm_s", "exposed_comm_s",
                     "exposed_delaying_compute_s", "overlap_slowdown_s"):
            lines.append(_row(name.removesuffix("_s"), getattr(m, name), predicted.get(name)))
        if r.collectives_per_step or plan.get("collectives_per_step"):
            line = "  collectives per step: " + (", ".join(
                f"{k} {v}" for k, v in sorted(r.collectives_per_step.items())) or "none")
            if plan.get("collectives_per_step"):
                line += "   predicted " + ", ".join(
                    f"{k} {v}" for k, v in sorted(plan["collectives_per_step"].items()) if v)
            lines.append(line)
        if r.collectives_by_unit:
            lines.append("  FSDP units: " + "; ".join(
                f"{unit or '<root>'} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
                for unit, c in r.collectives_by_unit.items()))
        if r.ddp_buckets or plan.get("ddp_buckets"):
            sizes = ", ".join("?" if b.bytes is None else f"{b.bytes / 2**20:.2f}"
                              for b in r.ddp_buckets) or "none"
            line = f"  DDP buckets (MiB, ready order): {sizes}"
            if plan.get("ddp_buckets"):
                line += "   predicted " + ", ".join(f"{b / 2**20:.2f}" for b in plan["ddp_buckets"])
            lines.append(line)
    if analysis.bucket_cap_mb is not None:
        lines.append(f"bucket_cap_mb that built these buckets: {analysis.bucket_cap_mb:g}")
    for s in analysis.stragglers[:3]:
        if s["waited_by_others_s"] > 0:
            lines.append(f"straggler: rank {s['rank']} kept the others waiting "
                         f"{s['waited_by_others_s'] * _MS:.3f} ms/step")
    lines.append("advice: " + advice(analysis))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    analysis = gather_data(args)
    outputs = []
    if args.refit is not None:
        outputs.append((args.refit, refit_text(analysis, args.plan, args.refit,
                                                facts_cache_of(args))))
    if args.html is not None:
        outputs.append((args.html, trace_page(analysis)))
    if outputs:
        for path, _ in outputs:
            check_writable(path, "--html" if path == args.html else "--refit")
        atomic_write_all(outputs)
    if args.format == "json":
        print(json.dumps(analysis.to_document(), indent=1))
    else:
        print(render_table(analysis))
        for path, _ in outputs:
            print(f"wrote {path}")
    return 0
