"""Hugging Face models planned from ``--hf-config`` train with their own loss (SPEC 7).

The default inputs carry ``labels`` shaped as each head's loss reads them, the step analysed is
``ModelOutput.loss``, and the plan is within 3% of FSDPMemTracker running the same model with
those labels (a causal LM, a seq2seq LM and an image classifier). Marked ``hf``: skipped
without the optional ``transformers`` extra.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from test_measure_helpers import run_cli

from fsdp_plan.api import PlanRequest, analyze_model, make_plan, predict
from fsdp_plan.measure.memory import measure_peak
from fsdp_plan.model.load import load_model
from fsdp_plan.model.source import ModelSource
from fsdp_plan.pictures.series import plan_timeline, step_series
from fsdp_plan.plan.emit import load_policy_module

pytestmark = [pytest.mark.hf, pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = os.path.join(ROOT, "examples", "hf")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")


def _source(path: str, batch: int = 2, seq: int = 64, **args) -> ModelSource:
    return ModelSource(source=path, kind="hf-config", entry="from_config", batch_size=batch,
                       seq_len=seq, args=args)


def _config(tmp_path, base: str, **changes) -> str:
    with open(os.path.join(HF, base), encoding="utf-8") as f:
        raw = json.load(f)
    raw.update(changes)
    path = tmp_path / f"{raw['architectures'][0]}.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    return str(path)


def _labels(source: ModelSource):
    _, kwargs = load_model(source).make_inputs(source.batch_size, source.seq_len)
    return kwargs.get("labels")


def test_each_head_gets_the_labels_its_loss_reads(tmp_path):
    causal = _labels(_source(os.path.join(HF, "llama.json"), 2, 16))
    assert causal.shape == (2, 16) and causal.dtype == torch.int64
    masked = _labels(_source(os.path.join(HF, "bert.json"), 2, 16))
    assert masked.shape == (2, 16) and masked.dtype == torch.int64
    seq2seq = _labels(_source(os.path.join(HF, "t5.json"), 2, 16))
    assert seq2seq.shape == (2, 16) and seq2seq.dtype == torch.int64
    image = _labels(_source(os.path.join(HF, "vit.json"), 3))
    assert image.shape == (3,) and image.dtype == torch.int64
    classify = _config(tmp_path, "bert.json", architectures=["BertForSequenceClassification"],
                       num_labels=5)
    assert _labels(_source(classify, 4, 16)).shape == (4,)
    regress = _config(tmp_path, "vit.json", num_labels=1)
    label = _labels(_source(regress, 3))
    assert label.shape == (3,) and label.is_floating_point()
    multi = _config(tmp_path, "bert.json", architectures=["BertForSequenceClassification"],
                    num_labels=3, problem_type="multi_label_classification")
    label = _labels(_source(multi, 2, 16))
    assert label.shape == (2, 3) and label.is_floating_point()
    # a head without a loss, and a model file, keep their inputs as they were
    bare = _config(tmp_path, "llama.json", architectures=["LlamaModel"])
    assert _labels(_source(bare, 2, 16)) is None
    file_source = ModelSource(source=os.path.join(FIXTURES, "hf_llama_file.py"), seq_len=16)
    assert _labels(file_source) is None


def test_the_step_is_the_models_own_loss_with_its_float32_logits():
    """Given labels the causal LM upcasts its logits to float32 inside its forward: the loss
    step holds more than summing the bf16 logits did (the old default)."""
    with_loss = analyze_model(_source(os.path.join(HF, "llama.json"), 2, 256)).facts.analysis
    without = analyze_model(ModelSource(source=os.path.join(FIXTURES, "hf_llama_file.py"),
                                        batch_size=2, seq_len=256)).facts.analysis
    peak = lambda a: max(e.peak for e in a.timeline.events)
    vocab, tokens = 512, 2 * 256
    assert peak(with_loss) - peak(without) >= vocab * tokens * 4  # at least the fp32 logits


@pytest.mark.parametrize(("config", "batch", "seq", "mem"), [
    ("llama.json", 2, 128, "3MB"), ("t5.json", 2, 64, "6MB"), ("vit.json", 8, 1, "3MB")])
def test_plans_with_labels_are_within_3_percent_of_fsdpmemtracker(config, batch, seq, mem):
    from fsdp_plan.common.sizes import parse_bytes
    source = _source(os.path.join(HF, config), batch, seq)
    result = make_plan(PlanRequest(source=source, budget_bytes=parse_bytes(mem),
                                   world_size=8, strategy="full"))
    measured = measure_peak(result.loaded, result.plan,
                            load_policy_module(result.policy_source()))
    predicted = result.plan.predicted["peak_bytes"]
    assert abs(predicted - measured.peak_bytes) <= 0.03 * measured.peak_bytes, (
        config, predicted, measured.peak_bytes, result.plan.predicted["breakdown"],
        measured.breakdown)


def test_the_breakdown_shows_what_the_loss_holds_when_the_peak_falls_there(tmp_path):
    code, out, err = run_cli(["--hf-config", os.path.join(HF, "llama.json"), "--mem", "1GB",
                              "--world-size", "8", "--seq-len", "256", "--batch-size", "2",
                              "--strategy", "full"])
    assert code == 0, err
    rows = dict(line.split(None, 1) for line in out.split("at the peak", 1)[1].splitlines()[2:9]
                if line.strip())
    assert "loss" in rows, out
    assert "backward (pre_bw lm_head)" in out


@pytest.mark.parametrize("strategy", ["full", "ddp"])
def test_the_pictures_show_what_the_loss_holds_as_the_breakdown_does(strategy):
    """The memory over the step (``--html``, ``--memory-snapshot``) splits the activations as
    the plan's breakdown does: its highest total is the predicted peak and holds the same
    ``loss`` bytes there. A DDP plan in bf16 computes under autocast, so its picture is drawn
    from the pass traced under autocast, as the search priced it."""
    source = _source(os.path.join(HF, "llama.json"), 2, 256)
    result = make_plan(PlanRequest(source=source, budget_bytes=10**9, world_size=8,
                                   strategy=strategy))
    prediction = predict(result.plan, result.facts)
    series = step_series(plan_timeline(result.plan, result.facts, prediction),
                         prediction.candidate.time)
    breakdown = result.plan.predicted["breakdown"]
    assert breakdown.get("loss"), breakdown
    assert series.peak_bytes == result.plan.predicted["peak_bytes"]
    at = series.totals.index(series.peak_bytes)
    assert series.parts["loss"][at] == breakdown["loss"]
    assert series.parts["activations"][at] == breakdown["activations"]


def test_model_made_position_ids_are_one_sequence_on_fake_tensors():
    """[Note: packed-sequence detection on fake tensors]: transformers skips its packed-sequence
    check for fake tensors and builds a 4-D mask real training does not; while the planner
    traces, position ids made as arange(n) + offset are one sequence, others keep the check."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import masking_utils

    from fsdp_plan.model.transformer_masks import transformer_masks_traceable

    with FakeTensorMode():
        made = (torch.arange(16) + 0).unsqueeze(0).expand(2, -1)
        assert masking_utils.find_packed_sequence_indices(made) is not None  # "tracing"
        with transformer_masks_traceable():
            made = (torch.arange(16) + 3).unsqueeze(0).expand(2, -1)
            assert masking_utils.find_packed_sequence_indices(made) is None
            packed = torch.cat([torch.arange(8), torch.arange(8)]).unsqueeze(0)
            assert masking_utils.find_packed_sequence_indices(packed) is not None
