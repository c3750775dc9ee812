"""FSDP2's host cost per unit and pass, in eager op dispatches (issue 18 item 5): the figure the
GPU presets' ``unit_overhead_s`` is scaled from.

    python benchmarks/fsdp_host_cost.py [--layers 16] [--rounds 3]

The tiny Llama of examples/llama.py (blocks of nine parameters, as a Llama block has) takes
steps in one process on the fake process group, whose collectives return at once: without
FSDP, with one unit (the root), and with a unit per block. What a unit per block adds over the
root alone, per extra unit and pass (forward, backward), is FSDP2's host work (hooks,
copy-in/copy-out, per-parameter bookkeeping); divided by what one op of the plain step costs,
it is a ratio that carries from this CPU to a GPU host (cost/streams.py [Note: the host
floor]). Torch 2.13 on a shared 2-core CPU (load 7-12): 32-79 op dispatches per unit and
pass over six rounds in two runs, median 69; each round's two steps are timed minutes apart at
most, but the load still moves them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _llama():
    spec = importlib.util.spec_from_file_location("_llama", os.path.join(ROOT, "examples",
                                                                         "llama.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["_llama"] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    llama = _llama()
    tokens = torch.randint(0, 100, (1, 8))

    def step_of(mode: str):
        torch.manual_seed(0)
        net = llama.build_model("tiny", n_layers=args.layers)
        for block in net.layers if mode == "per block" else []:
            fully_shard(block)
        if mode != "plain":
            fully_shard(net, reshard_after_forward=False)

        def step() -> None:
            llama.loss_fn(net(tokens)).backward()
            net.zero_grad(set_to_none=True)
        return step

    def median_s(step, reps: int = 15) -> float:
        for _ in range(3):
            step()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if not func.is_view and func.namespace == "aten":  # as the analysis counts
                Count.ops += 1
            return func(*a, **(kw or {}))

    plain = step_of("plain")
    with Count():
        plain()
    for _ in range(args.rounds):
        t = {mode: median_s(step_of(mode)) for mode in ("plain", "root", "per block")}
        per_op = t["plain"] / Count.ops
        per_unit = (t["per block"] - t["root"]) / args.layers / 2
        print(f"plain step {t['plain'] * 1e3:.1f} ms / {Count.ops} ops = {per_op * 1e6:.1f} us "
              f"per op; {args.layers} more units +{(t['per block'] - t['root']) * 1e3:.1f} ms = "
              f"{per_unit * 1e6:.0f} us per unit and pass = {per_unit / per_op:.0f} op dispatches",
              flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
