"""The report: the module table, the chosen plan beside alternatives and recipes, the timeline.

Pure formatting over plain data (``gather_*`` functions return rows; ``format_*`` print them),
so ``--format json`` and the tables show the same figures.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from tabulate import tabulate

from fsdp_plan.common.sizes import format_bytes, format_gb
from fsdp_plan.cost.comm_hooks import hook_kind
from fsdp_plan.cost.ddp_buckets import MIB
from fsdp_plan.cost.hardware import Hardware
from fsdp_plan.cost.memory_categories import summary_groups
from fsdp_plan.cost.precision import OPTIMIZER_STATES
from fsdp_plan.cost.step_time import StepTime
from fsdp_plan.facts.types import Analysis, ModelFacts, ModuleGraph
from fsdp_plan.plan.document import Plan
from fsdp_plan.search.candidate import Candidate, DDPDetail, OffloadDetail
from fsdp_plan.search.framework import FrameworkCost


class PlannedResult(Protocol):
    """What the report reads of a planning result (``api.PlanResult``)."""

    plan: Plan
    best: Candidate
    ranked: list[Candidate]
    facts: ModelFacts
    reasons: list[str]
    batch_options: list[dict[str, Any]]
    seconds: float
    framework: FrameworkCost | None
    """``--framework``: what keeping to its configuration costs (search/framework.py)."""


def gather_module_rows(graph: ModuleGraph, analysis: Analysis, max_depth: int = 2) -> list[dict[str, Any]]:
    """Per-module parameters, saved activations and FLOPs, down to ``max_depth``."""
    rows = []
    fw_incl, bw_incl = _inclusive_flops(graph, analysis)
    saved_incl = _inclusive_saved_bytes(graph, analysis)
    for fqn, info in graph.modules.items():
        depth = 0 if fqn == "" else fqn.count(".") + 1
        if depth > max_depth:
            continue
        comp = analysis.modules.get(fqn)
        saved = saved_incl[fqn]
        rows.append({
            "module": fqn or "<root>", "class": info.class_name, "params": info.subtree_numel,
            "param_bytes": fp32_bytes(info.subtree_numel), "saved_activation_bytes": saved,
            "fw_flops": fw_incl[fqn], "bw_flops": bw_incl[fqn],
            "calls": comp.calls if comp else 0,
        })
    return rows


def _inclusive_saved_bytes(graph: ModuleGraph, analysis: Analysis) -> dict[str, int]:
    """Bytes saved for backward by each module and its submodules (one pass, children first)."""
    saved: dict[str, int] = {}
    for fqn in reversed(list(graph.modules)):
        comp = analysis.modules.get(fqn)
        saved[fqn] = (comp.saved_bytes if comp else 0) + sum(
            saved[c] for c in graph.modules[fqn].children)
    # Ops outside every module (the loss) save their tensors in the root's name.
    saved[""] = sum(c.saved_bytes for c in analysis.modules.values())
    return saved


def _inclusive_flops(graph: ModuleGraph, analysis: Analysis) -> tuple[dict[str, float], dict[str, float]]:
    """Module FLOPs; containers that are never called (``ModuleList``) sum their children."""
    fw: dict[str, float] = {}
    bw: dict[str, float] = {}
    for fqn in reversed(list(graph.modules)):
        comp = analysis.modules.get(fqn)
        kids = graph.modules[fqn].children
        fw[fqn] = comp.fw_flops if comp and comp.calls else sum(fw[c] for c in kids)
        bw[fqn] = comp.bw_flops if comp and comp.bw_flops else sum(bw[c] for c in kids)
    fw[""], bw[""] = analysis.total_fw_flops, analysis.total_bw_flops
    return fw, bw


def candidate_row(c: Candidate) -> dict[str, Any]:
    """One candidate as a flat dict (shared by the table and JSON)."""
    return {
        "name": c.name, "fits": c.fits, "strategy": c.strategy,
        "mesh": f"{c.replicate}x{c.shard}", "units": len(c.units),
        "checkpointed_blocks": len(c.checkpointed),
        "selective_blocks": len(c.selective), "recompute_s": c.recompute_s,
        "peak_bytes": c.memory.peak_bytes, "peak_phase": c.memory.phase,
        "breakdown": c.memory.breakdown,
        "step_time_s": c.time.step_s, "exposed_comm_s": c.time.exposed_comm_s,
        "comm_tail_s": c.time.comm_tail_s, "hidden_comm_s": c.time.hidden_comm_s,
        "collectives": c.collectives,
        "cross_node_bytes": c.cross_node_bytes,
    }


def gather_checkpointing_rows(c: Candidate) -> list[dict[str, Any]]:
    """Per checkpointed block: its mode, the activation bytes the mode saves (against no
    checkpointing) and its recompute seconds in backward (search/evaluator.py [Note: recompute time])."""
    return [{"block": m.block, "mode": m.mode, "saved_bytes": m.saved_bytes,
             "recompute_s": m.recompute_s} for m in c.block_modes]


def format_checkpointing(c: Candidate, unavailable: str = "") -> str:
    """The chosen modes per block (runs of blocks alike on one row), with one line saying why
    selective checkpointing was not offered when it was not."""
    lines = [f"note: {unavailable}"] if unavailable else []
    rows = gather_checkpointing_rows(c)
    if not rows:
        return "\n".join(lines + ["activation checkpointing: none"])
    runs: list[list[dict[str, Any]]] = []
    for r in rows:
        last = runs[-1][-1] if runs else None
        if last and (last["mode"], last["saved_bytes"], round(last["recompute_s"], 9)) == (
                r["mode"], r["saved_bytes"], round(r["recompute_s"], 9)):
            runs[-1].append(r)
        else:
            runs.append([r])
    table = [[run[0]["block"] + (f" .. {run[-1]['block']}" if len(run) > 1 else ""), len(run),
              run[0]["mode"], format_bytes(run[0]["saved_bytes"]),
              f"{run[0]['recompute_s'] * 1e3:.2f}"] for run in runs]
    total_saved = sum(r["saved_bytes"] for r in rows)
    lines.append(tabulate(table, headers=["checkpointed blocks", "count", "mode",
                                          "saves (each)", "recompute ms (each)"]))
    lines.append(f"activation checkpointing saves {format_bytes(total_saved)} for "
                 f"{c.recompute_s * 1e3:.2f} ms of recompute per step")
    return "\n".join(lines)


_GROUPS = summary_groups()


def breakdown_summary(breakdown: dict[str, int]) -> str:
    """``states 12.3 + unsharded 4.5 + comm 1.2 + act 40.1`` (GB): why a peak is what it is."""
    parts = [f"{name} {format_gb(sum(breakdown.get(k, 0) for k in keys))}"
             for name, keys in _GROUPS.items()]
    return " + ".join(parts)


def format_candidates(rows: list[dict[str, Any]]) -> str:
    table = [[("* " if i == 0 and r["fits"] else "  ") + r["name"], "yes" if r["fits"] else "NO",
              r["mesh"], r["units"], r["checkpointed_blocks"], format_gb(r["peak_bytes"]),
              breakdown_summary(r["breakdown"]),
              f"{r['step_time_s'] * 1e3:.2f}", f"{r['exposed_comm_s'] * 1e3:.2f}",
              "/".join(str(r["collectives"][k]) for k in ("all_gather", "reduce_scatter", "all_reduce")),
              format_gb(r.get("cross_node_bytes", 0))]
             for i, r in enumerate(rows)]
    return tabulate(table, headers=["plan", "fits", "mesh", "units", "AC blocks", "peak GB",
                                    "peak = states + unsharded + comm + activations (GB)",
                                    "step ms", "exposed ms", "AG/RS/AR", "x-node GB"])


def gather_mesh_rows(candidates: list[Candidate]) -> list[dict[str, Any]]:
    """The best candidate of each sharding option (strategy and mesh), best first: how full
    sharding, every HSDP shard size and replication compare, with their cross-node traffic."""
    best: dict[tuple[str, int, int], Candidate] = {}
    for c in candidates:
        best.setdefault((c.strategy, c.replicate, c.shard), c)
    return [candidate_row(c) for c in best.values()]


def format_mesh_rows(rows: list[dict[str, Any]]) -> str:
    table = [[r["strategy"], r["mesh"], "yes" if r["fits"] else "NO", format_gb(r["peak_bytes"]),
              f"{r['step_time_s'] * 1e3:.2f}", format_gb(r["cross_node_bytes"]), r["name"]]
             for r in rows]
    return tabulate(table, headers=["strategy", "mesh (replicate x shard)", "fits", "peak GB",
                                    "step ms", "cross-node GB/step/GPU", "best plan of this mesh"])


def format_breakdown(breakdown: dict[str, int]) -> str:
    rows = [[k, format_bytes(v)] for k, v in sorted(breakdown.items(), key=lambda kv: -kv[1]) if v]
    return tabulate(rows, headers=["at the peak", "bytes per rank"])


def ascii_timeline(time: StepTime, width: int = 72) -> str:
    """Three lanes scaled to ``width``: compute, communication, and the waits, where compute
    stands still for communication (all-gather waits ``w``, the tail after backward ``!``);
    a fourth, the host issuing the device's work ``h``, where the host ran behind the device
    ([Note: the host floor] in cost/streams.py)."""
    end = max((e for _, _, _, e in time.spans), default=0.0) or 1.0
    lanes = {"compute": [" "] * width, "comm": [" "] * width, "wait": [" "] * width,
             "host": [" "] * width}
    for lane, label, start, stop in time.spans:
        a, b = int(start / end * (width - 1)), max(int(start / end * (width - 1)) + 1,
                                                    int(stop / end * (width - 1)))
        if lane == "wait":
            ch = "!" if "tail" in label else "w"
        elif lane == "host":
            ch = "h"
        else:
            ch = "F" if label.startswith("FW") else "B" if label.startswith("BW") else \
                "O" if label == "optimizer" else "g" if label.startswith("AG") else "r"
        for x in range(a, min(b, width)):
            lanes.get(lane, lanes["wait"])[x] = ch
    host = (["host    |" + "".join(lanes["host"]) + "|"] if time.host_wait_s > 0 else [])
    return "\n".join([
        "compute |" + "".join(lanes["compute"]) + "|",
        "comm    |" + "".join(lanes["comm"]) + "|",
        "waits   |" + "".join(lanes["wait"]) + "|",
        *host,
        ("F forward, B backward, O optimizer, g all-gather, r reduce-scatter/all-reduce; "
         "w compute waits for an all-gather, ! communication tail after backward"
         + ("; h the host issuing the device's work" if host else "")),
        (f"step {time.step_s:.3f} s = compute {time.compute_s:.3f} s (contention "
         f"{time.contention_s:.3f} s"
         + (f", waits for the host {time.host_wait_s:.3f} s" if host else "")
         + " included) + exposed communication "
         f"{time.exposed_comm_s:.3f} s (waits {time.bubbles_s:.3f} s + tail "
         f"{time.comm_tail_s:.3f} s) + optimizer {time.optimizer_s:.3f} s; communication "
         f"{time.total_comm_s:.3f} s in all, {time.hidden_comm_s:.3f} s of it hidden"),
    ])


def chrome_trace(time: StepTime) -> str:
    """The predicted timeline as Chrome/Perfetto trace JSON: one thread per stream, one for
    the waits (compute standing still for communication) and one for the host issuing the
    device's work ([Note: the host floor] in cost/streams.py)."""
    tids = {"compute": 1, "comm": 2, "wait": 3, "host": 4}
    events = [{"name": label, "ph": "X", "pid": 0, "tid": tids.get(lane, 3), "ts": start * 1e6,
               "dur": (stop - start) * 1e6,
               "cat": "predicted,exposed" if lane == "wait" else "predicted"}
              for lane, label, start, stop in time.spans]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}}
               for n, t in (("compute (predicted)", 1), ("communication (predicted)", 2),
                            ("compute waits for communication (predicted)", 3),
                            ("host issues the device's work (predicted)", 4))]
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})


def format_report(result: PlannedResult, rows: list[dict[str, Any]], *, model_name: str,
                  hardware: Hardware | None = None, hardware_file: str | None = None,
                  more_memory: str = "") -> str:
    """The table report of ``fsdp-plan MODEL``: the GPU assumed, the model, its modules, the
    candidates, the meshes, the chosen plan's peak and what its name means, what more memory
    would buy (``more_memory``, from the frontier), checkpointing, units, timeline, DDP lines
    and throughput."""
    graph, analysis, best = result.facts.graph, result.facts.analysis, result.best
    total = graph.total_numel
    plan = result.plan
    lines = [hardware_line(hardware, hardware_file)] if hardware is not None else []
    lines += [f"model: {model_name}  parameters: {total:,} "
             f"({format_bytes(fp32_bytes(total))} fp32)  micro-batch {plan.model.batch_size} x "
             f"seq {plan.model.seq_len}" + (f" x {plan.grad_accum_steps} accumulation steps"
                                                if plan.grad_accum_steps > 1 else "")]
    shard_states = (fp32_bytes(total) * (1 + OPTIMIZER_STATES.get(plan.optimizer, 0))
                    / plan.world_size)
    lines.append(f"budget {format_bytes(plan.budget_bytes)}, headroom "
                 f"{format_bytes(plan.headroom_bytes)}; model states fully sharded over "
                 f"{plan.world_size} GPUs: {format_bytes(shard_states)} per rank")
    lines.append("")
    mods = gather_module_rows(graph, analysis, max_depth=1 if len(graph.modules) > 60 else 2)
    lines.append(tabulate([[r["module"], r["class"], f"{r['params']:,}",
                            format_bytes(r["saved_activation_bytes"]),
                            format_flops(r["fw_flops"]), format_flops(r["bw_flops"])]
                           for r in mods[:40]],
                          headers=["module", "class", "params", "saved activations", "fw FLOP",
                                   "bw FLOP"], disable_numparse=True))
    lines += ["", format_candidates(rows), "", format_mesh_rows(gather_mesh_rows(result.ranked)),
              "", (f"chosen: {best.name}; peak {format_bytes(best.memory.peak_bytes)} at "
                   f"{best.memory.phase}")]
    legend = plan_name_legend(best.name)
    lines += [f"plan names: {legend}"] if legend else []
    lines += [more_memory] if more_memory else []
    lines += [format_breakdown(best.memory.breakdown), "",
              format_checkpointing(best, analysis.selective_unavailable)]
    lines += format_units_and_offload(best)
    lines += ["", ascii_timeline(best.time)]
    lines += ddp_lines(best, result.ranked)
    if analysis.ddp_unavailable:  # DDP's step under autocast failed: not planned
        lines.append(f"note: {analysis.ddp_unavailable}")
    lines += format_throughput(result)
    if result.framework is not None:
        lines.append(result.framework.line())
    lines.append(f"\nplanned in {result.seconds:.1f} s")
    return "\n".join(lines)


def format_throughput(result: PlannedResult) -> list[str]:
    """Tokens/s per GPU and MFU, the micro-batches tried, and why each choice went its way."""
    lines = []
    predicted = result.plan.predicted
    if "tokens_per_s" in predicted:
        lines.append(f"throughput: {predicted['tokens_per_s']:,.0f} tokens/s per GPU, MFU "
                     f"{predicted['mfu']:.1%} (step {result.best.time.step_s:.4g} s for "
                     f"{result.plan.grad_accum_steps} micro-batch(es) of "
                     f"{result.plan.model.batch_size})")
    if result.batch_options:
        lines.append(tabulate([[o["micro_batch"], o["grad_accum_steps"], o["gradient_sync"],
                                "yes" if o["fits"] else "NO", f"{o['step_s']:.4g}",
                                f"{o['tokens_per_s']:,.0f}", f"{o['mfu']:.1%}", o["note"]]
                               for o in result.batch_options],
                              headers=["micro-batch", "accumulation", "sync", "fits", "step s",
                                       "tokens/s/GPU", "MFU", "note"]))
    lines += [f"why: {reason}" for reason in result.reasons]
    return lines


def format_units_and_offload(best: Candidate) -> list[str]:
    """Grouped units with their modules, and what an offloaded plan keeps on the host."""
    lines = []
    grouped = [u for u in best.units if len(u.modules) > 1]
    if grouped:
        lines.append(f"grouped units ({len(grouped)}; one fully_shard call each, FSDP1 wraps "
                     "each module separately):")
        lines += [f"  {', '.join(u.modules)}  ({u.numel:,} parameters)" for u in grouped]
    if isinstance(best.detail, OffloadDetail):
        host = best.detail.host_bytes
        total = sum(host.values())
        parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in host.items())
        lines.append(f"CPU offload (FSDP2 CPUOffloadPolicy): on the host per rank "
                     f"{format_bytes(total)} ({parts}); optimizer step on the CPU "
                     f"{best.time.optimizer_s * 1e3:.1f} ms; host-device copies "
                     f"{best.detail.copy_s * 1e3:.1f} ms per step")
    if best.layout.optimizer_overlap:
        left = best.time.optimizer_s * 1e3
        lines.append("optimizer overlap: each parameter steps as soon as its gradient is reduced "
                     "(the policy's apply installs one optimizer per parameter; no clipping by "
                     "the global norm, no accumulation); "
                     + (f"{left:.2f} ms of it is left after backward" if left >= 0.005
                        else "all of it hidden behind backward"))
    return lines


def fp32_bytes(numel: int) -> int:
    """Bytes of ``numel`` parameters stored in float32 (how FSDP keeps the sharded copy)."""
    return numel * 4


def bucket_exposure(*, ready_s: float, start_s: float, end_s: float, nbytes: int,
                    backward_end_s: float, best_rate: float) -> tuple[float, str]:
    """How much of one bucket's all-reduce runs after backward (exposed) and why (issue 27
    item 5): it queued behind the previous bucket on the communication stream, it was ready
    only as backward ended, or it is too small to reach bandwidth (it moves at under half the
    rate of the fastest bucket: launch and latency dominate). Hidden buckets say so."""
    exposed = max(0.0, end_s - max(start_s, backward_end_s))
    if exposed <= 0:
        return 0.0, "hidden behind backward"
    reasons = []
    if start_s > ready_s + 1e-9:
        reasons.append(f"waited {(start_s - ready_s) * 1e3:.3f} ms behind the previous bucket on "
                       "the stream")
    if ready_s >= backward_end_s - 0.05 * max(end_s - start_s, 1e-12):
        reasons.append("ready only as backward ended")
    rate = nbytes / max(end_s - start_s, 1e-12)
    if best_rate > 0 and rate < best_rate / 2:
        reasons.append(f"too small to reach bandwidth ({rate / 1e9:.3g} GB/s, the largest "
                       f"rate of any bucket {best_rate / 1e9:.3g} GB/s)")
    if not reasons:
        reasons.append("its all-reduce is longer than the backward left after it was ready")
    return exposed, "; ".join(reasons)


def describe_buckets(candidate: Candidate, limit: int = 12) -> list[str]:
    """Report lines: each bucket's bytes, when it is ready, when its all-reduce runs, and what
    of it is exposed and why (``bucket_exposure``)."""
    detail = candidate.detail
    assert isinstance(detail, DDPDetail), "buckets are a DDP candidate's"
    ar = [s for s in candidate.time.spans if s[0] == "comm" and s[1].startswith("AR bucket")]
    lines = []
    ready = detail.ready_s or [span[2] for span in ar]
    t = candidate.time
    bw_end = t.forward_s + t.backward_s
    best_rate = max((b.nbytes / max(span[3] - span[2], 1e-12)
                     for b, span in zip(detail.buckets, ar)), default=0.0)
    for i, (bucket, span, at) in enumerate(zip(detail.buckets, ar, ready)):
        if i == limit and len(detail.buckets) > limit + 1:
            lines.append(f"  ... {len(detail.buckets) - limit - 1} more buckets")
            continue
        if limit < i < len(detail.buckets) - 1:
            continue
        exposed, why = bucket_exposure(ready_s=at, start_s=span[2], end_s=span[3],
                                       nbytes=bucket.nbytes, backward_end_s=bw_end,
                                       best_rate=best_rate)
        lines.append(f"  bucket {i:>3}: {bucket.nbytes / MIB:9.2f} MiB, "
                     f"{len(bucket.params):>4} params, ready {at * 1e3:9.3f} ms, all-reduce "
                     f"{span[2] * 1e3:9.3f} -> {span[3] * 1e3:9.3f} ms"
                     + (f"; exposed {exposed * 1e3:.3f} ms: {why}" if exposed > 0 else ""))
    lines.append(f"  backward ends at {bw_end * 1e3:.3f} ms; communication tail "
                 f"{t.exposed_comm_s * 1e3:.3f} ms (forward {t.forward_s * 1e3:.3f} ms, no "
                 "communication)")
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def why_line(ranked: list[Candidate]) -> str:
    """One line: why the winner beat the best candidate of the other kind (DDP vs FSDP/HSDP),
    on the same clock; empty when only one kind was planned."""
    fitting = [c for c in ranked if c.fits]
    if not fitting:
        return ""
    best = fitting[0]
    is_ddp = best.strategy == "ddp"
    other = next((c for c in fitting if (c.strategy == "ddp") != is_ddp), None)
    if other is None:
        ddp = next((c for c in ranked if c.strategy == "ddp"), None)
        if is_ddp or ddp is None:
            return ""
        return (f"why: {best.name} wins; DDP does not fit: its peak "
                f"{format_bytes(ddp.memory.peak_bytes)} holds every parameter, gradient and "
                "optimizer state on each GPU.")
    b, o = best.time, other.time
    ddp, fsdp = (b, o) if is_ddp else (o, b)
    return (f"why: {best.name} wins: step {_ms(b.step_s)} vs {_ms(o.step_s)} for {other.name}; "
            f"DDP (no parameter all-gathers, gradient buckets all-reduced during backward) "
            f"exposes {_ms(ddp.exposed_comm_s)} of {_ms(ddp.total_comm_s)} communication, "
            f"FSDP/HSDP {_ms(fsdp.exposed_comm_s)} of {_ms(fsdp.total_comm_s)}; peak "
            f"{format_bytes(best.memory.peak_bytes)} vs {format_bytes(other.memory.peak_bytes)}.")


def ddp_lines(best: Candidate, ranked: list[Candidate]) -> list[str]:
    """The report's DDP lines: why the winner won (DDP vs FSDP/HSDP) and, for a DDP winner,
    its buckets becoming ready with their all-reduces and the tail."""
    lines = []
    why = why_line(ranked)
    if why:
        lines.append(why)
    if isinstance(best.detail, DDPDetail):
        c = best.detail.config
        lines.append(f"DDP buckets after the rebuild ({len(best.detail.buckets)}, cap "
                     f"{c.bucket_cap_mb:g} MiB, first {c.first_bucket_mb:g} MiB"
                     + (f", {c.comm_hook} hook" if c.comm_hook else "")
                     + (", find_unused_parameters" if c.find_unused_parameters else "") + "):")
        lines.extend(describe_buckets(best))
        kind = hook_kind(c.comm_hook)
        if kind is not None and kind.numerics:  # a lossy hook says what it changes
            rank = (f" rank {c.powersgd_rank}, from iteration {c.powersgd_start_iter}"
                    if kind.name == "powersgd" else "")
            lines.append(f"lossy: the {kind.name} communication hook{rank}: {kind.numerics}.")
    return lines


_STRATEGY_WORDS = {
    "full": "full = full sharding (FSDP2 fully_shard, units reshard after forward)",
    "grad-op": "grad-op = units keep their parameters gathered from forward to backward "
               "(FSDP1 SHARD_GRAD_OP)",
    "none": "none = every rank holds all parameters (FSDP1 NO_SHARD)",
    "hybrid": "hybrid RxS = HSDP: R replicas of S-way sharding",
    "ddp": "ddp = DistributedDataParallel (every rank holds the whole model)",
}


def plan_name_legend(name: str) -> str:
    """What each word of a plan's name (``full per-block+top keep-last fwp1 bwp1 ac23 sac57``)
    means, for the words it has: plan files record units and modes, names only appear here."""
    words = name.removeprefix("recipe: ").split()
    parts: list[str] = []
    for w in words:
        if w in _STRATEGY_WORDS:
            parts.append(_STRATEGY_WORDS[w])
        elif w.startswith(("per-block", "grouped/", "root-only", "size/")):
            layout = {"per-block": "one unit per repeated block",
                      "root-only": "the whole model in one unit (the root)"}
            if w.startswith("grouped/"):
                text = ("consecutive blocks grouped into units, each gathering at most "
                        f"{w.split('/')[1].split('+')[0].rstrip('x')} blocks' parameters "
                        "(cut where the collectives cost least)")
            elif w.startswith("size/"):
                text = f"units of about 1/{w.split('/')[1]} of the parameters each"
            else:
                text = layout[w.split("+")[0]]
            if w.endswith("+top"):
                text += ", the top-level modules outside the blocks (embedding, head) as units"
            parts.append(f"{w} = {text}")
        elif w == "keep-last":
            parts.append("keep-last = the last block stays gathered after forward (backward "
                         "starts with it)")
        elif w.startswith("fwp") and w[3:].isdigit():
            parts.append(f"{w} = " + ("no explicit forward prefetch" if w == "fwp0" else
                                      f"each unit prefetches the next {w[3:]} in forward"))
        elif w.startswith("bwp") and w[3:].isdigit():
            parts.append(f"{w} = backward prefetch depth {w[3:]} (1 is FSDP2's default)")
        elif w.startswith("ac") and w[2:].isdigit():
            parts.append(f"{w} = the first {w[2:]} blocks fully checkpointed")
        elif w.startswith("sac") and w[3:].isdigit():
            parts.append(f"{w} = the next {w[3:]} blocks selectively checkpointed (matmuls and "
                         "attention saved, the rest recomputed)")
        elif w == "sync-last":
            parts.append("sync-last = gradients reduced after the last micro-batch only")
        elif w == "offload":
            parts.append("offload = CPUOffloadPolicy (states on the host)")
    if "hybrid" in words:
        parts = [p for p in parts if not p.startswith("hybrid ")] + [_STRATEGY_WORDS["hybrid"]]
    return "; ".join(parts)


def hardware_line(hardware: Hardware, hardware_file: str | None = None) -> str:
    """Which GPU and which figures the times assume (the first line of every report)."""
    where = (f"figures from --hardware {hardware_file}" if hardware_file
             else f"fsdp-plan's {hardware.name} preset; --gpu or --hardware to change")
    return f"assumed GPU: {hardware.name} ({where}); every step time below is for it"


def format_flops(flops: float) -> str:
    """``70.27 T``, ``4.19 G``, ``12.3 M``: FLOPs with a unit, so a small model's modules do
    not print as 0 TFLOP."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(flops) >= scale:
            return f"{flops / scale:.2f} {unit}"
    return f"{flops:.0f}"
