"""The generated policy module (SPEC section 4): its text, and what it does to real models.

Fixture-level tests load the rendered module in this process. Distributed tests run each in
fresh processes (``torch.multiprocessing`` spawn): FSDP2 on the fake process group at world
size 8, and real steps on gloo with 2 or 4 ranks for FSDP1, FSDP2, HSDP and strategy "none".
Workers are module-level functions so spawned children can import them.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import math
import multiprocessing
import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from fsdp_plan.plan.document import Mesh, Plan, Unit
from fsdp_plan.plan.emit import load_policy_module, render_policy_module, write_policy_module

LLAMA_PATH = Path(__file__).resolve().parent.parent / "examples" / "llama.py"
INJECTION = 'x"); import os; os.system("echo pwned'


def load_llama():
    module_name = "_fsdp_plan_example_llama"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, LLAMA_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while executing
    spec.loader.exec_module(module)
    return module


def make_plan(*, replicate: int = 1, shard: int = 8, strategy: str = "full",
              param_dtype: str | None = "bfloat16", reduce_dtype: str | None = "float32",
              grouped: bool = True) -> Plan:
    """A hand-written plan for the tiny Llama: one unit per block (layers.2 and layers.3
    grouped when ``grouped``), the root last and not resharded, AC on layers.0, prefetch."""
    blocks = [["layers.0"], ["layers.1"]]
    blocks += [["layers.2", "layers.3"]] if grouped else [["layers.2"], ["layers.3"]]
    reshard = strategy != "grad-op"
    units = [Unit(modules=m, reshard_after_forward=reshard) for m in blocks]
    units.append(Unit(modules=[""], reshard_after_forward=False))
    return Plan(
        model={"source": "examples/llama.py", "entry": "build_model", "args": {"size": "tiny"},
               "batch_size": 2, "seq_len": 16, "params": 198208},
        budget_bytes=70_000_000_000,
        headroom_bytes=7_000_000_000,
        world_size=replicate * shard,
        mesh=Mesh(replicate=replicate, shard=shard),
        strategy=strategy,
        units=units,
        activation_checkpointing=["layers.0"],
        forward_prefetch={"layers.0": ["layers.1"]},
        backward_prefetch={"layers.1": ["layers.0"]},
        mixed_precision={"param_dtype": param_dtype, "reduce_dtype": reduce_dtype},
        predicted={"peak_bytes": 61_234_567_890,
                   "collectives_per_step": {"all_gather": 7, "reduce_scatter": 4,
                                            "all_reduce": 0},
                   "step_time_s": 0.5, "exposed_comm_s": 0.01},
    )


# ---------------------------------------------------------------------------------------------
# The module's text and constants (no process group)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grouped", [True, False])
def test_plan_round_trips(grouped: bool) -> None:
    plan = make_plan(grouped=grouped)
    policy = load_policy_module(render_policy_module(plan))
    assert policy.PLAN == plan.to_dict()
    assert list(policy.PLAN) == list(plan.to_dict())  # SPEC key order kept
    expected_units = ["layers.0", "layers.1", "layers.2", "layers.3", ""]
    assert policy.FSDP1_UNITS == expected_units
    assert policy.PARAM_DTYPE is torch.bfloat16 and policy.REDUCE_DTYPE is torch.float32


def test_imports_only_torch_and_stdlib() -> None:
    tree = ast.parse(render_policy_module(make_plan()))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported - {"torch"} <= set(sys.stdlib_module_names), imported


def _statements(source: str) -> list[str]:
    """The module's statements after its docstring, with ``PLAN``'s value left out."""
    out = []
    for node in ast.parse(source).body[1:]:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else (
            node.target if isinstance(node, ast.AnnAssign) else None)
        out.append("PLAN = ..." if isinstance(target, ast.Name) and target.id == "PLAN"
                   else ast.dump(node))
    return out


def test_generated_code_is_the_runtime_module() -> None:
    """The policy file runs policy_runtime.py's code, statement for statement (no drift)."""
    from fsdp_plan import policy_runtime

    runtime = Path(policy_runtime.__file__).read_text()
    source = render_policy_module(make_plan())
    assert _statements(source) == _statements(runtime)
    assert _statements(source).count("PLAN = ...") == 1
    # The text after the docstring is the runtime's, but for the one PLAN line.
    runtime_code = runtime[runtime.index('"""', 3) + 3:].lstrip("\n")
    head, _, tail = runtime_code.partition("PLAN: dict = {}\n")
    assert source.index(head) < source.index("PLAN = {") < source.index(tail)
    assert source.endswith(tail)


def test_runtime_imported_from_the_package_does_nothing_plan_dependent() -> None:
    from fsdp_plan import policy_runtime
    from fsdp_plan.facts import analysis

    assert policy_runtime.PLAN == {} and policy_runtime.FSDP1_UNITS == []
    assert policy_runtime.FSDP_KWARGS == {} and policy_runtime.PARAM_DTYPE is None
    assert analysis.normalize_fqn is policy_runtime.plain_fqn
    assert policy_runtime.plain_fqn(
        "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.attn"
    ) == "layers.0.attn"


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float64"])
def test_dtype_names_resolve_to_torch_floating_dtypes(name: str) -> None:
    plan = make_plan(param_dtype=name)
    assert load_policy_module(render_policy_module(plan)).PARAM_DTYPE is getattr(torch, name)


@pytest.mark.parametrize("name", ["bf16", "int8", "Tensor", "__class__", "float32.x", "cuda"])
def test_other_dtype_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=f"unknown dtype {name!r}"):
        load_policy_module(render_policy_module(make_plan(param_dtype=name)))


def test_docstring_states_the_plan() -> None:
    policy = load_policy_module(render_policy_module(make_plan(replicate=2, shard=4,
                                                               strategy="hybrid")))
    doc = policy.__doc__
    assert "examples/llama.py (size=tiny)" in doc
    assert "World size 8 on a mesh of 2 replicate x 4 shard ranks (strategy hybrid)" in doc
    assert "Budget 70.0 GB (65.2 GiB)" in doc
    assert "predicted peak 61.2 GB (57.0 GiB)" in doc


@pytest.mark.parametrize("strategy, expected", [
    ("full", "FULL_SHARD"), ("hybrid", "HYBRID_SHARD"), ("grad-op", "SHARD_GRAD_OP"),
    ("none", "NO_SHARD"),
])
def test_fsdp_kwargs(strategy: str, expected: str) -> None:
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

    plan = make_plan(strategy=strategy)
    kwargs = load_policy_module(render_policy_module(plan)).FSDP_KWARGS
    assert kwargs["sharding_strategy"] is getattr(ShardingStrategy, expected)
    assert kwargs["backward_prefetch"] is BackwardPrefetch.BACKWARD_PRE
    assert kwargs["forward_prefetch"] is True
    assert kwargs["limit_all_gathers"] is True
    assert kwargs["mixed_precision"].param_dtype is torch.bfloat16
    assert kwargs["mixed_precision"].reduce_dtype is torch.float32
    assert kwargs["mixed_precision"].buffer_dtype is None


def test_fsdp_kwargs_without_prefetch_or_mixed_precision() -> None:
    plan = make_plan(param_dtype=None, reduce_dtype=None)
    plan.forward_prefetch, plan.backward_prefetch = {}, {}
    policy = load_policy_module(render_policy_module(plan))
    assert policy.FSDP_KWARGS["backward_prefetch"] is None
    assert policy.FSDP_KWARGS["forward_prefetch"] is False
    assert policy.FSDP_KWARGS["mixed_precision"] is None
    assert policy.fsdp1_kwargs() == policy.FSDP_KWARGS
    assert policy.fsdp1_kwargs(mesh="M")["device_mesh"] == "M"


def test_inconsistent_plan_fails_at_import() -> None:
    plan = make_plan()
    plan.forward_prefetch = {"layers.3": ["layers.1"]}  # layers.3 is not a unit's first module
    with pytest.raises(ValueError, match=r"names \['layers.3'\], which are not unit keys"):
        load_policy_module(render_policy_module(plan))
    plan = make_plan()
    plan.mixed_precision = {"param_dtype": "bfloat17", "reduce_dtype": None}
    with pytest.raises(ValueError, match="unknown dtype 'bfloat17'"):
        load_policy_module(render_policy_module(plan))


def test_write_is_atomic_and_loads_from_path(tmp_path: Path) -> None:
    path = tmp_path / "policy.py"
    write_policy_module(make_plan(), str(path))
    assert load_policy_module(str(path)).PLAN == make_plan().to_dict()
    bad = make_plan()
    bad.predicted["step_time_s"] = math.inf  # no exact Python literal
    before = path.read_text()
    with pytest.raises(ValueError, match="finite"):
        write_policy_module(bad, str(path))
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["policy.py"]


def test_untrusted_strings_stay_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "pwned"
    payloads = [
        INJECTION,
        f'"""\nopen({str(marker)!r}, "w")\n"""',
        f"'''\nopen({str(marker)!r}, 'w')\n'''",
        f"a\nopen({str(marker)!r}, 'w')  # \\",
        f"\\\"); open({str(marker)!r}, 'w'); (\"",
        "word " * 40 + INJECTION,  # long enough for pformat to split it across lines
    ]
    calls: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *a: calls.append(a))
    clean_body = [ast.dump(n) for n in ast.parse(render_policy_module(make_plan())).body[1:]
                  if not _is_plan_assignment(n)]
    for payload in payloads:
        plan = make_plan()
        plan.model = replace(plan.model, source=payload, args={payload: payload})
        plan.units[0].modules = [payload]
        plan.activation_checkpointing = [payload]
        plan.forward_prefetch = {payload: ["layers.1"]}
        plan.backward_prefetch = {"layers.1": [payload]}
        plan.gpu = payload
        source = render_policy_module(plan)
        policy = load_policy_module(source)
        assert policy.PLAN == plan.to_dict()
        assert policy.PLAN["units"][0]["modules"] == [payload]
        assert policy.FSDP1_UNITS[0] == payload
        # The payload never stands outside a string literal: the statements are those of a
        # clean plan's module, and PLAN's value is a pure literal.
        body = ast.parse(source).body
        assert [ast.dump(n) for n in body[1:] if not _is_plan_assignment(n)] == clean_body
        (plan_node,) = [n for n in body if _is_plan_assignment(n)]
        assert ast.literal_eval(plan_node.value) == plan.to_dict()
    assert calls == []
    assert not marker.exists()


def _is_plan_assignment(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "PLAN")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.inner(x))


class _Containers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.named = nn.ModuleDict({"a": _Block()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.named["a"](self.blocks[1](self.blocks[0](x)))


def _plan_for_containers(checkpointed: list[str]) -> Plan:
    return Plan(model={"source": "toy"}, budget_bytes=1, world_size=1, mesh=Mesh(shard=1),
                units=[Unit(modules=["blocks.0"]), Unit(modules=[""])],
                activation_checkpointing=checkpointed)


def test_activation_checkpointing_in_containers_and_nested() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    model = _Containers()
    block0, inner0 = model.blocks[0], model.blocks[0].inner
    policy = load_policy_module(render_policy_module(
        _plan_for_containers(["blocks.0", "named.a", "blocks.0.inner"])))
    policy.apply_activation_checkpointing(model)
    policy.apply_activation_checkpointing(model)  # idempotent: nothing wrapped twice
    assert isinstance(model.blocks[0], CheckpointWrapper)
    assert model.blocks[0]._checkpoint_wrapped_module is block0
    assert isinstance(model.named["a"], CheckpointWrapper)
    assert isinstance(block0.inner, CheckpointWrapper)
    assert block0.inner._checkpoint_wrapped_module is inner0
    assert not isinstance(model.blocks[1], CheckpointWrapper)
    assert not isinstance(model.blocks[0]._checkpoint_wrapped_module, CheckpointWrapper)
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    assert block0.calls == 2  # forward, then recomputed in backward
    assert model.blocks[1].calls == 1


def test_activation_checkpointing_names_missing_modules() -> None:
    policy = load_policy_module(render_policy_module(_plan_for_containers(["blocks.7"])))
    with pytest.raises(ValueError, match=r"no modules named \['blocks.7'\]"):
        policy.apply_activation_checkpointing(_Containers())


def test_auto_wrap_policy_under_fsdp1_recursion() -> None:
    """FSDP1's own recursion, with a marker wrapper, wraps exactly the plan's units."""
    from torch.distributed.fsdp.wrap import _recursive_wrap

    class Wrapped(nn.Module):
        def __init__(self, module: nn.Module, **kwargs: Any) -> None:
            super().__init__()
            self.module = module

    policy = load_policy_module(render_policy_module(make_plan()))
    llama = load_llama()
    for _ in range(2):  # a second model with fresh objects must not read stale names
        with torch.device("meta"):
            model = llama.build_model("tiny")
        _recursive_wrap(model, auto_wrap_policy=policy.auto_wrap_policy, wrapper_cls=Wrapped,
                        ignored_modules=set(), ignored_params=set(), only_wrap_children=True)
        wrapped = [name for name, m in model.named_modules() if isinstance(m, Wrapped)]
        assert wrapped == ["layers.0", "layers.1", "layers.2", "layers.3"]


# ---------------------------------------------------------------------------------------------
# Distributed: each test spawns fresh processes
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks start from a fork server that has imported torch once: fresh single-threaded
# processes like spawn's, without paying torch's import (seconds) for every rank.
_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor.debug",
            "torch.testing._internal.distributed.fake_pg", "fsdp_plan.model.fake", __name__]


def run_ranks(worker, world_size: int, *args: Any, timeout_s: float = 120.0) -> None:
    """Run ``worker(rank, world_size, port, *args)`` in ``world_size`` fresh processes."""
    multiprocessing.set_forkserver_preload(_PRELOAD)  # ignored once the server runs
    context = mp.start_processes(worker, args=(world_size, _free_port(), *args),
                                 nprocs=world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{worker.__name__} did not finish within {timeout_s} s")


def _init_gloo(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share two cores
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _comm_counts(mode) -> dict[str, int]:
    """CommDebugMode's counts normalised to all_gather / reduce_scatter / all_reduce."""
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for op, count in mode.get_comm_counts().items():
        name = str(op).lower()
        if "allgather" in name or "all_gather" in name:
            counts["all_gather"] += count
        elif "reduce_scatter" in name:
            counts["reduce_scatter"] += count
        elif "allreduce" in name or "all_reduce" in name:
            counts["all_reduce"] += count
    return counts


def _inputs(rank: int, generator_seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(generator_seed + rank)
    return torch.randint(0, 512, (2, 16), generator=generator)


def _check_fsdp2_structure(model: nn.Module, policy) -> None:
    """Every unit module is an FSDPModule (grouped ones sharing a state), AC wraps layers.0
    before sharding, prefetch lists point at the right units, reshard matches the plan."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    layers = model.layers
    for module in [layers[0], layers[1], layers[2], layers[3], model]:
        assert isinstance(module, FSDPModule), type(module)
    assert isinstance(layers[0], CheckpointWrapper)
    assert layers[2]._get_fsdp_state() is layers[3]._get_fsdp_state()
    assert layers[0]._get_fsdp_state()._states_to_forward_prefetch == [
        layers[1]._get_fsdp_state()]
    assert layers[1]._get_fsdp_state()._states_to_backward_prefetch == [
        layers[0]._get_fsdp_state()]
    for module, reshard in [(layers[0], True), (layers[2], True), (model, False)]:
        (group,) = module._get_fsdp_state()._fsdp_param_groups
        assert (group.post_forward_mesh_info is not None) is reshard


def _fake_world8_worker(rank: int, world_size: int, port: int, source: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_plan.model.fake import materialize_fake, new_fake_mode

    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        policy = load_policy_module(source)
        llama = load_llama()
        with torch.device("meta"):
            model = llama.build_model("tiny")
        fake_mode = new_fake_mode()
        materialize_fake(model, fake_mode)
        mesh = policy.build_device_mesh()  # outside FakeTensorMode: mesh setup reads tensors
        with fake_mode:
            policy.apply_fully_shard(model, mesh=mesh)
            _check_fsdp2_structure(model, policy)
            assert model.layers[1].attention.wq.weight.device_mesh.shape == (8,)
            assert model.layers[1].attention.wq.weight.to_local().shape == (8, 64)
            block0 = model.layers[0]._checkpoint_wrapped_module
            dtypes = []  # unsharded parameters seen in forward follow the MixedPrecisionPolicy
            model.layers[2].attention.register_forward_pre_hook(
                lambda m, args: dtypes.append(m.wq.weight.dtype))
            calls = []
            block0.register_forward_pre_hook(lambda *a: calls.append(1))  # recompute stops early
            tokens = torch.randint(0, 512, (2, 16))
            with CommDebugMode() as mode:
                llama.loss_fn(model(tokens)).backward()
        assert len(calls) == 2  # recomputed in backward
        assert dtypes == [torch.bfloat16]
        # 4 units gather in forward; the 3 resharded ones gather again in backward.
        assert _comm_counts(mode) == {"all_gather": 7, "reduce_scatter": 4, "all_reduce": 0}
        assert model.layers[2].attention.wq.weight.grad is not None
    finally:
        dist.destroy_process_group()


def test_fsdp2_on_fake_process_group_world_8() -> None:
    run_ranks(_fake_world8_worker, 1, render_policy_module(make_plan(shard=8)))


def _fsdp1_worker(rank: int, world_size: int, port: int, source: str) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    _init_gloo(rank, world_size, port)
    try:
        policy = load_policy_module(source)
        llama = load_llama()
        torch.manual_seed(0)
        model = llama.build_model("tiny")
        block0 = model.layers[0]
        calls = []
        block0.register_forward_pre_hook(lambda *a: calls.append(1))  # recompute stops early
        fsdp = FSDP(model, auto_wrap_policy=policy.auto_wrap_policy,
                    device_id=policy.local_device(), **policy.FSDP_KWARGS)  # as README says
        wrapped = [policy.plain_fqn(n) for n, m in fsdp.named_modules() if isinstance(m, FSDP)]
        assert sorted(wrapped) == sorted(policy.FSDP1_UNITS), wrapped

        def step_grads() -> tuple[float, list[torch.Tensor]]:
            fsdp.zero_grad(set_to_none=True)
            loss = llama.loss_fn(fsdp(_inputs(rank)))
            loss.backward()
            return loss.item(), [p.grad.clone() for p in fsdp.parameters()]

        loss_before, grads_before = step_grads()
        assert len(calls) == 1
        policy.apply_activation_checkpointing(fsdp)
        (name,) = [n for n, m in fsdp.named_modules() if isinstance(m, CheckpointWrapper)]
        # Inside layers.0's FSDP1 instance, around the original block.
        assert name == "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module", name
        assert fsdp.get_submodule(name)._checkpoint_wrapped_module is block0
        calls.clear()
        loss_after, grads_after = step_grads()
        assert len(calls) == 2  # checkpointed: recomputed in backward
        assert loss_after == loss_before
        for before, after in zip(grads_before, grads_after):
            torch.testing.assert_close(after, before)
        optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
        optimizer.step()
        assert llama.loss_fn(fsdp(_inputs(rank))).item() < loss_before
    finally:
        dist.destroy_process_group()


def test_fsdp1_auto_wrap_and_checkpointing_on_gloo() -> None:
    run_ranks(_fsdp1_worker, 2, render_policy_module(make_plan(shard=2)))


def _fsdp2_worker(rank: int, world_size: int, port: int, source: str, wrong_source: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    _init_gloo(rank, world_size, port)
    try:
        llama = load_llama()
        torch.manual_seed(0)
        model = llama.build_model("tiny")
        reference = copy.deepcopy(model)
        with pytest.raises(ValueError, match="PLAN is for 8 ranks but the process group has 2"):
            load_policy_module(wrong_source).apply_fully_shard(model)
        assert not any(type(m).__name__ == "CheckpointWrapper" for m in model.modules())

        policy = load_policy_module(source)
        policy.apply_fully_shard(model)
        _check_fsdp2_structure(model, policy)
        tokens = _inputs(0)  # the same batch on every rank: the sharded step equals one rank's
        with CommDebugMode() as mode:
            loss = llama.loss_fn(model(tokens))
            loss.backward()
        assert _comm_counts(mode) == {"all_gather": 7, "reduce_scatter": 4, "all_reduce": 0}
        ref_loss = llama.loss_fn(reference(tokens))
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad.full_tensor(), ref.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")

        for module in (model, reference):
            torch.optim.AdamW(module.parameters(), lr=1e-2).step()
        next_loss = llama.loss_fn(model(tokens))
        assert next_loss < loss
        torch.testing.assert_close(next_loss, llama.loss_fn(reference(tokens)), rtol=1e-3,
                                   atol=1e-4)
    finally:
        dist.destroy_process_group()


def test_fsdp2_real_step_on_gloo_matches_unsharded() -> None:
    source = render_policy_module(make_plan(shard=2, param_dtype=None, reduce_dtype=None))
    wrong = render_policy_module(make_plan(shard=8))
    run_ranks(_fsdp2_worker, 2, source, wrong)


def _replicated_worker(rank: int, world_size: int, port: int, source: str,
                       expected: dict[str, int]) -> None:
    """One real step with per-rank data; afterwards every rank holds the same parameters."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    _init_gloo(rank, world_size, port)
    try:
        policy = load_policy_module(source)
        llama = load_llama()
        torch.manual_seed(0)
        model = llama.build_model("tiny")
        policy.apply_fully_shard(model)
        weight = model.layers[1].attention.wq.weight
        mesh = policy.PLAN["mesh"]
        assert weight.device_mesh.shape == (mesh["replicate"], mesh["shard"])
        assert weight.device_mesh.mesh_dim_names == ("replicate", "shard")
        assert weight.placements == (Replicate(), Shard(0))
        with CommDebugMode() as mode:
            llama.loss_fn(model(_inputs(rank))).backward()
        assert _comm_counts(mode) == expected
        torch.optim.AdamW(model.parameters(), lr=1e-2).step()
        full = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(full) for _ in range(world_size)]
        dist.all_gather(gathered, full)
        for other in gathered:
            torch.testing.assert_close(other, full, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_hsdp_2x2_real_step_on_gloo() -> None:
    plan = make_plan(replicate=2, shard=2, strategy="hybrid")
    expected = {"all_gather": 7, "reduce_scatter": 4, "all_reduce": 4}
    run_ranks(_replicated_worker, 4, render_policy_module(plan), expected)


def test_strategy_none_is_pure_replication_on_gloo() -> None:
    """Mesh (2, 1): full parameters everywhere, no all-gather or reduce-scatter, one gradient
    all-reduce per unit."""
    plan = make_plan(replicate=2, shard=1, strategy="none")
    expected = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 4}
    run_ranks(_replicated_worker, 2, render_policy_module(plan), expected)
