"""The one step that builds a model: load it on ``meta`` and analyse one fake step into
``ModelFacts``. Everything after this (cost, search, plan) is pure over the facts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsdp_plan.common.arguments import require_type
from fsdp_plan.common.collector import alive_now_frozen, cycle_collector_paused
from fsdp_plan.common.dtypes import canonical_dtype
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.progress import Progress
from fsdp_plan.facts.types import ModelFacts, ModelOutline
from fsdp_plan.model.source import ModelSource, source_digest

if TYPE_CHECKING:  # loading imports torch: named here for the annotations only
    from fsdp_plan.model.load import LoadedModel


@dataclass(kw_only=True)
class Analyzed:
    """A model built on ``meta`` and its facts (the one step that needs torch); ``loaded`` is
    None for facts read from the cache (facts/cache.py)."""

    loaded: LoadedModel | None
    facts: ModelFacts
    digest: str
    notes: list[str] = field(default_factory=list)
    outline: ModelOutline | None = None
    """What the model says for reading a plan against it (None: from the cache)."""


def analyze_model(source: ModelSource, *, param_dtype: str = "bfloat16", exact: bool = False,
                  progress: Progress | None = None, compile_blocks: bool = False,
                  activation_memory_budget: float | None = None, **options: Any) -> Analyzed:
    """Build the model on ``meta`` and run the fake forward + backward (facts/analysis.py);
    ``compile_blocks``: with the repeated blocks compiled (``--compile``); ``options`` as
    ``analyze_loaded`` takes them."""
    require_type(source, ModelSource, "analyze_model(source)")  # [Note: API arguments]
    # importing torch and tracing: [Note: pausing the cycle collector]
    with cycle_collector_paused():
        _, _, load = _torch_stages()
        with alive_now_frozen():  # torch's modules, imported just now, are no young cycles
            return analyze_loaded(load.load_model(source), param_dtype=param_dtype,
                                  exact=exact, progress=progress, compile_blocks=compile_blocks,
                                  activation_memory_budget=activation_memory_budget,
                                  **options)


def analyze_loaded(loaded: LoadedModel, *, param_dtype: str = "bfloat16", exact: bool = False,
                   progress: Progress | None = None, compile_blocks: bool = False,
                   activation_memory_budget: float | None = None,
                   autocast_dtype: str | None = None, selective_mm_stride: int = 1,
                   selective_strides: tuple[int, ...] = (),
                   ddp_limit_bytes: int | None = None) -> Analyzed:
    """``analyze_model`` for a model already loaded (verify and predict load it to check it).

    ``autocast_dtype``: float32 parameters, forward and loss under ``torch.autocast``
    ([Note: autocast precision] in common/autocast.py). The selective pass saves every
    ``selective_mm_stride``-th matmul, ``selective_strides`` adds passes at others.
    ``ddp_limit_bytes``: with ``param_dtype`` below float32, also trace the step under
    autocast for DDP candidates, unless the model's parameters and gradients alone exceed that
    limit (DDP cannot fit then)."""
    import torch  # see _torch_stages

    analysis, graph_of, load = _torch_stages()
    source = loaded.source
    graph = graph_of.build_module_graph(loaded.model)
    if graph.total_numel == 0:
        raise BadInput(f"model {source.source!r} has no parameters; there is nothing to shard.")
    if progress:
        for note in loaded.notes:
            progress(f"note: {note}")
        progress(f"analysing {graph.total_numel:,} parameters, batch {source.batch_size} x "
                 f"sequence {source.seq_len}")
    ddp_autocast = (ddp_limit_bytes is not None
                    and 2 * graph.total_param_bytes <= ddp_limit_bytes)
    with load.user_code_output_to_stderr():  # the model's print()s: stdout is the report's
        analysed = analysis.analyze(loaded,
                                    param_dtype=getattr(torch, canonical_dtype(param_dtype)),
                                    blocks=graph.blocks, exact=exact, progress=progress,
                                    compile_blocks=compile_blocks,
                                    activation_memory_budget=activation_memory_budget,
                                    autocast_dtype=(getattr(torch, canonical_dtype(autocast_dtype))
                                                    if autocast_dtype else None),
                                    selective_mm_stride=selective_mm_stride,
                                    selective_strides=selective_strides,
                                    ddp_autocast=ddp_autocast)
    return Analyzed(loaded=loaded, facts=ModelFacts(graph=graph, analysis=analysed),
                    digest=source_digest(source), notes=list(loaded.notes),
                    outline=graph_of.model_outline(loaded.model, graph))


def _torch_stages():
    """The stages that build and trace a live model, imported on first use: they import
    torch, and ``import fsdp_plan`` (and planning from saved facts) must not. The package's
    one deliberate deferred import of its own modules (as FSDP2 defers its own)."""
    from fsdp_plan.facts import analysis, graph
    from fsdp_plan.model import load
    return analysis, graph, load
