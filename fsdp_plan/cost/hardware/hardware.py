"""The machine the step-time model runs on: ``Hardware``, the bundled presets, hardware files.

[Note: hardware files]
A hardware file (SPEC section 6) is YAML, read with the plan file's guards (safe_yaml.py):
``field: value`` lines for the fields of ``Hardware``. ``fsdp-plan calibrate`` writes one from
micro-benchmarks on the machine it runs on; ``bench --refit`` corrects one from a measured run;
anyone may write one by hand. The presets (``h100.yaml``, ``h200.yaml``, ``a100.yaml``,
``b200.yaml`` beside this file) are hardware files too, each figure with its source in a
comment. ``--hardware`` files override the fields of the ``--gpu`` preset (the plan's GPU for
``predict``), so a file may hold a single field; a base figure it sets reaches the preset's
tables fitted at that figure (derived.py [Note: base figures and derived tables]: they are
rescaled unless the file sets them too). A file written before the per-op fields existed still
reads that way.

Per-op fields (all optional):
- ``matmul_flops``: ``{dtype: {small, medium, large}}`` achieved FLOP/s of matrix multiplies
  by shape class (the smallest of M, N, K: < 128, < 1024, larger; facts/types.py [Note: op classes]);
- ``attention_flops``: ``{dtype: FLOP/s}`` of scaled-dot-product attention (forward and
  backward together);
- ``memory_bandwidth``: bytes/s that memory-bound ops (norms, activations, adds, copies) reach;
- ``op_overhead_s``: host time to dispatch (and launch) one op; ``async_launch`` says whether
  the host runs ahead of the device (GPUs: a unit's ops cost max(work, overhead), and the host
  issues them on its own timeline, which the device never runs ahead of: [Note: the host
  floor] in cost/streams.py) or not (CPU: work + overhead, in line);
- ``collectives``: ``{all_gather|reduce_scatter|all_reduce: {GROUP: {latency_s,
  bus_bandwidth}}}``, a fit of ``latency + factor * (g - 1) / g * bytes / bus_bandwidth`` per
  group size (``factor`` 2 for all-reduce), within a node;
- ``optimizer_s_per_param``: ``{adamw|sgd: seconds}`` per parameter of the rank's shard, and
  ``optimizer_s_per_tensor`` per parameter tensor (dispatch through FSDP2's DTensors);
- ``unit_overhead_s``: host time FSDP spends per unit per pass (hooks, copy-in/copy-out issue,
  stream waits): on a GPU on the host's timeline (it costs the step only where the host falls
  behind the device), on a CPU in line;
- ``param_overhead_s``: host time FSDP spends per parameter tensor of a unit per pass (its
  unsharded view, its gradient's copy and sharded DTensor), the same way;
- ``checkpoint_overhead_s``: host time activation checkpointing spends per checkpointed block
  and step (the wrapper, its saved-tensor hooks, RNG stashing, the recompute's setup) beyond
  the ops its forward replays, the same way;
- ``fsdp_s_per_byte``: ``{all_gather|reduce_scatter: {UNIT_BYTES: seconds per byte}}``, what
  FSDP2 spends per byte of a unit's gathered parameters around its all-gather (copy-in,
  copy-out, allocation) and per byte of its unsharded gradients around its reduce-scatter
  (copy-in, division, copy into the sharded gradient), measured at a few unit sizes (a CPU's
  allocator hands large buffers out as fresh pages, so large units cost more per byte) and
  interpolated between them; absent, two passes over the bytes at ``memory_bandwidth``;
- ``comm_overlaps_compute``: false where a collective holds the thread that computes (gloo);
- ``h2d_bandwidth``: host-to-device copy bytes/s (offload); 0 where there is no device (not
  measured: offload is then refused, never priced);
- ``source``: free text saying where the figures come from.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.limits import MAX_BYTES, MAX_WORLD_SIZE
from fsdp_plan.common.reading import read_input_bytes
from fsdp_plan.common.safe_yaml import DocumentKind, clip, load_yaml
from fsdp_plan.cost.hardware.derived import base_figures_of, follow_base_figures
from fsdp_plan.cost.precision import OPTIMIZERS

MM_CLASSES = ("small", "medium", "large")
DTYPES = ("float32", "bfloat16", "float16")
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
MAX_HARDWARE_FILE_BYTES = 1 << 20
HARDWARE_DOCUMENT = DocumentKind(
    text="a hardware file is YAML text", written_by=" such as peak_flops: 989e12",
    plain="a hardware file is plain field: value lines (numbers, text, true or false)",
    size="a hardware file is a few dozen values", name="a hardware file",
    depth="a hardware file nests 4 deep (collectives: kind: group: figure)",
    max_nodes=10_000, max_depth=16)
"""Hardware files get the plan file's guards (``fsdp_plan.common.safe_yaml``; issue 21, S3-07):
a calibrated file holds about 60 values, 4 deep."""


@dataclass(kw_only=True, frozen=True)
class Hardware:
    """One GPU (or CPU) kind and its links; every field can be set from a hardware file."""

    name: str
    peak_flops: float
    """Dense bf16 FLOP/s (datasheet)."""
    efficiency: float = 0.5
    """Share of peak a real training step reaches: the rate of facts without op counters; a
    file that changes it rescales the preset's per-op rates (derived.py)."""
    hbm_bandwidth: float = 3.3e12
    intra_node_bandwidth: float = 360e9
    """Achieved bus bandwidth of collectives inside a node, bytes/s per GPU."""
    inter_node_bandwidth: float = 40e9
    """One GPU's achieved share of its node's network, bytes/s (400 Gb/s InfiniBand per GPU:
    ~40 GB/s). A group with k ranks per node crosses nodes at k times this, capped by the
    intra-node bandwidth ([Note: bandwidth across nodes] in cost/step_time.py)."""
    collective_latency_s: float = 20e-6
    launch_overhead_s: float = 10e-6
    """Host cost of issuing one collective."""
    contention: float = 0.10
    """Fractional slowdown of compute while a collective overlaps it."""
    matmul_flops: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    attention_flops: Mapping[str, float] = field(default_factory=dict)
    memory_bandwidth: float = 0.0
    op_overhead_s: float = 0.0
    async_launch: bool = True
    comm_overlaps_compute: bool = True
    """Whether compute runs while a collective is in flight (NCCL on its own stream); gloo on
    a CPU runs a collective on the thread that issued it, which computes nothing meanwhile."""
    h2d_bandwidth: float = 50e9
    """Host-to-device copy bytes/s (offload); 0 means not measured (calibrate on a CPU), and
    offload is then refused rather than priced (offload.py ``pcie_bandwidth``)."""
    collectives: Mapping[str, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)
    optimizer_s_per_param: Mapping[str, float] = field(default_factory=dict)
    optimizer_s_per_tensor: Mapping[str, float] = field(default_factory=dict)
    """Seconds per parameter tensor of an optimizer step (FSDP2's DTensor dispatch per op)."""
    unit_overhead_s: float = 0.0
    param_overhead_s: float = 0.0
    checkpoint_overhead_s: float = 0.0
    fsdp_s_per_byte: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """FSDP2's own seconds per byte around a unit's all-gather and reduce-scatter, by unit
    bytes (empty: two passes at ``memory_bandwidth``)."""
    source: str = ""

    @functools.cached_property
    def collective_groups(self) -> dict[str, list[int]]:
        """Each collective kind's measured group sizes (``collectives``' keys), ascending:
        the time model picks a curve per collective (cost/step_time.py ``_fit``), thousands
        per DDP evaluation."""
        return {kind: sorted(int(g) for g in fits)
                for kind, fits in self.collectives.items() if fits}

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain YAML-able data (what ``write_hardware_file`` writes)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = _plain(value)
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


# field -> (lowest, highest, what 0 means or None, unit, example): what a hardware file may
# set. Every figure is bounded at reading (issue 21, S3-06): the highest are several times
# today's largest GPU; the lowest are far below any machine (1 MFLOP/s, 1 MB/s, a
# femtosecond) and keep a step time finite: a rate of 5e-324 divided by zero, peak_flops
# 1e-300 wrote a plan with mfu .inf. 0 is accepted only where it means something (no
# latency, no contention; memory_bandwidth 0 is derived from hbm_bandwidth).
_RANGES: dict[str, tuple[float, float, str | None, str, str]] = {
    "peak_flops": (1e6, 1e18, None, "FLOP/s (dense bf16)", "989e12"),
    "efficiency": (1e-3, 1.0, None, "(share of peak, a fraction)", "0.5"),
    "hbm_bandwidth": (1e6, 1e15, None, "bytes/s", "3.35e12"),
    "intra_node_bandwidth": (1e6, 1e15, None, "bytes/s per GPU", "360e9"),
    "inter_node_bandwidth": (1e6, 1e15, None, "bytes/s per GPU (its NIC share)", "40e9"),
    "collective_latency_s": (1e-15, 10.0, "none", "seconds", "20e-6"),
    "launch_overhead_s": (1e-15, 10.0, "none", "seconds", "10e-6"),
    "contention": (1e-12, 10.0, "none", "(fractional compute slowdown)", "0.1"),
    "memory_bandwidth": (1e6, 1e15, "0.8 x hbm_bandwidth", "bytes/s", "2.8e12"),
    "op_overhead_s": (1e-15, 1.0, "none", "seconds per op", "5e-6"),
    "h2d_bandwidth": (1e6, 1e15, "not measured", "bytes/s", "50e9"),
    "unit_overhead_s": (1e-15, 10.0, "none", "seconds per FSDP unit and pass", "100e-6"),
    "param_overhead_s": (1e-15, 1.0, "none", "seconds per FSDP parameter tensor and pass",
                         "20e-6"),
    "checkpoint_overhead_s": (1e-15, 10.0, "none", "seconds per checkpointed block and step",
                              "500e-6"),
    "fsdp_s_per_byte": (1e-18, 1e-6, "free", "seconds per byte",
                        "{all_gather: {134217728: 1e-12}}"),
    # nested values, checked with these bounds
    "matmul_flops": (1e6, 1e18, None, "FLOP/s", "{bfloat16: {large: 7e14}}"),
    "attention_flops": (1e6, 1e18, None, "FLOP/s", "{bfloat16: 4e14}"),
    "latency_s": (1e-15, 10.0, "none", "seconds", "20e-6"),
    "bus_bandwidth": (1e6, 1e15, None, "bytes/s", "360e9"),
    "optimizer_s_per_param": (1e-18, 1.0, "free", "seconds per parameter", "{adamw: 2e-12}"),
}
_NESTED = {"matmul_flops", "attention_flops", "collectives", "fsdp_s_per_byte",
           "optimizer_s_per_param",
           "optimizer_s_per_tensor"}


def _show(value: object) -> str:
    """A value read from a file, for a message (never a 4,000-digit repr)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"a {value.bit_length()}-bit number"
    return clip(repr(value))


def _number(key: str, value: object, where: str, label: str | None = None) -> float:
    """One numeric field, checked against ``_RANGES[key]``; ``label`` names it in messages."""
    low, high, zero, unit, example = _RANGES[key]
    label = label or key
    expected = (f"a number from {low:g} to {high:g} {unit}"
                + (f", or 0 ({zero})" if zero else "") + f", e.g. {key}: {example}")
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any float: out of range, not a crash
            number = math.inf
    elif isinstance(value, str):
        try:  # YAML 1.1 reads 989e12 (no dot) as a string
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None:
        raise BadInput(f"{where}: {label} is {_show(value)} ({type(value).__name__}); expected "
                       f"{expected}.")
    if not (low <= number <= high or (number == 0 and zero)):
        raise BadInput(f"{where}: {label} {_show(value)} is out of range; expected {expected}.")
    return number


_DIGITS = re.compile(r"[0-9]{1,30}")
"""A whole number as a key (``collectives`` group sizes, ``fsdp_s_per_byte`` unit sizes):
ASCII digits only; ``str.isdigit`` also takes "²" and other Unicode digits that ``int``
refuses (issue 21, S3-08)."""


def _whole_key(key: object, low: int, high: int) -> int | None:
    """``key`` as a whole number in ``low..high``, else None."""
    if isinstance(key, bool) or not _DIGITS.fullmatch(str(key)):
        return None
    number = int(str(key))
    return number if low <= number <= high else None


def _mapping(value: object, label: str, where: str, example: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise BadInput(f"{where}: {label} is {_show(value)} ({type(value).__name__}); expected "
                       f"a mapping, e.g. {example}.")
    return value


def _keys(value: Mapping[str, Any], allowed: tuple[str, ...], label: str, where: str) -> None:
    unknown = sorted(clip(str(k)) for k in value if k not in allowed)
    if unknown:
        raise BadInput(f"{where}: {label} has unknown keys {', '.join(unknown[:5])}; known: "
                       f"{', '.join(allowed)}.")


def _nested(key: str, value: object, where: str) -> dict[str, Any]:
    """``matmul_flops``, ``attention_flops``, ``collectives``, ``optimizer_s_per_param``."""
    if key == "matmul_flops":
        per_dtype = _mapping(value, key, where, "matmul_flops: {bfloat16: {large: 7e14}}")
        _keys(per_dtype, DTYPES, key, where)
        out: dict[str, Any] = {}
        for dtype, classes in per_dtype.items():
            classes = _mapping(classes, f"{key}.{dtype}", where, "{small: 1e14, large: 7e14}")
            _keys(classes, MM_CLASSES, f"{key}.{dtype}", where)
            out[dtype] = {c: _number(key, v, where, f"{key}.{dtype}.{c}")
                          for c, v in classes.items()}
        return out
    if key == "attention_flops":
        per_dtype = _mapping(value, key, where, "attention_flops: {bfloat16: 4e14}")
        _keys(per_dtype, DTYPES, key, where)
        return {d: _number(key, v, where, f"{key}.{d}") for d, v in per_dtype.items()}
    if key == "fsdp_s_per_byte":
        kinds = _mapping(value, key, where, "fsdp_s_per_byte: {all_gather: {134217728: 1e-12}}")
        _keys(kinds, ("all_gather", "reduce_scatter"), key, where)
        table: dict[str, Any] = {}
        for kind, sizes in kinds.items():
            sizes = _mapping(sizes, f"{key}.{kind}", where, "{134217728: 1e-12}")
            for size in sizes:
                if _whole_key(size, 1, MAX_BYTES) is None:
                    raise BadInput(f"{where}: {key}.{kind}: the unit size {_show(size)} must be "
                                   "a whole number of bytes (digits 0-9), at least 1 and at "
                                   "most 2**60.")
            table[kind] = {str(int(size)): _number(key, v, where, f"{key}.{kind}.{size}")
                           for size, v in sizes.items()}
        return table
    if key in ("optimizer_s_per_param", "optimizer_s_per_tensor"):
        per_opt = _mapping(value, key, where, f"{key}: {{adamw: 2e-12}}")
        _keys(per_opt, tuple(o for o in OPTIMIZERS if o != "none"), key, where)
        return {o: _number("optimizer_s_per_param", v, where, f"{key}.{o}")
                for o, v in per_opt.items()}
    kinds = _mapping(value, key, where,
                     "collectives: {all_gather: {8: {latency_s: 2e-5, bus_bandwidth: 3.6e11}}}")
    _keys(kinds, COLLECTIVE_KINDS, key, where)
    out = {}
    for kind, groups in kinds.items():
        groups = _mapping(groups, f"{key}.{kind}", where, "{8: {latency_s: 2e-5, ...}}")
        fitted: dict[str, Any] = {}
        for group, fit in groups.items():
            label = f"{key}.{kind}.{clip(str(group))}"
            if _whole_key(group, 2, MAX_WORLD_SIZE) is None:
                raise BadInput(f"{where}: {label}: the group size {_show(group)} must be a "
                               "whole number of ranks (digits 0-9), at least 2 and at most "
                               f"{MAX_WORLD_SIZE:,}.")
            fit = _mapping(fit, label, where, "{latency_s: 2e-5, bus_bandwidth: 3.6e11}")
            _keys(fit, ("latency_s", "bus_bandwidth"), label, where)
            if "bus_bandwidth" not in fit:
                raise BadInput(f"{where}: {label} lacks bus_bandwidth (bytes/s).")
            fitted[str(int(group))] = {k: _number(k, v, where, f"{label}.{k}")
                                       for k, v in fit.items()}
        out[kind] = fitted
    return out


MAX_NAME_CHARS = 200
MAX_SOURCE_CHARS = 16384


def _text(key: str, value: object, where: str) -> str:
    """``name`` (one printable line: plans record it as their ``gpu``) or ``source`` (free
    text that grows a clause with every refit)."""
    if key == "name":
        if (not isinstance(value, str) or not value.strip() or len(value) > MAX_NAME_CHARS
                or not value.isprintable()):
            raise BadInput(f"{where}: name is {_show(value)}; expected a GPU name as text (one "
                           f"printable line of at most {MAX_NAME_CHARS} characters).")
        return value
    if not isinstance(value, str) or len(value) > MAX_SOURCE_CHARS or "\0" in value:
        raise BadInput(f"{where}: source is {_show(value)}; expected text (at most "
                       f"{MAX_SOURCE_CHARS:,} characters) saying where the figures come from.")
    return value


def _preset_text(name: str) -> str:
    return resources.files(__package__).joinpath(f"{name}.yaml").read_text(encoding="utf-8")


def _load_presets() -> dict[str, Hardware]:
    base = Hardware(name="base", peak_flops=989e12)
    out = {}
    for name in ("h100", "h200", "a100", "b200"):
        where = f"preset {name}.yaml"
        raw = load_yaml(_preset_text(name).encode("utf-8"), where, HARDWARE_DOCUMENT)
        out[name] = _apply(base, raw, where)
    return out


def _apply(hw: Hardware, overrides: object, where: str) -> Hardware:
    if not isinstance(overrides, dict):
        raise BadInput(f"{where} must hold a mapping of field: value (e.g. peak_flops: 989e12), "
                       f"got {type(overrides).__name__}.")
    values = {f.name: getattr(hw, f.name) for f in fields(hw)}
    unknown = sorted(clip(str(k)) for k in overrides if k not in values)
    if unknown:
        near = difflib.get_close_matches(unknown[0], list(values), n=1, cutoff=0.6)
        raise BadInput(f"{where} sets unknown fields {', '.join(unknown[:5])}; "
                       + (f"did you mean {near[0]}? " if near else "")
                       + f"known fields: {', '.join(sorted(values))}.")
    for key, value in overrides.items():
        if key in ("name", "source"):
            values[key] = _text(key, value, where)
        elif key in ("async_launch", "comm_overlaps_compute"):
            if not isinstance(value, bool):
                raise BadInput(f"{where}: {key} is {_show(value)}; expected true (GPUs: the host "
                               "launches ahead, NCCL runs on its own stream) or false (CPU).")
            values[key] = value
        elif key in _NESTED:
            values[key] = _nested(key, value, where)
        else:
            values[key] = _number(key, value, where)
    rescaled = follow_base_figures({f.name: getattr(hw, f.name) for f in fields(hw)}, values,
                                   set(overrides))
    _check_rescaled(rescaled, values, overrides, where)
    if rescaled and "source" not in overrides:  # [Note: base figures and derived tables]
        values["source"] = (f"{hw.source or hw.name}; {where} sets "
                            f"{', '.join(sorted(k for k in overrides if k != 'name'))}, and the "
                            f"tables it leaves out follow: {', '.join(rescaled)}"
                            )[:MAX_SOURCE_CHARS]
    return Hardware(**values)


def _check_rescaled(rescaled: list[str], values: dict[str, Any], overrides: dict[str, Any],
                    where: str) -> None:
    """Refuse a file whose base figures rescale a table it leaves out beyond the bounds a
    hardware file may hold (issue 31, S4-05): ``op_overhead_s: 0.5`` made the h100's
    ``param_overhead_s`` 2 s and ``peak_flops: 1e6`` its matmul rates 7e5 FLOP/s, the plan
    written with them stored those figures, and every verb then refused the plan."""
    for phrase in rescaled:
        table = phrase.split(" ")[0].split(".")[0]
        try:
            if table in _NESTED:
                _nested(table, values[table], where)
            else:
                _number(table, values[table], where)
        except BadInput as error:
            given = sorted(k for k in overrides if k in base_figures_of(table))
            detail = str(error).removeprefix(f"{where}: ").rstrip(".")
            raise BadInput(
                f"{where} sets {', '.join(given)}, which rescales the preset's {table} (a table "
                f"fitted at the preset's figures follows them) to a figure no hardware file may "
                f"hold: {detail}. Set {table} in the file as well, or give "
                f"{' and '.join(given)} nearer the preset's.") from error


GPUS: dict[str, Hardware] = _load_presets()
"""The bundled presets, read from the hardware files beside this module."""


def hardware_for(name: str, overrides: dict[str, object] | None = None,
                 where: str = "hardware file") -> Hardware:
    """The preset ``name`` with any field replaced from ``overrides`` (a hardware file's mapping).

    Every override is checked: a known field, a finite number in its range (units in
    ``_RANGES``), nested per-op figures key by key; ``name`` is text. A name that is no preset
    (a calibrated machine's, recorded in its plans) is accepted with ``overrides``, which then
    start from the h100 preset's fields."""
    key = str(name).lower()
    if key not in GPUS and overrides is None:
        raise BadInput(f"unknown --gpu {name!r}; choose one of {', '.join(GPUS)}, or describe "
                       "the GPU in a hardware YAML file with --hardware.")
    hw = GPUS.get(key, GPUS["h100"])
    if overrides is None:
        return hw
    return _apply(hw, overrides, where)


def read_hardware_file(path: str, flag: str = "--hardware") -> dict[str, object]:
    """The mapping in a hardware YAML file, read as untrusted data (size, encoding, tags,
    aliases, depth and duplicate keys are checked before anything is built); its fields are
    checked by ``hardware_for``. ``flag`` names the file in messages."""
    where = f"{flag} {path!r}"
    data = read_input_bytes(path, where, MAX_HARDWARE_FILE_BYTES,
                            hint="Give the path of a YAML file such as one fsdp-plan calibrate "
                                 "writes.",
                            too_large="a hardware file is a few lines of field: value")
    raw = load_yaml(data, where, HARDWARE_DOCUMENT)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadInput(f"{where} must hold a mapping of field: value (e.g. peak_flops: 989e12), "
                       f"got {type(raw).__name__}.")
    return raw


def hardware_yaml(hw: Hardware, header: str = "") -> str:
    """A hardware file for ``hw``: ``header`` lines as comments, then every field."""
    import yaml
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comments + yaml.safe_dump(hw.to_dict(), sort_keys=False, width=100)
