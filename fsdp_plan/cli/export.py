"""Write a training framework's files for a plan: its config, any code hook, and a README.

    fsdp-plan export PLAN.yaml [MODEL] [--to accelerate|trainer|lightning|torchtitan] -o DIR
                     [--torchtitan-config MODULE:FUNCTION]

``--to`` defaults to the framework a plan was made for (``fsdp-plan --framework NAME``).

DIR gets the framework's own configuration (accelerate config YAML; Trainer ``fsdp_config``
JSON and ``TrainingArguments`` fields; Lightning Trainer arguments; a torchtitan config
module), the plan's policy module, the shortest code hook that keeps what the configuration
cannot say (only when there is something), and ``README.md``: how to launch and what, if
anything, is lost. The plan is read against the model's outline (its module tree and block
classes): kept on disk when the model was planned or exported before (no torch imported), else
from the model built on ``meta`` (no weights, no framework imported) and kept. Exit 2 for an
invalid plan or model, for ``--torchtitan-config`` with another ``--to``, and for a folder
where a file the export may write is an input (the plan, the model it names or MODEL, through
links too) — checked before the model is loaded; nothing is written unless all is.
"""

from __future__ import annotations

import argparse
import os

from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.files import atomic_write_all, check_outputs, check_writable
from fsdp_plan.export.common import (
    FRAMEWORKS,
    check_exportable,
    export_plan,
    file_names,
    framework_module,
    plain_text,
    plan_shape,
)
from fsdp_plan.facts.cache import FactsCache
from fsdp_plan.facts.types import ModelOutline
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.document import read_plan
from fsdp_plan.plan.emit import render_policy_module
from fsdp_plan.plan.model_match import check_outline_matches, source_from_plan
from fsdp_plan.plan.read import plan_input_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.yaml", help="a plan file (SPEC section 3)")
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None,
                        help="the model file (default: the source recorded in the plan)")
    parser.add_argument("--to", default=None, choices=FRAMEWORKS, dest="framework",
                        help="the framework to write files for (default: the plan's "
                        "framework, when it was made with --framework)")
    parser.add_argument("-o", "--output", required=True, metavar="DIR",
                        help="the folder to write into (created if missing)")
    parser.add_argument("--torchtitan-config", default=None, metavar="MODULE:FUNCTION",
                        help="--to torchtitan: the torchtitan config of the model the plan is "
                        "for, e.g. torchtitan.models.llama3.config_registry:llama3_8b")


def _check_folder(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"-o {path!r} is a file; give a folder to write the export into.")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise BadInput(f"-o {path!r}: the folder {parent!r} does not exist; create it or choose "
                       "another path.")


def run(args: argparse.Namespace) -> int:
    _check_folder(args.output)
    plan = read_plan(args.plan)
    if args.framework is None:  # a plan made with --framework names its framework
        if plan.framework is None:
            raise BadInput(f"give --to {'|'.join(FRAMEWORKS)}: the plan {args.plan!r} was not "
                           "made for a framework (fsdp-plan --framework NAME records one).")
        args.framework = plan.framework
    file_names(args.framework)  # a known framework, before the plan is judged for it
    check_exportable(plan, args.framework)
    if args.framework == "torchtitan":  # torchtitan's own model names its config itself
        torchtitan = framework_module("torchtitan")
        if args.torchtitan_config is not None or torchtitan.titan_model(plan) is None:
            torchtitan.check_config_name(args.torchtitan_config)
    elif args.torchtitan_config is not None:  # S4-12: an option that does nothing is refused
        raise BadInput(f"--torchtitan-config applies to --to torchtitan only, not to --to "
                       f"{args.framework}; leave it out (or export --to torchtitan).")
    # every file this export may write, checked against every input before any work (S4-02)
    possible = [("-o", os.path.join(args.output, name)) for name in file_names(args.framework)]
    check_outputs(plan_input_files(plan, args.plan, args.model), possible)
    source = source_from_plan(plan, args.model, args.plan)
    outline = _outline(source)
    check_outline_matches(plan, outline, source)
    shape = plan_shape(plan, outline)
    result = export_plan(plan, shape, args.framework, render_policy_module(plan),
                         {"torchtitan_config": args.torchtitan_config})
    paths = {name: os.path.join(args.output, name) for name in result.files}
    os.makedirs(args.output, exist_ok=True)
    for path in paths.values():
        check_writable(path, "-o")
    atomic_write_all([(paths[name], text) for name, text in result.files.items()])
    print(f"wrote {len(result.files)} files to {args.output}: {', '.join(sorted(result.files))}")
    if result.config_gaps:
        print(f"the {args.framework} configuration alone cannot say {len(result.config_gaps)} "
              "thing(s) the plan holds; the code hook keeps them (README.md says how)")
    elif result.lost:  # S4-17: "the whole plan" only when nothing is lost
        print(f"no code hook needed: the {args.framework} configuration says all a hook could "
              f"keep; {len(result.lost)} thing(s) the plan holds are lost (README.md says what)")
    else:
        print(f"the {args.framework} configuration is the whole plan; no code hook needed")
    for gap in result.lost:
        print(f"lost: {plain_text(gap.line())}")
    return 0


def _outline(source: ModelSource) -> ModelOutline:
    """The model's outline: kept on disk when the model was planned or exported before (facts/
    cache.py [Note: the facts cache]; no torch imported), else the model built on ``meta``
    (torch), whose outline is kept for the next export."""
    cache = FactsCache.default()
    outline = cache.load_outline(source) if cache is not None else None
    if outline is not None:
        return outline
    from fsdp_plan.measure import runtime  # torch (seconds): only when the model is built

    outline = runtime.built_outline(source)
    if cache is not None:
        cache.store_outline(source, outline)
    return outline
