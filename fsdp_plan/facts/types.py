"""What the planner knows about a model, as plain data: the module tree and one analysed step.

[Note: model facts]
``graph.py`` (module tree) and ``analysis.py`` (one fake forward + backward) are the only
places that touch a live ``nn.Module``. What they produce is defined here, free of torch:
``ModuleGraph`` / ``ModuleInfo`` and ``Analysis`` / ``Timeline`` / ``Event`` /
``ModuleCompute``. The memory model, the step-time model, the collective rule and the search
read only these, so they run (and are tested) on a JSON fixture without building a model.
``ModelFacts`` bundles both with a JSON form (``to_json`` / ``from_json``).

[Note: op classes]
What the step-time model needs to time a module's ops on a given machine (cost/step_time.py
``compute_time``): matrix-multiply FLOPs by shape class (the smallest of M, N, K below 128,
below 1024, or larger: small GEMMs run far below peak), attention FLOPs (SDPA kernels),
bytes read and written by every other op that computes (memory-bound: norms, activations,
residual adds, casts, copies, the loss), and the number of such ops (each pays a launch or
dispatch overhead). Views and other metadata-only ops count nothing.

[Note: FLOP attribution]
The FLOPs between two boundaries belong to the innermost module open at the first of
them: in forward the last pre-forward not yet closed by its post-forward; in backward the
last pre-backward not yet closed by its post-backward (a module's backward ops run right
after its pre-backward hook) that has no open submodule (a module and its last submodule
share an output, and the outer pre-backward hook fires second). Backward windows are not
nested: a module's post-backward waits for its input's whole gradient, so siblings that
share an input (q, k and v projections) close together after all of them ran, and their windows overlap. Measuring
each module over its own window would count q's backward in k's and v's too (the tiny
Llama's units summed to 1.4x the model's backward FLOPs). Each op's FLOPs go to one
module (``own_*``); a module's inclusive figure adds those of its FQN descendants, so the
units of any plan add up to the model. FLOPs outside every module (the loss) are the root's.
The op-class counters (``Event.ops``, [Note: op classes]) are attributed the same way
(``own_fw_ops`` / ``own_bw_ops``), those outside every module to the root.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

FACTS_VERSION = 1

OP_CLASSES = ("mm_small", "mm_medium", "mm_large", "attention", "memory_bytes", "ops")
"""The op-class counters a module's ops are summed into: see [Note: op classes]."""


@dataclass(kw_only=True)
class ModuleInfo:
    """One module of the tree, with its own and its subtree's parameters."""

    fqn: str
    class_name: str
    parent: str | None
    children: list[str]
    direct_numel: int
    """Parameters registered directly on this module (tied ones counted at their first owner)."""
    subtree_numel: int
    direct_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    buffer_bytes: int = 0
    """Buffers registered directly on this module."""
    param_shapes: list[list[int]] = field(default_factory=list)
    """Shapes of the parameters directly owned here (for FSDP's per-parameter padding)."""
    keeps_full_precision: bool = False
    """Batch norm with parameters: FSDP must keep it in float32 when the plan computes in a
    lower dtype (its weights meet float32 running statistics), so it is a unit of its own."""


@dataclass(kw_only=True)
class ModuleGraph:
    """The model's module tree and the facts unit construction needs."""

    modules: dict[str, ModuleInfo]
    """Every module by FQN, in ``named_modules()`` order (parents before children)."""
    tied_groups: list[list[str]]
    """Module FQNs that share at least one parameter (FSDP needs each group in one unit)."""
    blocks: list[str]
    """The repeated blocks: children of one container with the same class, in order."""
    total_numel: int
    total_param_bytes: int
    total_buffer_bytes: int
    hf_embeddings: dict[str, Any] | None = None
    """For a model with ``get_input_embeddings`` (Hugging Face): ``{input, output, final_norm,
    tied}``, the FQNs of its input and output embeddings and of the final norm
    (``facts/graph.hf_embeddings``), which accelerate gives units of their own; None otherwise."""


AUTOCAST_EXIT = "autocast_exit"
"""The event a pass under ``torch.autocast`` records where the autocast region ends (after the
loss, before backward): its weight cache is freed there ([Note: autocast and checkpointed
blocks] in timeline.py)."""


@dataclass(kw_only=True, slots=True)
class Event:
    """One module boundary in execution order."""

    kind: str
    """``pre_fw``, ``post_fw``, ``pre_bw``, ``post_bw``, ``autocast_exit`` or ``end``."""
    module: str
    level: int
    """Activation-side bytes alive at this boundary."""
    peak: int
    """Highest activation-side bytes since the previous boundary (>= both levels)."""
    flops: float
    """Cumulative FLOPs of the pass so far."""
    ops: dict[str, float] | None = None
    """Op-class counters of the ops that ran since the previous boundary (keys in
    ``OP_CLASSES``; see [Note: op classes]); ``None`` in facts written before they existed."""


@dataclass(kw_only=True)
class Timeline:
    """The events of one analysis pass."""

    events: list[Event]
    checkpointed: list[str] = field(default_factory=list)
    final_level: int = 0
    """Activation-side bytes left after backward (should be ~0)."""
    seconds: float = 0.0
    autocast_released: dict[str, int] = field(default_factory=dict)
    """Under ``torch.autocast``: bytes freed when the autocast region ends after the loss (its
    weight cache: casts no backward kept), by the module whose forward made them
    ([Note: autocast and checkpointed blocks] in timeline.py)."""

    def __reduce__(self) -> tuple:
        """Pickled as columns, one list per ``Event`` field (a pass's result sent from a
        forked child, facts/forked.py): unpickling the 73,000 ``Event`` objects of the
        10,006-module model one by one took 0.35 s of the planner's time per pass, columns
        and one constructor call per event a quarter of that."""
        return (_timeline_of_columns, (self.event_columns(), self.checkpointed,
                                       self.final_level, self.seconds, self.autocast_released))

    def event_columns(self) -> tuple[tuple, ...]:
        """The events as one tuple per ``Event`` field, in ``EVENT_FIELDS`` order."""
        return tuple(zip(*((e.kind, e.module, e.level, e.peak, e.flops, e.ops)
                           for e in self.events))) or ((),) * len(EVENT_FIELDS)


EVENT_FIELDS = ("kind", "module", "level", "peak", "flops", "ops")
"""``Event``'s fields in the order ``Timeline.event_columns`` writes them."""


def _timeline_of_columns(columns: tuple[tuple, ...], checkpointed: list[str], final_level: int,
                         seconds: float, autocast_released: dict[str, int]) -> Timeline:
    """The ``Timeline`` that ``Timeline.__reduce__`` wrote as columns."""
    return Timeline(events=[Event(kind=kind, module=module, level=level, peak=peak,
                                  flops=flops, ops=ops)
                            for kind, module, level, peak, flops, ops in zip(*columns)],
                    checkpointed=checkpointed, final_level=final_level, seconds=seconds,
                    autocast_released=autocast_released)


@dataclass(kw_only=True)
class ModuleCompute:
    """Per-module figures derived from a pass (see [Note: FLOP attribution])."""

    fw_flops: float = 0.0
    """Forward FLOPs of this module and its submodules."""
    bw_flops: float = 0.0
    """Backward FLOPs of this module and its submodules."""
    own_fw_flops: float = 0.0
    """Forward FLOPs of ops that ran in this module and in none of its submodules."""
    own_bw_flops: float = 0.0
    saved_bytes: int = 0
    """Bytes saved for backward by ops running directly in this module (not in children)."""
    output_bytes: int = 0
    calls: int = 0
    own_fw_ops: dict[str, float] = field(default_factory=dict)
    """Op-class counters (``OP_CLASSES``) of this module's own forward ops, attributed like
    ``own_fw_flops``; empty in facts written before they existed."""
    own_bw_ops: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class CompiledBlock:
    """What the AOTAutograd partition of one compiled block keeps (facts/compiled.py
    [Note: compiled blocks]); one block of each class is traced and stands for its class."""

    block: str
    """The FQN of the block traced."""
    class_name: str
    activation_memory_budget: float | None = None
    saved_bytes: int = 0
    """Bytes of new storages the forward saves for backward (graph inputs excluded)."""
    kept_bytes: int = 0
    """Bytes of new storages alive after the compiled forward: the saved set and the output."""
    saved_tensors: int = 0
    saved_input_tensors: int = 0
    """Saved tensors that alias a graph input (parameters, the block's input): no new bytes."""
    recomputed: dict[str, int] = field(default_factory=dict)
    """Forward ops the backward graph computes again, by op name."""
    mode: str = "none"
    """The block's checkpointing mode when traced: ``none``, ``full`` or ``selective`` (the
    checkpoint wrapper compiled with the block, as the policy does)."""
    fw_ops: dict[str, float] = field(default_factory=dict)
    """Op-class counters ([Note: op classes]) of the partition's forward graph with
    memory-bound ops counted per fused region (facts/fused.py [Note: fused regions])."""
    bw_ops: dict[str, float] = field(default_factory=dict)
    """The same for the backward graph (recomputed ops included)."""
    bw_peak_bytes: int = 0
    """The most bytes of new storages the backward graph holds at once when run op by op,
    each freed after its last use (graph inputs excluded): the block's transient on top of
    what its backward starts with (cost/timeline.py [Note: compiled timeline])."""


@dataclass(kw_only=True)
class CompiledBlocks:
    """``--compile``: every repeated block compiled; the partition of each block class."""

    activation_memory_budget: float | None = None
    by_class: dict[str, CompiledBlock] = field(default_factory=dict)
    block_class: dict[str, str] = field(default_factory=dict)
    """Every repeated block's FQN -> its class (the key of ``by_class`` it takes)."""

    by_mode: dict[str, dict[str, CompiledBlock]] = field(default_factory=dict)
    """``full`` / ``selective`` -> the partitions of each class traced checkpointed in that
    mode (a mode left out did not compile: it is not offered)."""

    def of(self, block: str, mode: str = "none") -> CompiledBlock | None:
        """The partition ``block`` takes in checkpointing ``mode``, or None when not traced."""
        table = self.by_class if mode == "none" else self.by_mode.get(mode, {})
        return table.get(self.block_class.get(block, ""))

    def kept_bytes(self, block: str, mode: str = "none") -> int | None:
        """What ``block``'s compiled forward leaves alive, or None when it was not traced."""
        one = self.of(block, mode)
        return None if one is None else one.kept_bytes

    def bw_peak_bytes(self, block: str, mode: str = "none") -> int | None:
        """``block``'s backward-graph transient (``CompiledBlock.bw_peak_bytes``), or None
        when it was not traced."""
        one = self.of(block, mode)
        return None if one is None else one.bw_peak_bytes


@dataclass(kw_only=True)
class SelectivePass:
    """The pass with every repeated block selectively checkpointed, at one ``aten.mm`` stride
    (``selective_mm_stride``: [Note: checkpointing modes] in checkpointing.py)."""

    mm_stride: int
    timeline: Timeline
    recompute_flops: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class Analysis:
    """What one micro-batch costs the unwrapped model: timeline, per-module compute, input bytes."""

    timeline: Timeline
    modules: dict[str, ModuleCompute]
    input_bytes: int
    param_dtype: str
    total_fw_flops: float
    total_bw_flops: float
    checkpointed_timeline: Timeline | None = None
    selective_timeline: Timeline | None = None
    """The pass with every repeated block selectively checkpointed ([Note: checkpointing
    modes] in checkpointing.py); None when the model has no blocks or it did not replay."""
    selective_ops: list[str] = field(default_factory=list)
    selective_recompute_flops: dict[str, float] = field(default_factory=dict)
    """Per block: the FLOPs its selective mode replays in backward."""
    selective_unavailable: str = ""
    """Why selective checkpointing is not offered for this model (empty when it is)."""
    compiled: CompiledBlocks | None = None
    """The compiled blocks' partitions (``--compile``); None for eager blocks."""
    selective_mm_stride: int = 1
    """The ``aten.mm`` stride of ``selective_timeline``: every k-th matmul of a block saved."""
    selective_variants: list[SelectivePass] = field(default_factory=list)
    """Selective passes at other strides (torchtitan's op recipe saves every second matmul)."""
    autocast_dtype: str | None = None
    """Set when the passes ran under ``torch.autocast`` with float32 parameters
    (``param_dtype`` then names the dtype autocast computes in): [Note: autocast precision]."""
    ddp_analysis: Analysis | None = None
    """For a plan computing below float32 with FSDP mixed precision: the plain pass under
    ``torch.autocast`` with float32 parameters, which is how a DDP plan computes (SPEC 7)."""
    ddp_unavailable: str = ""
    """Why DDP is not planned (that pass failed: the model does not run under autocast)."""

    def with_selective_stride(self, stride: int) -> Analysis | None:
        """This analysis with its selective pass at ``stride`` (None when none was run)."""
        if stride == self.selective_mm_stride:
            return self
        for variant in self.selective_variants:
            if variant.mm_stride == stride:
                return dataclasses.replace(
                    self, selective_timeline=variant.timeline,
                    selective_recompute_flops=dict(variant.recompute_flops),
                    selective_mm_stride=stride, selective_variants=[])
        return None

    def for_ddp(self) -> Analysis:
        """The analysis a DDP candidate is evaluated on (``ddp_analysis`` when there is one)."""
        return self.ddp_analysis if self.ddp_analysis is not None else self


@dataclass(kw_only=True)
class ModelFacts:
    """The module graph and its analysis: everything the models and the search read."""

    graph: ModuleGraph
    analysis: Analysis

    def to_dict(self, *, columns: bool = False) -> dict[str, Any]:
        """Plain data (``dataclasses.asdict``'s dict); ``columns``: each timeline's events as
        one list per ``Event`` field (``event_columns``) instead of a dict per event, as the
        facts cache writes them: the 70B shape's entry is 3.0 MB instead of 4.1, converted
        and encoded in 0.11 s instead of 0.22, read in 0.12 s instead of 0.17 (issue 29).
        ``from_dict`` reads both."""
        return {"facts_version": FACTS_VERSION, "graph": plain_data(self.graph),
                "analysis": plain_data(self.analysis, columns=columns)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelFacts:
        if raw.get("facts_version") != FACTS_VERSION:
            raise ValueError(f"model facts version {raw.get('facts_version')!r}; expected "
                             f"{FACTS_VERSION}.")
        return cls(graph=_graph(raw["graph"]), analysis=_analysis(raw["analysis"]))

    @classmethod
    def from_json(cls, text: str) -> ModelFacts:
        return cls.from_dict(json.loads(text))


@dataclass(kw_only=True)
class ModelOutline:
    """What a model built on ``meta`` says besides its facts, for reading a plan against it
    without building it again: ``export`` reads the plan's units against the module tree and
    classes (export/common.py [Note: PlanShape]), and every command checks that the model is
    the planned one (plan/model_match.py). Built with the model (``facts.graph.model_outline``)
    and kept beside the facts on disk (facts/cache.py [Note: the facts cache]), so an export of
    a plan whose model was planned or exported before imports no torch (issue 29)."""

    graph: ModuleGraph
    """The module tree; its ``total_numel`` counts each parameter once, as
    ``model.parameters()`` does (tied parameters are one)."""
    torch_classes: list[str]
    """Names of the model's module classes that torch defines (``nn.Linear``...), sorted."""
    no_split_modules: list[str]
    """The model's ``_no_split_modules`` (a Hugging Face model's decoder-layer classes)."""
    has_input_embeddings: bool
    """The model has a callable ``get_input_embeddings`` (accelerate adds units for it)."""
    containers: list[str]
    """FQNs of the ``nn.ModuleList``/``nn.ModuleDict`` modules without a ``forward`` of their
    own (the model calls their children, never them)."""

    def to_dict(self) -> dict[str, Any]:
        return {"facts_version": FACTS_VERSION, **plain_data(self)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelOutline:
        if raw.get("facts_version") != FACTS_VERSION:
            raise ValueError(f"model outline version {raw.get('facts_version')!r}; expected "
                             f"{FACTS_VERSION}.")
        return cls(graph=_graph(raw["graph"]),
                   torch_classes=[str(n) for n in raw["torch_classes"]],
                   no_split_modules=[str(n) for n in raw["no_split_modules"]],
                   has_input_embeddings=bool(raw["has_input_embeddings"]),
                   containers=[str(n) for n in raw["containers"]])


def _graph(g: dict[str, Any]) -> ModuleGraph:
    """A ``ModuleGraph`` from its JSON form."""
    return ModuleGraph(
        modules={k: ModuleInfo(**v) for k, v in g["modules"].items()},
        tied_groups=[list(t) for t in g["tied_groups"]], blocks=list(g["blocks"]),
        total_numel=g["total_numel"], total_param_bytes=g["total_param_bytes"],
        total_buffer_bytes=g["total_buffer_bytes"], hf_embeddings=g.get("hf_embeddings"))


def _analysis(a: dict[str, Any]) -> Analysis:
    """An ``Analysis`` from its JSON form (fields added later default)."""
    ckpt = a.get("checkpointed_timeline")
    return Analysis(
        timeline=_timeline(a["timeline"]),
        modules={k: ModuleCompute(**v) for k, v in a["modules"].items()},
        input_bytes=a["input_bytes"], param_dtype=a["param_dtype"],
        total_fw_flops=a["total_fw_flops"], total_bw_flops=a["total_bw_flops"],
        checkpointed_timeline=_timeline(ckpt) if ckpt else None,
        selective_timeline=_timeline(a["selective_timeline"]) if a.get("selective_timeline")
        else None, selective_ops=list(a.get("selective_ops", [])),
        selective_recompute_flops=dict(a.get("selective_recompute_flops", {})),
        selective_unavailable=a.get("selective_unavailable", ""),
        selective_mm_stride=int(a.get("selective_mm_stride", 1)),
        selective_variants=[SelectivePass(mm_stride=int(v["mm_stride"]),
                                          timeline=_timeline(v["timeline"]),
                                          recompute_flops=dict(v.get("recompute_flops", {})))
                            for v in a.get("selective_variants", [])],
        compiled=_compiled(a.get("compiled")),
        autocast_dtype=a.get("autocast_dtype"),
        ddp_analysis=_analysis(a["ddp_analysis"]) if a.get("ddp_analysis") else None,
        ddp_unavailable=a.get("ddp_unavailable", ""))


def _compiled(raw: dict[str, Any] | None) -> CompiledBlocks | None:
    if not raw:
        return None
    return CompiledBlocks(activation_memory_budget=raw.get("activation_memory_budget"),
                          by_class={k: CompiledBlock(**v) for k, v in raw["by_class"].items()},
                          block_class=dict(raw.get("block_class", {})),
                          by_mode={m: {k: CompiledBlock(**v) for k, v in per.items()}
                                   for m, per in raw.get("by_mode", {}).items()})


def _timeline(raw: dict[str, Any]) -> Timeline:
    """A ``Timeline`` from its JSON form: a dict per event, or ``event_columns``
    (``ModelFacts.to_dict(columns=True)``)."""
    if "event_columns" in raw:
        columns = dict(raw["event_columns"])
        if "ops_table" in raw:  # one object per distinct counters, shared as traced
            table = raw["ops_table"]
            columns["ops"] = [None if i is None else table[i] for i in columns["ops"]]
        events = [Event(kind=kind, module=module, level=level, peak=peak, flops=flops, ops=ops)
                  for kind, module, level, peak, flops, ops
                  in zip(*(columns[name] for name in EVENT_FIELDS), strict=True)]
    else:
        events = [Event(**e) for e in raw["events"]]
    return Timeline(events=events,
                    checkpointed=list(raw.get("checkpointed", [])),
                    final_level=raw.get("final_level", 0), seconds=raw.get("seconds", 0.0),
                    autocast_released=dict(raw.get("autocast_released", {})))


def fill_flops(events: list[Event], modules: dict[str, ModuleCompute]) -> None:
    """Forward/backward FLOPs per module, each op counted once (see [Note: FLOP attribution]).

    The innermost open module is worked out once per set of open modules, and each module's
    chain of ancestors once: a deep model's expanded pass (facts/depth.py) has 40,000 events
    (10,006 modules), and working both out per event made the pass 0.119 s instead of 0.095.
    The sums are added in event order as before."""
    for comp in modules.values():
        comp.fw_flops = comp.bw_flops = comp.own_fw_flops = comp.own_bw_flops = 0.0
        comp.own_fw_ops, comp.own_bw_ops = {}, {}
    open_modules: list[str] = []
    innermost: str | None = None
    """``_innermost(open_modules)``, None after each change of ``open_modules``."""
    innermosts: dict[tuple[str, ...], str] = {}
    chains: dict[str, list[str]] = {}
    in_backward = False
    for ev, nxt in itertools.pairwise(events):
        kind = ev.kind
        if kind in ("pre_fw", "pre_bw"):
            open_modules.append(ev.module)
            innermost = None
            in_backward = in_backward or kind == "pre_bw"
        elif kind in ("post_fw", "post_bw") and ev.module in open_modules:
            del open_modules[len(open_modules) - 1 - open_modules[::-1].index(ev.module)]
            innermost = None
        if open_modules and innermost is None:
            stack = tuple(open_modules)
            innermost = innermosts.get(stack)
            if innermost is None:
                innermost = innermosts[stack] = _innermost(open_modules)
        delta = nxt.flops - ev.flops
        if nxt.ops:  # op-class counters go where the FLOPs go; outside every module: the root
            comp = _figures_of(modules, innermost if open_modules else "")
            own = comp.own_bw_ops if in_backward else comp.own_fw_ops
            for k, v in nxt.ops.items():
                own[k] = own.get(k, 0.0) + v
        if not delta or not open_modules:
            continue
        owner = innermost
        comp = _figures_of(modules, owner)
        if in_backward:
            comp.own_bw_flops += delta
        else:
            comp.own_fw_flops += delta
        chain = chains.get(owner)
        if chain is None:
            chain = chains[owner] = _self_and_ancestors(owner)
        for fqn in chain:
            found = modules.get(fqn)
            if found is not None:
                if in_backward:
                    found.bw_flops += delta
                else:
                    found.fw_flops += delta


def _figures_of(modules: dict[str, ModuleCompute], fqn: str) -> ModuleCompute:
    """``modules[fqn]``, added empty when missing (``setdefault`` without building an empty
    one per event)."""
    found = modules.get(fqn)
    if found is None:
        found = modules[fqn] = ModuleCompute()
    return found


def _innermost(open_modules: list[str]) -> str:
    """The most recently opened module with no open submodule."""
    for i in range(len(open_modules) - 1, -1, -1):
        fqn = open_modules[i]
        prefix = fqn + "." if fqn else ""
        if not any(o != fqn and o.startswith(prefix) for o in open_modules):
            return fqn
    return open_modules[-1]


def _self_and_ancestors(fqn: str) -> list[str]:
    """``a.b.c`` -> ``["a.b.c", "a.b", "a", ""]``."""
    out = [fqn]
    while fqn:
        fqn = fqn.rpartition(".")[0]
        out.append(fqn)
    return out


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_SHARED = (int, float, str, bool, type(None))
"""Values ``plain_data`` returns as they are (immutable: ``asdict``'s deep copy of one is
itself)."""


def plain_data(value: Any, *, columns: bool = False) -> Any:
    """``dataclasses.asdict`` for facts, without its deep copies of immutable values:
    dataclasses become dicts of their fields, lists, tuples and dicts are rebuilt with their
    items converted, numbers, strings and None are shared, anything else is converted by
    ``asdict`` itself. ``asdict`` took 0.6 s of the 70B shape's cache write after tracing
    (issue 29); tests/test_facts_cache.py checks both give the same dict. ``columns``: each
    ``Timeline`` with its events as columns (``ModelFacts.to_dict``)."""
    kind = type(value)
    if kind in _SHARED:
        return value
    if columns:
        return _plain_columns(value, kind)
    if kind is list:
        return [plain_data(v) for v in value]
    if kind is dict:
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if kind is tuple:
        return tuple(plain_data(v) for v in value)
    names = _FIELD_NAMES.get(kind)
    if names is None and is_dataclass(value) and not isinstance(value, type):
        names = _FIELD_NAMES[kind] = tuple(f.name for f in fields(value))
    if names is not None:
        return {n: plain_data(getattr(value, n)) for n in names}
    return asdict(_Boxed(value))["value"]  # anything else (a namedtuple): asdict's own rule


def _plain_columns(value: Any, kind: type) -> Any:
    """``plain_data(value, columns=True)`` for a value that is not a number or a string."""
    if kind is Timeline:
        plain = {n: plain_data(getattr(value, n))
                 for n in ("checkpointed", "final_level", "seconds", "autocast_released")}
        columns = value.event_columns()
        plain["event_columns"] = {name: list(column) for name, column
                                  in zip(EVENT_FIELDS, columns, strict=True) if name != "ops"}
        plain["event_columns"]["ops"], plain["ops_table"] = _ops_table(
            columns[EVENT_FIELDS.index("ops")])
        return plain
    if kind is list:
        return [plain_data(v, columns=True) for v in value]
    names = _FIELD_NAMES.get(kind)
    if names is None and is_dataclass(value) and not isinstance(value, type):
        names = _FIELD_NAMES[kind] = tuple(f.name for f in fields(value))
    if names is not None:
        return {n: plain_data(getattr(value, n), columns=True) for n in names}
    return plain_data(value)  # dicts and tuples hold no timeline


def _ops_table(ops: Sequence[dict[str, float] | None]
               ) -> tuple[list[int | None], list[dict[str, float]]]:
    """Events' op counters as an index each (None for none) into a table of the distinct
    counter objects, in order of first use (``_timeline`` reads them back as one object per
    entry). A deep model's repeated blocks share their counters (facts/depth.py), and the
    search times and sums them once per object (cost/ddp_buckets.py ``event_times``,
    search/evaluator.py ``_OpSums``): written out one per event, the 70B's facts read from
    the cache summed four times as many counters per search."""
    where: dict[int, int] = {}
    table: list[dict[str, float]] = []
    indices: list[int | None] = []
    for o in ops:
        if o is None:
            indices.append(None)
            continue
        i = where.get(id(o))
        if i is None:
            i = where[id(o)] = len(table)
            table.append(dict(o))
        indices.append(i)
    return indices, table


@dataclass
class _Boxed:
    """One value in a dataclass, so that ``asdict`` converts it by its own rule."""

    value: Any
