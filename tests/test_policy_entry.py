"""One entry point in the policy module (SPEC section 7): ``apply`` and ``autocast``.

The same training loop (``model = policy.apply(model)``, forward and loss under
``policy.autocast()``, backward, optimizer step) trains an FSDP2, an HSDP and a DDP plan on 2
gloo processes; ``apply_fully_shard`` refuses a DDP plan and ``apply_ddp`` a sharded one,
each naming the right call.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
from test_emit import _comm_counts, _init_gloo, _inputs, load_llama, make_plan, run_ranks

from fsdp_plan.plan.document import Plan, Unit
from fsdp_plan.plan.emit import load_policy_module, render_policy_module

STEPS = 6


def ddp_plan(param_dtype: str | None = "bfloat16") -> Plan:
    """The tiny Llama replicated on 2 ranks with DDP (one unit, the root), layers.0 checkpointed."""
    plan = make_plan(replicate=2, shard=1, strategy="ddp", param_dtype=param_dtype)
    plan.units = [Unit(modules=[""], reshard_after_forward=False)]
    plan.forward_prefetch, plan.backward_prefetch = {}, {}
    plan.ddp = {"bucket_cap_mb": 25, "first_bucket_mb": 1, "gradient_as_bucket_view": False,
                "static_graph": False, "find_unused_parameters": False}
    return plan


def autocast_fsdp_plan() -> Plan:
    """FSDP2 over 2 ranks keeping float32 parameters, computing under bf16 autocast (SPEC 7)."""
    plan = make_plan(shard=2, param_dtype="float32", reduce_dtype="float32")
    plan.mixed_precision = replace(plan.mixed_precision, autocast_dtype="bfloat16")
    return plan


# ---------------------------------------------------------------------------------------------
# In process: refusals, the autocast rule, the device
# ---------------------------------------------------------------------------------------------


def test_apply_fully_shard_refuses_a_ddp_plan_naming_the_right_call() -> None:
    policy = load_policy_module(render_policy_module(ddp_plan()))
    with pytest.raises(ValueError, match=r"DDP plan.*apply\(model\).*apply_ddp\(model\)"):
        policy.apply_fully_shard(load_llama().build_model("tiny"))


def test_apply_ddp_refuses_a_sharded_plan_naming_the_right_call() -> None:
    policy = load_policy_module(render_policy_module(make_plan(shard=2)))
    with pytest.raises(ValueError, match=r"sharded plan.*'full'.*apply\(model\).*"
                                         r"apply_fully_shard\(model\)"):
        policy.apply_ddp(load_llama().build_model("tiny"))


@pytest.mark.parametrize("plan, expected", [
    (make_plan(shard=2), None),                         # bf16 MixedPrecisionPolicy, no autocast
    (autocast_fsdp_plan(), torch.bfloat16),             # autocast_dtype
    (ddp_plan("bfloat16"), torch.bfloat16),             # DDP below float32 computes under autocast
    (ddp_plan("float32"), None),
])
def test_autocast_follows_the_plan(plan: Plan, expected: torch.dtype | None) -> None:
    policy = load_policy_module(render_policy_module(plan))
    assert policy.AUTOCAST_DTYPE is expected
    context = policy.autocast()
    if expected is None:
        assert isinstance(context, contextlib.nullcontext)
        return
    with context:
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") is expected
        out = torch.nn.Linear(4, 4)(torch.ones(2, 4))
    assert out.dtype is expected


def test_local_device_is_the_cpu_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    policy = load_policy_module(render_policy_module(make_plan(shard=2)))
    assert policy.local_device() == torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# One loop, three plans, 2 gloo ranks
# ---------------------------------------------------------------------------------------------


def _one_loop_worker(rank: int, world_size: int, port: int, cases: list) -> None:
    """The README loop, unchanged for every plan: apply, autocast, backward, step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.nn.parallel import DistributedDataParallel

    _init_gloo(rank, world_size, port)
    try:
        llama = load_llama()
        for name, source, expected in cases:
            policy = load_policy_module(source)
            torch.manual_seed(0)
            model = llama.build_model("tiny")
            seen = []  # (autocast on, dtype of a weight) inside layers.1's attention
            model.layers[1].attention.register_forward_pre_hook(
                lambda m, args, seen=seen: seen.append((torch.is_autocast_enabled("cpu"),
                                                        m.wq.weight.dtype)))

            model = policy.apply(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            tokens = _inputs(rank)
            losses, counts = [], None
            for step in range(STEPS):
                optimizer.zero_grad(set_to_none=True)
                with CommDebugMode() as mode:
                    with policy.autocast():
                        loss = llama.loss_fn(model(tokens))
                    loss.backward()
                if step == 1:  # steady step: DDP rebuilt its buckets after the first
                    counts = _comm_counts(mode)
                optimizer.step()
                losses.append(loss.item())

            if expected["ddp"]:
                assert isinstance(model, DistributedDataParallel), (name, type(model))
            else:
                assert isinstance(model, FSDPModule), (name, type(model))
                assert model.layers[1].attention.wq.weight.device_mesh.shape == expected["mesh"]
            assert counts == expected["counts"], (name, counts)
            assert seen[0] == expected["forward"], (name, seen[0])
            assert losses[-1] < losses[0], (name, losses)
            if rank == 0:
                print(f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {STEPS} steps, "
                      f"collectives {counts}", flush=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_one_loop_trains_fsdp_hsdp_and_ddp_plans_on_gloo() -> None:
    hsdp = make_plan(replicate=2, shard=1, strategy="hybrid")
    cases = [
        # FSDP2, float32 parameters gathered, compute under bf16 autocast; 4 units: 4 gathers in
        # forward, the 3 resharded again in backward, 4 reduce-scatters
        ("fsdp", render_policy_module(autocast_fsdp_plan()),
         {"ddp": False, "mesh": (2,), "forward": (True, torch.float32),
          "counts": {"all_gather": 7, "reduce_scatter": 4, "all_reduce": 0}}),
        # HSDP on a (2, 1) mesh: bf16 MixedPrecisionPolicy, no autocast, one all-reduce per unit
        ("hsdp", render_policy_module(hsdp),
         {"ddp": False, "mesh": (2, 1), "forward": (False, torch.bfloat16),
          "counts": {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 4}}),
        # DDP: float32 parameters under bf16 autocast; 0.8 MB of gradients fill one bucket
        ("ddp", render_policy_module(ddp_plan()),
         {"ddp": True, "forward": (True, torch.float32),
          "counts": {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 1}}),
    ]
    run_ranks(_one_loop_worker, 2, cases, timeout_s=300)
