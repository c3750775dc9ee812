"""``fsdp-plan predict``: the plan as written, checked against FSDPMemTracker through verify."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from fsdp_plan.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("predict")
    path = str(folder / "plan.yaml")
    code = main([LLAMA, "--model-arg", "size=tiny", "--mem", "2GB", "--world-size", "4",
                 "--strategy", "full",
                 "--seq-len", "64", "--batch-size", "2", "--format", "json", "--plan", path,
                 "--strategy", "full"])  # FSDP units to edit (auto may choose DDP: no units)
    assert code == 0
    return path


def _edit(path: str, tmp_path, change) -> str:
    with open(path) as f:
        doc = yaml.safe_load(f)
    change(doc)
    out = tmp_path / "edited.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(out)


def test_predict_reproduces_the_planners_own_prediction(planned, capsys):
    capsys.readouterr()
    assert main(["predict", planned, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    with open(planned) as f:
        stored = yaml.safe_load(f)["predicted"]
    assert data["predicted"]["peak_bytes"] == stored["peak_bytes"]
    assert data["predicted"]["collectives_per_step"] == stored["collectives_per_step"]
    assert data["predicted"]["step_time_s"] == stored["step_time_s"]
    assert data["fits"] is True


def torchtitan(doc: dict) -> None:
    """One unit per block, the last kept unsharded, every block checkpointed; no prediction."""
    blocks = [f"layers.{i}" for i in range(4)]
    doc["units"] = ([{"modules": [b], "reshard_after_forward": b != blocks[-1]} for b in blocks]
                    + [{"modules": [""], "reshard_after_forward": False}])
    doc["activation_checkpointing"] = blocks
    doc["forward_prefetch"], doc["backward_prefetch"] = {}, {}
    doc.pop("predicted")
    doc["model"].pop("notes", None)


def test_a_hand_written_recipe_is_predicted_and_verify_agrees(planned, tmp_path, capsys):
    """The user's current setup, predicted without a search; FSDPMemTracker measures it within
    verify's 5% of that fresh prediction (the file holds no prediction of its own)."""
    path = _edit(planned, tmp_path, torchtitan)
    capsys.readouterr()
    assert main(["predict", path, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["predicted"]["collectives_per_step"] == {"all_gather": 8, "reduce_scatter": 5,
                                                         "all_reduce": 0}
    assert data["stored_predicted"] == {}
    assert main(["verify", path, "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fresh_prediction"] is True
    assert report["predicted_peak_bytes"] == data["predicted"]["peak_bytes"]
    assert report["relative_error"] <= 0.05


def test_verify_says_when_the_stored_prediction_is_stale(planned, tmp_path, capsys):
    def stale(doc):
        doc["predicted"]["peak_bytes"] = doc["predicted"]["peak_bytes"] * 3
    path = _edit(planned, tmp_path, stale)
    capsys.readouterr()
    # The stored figure is what other programs read: off by 3x, verify fails on it, while the
    # plan as it is now is predicted within tolerance.
    assert main(["verify", path, "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert any("not what the plan predicts now" in n for n in report["notes"])
    assert report["fresh_relative_error"] <= 0.05 < report["relative_error"]
    assert len(report["problems"]) == 1


def test_a_plan_over_its_budget_exits_3_after_printing_the_prediction(planned, tmp_path,
                                                                      capsys):
    def tight(doc):
        doc["budget_bytes"], doc["headroom_bytes"] = 1_000_000, 0
    path = _edit(planned, tmp_path, tight)
    capsys.readouterr()
    assert main(["predict", path]) == 3
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out and "peaks at" in err and "Traceback" not in err


def test_prefetch_lists_that_are_not_a_uniform_depth_are_refused(planned, tmp_path, capsys):
    def odd(doc):
        torchtitan(doc)
        doc["forward_prefetch"] = {"layers.0": ["layers.3"]}
    path = _edit(planned, tmp_path, odd)
    capsys.readouterr()
    assert main(["predict", path]) == 2
    err = capsys.readouterr().err
    assert "uniform depth" in err and "Traceback" not in err


def test_checkpointing_a_module_that_is_not_a_block_is_refused(planned, tmp_path, capsys):
    def inner(doc):
        torchtitan(doc)
        doc["activation_checkpointing"] = ["layers.0.attention"]
    path = _edit(planned, tmp_path, inner)
    capsys.readouterr()
    assert main(["predict", path]) == 2
    err = capsys.readouterr().err
    assert "not repeated blocks" in err and "Traceback" not in err
