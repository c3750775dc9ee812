"""Test shorthand: a ``Layout`` from the keywords a test reads best, evaluated by name; the
tiny Llama's facts fixture and the source it was traced from."""

from __future__ import annotations

from pathlib import Path

from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.model.source import ModelSource
from fsdp_plan.search.candidate import Candidate, Layout
from fsdp_plan.search.evaluator import Evaluator

ROOT = Path(__file__).resolve().parent.parent
TINY_LLAMA_FACTS = ROOT / "tests" / "fixtures" / "tiny_llama_facts.json"
TINY_LLAMA = ModelSource(source=str(ROOT / "examples" / "llama.py"), args={"size": "tiny"},
                         batch_size=2, seq_len=64)
"""The source ``TINY_LLAMA_FACTS`` holds the facts of."""


def tiny_llama_facts() -> ModelFacts:
    """A fresh copy of the tiny Llama's facts (no torch model)."""
    return ModelFacts.from_json(TINY_LLAMA_FACTS.read_text())


def layout(*, strategy: str = "full", replicate: int = 1, shard: int = 1,
           groups: list[list[str]] | tuple = (), reshard: list[bool] | None = None,
           root_reshard: bool = False, k: int = 0, checkpoint: frozenset[int] | None = None,
           selective: frozenset[int] = frozenset(), forward_prefetch: int = 0,
           backward_prefetch: int = 1, offload: bool = False) -> Layout:
    """``groups`` children first (the root excluded); the first ``k`` blocks fully
    checkpointed, or the block indices in ``checkpoint``; ``reshard`` defaults to all True."""
    full = frozenset(range(k)) if checkpoint is None else frozenset(checkpoint)
    return Layout(strategy=strategy, mesh=(replicate, shard),
                  groups=tuple(tuple(g) for g in groups),
                  reshard=tuple([True] * len(groups) if reshard is None else reshard),
                  root_reshard=root_reshard, full=full, selective=frozenset(selective) - full,
                  forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch,
                  offload=offload)


def evaluate(ev: Evaluator, *, name: str = "x", **keywords) -> Candidate:
    """``ev.evaluate(layout(**keywords), name)``."""
    return ev.evaluate(layout(**keywords), name)
