"""The kinds of memory the memory model's breakdown counts: one table that the pictures, the
report and ``verify`` read (issue 28 item 2), so a new kind is one entry here plus where the
memory model sizes it (cost/memory.py, cost/ddp_buckets.py, cost/offload.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class MemoryCategory:
    """One key of ``predicted.breakdown`` (and of the memory model's ``breakdown``)."""

    key: str
    label: str
    """How a picture names it."""
    color: str
    """Its colour on the HTML page: blues parameters, purple optimizer states, greens
    gradients, orange activations (light orange: what the loss holds), yellow communication."""
    group: str | None = None
    """Its term in the report's ``states + unsharded + comm + act`` summary (None: not one)."""
    tracker_names: tuple[str, ...] = ()
    """PyTorch's FSDPMemTracker categories (``_FSDPRefType`` / ``_MemRefType`` values) that
    ``verify`` counts as it."""
    mem_tracker_names: tuple[str, ...] = ()
    """``MemTracker``'s categories (a DDP rank's measurement, measure/ddp.py) counted as it."""


MEMORY_CATEGORIES: tuple[MemoryCategory, ...] = (
    MemoryCategory(key="sharded_params", label="parameters (sharded)", color="#1f4e79",
                   group="states", tracker_names=("Sharded Param",)),
    MemoryCategory(key="params", label="parameters", color="#1f4e79",
                   mem_tracker_names=("Parameter",)),
    MemoryCategory(key="unsharded_params", label="parameters (all-gathered)", color="#5b9bd5",
                   group="unsharded", tracker_names=("Unsharded Param",)),
    MemoryCategory(key="autocast_weights", label="autocast weight copies", color="#9dc3e6"),
    MemoryCategory(key="optimizer_states", label="optimizer states", color="#7030a0",
                   group="states", tracker_names=("OptState",), mem_tracker_names=("Optstate",)),
    MemoryCategory(key="sharded_grads", label="gradients (sharded)", color="#548235",
                   group="states", tracker_names=("Sharded Grad",)),
    MemoryCategory(key="gradient_buckets", label="gradients (DDP buckets)", color="#548235",
                   mem_tracker_names=("Gradient",)),
    MemoryCategory(key="grads", label="gradients", color="#70ad47"),
    MemoryCategory(key="accumulated_grads", label="gradients (accumulated)", color="#a9d18e"),
    MemoryCategory(key="unsharded_grads", label="gradients (unsharded)", color="#a9d18e",
                   group="unsharded", tracker_names=("Unsharded Grad",)),
    MemoryCategory(key="activations", label="activations", color="#ed7d31", group="act",
                   tracker_names=("Activation", "Temp"), mem_tracker_names=("Activation", "Temp")),
    MemoryCategory(key="loss", label="loss", color="#f4b183"),
    MemoryCategory(key="comm_buffers", label="communication buffers", color="#ffc000",
                   group="comm", tracker_names=("All Gather", "Reduce Scatter")),
    MemoryCategory(key="offload_copies", label="offload copies", color="#bf9000"),
    MemoryCategory(key="optimizer_temporaries", label="optimizer temporaries", color="#c00000",
                   group="comm"),
    MemoryCategory(key="buffers", label="module buffers", color="#7f7f7f", group="states",
                   tracker_names=("Buffer",), mem_tracker_names=("Buffer",)),
    MemoryCategory(key="inputs", label="inputs", color="#bfbfbf", group="states",
                   tracker_names=("Inputs",), mem_tracker_names=("Other",)),
)
"""Every kind, in stacking order (resident state at the bottom)."""


def summary_groups() -> dict[str, tuple[str, ...]]:
    """The report's summary terms in order (``states``, ``unsharded``, ``comm``, ``act``) and
    the keys each sums."""
    groups: dict[str, list[str]] = {name: [] for name in ("states", "unsharded", "comm", "act")}
    for category in MEMORY_CATEGORIES:
        if category.group is not None:
            groups[category.group].append(category.key)
    return {name: tuple(keys) for name, keys in groups.items()}


def tracker_to_breakdown() -> dict[str, str]:
    """FSDPMemTracker's category names -> the breakdown keys (several may share one key)."""
    return {name: c.key for c in MEMORY_CATEGORIES for name in c.tracker_names}


def mem_tracker_to_breakdown() -> dict[str, str]:
    """``MemTracker``'s category names -> the DDP prediction's breakdown keys."""
    return {name: c.key for c in MEMORY_CATEGORIES for name in c.mem_tracker_names}
