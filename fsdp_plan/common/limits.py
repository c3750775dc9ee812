"""Upper bounds on what a user (flag) or a plan file (field) may ask for, written once.

Anything larger is a typing mistake, refused before any work with the reason below; the
command line (cli/plan.py, model/source.py), sizes (sizes.py) and plan validation (plan/check.py)
read the same figures.
"""

from __future__ import annotations

MAX_WORLD_SIZE = 2**20
"""1,048,576 GPUs. FSDP's device mesh and this planner's per-rank model describe real clusters
(the largest runs today have ~10^5 GPUs); a larger count would only overflow later arithmetic."""
MAX_GPUS_PER_NODE = 1024
"""GPUs sharing one node's fast links (8 on DGX/HGX, 72 in an NVL72 rack)."""
MAX_BATCH_SIZE = 2**24
"""Samples in one micro-batch on one GPU. 16.7 million is far past any real micro-batch
(they are 1-1024); larger values are typing mistakes that only surface later as overflowing
tensor sizes."""
MAX_GRAD_ACCUM_STEPS = 2**20
"""Micro-batches per optimizer step (a plan's ``grad_accum_steps``). With ``MAX_BATCH_SIZE``
it bounds ``--global-batch-size`` per rank; real runs accumulate 1-1024."""
MAX_SEQ_LEN = 2**26
"""Tokens per sample. 67 million is beyond the longest context any model trains with
(about 10 million); larger values are typing mistakes."""
MAX_TOKENS = 2**32
"""``batch_size * seq_len``: the analysis builds fake activations of this many tokens times the
hidden size, and element counts must stay well inside int64."""
MAX_BYTES = 2**60
"""Memory sizes: larger ones are typing mistakes (and would overflow float arithmetic)."""


def budget_limit(budget_bytes: int, headroom_bytes: int) -> int:
    """The peak a plan may reach (SPEC section 2): the budget minus the headroom kept free."""
    return budget_bytes - headroom_bytes
