"""Read a plan file as untrusted data, and find the files a plan names.

``read_plan_document`` reads regular files only, refuses files over ``MAX_PLAN_BYTES``
(common/reading.py [Note: reading input files]), then parses with the guarded
loader shared with hardware files (``fsdp_plan.common.safe_yaml``: no tags, no alias bombs or
recursive aliases, at most ``MAX_DEPTH`` deep and ``MAX_NODES`` values, no duplicate keys).
Every refusal is one ``BadInput`` paragraph (exit 2). The fields are
checked afterwards by ``fsdp_plan.plan.check``.
"""

from __future__ import annotations

import os
from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.reading import read_input_bytes
from fsdp_plan.common.safe_yaml import DocumentKind, load_yaml
from fsdp_plan.model.source import model_input_files

MAX_PLAN_BYTES = 16 * 2**20
"""A plan for a 405B model is about 25 kB; a file this large is not a plan and parsing it
would only cost time and memory."""
PLAN_DOCUMENT = DocumentKind(
    text="a plan is a YAML text file", written_by=" written by fsdp-plan --plan",
    plain="a plan is plain data (mappings, lists, strings, numbers)",
    size="a plan is a few thousand values", name="a plan", depth="a plan nests 4 deep")
"""How plan files are bounded and spoken of (``fsdp_plan.common.safe_yaml``)."""


def read_plan_document(path: str) -> Any:
    """The plan file's YAML as plain data; every way a file can fail to be a plan is a ``BadInput``."""
    where = f"plan file {path!r}"
    data = read_input_bytes(path, where, MAX_PLAN_BYTES, limit_text=f"{MAX_PLAN_BYTES // 2**20} MiB",
                            hint="Give the path of a plan file written by fsdp-plan --plan.",
                            too_large="a plan for a 405B model is about 25 kB, so this is not "
                                      "a plan file")
    return parse_plan_text(data, where)


def parse_plan_text(data: bytes, where: str = "plan") -> Any:
    """Decode and parse a plan document held in memory (see ``read_plan_document``)."""
    raw = load_yaml(data, where, PLAN_DOCUMENT)
    if raw is None:
        raise BadInput(f"{where} is empty; write a plan with fsdp-plan --plan.")
    return raw


def resolve_candidates(source: str, plan_path: str | None) -> list[str]:
    """Where a relative model path in a plan is looked for, in order: the plan file's folder
    (the planner records paths from there), then the working folder (plans written before that
    rule, and hand-written ones, name paths from the project root the user runs in).

    Never the folders above either: a plan is data, and searching every ancestor up to ``/``
    would import and run a ``.py`` that anyone planted in a writable ancestor (a shared
    temporary folder) under the name the plan gives (issue 21, S3-01)."""
    if os.path.isabs(source):
        return [source]
    found = []
    if plan_path is not None:
        found.append(os.path.join(os.path.dirname(os.path.abspath(plan_path)), source))
    found.append(os.path.abspath(source))
    return list(dict.fromkeys(os.path.normpath(p) for p in found))


def plan_model_file(model: Any, plan_path: str | None) -> str | None:
    """The existing file the plan's ``model.source`` names (looked up as
    ``resolve_candidates`` does; nothing is imported), or None."""
    source = model.get("source") if isinstance(model, dict) else getattr(model, "source", None)
    if not isinstance(source, str) or not source or "\0" in source:
        return None
    for candidate in resolve_candidates(source, plan_path):
        if os.path.isfile(candidate):
            return candidate
    return None


def plan_input_files(plan: Any, plan_path: str | None, model_path: str | None = None
                     ) -> list[tuple[str, str]]:
    """``(flag, path)`` of every file a verb reads for a plan, for ``files.check_outputs``
    (issue 31, S4-02): the plan file, the model given as MODEL (its module's file for
    ``package.module:attr``), and the model file or config the plan's ``model.source`` names
    where it exists. The plan's model counts even when MODEL overrides it: it is still the
    user's code."""

    files: list[tuple[str, str]] = [("PLAN.yaml", plan_path)] if plan_path else []
    files += model_input_files(model_path, None)
    named = plan_model_file(getattr(plan, "model", None), plan_path)
    if named:
        files.append(("model file the plan names", named))
    return files
