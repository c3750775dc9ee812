"""DDP as a strategy handed to the search: ``DistributedDataParallel`` over the whole world,
its bucket cap chosen on the same clock and memory budget as the FSDP candidates.

The buckets, their ready order, DDP's memory and its step are cost models
(cost/ddp_buckets.py [Note: DDP buckets]), evaluated on the step as DDP computes it (under
autocast below float32: ``Analysis.for_ddp``, [Note: autocast precision]); this module only proposes configurations: each
cap of ``CAP_GRID_MB`` with a first bucket as large (an explicit ``bucket_cap_mb``) or of
1 MiB, and DDP's defaults as a named recipe when they are not the fastest.
"""

from __future__ import annotations

import dataclasses

from fsdp_plan.cost.comm_hooks import COMM_HOOKS, compress_hook_for
from fsdp_plan.cost.ddp_buckets import (
    CAP_GRID_MB,
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_MB,
    DDPConfig,
    unused_parameters,
)
from fsdp_plan.facts.types import Analysis, ModuleGraph
from fsdp_plan.search.candidate import Candidate, DDPDetail, Layout, SearchSettings
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.framework import FrameworkLimits


class DdpStrategy:
    """The fastest DDP bucket configuration (and DDP's default buckets when they differ); with
    ``limits``, only those a framework's configuration says (search/framework.py)."""

    def __init__(self, limits: FrameworkLimits | None = None) -> None:
        self.limits = limits

    @staticmethod
    def hooks(settings: SearchSettings) -> list[tuple[str | None, int]]:
        """The (hook, PowerSGD rank) pairs to try. A reduced-precision reduction the user asked
        for (``--reduce-dtype``) is the cast hook of that dtype; with ``--allow-lossy-hooks``
        DDP's own all-reduce, both cast hooks and PowerSGD at each rank of ``POWERSGD_RANKS``
        compete (on a CPU, gloo, only fp16: gloo refuses the bf16 hook, and completes
        PowerSGD's all-reduces on its own threads, where ranks may issue the next ones in
        different orders)."""
        asked = compress_hook_for(settings.precision.reduce_dtype)
        if not settings.allow_lossy_hooks:
            return [(asked, 1)]
        out: list[tuple[str | None, int]] = [(None, 1)]
        for kind in COMM_HOOKS.values():
            if kind.on_gloo or settings.hardware.async_launch:
                out += [(kind.name, r) for r in kind.ranks]
        return out

    def candidates(self, evaluator: Evaluator) -> list[Candidate]:
        """A lossy hook is used only when the user allowed it: a reduced-precision gradient
        reduction (``--reduce-dtype``) or ``--allow-lossy-hooks``."""
        s = evaluator.settings
        if evaluator.analysis.ddp_unavailable:
            return []  # the model fails under autocast, as DDP would run it
        configs = config_options(evaluator.graph, evaluator.analysis.for_ddp(),
                                 hooks=self.hooks(s), unused=any(
                                     p.ready_event is None
                                     for p in evaluator.ddp_ready_order().params))
        if self.limits is not None:
            configs = self.limits.ddp_configs(configs, s.precision.reduce_bytes)
            if not configs:
                return []
        evaluated = [evaluator.evaluate(ddp_layout(s, c), label(c)) for c in configs]
        best = best_config(evaluated)
        out = [best]
        default = next((c for c in evaluated if _is_default(ddp_config(c))), best)
        if default is not best:
            out.append(dataclasses.replace(default, name=f"recipe: {default.name} (DDP default)"))
        return out

    def recipes(self, evaluator: Evaluator) -> list[Candidate]:
        return []


def ddp_layout(settings: SearchSettings, config: DDPConfig) -> Layout:
    """DDP over the whole world with ``config``'s buckets."""
    return Layout(strategy="ddp", mesh=(settings.world_size, 1), ddp=config)


def ddp_config(candidate: Candidate) -> DDPConfig:
    """The bucket configuration of a DDP candidate."""
    assert isinstance(candidate.detail, DDPDetail), "a DDP candidate carries its buckets"
    return candidate.detail.config


def label(config: DDPConfig) -> str:
    """A DDP candidate's name: its cap, its first bucket and its hook."""
    first = (f", first {config.first_bucket_mb:g} MiB"
             if config.first_bucket_mb != config.bucket_cap_mb else "")
    return f"ddp buckets {config.bucket_cap_mb:g} MiB{first}{hook_label(config)}"


def hook_label(config: DDPConfig) -> str:
    """A candidate name's words for its communication hook ('' for none)."""
    if config.comm_hook is None:
        return ""
    if config.comm_hook == "powersgd":
        return f", PowerSGD rank {config.powersgd_rank}"
    return f", {config.comm_hook.split('_')[0]} all-reduce"


def config_options(graph: ModuleGraph, analysis: Analysis, *,
                   hooks: list[tuple[str | None, int]] | None = None,
                   caps: tuple[int, ...] = CAP_GRID_MB, unused: bool | None = None
                   ) -> list[DDPConfig]:
    """The configurations the search tries: each cap with a first bucket as large (an explicit
    ``bucket_cap_mb``) or of 1 MiB, ``find_unused_parameters`` exactly when a parameter gets no
    gradient. ``static_graph`` stays off: one traced step cannot show that the graph never
    changes (data-dependent control flow), and it changes no bucket or byte here. ``unused``
    (whether any parameter gets no gradient) spares recomputing it when the caller knows.
    ``hooks``: (communication hook, PowerSGD rank) pairs, each tried with every cap (default:
    DDP's own all-reduce)."""
    if unused is None:
        unused = bool(unused_parameters(graph, analysis))
    out = []
    for hook, rank in hooks or [(None, 1)]:
        for cap in caps:
            for first in sorted({cap, min(cap, DEFAULT_FIRST_BUCKET_MB)}, reverse=True):
                out.append(DDPConfig(bucket_cap_mb=cap, first_bucket_mb=first,
                                     find_unused_parameters=unused, comm_hook=hook,
                                     powersgd_rank=rank))
    return out


def _is_default(config: DDPConfig) -> bool:
    return (config.bucket_cap_mb, config.first_bucket_mb) == (DEFAULT_BUCKET_CAP_MB,
                                                              DEFAULT_FIRST_BUCKET_MB)


def best_config(evaluated: list[Candidate]) -> Candidate:
    """The fastest DDP candidate; ties go to the one closest to DDP's defaults."""
    def key(c: Candidate) -> tuple[float, int, int]:
        config = ddp_config(c)
        return (round(c.time.step_s, 9), 0 if _is_default(config) else 1,
                abs(config.bucket_cap_mb - 25))
    return min(evaluated, key=key)


def sweep(evaluator: Evaluator, caps: tuple[int, ...] = CAP_GRID_MB) -> list[Candidate]:
    """One candidate per cap (first bucket as large): the step-time curve over the cap."""
    s = evaluator.settings
    unused = bool(unused_parameters(evaluator.graph, evaluator.analysis.for_ddp()))
    hook = compress_hook_for(s.precision.reduce_dtype)
    configs = [DDPConfig(bucket_cap_mb=cap, first_bucket_mb=cap, find_unused_parameters=unused,
                         comm_hook=hook) for cap in caps]
    return [evaluator.evaluate(ddp_layout(s, c), label(c)) for c in configs]
