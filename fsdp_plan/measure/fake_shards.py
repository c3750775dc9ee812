"""FSDP2's padding of absent shards, in one step instead of one per rank, while a plan is measured
on the fake process group.

[Note: one empty shard for every absent rank]
``fully_shard`` splits each parameter with ``_chunk_with_empty(tensor, num_chunks, dim)``
(``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``): ``torch.chunk`` gives at most as
many pieces as the dimension is long, and every other rank of the shard group gets an empty
tensor of its own, one ``new_empty(0)`` call each. Under ``FakeTensorMode`` each call is a
dispatch of about a millisecond here, made twice per parameter per rank (``FSDPParam`` at
init and for its post-forward metadata): a plan at 1,048,576 ranks spent about 35 minutes
there before its first step (issue 21, S3-29; 2,048 ranks of a two-Linear model took 19 s).
FSDP2 reads only the chunk of its own rank and the size of chunk 0 from that list, so
``one_empty_shard()`` makes the padding one empty tensor repeated: the same sizes and the same
measurement, one dispatch per parameter at any world size. It replaces the function only where
``_fsdp_param`` imports it under that name (torch 2.4 and later) and restores it on exit; on a
PyTorch without it nothing changes but the time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def chunk_with_one_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> list[torch.Tensor]:
    """``_chunk_with_empty`` with every padding entry the same empty tensor."""
    chunks = list(torch.chunk(tensor, num_chunks, dim=dim))
    if len(chunks) < num_chunks:
        chunks += [chunks[0].new_empty(0)] * (num_chunks - len(chunks))
    return chunks


@contextlib.contextmanager
def one_empty_shard() -> Iterator[None]:
    """Within the block, FSDP2 pads absent shards with one shared empty tensor (see the
    [Note: one empty shard for every absent rank])."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:  # an older layout of FSDP2: measure at its own pace
        yield
        return
    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return
    _fsdp_param._chunk_with_empty = chunk_with_one_empty
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original
