"""Hostile input, round 3 (issue 21): tune, the torchrun worker entry, plans and predict.

Each case runs through a real entry point (``fsdp_plan.cli.main.main`` in-process, or a
subprocess of ``python -m fsdp_plan.cli.main`` / ``python -m fsdp_plan.bench.worker``) and
checks the SPEC 2 contract for it: the exit code, the message's words, no Python traceback,
and no file written, changed or left behind (no worker left running either). Where a check
must come "before any measuring", the one function that starts workers (``time_plans`` for
tune) is replaced by a recorder, and the model loader by one that fails the test.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
from test_measure_helpers import plan_file, tiny_llama_plan

import fsdp_plan.bench.timing as timing
import fsdp_plan.measure.runtime as runtime
from fsdp_plan.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` (recursively): bytes and mode. A refused run changes none,
    adds none and leaves no temporary."""
    return {str(p.relative_to(folder)): (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys, argv: list[str], code: int, *needles: str) -> str:
    """``fsdp-plan ARGV`` in-process: exit ``code``, every needle in stderr, no traceback, no
    report on stdout."""
    got = main(argv)
    captured = capsys.readouterr()
    assert got == code, captured.err
    assert "Traceback" not in captured.err, captured.err
    assert captured.out == "", captured.out
    for needle in needles:
        assert needle in captured.err, captured.err
    return captured.err


class FakeTimePlans:
    """Stands in for ``bench.timing.time_plans`` (the only thing tune starts workers with):
    records the plans and answers with a step time per plan (1% jitter, two ranks)."""

    def __init__(self, seconds=lambda plan: 1.0, action=None) -> None:
        self.calls: list[list] = []
        self.seconds = seconds
        self.action = action

    def __call__(self, source, plans, *, nproc, mesh, steps, warmup, **_):
        self.calls.append(list(plans))
        if self.action is not None:
            self.action()
        return [[[self.seconds(p) * (1 + 0.01 * (i % 3 - 1)) for i in range(steps)]] * nproc
                for p in plans]


def _no_model_loading(*args, **kwargs):
    raise AssertionError("the model was loaded: the check did not come before the work")


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> str:
    """A tiny Llama plan at world 2 (one unit per block, root last), in a folder of its own."""
    return plan_file(tmp_path_factory.mktemp("plan"), tiny_llama_plan(world=2))


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """The folder ``tempfile`` uses in this test: it must be empty when the command returns."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


# --- tune: outputs checked before measuring (S3-11) -------------------------------------------

def test_s3_11_tune_out_under_a_file_is_refused_before_any_measuring(plan, tmp_path, capsys,
                                                                     monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text("# a project's readme\n")
    bench = FakeTimePlans()
    monkeypatch.setattr(timing, "time_plans", bench)
    monkeypatch.setattr(runtime, "load_planned_model", _no_model_loading)
    before = snapshot(tmp_path)
    refused(capsys, ["tune", plan, "--out", str(readme / "sub")], 2,
            "--out", "README.md", "is a file, not a folder")
    assert bench.calls == []
    assert snapshot(tmp_path) == before


# --- tune: --nproc capped as bench and calibrate cap it (S3-31) -------------------------------

@pytest.mark.parametrize("over", [1, 64])
def test_s3_31_tune_nproc_is_capped_like_bench(plan, tmp_path, capsys, monkeypatch, over):
    from fsdp_plan.bench.inputs import max_local_workers
    limit = max_local_workers()
    bench = FakeTimePlans()
    monkeypatch.setattr(timing, "time_plans", bench)
    monkeypatch.setattr(runtime, "load_planned_model", _no_model_loading)
    out = tmp_path / "results"
    before = snapshot(tmp_path)
    refused(capsys, ["tune", plan, "--nproc", str(limit + over), "--out", str(out)], 2,
            f"--nproc is the number of local worker processes, from 1 to {limit}",
            f"got {limit + over}")
    refused(capsys, ["tune", plan, "--nproc", "0", "--out", str(out)], 2, "from 1 to")
    assert bench.calls == [] and not out.exists()
    assert snapshot(tmp_path) == before
