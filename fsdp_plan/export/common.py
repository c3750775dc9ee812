"""What a plan asks of a training framework, and what a framework's configuration cannot say.

[Note: configuration reach]
A framework's configuration describes FSDP coarsely: accelerate and the HF Trainer wrap every
module of some classes (``transformer_layer_cls_to_wrap``) with one ``reshard_after_forward``,
checkpoint all of those modules or none, never set explicit prefetch, and know one mixed
precision (``bf16``: parameters, gradient reduction and outputs all in bf16). A plan may say
more: grouped units, units that are not one class, per-unit reshard, checkpointing of some
blocks (full or selective), prefetch lists, float32 reduction, bf16 autocast over float32
parameters, gradient sync on the last micro-batch only, DDP bucket sizes. Each thing a
configuration cannot say is a ``Gap`` (what the plan holds, what the framework does instead).
``export`` writes the configuration alone when there is no gap; otherwise it also writes a
code hook that applies the plan through its policy module, and the README lists any gap the
hook cannot close either. Planning for a framework (``--framework``) keeps the search to plans
without configuration gaps, through the same ``config_gaps`` functions.

[Note: PlanShape]
``plan_shape`` reads the plan together with the model's outline (``ModelOutline``: what the
model built on ``meta`` says; class names are not in the plan, and the outline is kept on disk
beside the model's facts, so an export imports no torch when the model was planned or exported
before): which classes the units' modules have, and whether "every module of those
classes, one unit each, plus the root" is exactly the plan's units. Everything after it is a
pure function of ``PlanShape``, so the frameworks' rules are tested without a model. What a
framework makes of the model (accelerate's final-norm unit, its Hugging Face embedding units,
torchtitan's units) is read from the model's ``ModuleGraph`` by search/framework.py's own
functions, the ones ``--framework`` restricts the search with: one description of each
framework's reach, so export and the search cannot disagree about a model.

[Note: strings in exports]
Names in an export come from user files: the plan's ``model.source`` (any string the plan
validator lets through: quotes, newlines, code), the model's module FQNs and class names (a
class may be named ``'Block,Linear'`` or hold a newline), and ``--torchtitan-config``. Each is
encoded once, where it lands (issue 31, S4-01):
- generated Python: values only as ``repr`` literals or ints, and docstring text through
  ``emit.doc_safe`` (a character whitelist, as the policy module's docstring);
  ``--torchtitan-config`` must be a dotted module path and a function name;
- YAML and JSON: ``yaml.safe_dump`` / ``json.dumps`` of plain data, never text pasted in;
- README.md: the title and every gap line through ``md_text`` (one line, Markdown and HTML
  escaped); the terminal's ``lost:`` lines through ``plain_text``.
A framework whose own format cannot carry a name (accelerate's and the Trainer's
comma-separated class list) gets a gap instead, so the code hook applies the plan by FQN.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.cost.ddp_buckets import DDPConfig
from fsdp_plan.facts.types import ModelOutline
from fsdp_plan.plan.document import Plan
from fsdp_plan.search.framework import FRAMEWORKS, class_tail, final_norm, titan_units

POLICY_FILE = "fsdp_plan_policy.py"
"""Name of the policy module inside an export folder (hooks import it as ``fsdp_plan_policy``)."""
README_FILE = "README.md"


@dataclass(frozen=True)
class Gap:
    """One thing a plan holds that a framework's configuration cannot say."""

    feature: str
    """What it concerns: ``units``, ``reshard_after_forward``, ``activation_checkpointing``..."""
    plan: str
    """What the plan holds."""
    instead: str
    """What the framework does instead."""

    def line(self) -> str:
        return f"{self.feature}: the plan has {self.plan}; {self.instead}"


@dataclass(frozen=True, kw_only=True)
class PlanShape:
    """The plan as a framework configuration sees it (see [Note: PlanShape])."""

    strategy: str
    world_size: int
    replicate: int
    shard: int
    block_classes: tuple[str, ...]
    """Class names of the modules in the units other than the root, first seen first."""
    class_units: bool
    """The non-root units are exactly every module of ``block_classes``, one unit each."""
    class_modules: int
    """How many modules of ``block_classes`` the model has (what a class-based wrap wraps)."""
    grouped_units: int
    """Units with more than one module."""
    units: int
    block_reshard: tuple[bool, ...]
    """The distinct ``reshard_after_forward`` values of the non-root units (but the final
    norm's, see ``final_norm``)."""
    root_reshard: bool
    checkpointed: dict[str, str]
    """``{FQN: full | selective}``."""
    checkpoint_all_class_modules: bool
    """Every module of ``block_classes`` is fully checkpointed and nothing else is."""
    forward_prefetch: bool
    deep_backward_prefetch: bool
    """Some unit prefetches more than one unit in backward (FSDP2's implicit prefetch: one)."""
    param_dtype: str | None
    reduce_dtype: str | None
    autocast_dtype: str | None
    """The dtype forward runs in under ``torch.autocast`` (the policy's ``AUTOCAST_DTYPE``)."""
    unit_precision: int
    """Units with their own ``mixed_precision`` (batch norm kept in float32)."""
    micro_batch: int
    seq_len: int | None
    grad_accum_steps: int
    gradient_sync: str
    offload: bool
    ddp: DDPConfig | None
    hf_model: bool
    """The model has ``get_input_embeddings`` (accelerate gives HF models extra units)."""
    model_source: str = ""
    model_class: str = ""
    unit_modules: tuple[tuple[str, ...], ...] = ()
    """The non-root units' modules, in plan order."""
    unit_reshard: tuple[bool, ...] = ()
    """The non-root units' ``reshard_after_forward``, in plan order."""
    final_norm: str | None = None
    """The module accelerate gives a unit of its own, kept gathered (``final_norm``); the
    class fields above leave its unit out."""
    final_norm_reshard: bool | None = None
    """That unit's ``reshard_after_forward``; None: the plan gives it no unit of its own."""
    wrap_classes: tuple[str, ...] = ()
    """The block classes a class list names (``wrap_class_names``): ``block_classes`` without
    torch's own layers (``Linear`` alone would wrap every linear layer), else the model's
    ``_no_split_modules``."""
    hf_layout: bool = False
    """A Hugging Face model's plan has accelerate's units for it: the untied input embedding
    alone, the final norm with the output embedding (``search.framework.class_tail``)."""
    titan_units: tuple[tuple[str, ...], ...] = ()
    """The units torchtitan's ``apply_fsdp_to_decoder`` makes of this model: ``tok_embeddings``,
    each child of ``layers``, ``[norm, lm_head]`` (search/framework.py [Note: framework
    limits]); empty without a ``layers`` container."""


@dataclass
class Export:
    """The files of one framework export and what was lost."""

    framework: str
    files: dict[str, str] = field(default_factory=dict)
    """File name inside the export folder -> text."""
    config_gaps: list[Gap] = field(default_factory=list)
    """What the configuration alone cannot say (empty: the configuration is the whole plan)."""
    lost: list[Gap] = field(default_factory=list)
    """What is lost even with the hook."""

    @property
    def needs_hook(self) -> bool:
        return bool(self.config_gaps)


def _autocast_dtype(plan: Plan) -> str | None:
    """The policy module's ``AUTOCAST_DTYPE`` rule (``policy_runtime._configure``), on names."""
    mp = plan.mixed_precision
    if mp.autocast_dtype:
        return mp.autocast_dtype
    if plan.strategy == "ddp" and mp.param_dtype in ("bfloat16", "float16"):
        return mp.param_dtype
    return None


def plan_shape(plan: Plan, outline: ModelOutline) -> PlanShape:
    """Read ``plan`` against its model (``outline``: what the model built on ``meta`` says,
    ``facts.graph.model_outline``) as a framework configuration sees it."""
    graph = outline.graph
    modules = graph.modules
    units = [unit for unit in plan.units if unit.modules != [""]]
    missing = sorted({fqn for unit in units for fqn in unit.modules} - set(modules))
    if missing:
        raise BadInput(f"the plan's units name {missing[:5]!r}, which the model does not have; "
                       "give the model the plan was made for.")
    # what each framework makes of the model, as the search read it (search/framework.py)
    norm, hf, tail = final_norm(graph), graph.hf_embeddings, class_tail(graph)
    norm_unit = [unit for unit in units if tail and sorted(unit.modules) == sorted(tail)]
    embedding = (hf or {}).get("input") if not (hf or {}).get("tied") else None
    embedding_unit = [unit for unit in units if embedding and unit.modules == [embedding]]
    # what the class list wraps
    inner = [unit for unit in units if unit not in norm_unit and unit not in embedding_unit]
    classes: list[str] = []
    for unit in inner:
        for fqn in unit.modules:
            name = modules[fqn].class_name
            if name not in classes:
                classes.append(name)
    class_fqns = {fqn for fqn, info in modules.items() if fqn and info.class_name in classes}
    unit_fqns = [fqn for unit in inner for fqn in unit.modules]
    checkpointed = (dict(plan.activation_checkpointing)
                    if isinstance(plan.activation_checkpointing, dict)
                    else {fqn: "full" for fqn in plan.activation_checkpointing})
    root = [unit for unit in plan.units if unit.modules == [""]]
    return PlanShape(
        strategy=plan.strategy, world_size=plan.world_size, replicate=plan.mesh.replicate,
        shard=plan.mesh.shard, block_classes=tuple(classes),
        class_units=(all(len(unit.modules) == 1 for unit in inner)
                     and sorted(unit_fqns) == sorted(class_fqns)),
        class_modules=len(class_fqns),
        grouped_units=sum(len(unit.modules) > 1 for unit in plan.units if unit not in norm_unit),
        units=len(plan.units),
        block_reshard=tuple(sorted({bool(unit.reshard_after_forward)
                                    for unit in inner + embedding_unit})),
        root_reshard=bool(root[0].reshard_after_forward) if root else False,
        checkpointed=checkpointed,
        checkpoint_all_class_modules=(set(checkpointed) == class_fqns
                                      and set(checkpointed.values()) <= {"full"}),
        forward_prefetch=any(plan.forward_prefetch.values()),
        deep_backward_prefetch=any(len(t) > 1 for t in plan.backward_prefetch.values()),
        param_dtype=plan.mixed_precision.param_dtype,
        reduce_dtype=plan.mixed_precision.reduce_dtype,
        autocast_dtype=_autocast_dtype(plan),
        unit_precision=sum(bool(unit.mixed_precision) for unit in plan.units),
        micro_batch=plan.model.batch_size,
        seq_len=plan.model.seq_len,
        grad_accum_steps=plan.grad_accum_steps,
        gradient_sync=plan.gradient_sync,
        offload=plan.offload is not None,
        ddp=plan.ddp,
        hf_model=outline.has_input_embeddings,
        model_source=plan.model.source,
        model_class=modules[""].class_name,
        unit_modules=tuple(tuple(unit.modules) for unit in units),
        unit_reshard=tuple(bool(unit.reshard_after_forward) for unit in units),
        titan_units=tuple(tuple(unit) for unit in titan_units(graph)),
        wrap_classes=wrap_class_names(outline, classes),
        hf_layout=hf is not None and bool(norm_unit) and (bool(embedding_unit) or not embedding),
        final_norm=norm,
        final_norm_reshard=(bool(norm_unit[0].reshard_after_forward) if norm_unit else None),
    )


def wrap_class_names(outline: ModelOutline, classes: list[str]) -> tuple[str, ...]:
    """What ``transformer_layer_cls_to_wrap`` may name of ``classes`` (the units' classes):
    block classes only. A plan for a Hugging Face model may give ``lm_head`` a unit, whose
    class ``Linear`` in a class list wraps every linear layer of the model; torch's own
    classes are left out, and with nothing left the model's ``_no_split_modules`` (its
    decoder-layer classes) stand in."""
    kept = tuple(name for name in classes if name not in outline.torch_classes)
    return kept or tuple(outline.no_split_modules)


# ---------------------------------------------------------------------------------------------
# Gaps shared by the class-wrapping configurations (accelerate, HF Trainer)
# ---------------------------------------------------------------------------------------------

_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def precision_name(shape: PlanShape) -> str | None:
    """accelerate's ``mixed_precision`` (``no``, ``bf16``, ``fp16``) that is the plan's, or None.

    accelerate's ``bf16`` with FSDP2 is ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=bf16, output_dtype=bf16)``; without a lower dtype it is ``no``."""
    low = {d for d in (shape.param_dtype, shape.reduce_dtype) if d not in (None, "float32")}
    if shape.autocast_dtype is not None and shape.strategy != "ddp":
        return None
    if not low:
        return "no"
    if len(low) == 1 and shape.param_dtype == shape.reduce_dtype and low <= set(_SHORT):
        return _SHORT[shape.param_dtype]
    return None


def carriable_class_name(name: str) -> bool:
    """Whether accelerate's ``fsdp_transformer_layer_cls_to_wrap`` (one string that accelerate
    splits at commas; the Trainer joins its list into it) can name the class: an identifier,
    what a ``class`` statement makes (issue 31, S4-09: ``type("Block,Linear", ...)`` would be
    read as two classes)."""
    return name.isidentifier()


def class_wrap_gaps(shape: PlanShape, who: str) -> list[Gap]:
    """What a class-based FSDP2 configuration (one reshard flag, AC all or none, implicit
    prefetch, one precision) cannot say about a sharded plan; ``who`` names the framework."""
    gaps = []
    odd = [name for name in shape.block_classes if not carriable_class_name(name)]
    if odd:
        gaps.append(Gap("units", f"block class name(s) {', '.join(repr(n) for n in odd)}",
                        f"{who}'s class list is one comma-separated string of class names, "
                        "which cannot carry them"))
    if shape.grouped_units:
        gaps.append(Gap("units", f"{shape.grouped_units} unit(s) grouping several modules in "
                        "one fully_shard call", f"{who} gives each module of a class its own unit"))
    if not shape.class_units:
        gaps.append(Gap("units", f"{shape.units - 1} unit(s) besides the root",
                        f"{who} would wrap all {shape.class_modules} modules of class "
                        f"{', '.join(shape.block_classes) or '(none)'}"))
    if shape.hf_model and not shape.hf_layout:
        gaps.append(Gap("units", "no unit of its own for the input embedding or for the final "
                        "norm with the output head", f"{who} adds both for a Hugging Face model"))
    elif shape.final_norm is not None and shape.final_norm_reshard is not False:
        gaps.append(Gap("units", f"{shape.final_norm} " + (
            "resharded after forward" if shape.final_norm_reshard else "in another unit"),
            f"{who} gives the final norm {shape.final_norm} a unit of its own, kept gathered "
            "after forward"))
    if len(shape.block_reshard) > 1:
        gaps.append(Gap("reshard_after_forward", "units that reshard after forward and units "
                        "that do not", f"{who} sets one reshard_after_forward for every unit"))
    if shape.root_reshard:
        gaps.append(Gap("reshard_after_forward", "the root resharded after forward",
                        f"{who} leaves the root to FSDP2's default (not resharded)"))
    if shape.checkpointed and not shape.checkpoint_all_class_modules:
        modes = sorted(set(shape.checkpointed.values()))
        gaps.append(Gap("activation_checkpointing", f"{len(shape.checkpointed)} module(s) "
                        f"checkpointed ({'/'.join(modes)})", f"{who} checkpoints all "
                        f"{shape.class_modules} wrapped modules fully, or none"))
    if shape.forward_prefetch or shape.deep_backward_prefetch:
        gaps.append(Gap("prefetch", "explicit forward/backward prefetch lists",
                        f"{who} keeps FSDP2's implicit prefetch (one unit, backward only)"))
    if precision_name(shape) is None:
        gaps.append(Gap("mixed_precision", _precision_text(shape),
                        f"{who}'s bf16/fp16 casts parameters, gradient reduction and outputs "
                        "to one dtype"))
    if shape.unit_precision:
        gaps.append(Gap("mixed_precision", f"{shape.unit_precision} unit(s) with their own "
                        "precision (batch norm in float32)", f"{who} has one policy for all"))
    if shape.gradient_sync == "last" and shape.grad_accum_steps > 1:
        gaps.append(Gap("gradient_sync", "gradients reduced on the last micro-batch only",
                        f"{who}'s configuration has no FSDP2 gradient-sync switch"))
    return gaps


def _precision_text(shape: PlanShape) -> str:
    text = f"param_dtype {shape.param_dtype or 'float32'}, reduce_dtype " \
           f"{shape.reduce_dtype or shape.param_dtype or 'float32'}"
    if shape.autocast_dtype:
        text += f", forward under {shape.autocast_dtype} autocast"
    return text


# ---------------------------------------------------------------------------------------------
# The export itself
# ---------------------------------------------------------------------------------------------


def framework_gaps(framework: str, plan: Plan, outline: ModelOutline) -> list[Gap]:
    """What ``framework``'s configuration alone cannot say of ``plan`` for its model
    (``outline``): ``--framework`` planning checks its restricted plan with this, so that
    export writes no code hook for it."""
    return list(framework_module(framework).config_gaps(plan_shape(plan, outline)))


def framework_module(framework: str) -> Any:
    """``fsdp_plan.export.<framework>`` (``config_gaps``, ``render``, ``FILE_NAMES``), imported
    when a framework is exported to: torchtitan's reads torchtitan's own configs (and torch),
    which no other export needs."""
    return importlib.import_module(f"fsdp_plan.export.{framework}")


def file_names(framework: str) -> tuple[str, ...]:
    """Every file name ``framework``'s export may write, whatever the plan: the outputs that
    ``export`` checks against its inputs before any work (issue 31, S4-02)."""
    if framework not in FRAMEWORKS:
        raise BadInput(f"--to {framework!r} is not a framework fsdp-plan exports to; choose one "
                       f"of {', '.join(FRAMEWORKS)}.")
    return (*framework_module(framework).FILE_NAMES, POLICY_FILE, README_FILE)


def check_exportable(plan: Plan, framework: str) -> None:
    """Refuse what no framework's export can run: a plan whose optimizer steps in backward
    (the frameworks step their own optimizer after backward, and clip there)."""
    if plan.optimizer_overlap:
        raise BadInput(f"the plan steps its optimizer in backward (optimizer_overlap: true), and "
                       f"{framework} steps its own optimizer after backward, so the export "
                       "would train another plan. Apply this plan in a loop of your own "
                       "(policy.apply(model, optimizer_kwargs=...)), or export a plan made "
                       "without --optimizer-overlap.")


def export_plan(plan: Plan, shape: PlanShape, framework: str, policy_source: str,
                options: dict[str, Any] | None = None) -> Export:
    """The files of ``framework``'s export of ``plan`` (``policy_source`` is its policy module)."""
    if framework not in FRAMEWORKS:
        raise BadInput(f"--to {framework!r} is not a framework fsdp-plan exports to; choose one "
                       f"of {', '.join(FRAMEWORKS)}.")
    check_exportable(plan, framework)
    result: Export = framework_module(framework).render(plan, shape, dict(options or {}))
    result.files[POLICY_FILE] = policy_source
    return result


def plain_text(value: object) -> str:
    """``value`` as one line of text for a terminal or a document: every character that is
    not printable (line breaks, tabs, escape sequences, Unicode line separators) is written
    as its Python escape (``\\n``, ``\\x1b``), so a name from a model or a plan cannot start a
    line or a terminal sequence of its own (see [Note: strings in exports])."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(value))


_MARKDOWN_SPECIAL = re.compile(r"[\\`*\[\]<>&|~#]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def md_text(value: object) -> str:
    """``value`` as Markdown text that renders as written: one line (``plain_text``), and
    every character that opens Markdown or HTML (code spans and fences, emphasis, links,
    images, HTML tags and entities, tables, headings) backslash-escaped. Underscores inside a
    word (``reshard_after_forward``) open nothing and stay as they are."""
    return _MARKDOWN_SPECIAL.sub(lambda m: "\\" + m.group(0), plain_text(value))


NOTHING_LOST = "Nothing: launched as above, the run is the planned run."


def readme(title: str, export: Export, launch: str, hook_text: str, files: dict[str, str]
           ) -> str:
    """The export folder's README.md: the files, how to launch, what (if anything) is lost.

    ``title`` and the gaps carry names from the plan and the model: they are written through
    ``md_text``; ``launch``, ``hook_text`` and ``files`` are fsdp-plan's own Markdown."""
    lines = [f"# {md_text(title)}", "",
             "Written by `fsdp-plan export`; regenerate it from the plan rather than editing it.",
             "", "## Files", ""]
    lines += [f"- `{name}`: {what}" for name, what in files.items()]
    lines += ["", "## Launch", "", launch.strip(), ""]
    if export.config_gaps:
        lines += ["## The code hook", "", "The configuration alone cannot say all of the plan:",
                  ""]
        lines += [f"- {md_text(gap.line())}" for gap in export.config_gaps]
        lines += ["", hook_text.strip(), ""]
    elif export.lost:  # no hook would keep more (S4-17: "whole plan" only when it is)
        lines += ["## No code hook", "",
                  "This configuration says all of the plan that a code hook could keep; what "
                  "neither can is listed below.", ""]
    else:
        lines += ["## The configuration is the whole plan", "",
                  "Nothing in the plan is beyond this configuration: no code hook is needed.", ""]
    lines += ["## What is lost", ""]
    if export.lost:
        lines += [f"- {md_text(gap.line())}" for gap in export.lost]
    else:
        lines.append(NOTHING_LOST)
    return "\n".join(lines) + "\n"
