"""fsdp-plan: plan PyTorch FSDP wrapping, prefetch, sharding and activation checkpointing.

The package is laid out as the pipeline it runs:

    load -> graph / analysis -> memory / cost -> search -> plan -> emit -> verify / bench

with ``cli`` a thin layer on top. See README.md and SPEC.md.
"""

__version__ = "0.1.0"
