"""Measure the machine this runs on and describe it as a hardware file (SPEC section 6).

[Note: calibration]
``fsdp-plan calibrate`` launches ``--nproc`` workers (``fsdp_plan.measure.launch``, as bench
does, one thread each on a CPU, so the figures are those of a bench run) and on every rank at
once measures, each repeated and reduced to a median:
- the host overhead of one op in a training step: a chain of tiny ops forward and backward,
  its dispatched ops counted as the analysis counts them (facts/types.py [Note: op classes]);
- matrix multiplies per dtype (float32, bfloat16, and float16 on a GPU) in the three shape
  classes, the overhead of one op subtracted;
- attention (SDPA forward + backward) at its FLOP count;
- memory-bound elementwise ops (add, mul, GELU) as bytes read + written per second;
- host-to-device copies (a GPU only: a CPU has no device to copy to, and says so);
- the optimizer step (AdamW, SGD) per parameter, and per parameter tensor on FSDP2 DTensors;
- all_gather_into_tensor, reduce_scatter_tensor and all_reduce over message sizes, fitted to
  ``latency + factor * (g - 1) / g * bytes / bus_bandwidth`` through the smallest message
  (the latency) and the largest, 128 MiB (the bandwidth FSDP's units see): [Note: fitting
  collectives];
- overlap and contention: whether compute runs while an all-gather is in flight (on gloo it
  may not: the collective can hold the core the computing thread needs), and how much
  compute slows while it does: [Note: the overlap probe];
- FSDP's cost per unit and pass: an FSDP2 model of many tiny units against one unit, each
  less its own collectives timed alone; per parameter tensor and per checkpointed block on
  the fake process group, whose collectives cost nothing ([Note: the floor's figures]); and
  FSDP2's cost per byte around a unit's all-gather and reduce-scatter (copies, allocation,
  division): units of four sizes, each one's forward and backward less the fitted
  collectives.
Rank 0 returns the figures; the parent writes the hardware file (atomically, never half).

[Note: the floor's figures]
The clock's floor (cost/streams.py [Note: the host floor]) takes its figures from here.
``op_overhead_s`` is what one op of a training step costs the host: tiny layers forward and
backward, so small that the time is the host's. On a CPU that is the dispatch cost per op,
paid in line; on a GPU the same chain, synchronised, is host-bound, so it is the launch floor
that keeps a kernel from starting before the host has issued it.

``unit_overhead_s`` is FSDP2's cost per unit and pass beyond its collectives (hooks, copy-in /
copy-out, the work handles and waits of an asynchronous collective): sixteen tiny units
against one, on the backend the plans will run on. Each arm's collectives are also timed
alone, at the sizes FSDP2 pads them to, and taken off; the four arms run in turn, each
round, so a burst of load on a shared machine hits them alike. An earlier probe took off the
collectives' latency fitted minutes before (``_collective_figures``); on a 2-core machine
that latency swung from 0.3 to 7 ms with the load and the estimate with it (1.2 ms per unit
and pass on a quiet run, 11.5 ms on a loaded one). Its replacement ran FSDP2 on the fake
process group, whose collectives cost nothing, and read 0.85-1.0 ms on an idle machine where
the gloo arms read 1.2 ms: the closed loop's deep narrow model (49 units of one small
all-gather pair and reduce-scatter each) then came out 17-32% fast with per-unit plans, its
per-unit cost 6.0 ms per step measured against 4.7 predicted. What the fake group misses is
gloo's side of an asynchronous collective inside a step (the work object, the wake-up of its
thread, the wait), which a bench on gloo pays; so on two or more ranks the figure is the
backend's, and the fake group's is kept for one rank (no collective to measure).

The fake process group (``_fsdp_host_cost``, every rank at once as a run's ranks share the
cores: in rank 0 alone it read 1.5-2.4 ms per unit and pass where two processes at once read
2.4-4.9 ms at load 6) still gives the figures no collective touches: FSDP2's cost per
parameter tensor and pass (one unit against no FSDP, less that unit's share: 27-54 us,
Python around each parameter's views, gradient and DTensor, which the per-unit difference
cancels), and activation checkpointing's cost per checkpointed block and step beyond its
replayed ops (1.1-1.6 ms: the wrapper, saved-tensor hooks, RNG stashing). Measured in one
process interleaved with the deep narrow model's own steps on the fake process group
(benchmarks/floor_in_process.py), its three plans' median errors over three rounds were
-18%, -5% and -12% with them (rounds from -27% to +22%, the root-only plan's mostly the
optimizer's load) and -26%, -12% and -22% without.

[Note: fitting collectives]
``t = latency + factor * (g-1)/g * bytes / bus_bandwidth``: the latency is what the two
smallest messages cost (their bytes are nothing), the bandwidth what the largest reaches
beyond it. FSDP's units are tens to hundreds of MiB, where the bandwidth matters; a least
squares fit on relative error let mid-sized messages (2-8 MiB, faster per byte on gloo) set
it, and predicted a 500 MB all-gather 1.5x too fast. Mid-sized messages now come out slower
than measured, which only matters for plans of many small units.

[Note: the overlap probe]
Compute (matmuls) runs alone, an all-gather alone, then both at once: the share of the
shorter one hidden by the overlap is ``overlap`` (1: all, 0: none), the compute's slowdown
beside an all-gather in flight is ``contention``. The compute lasts about as long as the
all-gather (on a CPU ~10 ms each): with compute much shorter, the hidden share is a small
difference of two noisy times divided by a small number, and flipped between runs on gloo
(0.19 on one rank, 0.66 on the other). Ranks wait for each other at every collective, so the
rank that hides least decides whether the hardware file says compute overlaps communication
(the median of those two ranks flipped the answer between runs).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.cost.hardware import Hardware
from fsdp_plan.cost.step_time import collective_time
from fsdp_plan.measure.launch import launch
from fsdp_plan.measure.worker_setup import end_worker_process_group

OPTIMIZER_PARAMS = 1 << 22
"""Parameters of the timed optimizer step: 4M fp32 (64 MiB with gradients and AdamW's two
states), beyond a 32 MiB last-level cache, as a model's shard is. AdamW touches 16 bytes per
fp32 parameter plus its gradient; over 1M parameters (16 MiB, inside a 32 MiB L3) it ran
20-30% faster per parameter than over GPT-2 small's 62M-parameter shard."""
MESSAGE_SIZES = (1 << 12, 1 << 16, 1 << 19, 1 << 21, 1 << 23, 1 << 26, 1 << 27)
"""Bytes of the full (gathered / reduced) buffer of each timed collective."""
_SHAPES = {"small": ((64, 768, 768), (768, 64, 768), (768, 768, 64)),
           "medium": ((256, 768, 768), (768, 256, 768), (768, 768, 256)),
           "large": ((1024, 1024, 1024),)}
"""(M, K, N) shapes per class; the smallest dimension decides the class (facts/types.py). A class's
rate is the harmonic mean of its shapes': training multiplies activations by weights (M
small in decode-like shapes) and, for weight gradients, over the tokens (K small)."""
_GPU_SHAPES = {"small": ((64, 4096, 4096), (4096, 64, 4096), (4096, 4096, 64)),
               "medium": ((512, 4096, 4096), (4096, 512, 4096), (4096, 4096, 512)),
               "large": ((4096, 4096, 4096),)}


def _timed(fn: Callable[[], Any], sync: Callable[[], None], repeat: int,
           min_s: float = 0.02, inner: int | None = None) -> float:
    """Median seconds of one ``fn()`` call over ``repeat`` samples, each of enough calls to
    last ``min_s`` (one warm-up call first), or of exactly ``inner`` calls: a function that
    runs collectives must make the same number of calls on every rank."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - t0, 1e-7)
    inner = inner or max(1, min(1000, int(min_s / once)))
    samples = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def _count_ops(fn: Callable[[], Any]) -> int:
    """Dispatched ops ``fn`` runs, counted as the analysis counts them (views excluded)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.namespace == "aten":
                Counter.count += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.count


def _training_step(net: Any, x: Any) -> Callable[[], None]:
    """One forward and backward of ``net`` on ``x``, gradients dropped after: what the probes
    below time (a step's host cost without the optimizer)."""
    def step() -> None:
        net(x).sum().backward()
        net.zero_grad(set_to_none=True)
    return step


def _op_overhead(device: Any, sync: Callable[[], None], repeat: int) -> tuple[float, int]:
    """Host seconds per op of a training step, and the ops counted: a stack of tiny layers
    forward and backward (module calls, autograd, gradient accumulation), its compute
    negligible."""
    import torch

    torch.manual_seed(0)
    stack = torch.nn.Sequential(*[layer for _ in range(8) for layer in (
        torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU())]).to(device)
    x0 = torch.randn(4, 16, device=device)

    chain = _training_step(stack, x0)
    ops = _count_ops(chain)
    return _timed(chain, sync, repeat) / max(ops, 1), ops


def _matmul_rates(device: Any, sync: Callable[[], None], repeat: int, dtypes: list[Any],
                  overhead: float) -> dict[str, dict[str, float]]:
    """FLOP/s of ``torch.mm`` per dtype and shape class (one op's overhead taken off on a CPU,
    where it is paid in line)."""
    import torch

    shapes = _GPU_SHAPES if device.type == "cuda" else _SHAPES
    matmul: dict[str, dict[str, float]] = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        matmul[name] = {}
        for cls, dims in shapes.items():
            seconds = flops = 0.0
            for m, k, n in dims:
                a = torch.randn(m, k, device=device, dtype=dtype)
                b = torch.randn(k, n, device=device, dtype=dtype)
                t = _timed(lambda a=a, b=b: torch.mm(a, b), sync, repeat)
                seconds += max(t - (0.0 if device.type == "cuda" else overhead), t * 0.05)
                flops += 2.0 * m * k * n
            matmul[name][cls] = flops / seconds
    return matmul


def _attention_rates(device: Any, sync: Callable[[], None], repeat: int, dtypes: list[Any],
                     overhead: float) -> dict[str, float]:
    """FLOP/s of SDPA forward + backward per dtype (at its FLOP count, as the analysis counts
    it; the ops' overhead taken off on a CPU)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    attention: dict[str, float] = {}
    b_, h_, s_, d_ = (4, 16, 1024, 128) if device.type == "cuda" else (1, 4, 256, 64)
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        q, k_, v = (torch.randn(b_, h_, s_, d_, device=device, dtype=dtype, requires_grad=True)
                    for _ in range(3))
        grad = torch.randn(b_, h_, s_, d_, device=device, dtype=dtype)

        def attn(q=q, k_=k_, v=v, grad=grad) -> None:
            F.scaled_dot_product_attention(q, k_, v, is_causal=True).backward(grad)
        shape = (b_, h_, s_, d_)
        flops = (sdpa_flop_count(shape, shape, shape)
                 + sdpa_backward_flop_count(shape, shape, shape, shape))
        t = _timed(attn, sync, repeat)
        attention[name] = flops / max(t - _count_ops(attn) * (
            0.0 if device.type == "cuda" else overhead), t * 0.05)
    return attention


def _memory_bandwidth(device: Any, sync: Callable[[], None], repeat: int,
                      overhead: float) -> float:
    """Bytes read + written per second by memory-bound elementwise ops, on tensors larger than
    any cache (small ones are dominated by the per-op overhead, counted apart)."""
    import torch
    import torch.nn.functional as F

    n = (1 << 26) if device.type == "cuda" else (1 << 23)
    a = torch.randn(n, device=device)
    b = torch.randn(n, device=device)

    def elementwise() -> None:
        torch.add(a, b)
        torch.mul(a, b)
        F.gelu(a)
    moved = (3 + 3 + 2) * n * 4
    t = _timed(elementwise, sync, repeat)
    return moved / max(t - (0.0 if device.type == "cuda" else 3 * overhead), t * 0.05)


def _optimizer_rates(device: Any, sync: Callable[[], None], repeat: int) -> dict[str, float]:
    """Seconds per parameter of the optimizer step, over a list of tensors (as a model's
    parameters) holding more than a last-level cache does (``OPTIMIZER_PARAMS``)."""
    import torch

    per_param: dict[str, float] = {}
    count = OPTIMIZER_PARAMS // 16
    for opt_name, make in (("adamw", lambda p: torch.optim.AdamW(p, lr=1e-4)),
                           ("sgd", lambda p: torch.optim.SGD(p, lr=1e-4))):
        params = [torch.nn.Parameter(torch.randn(count, device=device)) for _ in range(16)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = make(params)
        t = _timed(opt.step, sync, repeat)
        per_param[opt_name] = t / (16 * count)
        del params, opt
    return per_param


def _compute_figures(device: Any, sync: Callable[[], None], repeat: int) -> dict[str, Any]:
    """The figures of one rank that need no other rank, in this order: host overhead per op,
    matmul and attention rates, memory bandwidth, host-to-device copies, the optimizer step."""
    import torch

    overhead, ops = _op_overhead(device, sync, repeat)
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device.type == "cuda" else [])
    out: dict[str, Any] = {"op_overhead_s": overhead, "ops_in_probe": ops}
    out["matmul_flops"] = _matmul_rates(device, sync, repeat, dtypes, overhead)
    out["attention_flops"] = _attention_rates(device, sync, repeat, dtypes, overhead)
    out["memory_bandwidth"] = _memory_bandwidth(device, sync, repeat, overhead)
    if device.type == "cuda":
        host = torch.empty(1 << 26, dtype=torch.uint8, pin_memory=True)
        t = _timed(lambda: host.to(device, non_blocking=True), sync, repeat)
        out["h2d_bandwidth"] = host.numel() / t
    else:
        out["h2d_bandwidth"] = 0.0
        out["notes"] = ["host-to-device copies: skipped, a CPU has no device to copy to"]
    out["optimizer_s_per_param"] = _optimizer_rates(device, sync, repeat)
    return out


def _all_gather(full: Any, part: Any, async_op: bool = False) -> Any:
    """FSDP2's all-gather into one flat tensor (``all_gather_single`` where torch has it)."""
    import torch.distributed as dist
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(full, part, async_op=async_op)


def _reduce_scatter(part: Any, full: Any) -> Any:
    import torch.distributed as dist
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(part, full)


def _fit(sizes: list[int], times: list[float], group: int, factor: float) -> dict[str, float]:
    """Latency and bus bandwidth of one collective from its times over message sizes, through
    the two smallest messages and the largest: see [Note: fitting collectives]."""
    order = sorted(range(len(sizes)), key=sizes.__getitem__)
    large = order[-1]
    x_large = factor * (group - 1) / group * sizes[large]
    smallest = order[:2] if len(order) > 2 else []
    latency, slope = 0.0, times[large] / max(x_large, 1e-9)
    for _ in range(3):  # latency with this slope, slope with that latency (converges at once)
        latency = min(max(0.0, statistics.median(
            times[i] - slope * factor * (group - 1) / group * sizes[i] for i in smallest))
            if smallest else 0.0, times[large] / 2)
        slope = max((times[large] - latency) / max(x_large, 1e-9), 1e-15)
    return {"latency_s": latency, "bus_bandwidth": 1.0 / slope}


def _collective_figures(device: Any, sync: Callable[[], None], repeat: int,
                        sizes: tuple[int, ...]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    fits: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    for kind, factor in (("all_gather", 1.0), ("reduce_scatter", 1.0), ("all_reduce", 2.0)):
        times = []
        for nbytes in sizes:
            numel = max(world, nbytes // 4 // world * world)
            full = torch.zeros(numel, device=device)
            part = torch.zeros(numel // world, device=device)
            if kind == "all_gather":
                def fn(full=full, part=part) -> None:
                    _all_gather(full, part)
            elif kind == "reduce_scatter":
                def fn(full=full, part=part) -> None:
                    _reduce_scatter(part, full)
            else:
                def fn(full=full) -> None:
                    dist.all_reduce(full)
            dist.barrier()
            # the largest messages take long enough for one call per sample
            times.append(_timed(fn, sync, repeat, inner=1 if nbytes >= 1 << 26 else 4))
        # every rank must agree on one fit: the slowest rank's times decide
        gathered = [None] * world
        dist.all_gather_object(gathered, times)
        worst = [max(col) for col in zip(*gathered)]
        raw[kind] = {str(s): t for s, t in zip(sizes, worst)}
        fits[kind] = {str(world): _fit([max(world, s // 4 // world * world) * 4 for s in sizes],
                                       worst, world, factor)}
    return {"collectives": fits, "collective_times_s": raw}


def _contention(device: Any, sync: Callable[[], None], repeat: int) -> dict[str, float]:
    """The overlap probe (see its Note): how much of an all-gather's time compute can run beside
    it (1: all, 0: none, as when the collective holds the computing thread), and how much
    compute slows while it does."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    a = torch.randn(256, 256, device=device)
    full = torch.zeros(world * (1 << 20), device=device)
    part = torch.zeros(1 << 20, device=device)

    # compute about as long as the all-gather: [Note: the overlap probe]
    rounds = 8 if device.type == "cuda" else 32

    def compute() -> None:
        for _ in range(rounds):
            torch.mm(a, a)

    def overlapped() -> float:
        work = _all_gather(full, part, async_op=True)
        sync()
        t0 = time.perf_counter()
        compute()
        sync()
        spent = time.perf_counter() - t0
        work.wait()
        return spent
    def gathered() -> None:
        _all_gather(full, part)

    def both() -> None:
        work = _all_gather(full, part, async_op=True)
        compute()
        work.wait()
        sync()
    repeat = max(5, repeat)
    alone = _timed(compute, sync, repeat)
    dist.barrier()
    comm = _timed(gathered, sync, repeat, inner=2)
    dist.barrier()
    together = _timed(both, sync, repeat, inner=2)
    dist.barrier()
    with_comm = statistics.median(overlapped() for _ in range(max(3, repeat)))
    hidden = (alone + comm - together) / max(min(alone, comm), 1e-9)
    return {"contention": max(0.0, min(10.0, with_comm / alone - 1.0)),
            "overlap": max(0.0, min(1.0, hidden))}


def _fsdp_figures(device: Any, sync: Callable[[], None], repeat: int,
                  collectives: dict[str, Any]) -> dict[str, Any]:
    """FSDP2's cost per unit and pass on this backend beyond its collectives ([Note: the floor's
    figures]): sixteen tiny units against one, each arm's own collectives timed alone and taken
    off, the four arms in turn; and the optimizer's cost per parameter tensor on FSDP2's
    DTensor parameters."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    layers, width = FSDP_HOST_BLOCKS, 8

    def model(units: int) -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
        for layer in (list(net) if units > 1 else []):
            fully_shard(layer)
        fully_shard(net)
        return net

    def their_collectives(units: int, gathers: int) -> Callable[[], None]:
        """The all-gathers and reduce-scatters ``units`` units of ``layers // units`` layers
        issue in a step (``gathers`` all-gathers each: the root keeps its parameters between
        forward and backward), at the sizes FSDP2 pads them to."""
        world = dist.get_world_size()
        rows = -(-width // world)  # dim 0 of each parameter, padded to a multiple of the world
        shard = (rows * width + rows) * (layers // units)
        full = torch.zeros(shard * world, device=device)
        part = torch.zeros(shard, device=device)

        def run() -> None:
            for _ in range(units):
                for _ in range(gathers):
                    _all_gather(full, part)
                _reduce_scatter(part, full)
        return run

    x = torch.randn(4, width, device=device)
    nets = {units: model(units) for units in (1, layers)}
    steps = {units: _training_step(net, x) for units, net in nets.items()}
    arms = [steps[1], their_collectives(1, 1), steps[layers], their_collectives(layers, 2)]
    for arm in arms:  # warm-up: FSDP's lazy init, gloo's pairs
        arm()
    rounds = [[_timed(arm, sync, 1, inner=4) for arm in arms] for _ in range(max(3, repeat))]
    one, one_comm, own, own_comm = (statistics.median(r[i] for r in rounds)
                                    for i in range(len(arms)))
    # the root of the own-units arm holds no parameter: its units are the 16 extra ones
    per_unit = ((own - own_comm) - (one - one_comm)) / (layers - 1)
    per_tensor = {}
    net = nets[layers]
    params = list(net.parameters())
    for name, make in (("adamw", lambda p: torch.optim.AdamW(p, lr=1e-4)),
                       ("sgd", lambda p: torch.optim.SGD(p, lr=1e-4))):
        net(x).sum().backward()
        opt = make(params)
        per_tensor[name] = _timed(opt.step, sync, repeat, inner=4) / len(params)
        net.zero_grad(set_to_none=True)
    return {"unit_overhead_s": max(0.0, per_unit / 2),
            "optimizer_s_per_tensor": per_tensor,
            **_fsdp_bytes(device, sync, repeat, collectives)}


FSDP_UNIT_SHAPES = {"cpu": ((1024, 2), (1024, 6), (2048, 4), (2048, 8), (4096, 8)),
                    "cuda": ((2048, 4), (4096, 4), (4096, 8), (8192, 4), (8192, 8))}
"""(width, layers) of the square fp32 units timed by ``_fsdp_bytes``: 8, 24, 64, 128 and 512 MiB
on a CPU (glibc hands out buffers above 32 MiB as fresh pages, paid per byte on every step,
smaller ones from reused memory); 64, 256, 512, 1024 and 2048 MiB on a GPU."""


def _fsdp_bytes(device: Any, sync: Callable[[], None], repeat: int,
                collectives: dict[str, Any]) -> dict[str, Any]:
    """FSDP2's own seconds per byte around a unit's collectives, at several unit sizes: one
    unit (no compute to speak of: a batch of one row through square layers) timed in forward
    and in backward, less the fitted all-gather and reduce-scatter of its bytes. What is left
    is FSDP2's copy-in, copy-out, allocation and gradient division. On a 2-core CPU with gloo
    a 128 MiB unit came to 0.6-0.9 ns per gathered byte and 1.0-1.7 ns per gradient byte, two
    to three times two passes at the memory bandwidth (the estimate without this probe)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    fitted_only = Hardware(name="fits", peak_flops=1.0, launch_overhead_s=0.0,
                           collectives=collectives)  # the cost model's rule on the fits above

    def fitted(kind: str, nbytes: int) -> float:
        return collective_time(fitted_only, nbytes, world, kind)
    table: dict[str, dict[str, float]] = {"all_gather": {}, "reduce_scatter": {}}
    for d, layers in FSDP_UNIT_SHAPES["cuda" if device.type == "cuda" else "cpu"]:
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(layers)]).to(device)
        fully_shard(net, reshard_after_forward=False)
        x = torch.randn(1, d, device=device)
        nbytes = d * d * layers * 4
        forward, backward = [], []
        warmup, samples = (2, max(3, repeat)) if nbytes <= 1 << 27 else (1, 3)
        for step in range(warmup + samples):
            sync()
            t0 = time.perf_counter()
            loss = net(x).sum()
            sync()
            t1 = time.perf_counter()
            loss.backward()
            sync()
            t2 = time.perf_counter()
            net.zero_grad(set_to_none=True)
            if step >= warmup:
                forward.append(t1 - t0)
                backward.append(t2 - t1)
        table["all_gather"][str(nbytes)] = max(
            0.0, statistics.median(forward) - fitted("all_gather", nbytes)) / nbytes
        table["reduce_scatter"][str(nbytes)] = max(
            0.0, statistics.median(backward) - fitted("reduce_scatter", nbytes)) / nbytes
        del net, loss
    return {"fsdp_s_per_byte": table}


FSDP_HOST_BLOCKS = 16
"""Blocks of the host-cost probe (``_fsdp_host_cost``), each its own unit or all in one."""


def _fsdp_host_cost(repeat: int) -> dict[str, float]:
    """FSDP2's and activation checkpointing's host seconds on a CPU, on the fake process group
    (its collectives return at once, so what is left is hooks, copies and bookkeeping;
    [Note: the floor's figures]): ``FSDP_HOST_BLOCKS`` blocks of eight parameters without
    FSDP, all in one unit, each its own unit, and each its own unit and checkpointed, timed in
    turn. ``unit_overhead_s`` (per unit and pass) is own units against one unit;
    ``param_overhead_s`` (per parameter tensor and pass) is one unit against none, less that
    unit's own share; ``checkpoint_overhead_s`` (per checkpointed block and step, beyond the
    ops its forward replays, which the clock counts as ops) is checkpointed against not.
    Runs in one process with no other process group initialised."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        return fsdp_host_figures(repeat)
    finally:
        dist.destroy_process_group()


def fsdp_host_figures(repeat: int) -> dict[str, float]:
    """``_fsdp_host_cost``'s figures, on the fake process group already initialised."""
    import torch
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import fully_shard

    def block() -> nn.Module:
        return nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8),
                             nn.Linear(8, 8))

    x = torch.randn(4, 8)
    steps = []
    for arm in ("plain", "one unit", "own units", "checkpointed"):
        torch.manual_seed(0)
        blocks = [block() for _ in range(FSDP_HOST_BLOCKS)]
        if arm == "checkpointed":
            blocks = [checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                      for b in blocks]
        net = nn.Sequential(*blocks)
        for b in net if arm in ("own units", "checkpointed") else []:
            fully_shard(b)
        if arm != "plain":
            fully_shard(net, reshard_after_forward=False)
        steps.append(_training_step(net, x))
    params = sum(1 for _ in net.parameters())
    replay = _count_ops(lambda: block()(x)) * FSDP_HOST_BLOCKS  # forward ops replayed
    # the arms in turn, so a burst of load on a shared machine hits all of them; each arm's
    # fastest round, since load only ever adds time (the medians' differences, a few
    # microseconds per block, came out 0 on a loaded machine)
    rounds: list[list[float]] = []
    for _ in range(max(3, repeat)):
        rounds.append([_timed(s, lambda: None, 1, inner=4) for s in steps])
    plain, one, own, ckpt = (min(r[i] for r in rounds) for i in range(4))
    unit = max(0.0, (own - one) / FSDP_HOST_BLOCKS / 2)
    per_op = plain / max(1, _count_ops(steps[0]))
    return {"unit_overhead_s": unit,
            "param_overhead_s": max(0.0, (one - plain - 2 * unit) / params / 2),
            "checkpoint_overhead_s": max(0.0, (ckpt - own - replay * per_op)
                                         / FSDP_HOST_BLOCKS)}


def calibrate_rank(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """One calibration worker (``launch`` target): every rank measures, rank 0 returns."""
    import torch
    import torch.distributed as dist

    backend = payload["backend"]
    use_cuda = backend == "nccl"
    if use_cuda:
        torch.cuda.set_device(ctx.local_rank)
        device = torch.device("cuda", ctx.local_rank)
    else:
        torch.set_num_threads(1)  # as bench workers run: N workers share the cores
        device = torch.device("cpu")
    dist.init_process_group(backend, device_id=device if use_cuda else None)
    sync = (lambda: torch.cuda.synchronize(device)) if use_cuda else (lambda: None)
    repeat = int(payload["repeat"])
    ctx.report(phase="compute")
    figures = _compute_figures(device, sync, repeat)
    ctx.report(phase="collectives")
    dist.barrier()
    if dist.get_world_size() > 1:
        figures.update(_collective_figures(device, sync, repeat, tuple(payload["sizes"])))
        ctx.report(phase="overlap")
        figures.update(_contention(device, sync, repeat))
        ctx.report(phase="fsdp units")
        figures.update(_fsdp_figures(device, sync, repeat, figures["collectives"]))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    dist.barrier()
    end_worker_process_group()
    host: dict[str, float] = {}
    if not use_cuda:  # the per-parameter and checkpoint figures, where no collective runs,
        # every rank at once as the ranks of a run share the cores: [Note: the floor's figures]
        ctx.report(phase="fsdp host cost")
        host = _fsdp_host_cost(repeat)
    if ctx.rank != 0:
        return {"rank": ctx.rank, **host}
    return {"ranks": gathered, **host, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if use_cuda
            else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "torch": torch.__version__}


def _median_nested(values: list[Any]) -> Any:
    """The median over ranks of a figure, key by key for nested ones."""
    if isinstance(values[0], dict):
        return {k: _median_nested([v[k] for v in values if k in v]) for k in values[0]}
    if isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
        return statistics.median(values)
    return values[0]


def hardware_from(result: dict[str, Any], backend: str, nproc: int) -> Hardware:
    """The hardware description of a calibration run (rank figures reduced to medians)."""
    ranks = result["ranks"]
    fig = {k: _median_nested([r[k] for r in ranks if k in r]) for k in ranks[0]}
    matmul = fig["matmul_flops"]
    best = max(v for per in matmul.values() for v in per.values())
    gpu = backend == "nccl"
    coll = fig.get("collectives") or {}
    ag = next(iter(coll.get("all_gather", {}).values()), None)
    name = "calibrated-" + ("".join(c if c.isalnum() else "-" for c in result["device_name"])
                            .strip("-").lower()[:40])
    return Hardware(
        name=name, peak_flops=best, efficiency=1.0,
        hbm_bandwidth=fig["memory_bandwidth"], memory_bandwidth=fig["memory_bandwidth"],
        intra_node_bandwidth=ag["bus_bandwidth"] if ag else 1e9,
        inter_node_bandwidth=ag["bus_bandwidth"] if ag else 1e9,
        collective_latency_s=ag["latency_s"] if ag else 0.0, launch_overhead_s=0.0,
        contention=fig.get("contention", 0.0) or 0.0,
        matmul_flops=matmul, attention_flops=fig["attention_flops"],
        op_overhead_s=fig["op_overhead_s"], async_launch=gpu,
        # the rank that hides least decides: [Note: the overlap probe]
        comm_overlaps_compute=gpu or min((r.get("overlap") or 0.0) for r in ranks) >= 0.5,
        h2d_bandwidth=fig.get("h2d_bandwidth") or 0.0, collectives=coll,
        optimizer_s_per_param=fig["optimizer_s_per_param"],
        optimizer_s_per_tensor=fig.get("optimizer_s_per_tensor") or {},
        # per unit: on this backend, beside its collectives; alone (one process, no collective)
        # the fake process group's: [Note: the floor's figures]
        unit_overhead_s=fig.get("unit_overhead_s", result.get("unit_overhead_s", 0.0)) or 0.0,
        param_overhead_s=result.get("param_overhead_s", 0.0) or 0.0,
        checkpoint_overhead_s=result.get("checkpoint_overhead_s", 0.0) or 0.0,
        fsdp_s_per_byte=fig.get("fsdp_s_per_byte") or {},
        source=(f"fsdp-plan calibrate --backend {backend} --nproc {nproc} on "
                f"{result['device_name']}, torch {result['torch']}, "
                f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}"),
    )


def calibrate(*, nproc: int, backend: str, repeat: int = 5,
              sizes: tuple[int, ...] = MESSAGE_SIZES, timeout_s: float = 300.0,
              on_progress: Callable[[int, dict[str, Any]], None] | None = None
              ) -> tuple[Hardware, dict[str, Any]]:
    """Run the micro-benchmarks on ``nproc`` workers; the hardware and the raw figures."""
    if backend not in ("gloo", "nccl"):
        raise BadInput(f"--backend {backend!r}: choose gloo (CPU) or nccl (GPUs).")
    if backend == "nccl":
        import torch
        if not torch.cuda.is_available():
            raise BadInput("--backend nccl needs CUDA GPUs and this machine has none; use "
                           "--backend gloo to calibrate the CPU.")
        if nproc > torch.cuda.device_count():
            raise BadInput(f"--nproc {nproc} is more than this machine's "
                           f"{torch.cuda.device_count()} GPUs.")
    results = launch("fsdp_plan.measure.calibrate:calibrate_rank",
                     {"backend": backend, "repeat": repeat, "sizes": list(sizes)},
                     nproc=nproc, timeout_s=timeout_s, on_progress=on_progress)
    for key in ("unit_overhead_s", "param_overhead_s", "checkpoint_overhead_s"):
        host = [r[key] for r in results if key in r]
        if host:  # the median over the ranks, as every other figure
            results[0][key] = statistics.median(host)
    return hardware_from(results[0], backend, nproc), results[0]
