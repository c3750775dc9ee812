"""What a training framework's own configuration can say about FSDP, as data the search is
handed (``--framework``).

[Note: framework limits]
``--framework NAME`` keeps the search to the plans NAME's configuration applies by itself, so
the exported configuration (export/NAME.py) runs the predicted plan with no code hook. Read in
accelerate 1.15, transformers 5 (the Trainer prepares through accelerate), Lightning 2.6 and
torchtitan 0.3:

- accelerate, FSDP version 2 (``fsdp2_prepare_model``): ``fully_shard`` on every module of
  the classes in ``fsdp_transformer_layer_cls_to_wrap`` (bottom-up, each its own unit) with
  one ``fsdp_reshard_after_forward``; then the final norm (``_find_final_norm``: the last
  direct child of the base model whose class name contains "Norm", for any model) as a unit
  of its own kept gathered after forward; then the root with FSDP2's default (not resharded
  after forward). A model with ``get_input_embeddings`` (Hugging Face) also gets its untied
  input embedding as a unit (with the blocks' reshard flag) and its output embedding in the
  final norm's unit (``[model.norm, lm_head]``, kept gathered); the graph records those
  modules (``ModuleGraph.hf_embeddings``), so the restricted search plans them
  (``class_tail``), and the check after the search (export/common ``framework_gaps``) agrees.
  ``fsdp_activation_checkpointing`` wraps every module of those classes in
  ``checkpoint_wrapper`` (full) or none; ``fully_shard`` then also lands on each wrapper,
  whose parameters its block's unit already holds (an empty unit: no collective, no memory). No explicit prefetch (FSDP2's implicit one unit in
  backward). ``mixed_precision: bf16|fp16`` is ``MixedPrecisionPolicy(param_dtype=d,
  reduce_dtype=d, output_dtype=d)`` and ``no`` keeps float32: one dtype for parameters and
  reduction, no autocast (the FSDP2 path skips ``prepare_model``'s autocast wrapper). HSDP
  through ``parallelism_config``, CPU offload through ``fsdp_offload_params``; gradients are
  reduced after every micro-batch. DDP (``MULTI_GPU``): DDP's default buckets, no
  ``find_unused_parameters``, no hook, no checkpointing; planned only where gradients are
  reduced in float32 (accelerate's DDP all-reduces what autocast left in float32).
- The Trainer: the same through accelerate, without HSDP (its ``fsdp`` words shard over all
  ranks); DDP buckets all of one size (``ddp_bucket_cap_mb``), ``ddp_find_unused_parameters``.
- Lightning ``ModelParallelStrategy``: FSDP2 is applied only by the LightningModule's
  ``configure_model``; its configuration names no unit, so every sharded plan needs the hook.
  ``--framework lightning`` plans without restriction and records the framework.
- torchtitan (``apply_fsdp_to_decoder``): ``tok_embeddings``, each block of ``layers``,
  ``[norm, lm_head]`` together (``[tok_embeddings, norm, lm_head]`` one unit when
  ``enable_weight_tying`` ties them, kept gathered too), then the root; ``fsdp_reshard_after_forward`` ``always`` (all
  resharded), ``default`` (all but [norm, lm_head]) or ``never``; FullAC on every block or
  none (its SelectiveAC "op" policy saves every other matmul, which fsdp-plan's selective
  mode does not model); ``mixed_precision_param`` bfloat16 or float32 with float32
  reduction; no explicit prefetch for dense models; no DDP plan (its replicate degree runs
  with its own settings). The units are named as torchtitan's model names them.

Everything here is a pure function of the module graph: the search consults it
(search/fsdp.py, search/ddp.py, search/offload.py, search/run.py, search/batching.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.cost.ddp_buckets import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_MB, DDPConfig
from fsdp_plan.cost.units import check_tied, with_full_precision_units
from fsdp_plan.facts.types import ModuleGraph

FRAMEWORKS = ("accelerate", "trainer", "lightning", "torchtitan")
"""The frameworks ``--framework`` plans for and ``export --to`` writes files for."""

TITAN_EMBEDDINGS = "tok_embeddings"
TITAN_TAIL = ("norm", "lm_head")
"""torchtitan 0.3's names of the modules it gives units besides the blocks."""
TITAN_TIED_TAIL = (TITAN_EMBEDDINGS, *TITAN_TAIL)
"""torchtitan's one unit for all three when ``enable_weight_tying`` ties the embedding and
the head (its 1B and 3B Llama flavours), kept gathered as ``[norm, lm_head]`` is."""


@dataclass(frozen=True, kw_only=True)
class FrameworkLimits:
    """What one framework's configuration can say (see [Note: framework limits])."""

    name: str
    restricts: bool = True
    """False: the configuration says no unit at all (Lightning), so nothing is restricted."""
    units: str = "class"
    """``class``: every module of the blocks' classes, one unit each, the final norm, the
    root; ``torchtitan``: ``tok_embeddings``, each block, ``[norm, lm_head]``, the root."""
    strategies: frozenset[str] = frozenset({"full", "grad-op", "hybrid", "ddp"})
    param_dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")
    reduce: str = "param"
    """``param``: gradients are reduced in the parameter dtype; ``float32``: always float32."""
    precision_text: str = ""
    """How the framework's precision setting works, for the refusal message."""
    ddp_buckets: str | None = "default"
    """``default``: DDP's own buckets only; ``uniform``: one cap for every bucket (or the
    default); None: no DDP plan."""
    ddp_find_unused: bool = False
    """Whether the configuration can set ``find_unused_parameters``."""

    # --- the request ----------------------------------------------------------------------

    def reduce_dtype_for(self, param_dtype: str, reduce_dtype: str | None) -> str:
        """The reduction dtype to plan with: the framework's when the user left it open
        (None or ``auto``); the user's when the framework can say it; else ``BadInput``."""
        if param_dtype not in self.param_dtypes:
            raise BadInput(f"--framework {self.name} cannot compute in {param_dtype}: "
                           f"{self.precision_text} Use --param-dtype "
                           f"{' or '.join(_SHORT[d] for d in self.param_dtypes)}.")
        own = param_dtype if self.reduce == "param" else "float32"
        if reduce_dtype in (None, "auto", own):
            return own
        raise BadInput(f"--reduce-dtype {_SHORT.get(reduce_dtype, reduce_dtype)} cannot be said "
                       f"by {self.name}'s configuration with --param-dtype {_SHORT[param_dtype]}: "
                       f"{self.precision_text} Leave --reduce-dtype out (it is then "
                       f"{_SHORT[own]}), or plan without --framework (export then writes a "
                       "code hook that keeps the plan's precision).")

    def check_strategy(self, strategy: str) -> None:
        """``--strategy`` must be one the configuration can say (or ``auto``)."""
        if strategy != "auto" and strategy not in self.strategies:
            raise BadInput(f"--strategy {strategy} cannot be said by {self.name}'s "
                           f"configuration; it can say {', '.join(sorted(self.strategies))} "
                           "(or leave --strategy auto).")

    # --- the search -----------------------------------------------------------------------

    def unit_layouts(self, graph: ModuleGraph, full_precision_units: bool
                     ) -> dict[str, list[list[str]]]:
        """The one unit layout the configuration makes (children first, root excluded), or
        none when it cannot make one for this model (no blocks, nested or tied blocks, batch
        norm that needs a unit of its own under mixed precision)."""
        groups = (titan_units(graph) if self.units == "torchtitan" else _class_units(graph))
        if not groups or not check_tied(graph, groups):
            return {}
        if full_precision_units and with_full_precision_units(graph, groups) != groups:
            return {}  # one mixed precision for every unit: no batch norm of its own
        return {self.units: groups}

    def reshard_options(self, graph: ModuleGraph, groups: list[list[str]], strategy: str
                        ) -> list[tuple[bool, ...]]:
        """Each unit's ``reshard_after_forward`` the configuration can say for ``groups``:
        one flag for all (accelerate; grad-op is all false); torchtitan's ``always``,
        ``default`` ([norm, lm_head] kept) and ``never`` (grad-op)."""
        if strategy == "grad-op":
            return [tuple(False for _ in groups)]
        every = tuple(True for _ in groups)
        if self.units != "torchtitan":  # the final norm (with a Hugging Face head) is kept gathered
            tail = sorted(class_tail(graph))
            return [tuple(sorted(g) != tail for g in groups)]
        default = tuple(tuple(g) not in (TITAN_TAIL, TITAN_TIED_TAIL) for g in groups)
        return [every] if default == every else [every, default]

    def checkpoint_paths(self, graph: ModuleGraph, groups: list[list[str]], n_blocks: int
                         ) -> list[list[tuple[int, int]]]:
        """``(n_full, n_selective)`` counts: none, or every block fully checkpointed where the
        configuration's checkpointing wraps exactly the blocks."""
        wrapped = {g[0] for g in groups if len(g) == 1}
        if n_blocks == 0 or not set(graph.blocks) <= wrapped:
            return [[(0, 0)]]
        wrapped.discard(final_norm(graph) or "")
        wrapped.discard((graph.hf_embeddings or {}).get("input") or "")
        if self.units == "class" and len(wrapped) != n_blocks:
            return [[(0, 0)]]  # accelerate would checkpoint every wrapped module, not blocks
        return [[(0, 0), (n_blocks, 0)]]

    def ddp_configs(self, configs: list[DDPConfig], reduce_bytes: int) -> list[DDPConfig]:
        """The DDP configurations the configuration can say, of those the search tries, as
        the framework applies them: ``gradient_as_bucket_view`` off (its default), no hook."""
        if self.ddp_buckets is None or reduce_bytes < 4:
            return []
        out: list[DDPConfig] = []
        for c in configs:
            default = (c.bucket_cap_mb, c.first_bucket_mb) == (DEFAULT_BUCKET_CAP_MB,
                                                               DEFAULT_FIRST_BUCKET_MB)
            buckets = default or (self.ddp_buckets == "uniform"
                                  and c.first_bucket_mb == c.bucket_cap_mb)
            said = dataclasses.replace(c, gradient_as_bucket_view=False, comm_hook=None)
            if (buckets and not c.static_graph and said not in out
                    and (self.ddp_find_unused or not c.find_unused_parameters)):
                out.append(said)
        return out

    def allows(self, layout, graph: ModuleGraph, full_precision_units: bool) -> bool:
        """Whether the configuration says ``layout`` (a ``search.candidate.Layout``) exactly:
        used on candidates the search did not make under these limits (recipes, rescues)."""
        if layout.strategy not in self.strategies:
            return False
        if layout.strategy == "ddp":
            return (not layout.full and not layout.selective and layout.ddp is not None
                    and self.ddp_configs([layout.ddp], 4) == [layout.ddp])
        layouts = self.unit_layouts(graph, full_precision_units)
        groups = [list(g) for g in layout.groups]
        if groups not in layouts.values() or layout.root_reshard:
            return False
        if tuple(layout.reshard) not in self.reshard_options(graph, groups, layout.strategy):
            return False
        counts = (len(layout.full), len(layout.selective - layout.full))
        paths = self.checkpoint_paths(graph, groups, len(graph.blocks))
        if counts not in {c for path in paths for c in path}:
            return False
        return (layout.forward_prefetch, layout.backward_prefetch) == PREFETCH


PREFETCH = (0, 1)
"""Forward and backward prefetch depths a configuration gets: FSDP2's implicit prefetch."""

_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

_ACCELERATE_PRECISION = ("accelerate's mixed_precision bf16 or fp16 casts parameters, gradient "
                         "reduction and outputs to that one dtype (FSDP2 MixedPrecisionPolicy), "
                         "and no keeps all three in float32.")

LIMITS: dict[str, FrameworkLimits] = {
    "accelerate": FrameworkLimits(name="accelerate", precision_text=_ACCELERATE_PRECISION),
    "trainer": FrameworkLimits(
        name="trainer", strategies=frozenset({"full", "grad-op", "ddp"}),
        precision_text="the Trainer's bf16/fp16 is accelerate's: " + _ACCELERATE_PRECISION,
        ddp_buckets="uniform", ddp_find_unused=True),
    "lightning": FrameworkLimits(name="lightning", restricts=False),
    "torchtitan": FrameworkLimits(
        name="torchtitan", units="torchtitan",
        strategies=frozenset({"full", "grad-op", "hybrid"}),
        param_dtypes=("bfloat16", "float32"), reduce="float32",
        precision_text="torchtitan computes in mixed_precision_param (bfloat16 or float32) and "
                       "reduces in mixed_precision_reduce, which its FSDP path keeps float32.",
        ddp_buckets=None),
}


def limits_for(framework: str | None) -> FrameworkLimits | None:
    """The limits of ``framework`` (None: no framework); ``BadInput`` for an unknown name."""
    if framework is None:
        return None
    if framework not in LIMITS:
        raise BadInput(f"--framework {framework!r} is not a framework fsdp-plan plans for; "
                       f"choose one of {', '.join(FRAMEWORKS)}.")
    return LIMITS[framework]


def final_norm(graph: ModuleGraph) -> str | None:
    """The module accelerate's ``_find_final_norm`` gives a unit of its own: the last direct
    child of the base model (a Hugging Face model's, recorded in ``graph.hf_embeddings``;
    else the root) whose class name contains "Norm"."""
    if graph.hf_embeddings is not None:
        return graph.hf_embeddings.get("final_norm")
    found = None
    for child in graph.modules[""].children:
        if "Norm" in graph.modules[child].class_name:
            found = child
    return found


def class_tail(graph: ModuleGraph) -> list[str]:
    """The unit accelerate keeps gathered after forward: the final norm, for a Hugging Face
    model grouped with the output embedding (and the input one when they are tied)."""
    norm = final_norm(graph)
    hf = graph.hf_embeddings or {}
    tail = [norm] if norm is not None else []
    if hf.get("output"):
        tail += ([hf["input"]] if hf.get("tied") and hf.get("input") else []) + [hf["output"]]
    return [fqn for fqn in dict.fromkeys(tail) if fqn in graph.modules]


def _class_units(graph: ModuleGraph) -> list[list[str]]:
    """Every module of the blocks' classes, one unit each, the final norm (a Hugging Face
    model's with its output embedding, and its untied input embedding a unit of its own:
    ``fsdp2_prepare_model``), in module order; none when one of them holds another (the
    search's layouts never nest units)."""
    classes = {graph.modules[b].class_name for b in graph.blocks}
    fqns = [fqn for fqn, info in graph.modules.items() if fqn and info.class_name in classes]
    tail = [f for f in class_tail(graph) if f not in fqns]
    hf = graph.hf_embeddings or {}
    embedding = ([hf["input"]] if hf.get("input") and not hf.get("tied")
                 and hf["input"] in graph.modules and hf["input"] not in fqns else [])
    groups = [[f] for f in fqns + embedding] + ([tail] if tail else [])
    flat = [f for g in groups for f in g]
    prefixes = tuple(f + "." for f in flat)
    if not fqns or any(f.startswith(prefixes) for f in flat):
        return []
    order = {fqn: i for i, fqn in enumerate(graph.modules)}
    return sorted(groups, key=lambda g: order[g[0]])


def titan_units(graph: ModuleGraph) -> list[list[str]]:
    """torchtitan's units: ``tok_embeddings``, each block, ``[norm, lm_head]`` (when the
    model has both), in module order; ``[tok_embeddings, norm, lm_head]`` one unit when the
    embedding and the head share their weight."""
    if not graph.blocks:
        return []
    groups = [[b] for b in graph.blocks]
    tied = (any(TITAN_EMBEDDINGS in t and TITAN_TAIL[1] in t for t in graph.tied_groups)
            and all(m in graph.modules for m in TITAN_TIED_TAIL))
    if tied:  # enable_weight_tying
        groups.append(list(TITAN_TIED_TAIL))
    else:
        if TITAN_EMBEDDINGS in graph.modules:
            groups.append([TITAN_EMBEDDINGS])
        if all(m in graph.modules for m in TITAN_TAIL):
            groups.append(list(TITAN_TAIL))
    order = {fqn: i for i, fqn in enumerate(graph.modules)}
    return sorted(groups, key=lambda g: order[g[0]])


@dataclass(frozen=True, kw_only=True)
class FrameworkCost:
    """What keeping to a framework's configuration costs against the unrestricted plan (both
    searched on the same facts), or why nothing was restricted."""

    framework: str
    restricted: bool
    """The chosen plan is the restricted one: the configuration alone runs it."""
    step_s: float | None = None
    peak_bytes: int | None = None
    free_step_s: float | None = None
    """The unrestricted plan's step (None: without the restriction nothing fits)."""
    free_peak_bytes: int | None = None
    free_name: str = ""
    why: str = ""
    """Why the plan is not restricted (the configuration says no plan that fits)."""

    def line(self) -> str:
        """One report line: the restriction's cost, or why there is none."""
        if not self.restricted:
            return (f"--framework {self.framework}: {self.why}; planned without restriction, "
                    f"so `fsdp-plan export --to {self.framework}` writes the code hook.")
        head = f"restricted to {self.framework}'s configuration"
        if self.free_step_s is None or self.step_s is None or self.peak_bytes is None:
            return f"{head}: without the restriction no plan fits; export needs no code hook."
        step = self.step_s / self.free_step_s - 1
        peak = self.peak_bytes - int(self.free_peak_bytes or 0)
        return (f"{head}: {step:+.1%} step time ({self.step_s:.4g} s vs "
                f"{self.free_step_s:.4g} s), {'+' if peak >= 0 else '-'}"
                f"{format_bytes(abs(peak))} peak against the unrestricted plan "
                f"({self.free_name}); the exported configuration needs no code hook.")


LIGHTNING_WHY = ("Lightning's ModelParallelStrategy applies FSDP2 only in the LightningModule's "
                 "configure_model, so its configuration names no unit and every sharded plan "
                 "needs that hook")
