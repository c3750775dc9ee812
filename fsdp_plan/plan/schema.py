"""The plan's top-level fields, declared once (DESIGN section 0), and the walk that reads them.

[Note: one declaration of the plan's fields]
``FIELDS`` lists every top-level key of a plan document in the order the writer puts them
(SPEC 3 order, later fields beside the ones they belong with), each with its checker
(plan/check.py), its default when absent, the plan version that introduced it, and when the
writer leaves it out. Everything else is derived from that one list:

- validation (``check_plan_document``): every field is checked in turn, a field's ``after``
  ones first (``strategy`` reads the mesh and the units);
- refusal of unknown keys, naming the closest known one (issue 31, S4-10: a misspelt
  ``activation_checkpointng:`` was dropped and gave a policy without checkpointing);
- the version rule (``needed_version``): a field from version 2 (or a version-2 form of an
  older one, ``needs``) in a version-1 plan is refused, and the writer records the lowest
  version that holds what it writes, so what planning writes always reads back;
- the document order of ``Plan.to_dict`` and the arguments of ``Plan.from_dict``.

A new field is one ``Field`` here, its checker, and its ``Plan`` attribute
(tests/test_architecture.py holds the three together).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.plan import check as c
from fsdp_plan.plan import sections
from fsdp_plan.plan.checker import Checker, closest, field, show, walk_plain

REQUIRED: Any = object()
"""The default of a field every plan must hold."""

Needs = Callable[[Any], "tuple[str, str] | None"]
"""For a field value as written: ``(problem, remedy)`` when it uses what the field's ``since``
version introduced, else None."""


def _present(default: Any) -> Needs:
    """The usual rule: any value but the default (null included as absent) needs ``since``."""
    def needs(value: Any) -> tuple[str, str] | None:
        return None if value is None or value == default else ("is set in a version-1 plan", "")
    return needs


def _mapping_form(value: Any) -> tuple[str, str] | None:
    return (("is a mapping {FQN: full | selective}", "list the FQNs (full recomputation)")
            if isinstance(value, dict) else None)


def _autocast_form(value: Any) -> tuple[str, str] | None:
    return (("sets autocast_dtype", "remove autocast_dtype to compute in param_dtype")
            if isinstance(value, dict) and value.get("autocast_dtype") is not None else None)


def _compiled_form(value: Any) -> tuple[str, str] | None:
    """``compile: {blocks: false}`` is eager, as in version 1."""
    return (("compiles blocks", "") if isinstance(value, dict) and value.get("blocks") is True
            else None)


@dataclass(frozen=True)
class Field:
    """One top-level key of a plan document."""

    name: str
    check: Callable[[Checker, Any, dict[str, Any]], Any]
    """``(checker, value as written or the default, fields checked so far) -> value kept``:
    plan/check.py's, or a typed section's (plan/sections/)."""
    default: Any = REQUIRED
    since: int = 1
    """The plan version that introduced the field (or the form ``needs`` spots)."""
    needs: Needs | None = None
    """Whether a value needs ``since``; default: any value but ``default``."""
    after: tuple[str, ...] = ()
    """Fields whose checked values the checker reads."""
    optional: bool = False
    """Left out of a written plan when it is its default (or empty)."""
    written_if: Callable[[dict[str, Any]], bool] | None = None
    """Written only when this holds of the document (``gradient_sync`` beside accumulation)."""

    def needed(self, value: Any) -> tuple[str, str] | None:
        if self.since == 1:
            return None
        return (self.needs or _present(self.default))(value)

    def written(self, doc: dict[str, Any]) -> bool:
        if self.written_if is not None:
            return self.written_if(doc)
        value = doc[self.name]
        return not self.optional or not (value == self.default or value in (None, {}, []))


FIELDS: tuple[Field, ...] = (
    Field("fsdp_plan_version", lambda check, value, out: value),  # read first: check_version
    Field("model", sections.check_model),
    Field("budget_bytes", c.check_budget),
    Field("headroom_bytes", c.check_headroom, default=0, after=("budget_bytes",)),
    Field("world_size", sections.check_world_size),
    Field("gpus_per_node", sections.check_gpus_per_node, default=None, optional=True,
          after=("world_size",)),
    Field("mesh", c.check_mesh, after=("world_size",)),
    Field("strategy", c.check_strategy, default=None, after=("mesh", "units")),
    Field("framework", c.check_framework, default=None, since=2, optional=True),
    Field("units", c.check_units),
    Field("ddp", sections.check_ddp, default=None, since=2, optional=True, after=("strategy",)),
    Field("activation_checkpointing", c.check_checkpointing, default=[], since=2,
          needs=_mapping_form),
    Field("selective_ops", c.check_selective_ops, default=[], optional=True,
          after=("activation_checkpointing",)),
    Field("selective_mm_stride", c.check_mm_stride, default=1, since=2, optional=True),
    Field("forward_prefetch", c.check_forward_prefetch, default={}, after=("units",)),
    Field("backward_prefetch", c.check_backward_prefetch, default={},
          after=("units", "forward_prefetch")),
    Field("mixed_precision", sections.check_plan_precision, default={}, since=2,
          needs=_autocast_form),
    Field("optimizer", c.check_optimizer, default="adamw"),
    Field("optimizer_overlap", c.check_optimizer_overlap, default=False, since=2, optional=True,
          after=("strategy", "optimizer", "grad_accum_steps", "offload", "ddp")),
    Field("gpu", c.check_gpu, default="h100", after=("hardware",)),
    Field("hardware", c.check_hardware, default=None, optional=True),
    Field("grad_accum_steps", c.check_accum_steps, default=1, since=2, optional=True),
    Field("gradient_sync", c.check_gradient_sync, default="every",
          written_if=lambda doc: doc["grad_accum_steps"] > 1),
    Field("offload", sections.check_offload, default=None, since=2, optional=True),
    Field("compile", sections.check_compile, default=None, since=2, needs=_compiled_form,
          optional=True),
    Field("predicted", sections.check_predicted, default={}, after=("world_size",)),
)
NAMES = tuple(f.name for f in FIELDS)
_BY_NAME = {f.name: f for f in FIELDS}
PLAN_VERSIONS = (1, 2)


def needed_version(doc: dict[str, Any]) -> int:
    """The lowest plan version that holds ``doc``'s fields as written."""
    return max([1] + [f.since for f in FIELDS if f.name in doc and f.needed(doc[f.name])])


def check_version(raw: dict[str, Any], where: str) -> int:
    version = raw.get("fsdp_plan_version")
    if isinstance(version, bool) or version not in PLAN_VERSIONS:
        if version is None:
            raise BadInput(f"{where} has no fsdp_plan_version key; it is not a fsdp-plan plan "
                           "file. Write one with fsdp-plan MODEL ... --plan PLAN.yaml.")
        raise BadInput(f"{where} has fsdp_plan_version {show(version)}; this fsdp-plan reads "
                       "version 1 and version 2 plans. Re-run fsdp-plan to write a current plan.")
    return version


def check_plan_document(raw: Any, where: str = "plan") -> dict[str, Any]:
    """Validate a plan document; returns the values ``Plan.from_dict`` stores (plain data),
    one per field of ``FIELDS``."""
    check = Checker(where)
    if not isinstance(raw, dict):
        raise BadInput(f"{where} is not a fsdp-plan plan file (expected a YAML mapping of keys "
                       f"such as fsdp_plan_version, model and units, got {show(raw)}).")
    walk_plain(check, raw)
    version = check_version(raw, where)
    missing = [f.name for f in FIELDS if f.default is REQUIRED and f.name not in raw]
    if missing:
        raise BadInput(f"{where} lacks the keys {', '.join(missing)}; it is not a complete plan "
                       "(SPEC 3 lists them). Re-run fsdp-plan --plan to write one.")
    for key in raw:
        if key not in _BY_NAME:
            raise check.fail(field("", key), "is not a key of a fsdp-plan plan",
                             f"{closest(key, NAMES)}fix the spelling, or remove it (a plan "
                             "holds only the keys SPEC sections 3 and 6-8 name)")
    out: dict[str, Any] = {}

    def read(f: Field) -> None:
        if f.name in out:
            return
        for name in f.after:
            read(_BY_NAME[name])
        out[f.name] = f.check(check, raw.get(f.name, f.default), out)

    for f in FIELDS:
        read(f)
    for f in FIELDS:  # the version rule, once every field is known to be well formed
        needed = f.needed(raw.get(f.name)) if version < f.since else None
        if needed:
            problem, remedy = needed
            raise check.fail(f.name, problem, f"{f.name} needs fsdp_plan_version: {f.since}; "
                             f"write that, or {remedy or 'remove ' + f.name}")
    return out
