"""What the user asks the planner for: ``PlanRequest``, validated on construction, with the
search's own settings (``SearchOptions``: how widely it looks, not what is trained), and the
``SearchSettings`` the search holds fixed for it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fsdp_plan.common.arguments import require_choice, require_type, require_whole
from fsdp_plan.common.autocast import AUTOCAST_DTYPES
from fsdp_plan.common.dtypes import DTYPE_BYTES, canonical_dtype
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.limits import (
    MAX_BATCH_SIZE,
    MAX_BYTES,
    MAX_GPUS_PER_NODE,
    MAX_GRAD_ACCUM_STEPS,
    MAX_WORLD_SIZE,
    budget_limit,
)
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.cost.hardware import Hardware, hardware_for
from fsdp_plan.cost.offload import pcie_bandwidth
from fsdp_plan.cost.optimizer_overlap import OVERLAP_STRATEGIES
from fsdp_plan.cost.precision import OPTIMIZER_STATES, Precision
from fsdp_plan.facts.checkpointing import TORCHTITAN_MM_STRIDE
from fsdp_plan.model.source import ModelSource
from fsdp_plan.search.candidate import STRATEGY_CHOICES, SearchSettings
from fsdp_plan.search.framework import FrameworkLimits, limits_for


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """How widely the planner looks for one request's plan: the search's settings, not the
    training run's (no plan records them; the same request planned with other options trains
    the same way)."""

    exact_analysis: bool = False
    """Analyse every block instead of three per stack (facts/depth.py)."""
    auto_batch: bool = False
    """``--batch-size auto``: weigh micro-batches and keep the largest that fits, or the
    fastest if larger is not faster (search/batching.py)."""
    compile_auto: bool = False
    """``--compile auto``: plan eager and compiled blocks (``PlanRequest.compile_blocks`` is
    then true for the analysis) and keep the better plan (api.py ``make_plan``)."""

    def __post_init__(self) -> None:
        for flag in ("exact_analysis", "auto_batch", "compile_auto"):
            require_type(getattr(self, flag), bool, f"SearchOptions.{flag}")


@dataclass(kw_only=True)
class PlanRequest:
    """What the user asks for: a model, a per-GPU budget, the cluster, the training setup and
    what the plan may use (``allow_*``); ``search`` holds how widely the planner looks."""

    source: ModelSource
    budget_bytes: int
    """Per-GPU memory budget in bytes (``--mem``)."""
    headroom_bytes: int | None = None
    """Kept free for the CUDA context, communication buffers and fragmentation; default 10%."""
    world_size: int = 8
    gpus_per_node: int = 8
    strategy: str = "auto"
    """``auto``, ``full``, ``hybrid``, ``grad-op``, ``none`` or ``ddp`` (DistributedDataParallel)."""
    param_dtype: str = "bfloat16"
    reduce_dtype: str | None = "float32"
    """``float32``, ``bfloat16``..., ``auto`` (the search tries float32 and bfloat16), or None:
    float32, or under ``framework`` the dtype its configuration reduces in."""
    autocast_dtype: str | None = None
    """``--autocast``: FSDP keeps float32 parameters and forward and loss run under
    ``torch.autocast`` in this dtype ([Note: autocast precision] in common/autocast.py);
    ``param_dtype`` is then float32."""
    optimizer: str = "adamw"
    hardware: Hardware = field(default_factory=lambda: hardware_for("h100"))
    hardware_origin: dict[str, str] | None = None
    """Where ``hardware`` came from (``cost/hardware/stored.file_origin`` of a ``--hardware``
    file): the plan stores it beside the figures (SPEC 7)."""
    allow_lossy_hooks: bool = False
    """DDP plans may all-reduce through a lossy communication hook (``--allow-lossy-hooks``:
    fp16/bf16 compression, PowerSGD), each priced on the clock (cost/comm_hooks.py)."""
    allow_offload: bool = False
    """When nothing fits on the device, plan FSDP2 ``CPUOffloadPolicy`` (``--allow-offload``;
    cost/offload.py [Note: offload as the last resort])."""
    optimizer_overlap: bool = False
    """``--optimizer-overlap``: the training loop lets each parameter step as soon as its
    gradient is reduced (no clipping by the global norm, no accumulation); every FSDP2 and DDP
    layout that can is planned so (cost/optimizer_overlap.py)."""
    grad_accum_steps: int = 1
    """Micro-batches (``source.batch_size`` samples each, per rank) per optimizer step."""
    gradient_sync: str = "every"
    """Reduce gradients after ``every`` micro-batch or only the ``last``."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all data-parallel ranks: the planner chooses the
    micro-batch, accumulation and gradient sync (search/batching.py)."""
    compile_blocks: bool = False
    """``--compile``: plan the repeated blocks compiled (``torch.compile(block.forward,
    fullgraph=True)``), their saved activations from the AOTAutograd partition
    (facts/compiled.py); FSDP2 plans only."""
    activation_memory_budget: float | None = None
    """``--activation-memory-budget``: ``torch._functorch.config.activation_memory_budget``
    (0..1) for the compiled blocks; None: the partitioner's default."""
    framework: str | None = None
    """``--framework``: keep the search to what this framework's configuration says
    (search/framework.py [Note: framework limits]); the plan records it."""
    search: SearchOptions = field(default_factory=SearchOptions)
    """The search's own settings: analysis depth, and whether it weighs micro-batches and
    eager against compiled blocks."""
    asked_reduce_dtype: str | None = field(init=False, default=None)
    """``reduce_dtype`` as given, before a framework settled it (``unrestricted``)."""

    def __post_init__(self) -> None:
        self._check_types()
        self._check_full_nodes()
        self.param_dtype = canonical_dtype(self.param_dtype, "param_dtype")
        if self.autocast_dtype is not None:
            self.autocast_dtype = canonical_dtype(self.autocast_dtype, "autocast dtype")
            if self.autocast_dtype not in AUTOCAST_DTYPES:
                raise BadInput(f"--autocast {self.autocast_dtype} is not a dtype torch.autocast "
                               "computes in; use bf16 or fp16.")
            if self.param_dtype != "float32":
                raise BadInput(f"--autocast keeps float32 parameters (FSDP gathers them in "
                               f"float32 and autocast casts per op), so --param-dtype "
                               f"{self.param_dtype} cannot go with it; leave --param-dtype out "
                               "(or give fp32).")
        self.asked_reduce_dtype = self.reduce_dtype
        if self.reduce_dtype not in (None, "auto"):  # auto: the search tries float32 and bf16
            self.reduce_dtype = canonical_dtype(self.reduce_dtype, "reduce_dtype")
        limits = limits_for(self.framework)
        if limits is not None and limits.restricts:
            self.reduce_dtype = limits.reduce_dtype_for(self.param_dtype, self.reduce_dtype)
            limits.check_strategy(self.strategy)
            if self.gradient_sync == "last" and self.grad_accum_steps > 1:
                raise BadInput(f"--framework {self.framework} reduces gradients after every "
                               "micro-batch; gradient_sync last needs the policy's "
                               "prepare_microbatch (plan without --framework).")
        elif self.reduce_dtype is None:
            self.reduce_dtype = "float32"
        if self.headroom_bytes is None:
            self.headroom_bytes = self.budget_bytes // 10
        if not 0 <= self.headroom_bytes < self.budget_bytes:
            raise BadInput(f"headroom {format_bytes(self.headroom_bytes)} must be at least 0 and "
                           f"leave part of the budget {format_bytes(self.budget_bytes)}.")
        if self.optimizer not in OPTIMIZER_STATES:
            raise BadInput(f"optimizer {self.optimizer!r} is not one of "
                           f"{', '.join(OPTIMIZER_STATES)}.")
        if self.activation_memory_budget is not None:
            if not self.compile_blocks:
                raise BadInput("--activation-memory-budget sets the compiled blocks' "
                               "partitioner budget; add --compile (or drop the budget).")
            if not 0 <= self.activation_memory_budget <= 1:
                raise BadInput(f"--activation-memory-budget {self.activation_memory_budget} is "
                               "outside 0..1 (the fraction of the default saved activations "
                               "the partitioner may keep); give e.g. 0.5.")
        if self.search.compile_auto and self.limits is not None:
            raise BadInput(f"--compile auto with --framework {self.framework}: its exported "
                           "configuration cannot say compiled blocks, so only eager plans "
                           "could be kept; plan without --compile for an eager "
                           f"{self.framework} plan, or without --framework to weigh compiled "
                           "blocks against eager (export then writes a hook that compiles "
                           "them).")
        if self.compile_blocks and self.limits is not None:
            raise BadInput(f"--compile with --framework {self.framework}: the exported "
                           "configuration does not say compiled blocks yet; plan without "
                           "--framework (export then writes a hook that compiles them).")
        if self.search.compile_auto and not self.compile_blocks:
            raise BadInput("SearchOptions.compile_auto compares eager with compiled blocks; set "
                           "compile_blocks too.")
        if self.compile_blocks and self.strategy == "ddp":
            raise BadInput("--compile plans compiled blocks for FSDP2 (sharded) plans; DDP with "
                           "compiled blocks is not modelled. Drop --compile or --strategy ddp.")
        if self.allow_offload:  # before any work: h2d_bandwidth 0 cannot price the copies
            pcie_bandwidth(self.hardware)
        if self.optimizer_overlap:
            self._check_optimizer_overlap()

    def _check_optimizer_overlap(self) -> None:
        """``--optimizer-overlap`` only where one backward makes one optimizer step, the policy
        installs the step, and there is an optimizer."""
        fix = "drop --optimizer-overlap, or"
        if self.optimizer == "none":
            raise BadInput(f"--optimizer-overlap steps the optimizer in backward, and --optimizer "
                           f"none has none; {fix} name the training script's optimizer.")
        if self.grad_accum_steps > 1 or self.global_batch_size is not None:
            raise BadInput(f"--optimizer-overlap steps each parameter in every backward, so one "
                           "optimizer step is one micro-batch: no accumulation, and no "
                           f"--global-batch-size for the planner to split; {fix} give the "
                           "per-rank --batch-size.")
        if self.framework is not None:
            raise BadInput(f"--optimizer-overlap with --framework {self.framework}: the "
                           "framework steps its own optimizer after backward; the policy's "
                           f"apply installs the in-backward step in a loop of your own. {fix} "
                           "plan without --framework.")
        if self.strategy not in ("auto", *OVERLAP_STRATEGIES):
            raise BadInput(f"--optimizer-overlap with --strategy {self.strategy}; {fix} choose "
                           f"one of {', '.join(OVERLAP_STRATEGIES)}.")

    def _check_types(self) -> None:
        """Every field of the right type and the counts in range, before anything divides by
        them ([Note: API arguments] in common/arguments.py)."""
        require_type(self.source, ModelSource, "PlanRequest.source")
        require_whole(self.budget_bytes, "PlanRequest.budget_bytes", 1, MAX_BYTES)
        if self.headroom_bytes is not None:
            require_whole(self.headroom_bytes, "PlanRequest.headroom_bytes", 0, MAX_BYTES)
        require_whole(self.world_size, "PlanRequest.world_size", 1, MAX_WORLD_SIZE)
        require_whole(self.gpus_per_node, "PlanRequest.gpus_per_node", 1, MAX_GPUS_PER_NODE)
        require_choice(self.strategy, "PlanRequest.strategy", STRATEGY_CHOICES)
        require_type(self.param_dtype, str, "PlanRequest.param_dtype")
        require_type(self.reduce_dtype, (str, type(None)), "PlanRequest.reduce_dtype")
        require_type(self.autocast_dtype, (str, type(None)), "PlanRequest.autocast_dtype")
        require_type(self.optimizer, str, "PlanRequest.optimizer")
        require_type(self.hardware, Hardware, "PlanRequest.hardware")
        require_type(self.hardware_origin, (dict, type(None)), "PlanRequest.hardware_origin")
        require_type(self.search, SearchOptions, "PlanRequest.search")
        for flag in ("allow_offload", "allow_lossy_hooks", "compile_blocks", "optimizer_overlap"):
            require_type(getattr(self, flag), bool, f"PlanRequest.{flag}")
        require_whole(self.grad_accum_steps, "PlanRequest.grad_accum_steps", 1,
                      MAX_GRAD_ACCUM_STEPS)
        require_choice(self.gradient_sync, "PlanRequest.gradient_sync", ("every", "last"))
        if self.global_batch_size is not None:
            require_whole(self.global_batch_size, "PlanRequest.global_batch_size", 1,
                          MAX_BATCH_SIZE * MAX_GRAD_ACCUM_STEPS)
        if self.activation_memory_budget is not None:
            require_type(self.activation_memory_budget, (int, float),
                         "PlanRequest.activation_memory_budget")
        require_type(self.framework, (str, type(None)), "PlanRequest.framework")

    def _check_full_nodes(self) -> None:
        """Nodes are full, as in the plan the request writes (issue 31, S4-16: what planning
        writes reads back)."""
        if self.world_size > self.gpus_per_node and self.world_size % self.gpus_per_node:
            raise BadInput(f"PlanRequest world_size {self.world_size} is not a multiple of "
                           f"gpus_per_node {self.gpus_per_node}; nodes must be full, as in the "
                           "plan it writes.")

    def analysis_options(self) -> dict[str, Any]:
        """How ``analyze_model`` traces for this request: FSDP mixed precision or autocast, the
        torchtitan recipe's selective stride, compiled blocks, and (when DDP may be chosen below
        float32) the step under autocast that DDP computes ([Note: autocast precision])."""
        lower = DTYPE_BYTES[self.param_dtype] < 4 and self.autocast_dtype is None
        # --compile auto's eager side may choose DDP (search/compile_choice.py); compiled may not
        ddp = (self.strategy in ("auto", "ddp") and lower
               and (not self.compile_blocks or self.search.compile_auto))
        return {"param_dtype": self.param_dtype, "autocast_dtype": self.autocast_dtype,
                "exact": self.search.exact_analysis,
                "selective_strides": (TORCHTITAN_MM_STRIDE,),
                "ddp_limit_bytes": self.limit_bytes if ddp else None,
                "compile_blocks": self.compile_blocks,
                "activation_memory_budget": self.activation_memory_budget}

    @property
    def limits(self) -> FrameworkLimits | None:
        """The framework's limits the search keeps to (None: no framework, or one whose
        configuration restricts nothing)."""
        limits = limits_for(self.framework)
        return limits if limits is not None and limits.restricts else None

    def at_its_micro_batch(self) -> PlanRequest:
        """This request planned at its own micro-batch (``source.batch_size``, with its
        accumulation): no global batch to split and no micro-batches weighed."""
        return dataclasses.replace(self, global_batch_size=None,
                                   search=dataclasses.replace(self.search, auto_batch=False))

    def unrestricted(self) -> PlanRequest:
        """This request without its framework, as planning without ``--framework`` sees it
        (the reduce dtype as the user gave it): what the restriction is priced against."""
        return dataclasses.replace(self, framework=None, reduce_dtype=self.asked_reduce_dtype)

    @property
    def limit_bytes(self) -> int:
        """The peak a plan may reach: budget minus headroom."""
        return budget_limit(self.budget_bytes, int(self.headroom_bytes or 0))

    def settings(self) -> SearchSettings:
        """What the search holds fixed for this request."""
        return SearchSettings(budget_bytes=self.budget_bytes,
                              headroom_bytes=int(self.headroom_bytes or 0),
                              world_size=self.world_size, gpus_per_node=self.gpus_per_node,
                              strategy=self.strategy,
                              precision=Precision.of(self.param_dtype, self.reduce_dtype),
                              optimizer=self.optimizer, hardware=self.hardware,
                              grad_accum_steps=self.grad_accum_steps,
                              gradient_sync=self.gradient_sync,
                              micro_batch=self.source.batch_size,
                              allow_lossy_hooks=self.allow_lossy_hooks,
                              optimizer_overlap=self.optimizer_overlap)
