"""Compiled blocks (issue 22): the fused-kernel counters of the partition's graphs
(facts/fused.py) and their place in the step time (cost/compiled_time.py)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from fsdp_plan.cost.hardware import hardware_for
from fsdp_plan.facts import compiled
from fsdp_plan.facts.analysis import analyze
from fsdp_plan.facts.graph import build_module_graph
from fsdp_plan.model.load import load_model
from fsdp_plan.model.source import ModelSource

MODELS = {"llama": "examples/llama.py", "gpt2": "examples/gpt2.py"}
FLOP_KEYS = ("mm_small", "mm_medium", "mm_large", "attention")


def _loaded(name: str):
    return load_model(ModelSource(source=MODELS[name], args={"size": "tiny"}, batch_size=2,
                                  seq_len=64))


def _inside(modules, block: str, key: str) -> dict[str, float]:
    """The eager analysis's op counters of ``block`` and everything inside it."""
    total: dict[str, float] = {}
    for fqn, comp in modules.items():
        if fqn == block or fqn.startswith(block + "."):
            for k, v in getattr(comp, key).items():
                total[k] = total.get(k, 0.0) + v
    return total


@pytest.fixture(scope="module", params=sorted(MODELS))
def both(request):
    loaded = _loaded(request.param)
    blocks = build_module_graph(loaded.model).blocks
    eager = analyze(loaded, param_dtype=torch.bfloat16, blocks=blocks, with_checkpointing=False)
    comp = compiled.analyze_compiled(loaded, param_dtype=torch.bfloat16, blocks=blocks)
    return eager, comp


def test_fused_forward_keeps_the_matmul_flops_and_cuts_kernels_and_bytes(both):
    """Fusion changes memory-bound work only: the compiled forward graph's matmul and
    attention FLOPs equal the eager block's, with fewer kernels and fewer bytes moved."""
    eager, comp = both
    (one,) = comp.by_class.values()
    ref = _inside(eager.modules, one.block, "own_fw_ops")
    assert sum(one.fw_ops.get(k, 0.0) for k in FLOP_KEYS) == pytest.approx(
        sum(ref.get(k, 0.0) for k in FLOP_KEYS), rel=1e-9)
    # Llama's RMSNorm, SiLU and rotary run as many eager ops; GPT-2's LayerNorm and GELU are
    # single eager kernels already, so there compile fuses only the residual add into the norm
    fewer = 0.6 if one.class_name == "TransformerBlock" else 1.0
    assert one.fw_ops["ops"] < fewer * ref["ops"]
    assert one.fw_ops["memory_bytes"] < ref["memory_bytes"]
    assert one.bw_ops["ops"] < _inside(eager.modules, one.block, "own_bw_ops")["ops"]


def test_recompute_is_what_each_mode_recomputes(both):
    """Full checkpointing recomputes the forward's matmuls in the backward graph; the
    selective policy saves every matmul's output, so its backward graph multiplies no more
    than the plain one (memory-bound ops only are recomputed)."""
    _eager, comp = both
    (plain,) = comp.by_class.values()
    (full,) = comp.by_mode["full"].values()
    (sel,) = comp.by_mode["selective"].values()

    def mm(ops):
        return sum(ops.get(k, 0.0) for k in ("mm_small", "mm_medium", "mm_large"))

    assert 0 < mm(full.bw_ops) - mm(plain.bw_ops) <= mm(plain.fw_ops)
    assert mm(sel.bw_ops) == mm(plain.bw_ops)
    assert sel.bw_ops["memory_bytes"] > plain.bw_ops["memory_bytes"]


@functools.cache
def _planned(compile_blocks: bool):
    from fsdp_plan.api import make_plan
    from fsdp_plan.search.request import PlanRequest
    source = ModelSource(source=MODELS["llama"], args={"size": "small"}, batch_size=2,
                         seq_len=256)
    return make_plan(PlanRequest(source=source, budget_bytes=10**12, world_size=8,
                                 strategy="full", compile_blocks=compile_blocks))


def _predicted(compile_blocks: bool, hw):
    from fsdp_plan.api import predict
    result = _planned(compile_blocks)
    return predict(result.plan, result.facts, hardware=hw).candidate.time


def test_compiled_step_differs_from_eager_by_memory_bound_work_only():
    """On a machine where memory-bound work and launches are free, the compiled step
    computes as long as the eager one (same matmul and attention FLOPs); on an H100 it is
    shorter, by less than the eager memory-bound time."""
    h100 = hardware_for("h100")
    free = dataclasses.replace(h100, memory_bandwidth=1e30, hbm_bandwidth=1e30,
                               op_overhead_s=0.0)
    assert _predicted(True, free).compute_s == pytest.approx(_predicted(False, free).compute_s,
                                                             rel=1e-6)
    eager, comp = _predicted(False, h100), _predicted(True, h100)
    assert comp.compute_s < eager.compute_s
    assert eager.compute_s - comp.compute_s < eager.compute_s - _predicted(False, free).compute_s
