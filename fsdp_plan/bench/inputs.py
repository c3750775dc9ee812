"""Every input of a benchmark run, checked before any worker starts (SPEC 2: bad input is
exit 2 with one paragraph, and nothing is written).

A benchmark costs minutes; an input found wrong only when the result is written loses the
run (issue 9: ``--predicted-trace`` that is not JSON, ``--compare`` lacking fields,
``--timeout nan``). So numbers are bounded here, files are read and checked here (the run
keeps what was read), and the ``--out`` folder is only checked: it is created when the
result is written, never for a run that is refused.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.reading import read_input_bytes

MAX_STEPS = 100_000
MAX_WARMUP = 10_000
MAX_THRESHOLD = 10.0
MAX_TRACE_BYTES = 1 << 30
"""A predicted trace is read whole into memory: refuse anything bigger than 1 GiB."""


@dataclass(frozen=True, kw_only=True)
class BenchRequest:
    """What one benchmark run is asked to do, as the command line gave it (``fsdp-plan bench``
    and the torchrun worker entry both build one, in ``cli/bench.py``). Its numbers are
    checked when it is made; its files are read by ``session.prepare``."""

    plan_path: str
    """The plan file (``PLAN.yaml``)."""
    model_path: str | None
    """The model file; ``None``: the source the plan records."""
    steps: int
    """Timed steady steps, 1 to ``MAX_STEPS``."""
    warmup: int
    """Unmeasured warm-up steps before them, 0 to ``MAX_WARMUP``."""
    fsdp_version: Literal[1, 2]
    """2: FSDP2 ``fully_shard``; 1: FSDP1 ``FullyShardedDataParallel`` (``--fsdp1``)."""
    out: str
    """The folder the result JSON and trace are written to (created only then)."""
    threshold: float
    """Relative regression that fails ``compare`` (above 0, below ``MAX_THRESHOLD``)."""
    format: Literal["table", "json"]
    """How the report is printed on stdout."""
    compare: str | None = None
    """A previous result to hold this run against."""
    predicted_trace: str | None = None
    """The planner's ``--trace`` output, for a side-by-side trace."""
    refit: str | None = None
    """A hardware file to rewrite from what the run measured (``bench/refit.py``)."""
    html: str | None = None
    """``--html``: the page of the run over the prediction (pictures/)."""
    memory_snapshot: str | None = None
    """``--memory-snapshot``: the measured step as a ``torch.cuda.memory._snapshot()`` pickle."""
    baseline: Literal["no-overlap"] | None = None
    """``--baseline no-overlap``: profile the plan again with communication held until backward
    compute is done, and say what overlap bought (bench/overlap.py)."""

    def __post_init__(self) -> None:
        """``--steps``, ``--warmup`` and ``--threshold`` within bounds (NaN and inf refused)."""
        if not 1 <= self.steps <= MAX_STEPS:
            raise BadInput(f"--steps is the number of timed steps, from 1 to {MAX_STEPS:,}; got "
                           f"{self.steps}.")
        if not 0 <= self.warmup <= MAX_WARMUP:
            raise BadInput(f"--warmup is the number of unmeasured warm-up steps, from 0 to "
                           f"{MAX_WARMUP:,}; got {self.warmup}.")
        if not (math.isfinite(self.threshold) and 0 < self.threshold < MAX_THRESHOLD):
            raise BadInput(f"--threshold is a fraction above 0 and below {MAX_THRESHOLD:g} "
                           f"(0.10 = 10%), got {self.threshold}.")
        if self.baseline not in (None, "no-overlap"):
            raise BadInput(f"--baseline takes no-overlap (the plan run again with communication "
                           f"held until backward compute is done), got {self.baseline!r}.")


def check_timeout(timeout_s: float) -> None:
    """``--timeout``: a finite, positive number of seconds."""
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise BadInput(f"--timeout is how many seconds a worker may go without progress; it "
                       f"must be a positive finite number, got {timeout_s}.")


def max_local_workers() -> int:
    """How many worker processes one machine may start: one per GPU with CUDA (NCCL needs a
    GPU per rank), else four per core (at least 8): gloo ranks beyond that only queue."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(8, 4 * (os.cpu_count() or 1))


def check_nproc(nproc: int) -> None:
    """``--nproc`` between 1 and what this machine can run (``max_local_workers``)."""
    limit = max_local_workers()
    if not 1 <= nproc <= limit:
        raise BadInput(f"--nproc is the number of local worker processes, from 1 to {limit} on "
                       f"this machine; got {nproc}. Collective counts per rank do not depend "
                       "on the world size, so 2 or 4 ranks check a plan made for more; across "
                       "machines run the worker under torchrun.")


def read_predicted_trace(path: str) -> dict[str, Any]:
    """The planner's ``--trace`` file, read and checked: a JSON object whose ``traceEvents``
    is a list of objects (the Chrome trace format ``fsdp-plan --trace`` writes)."""
    hint = "write it with fsdp-plan MODEL ... --trace FILE.json"
    if not os.path.exists(path):
        raise BadInput(f"--predicted-trace {path!r} does not exist; {hint}.")
    if not os.path.isfile(path):
        raise BadInput(f"--predicted-trace {path!r} is not a file; {hint}.")
    data = read_input_bytes(path, f"--predicted-trace {path!r}", MAX_TRACE_BYTES,
                            limit_text="1 GiB", hint=f"To fix, {hint}.",
                            too_large="a planner trace is a few MB")
    try:
        trace = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError too
        raise BadInput(f"--predicted-trace {path!r} is not a readable JSON trace "
                       f"({' '.join(str(e).split())[:300]}); {hint}.") from e
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise BadInput(f"--predicted-trace {path!r} is JSON but not a Chrome trace (an object "
                       f"with a traceEvents list of event objects); {hint}.")
    return trace


def check_out_folder(path: str) -> None:
    """``--out`` can hold the result: an existing writable folder, or a folder that can be
    created under its nearest existing parent. Nothing is created here."""
    if not path:
        raise BadInput("--out needs a folder path, got an empty string.")
    folder = os.path.abspath(path)
    if os.path.exists(folder):
        if not os.path.isdir(folder):
            raise BadInput(f"--out {path!r} is a file, not a folder: a run writes a result and a "
                           "trace into the folder. Choose a folder path.")
    elif os.path.lexists(folder):
        raise BadInput(f"--out {path!r} is a symbolic link to a path that does not exist; "
                       "create its target or choose another folder.")
    else:
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        if not os.path.isdir(folder):
            raise BadInput(f"--out {path!r} cannot be created: {folder!r} is a file, not a "
                           "folder. Choose a path inside a folder.")
    if not os.access(folder, os.W_OK | os.X_OK):
        what = "cannot be written" if folder == os.path.abspath(path) else (
            f"cannot be created in {folder!r}")
        raise BadInput(f"--out {path!r} {what} (permission denied); choose another folder.")
