"""PyTorch's own ``nn.Transformer`` modules plan, verify and bench ([Note: causal masks on fake
tensors] in fsdp_plan/transformer_masks.py).

``examples/seq2seq_transformer.py`` (``nn.Transformer`` with the tutorials' float causal mask,
no ``tgt_is_causal``) and ``examples/encoder_classifier.py`` (``nn.TransformerEncoder`` with a key
padding mask, nested tensors left on) are planned at world 4, held against FSDPMemTracker
(within 3%) and counted on 2 gloo processes (exactly the prediction). A mask made otherwise is
planned as not causal and the plan says so; a model's own ``.item()`` still exits 2.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from test_measure_helpers import ROOT, run_cli
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdp_plan.api import PlanRequest, make_plan
from fsdp_plan.measure.collectives import count_collectives_many
from fsdp_plan.measure.memory import measure_peak
from fsdp_plan.model.source import ModelSource
from fsdp_plan.model.transformer_masks import UNKNOWN_MASK_NOTE, transformer_masks_traceable
from fsdp_plan.plan.emit import load_policy_module

EXAMPLES = {"seq2seq": str(ROOT / "examples" / "seq2seq_transformer.py"),
            "classifier": str(ROOT / "examples" / "encoder_classifier.py")}
CASES = str(ROOT / "tests" / "fixtures" / "torch_transformer_cases.py")


@functools.cache
def _planned(name: str):
    source = ModelSource(source=EXAMPLES[name], batch_size=2, seq_len=64)
    # budgets where the whole model in one unit does not fit, so the blocks are units of their
    # own (at 3 MB the seq2seq model's step, the host's on the h100 preset, is fastest root-only)
    result = make_plan(PlanRequest(source=source, budget_bytes=int(2.3 * 10**6)
                                   if name == "seq2seq" else 10**6, world_size=4,
                                   strategy="full"))
    return result, source


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_torch_transformers_plan_and_verify_within_3_percent(name):
    result, _ = _planned(name)
    assert len(result.plan.units) > 1  # units below the root: the blocks are sharded
    measured = measure_peak(result.loaded, result.plan, load_policy_module(result.policy_source()))
    predicted = result.plan.predicted["peak_bytes"]
    assert abs(predicted - measured.peak_bytes) <= 0.03 * measured.peak_bytes, (
        name, predicted, measured.peak_bytes)
    assert UNKNOWN_MASK_NOTE not in (result.plan.model.notes or ())


def test_torch_transformers_count_exactly_on_gloo():
    jobs, plans = [], []
    for name in EXAMPLES:
        result, source = _planned(name)
        plans.append(result.plan)
        jobs.append({"plan": result.plan.to_dict(), "fsdp_version": 2, "source": source})
    counted = count_collectives_many(jobs[0]["source"], jobs, nproc=2, timeout_s=600)
    for plan, per_rank in zip(plans, counted):
        assert per_rank[0] == per_rank[1] == plan.predicted["collectives_per_step"]


def test_a_causal_mask_is_recognised_by_how_it_was_made():
    from torch.nn.modules import transformer

    notes: list[str] = []
    with FakeTensorMode(), transformer_masks_traceable(notes):
        made = torch.nn.Transformer.generate_square_subsequent_mask(8)
        by_hand = torch.triu(torch.full((8, 8), float("-inf")), diagonal=1)
        assert transformer._detect_is_causal_mask(made)
        assert transformer._detect_is_causal_mask(by_hand.to(torch.bfloat16))  # FSDP's cast
        assert not transformer._detect_is_causal_mask(made, size=4)  # another size: no
        assert not transformer._detect_is_causal_mask(made, is_causal=False)  # a hint rules
        assert notes == []
        assert not transformer._detect_is_causal_mask(torch.zeros(8, 8))
        assert notes == [UNKNOWN_MASK_NOTE]
        # a diagonal other than 1 is not causal
        assert not transformer._detect_is_causal_mask(
            torch.triu(torch.full((8, 8), float("-inf")), diagonal=0))
    # outside the block torch's own check is back, and real masks are read as torch reads them
    assert transformer._detect_is_causal_mask(torch.nn.Transformer.generate_square_subsequent_mask(4))
    assert "transformer_masks" not in transformer._detect_is_causal_mask.__module__


def test_a_mask_not_made_causal_is_planned_as_not_causal_and_the_plan_says_so(tmp_path):
    plan = tmp_path / "plan.yaml"
    code, _, err = run_cli([CASES, "--mem", "1GB", "--world-size", "2", "--seq-len", "16",
                              "--plan", str(plan)])
    assert code == 0, err
    assert "not causal" in plan.read_text(encoding="utf-8")


def test_the_models_own_item_still_exits_2_with_the_line(tmp_path):
    plan = tmp_path / "plan.yaml"
    code, _, err = run_cli([CASES, "--model-arg", "case=item", "--mem", "1GB",
                              "--world-size", "2", "--seq-len", "16", "--plan", str(plan)])
    assert code == 2 and "Traceback" not in err, err
    assert "reads a tensor's value" in err and ".item()" in err
    assert os.path.basename(CASES) in err
    assert not plan.exists()
