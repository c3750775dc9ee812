"""DDP communication hooks as kinds: one table that the plan checker, the clock, the memory
model, the search, the report and the policy module read, so a new hook is one entry here plus
its cost function (issue 27, issue 28 item 2).

[Note: communication hooks] (read in torch 2.13 ``ddp_comm_hooks/default_hooks.py`` and
``powerSGD_hook.py``; counts and state checked on gloo by tests/test_comm_hooks.py)
- ``fp16_compress`` / ``bf16_compress``: the bucket is cast to the half dtype and divided by
  the world size (``buffer.to(dtype).div_(world)``: one pass reading 4 and writing 2 bytes per
  element, then one reading and writing 2), all-reduced at half the bytes, and copied back into
  the bucket when the all-reduce is done (``copy_``: 2 read, 4 written). One all-reduce per
  bucket. Lossy: every gradient sum is rounded to 11 (fp16, which also overflows above 65504)
  or 8 (bf16) significant bits.
- ``powersgd`` (``PowerSGDState(process_group=None, matrix_approximation_rank=r,
  start_powerSGD_iter=s)``, the other settings at their defaults: ``min_compression_rate`` 2,
  error feedback and warm start on, no batching by shape): before iteration ``s`` a plain
  all-reduce per bucket. From ``s`` on, per bucket: the last error is added and the bucket
  cloned (error feedback); each gradient viewed as ``[shape[0], -1]`` (``n x m``) is compressed
  when ``(n + m) * r' * 2 < n * m`` with ``r' = min(n, m, r)``, the rest (biases, norms, small
  matrices) is all-reduced uncompressed in one flat all-reduce (issued even when empty); the
  compressed ones are ``P = M Q`` (``n x r'``), all-reduced, orthogonalised (Gram-Schmidt),
  ``Q = M^T P`` (``m x r'``), all-reduced, and decompressed to ``P Q^T``; the new error is the
  clone minus the result. Three all-reduces per bucket. State kept across steps per bucket: the
  error (the bucket's size), and P and Q (warm start). Lossy: the update is a rank-``r``
  approximation, its error fed back into the next step.

[Note: hooks on the clock]
The hook is called in backward when its bucket is ready; what it computes before its first
collective runs there on the compute stream (the host issues it in line). On a GPU, NCCL's
futures complete when the collective is enqueued and ``then`` callbacks run at once on a stream
from the pool that waits for the collective: their work (the copy back, PowerSGD's middle and
last matmuls) runs after the collective, off the compute stream; the clock puts it on the
communication stream right after its collective, which is conservative by its few microseconds.
PowerSGD's last callback calls ``torch.cuda.synchronize``: the host waits there for the
bucket's whole chain, so the backward after it is not issued before the chain ends: counted as
compute waiting for communication (a bubble). On a CPU (gloo) the callbacks run on gloo's
thread when the collective finishes and compute is in line anyway.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

POWERSGD_MIN_COMPRESSION_RATE = 2
"""``PowerSGDState.min_compression_rate``'s default."""
POWERSGD_DEFAULT_START_ITER = 1_000
"""``PowerSGDState.start_powerSGD_iter``'s default."""
POWERSGD_RANKS = (1, 2, 4)
"""``matrix_approximation_rank`` values the search tries (PowerSGD's paper and PyTorch's docs
recommend starting at 1 and raising it until accuracy holds)."""


@dataclass(frozen=True, kw_only=True)
class HookPhase:
    """One step of a hook's chain for one bucket: compute, then (unless last) a collective."""

    label: str
    flops: float = 0.0
    """Matrix-multiply FLOPs of this step's compute."""
    memory_bytes: float = 0.0
    """Bytes read and written by this step's memory-bound compute (casts, copies, adds)."""
    all_reduce_bytes: float | None = None
    """The all-reduce that follows it; None for the chain's last step."""
    ops: int = 0
    """Ops the host dispatches for this step's compute."""


@dataclass(frozen=True, kw_only=True)
class CommHookKind:
    """A ``comm_hook`` a plan may name."""

    name: str
    torch_hook: str
    """The hook function in ``torch.distributed.algorithms.ddp_comm_hooks``. The policy
    module registers ``default_hooks.<name>_hook`` by name, PowerSGD with its state."""
    numerics: str
    """What it changes numerically, for the report; a hook is lossy when this is not empty."""
    wire_element_bytes: int | None
    """Bytes per gradient element on the wire, for a cast hook; None for PowerSGD."""
    all_reduces: int = 1
    """All-reduces per bucket and step (PowerSGD's after ``start_iter``)."""
    host_sync: bool = False
    """Whether the chain ends with ``torch.cuda.synchronize`` (the host waits for it)."""
    reduce_dtype: str | None = None
    """The dtype a cast hook reduces in: the hook a ``--reduce-dtype`` of it asks for."""
    on_gloo: bool = True
    """Whether the search offers it on a CPU (gloo): gloo refuses the bf16 cast, and completes
    PowerSGD's all-reduces on its own threads, where ranks may issue the next in other orders."""
    ranks: tuple[int, ...] = (1,)
    """The ``matrix_approximation_rank`` values the search tries (PowerSGD's only)."""


COMM_HOOKS: dict[str, CommHookKind] = {
    kind.name: kind for kind in (
        CommHookKind(name="fp16_compress", torch_hook="default_hooks.fp16_compress_hook",
                     wire_element_bytes=2, reduce_dtype="float16",
                     numerics="gradients are summed in float16: 11 significant bits, and "
                              "sums above 65504 overflow to inf"),
        CommHookKind(name="bf16_compress", torch_hook="default_hooks.bf16_compress_hook",
                     wire_element_bytes=2, reduce_dtype="bfloat16", on_gloo=False,
                     numerics="gradients are summed in bfloat16: 8 significant bits"),
        CommHookKind(name="powersgd", torch_hook="powerSGD_hook.powerSGD_hook",
                     wire_element_bytes=None, all_reduces=3, host_sync=True, on_gloo=False,
                     ranks=POWERSGD_RANKS,
                     numerics="each gradient matrix is all-reduced as a rank-r approximation "
                              "(PowerSGD), its error fed back into the next step; plain "
                              "all-reduce before start_iter"),
    )
}
"""Every hook kind, by the name a plan's ``ddp.comm_hook`` gives."""


def hook_kind(name: str | None) -> CommHookKind | None:
    """The kind a plan names (None for DDP's own all-reduce)."""
    return None if name is None else COMM_HOOKS[name]


def compress_hook_for(reduce_dtype: str) -> str | None:
    """The cast hook that reduces in ``reduce_dtype`` (the user's ``--reduce-dtype``), or None
    for a full-precision reduction."""
    return next((kind.name for kind in COMM_HOOKS.values() if kind.reduce_dtype == reduce_dtype
                 and reduce_dtype is not None), None)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``tensor.view(tensor.shape[0], -1)``'s shape (a 0-d tensor is ``1 x 1``)."""
    if not shape:
        return 1, 1
    n = int(shape[0])
    return n, math.prod(int(d) for d in shape[1:]) if len(shape) > 1 else 1


@dataclass(frozen=True, kw_only=True)
class PowerSGDSplit:
    """How PowerSGD splits one bucket (elements)."""

    uncompressed: int
    compressed: int
    """Elements of the gradients compressed (``n * m`` summed)."""
    p: int
    q: int
    matmul_nm_r: int
    """Sum over compressed matrices of ``n * m * r'``: each of the three matmuls costs twice it."""
    gram_schmidt_p: int
    """Sum of ``n * r'^2``: orthogonalising P."""
    gram_schmidt_q: int
    """Sum of ``m * r'^2``: orthogonalising Q (warm start)."""
    compressed_matrices: int


def powersgd_split(shapes: Sequence[Sequence[int]], rank: int) -> PowerSGDSplit:
    """``powerSGD_hook``'s step I for a bucket whose gradients have these shapes."""
    uncompressed = compressed = p = q = nmr = gs_p = gs_q = count = 0
    for shape in shapes:
        n, m = matrix_shape(shape)
        r = min(n, m, rank)
        if (n + m) * r * POWERSGD_MIN_COMPRESSION_RATE < n * m:
            p, q, nmr, compressed = p + n * r, q + m * r, nmr + n * m * r, compressed + n * m
            gs_p, gs_q, count = gs_p + n * r * r, gs_q + m * r * r, count + 1
        else:
            uncompressed += n * m
    return PowerSGDSplit(uncompressed=uncompressed, compressed=compressed, p=p, q=q, matmul_nm_r=nmr,
                         gram_schmidt_p=gs_p, gram_schmidt_q=gs_q, compressed_matrices=count)


def hook_phases(name: str | None, shapes: Sequence[Sequence[int]], element_bytes: int, *,
                rank: int = 1) -> list[HookPhase]:
    """One bucket's chain under hook ``name`` ([Note: communication hooks]): the compute before
    each all-reduce, and the compute after the last one. ``element_bytes``: the gradients'."""
    numel = sum(math.prod(int(d) for d in s) for s in shapes)
    nbytes = numel * element_bytes
    kind = hook_kind(name)
    if kind is None:
        return [HookPhase(label="all-reduce", all_reduce_bytes=nbytes), HookPhase(label="done")]
    if kind.wire_element_bytes is not None:
        wire = kind.wire_element_bytes
        return [HookPhase(label=f"cast to {kind.reduce_dtype or name}", ops=2,
                          memory_bytes=numel * (element_bytes + wire) + numel * 2 * wire,
                          all_reduce_bytes=numel * wire),
                HookPhase(label="copy back", ops=1, memory_bytes=numel * (wire + element_bytes))]
    split = powersgd_split(shapes, rank)
    b = element_bytes
    matrices = split.compressed_matrices
    thin = split.compressed * b  # a rank-r matmul reads (or writes) its whole matrix M
    return [
        # error add (2 read, 1 written), clone (1 read, 1 written), the flat uncompressed copy,
        # orthogonalise Q, P = M Q
        HookPhase(label="PowerSGD compress", flops=2 * split.matmul_nm_r + 2 * split.gram_schmidt_q,
                  memory_bytes=5 * nbytes + 2 * split.uncompressed * b + thin,
                  all_reduce_bytes=split.uncompressed * b, ops=4 + 3 * matrices),
        # unpack the uncompressed gradients (divide, copy back)
        HookPhase(label="PowerSGD unpack", memory_bytes=4 * split.uncompressed * b,
                  all_reduce_bytes=split.p * b, ops=2 + len(shapes)),
        # orthogonalise P, Q = M^T P
        HookPhase(label="PowerSGD Q", flops=2 * split.matmul_nm_r + 2 * split.gram_schmidt_p,
                  memory_bytes=thin, all_reduce_bytes=split.q * b, ops=3 * matrices),
        # divide Q, M = P Q^T, error = clone - M
        HookPhase(label="PowerSGD decompress", flops=2 * split.matmul_nm_r,
                  memory_bytes=2 * split.q * b + thin + 3 * nbytes, ops=2 + matrices),
    ]


def hook_state_bytes(name: str | None, buckets: Sequence[Sequence[Sequence[int]]],
                     element_bytes: int, *, rank: int = 1) -> int:
    """Bytes a hook keeps across steps for these buckets (each a list of gradient shapes):
    PowerSGD's error per bucket and its P and Q (warm start); none for the others."""
    kind = hook_kind(name)
    if kind is None or kind.name != "powersgd":
        return 0
    total = 0
    for shapes in buckets:
        split = powersgd_split(shapes, rank)
        numel = sum(math.prod(int(d) for d in s) for s in shapes)
        total += (numel + split.p + split.q) * element_bytes
    return total


def hook_step_bytes(name: str | None, buckets: Sequence[Sequence[Sequence[int]]],
                    element_bytes: int, *, rank: int = 1) -> int:
    """Bytes a hook holds on top while one bucket's chain runs: PowerSGD's clone of the bucket,
    the flat uncompressed gradients and the new error made while the old is still held (the
    largest bucket); a cast hook's half-precision copy of the bucket."""
    kind = hook_kind(name)
    if kind is None:
        return 0
    out = 0
    for shapes in buckets:
        numel = sum(math.prod(int(d) for d in s) for s in shapes)
        if kind.wire_element_bytes is not None:
            out = max(out, numel * kind.wire_element_bytes)
        else:
            split = powersgd_split(shapes, rank)
            out = max(out, (2 * numel + split.uncompressed) * element_bytes)
    return out


def all_reduces_per_bucket(name: str | None) -> int:
    """All-reduces one bucket costs under hook ``name`` (PowerSGD after ``start_iter``)."""
    kind = hook_kind(name)
    return 1 if kind is None else kind.all_reduces
