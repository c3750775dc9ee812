"""Optimizer overlap (SPEC 8, ``optimizer_overlap: true``): each parameter stepped as soon as
its gradient is reduced, during backward, instead of one optimizer step after it.

[Note: optimizer overlap in the models]
The policy installs one optimizer per parameter (policy_runtime.py [Note: the optimizer in
backward]). What changes, in the memory model (cost/memory.py, cost/ddp_buckets.py):
- FSDP2: a unit's sharded gradient exists only while its parameters step, right after its
  reduce-scatter, beside the step's temporary for one parameter (AdamW's ``denom``, the size
  of that parameter's shard); the gradients of units already reduced are gone, and there is no
  optimizer-step phase after backward.
- DDP: the gradients still fill the buckets during backward (DDP allocates them), but the
  optimizer's temporaries are one parameter's, during backward, not the whole model's after it.
And in the clock (cost/step_time.py, cost/ddp_buckets.py): a unit's (or bucket's) optimizer
work runs after its reduce-scatter (all-reduce) on the same stream, FSDP2's reduce-scatter
stream (DDP's optimizer stream), so it hides behind the rest of backward and slows the compute
it overlaps like a collective does; what is left after backward ends the step. Where the host
computes in line (a CPU) the step runs on the backward's thread and adds to it.

Valid only where nothing reads gradients across parameters after backward (``overlap_refusal``).
"""

from __future__ import annotations

OVERLAP_STRATEGIES = ("full", "hybrid", "grad-op", "none", "ddp")
"""Strategies whose policy ``apply`` can install it: FSDP2's and DDP's (FSDP1, applied by the
user's own ``FullyShardedDataParallel`` call, cannot)."""


def overlap_refusal(*, strategy: str, optimizer: str, grad_accum_steps: int,
                    offload: bool, comm_hook: str | None) -> str | None:
    """Why a plan of these settings cannot step its optimizer in backward (None: it can)."""
    if optimizer == "none":
        return "the plan has no optimizer (optimizer: none) to step in backward"
    if strategy not in OVERLAP_STRATEGIES:
        return f"strategy {strategy!r} is not applied by the policy's apply (FSDP2 or DDP)"
    if grad_accum_steps > 1:
        return (f"the plan accumulates {grad_accum_steps} micro-batches per optimizer step, and "
                "a parameter stepped in backward cannot wait for the later ones")
    if offload:
        return ("the plan offloads to the CPU, where the in-backward steps would run on the "
                "host inside backward, which the planner does not model")
    if comm_hook is not None:
        return (f"the plan's DDP communication hook {comm_hook} and the in-backward step are "
                "both DDP communication hooks, and DDP takes one")
    return None


def step_temporaries(optimizer: str) -> int:
    """Temporaries the size of the parameter that one parameter's ``foreach`` step allocates:
    Adam(W)'s ``denom``, none for SGD."""
    return 1 if optimizer in ("adamw", "adam") else 0
