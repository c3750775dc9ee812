"""Dry-run a plan on the fake process group and compare the measured peak with the prediction.

    fsdp-plan verify PLAN.yaml [MODEL] [--tolerance 0.05] [--format table|json]

Rebuilds the planned model under ``FakeTensorMode`` at the plan's real world size and mesh,
applies the policy module rendered from the plan (what users import), runs a warm-up and a
steady step under ``FSDPMemTracker`` and prints predicted vs measured peak, by component and
per unit. Exit 0 when the measured peak fits ``budget - headroom`` and is within
``--tolerance`` of the prediction, 1 when not, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tabulate import tabulate

from fsdp_plan.api import analyze_for_plan, plan_hardware, predict
from fsdp_plan.cli.cache_flag import add_no_cache, facts_cache_of
from fsdp_plan.common.errors import BadInput, CheckFailed
from fsdp_plan.common.files import atomic_write_all, check_outputs
from fsdp_plan.common.progress import Steps
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.cost.memory_categories import tracker_to_breakdown
from fsdp_plan.facts.cache import FactsCache
from fsdp_plan.measure import runtime
from fsdp_plan.measure.measured import MeasuredMemory
from fsdp_plan.measure.peak import measured_peak
from fsdp_plan.model.load import LoadedModel, user_code_output_to_stderr
from fsdp_plan.pictures import files as pictures
from fsdp_plan.pictures.snapshot import measured_snapshot
from fsdp_plan.plan.document import Plan, read_plan
from fsdp_plan.plan.read import plan_input_files

TRACKER_TO_PLAN = tracker_to_breakdown()
"""FSDPMemTracker's categories -> the planner's breakdown keys (cost/memory_categories.py)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.yaml", help="a plan written by fsdp-plan --plan")
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None,
                        help="the model file (default: the source recorded in the plan)")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="largest accepted |measured - predicted| / measured (default 0.05)")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    add_no_cache(parser)
    pictures.add_arguments(parser, measured=True)


def gather_data(plan: Plan, measured: MeasuredMemory, tolerance: float,
                fresh: dict[str, Any] | None = None, fresh_note: str | None = None
                ) -> dict[str, Any]:
    """Everything the report shows and the checks decide, as plain data.

    The measurement is held against the plan file's stored prediction (what other programs
    read) and against ``fresh``, the prediction of the plan as it is now (``api.predict``);
    either off by more than ``tolerance`` fails. Without a stored prediction (a hand-written
    plan) the fresh one is the headline; ``fresh_note`` says why there is no fresh one."""
    stored = plan.predicted or {}
    fresh = fresh or {}
    stored_peak = stored.get("peak_bytes")
    fresh_peak = fresh.get("peak_bytes")
    predicted = stored if stored_peak is not None else fresh
    predicted_peak = stored_peak if stored_peak is not None else fresh_peak
    limit = plan.budget_bytes - plan.headroom_bytes
    measured_by_key: dict[str, int] = {}
    for category, value in measured.breakdown.items():
        key = TRACKER_TO_PLAN.get(category, category)
        measured_by_key[key] = measured_by_key.get(key, 0) + value
    predicted_by_key = {k: int(v) for k, v in (predicted.get("breakdown") or {}).items()
                        if isinstance(v, (int, float))}
    if "loss" in predicted_by_key:  # the trackers count what the loss holds as activations
        predicted_by_key["activations"] = (predicted_by_key.get("activations", 0)
                                           + predicted_by_key.pop("loss"))
    keys = [k for k in dict.fromkeys([*TRACKER_TO_PLAN.values(), *predicted_by_key])
            if measured_by_key.get(k) or predicted_by_key.get(k)]
    components = [{"component": k, "predicted_bytes": predicted_by_key.get(k),
                   "measured_bytes": measured_by_key.get(k, 0)} for k in keys]
    predicted_units = {u.get("key"): u for u in predicted.get("units") or [] if isinstance(u, dict)}
    units = [{"unit": u.key or "<root>", "reshard_after_forward": u.reshard_after_forward,
              "predicted": {k: v for k, v in predicted_units.get(u.key, {}).items()
                            if k != "key" and isinstance(v, (int, float))},
              "measured_peak_bytes": measured.module_peaks.get(u.key)} for u in plan.units]
    def off_by(peak: int | None) -> float | None:
        if peak is None or not measured.peak_bytes:
            return None
        return abs(measured.peak_bytes - peak) / measured.peak_bytes
    rel, fresh_rel = off_by(predicted_peak), off_by(fresh_peak)
    problems = []
    if measured.peak_bytes > limit:
        problems.append(f"measured peak {format_bytes(measured.peak_bytes)} exceeds budget - "
                        f"headroom = {format_bytes(limit)}")
    if rel is not None and rel > tolerance:
        problems.append(f"measured peak {format_bytes(measured.peak_bytes)} differs from the "
                        f"predicted {format_bytes(predicted_peak)} by {rel:.1%} (tolerance "
                        f"{tolerance:.1%})")
    if fresh_peak != predicted_peak and fresh_rel is not None and fresh_rel > tolerance:
        problems.append(f"measured peak {format_bytes(measured.peak_bytes)} differs from the "
                        f"plan's prediction as it is now, {format_bytes(fresh_peak)}, by "
                        f"{fresh_rel:.1%} (tolerance {tolerance:.1%})")
    if measured.dtype_mismatches:
        more = len(measured.dtype_mismatches) - 1
        problems.append(f"a real device would refuse this step: {measured.dtype_mismatches[0]}"
                        + (f" (and {more} more)" if more else "") + "; fake kernels accept mixed "
                        "dtypes, real ones do not: make that module a fully_shard unit (its "
                        "inputs are then cast to param_dtype) or keep the model's float buffers "
                        "in param_dtype")
    notes = list(measured.notes)
    if fresh_note:
        notes.append(fresh_note)
    if predicted_peak is None:
        notes.append("the plan has no predicted peak; only the budget was checked.")
    elif fresh_peak is not None and stored_peak is not None and stored_peak != fresh_peak:
        notes.append(f"the plan file's stored peak {format_bytes(stored_peak)} is not what the "
                     f"plan predicts now ({format_bytes(fresh_peak)}): it was edited, or "
                     "fsdp-plan's model changed since; re-plan or run fsdp-plan predict.")
    return {"model": plan.model.source, "world_size": plan.world_size,
            "mesh": {"replicate": plan.mesh.replicate, "shard": plan.mesh.shard},
            "budget_bytes": plan.budget_bytes, "headroom_bytes": plan.headroom_bytes,
            "limit_bytes": limit, "predicted_peak_bytes": predicted_peak,
            "stored_peak_bytes": stored_peak, "fresh_peak_bytes": fresh_peak,
            "fresh_prediction": fresh_peak is not None,
            "measured_peak_bytes": measured.peak_bytes, "relative_error": rel,
            "fresh_relative_error": fresh_rel,
            "tolerance": tolerance, "components": components, "units": units,
            "measured": measured.to_dict(), "notes": notes, "problems": problems,
            "ok": not problems}


def _cell(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def format_report(data: dict[str, Any]) -> str:
    rows = [[c["component"], _cell(c["predicted_bytes"]), _cell(c["measured_bytes"]),
             "-" if c["predicted_bytes"] is None else _cell(c["measured_bytes"] - c["predicted_bytes"])]
            for c in data["components"]]
    rows.append(["PEAK", _cell(data["predicted_peak_bytes"]), _cell(data["measured_peak_bytes"]),
                 "-" if data["predicted_peak_bytes"] is None
                 else _cell(data["measured_peak_bytes"] - data["predicted_peak_bytes"])])
    mesh = data["mesh"]
    head = (f"verify {data['model']} at world size {data['world_size']} (mesh "
            f"{mesh['replicate']}x{mesh['shard']}) {data.get('where', 'on the fake process group')} "
            f"({data['measured']['seconds']:.1f} s)")
    legend = ("breakdown at the peak (measured: FSDPMemTracker; Temp counts as activations, "
              "all-gather/reduce-scatter buffers as comm_buffers)")
    parts = [head, "", legend,
             tabulate(rows, headers=["component", "predicted", "measured", "measured - predicted"])]
    unit_fields = sorted({k for u in data["units"] for k in u["predicted"]})
    if data["units"]:
        unit_rows = [[u["unit"], "yes" if u["reshard_after_forward"] else "no",
                      *[_cell(u["predicted"].get(k)) if k.endswith("bytes")
                        else u["predicted"].get(k, "-") for k in unit_fields],
                      _cell(u["measured_peak_bytes"])] for u in data["units"]]
        parts += ["", tabulate(unit_rows, headers=["unit", "reshard", *[f"predicted {k}" for k in
                                                                       unit_fields],
                                                   "measured peak while it ran"])]
    rel = data["relative_error"]
    parts += ["", f"budget {_cell(data['budget_bytes'])} - headroom {_cell(data['headroom_bytes'])}"
                  f" = {_cell(data['limit_bytes'])}; measured peak {_cell(data['measured_peak_bytes'])}"
                  + ("" if rel is None else f"; off the prediction by {rel:.1%} "
                     f"(tolerance {data['tolerance']:.1%})")]
    parts += [f"note: {n}" for n in data["notes"]]
    parts.append("verify: " + ("OK" if data["ok"] else "FAILED: " + "; ".join(data["problems"])))
    return "\n".join(parts)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.tolerance < 1:
        raise BadInput(f"--tolerance is a fraction (0.05 = 5%), got {args.tolerance}.")
    plan = read_plan(args.plan)  # data only: its model.source is an input too (S4-02)
    check_outputs(plan_input_files(plan, args.plan, args.model), pictures.outputs(args))
    pictures.check(args)
    if plan.strategy == "ddp" and args.memory_snapshot:
        pictures.refuse_with(args, "a DDP plan is measured in a separate one-rank process that "
                             "records no allocation trace; fsdp-plan predict --memory-snapshot "
                             "writes the predicted one")
    loaded = runtime.load_planned_model(plan, args.model, args.plan)
    progress = Steps(total=3, quiet=args.format == "json", what="verify")
    progress.step("analysing the model at the plan's precision")
    fresh, fresh_note, facts, prediction = fresh_prediction(plan, loaded, facts_cache_of(args))
    if prediction is None:  # before the measurement: nothing to draw the measurement over
        pictures.refuse_with(args, "the plan cannot be predicted as written, so there is no "
                             "predicted step to draw")
    policy = runtime.load_policy(runtime.policy_source(plan))
    progress.step("measuring a steady step of one rank on real CPU tensors (a DDP rank holds "
                  "the whole model at any world size)" if plan.strategy == "ddp" else
                  f"measuring a steady step at world size {plan.world_size}")
    with user_code_output_to_stderr():  # the model's print()s stay off the report
        measured = measured_peak(loaded, plan, policy, record=pictures.wanted(args))
    progress.step("comparing")
    progress.close()
    data = gather_data(plan, measured, args.tolerance, fresh, fresh_note)
    if measured.where:
        data["where"] = measured.where
    if pictures.wanted(args):
        _write_pictures(args, plan, facts, prediction, measured)
    if args.format == "json":
        print(json.dumps(data, indent=2))
    else:
        print(format_report(data))
    if not data["ok"]:
        raise CheckFailed("; ".join(data["problems"]) + ".")
    return 0


def fresh_prediction(plan: Plan, loaded: LoadedModel, facts_cache: FactsCache | None = None
                     ) -> tuple[dict[str, Any] | None, str | None, Any, Any]:
    """The plan's prediction as it is now (its ``predicted`` block, or None and the reason it
    cannot be predicted), and the facts and ``Prediction`` behind it (for the pictures);
    ``facts_cache`` as ``analyze_for_plan`` reads it."""
    facts = None
    try:
        facts = analyze_for_plan(plan, loaded, facts_cache=facts_cache)
        prediction = predict(plan, facts)
    except BadInput as e:
        return None, (f"the plan cannot be predicted as written ({e}); the measurement is held "
                      "against the plan file's stored prediction."), facts, None
    return prediction.predicted, None, facts, prediction


def _write_pictures(args: argparse.Namespace, plan: Plan, facts, prediction, measured) -> None:
    """``--html`` (prediction with the measured curve over it) and ``--memory-snapshot``
    (the measured step), written whatever the check decides: they show why it failed."""
    frontier, notes = pictures.frontier_of(plan, facts, prediction) if args.html else (None, [])
    record = measured.record
    snapshot = measured_snapshot(record) if record is not None else None
    files = pictures.files(
        args, title=f"fsdp-plan verify: {plan.model.source} at world size "
        f"{plan.world_size}", plan=plan, facts=facts, prediction=prediction,
        hardware=plan_hardware(plan), frontier=frontier, record=record,
        measured_label="measured (FSDPMemTracker, highest between module boundaries)",
        measured_snapshot=snapshot, notes=notes + list(measured.notes))
    atomic_write_all(files)
    if args.format == "table":
        for path, _ in files:
            print(f"fsdp-plan verify: wrote {path}", file=sys.stderr)
