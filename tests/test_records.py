"""``with_fields`` is ``dataclasses.replace`` for the search's records (common/records.py)."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp_plan.common.records import with_fields
from fsdp_plan.cost.step_time import UnitCost
from fsdp_plan.search.candidate import Layout


def test_copies_as_replace_does():
    layout = Layout(strategy="hybrid", mesh=(2, 4), groups=(("a",), ("b",)),
                    reshard=(True, False), full=frozenset({0}), forward_prefetch=1)
    for changes in ({}, {"full": frozenset(), "selective": frozenset({1})},
                    {"forward_prefetch": 0, "backward_prefetch": 2, "optimizer_overlap": True}):
        want, got = dataclasses.replace(layout, **changes), with_fields(layout, **changes)
        assert got == want and hash(got) == hash(want) and repr(got) == repr(want)
        assert list(vars(got).items()) == list(vars(want).items())
        assert got is not layout
    cost = UnitCost(key="k", fw_compute_s=1.0, bw_compute_s=2.0, all_gather_s=0.5,
                    reduce_scatter_s=0.25)
    assert with_fields(cost, bw_compute_s=3.0) == dataclasses.replace(cost, bw_compute_s=3.0)
    assert cost.bw_compute_s == 2.0  # the original is left as it was
    with pytest.raises(dataclasses.FrozenInstanceError):
        with_fields(cost).key = "other"  # type: ignore[misc]


def test_refuses_what_replace_refuses():
    layout = Layout(strategy="full", mesh=(1, 8))
    with pytest.raises(TypeError, match="no field 'fulll'"):
        with_fields(layout, fulll=frozenset())


@dataclasses.dataclass(frozen=True)
class _Checked:
    n: int
    doubled: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "doubled", 2 * self.n)


@dataclasses.dataclass(slots=True)
class _Slotted:
    n: int


@dataclasses.dataclass
class _OnSlots(_Slotted):
    m: int = 0


def test_other_dataclasses_go_through_replace():
    # __post_init__ (and a field outside __init__) must run again; slots are not in __dict__
    assert with_fields(_Checked(2), n=5).doubled == 10
    assert with_fields(_Slotted(1), n=3) == _Slotted(3)
    assert with_fields(_OnSlots(1, 2), m=4) == _OnSlots(1, 4)
