"""The vocabulary every strategy shares: settings, the ``Layout`` a plan applies, the evaluated
``Candidate`` with what each strategy adds, and ranking.

A ``Layout`` is plain data: the strategy, the mesh, the units (``groups``, children first, the
root excluded), their ``reshard_after_forward``, the checkpointed blocks per mode, the prefetch
depths, offload and DDP's buckets. ``search/evaluator.Evaluator.evaluate(layout, name)`` turns
one into a ``Candidate`` with the memory, collective and time models; ``plan/build.to_plan``
writes a candidate as a plan and ``plan/build.layout_of`` reads a plan back into the same
layout (``layout_of(to_plan(c)) == c.layout``). Strategies never import each other: the search
(``search/run.py``) receives them as ``Generator`` and ``Fallback`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from fsdp_plan.common.deferred import Deferred
from fsdp_plan.common.limits import budget_limit
from fsdp_plan.cost.ddp_buckets import Bucket, DDPConfig
from fsdp_plan.cost.hardware import Hardware
from fsdp_plan.cost.memory import MemoryEstimate
from fsdp_plan.cost.precision import Precision
from fsdp_plan.cost.step_time import StepTime
from fsdp_plan.cost.units import UnitSpec

Strategy = Literal["full", "hybrid", "grad-op", "none", "ddp"]
"""How parameters are held: FSDP full sharding, HSDP, FSDP's SHARD_GRAD_OP (kept unsharded
after forward), FSDP without sharding, or ``DistributedDataParallel``."""
STRATEGIES: tuple[str, ...] = get_args(Strategy)
STRATEGY_CHOICES: tuple[str, ...] = ("auto", *STRATEGIES)
"""What ``--strategy`` accepts: a strategy, or ``auto`` for the best that fits."""
GradientSync = Literal["every", "last"]
GRADIENT_SYNCS: tuple[str, ...] = get_args(GradientSync)


@dataclass(kw_only=True)
class SearchSettings:
    """The user's constraints, fixed during the search."""

    budget_bytes: int
    headroom_bytes: int
    world_size: int
    gpus_per_node: int
    hardware: Hardware
    strategy: str = "auto"
    """``auto`` or one of ``STRATEGIES``."""
    precision: Precision = field(default_factory=Precision)
    optimizer: str = "adamw"
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step: memory, time and counts cover the whole step."""
    gradient_sync: str = "every"
    """Reduce gradients after ``every`` micro-batch or only the ``last``."""
    micro_batch: int = 1
    """Samples per micro-batch per rank (the no-fit advice suggests fewer when above 1)."""
    optimizer_overlap: bool = False
    """The training loop lets each parameter step in backward (``--optimizer-overlap``): every
    layout that can have it is evaluated so (``Layout.optimizer_overlap``)."""
    allow_lossy_hooks: bool = False
    """DDP plans may use a lossy communication hook the user did not ask for by dtype
    (``--allow-lossy-hooks``: half-precision casts, PowerSGD; cost/comm_hooks.py)."""

    @property
    def limit_bytes(self) -> int:
        """The peak a plan may reach: budget minus headroom."""
        return budget_limit(self.budget_bytes, self.headroom_bytes)

    def allows(self, strategy: str) -> bool:
        """Whether the user's ``--strategy`` admits a candidate of ``strategy``."""
        return self.strategy in ("auto", strategy)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What a plan applies, as the search and the plan file both describe it."""

    strategy: str
    mesh: tuple[int, int]
    """(replicate, shard): DDP, HSDP and FSDP as two degrees, as torchtitan writes them."""
    groups: tuple[tuple[str, ...], ...] = ()
    """Each non-root unit's modules (one ``fully_shard`` call), children first."""
    reshard: tuple[bool, ...] = ()
    """``reshard_after_forward`` of each unit in ``groups``."""
    root_reshard: bool = False
    full: frozenset[int] = frozenset()
    """Block indices fully checkpointed."""
    selective: frozenset[int] = frozenset()
    """Block indices selectively checkpointed (never also in ``full``)."""
    selective_mm_stride: int = 1
    """Selective blocks save every k-th ``aten.mm`` (torchtitan's op policy: 2; SPEC 7)."""
    forward_prefetch: int = 0
    backward_prefetch: int = 1
    offload: bool = False
    """FSDP2 ``CPUOffloadPolicy`` (search/offload.py)."""
    ddp: DDPConfig | None = None
    """DDP's bucket configuration when ``strategy`` is ``ddp``."""
    optimizer_overlap: bool = False
    """Each parameter stepped in backward (cost/optimizer_overlap.py): the evaluator sets it
    where the settings allow it and the layout can have it."""

    @property
    def replicate(self) -> int:
        return self.mesh[0]

    @property
    def shard(self) -> int:
        return self.mesh[1]

    @property
    def units_key(self) -> tuple:
        """What fixes the layout's ``fully_shard`` units: their groups, reshard choices and
        mesh (the evaluator builds and times a layout's units once per key)."""
        return (self.groups, self.reshard, self.root_reshard, self.mesh)


@dataclass(kw_only=True, frozen=True)
class BlockMode:
    """One checkpointed block: ``full`` or ``selective``, the activation bytes its mode keeps
    out of memory (forward level rise saved against no checkpointing) and its replay time."""

    block: str
    mode: str
    saved_bytes: int
    recompute_s: float
    recompute_host_s: float = 0.0
    """Host seconds to issue the replayed ops ([Note: the host floor] in cost/streams.py)."""


@dataclass(kw_only=True)
class DDPDetail:
    """What a DDP candidate adds: its buckets after the rebuild and when each is ready."""

    config: DDPConfig
    buckets: list[Bucket]
    unused: list[int] = field(default_factory=list)
    """DDP parameter indices that get no gradient."""
    ready_s: list[float] = field(default_factory=list)
    """When each bucket's last gradient is ready (seconds from the step's start)."""


@dataclass(kw_only=True)
class OffloadDetail:
    """What an offloaded candidate adds: bytes moved to the host and the copies' time."""

    host_bytes: dict[str, int]
    copy_s: float
    """Host-device copy time per step (both directions), before overlap."""


@dataclass(kw_only=True)
class Candidate:
    """One layout with what the models said of it (no subclasses: ``detail`` holds what a
    strategy adds)."""

    name: str
    layout: Layout
    units: list[UnitSpec]
    memory: MemoryEstimate
    deferred_time: Deferred[StepTime]
    """Its step time, simulated when first read (``time``; [Note: step times when asked] in
    common/deferred.py)."""
    collectives: dict[str, int]
    collectives_fsdp1: dict[str, int]
    fits: bool
    cross_node_bytes: int = 0
    """Bytes one GPU sends across nodes per step (cost/collectives.py ``cross_node_bytes``)."""
    block_modes: list[BlockMode] = field(default_factory=list)
    """Per checkpointed block, in stack order: its mode, what it saves and what it costs."""
    detail: DDPDetail | OffloadDetail | None = None

    @property
    def time(self) -> StepTime:
        """The step time (the clock's simulation runs on the first read)."""
        return self.deferred_time.get()

    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def replicate(self) -> int:
        return self.layout.mesh[0]

    @property
    def shard(self) -> int:
        return self.layout.mesh[1]

    @property
    def forward_prefetch(self) -> int:
        return self.layout.forward_prefetch

    @property
    def backward_prefetch(self) -> int:
        return self.layout.backward_prefetch

    @property
    def checkpointed(self) -> list[str]:
        """Every checkpointed block, in stack order."""
        return [m.block for m in self.block_modes]

    @property
    def selective(self) -> list[str]:
        """The blocks of ``checkpointed`` in selective mode (the others are full)."""
        return [m.block for m in self.block_modes if m.mode == "selective"]

    @property
    def selective_mm_stride(self) -> int:
        """Selective blocks save every k-th ``aten.mm`` (1 without selective blocks)."""
        return self.layout.selective_mm_stride if self.layout.selective else 1

    @property
    def recompute_s(self) -> float:
        """Seconds of backward spent replaying checkpointed forwards (all blocks)."""
        return sum(m.recompute_s for m in self.block_modes)


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Fitting candidates by step time (then fewer checkpointed blocks, lower peak), then the rest
    by peak."""
    return sorted(candidates, key=lambda c: (
        not c.fits, round(c.time.step_s, 9) if c.fits else c.memory.peak_bytes,
        len(c.block_modes), c.memory.peak_bytes))


def choose(searched: list[Candidate], recipes: list[Candidate], strategy: str = "auto"
           ) -> list[Candidate]:
    """The search's ranking with any fitting recipe that beats it: never worse than a recipe.

    Recipes compete only when the user's ``--strategy`` allows theirs."""
    allowed = [r for r in recipes if r.fits and strategy in ("auto", r.strategy)]
    return rank(searched + allowed)
