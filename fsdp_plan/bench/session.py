"""One benchmark session, shared by ``fsdp-plan bench`` and the torchrun worker entry (both in
``cli/bench.py``): validate the inputs before any work (``prepare``), then turn every rank's
figures into one result file, a report and an exit code (``finish``).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from fsdp_plan.api import analyze_for_plan, plan_hardware, predict
from fsdp_plan.bench import inputs, results
from fsdp_plan.bench.inputs import BenchRequest
from fsdp_plan.bench.overlap import held_refusal, overlap_figures
from fsdp_plan.bench.refit import check_refit_path, refit
from fsdp_plan.common.errors import BadInput, CheckFailed
from fsdp_plan.common.files import atomic_write_all, check_outputs
from fsdp_plan.cost.hardware.stored import hardware_of
from fsdp_plan.measure import runtime
from fsdp_plan.measure.memory import measure_peak
from fsdp_plan.measure.profile import stream_intervals
from fsdp_plan.measure.worker_setup import source_payload
from fsdp_plan.model.load import LoadedModel, user_code_output_to_stderr
from fsdp_plan.pictures import files as pictures
from fsdp_plan.pictures.snapshot import measured_snapshot
from fsdp_plan.plan.document import Plan, read_plan
from fsdp_plan.plan.read import plan_input_files


@dataclass(kw_only=True)
class Prepared:
    """Everything checked before launching: the request, the plan, the model, the run's mesh,
    the payload."""

    request: BenchRequest
    plan: Plan
    loaded: LoadedModel
    nproc: int
    mesh: tuple[int, int]
    payload: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    old_result: dict[str, Any] | None = None
    """``--compare``'s result, read and checked."""
    predicted_trace: dict[str, Any] | None = None
    """``--predicted-trace``, read and checked."""


def run_mesh(plan: Plan, nproc: int) -> tuple[tuple[int, int], list[str]]:
    """The ``(replicate, shard)`` mesh for ``nproc`` ranks: the plan's own when ``nproc`` is its
    world size; else plain FSDP over ``nproc``, or HSDP keeping the plan's shard size."""
    replicate, shard = runtime.mesh_shape(plan.mesh)
    notes = []
    if nproc == plan.world_size:
        mesh = (replicate, shard)
    elif replicate == 1:
        mesh = (1, nproc)
    elif nproc % shard == 0:
        mesh = (nproc // shard, shard)
    else:
        raise BadInput(f"{nproc} ranks cannot hold the plan's HSDP shard groups of {shard}; "
                       f"run a multiple of {shard} (--nproc, or WORLD_SIZE under torchrun; the "
                       f"plan is for {plan.world_size} ranks).")
    if nproc != plan.world_size:
        notes.append(f"running {nproc} ranks (mesh {mesh[0]}x{mesh[1]}) for a plan made for "
                     f"{plan.world_size}: collective counts per rank do not depend on the world "
                     "size, step time and communication do.")
    if mesh[1] == 1 and shard > 1:
        notes.append("shard groups of 1 issue no all-gather or reduce-scatter, so counts cannot "
                     "match a plan made for sharded groups.")
    return mesh, notes


def prepare(request: BenchRequest, *, nproc: int) -> Prepared:
    """Read and check every input before any worker starts (bad input fails fast, exit 2):
    the plan and its model, ``--compare``, ``--predicted-trace``, ``--refit`` and ``--out``
    (the numbers were checked when ``request`` was made). Creates nothing but the run's
    private trace folder, last (the caller removes it)."""
    if nproc < 1:
        raise BadInput(f"--nproc must be at least 1, got {nproc}.")
    old = results.read_result(request.compare) if request.compare else None
    predicted_trace = (inputs.read_predicted_trace(request.predicted_trace)
                       if request.predicted_trace else None)
    inputs.check_out_folder(request.out)
    plan = read_plan(request.plan_path)  # data only: its model.source is an input too (S4-02)
    check_outputs([*plan_input_files(plan, request.plan_path, request.model_path),
                   ("--compare", request.compare), ("--predicted-trace", request.predicted_trace)],
                  [*pictures.outputs(request), ("--refit", request.refit)])
    pictures.check(request)
    if request.refit:  # checked before the run: a bad file fails fast
        check_refit_path(request.refit)
    if request.fsdp_version == 1 and plan.compile is not None:
        raise BadInput(compiled_fsdp1_refusal(request.plan_path))
    if request.fsdp_version == 1 and plan.optimizer_overlap:
        raise BadInput(f"{request.plan_path!r} steps its optimizer in backward "
                       "(optimizer_overlap), which the policy installs on FSDP2 and DDP only; "
                       "bench it without --fsdp1.")
    if request.baseline is not None:
        check_baseline(request, plan)
    loaded = runtime.load_planned_model(plan, request.model_path, request.plan_path)
    mesh, notes = run_mesh(plan, nproc)
    payload = {
        "source": source_payload(loaded.source),
        "policy_source": runtime.policy_source(plan), "mesh": list(mesh),
        "fsdp_version": request.fsdp_version, "optimizer": plan.optimizer,
        "warmup": request.warmup, "steps": request.steps,
        # a GPU records its allocator over one more steady step for --memory-snapshot
        "memory_snapshot": bool(request.memory_snapshot),
        "baseline": request.baseline,
    }
    payload["trace_dir"] = tempfile.mkdtemp(prefix="fsdp-plan-traces-")
    try:
        return Prepared(request=request, plan=plan, loaded=loaded, nproc=nproc, mesh=mesh,
                        payload=payload, notes=notes, old_result=old,
                        predicted_trace=predicted_trace)
    except BaseException:  # a signal right here: the caller never sees the folder
        shutil.rmtree(payload["trace_dir"], ignore_errors=True)
        raise


def check_baseline(request: BenchRequest, plan: Plan) -> None:
    """``--baseline no-overlap`` runs what measure/no_overlap.py can hold: FSDP2 and DDP plans,
    DDP without a communication hook of its own."""
    if request.fsdp_version == 1:
        raise BadInput("--baseline no-overlap holds communication for FSDP2 and DDP plans; "
                       "with --fsdp1 it is not supported. Run bench without --fsdp1 to see "
                       "what overlap buys the plan.")
    refused = held_refusal(plan)
    if refused:
        why, key = refused
        raise BadInput(f"--baseline no-overlap holds a DDP plan's buckets with a communication "
                       f"hook of its own, and {request.plan_path!r} {why}. Bench it without "
                       f"--baseline, or bench a copy of the plan without {key} with --baseline "
                       "no-overlap.")


def _predicted_contention(prepared: Prepared) -> float | None:
    """The cost model's backward contention for the plan as written
    (``StepTime.backward_contention_s``)."""
    with user_code_output_to_stderr():  # the prediction runs the model (fake tensors)
        facts = analyze_for_plan(prepared.plan, prepared.loaded)
        return predict(prepared.plan, facts).candidate.time.backward_contention_s


def compiled_fsdp1_refusal(plan_path: str) -> str:
    """Why ``--fsdp1`` does not run a plan made with ``--compile``, and what to do."""
    return (f"--fsdp1: {plan_path!r} was planned with --compile, and it compiles its repeated "
            "blocks the FSDP2 way (torch.compile(block.forward, fullgraph=True) after "
            "checkpointing, before fully_shard, so FSDP's hooks stay outside the graphs); FSDP1 "
            "wraps the blocks in FullyShardedDataParallel units with their own hooks, which is "
            "not what the plan's predictions were made for, and running it eager would "
            "benchmark a different plan under the same name. Run bench without --fsdp1 (FSDP2, "
            "the blocks compiled), or plan again without --compile to bench with FSDP1.")


def _cpu_memory(prepared: Prepared, record: bool = False) -> dict[str, Any]:
    """On CPU there is no allocator peak: measure the plan with FSDPMemTracker on the fake
    process group at the plan's world size (SPEC 5's CPU definition of peak); ``record``
    keeps the step's allocations for the pictures (under ``record``, not in the result)."""
    if prepared.request.fsdp_version != 2:
        return {"peak_bytes": None, "source": "not measured: FSDPMemTracker tracks FSDP2 only"}
    measured = measure_peak(prepared.loaded, prepared.plan,
                            runtime.load_policy(prepared.payload["policy_source"]),
                            record=record)
    return {"peak_bytes": measured.peak_bytes, "breakdown": measured.breakdown,
            "record": measured.record,
            "source": f"FSDPMemTracker on the fake process group at world size "
                      f"{prepared.plan.world_size} (CPU run: no allocator peak)"}


def finish(prepared: Prepared, ranks: list[dict[str, Any]]) -> int:
    """Write the result, print the report, check counts and ``--compare``; the exit code."""
    request = prepared.request
    if ranks and ranks[0].get("peak_bytes") is not None:
        memory = {"peak_bytes": max(r["peak_bytes"] for r in ranks),
                  "source": ranks[0].get("peak_source")
                  or "torch.cuda.max_memory_allocated over the timed steps"}
    else:
        # The tracked step runs the model here, in the main thread, whose print()s would go
        # to the report (cli/process.py [Note: the report owns file descriptor 1]) and break
        # --format json's one document (issue 31, S3-15): they go to stderr.
        with user_code_output_to_stderr():
            memory = _cpu_memory(prepared, record=pictures.wanted(request)
                                 and prepared.plan.strategy != "ddp")
    record = memory.pop("record", None)
    overlap = None
    if ranks and ranks[0].get("baseline"):
        overlap = {"how": ranks[0]["baseline"]["how"], **overlap_figures(
            ranks[0], ranks[0]["baseline"], _predicted_contention(prepared)).to_dict()}
    result = results.build_result(prepared, ranks, memory, overlap=overlap)
    problems = results.check_prediction(result)
    compare_table, compare_problems = "", []
    if prepared.old_result is not None:
        compare_table, compare_problems = results.compare(prepared.old_result, result,
                                                          request.threshold)
    try:
        path = results.write_result(result, request.out, trace_from=ranks[0]["trace"],
                                    predicted_trace=prepared.predicted_trace,
                                    held_trace_from=(ranks[0].get("baseline") or {}).get("trace"))
    except BadInput as e:  # the run is done: show its figures before saying they were not saved
        _print_report(result, prepared, compare_table)
        raise BadInput(f"{e} The figures above were measured but not saved.") from e
    result["path"] = path
    written = []
    if pictures.wanted(request):
        with user_code_output_to_stderr():  # the prediction under the page runs the model
            written = _write_pictures(prepared, ranks[0], record)
    _print_report(result, prepared, compare_table)
    for picture in written:
        print(f"picture written to {picture}", file=sys.stderr)
    if request.refit:
        start = None
        if prepared.plan.hardware is not None:  # the figures the plan was predicted with
            start = hardware_of(prepared.plan.hardware)
        hw, f = refit(request.refit, prepared.plan.gpu, result, start)
        print(f"refit {request.refit}: compute x{f['compute']:.3g}, communication "
              f"x{f['communication']:.3g}, optimizer x{f['optimizer']:.3g} ({hw.name}); plan "
              f"or predict with --hardware {request.refit}", file=sys.stderr)
    failures = problems + compare_problems
    if failures:
        raise CheckFailed("; ".join(failures) + f". The result was still written to {path}.")
    print(f"result written to {path}", file=sys.stderr)
    return 0


def _print_report(result: dict[str, Any], prepared: Prepared, compare_table: str) -> None:
    if prepared.request.format == "json":
        print(json.dumps(result, indent=2, default=str))
        return
    text = results.format_report(result, prepared.notes)
    print(text + ("\n\n" + compare_table if compare_table else ""))


def _write_pictures(prepared: Prepared, rank0: dict[str, Any], record: Any) -> list[str]:
    """``--html`` (the prediction with the measured memory curve and the measured streams)
    and ``--memory-snapshot`` (the measured step: the CUDA allocator's own snapshot on a GPU,
    FSDPMemTracker's recorded step on a CPU, the prediction for a DDP plan on a CPU)."""
    import pickle

    # the prediction drawn under the measurement (api is above bench: imported when drawing)
    request, plan = prepared.request, prepared.plan
    facts = analyze_for_plan(plan, prepared.loaded)
    prediction = predict(plan, facts)
    frontier, notes = (pictures.frontier_of(plan, facts, prediction) if request.html
                       else (None, []))
    snapshot = None
    if rank0.get("snapshot"):
        with open(rank0["snapshot"], "rb") as f:
            snapshot = pickle.load(f)
        label = "measured (CUDA allocator over a steady step)"
    elif record is not None:
        snapshot = measured_snapshot(record)
        label = "measured (FSDPMemTracker on the fake process group)"
    else:
        label = ""
        notes.append("no measured allocation trace for this run (a DDP plan on a CPU): the "
                     "snapshot is the prediction's.")
    streams = stream_intervals(rank0["trace"]) if rank0.get("trace") else None
    files = pictures.files(
        request, title=f"fsdp-plan bench: {plan.model.source} on {prepared.nproc} "
        "rank(s)", plan=plan, facts=facts, prediction=prediction, hardware=plan_hardware(plan),
        frontier=frontier, record=record, measured_label=label, measured_snapshot=snapshot,
        measured_streams=streams, notes=notes + prepared.notes)
    atomic_write_all(files)
    return [path for path, _ in files]
