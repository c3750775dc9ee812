"""Which fitted tables of a hardware description follow from which base figures.

[Note: base figures and derived tables]
A hardware description holds base figures (``peak_flops``, ``efficiency``, ``hbm_bandwidth``,
``memory_bandwidth``, ``intra_node_bandwidth``, ``collective_latency_s``, ``op_overhead_s``)
and tables fitted or estimated at those figures: per-op matmul and attention rates, the
collectives' fitted curves, FSDP2's seconds per byte, the optimizer's seconds per parameter
and per tensor. The step-time model reads the tables first (cost.py ``Rates``,
``collective_time``), so a hardware file that sets a base figure over a preset (``--hardware``
over ``--gpu``) but leaves the preset's tables in place changes nothing: a link 360x slower
predicted the same step (issue 21, S3-02).

So a file that sets a base figure and not a table derived from it does not inherit that
table as it was. The table is **rescaled** by the ratio of the new figure to the preset's
(``_RULES`` below), not dropped: the preset's tables carry what the datasheet figure alone
does not (fp32 matmuls at a fifteenth of the bf16 rate, skinny shapes slower than square ones,
all-reduce latency above all-gather's), and that shape holds on a slower or faster part of the
same kind; dropping them would fall back to ``peak_flops x efficiency`` for every dtype and
price fp32 matmuls at the bf16 peak. Where the preset's figure is 0 there is no ratio, and
the table is dropped so its fallback (the new figure itself) applies. A file that sets a table
as well is taken as written, table and figures alike; a file that sets neither keeps the
preset's. The description's ``source`` says what was rescaled, so a plan that stores the
figures (plans.py) also says where they came from.

The rules:
- ``matmul_flops``, ``attention_flops``: achieved FLOP/s, scale with ``peak_flops x
  efficiency`` (``efficiency`` is the share of peak a step reaches, so it reaches them too);
- ``memory_bandwidth``: scales with ``hbm_bandwidth`` (0 stays 0: derived as 0.8 x HBM);
- ``collectives``: each curve's ``bus_bandwidth`` scales with ``intra_node_bandwidth``, its
  ``latency_s`` with ``collective_latency_s``;
- ``fsdp_s_per_byte``, ``optimizer_s_per_param``: seconds per byte or parameter, scale with
  the inverse of the memory bandwidth (``memory_bandwidth``, else 0.8 x ``hbm_bandwidth``);
- ``optimizer_s_per_tensor``: host dispatch per tensor, scales with ``op_overhead_s``;
- ``unit_overhead_s``, ``param_overhead_s``, ``checkpoint_overhead_s``: FSDP2's and
  checkpointing's host seconds, the same host's Python and dispatch, scale with
  ``op_overhead_s`` ([Note: the host floor] in cost/streams.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def _memory(values: Mapping[str, Any]) -> float:
    return float(values["memory_bandwidth"] or 0.8 * values["hbm_bandwidth"])


@dataclass(frozen=True)
class _Rule:
    """``table`` (or only the ``leaf`` key of each curve in it) follows ``figure(values)``,
    which reads the base fields ``bases``; ``power`` -1 for seconds per unit of a rate."""

    table: str
    bases: tuple[str, ...]
    figure: Callable[[Mapping[str, Any]], float]
    power: int = 1
    leaf: str | None = None


_RULES = (
    _Rule("memory_bandwidth", ("hbm_bandwidth",), lambda v: v["hbm_bandwidth"]),
    _Rule("matmul_flops", ("peak_flops", "efficiency"),
          lambda v: v["peak_flops"] * v["efficiency"]),
    _Rule("attention_flops", ("peak_flops", "efficiency"),
          lambda v: v["peak_flops"] * v["efficiency"]),
    _Rule("collectives", ("intra_node_bandwidth",), lambda v: v["intra_node_bandwidth"],
          leaf="bus_bandwidth"),
    _Rule("collectives", ("collective_latency_s",), lambda v: v["collective_latency_s"],
          leaf="latency_s"),
    _Rule("fsdp_s_per_byte", ("memory_bandwidth", "hbm_bandwidth"), _memory, power=-1),
    _Rule("optimizer_s_per_param", ("memory_bandwidth", "hbm_bandwidth"), _memory, power=-1),
    _Rule("optimizer_s_per_tensor", ("op_overhead_s",), lambda v: v["op_overhead_s"]),
    _Rule("unit_overhead_s", ("op_overhead_s",), lambda v: v["op_overhead_s"]),
    _Rule("param_overhead_s", ("op_overhead_s",), lambda v: v["op_overhead_s"]),
    _Rule("checkpoint_overhead_s", ("op_overhead_s",), lambda v: v["op_overhead_s"]),
)


def base_figures_of(table: str) -> set[str]:
    """The base figures ``table`` follows (``_RULES``)."""
    return {base for rule in _RULES if rule.table == table for base in rule.bases}


def _scaled(table: Any, factor: float | None, leaf: str | None) -> Any:
    """``table`` with every number (or only each curve's ``leaf`` entry) times ``factor``;
    ``factor`` None drops the ``leaf`` entries."""
    if not isinstance(table, Mapping):
        return table * factor if factor is not None else table
    out = {}
    for key, value in table.items():
        if isinstance(value, Mapping) or leaf is None:
            out[key] = _scaled(value, factor, leaf)
        elif key == leaf and factor is not None:
            out[key] = value * factor
        elif key != leaf:
            out[key] = value
    return out


def _has_numbers(table: Any, leaf: str | None) -> bool:
    """Whether ``table`` holds a nonzero figure the rule would change."""
    if isinstance(table, Mapping):
        return any((leaf is None or key == leaf or isinstance(v, Mapping))
                   and _has_numbers(v, leaf) for key, v in table.items())
    return isinstance(table, (int, float)) and not isinstance(table, bool) and table != 0


def follow_base_figures(before: Mapping[str, Any], after: dict[str, Any],
                        given: set[str]) -> list[str]:
    """Rescale (in ``after``, the fields once a file's ``given`` keys are applied over
    ``before``) every table the file left out whose base figures it changed; returns one
    phrase per table touched ("matmul_flops x0.001", "collectives.latency_s dropped").
    See [Note: base figures and derived tables]."""
    done: list[str] = []
    for rule in _RULES:
        if rule.table in given or not given & set(rule.bases):
            continue
        old, new = rule.figure(before), rule.figure(after)
        table = after[rule.table]
        if new == old or not _has_numbers(table, rule.leaf):
            continue
        if old > 0:
            factor: float | None = (new / old) ** rule.power
        else:
            factor = None
        if not isinstance(table, Mapping):  # a figure, not a table (memory_bandwidth, ...)
            after[rule.table] = table * factor if factor is not None else 0.0
        elif rule.leaf is None and factor is None:
            after[rule.table] = {}
        else:
            after[rule.table] = _scaled(table, factor, rule.leaf)
        name = rule.table + (f".{rule.leaf}" if rule.leaf else "")
        done.append(f"{name} dropped" if factor is None else f"{name} x{factor:.4g}")
    return done
