"""``--html`` and ``--memory-snapshot`` for every verb that draws (plan, predict, verify, bench,
tune): the options, their checks before any work, and the files they write.

The verbs (cli/, and bench/session.py for the torchrun worker) call it; it never calls them.
Nothing here imports torch or plotly at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.files import check_writable
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.pictures.html import plotly_or_exit, render_page
from fsdp_plan.pictures.page import gather, predicted_snapshot_of
from fsdp_plan.pictures.snapshot import snapshot_bytes
from fsdp_plan.plan.report import hardware_line, plan_name_legend
from fsdp_plan.search.frontier import Variant, compute_frontier, more_memory_line

if TYPE_CHECKING:
    from fsdp_plan.api import Prediction
    from fsdp_plan.facts.types import ModelFacts
    from fsdp_plan.plan.document import Plan
    from fsdp_plan.search.frontier import Frontier


def add_arguments(parser: argparse.ArgumentParser, *, measured: bool) -> None:
    """The two picture options; ``measured``: the verb measures a step (verify, bench)."""
    what = ("the measured step (FSDPMemTracker on a CPU, the CUDA allocator on a GPU)"
            if measured else "the predicted step")
    parser.add_argument("--html", default=None, metavar="REPORT.html",
                        help="write one self-contained page: memory over the step by what "
                        "holds it, the frontier of budgets, the two-stream timeline, per-block "
                        "checkpointing (needs the html extra: pip install 'fsdp-plan[html]')")
    parser.add_argument("--memory-snapshot", default=None, metavar="SNAP.pickle",
                        help=f"write {what} as a torch.cuda.memory._snapshot() pickle for "
                        "PyTorch's memory viewer (pytorch.org/memory_viz)")


def outputs(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """``(flag, path)`` of the picture outputs, for ``check_outputs``."""
    return [("--html", getattr(args, "html", None)),
            ("--memory-snapshot", getattr(args, "memory_snapshot", None))]


def check(args: argparse.Namespace) -> None:
    """Before any work: each path writable, and plotly importable when ``--html`` is given
    (exit 2 naming the extra)."""
    for flag, path in outputs(args):
        if path is not None:
            check_writable(path, flag)
    if getattr(args, "html", None):
        plotly_or_exit()


def wanted(args: argparse.Namespace) -> bool:
    return any(path for _, path in outputs(args))


def frontier_of(plan: Plan, facts: ModelFacts, prediction: Prediction) -> tuple[Any, list[str]]:
    """The frontier around a plan file's budget, searched with ``--strategy auto`` on the
    plan's precision, optimizer and accumulation (``None`` and why for a DDP plan)."""
    if prediction.evaluator is None:
        return None, ["no frontier: the plan's prediction kept no evaluator."]
    settings = dataclasses.replace(prediction.evaluator.settings, strategy="auto")
    variant = Variant(micro_batch=plan.model.batch_size,
                      grad_accum_steps=plan.grad_accum_steps, facts=facts)
    return compute_frontier([variant], settings,
                            seq_len=plan.model.seq_len), []


def header_lines(plan: Plan, hardware: Any, hardware_file: str | None, name: str,
                 frontier: Frontier | None) -> list[str]:
    """The first lines of a page: the GPU assumed, the plan, what more memory buys."""
    model = plan.model
    args = " ".join(f"{k}={v}" for k, v in (model.args or {}).items())
    lines = [hardware_line(hardware, hardware_file),
             (f"model {model.source} {args}: micro-batch {model.batch_size} x "
              f"sequence {model.seq_len}; {plan.world_size} GPUs, mesh "
              f"{plan.mesh.replicate}x{plan.mesh.shard} ({plan.strategy}); budget "
              f"{format_bytes(plan.budget_bytes)}, headroom "
              f"{format_bytes(plan.headroom_bytes)}"),
             f"plan: {name}"]
    if frontier is not None:
        lines.append(more_memory_line(frontier))
        lines.append(f"frontier: {len(frontier.points)} budgets, {frontier.searches} searches, "
                     f"{frontier.plans_evaluated} plans evaluated in {frontier.seconds:.1f} s "
                     f"({frontier.cpu_seconds:.1f} s of CPU)")
    return lines


def files(args: argparse.Namespace, *, title: str, plan: Plan, facts: ModelFacts,
          prediction: Prediction, hardware: Any, hardware_file: str | None = None,
          name: str = "", frontier: Frontier | None = None, record: Any = None,
          measured_label: str = "", measured_snapshot: dict[str, Any] | None = None,
          measured_streams: dict[str, list[tuple[float, float]]] | None = None,
          notes: list[str] | None = None) -> list[tuple[str, str | bytes]]:
    """The ``(path, content)`` of every picture asked for: the page, and the snapshot
    (``measured_snapshot`` when the verb measured one, else the prediction's)."""
    name = name or prediction.candidate.name
    page, timeline = gather(title=title, plan=plan, facts=facts, prediction=prediction,
                            header=header_lines(plan, hardware, hardware_file, name, frontier),
                            legend=plan_name_legend(name), frontier=frontier, record=record,
                            measured_label=measured_label, measured_streams=measured_streams,
                            notes=notes)
    out: list[tuple[str, str | bytes]] = []
    if args.html:
        out.append((args.html, render_page(page)))
    if args.memory_snapshot:
        snapshot = (measured_snapshot if measured_snapshot is not None
                    else predicted_snapshot_of(timeline, prediction.candidate.time))
        out.append((args.memory_snapshot, snapshot_bytes(snapshot)))
    return out


def refuse_with(args: argparse.Namespace, reason: str) -> None:
    """``BadInput`` for a picture this run cannot make (before any work)."""
    asked = [flag for flag, path in outputs(args) if path]
    if asked:
        raise BadInput(f"{' and '.join(asked)}: {reason}; nothing was written.")
