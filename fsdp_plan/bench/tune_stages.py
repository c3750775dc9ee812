"""The tuning order: the stages ``fsdp-plan tune`` runs after its baseline, and what each one
proposes (bench/tune.py runs them).

[Note: the tuning order]
Data parallelism is tuned as practitioners tune it: a baseline without overlap beside the plan
as written, the topology checked, small, medium and large buckets swept, whether backward got
slower under overlap, then compression, optimizer overlap and prefetch, one change at a time,
keeping the best and a rollback. ``STAGES`` is that order. Each stage reads the best plan so
far (and what the baseline measured) and says why it runs and what it proposes, or why it has
nothing to propose:

0. baseline (the loop's first launch): the plan as given, which is the rollback, and in the
   same launch its no-overlap twin (measure/no_overlap.py): the overlap verdict
   (bench/overlap.py [Note: the overlap verdict]).
1. topology: no run. Where the plan's collectives go on its nodes (a shard group inside a node
   or across nodes, ``gpus_per_node``) and what the local run can say of it. The mesh is the
   planner's choice (``--strategy hybrid``), not a knob one machine can measure.
2. buckets: for DDP the planned ``bucket_cap_mb`` is the medium bucket, and a small (a quarter
   of it) and a large one (four times it) are benched beside it. For FSDP2 the unit is the
   bucket (one all-gather and one reduce-scatter per unit), so the unit layouts around the
   plan's (root only, one unit per block, two blocks per unit) are its small and large ones.
3. contention: reads the baseline's verdict. When overlap paid, nothing changes, nor when its
   cost is within the baseline's noise or nothing was hidden (compute that nothing overlapped
   cannot have been slowed by it). When it cost more than it hid, the change that overlaps
   less: FSDP2 shallower prefetch (fewer collectives beside compute); DDP one bucket of every
   gradient, whose all-reduce starts when backward ends: the held twin written as a plan (the
   twin itself is a measurement, not a plan).
4. hooks (DDP): DDP's own all-reduce against communication hooks. A lossy hook (half-precision
   casts, PowerSGD) is proposed only with ``--allow-lossy-hooks``, the planner's permission;
   dropping the plan's own hook (lossless) always. Hooks the workers cannot run (bf16 and
   PowerSGD on gloo) are not proposed, nor PowerSGD when it would start compressing only after
   the steps tune measures.
5. optimizer overlap: on only where ``overlap_refusal`` allows it and the user said the loop
   allows it (``--optimizer-overlap``, as when planning: no clipping by the global norm); off
   (the plain step after backward) always.
6. prefetch (FSDP2): forward prefetch on or off, backward prefetch depth 1 or 2.
7. checkpointing: one block fewer, none, one more (each block keeps its mode).
8. reshard: the last unit before the root kept unsharded after forward.

Every proposal is one knob away from the best so far and accepted by the plan format
(``Plan.from_dict(plan.to_dict())``); the loop predicts it, drops what does not fit or was
measured already, and benches the rest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from fsdp_plan.bench.overlap import OverlapFigures
from fsdp_plan.common.errors import BadInput
from fsdp_plan.cost.comm_hooks import COMM_HOOKS
from fsdp_plan.cost.optimizer_overlap import overlap_refusal
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.plan.document import Plan, Unit
from fsdp_plan.plan.prefetch import prefetch_depths, prefetch_maps
from fsdp_plan.plan.sections.ddp import MAX_BUCKET_MB

MIB = 1 << 20
BUCKET_FACTOR = 4
"""The small bucket is the planned cap over this, the large one the cap times it."""

Proposal = tuple[str, str, Plan]
"""``(knob, change, plan)``: a plan one knob away from the best so far, and what changed."""


@dataclass(frozen=True, kw_only=True)
class Permissions:
    """What the user allowed tune to change beyond the plan's own numerics and loop."""

    lossy_hooks: bool = False
    """``--allow-lossy-hooks``: DDP plans may all-reduce through fp16/bf16 compression or
    PowerSGD."""
    optimizer_overlap: bool = False
    """``--optimizer-overlap``: the training loop lets each parameter step in backward."""
    accelerator: bool = False
    """The workers run on GPUs (NCCL): hooks gloo cannot run may be proposed."""


@dataclass(frozen=True, kw_only=True)
class Context:
    """What a stage reads: the best plan so far and what the baseline measured."""

    plan: Plan
    facts: ModelFacts
    allow: Permissions = field(default_factory=Permissions)
    overlap: OverlapFigures | None = None
    """The baseline's overlap figures (None: the no-overlap twin was not measured)."""
    overlap_note: str = ""
    """How communication was held, or why the twin was not measured."""
    run_mesh: tuple[int, int] | None = None
    """``(replicate, shard)`` of the local run (None: not known)."""
    warmup_steps: int = 0
    """Steps each run makes before it is timed."""
    noise: float = 0.0
    """The baseline's relative spread: a difference of backwards smaller than this share of
    the held backward is the run's noise."""
    buckets: tuple[int, ...] = ()
    """The best plan's predicted DDP buckets (bytes), empty for FSDP."""


@dataclass(frozen=True, kw_only=True)
class Proposed:
    """A stage's answer: why it runs (or has nothing to run) and its proposals."""

    reason: str
    proposals: list[Proposal] = field(default_factory=list)


@dataclass(frozen=True)
class Stage:
    name: str
    propose: Callable[[Context], Proposed]
    benches: bool = True
    """False: a check with no run (topology)."""


def is_valid(plan: Plan) -> bool:
    """Whether the plan file format accepts ``plan`` (``plan.check``): a proposal the format
    forbids is never benched (issue 21, S3-14)."""
    try:
        Plan.from_dict(plan.to_dict())
    except BadInput:
        return False
    return True


def _valid(proposals: list[Proposal]) -> list[Proposal]:
    return [(knob, change, p) for knob, change, p in proposals if is_valid(p)]


def _changed(plan: Plan, **changes) -> Plan:
    return dataclasses.replace(plan, **changes, predicted={})


def _mb(value: float) -> str:
    return f"{value:g} MiB"


# --- 1. topology ------------------------------------------------------------------------------

def topology(ctx: Context) -> Proposed:
    """Where the plan's collectives run on its nodes, and what this run measures of them."""
    plan, gpus = ctx.plan, ctx.plan.node_gpus
    world, replicate, shard = plan.world_size, plan.mesh.replicate, plan.mesh.shard
    nodes = math.ceil(world / gpus)
    where = f"{world} rank(s) on {nodes} node(s) of {gpus} GPUs (gpus_per_node)"
    if plan.strategy == "ddp":
        line = (f"DDP over {where}: one all-reduce group over every rank; the plan holds no "
                "group to choose")
    elif replicate == 1 and shard <= gpus:
        line = (f"one shard group of {shard} rank(s) inside a node ({where}): all-gathers and "
                "reduce-scatters stay on the node's links; nothing to choose")
    elif replicate == 1:
        line = (f"one shard group of {shard} ranks across {nodes} nodes ({where}): every "
                f"all-gather and reduce-scatter crosses nodes; HSDP with shard groups of {gpus} "
                "(fsdp-plan --strategy hybrid) would keep them on a node, a mesh the planner "
                "chooses and one machine cannot measure")
    elif gpus % shard == 0:
        line = (f"HSDP: {replicate} replicas of shard groups of {shard} inside a node ({where}): "
                "all-gathers and reduce-scatters stay on a node, only the replicas' all-reduce "
                "crosses nodes")
    else:
        line = (f"HSDP: shard groups of {shard} do not fit a node of {gpus} ({where}): "
                f"all-gathers and reduce-scatters cross nodes; shard groups of {gpus} or a "
                f"divisor of it would not (re-plan with --gpus-per-node {gpus})")
    if ctx.run_mesh is not None and tuple(ctx.run_mesh) != (replicate, shard):
        r, s = ctx.run_mesh
        line += (f"; measured here on {r * s} local rank(s) (mesh {r}x{s}), so the stages "
                 "compare plans on this machine's links, not the target cluster's")
    return Proposed(reason=line)


# --- 2. buckets -------------------------------------------------------------------------------

def _layout(plan: Plan) -> tuple[list[list[str]], list[bool]]:
    units = [u for u in plan.units if u.modules != [""]]
    return [list(u.modules) for u in units], [u.reshard_after_forward for u in units]


def _with_units(plan: Plan, groups: list[list[str]], reshard: list[bool]) -> Plan:
    root = next(u for u in plan.units if u.modules == [""])
    units = [Unit(modules=g, reshard_after_forward=r) for g, r in zip(groups, reshard)]
    fwd, bwd = prefetch_depths(plan)
    forward, backward = prefetch_maps([g[0] for g in groups], fwd, bwd)
    return _changed(plan, units=[*units, root], forward_prefetch=forward,
                    backward_prefetch=backward)


def _resharding(plan: Plan, count: int, last: bool = True) -> list[bool]:
    """``reshard_after_forward`` for ``count`` new units: grad-op keeps every unit gathered
    (the plan format refuses a resharding unit under it); otherwise every unit reshards,
    the last one only when ``last``."""
    if plan.strategy == "grad-op":
        return [False] * count
    return [True] * (count - 1) + [last] if count else []


def unit_layouts(plan: Plan, facts: ModelFacts) -> list[Proposal]:
    """An FSDP2 plan's unit layouts one step coarser or finer: root only, one unit per block,
    two blocks per unit."""
    blocks = facts.graph.blocks
    groups, _ = _layout(plan)
    out = []
    if blocks and not groups:
        out.append(("unit layout", "root only -> one unit per block",
                    _with_units(plan, [[b] for b in blocks],
                                _resharding(plan, len(blocks), last=False))))
    elif groups:
        out.append(("unit layout", f"{len(groups)} units -> root only",
                    _with_units(plan, [], [])))
        if all(len(g) == 1 for g in groups) and len(groups) >= 4 and groups[0][0] in blocks:
            pairs = [[m for g in groups[i:i + 2] for m in g] for i in range(0, len(groups), 2)]
            out.append(("unit layout", "one unit per block -> two blocks per unit",
                        _with_units(plan, pairs, _resharding(plan, len(pairs)))))
    return _valid(out)


def _with_cap(plan: Plan, cap: float) -> Plan:
    """The DDP plan with bucket cap ``cap`` MiB; an explicit first bucket (as large as the
    others) follows the cap, a smaller first bucket stays (at most the cap)."""
    ddp = plan.ddp
    first = cap if ddp.first_bucket_mb == ddp.bucket_cap_mb else min(ddp.first_bucket_mb, cap)
    return _changed(plan, ddp=dataclasses.replace(ddp, bucket_cap_mb=cap, first_bucket_mb=first))


def buckets(ctx: Context) -> Proposed:
    plan = ctx.plan
    if plan.strategy == "ddp":
        cap = plan.ddp.bucket_cap_mb
        small, large = cap / BUCKET_FACTOR, min(cap * BUCKET_FACTOR, MAX_BUCKET_MB)
        proposals = [("bucket cap", f"{_mb(cap)} -> {_mb(c)} ({size})", _with_cap(plan, c))
                     for c, size in ((small, "small"), (large, "large")) if c != cap]
        return Proposed(reason=(f"DDP buckets: the planned {_mb(cap)} cap is the medium one "
                                f"(re-measured as the reference), {_mb(small)} (cap / "
                                f"{BUCKET_FACTOR}) the small and {_mb(large)} (cap x "
                                f"{BUCKET_FACTOR}) the large"),
                        proposals=_valid(proposals))
    if any(u.mixed_precision for u in plan.units):
        return Proposed(reason="units carry their own mixed precision: regrouping them would "
                               "change what they compute in")
    proposals = unit_layouts(plan, ctx.facts)
    if not proposals:
        return Proposed(reason="FSDP2's unit is its bucket, and the model has no repeated "
                               "blocks to group otherwise")
    return Proposed(reason="FSDP2's unit is its communication bucket (one all-gather and one "
                           "reduce-scatter per unit): the unit layouts around the plan's are "
                           "its small and large buckets", proposals=proposals)


# --- 3. contention ----------------------------------------------------------------------------

def _prefetch(plan: Plan, forward_depth: int, backward_depth: int) -> Plan:
    keys = [u.key for u in plan.units]
    forward, backward = prefetch_maps(keys, forward_depth, backward_depth)
    return _changed(plan, forward_prefetch=forward, backward_prefetch=backward)


def contention(ctx: Context) -> Proposed:
    figures, plan = ctx.overlap, ctx.plan
    if figures is None:
        return Proposed(reason=f"no overlap verdict: {ctx.overlap_note or 'not measured'}")
    saved_ms, held_ms = figures.saved_s * 1e3, figures.backward_held_s * 1e3
    if figures.hidden_s <= 0:  # nothing ran beside compute: nothing could slow it down
        return Proposed(reason=f"no communication overlapped the baseline's backward compute, "
                               f"so the {figures.contention_s * 1e3:+.3g} ms its compute took "
                               "beside the held twin's is the run's noise, not contention: "
                               "nothing to change")
    if figures.saved_s >= 0:
        return Proposed(reason=f"overlap paid (the baseline's backward: saves {saved_ms:.3g} ms "
                               f"of {held_ms:.3g}): kept, nothing to change")
    if -figures.saved_s <= ctx.noise * figures.backward_held_s:
        return Proposed(reason=f"overlap cost the baseline's backward {-saved_ms:.3g} ms of "
                               f"{held_ms:.3g}, within the noise ({ctx.noise:.1%}): nothing to "
                               "change")
    cost = (f"overlap cost the baseline's backward {-saved_ms:.3g} ms of {held_ms:.3g} (compute "
            f"slowed {figures.contention_s * 1e3:.3g} ms to hide {figures.hidden_s * 1e3:.3g})")
    if plan.strategy == "ddp":
        total = sum(ctx.buckets)
        if len(ctx.buckets) <= 1:
            return Proposed(reason=f"{cost}, but the plan already all-reduces one bucket after "
                                   "backward: no plan overlaps less")
        cap = min(max(1, math.ceil(total / MIB)), MAX_BUCKET_MB)
        one = _changed(plan, ddp=dataclasses.replace(plan.ddp, bucket_cap_mb=cap,
                                                     first_bucket_mb=cap))
        change = f"{len(ctx.buckets)} buckets -> one ({_mb(cap)})"
        return Proposed(reason=f"{cost}: one bucket of every gradient, all-reduced when "
                               "backward ends (the held twin as a plan)",
                        proposals=_valid([("bucket cap", change, one)]))
    groups, _ = _layout(plan)
    fwd, bwd = prefetch_depths(plan)
    proposals = []
    if groups and fwd > 0:
        proposals.append(("forward prefetch", f"depth {fwd} -> 0", _prefetch(plan, 0, bwd)))
    if groups and bwd > 1:
        proposals.append(("backward prefetch", f"depth {bwd} -> 1", _prefetch(plan, fwd, 1)))
    if not proposals:
        return Proposed(reason=f"{cost}, but the plan already prefetches as little as the plan "
                               "format holds (forward 0, backward 1): no plan holds "
                               "communication back further")
    return Proposed(reason=f"{cost}: shallower prefetch, fewer collectives beside compute",
                    proposals=_valid(proposals))


# --- 4. hooks ---------------------------------------------------------------------------------

def _with_hook(plan: Plan, hook: str | None, rank: int | None = None) -> Plan:
    ddp = dataclasses.replace(plan.ddp, comm_hook=hook)
    if rank is not None:
        ddp = dataclasses.replace(ddp, powersgd_rank=rank)
    return _changed(plan, ddp=ddp)


def _hook_name(hook: str | None, rank: int | None = None) -> str:
    if hook is None:
        return "DDP's all-reduce"
    return f"PowerSGD rank {rank}" if hook == "powersgd" else hook


def hooks(ctx: Context) -> Proposed:
    plan, allow = ctx.plan, ctx.allow
    if plan.strategy != "ddp":
        return Proposed(reason="not a DDP plan: FSDP2 reduces gradients in "
                               "mixed_precision.reduce_dtype, with no communication hook")
    if plan.optimizer_overlap:
        return Proposed(reason="the plan steps its optimizer in backward, which is DDP's one "
                               "communication hook")
    ddp = plan.ddp
    current = _hook_name(ddp.comm_hook, ddp.powersgd_rank)
    proposals: list[Proposal] = []
    notes: list[str] = []
    lossy: set[str] = set()
    if ddp.comm_hook is not None:
        proposals.append(("comm hook", f"{current} -> DDP's all-reduce (lossless)",
                          _with_hook(plan, None)))
    # PowerSGD all-reduces plainly before start_iter: a run that warms up for fewer steps
    # would time DDP's all-reduce under PowerSGD's name
    compresses = ddp.powersgd_start_iter <= ctx.warmup_steps
    late = (f"PowerSGD compresses only from step {ddp.powersgd_start_iter} (start_iter), after "
            f"the steps tune times ({ctx.warmup_steps} warm-up)")
    if ddp.comm_hook == "powersgd" and compresses:  # a higher rank is closer to the gradient
        higher = ddp.powersgd_rank * 2
        proposals.append(("comm hook", f"{current} -> PowerSGD rank {higher} (less lossy)",
                          _with_hook(plan, "powersgd", higher)))
    elif ddp.comm_hook == "powersgd":
        notes.append(f"no other PowerSGD rank proposed: {late}")
    if allow.lossy_hooks:
        for kind in COMM_HOOKS.values():
            if not (kind.on_gloo or allow.accelerator):
                notes.append(f"{kind.name} not proposed: gloo cannot run it")
                continue
            if kind.name == "powersgd" and not compresses:
                notes.append(f"powersgd not proposed: {late}")
                continue
            for rank in kind.ranks if kind.name == "powersgd" else (None,):
                if (kind.name, rank) != (ddp.comm_hook, ddp.powersgd_rank if rank else None):
                    change = f"{current} -> {_hook_name(kind.name, rank)} (lossy)"
                    proposals.append(("comm hook", change, _with_hook(plan, kind.name, rank)))
                    lossy.add(f"{kind.name}: {kind.numerics}")
    else:
        notes.append("lossy hooks (fp16/bf16 compression, PowerSGD) not proposed: they change "
                     "the gradients' numerics, and --allow-lossy-hooks (the planner's "
                     "permission) was not given")
    proposals = _valid(proposals)
    reason = f"DDP all-reduces through {current}"
    if lossy:
        reason += "; lossy hooks allowed (--allow-lossy-hooks): " + "; ".join(sorted(lossy))
    if notes:
        reason += "; " + "; ".join(notes)
    return Proposed(reason=reason, proposals=proposals)


# --- 5. optimizer overlap ---------------------------------------------------------------------

def optimizer_overlap(ctx: Context) -> Proposed:
    plan = ctx.plan
    if plan.optimizer_overlap:
        return Proposed(reason="the plan steps each parameter in backward; the plain step "
                               "after backward is measured against it",
                        proposals=_valid([("optimizer overlap", "in backward -> after backward",
                                           _changed(plan, optimizer_overlap=False))]))
    why = overlap_refusal(strategy=plan.strategy, optimizer=plan.optimizer,
                          grad_accum_steps=plan.grad_accum_steps,
                          offload=plan.offload is not None,
                          comm_hook=plan.ddp.comm_hook if plan.ddp else None)
    if why:
        return Proposed(reason=f"optimizer overlap refused: {why}")
    if not ctx.allow.optimizer_overlap:
        return Proposed(reason="optimizer overlap not proposed: stepping each parameter in "
                               "backward forbids clipping by the global norm, and "
                               "--optimizer-overlap (the loop allows it, as when planning) was "
                               "not given")
    return Proposed(reason="each parameter stepped as its gradient is reduced, during backward "
                           "(--optimizer-overlap given; overlap_refusal allows it)",
                    proposals=_valid([("optimizer overlap", "after backward -> in backward",
                                       _changed(plan, optimizer_overlap=True))]))


# --- 6. prefetch ------------------------------------------------------------------------------

def prefetch(ctx: Context) -> Proposed:
    plan = ctx.plan
    if plan.strategy == "ddp":
        return Proposed(reason="DDP plan: no prefetch (DDP gathers no parameters)")
    groups, _ = _layout(plan)
    if not groups:
        return Proposed(reason="one unit (the root): nothing to prefetch")
    fwd, bwd = prefetch_depths(plan)
    return Proposed(reason="FSDP2 explicit prefetch: forward on or off, backward depth 1 or 2",
                    proposals=_valid([
                        ("forward prefetch", f"depth {fwd} -> {1 - min(fwd, 1)}",
                         _prefetch(plan, 1 - min(fwd, 1), bwd)),
                        ("backward prefetch", f"depth {bwd} -> {2 if bwd == 1 else 1}",
                         _prefetch(plan, fwd, 2 if bwd == 1 else 1))]))


# --- 7. checkpointing -------------------------------------------------------------------------

def checkpointing_changes(plan: Plan, blocks: list[str]) -> list[Proposal]:
    """One block fewer, none, one block more. Each block keeps its mode (``full`` or
    ``selective``) and the label counts what the plan then checkpoints (issue 21, S3-14:
    "80 -> 79 blocks" used to turn every selective block into full)."""
    written = plan.activation_checkpointing
    modes = dict(written) if isinstance(written, dict) else {name: "full" for name in written}
    names = list(modes)

    def checkpointing(chosen: dict[str, str]) -> Plan:
        if isinstance(written, dict) and chosen:
            value: list[str] | dict[str, str] = chosen
        else:  # no selective block: the list form, which every plan version reads
            value = list(chosen)
        return _changed(plan, activation_checkpointing=value)
    out = []
    if names:
        out.append(("checkpointing", f"{len(names)} -> {len(names) - 1} blocks",
                    checkpointing(dict(list(modes.items())[:-1]))))
        if len(names) > 1:
            out.append(("checkpointing", f"{len(names)} -> 0 blocks", checkpointing({})))
    free = [b for b in blocks if b not in modes and not any(
        n.startswith(b + ".") or b.startswith(n + ".") for n in names)]
    if free:
        mode = modes[names[-1]] if names and isinstance(written, dict) else "full"
        label = f"{len(names)} -> {len(names) + 1} blocks"
        if isinstance(written, dict):
            label += f" ({free[0]} {mode})"
        out.append(("checkpointing", label, checkpointing({**modes, free[0]: mode})))
    return _valid(out)


def checkpointing(ctx: Context) -> Proposed:
    proposals = checkpointing_changes(ctx.plan, ctx.facts.graph.blocks)
    if not proposals:
        return Proposed(reason="no repeated block to checkpoint or stop checkpointing")
    return Proposed(reason="activation checkpointing of the repeated blocks: one fewer, none, "
                           "one more", proposals=proposals)


# --- 8. reshard -------------------------------------------------------------------------------

def reshard(ctx: Context) -> Proposed:
    plan = ctx.plan
    if plan.strategy == "ddp":
        return Proposed(reason="DDP plan: nothing is sharded")
    if plan.strategy == "grad-op":
        return Proposed(reason="grad-op keeps every unit gathered after forward already")
    groups, resharded = _layout(plan)
    if not groups or not resharded[-1]:
        return Proposed(reason="the last unit before the root already stays gathered after "
                               "forward" if groups else "one unit (the root): nothing to keep")
    last = len(groups) - 1  # the last unit before the root; its other settings kept
    units = [dataclasses.replace(u, reshard_after_forward=False) if i == last else u
             for i, u in enumerate(plan.units)]
    return Proposed(reason="the last unit's parameters kept gathered from forward to backward "
                           "(its all-gather in backward saved, its memory held)",
                    proposals=_valid([("reshard", f"keep {groups[-1][0]} unsharded after forward",
                                       _changed(plan, units=units))]))


STAGES: tuple[Stage, ...] = (
    Stage("topology", topology, benches=False),
    Stage("buckets", buckets),
    Stage("contention", contention),
    Stage("hooks", hooks),
    Stage("optimizer overlap", optimizer_overlap),
    Stage("prefetch", prefetch),
    Stage("checkpointing", checkpointing),
    Stage("reshard", reshard),
)
"""[Note: the tuning order], after the baseline."""

