"""What a command prints: PyTorch's warnings about the planner's own tracing machinery are
hidden ([Note: warnings of the planner's passes]); every other warning still shows."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from fsdp_plan.common.torch_warnings import ARTEFACTS, artefacts_hidden

HUB_KERNELS = os.path.join(os.path.dirname(__file__), "fixtures", "hub_kernels.py")


def test_tracing_a_model_with_modules_outside_its_tree_prints_no_torch_warning(tmp_path):
    """transformers 5's hub kernels are modules outside the model's tree, one calling another
    of its class; ModTracker (the analysis and FSDPMemTracker) warned "The module hierarchy
    tracking maybe be messed up" on every plan of an HF Llama. The plan and its verify are
    right (verify agrees to the byte), so the warning is hidden, and --debug shows it. A
    fresh process, as a user runs it: warnings are shown once per place in a process."""
    argv = [sys.executable, "-m", "fsdp_plan.cli.main", HUB_KERNELS, "--mem", "1GB",
            "--world-size", "2", "--seq-len", "16", "--no-cache", "--verify"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr
    assert "(+0.0%)" in done.stderr  # verify: the traced modules were measured alike
    debug = subprocess.run([*argv, "--debug"], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path, check=False)
    assert "hierarchy tracking maybe be messed up" in debug.stderr


@pytest.mark.parametrize("message", [m for m, _ in ARTEFACTS])
def test_each_listed_warning_is_hidden_and_others_still_show(message):
    text = message.replace("(PRE|POST)", "PRE").replace("\\", "")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with artefacts_hidden():
            warnings.warn(text + " (as PyTorch says it)", UserWarning, stacklevel=1)
            warnings.warn("a warning of the model's own", UserWarning, stacklevel=1)
    assert [str(w.message) for w in shown] == ["a warning of the model's own"]
