"""PyTorch warnings that the planner's own passes set off and that say nothing about the
user's training run, kept out of what a command prints (``--debug`` shows them).

[Note: warnings of the planner's passes]
Planning and ``verify`` run the model on fake CPU tensors under PyTorch's trackers, and
``bench`` and DDP's ``verify`` run it on CPU gloo workers. Some of PyTorch's warnings come
from that machinery, not from the model as it trains on GPUs: each is listed below with
where it comes from. A warning not listed is printed as before: it may be the user's.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

ARTEFACTS: tuple[tuple[str, str], ...] = (
    ("The module hierarchy tracking maybe be messed up",
     ("ModTracker (the analysis and FSDPMemTracker) names a module outside the model's tree "
      "by its class; transformers' hub-kernel functions are such modules, one calling "
      "another of its class, and read as a module entered twice")),
    ("Module is None. Skipping (PRE|POST)_BW hook",
     "ModTracker: a module made during the forward was freed before backward reached its hook"),
    ("Mismatch dtype between input and weight",
     ("the CPU's rms_norm picks its kernel: a bfloat16 input with a float32 weight (a norm "
      "kept in float32 under autocast) takes the composite one; memory and plans are alike")),
    ("Torchinductor does not support code generation for complex operators",
     ("--compile traces blocks through Inductor's lowering without generating code; the "
      "rotary embeddings' complex multiply is the usual one")),
)
"""Each warning's message (a regular expression matched at its start) and where it comes from."""


@contextlib.contextmanager
def artefacts_hidden() -> Iterator[None]:
    """Within the block, the warnings of ``ARTEFACTS`` are not shown (the filters before it
    come back at its end)."""
    with warnings.catch_warnings():
        for message, _where in ARTEFACTS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield
