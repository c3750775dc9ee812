"""Property tests (hypothesis): the --mem parser, the argument parser and random module trees.

- ``parse_bytes``: every positive number with every supported unit parses to the exact
  integer (checked with ``fractions``, not the parser's own arithmetic); anything else raises
  ``BadInput``, never another exception.
- The command line: random flag combinations end with exit code 0, 2 or 3, never a Python
  traceback, and write nothing unless the code is 0.
- Random small module trees (nested ``nn.ModuleList``/``nn.ModuleDict``/plain modules around
  ``Linear`` layers of random sizes), written as model files: the planner never crashes, and
  every plan it emits is accepted by ``fully_shard`` and measures within its budget under
  ``FSDPMemTracker`` on the fake process group.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_plan.cli.main import main
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.sizes import MAX_BYTES, parse_bytes

UNITS = {
    "": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
FAST = settings(max_examples=50, deadline=None)


def _spellings(unit: str) -> st.SearchStrategy[str]:
    """``gib`` as written by users: GiB, GIB, gib, Gib."""
    return st.sampled_from(sorted({unit, unit.upper(), unit.capitalize(),
                                   unit[:-1].upper() + unit[-1:] if unit else ""}))


@st.composite
def sizes(draw) -> tuple[str, Fraction, int]:
    """A size as text, its exact value in bytes, and the unit multiplier."""
    unit = draw(st.sampled_from(sorted(UNITS)))
    digits = draw(st.integers(min_value=1, max_value=10**12))
    decimals = draw(st.integers(min_value=0, max_value=6))
    whole, frac = divmod(digits, 10**decimals)
    number = f"{whole}.{frac:0{decimals}d}" if decimals else str(whole)
    if decimals and whole == 0 and draw(st.booleans()):
        number = number[1:]  # ".5GB"
    exponent = draw(st.sampled_from(["", "e0", "e3", "E-2", "e+1"]))
    value = Fraction(digits, 10**decimals) * (Fraction(10) ** int(exponent[1:] or 0))
    space = draw(st.sampled_from(["", " ", "  "]))
    text = f"{number}{exponent}{space}{draw(_spellings(unit))}"
    return text, value * UNITS[unit], UNITS[unit]


@FAST
@given(sizes())
def test_every_positive_size_with_every_unit_parses_exactly(size):
    text, exact, _ = size
    expected = math.floor(exact)
    if 0 < expected <= MAX_BYTES:
        assert parse_bytes(text) == expected, text
    else:
        with pytest.raises(BadInput, match="larger than zero|more than any GPU"):
            parse_bytes(text)


@FAST
@given(sizes(), st.sampled_from(["-", "+", "--", "~"]))
def test_signed_sizes_are_refused(size, sign):
    with pytest.raises(BadInput, match="not a memory size"):
        parse_bytes(sign + size[0])


@FAST
@given(st.integers(min_value=1, max_value=10**6),
       st.sampled_from(["xb", "gbb", "kg", "gigs", "mbit", "pb", "eib", "bytes", "g b"]))
def test_unknown_units_are_refused(number, unit):
    with pytest.raises(BadInput, match="not a memory size"):
        parse_bytes(f"{number}{unit}")


@FAST
@given(st.text(max_size=20))
def test_any_text_parses_or_raises_bad_input(text):
    try:
        value = parse_bytes(text)
    except BadInput as e:
        assert "--mem" in str(e)
    else:
        assert isinstance(value, int) and 0 < value <= MAX_BYTES


# --- the argument parser ------------------------------------------------------------------

TINY_MODEL = """\
import torch
from torch import nn


def build_model(width=32):
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 16))


def example_inputs(batch_size, seq_len):
    return (torch.randn(batch_size, seq_len, 16),)
"""

FLAG_VALUES = {
    "--mem": st.sampled_from(["50kB", "2MB", "1GB", "80GB", "0", "-1GB", "lots", "1e400GB", "3"]),
    "--headroom": st.sampled_from(["0", "1kB", "10MB", "5GB", "x"]),
    "--world-size": st.sampled_from(["1", "2", "8", "12", "16", "0", "-4", "two"]),
    "--gpus-per-node": st.sampled_from(["1", "4", "8", "0", "x"]),
    "--batch-size": st.sampled_from(["1", "2", "0", "-1", "1.5"]),
    "--seq-len": st.sampled_from(["1", "8", "0", "x"]),
    "--strategy": st.sampled_from(["auto", "full", "hybrid", "grad-op", "none", "zero3"]),
    "--param-dtype": st.sampled_from(["bf16", "fp16", "fp32", "fp8", "int4"]),
    "--reduce-dtype": st.sampled_from(["fp32", "bf16", "double"]),
    "--optimizer": st.sampled_from(["adamw", "sgd", "none", "lion"]),
    "--gpu": st.sampled_from(["h100", "a100", "h200", "b200", "tpu9", ""]),
    "--format": st.sampled_from(["table", "json", "xml"]),
    "--top": st.sampled_from(["1", "3", "0", "-2"]),
    "--model-arg": st.sampled_from(["width=8", "width=x", "width", "=3", "depth=2"]),
    "--entry": st.sampled_from(["build_model", "nope"]),
}
SWITCHES = ["--exact-analysis", "--bogus", "--debug"]


@st.composite
def command_lines(draw) -> list[str]:
    flags = draw(st.lists(st.sampled_from(sorted(FLAG_VALUES)), unique=True, max_size=6))
    argv: list[str] = []
    for flag in flags:
        argv += [flag, draw(FLAG_VALUES[flag])]
    if "--mem" not in flags and draw(st.booleans()):
        argv += ["--mem", "1GB"]
    argv += draw(st.lists(st.sampled_from(SWITCHES[:2]), unique=True, max_size=1))
    return draw(st.permutations(argv)) if draw(st.booleans()) else argv


@settings(max_examples=30, deadline=None)
@given(command_lines(), st.booleans())
def test_random_flags_end_in_a_spec_exit_code_without_a_traceback(argv, with_model):
    with tempfile.TemporaryDirectory() as folder:
        model = os.path.join(folder, "tiny.py")
        with open(model, "w") as f:
            f.write(TINY_MODEL)
        out = os.path.join(folder, "out")
        os.mkdir(out)
        full = ([model] if with_model else []) + argv + [
            "--plan", os.path.join(out, "p.yaml"), "-o", os.path.join(out, "p.py")]
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(full)
        assert code in (0, 2, 3), (full, code, err.getvalue())
        if "--debug" not in argv:
            assert "Traceback" not in err.getvalue(), (full, err.getvalue())
        if code != 0:
            assert not os.listdir(out), (full, os.listdir(out))
        else:
            assert sorted(os.listdir(out)) == ["p.py", "p.yaml"]


# --- random module trees ------------------------------------------------------------------

TREE_MODEL = '''\
"""A random module tree for the property tests (generated)."""
import torch
from torch import nn

SPEC = {spec}
DIM = {dim}


class ListChain(nn.ModuleList):
    def forward(self, x):
        for module in self:
            x = module(x)
        return x


class DictChain(nn.ModuleDict):
    def forward(self, x):
        for module in self.values():
            x = module(x)
        return x


class Stack(nn.Module):
    """A plain module iterating an nn.ModuleList it owns, as decoder stacks do."""

    def __init__(self, children):
        super().__init__()
        self.layers = nn.ModuleList(children)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Mlp(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def build(spec):
    kind, body = spec
    if kind == "mlp":
        return Mlp(body)
    if kind == "list":
        return ListChain([build(c) for c in body])
    if kind == "dict":
        return DictChain({{key: build(c) for key, c in body}})
    return Stack([build(c) for c in body])


def build_model():
    return nn.Sequential(build(SPEC), nn.LayerNorm(DIM))


def example_inputs(batch_size, seq_len):
    return (torch.randn(batch_size, seq_len, DIM),)
'''


def trees() -> st.SearchStrategy:
    leaves = st.tuples(st.just("mlp"), st.sampled_from([1, 4, 16, 64, 256, 512]))

    def nest(children):
        keyed = st.lists(st.tuples(st.from_regex(r"k_[a-z0-9]{1,4}", fullmatch=True), children),
                         min_size=1, max_size=3, unique_by=lambda kv: kv[0])
        return st.one_of(
            st.tuples(st.just("list"), st.lists(children, min_size=1, max_size=3)),
            st.tuples(st.just("stack"), st.lists(children, min_size=1, max_size=3)),
            st.tuples(st.just("dict"), keyed),
        )
    return st.recursive(leaves, nest, max_leaves=6)


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees(), st.sampled_from([8, 16, 32]), st.sampled_from(["60kB", "120kB", "200kB", "300kB", "600kB", "2MB"]),
       st.sampled_from([2, 4, 8]))
def test_random_module_trees_plan_and_fit_under_fully_shard(tree, dim, mem, world):
    from fsdp_plan.measure.peak import measured_peak as measure_peak
    from fsdp_plan.measure.runtime import source_from_plan
    from fsdp_plan.model.load import load_model
    from fsdp_plan.plan.document import read_plan
    from fsdp_plan.plan.emit import load_policy_module

    with tempfile.TemporaryDirectory() as folder:
        model = os.path.join(folder, "tree.py")
        with open(model, "w") as f:
            f.write(TREE_MODEL.format(spec=json.dumps(tree), dim=dim))
        plan_path, policy = os.path.join(folder, "p.yaml"), os.path.join(folder, "p.py")
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main([model, "--mem", mem, "--world-size", str(world), "--seq-len", "16",
                         "--batch-size", "2", "--plan", plan_path, "-o", policy])
        assert code in (0, 3), (tree, err.getvalue())
        assert "Traceback" not in err.getvalue()
        if code == 3:
            return  # nothing fits: the message was checked above
        plan = read_plan(plan_path)
        measured = measure_peak(load_model(source_from_plan(plan)), plan, load_policy_module(policy))
        limit = plan.budget_bytes - plan.headroom_bytes
        assert measured.peak_bytes <= limit, (
            tree, [u.modules for u in plan.units], plan.activation_checkpointing,
            measured.peak_bytes, plan.predicted["peak_bytes"], limit)
