"""``fsdp-plan trace --html R.html``: one stable step's measured timeline per rank, in the plan
report's page style (pictures/html.py [Note: a page that loads nothing]).

Each rank's median stable step, from the start of its device window: a row per stream with its
kernels (compute, communication, copies), then rows for the exposed communication (no compute
beside it), the hidden part, the idle time (the host's share apart) and the tail after the
last backward compute (trace_figures.py [Note: the measured step split]). Plain data in (a
``TraceAnalysis``); plotly is imported only here.
"""

from __future__ import annotations

import html
from typing import Any

from fsdp_plan.measure.intervals import clip, intersect, minus, union
from fsdp_plan.measure.trace_ranks import RankFigures, TraceAnalysis
from fsdp_plan.pictures.html import _STYLE, CONFIG, _table, plotly_or_exit

KINDS = {"compute": ("compute kernel", "#4472c4"), "comm": ("communication", "#70ad47"),
         "copy": ("copy / memset", "#bfbfbf"), "exposed": ("exposed communication", "#c00000"),
         "hidden": ("hidden communication", "#a9d18e"), "idle": ("idle, work queued", "#ffc000"),
         "host": ("idle, the host launching nothing", "#7f7f7f"),
         "tail": ("tail after backward", "#7f0000")}
MAX_BARS_PER_ROW = 5000
"""Bars drawn per stream row (merged beyond that): a page stays light on a busy trace."""


def _rows(rank: RankFigures) -> list[tuple[str, str, list[tuple[float, float]]]]:
    """(row, kind, intervals in ms from the window's start) of a rank's median step."""
    step = next(s for s in rank.timeline.stable if s.number == rank.median_step)
    lo, hi = step.window
    acts = [a for a in rank.timeline.activities if a.end > lo and a.start < hi]

    def ms(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [((a - lo) / 1e3, (b - lo) / 1e3) for a, b in spans]
    rows = []
    for stream in sorted({str(a.stream) for a in acts}):
        mine = [a for a in acts if str(a.stream) == stream]
        for kind, test in (("compute", lambda a: a.compute), ("comm", lambda a: a.comm),
                           ("copy", lambda a: not a.compute and not a.comm)):
            spans = [(a.start, a.end) for a in mine if test(a)]
            if len(spans) > MAX_BARS_PER_ROW:
                spans = union(spans)
            if spans:
                rows.append((f"rank {rank.rank} stream {stream}", kind, ms(clip(sorted(spans),
                                                                                 lo, hi))))
    comm = clip(union((a.start, a.end) for a in acts if a.comm), lo, hi)
    compute = clip(union((a.start, a.end) for a in acts if a.compute), lo, hi)
    busy = clip(union((a.start, a.end) for a in acts), lo, hi)
    queued = clip(union((a.launch, a.start) for a in acts if a.launch is not None), lo, hi)
    figures = rank.median()
    own_bw = [a.end for a in acts if a.step == step.index and a.phase == "backward" and a.compute]
    tail = []
    if own_bw and figures.comm_tail_s > 0:
        bf = min(hi, max(own_bw))
        tail = [(bf, bf + figures.comm_tail_s * 1e6)]
    idle = minus(minus([(lo, hi)], busy), tail)
    label = f"rank {rank.rank} step {step.number}"
    rows += [(label, "exposed", ms(minus(comm, compute))),
             (label, "hidden", ms(intersect(comm, compute))),
             (label, "host", ms(minus(idle, queued))),
             (label, "idle", ms(intersect(idle, queued))), (label, "tail", ms(tail))]
    return [r for r in rows if r[2]]


def _figure(analysis: TraceAnalysis) -> Any:
    import plotly.graph_objects as go
    fig = go.Figure()
    order: list[str] = []
    shown: set[str] = set()
    for rank in analysis.ranks:
        for row, kind, spans in _rows(rank):
            if row not in order:
                order.append(row)
            name, colour = KINDS[kind]
            fig.add_trace(go.Bar(orientation="h", y=[row] * len(spans),
                                 x=[max(b - a, 1e-6) for a, b in spans], base=[a for a, _ in spans],
                                 name=name, legendgroup=kind, showlegend=kind not in shown,
                                 marker_color=colour,
                                 hovertemplate=f"{name}: %{{base:.3f}} ms + %{{x:.3f}} ms"))
            shown.add(kind)
    fig.update_layout(title="One stable step per rank, measured (the rank's median step)",
                      barmode="overlay", height=200 + 28 * len(order),
                      xaxis_title="ms into the step's device window", margin={"t": 60, "r": 20},
                      yaxis={"categoryorder": "array", "categoryarray": order[::-1]})
    return fig


def trace_page(analysis: TraceAnalysis) -> str:
    """The whole page."""
    plotly_or_exit()
    div = _figure(analysis).to_html(full_html=False, include_plotlyjs=True,
                                    include_mathjax=False, config=CONFIG, div_id="figure-trace")
    names = ("step_s", "forward_s", "backward_s", "optimizer_s", "comm_tail_s", "idle_s",
             "host_wait_s", "comm_s", "exposed_comm_s", "exposed_delaying_compute_s")
    rows = [[r.rank, r.median_step] + [f"{getattr(r.median(), n) * 1e3:.3f}" for n in names]
            for r in analysis.ranks]
    table = _table(["rank", "step"] + [n.removesuffix("_s") + " ms" for n in names], rows)
    title = f"fsdp-plan trace: {len(analysis.ranks)} rank(s)"
    files = "".join(f'<p class="meta">rank {r.rank}: {html.escape(r.path)} '
                    f"({html.escape(r.device)}, {len(r.steps)} stable steps)</p>"
                    for r in analysis.ranks)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{files}<div class=\"section\">{table}</div>"
            f"<div class=\"section\" id=\"timeline\">{div}</div></body></html>\n")
