"""A plan is data: the model it names to import (``kind: import``) is never imported, save
fsdp-plan's own ``torchtitan:NAME:FLAVOR`` builder with the shorthand's arguments, which
imports only torchtitan's registered models (``source_from_plan`` in plan/model_match.py).
Torch-free: nothing here builds a model."""

from __future__ import annotations

import copy
import os

import pytest
import yaml

from fsdp_plan.common.errors import BadInput
from fsdp_plan.model.source import TORCHTITAN_ENTRY
from fsdp_plan.plan.document import Plan
from fsdp_plan.plan.model_match import source_from_plan

BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "policies", "llama8b_h100x8.yaml")
TORCHTITAN_MODEL = {"source": TORCHTITAN_ENTRY, "entry": "build_model", "kind": "import",
                    "args": {"name": "llama3", "flavor": "8B", "seq_len": 8192}}


def _plan(**model: object) -> Plan:
    """The bundled Llama 8B plan, its model named as ``torchtitan:llama3:8B`` names it,
    changed by ``model``."""
    with open(BUNDLED, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    raw["model"].update(copy.deepcopy(TORCHTITAN_MODEL), **model)
    return Plan.from_dict(raw)


def test_the_plan_of_a_torchtitan_shorthand_rebuilds_without_a_model_argument():
    source = source_from_plan(_plan())
    assert (source.source, source.kind) == (TORCHTITAN_ENTRY, "import")
    assert source.args == {"name": "llama3", "flavor": "8B", "seq_len": 8192}


@pytest.mark.parametrize("model", [
    {"source": "os:system"},  # any other module
    {"source": "fsdp_plan.model.torchtitan_models:_registry"},  # another function of ours
    {"entry": "swap_flex_attention"},
    {"args": {"name": "llama3", "flavor": "8B", "extra": "x"}},  # not the shorthand's
    {"args": {"name": ["llama3"], "flavor": "8B"}},
    {"args": {"name": "llama3", "flavor": "8B", "seq_len": "8192"}},
])
def test_any_other_module_to_import_is_refused(model):
    with pytest.raises(BadInput, match="does not import what a plan file names"):
        source_from_plan(_plan(**model))
