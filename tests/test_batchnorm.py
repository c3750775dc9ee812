"""Batch norm under bf16 mixed precision: [Note: batch norm in full precision] in units.py.

FSDP2 gathers every unit in ``param_dtype``; a batch norm's weights in bf16 beside its float32
running statistics fail the first real step (``expected scalar type BFloat16 but found
Float``). Plans therefore make each batch norm a float32 unit of its own: the planner's graph,
layouts, memory model and plan record it, the policy applies it, and ``verify`` refuses a plan
that does not.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml
from test_emit import _init_gloo, run_ranks
from test_measure_helpers import run_cli
from torch import nn

from fsdp_plan.cost.precision import Precision
from fsdp_plan.cost.units import build_units, unit_mixed_precision, with_full_precision_units
from fsdp_plan.facts.dtypes import DtypeChecker
from fsdp_plan.facts.graph import build_module_graph
from fsdp_plan.model.load import ModelSource, load_model
from fsdp_plan.plan.document import Mesh, Plan, Unit
from fsdp_plan.plan.emit import load_policy_module, render_policy_module
from fsdp_plan.search.layouts import block_layouts

ROOT = Path(__file__).resolve().parent.parent
RESNET = str(ROOT / "examples" / "resnet.py")
LLAMA = str(ROOT / "examples" / "llama.py")
FLOAT32_UNIT = {"param_dtype": "float32", "output_dtype": "bfloat16"}


class ConvNet(nn.Module):
    """conv -> bn -> relu -> conv -> bn (inside ``block``), then a conv head; plus a
    parameter-free batch norm (``affine=False``) and a LayerNorm, which stay as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                   nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, bias=False),
                                   nn.BatchNorm2d(8))
        self.plain_bn = nn.BatchNorm2d(8, affine=False)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.plain_bn(self.block(x))
        return self.head(self.norm(x.transpose(1, 3)).transpose(1, 3))


def _resnet_graph():
    return build_module_graph(load_model(ModelSource(source=RESNET, args={"size": "tiny"},
                                                     batch_size=2, seq_len=16)).model)


# ---------------------------------------------------------------------------------------------
# The planner's side (no process group)
# ---------------------------------------------------------------------------------------------


def test_graph_flags_batch_norm_with_parameters_only() -> None:
    with torch.device("meta"):
        graph = build_module_graph(ConvNet())
    flagged = [fqn for fqn, info in graph.modules.items() if info.keeps_full_precision]
    assert flagged == ["block.1", "block.4"]


def test_every_layout_makes_each_batch_norm_a_unit_before_its_container() -> None:
    graph = _resnet_graph()
    batch_norms = [f for f, info in graph.modules.items() if info.keeps_full_precision]
    assert len(batch_norms) == 29 and "layer2.0.downsample.1" in batch_norms
    layouts = block_layouts(graph)
    assert "per-block" in layouts and "root-only" in layouts
    for name, groups in layouts.items():
        keys = [g[0] for g in groups]
        assert [g for g in groups if g[0] in batch_norms] == [[b] for b in batch_norms], name
        for bn in batch_norms:  # children first: no unit containing a batch norm comes before it
            assert all(not bn.startswith(k + ".") for k in keys[:keys.index(bn)]), (name, bn)
    # In execution order around the blocks: layer2.1's batch norms right before layer2.1.
    per_block = [g[0] for g in layouts["per-block"]]
    at = per_block.index("layer2.1")
    assert per_block[at - 3:at] == ["layer2.1.bn1", "layer2.1.bn2", "layer2.1.bn3"]


def test_models_without_batch_norm_keep_their_layouts() -> None:
    graph = build_module_graph(load_model(ModelSource(source=LLAMA, args={"size": "tiny"},
                                                      batch_size=2, seq_len=16)).model)
    groups = [[b] for b in graph.blocks]
    assert with_full_precision_units(graph, groups) == groups


def test_batch_norm_units_are_gathered_in_float32() -> None:
    graph = _resnet_graph()
    units = build_units(graph, with_full_precision_units(graph, []), [True] * 29, shard_size=2)
    bn_unit, root = units[0], units[-1]
    assert bn_unit.modules == ["bn1"] and bn_unit.full_precision and bn_unit.numel == 16
    assert root.modules == [""] and not root.full_precision
    bf16 = Precision(orig_bytes=4, param_bytes=2, reduce_bytes=4)
    assert bf16.unit_param_bytes(bn_unit) == 4 and bf16.unit_param_bytes(root) == 2
    assert Precision(param_bytes=4).unit_param_bytes(bn_unit) == 4
    assert unit_mixed_precision(bn_unit, "bfloat16") == FLOAT32_UNIT
    assert unit_mixed_precision(bn_unit, "float16") == {"param_dtype": "float32",
                                                        "output_dtype": "float16"}
    assert unit_mixed_precision(bn_unit, "float32") is None
    assert unit_mixed_precision(bn_unit, None) is None
    assert unit_mixed_precision(root, "bfloat16") is None


def test_dtype_checker_refuses_bf16_batch_norm_weights_beside_float32_statistics() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(2, 8, 4, 4).bfloat16()
        stats = torch.zeros(8), torch.ones(8)
        with DtypeChecker() as checker:
            torch.nn.functional.batch_norm(x, *stats, torch.ones(8).bfloat16(),
                                           torch.zeros(8).bfloat16(), training=True)
        assert len(checker.mismatches) == 1
        assert "got bfloat16 and float32" in checker.mismatches[0]
        assert "batch norm" in checker.mismatches[0]
        with DtypeChecker() as checker:  # float32 weights and a bf16 input: a kernel that runs
            torch.nn.functional.batch_norm(x, *stats, torch.ones(8), torch.zeros(8),
                                           training=True)
            torch.nn.functional.batch_norm(x.float(), *stats, None, None, training=True)
        assert checker.mismatches == []


# ---------------------------------------------------------------------------------------------
# The policy's side
# ---------------------------------------------------------------------------------------------


def _convnet_plan(*, world: int, override: bool) -> dict:
    """A plan document for ConvNet: each batch norm a unit (float32 when ``override``), the
    block, the root; bf16 compute."""
    units = [Unit(modules=["block.1"]), Unit(modules=["block.4"]), Unit(modules=["block"]),
             Unit(modules=[""], reshard_after_forward=False)]
    document = Plan(model={"source": "ConvNet"}, budget_bytes=10**9, world_size=world,
                    mesh=Mesh(shard=world), units=units,
                    mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                    ).to_dict()
    if override:
        for unit in document["units"][:2]:
            unit["mixed_precision"] = dict(FLOAT32_UNIT)
    return document


class _Document:
    """What render_policy_module needs of a plan (its document), for hand-made documents."""

    def __init__(self, document: dict) -> None:
        self.document = document

    def to_dict(self) -> dict:
        return self.document


def test_policy_applies_the_unit_override() -> None:
    policy = load_policy_module(render_policy_module(_Document(_convnet_plan(world=2,
                                                                             override=True))))
    units = policy.PLAN["units"]
    assert policy._unit_precision(units[0]) == {
        "param_dtype": torch.float32, "reduce_dtype": torch.float32,
        "output_dtype": torch.bfloat16}
    assert policy._unit_precision(units[2]) == {
        "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": None}
    # FSDP1 keeps its default: every _BatchNorm wrapped separately in full precision.
    mixed = policy.FSDP_KWARGS["mixed_precision"]
    assert mixed.param_dtype is torch.bfloat16
    assert torch.nn.modules.batchnorm._BatchNorm in mixed._module_classes_to_ignore
    document = _convnet_plan(world=2, override=True)
    document["units"][0]["mixed_precision"] = {"param_dtpye": "float32"}
    with pytest.raises(ValueError, match="unknown mixed_precision keys"):
        load_policy_module(render_policy_module(_Document(document)))


def test_without_a_lower_param_dtype_fsdp1_adds_no_units() -> None:
    document = _convnet_plan(world=2, override=False)
    document["mixed_precision"] = {"param_dtype": None, "reduce_dtype": "float32"}
    policy = load_policy_module(render_policy_module(_Document(document)))
    assert policy.FSDP_KWARGS["mixed_precision"]._module_classes_to_ignore == ()


def _step_worker(rank: int, world_size: int, port: int, with_source: str,
                 without_source: str) -> None:
    """One bf16 training step of ConvNet with FSDP2: it runs with the float32 batch norm units
    and fails as users saw it without them."""
    _init_gloo(rank, world_size, port)
    for source, runs in ((with_source, True), (without_source, False)):
        policy = load_policy_module(source)
        torch.manual_seed(0)
        model = policy.apply_fully_shard(ConvNet())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(2, 4, 8, 8)
        try:
            for _ in range(2):
                out = model(x)
                out.float().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        except RuntimeError as e:
            assert not runs, e
            assert "expected scalar type BFloat16 but found Float" in str(e), e
            continue
        assert runs, "a bf16 batch norm ran; the test no longer shows the failure it guards"
        assert out.dtype is torch.bfloat16  # the head computed in bf16 (the output cast back)
        bn = model.block[1]
        assert bn.weight.dtype is torch.float32 and bn.running_mean.abs().sum() > 0
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_bf16_step_runs_with_float32_batch_norm_units_on_gloo() -> None:
    with_source = render_policy_module(_Document(_convnet_plan(world=2, override=True)))
    without_source = render_policy_module(_Document(_convnet_plan(world=2, override=False)))
    run_ranks(_step_worker, 2, with_source, without_source)


# ---------------------------------------------------------------------------------------------
# The planner and verify end to end
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_planned_resnet_records_float32_units_and_verify_catches_a_plan_without(
        tmp_path: Path) -> None:
    plan_path, policy_path = tmp_path / "resnet.yaml", tmp_path / "resnet.py"
    code, _, err = run_cli([RESNET, "--model-arg", "size=tiny", "--mem", "1GB",
                            "--world-size", "2", "--batch-size", "4", "--param-dtype", "bf16",
                            "--strategy", "full",  # at 1 GB auto would replicate (DDP)
                            "--plan", str(plan_path), "-o", str(policy_path)])
    assert code == 0, err
    document = yaml.safe_load(plan_path.read_text())
    overridden = [u["modules"][0] for u in document["units"] if u.get("mixed_precision")]
    assert len(overridden) == 29 and "layer1.0.downsample.1" in overridden
    assert all(u["mixed_precision"] == FLOAT32_UNIT for u in document["units"]
               if u.get("mixed_precision"))
    policy = load_policy_module(str(policy_path))
    assert policy.PLAN == document

    code, out, err = run_cli(["verify", str(plan_path)])
    assert code == 0, out + err
    assert "Traceback" not in err

    # The plan as fsdp-plan wrote it before: no float32 batch norm units.
    document["units"] = [u for u in document["units"] if not u.get("mixed_precision")]
    document["forward_prefetch"], document["backward_prefetch"] = {}, {}
    old_path = tmp_path / "old.yaml"
    old_path.write_text(yaml.safe_dump(document, sort_keys=False))
    before = sorted(os.listdir(tmp_path))
    code, out, err = run_cli(["verify", str(old_path)])
    assert code == 1, out + err
    assert "native_batch_norm got bfloat16 and float32" in err
    assert "batch norm" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == before


def test_float32_plans_give_batch_norm_no_units_of_its_own():
    """Batch norm needs its own float32 unit only when the plan computes below float32."""
    from fsdp_plan.facts.graph import build_module_graph
    from fsdp_plan.model.load import load_model
    from fsdp_plan.model.source import ModelSource
    from fsdp_plan.search.layouts import block_layouts
    resnet = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "examples", "resnet.py")
    graph = build_module_graph(load_model(ModelSource(source=resnet,
                                                      args={"size": "tiny"})).model)
    norms = {f for f, m in graph.modules.items() if m.keeps_full_precision}
    assert norms
    for groups in block_layouts(graph, full_precision_units=False).values():
        assert not norms & {m for g in groups for m in g}
    for groups in block_layouts(graph, full_precision_units=True).values():
        assert norms <= {m for g in groups for m in g}


def test_compiled_blocks_holding_float32_batch_norm_units_are_refused(tmp_path):
    """Below float32 each batch norm is a float32 FSDP unit of its own, and one inside a
    compiled block would be unsharded by FSDP2's hooks in the middle of the block's graph,
    which ``torch.compile(fullgraph=True)`` refuses: the compiled ResNet plan failed on its
    first forward (bench on 2 gloo ranks: "Attempted to call function marked as skipped").
    ``--compile`` is refused for it, naming the batch norm and the way out; with float32
    parameters there are no such units and the compiled plan is made."""
    argv = [RESNET, "--model-arg", "size=tiny", "--mem", "1GB", "--world-size", "2",
            "--batch-size", "2", "--no-cache"]
    plan_path = tmp_path / "p.yaml"
    code, _, err = run_cli([*argv, "--compile", "--plan", str(plan_path)])
    assert code == 2 and "Traceback" not in err
    assert "holds batch norm" in err and "--param-dtype fp32" in err
    assert not plan_path.exists()
    code, _, err = run_cli([*argv, "--compile", "--param-dtype", "fp32", "--plan",
                            str(plan_path)])
    assert code == 0, err
    plan = yaml.safe_load(plan_path.read_text())
    assert plan["compile"]["blocks"] and plan["compile"]["modules"]
    assert not any(u.get("mixed_precision") for u in plan["units"])  # no float32 units
