"""The hardware a plan keeps: the figures it was predicted with, and where they came from.

[Note: plans keep their hardware]
A plan made with ``--hardware HW.yaml`` (SPEC 7) stores, under its top-level ``hardware:``
key, every figure of the hardware it was predicted with (the preset with the file over it,
tables rescaled as derived.py says) and where they came from::

    hardware:
      file: hw.yaml             # the file's name as given (its folder is not kept)
      sha256: 3f2a...           # of the file's bytes, to tell whether a file is that one
      header: Hardware file written by fsdp-plan calibrate ...   # its leading comments
      figures: {name: calibrated-cpu, peak_flops: 1.1e11, ...}   # every Hardware field

so ``predict``, ``verify``, ``bench --refit`` and ``tune`` time the plan as it was planned
with no flag, and a moved or deleted file does not matter (issue 19, item 5). ``--hardware``
on those verbs still overrides: the preset (``--gpu`` or the plan's ``gpu``) with that file
over it, exactly as when planning; ``--gpu`` alone asks for the preset as it is. A plan made
from a preset records only its ``gpu`` name, as before, so plans of the bundled GPUs (and the
policies under ``policies/``) are unchanged. The block is checked with the plan (plan_check.py)
by the same reader and bounds as a hardware file; ``figures`` are complete when fsdp-plan
writes them, and a hand-trimmed block reads as a hardware file over the preset it names.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import os
import re
from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.cost.hardware.hardware import GPUS, MAX_HARDWARE_FILE_BYTES, Hardware, hardware_for

STORED_KEYS = ("file", "sha256", "header", "figures")
MAX_HEADER_CHARS = 4096


def file_origin(path: str) -> dict[str, str]:
    """Where a hardware file's figures came from: its name, digest and leading comments
    (only its name if it can no longer be read: it was read a moment ago)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_HARDWARE_FILE_BYTES + 1)
    except OSError:
        return {"file": os.path.basename(path)}
    header = []
    for line in data.decode("utf-8-sig", errors="replace").splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:].removeprefix(" ").rstrip())
    out = {"file": os.path.basename(path), "sha256": hashlib.sha256(data).hexdigest()}
    text = " ".join(" ".join(header).split())  # one line of prose: YAML keeps it plain
    if text:
        out["header"] = text[:MAX_HEADER_CHARS]
    return out


def stored_block(hw: Hardware, origin: dict[str, str] | None) -> dict[str, Any] | None:
    """The plan's ``hardware`` mapping for ``hw``; None when ``hw`` is a bundled preset as it
    is (the plan's ``gpu`` name says it all)."""
    if GPUS.get(hw.name) == hw:
        return None
    return {**(origin or {}), "figures": hw.to_dict()}


def check_stored_block(value: Any, where: str) -> dict[str, Any]:
    """Validate a plan's ``hardware`` mapping: its provenance as text, its ``figures`` with
    the bounds of a hardware file (``hardware_for``). Returns a copy of it as written."""
    here = f"{where}: hardware"
    example = "hardware: {file: hw.yaml, figures: {name: ..., peak_flops: ...}}"
    if not isinstance(value, dict):
        raise BadInput(f"{here} must be a mapping ({example}); remove it to time the plan on its "
                       "gpu preset.")
    unknown = [str(k)[:40] for k in value if k not in STORED_KEYS]
    if unknown:
        near = difflib.get_close_matches(unknown[0], STORED_KEYS, n=1, cutoff=0.6)
        raise BadInput(f"{here}.{unknown[0]} is not a key fsdp-plan knows here; "
                       + (f"did you mean {near[0]}? " if near else "")
                       + f"hardware takes only {', '.join(STORED_KEYS)}.")
    for key, limit in (("file", 4096), ("header", MAX_HEADER_CHARS)):
        text = value.get(key)
        if text is not None and (not isinstance(text, str) or len(text) > limit
                                 or "\0" in text):
            raise BadInput(f"{here}.{key} must be text of at most {limit} characters; it says "
                           "where the figures came from.")
    digest = value.get("sha256")
    if digest is not None and (not isinstance(digest, str)
                               or not re.fullmatch(r"[0-9a-f]{64}", digest)):
        raise BadInput(f"{here}.sha256 must be 64 lowercase hex digits (the file's SHA-256).")
    if "figures" not in value:
        raise BadInput(f"{here} has no figures; write them as a hardware file's fields "
                       f"({example}), or remove hardware to time the plan on its gpu preset.")
    hardware_of(value, where)
    return copy.deepcopy(value)


def hardware_of(block: dict[str, Any], where: str = "plan") -> Hardware:
    """The ``Hardware`` a plan's ``hardware`` mapping describes (checked as a hardware file
    over the preset its ``figures.name`` names, h100 for a calibrated machine's name)."""
    figures = block.get("figures")
    if not isinstance(figures, dict):
        raise BadInput(f"{where}: hardware.figures must be a mapping of a hardware file's "
                       "fields (name, peak_flops, ...).")
    name = figures.get("name")
    return hardware_for(name if isinstance(name, str) else "h100", figures,
                        where=f"{where}: hardware.figures")
