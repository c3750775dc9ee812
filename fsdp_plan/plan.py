"""The plan: SPEC section 3 as dataclasses, written to YAML atomically and read back with ``safe_load``.

``Plan.to_dict()`` is exactly the YAML document (and the emitted module's ``PLAN``);
``Plan.from_dict()`` validates a document read from disk before anything uses it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import yaml

from fsdp_plan.errors import BadInput

PLAN_VERSION = 1
Strategy = Literal["full", "hybrid", "grad-op", "none"]
STRATEGIES: tuple[str, ...] = ("full", "hybrid", "grad-op", "none")


@dataclass(kw_only=True)
class Unit:
    """One ``fully_shard`` call: the modules it groups and whether it reshards after forward."""

    modules: list[str]
    """Module FQNs given to one ``fully_shard`` call (``""`` is the root)."""
    reshard_after_forward: bool = True

    @property
    def key(self) -> str:
        """The unit's first module FQN: how prefetch maps name units."""
        return self.modules[0]


@dataclass(kw_only=True)
class Mesh:
    """The device mesh: ``replicate`` groups of ``shard`` ranks (``replicate == 1`` is plain FSDP)."""

    replicate: int = 1
    shard: int = 1

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard


@dataclass(kw_only=True)
class Plan:
    """Everything a training script needs to apply a plan, plus what the planner predicted."""

    model: dict[str, Any]
    budget_bytes: int
    world_size: int
    mesh: Mesh
    units: list[Unit]
    strategy: str = "full"
    headroom_bytes: int = 0
    activation_checkpointing: list[str] = field(default_factory=list)
    forward_prefetch: dict[str, list[str]] = field(default_factory=dict)
    backward_prefetch: dict[str, list[str]] = field(default_factory=dict)
    mixed_precision: dict[str, str | None] = field(default_factory=dict)
    optimizer: str = "adamw"
    gpu: str = "h100"
    predicted: dict[str, Any] = field(default_factory=dict)
    fsdp_plan_version: int = PLAN_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The YAML document, keys in SPEC order first."""
        raw = asdict(self)
        order = ["fsdp_plan_version", "model", "budget_bytes", "headroom_bytes", "world_size",
                 "mesh", "strategy", "units", "activation_checkpointing", "forward_prefetch",
                 "backward_prefetch", "mixed_precision", "optimizer", "gpu", "predicted"]
        return {key: raw[key] for key in order}

    @classmethod
    def from_dict(cls, raw: Any, where: str = "plan") -> Plan:
        """Validate a plan document (from YAML) and build the dataclasses."""
        if not isinstance(raw, dict):
            raise BadInput(f"{where} is not a fsdp-plan plan file (expected a YAML mapping).")
        version = raw.get("fsdp_plan_version")
        if version != PLAN_VERSION:
            raise BadInput(f"{where} has fsdp_plan_version {version!r}; this fsdp-plan reads "
                           f"version {PLAN_VERSION}. Re-run fsdp-plan to write a current plan.")
        missing = [k for k in ("model", "budget_bytes", "world_size", "mesh", "units") if k not in raw]
        if missing:
            raise BadInput(f"{where} lacks the keys {', '.join(missing)}; it is not a complete plan.")
        try:
            units = [Unit(modules=[str(m) for m in u["modules"]],
                          reshard_after_forward=bool(u.get("reshard_after_forward", True)))
                     for u in raw["units"]]
            mesh = Mesh(replicate=int(raw["mesh"].get("replicate", 1)),
                        shard=int(raw["mesh"].get("shard", raw["world_size"])))
            plan = cls(
                model=dict(raw["model"]),
                budget_bytes=int(raw["budget_bytes"]),
                headroom_bytes=int(raw.get("headroom_bytes", 0)),
                world_size=int(raw["world_size"]),
                mesh=mesh,
                strategy=str(raw.get("strategy", "full")),
                units=units,
                activation_checkpointing=[str(m) for m in raw.get("activation_checkpointing") or []],
                forward_prefetch={str(k): [str(x) for x in v]
                                  for k, v in (raw.get("forward_prefetch") or {}).items()},
                backward_prefetch={str(k): [str(x) for x in v]
                                   for k, v in (raw.get("backward_prefetch") or {}).items()},
                mixed_precision=dict(raw.get("mixed_precision") or {}),
                optimizer=str(raw.get("optimizer", "adamw")),
                gpu=str(raw.get("gpu", "h100")),
                predicted=dict(raw.get("predicted") or {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BadInput(f"{where} is malformed ({type(e).__name__}: {e}); re-run fsdp-plan to "
                           "write it again.") from e
        if mesh.world_size != plan.world_size:
            raise BadInput(f"{where}: mesh {mesh.replicate}x{mesh.shard} does not multiply to "
                           f"world_size {plan.world_size}.")
        if plan.strategy not in STRATEGIES:
            raise BadInput(f"{where}: unknown strategy {plan.strategy!r}; expected one of "
                           f"{', '.join(STRATEGIES)}.")
        return plan


def _write_temporary(path: str, text: str) -> str:
    """``text`` in a synced temporary file beside ``path``; returns the temporary's path."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half-written."""
    tmp = _write_temporary(path, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_all(files: list[tuple[str, str]]) -> None:
    """Write every (path, text) through temporaries, renaming only once all are written.

    A failure while writing (disk full, permissions) renames nothing, removes the temporaries,
    leaves existing files as they were, and is reported as ``BadInput``."""
    staged: list[tuple[str, str]] = []
    try:
        for path, text in files:
            staged.append((_write_temporary(path, text), path))
        for tmp, path in staged:
            os.replace(tmp, path)
    except OSError as e:
        raise BadInput(f"writing {e.filename or 'an output file'!r} failed ({e.strerror or e}); "
                       "nothing was written. Free space or choose another path.") from e
    finally:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)


def check_writable(path: str, what: str) -> None:
    """Fail early, before any work, when ``path`` cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        probe = folder
        while probe and not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        if os.path.exists(probe) and not os.path.isdir(probe):
            raise BadInput(f"{what} {path!r}: {probe!r} is a file, not a folder; choose a path "
                           "inside a folder.")
        raise BadInput(f"{what} {path!r}: the folder {folder!r} does not exist; create it or "
                       "choose another path.")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise BadInput(f"{what} {path!r} cannot be written (permission denied); choose another path.")
    if os.path.isdir(path):
        raise BadInput(f"{what} {path!r} is a folder; give a file path.")


def plan_to_yaml(plan: Plan) -> str:
    return yaml.safe_dump(plan.to_dict(), sort_keys=False, default_flow_style=None, width=100)


def write_plan(plan: Plan, path: str) -> None:
    atomic_write_text(path, plan_to_yaml(plan))


def read_plan(path: str) -> Plan:
    """Read a plan file with ``yaml.safe_load`` only, then validate it."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError as e:
        raise BadInput(f"plan file {path!r} does not exist.") from e
    except yaml.constructor.ConstructorError as e:
        raise BadInput(f"plan file {path!r} holds a YAML tag that fsdp-plan never constructs "
                       f"({' '.join(str(e.problem).split())}); a plan is plain data (mappings, "
                       "lists, strings, numbers). Re-run fsdp-plan to write it.") from e
    except (OSError, yaml.YAMLError) as e:
        raise BadInput(f"plan file {path!r} cannot be read as YAML: "
                       f"{' '.join(str(e).split())}.") from e
    return Plan.from_dict(raw, where=f"plan file {path!r}")
