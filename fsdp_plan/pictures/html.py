"""One self-contained HTML page of a plan (``--html REPORT.html``): memory over the step by what
holds it, the frontier of budgets, the two-stream timeline and the blocks' checkpointing.

[Note: a page that loads nothing]
The page must open anywhere, offline included: plotly's JavaScript is inlined once
(``include_plotlyjs=True`` for the first figure, ``False`` after), its logo link and MathJax
are off, and every style is in the page. plotly (the optional ``html`` extra) is imported
here only, inside ``render_page``; planning never needs it. Plain data comes in (``Page``,
pictures/page.py); nothing here reads a model or a plan file.
"""

from __future__ import annotations

import html
from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.cost.memory_categories import MEMORY_CATEGORIES
from fsdp_plan.pictures.page import Page
from fsdp_plan.pictures.series import CATEGORIES

COLORS = {c.key: c.color for c in MEMORY_CATEGORIES}
"""One colour per kind of memory (cost/memory_categories.py)."""
LANES = {"FW": ("compute", "#4472c4"), "BW": ("compute", "#ed7d31"),
         "optimizer": ("compute", "#7030a0"), "AG": ("communication", "#70ad47"),
         "RS": ("communication", "#ffc000"), "AR": ("communication", "#c55a11"),
         "wait": ("waits", "#c00000"), "tail": ("waits", "#7f0000"),
         "host": ("host", "#7f7f7f")}
CONFIG = {"displaylogo": False, "responsive": True}
_GB = 1e9


def plotly_or_exit() -> Any:
    """plotly, or ``BadInput`` (exit 2) saying which extra to install."""
    try:
        import plotly
    except ImportError as e:
        raise BadInput("--html needs plotly, the optional html extra: pip install "
                       "'fsdp-plan[html]' (or pip install plotly); nothing was written.") from e
    return plotly


def _size(num_bytes: float) -> str:
    """``80.0 GB``, or ``20.0 MB`` for a budget below 1 GB (the axis is in GB)."""
    return f"{num_bytes / _GB:.1f} GB" if num_bytes >= _GB else f"{num_bytes / 1e6:.1f} MB"


def _memory_figure(page: Page) -> Any:
    import plotly.graph_objects as go

    s = page.series
    x = [t * 1e3 for t in s.times_s]
    fig = go.Figure()
    for key, values in s.parts.items():
        if not any(values):
            continue
        fig.add_trace(go.Scatter(
            x=x, y=[v / _GB for v in values], name=CATEGORIES.get(key, key), mode="lines",
            stackgroup="memory", line={"width": 0.5, "shape": "hv",
                                       "color": COLORS.get(key, "#999999")},
            customdata=s.labels, hovertemplate="%{y:.2f} GB at %{x:.1f} ms<br>%{customdata}"))
    if page.measured:
        mx, my = page.measured
        fig.add_trace(go.Scatter(x=[t * 1e3 for t in mx], y=[v / _GB for v in my],
                                 name=page.measured_label, mode="lines+markers",
                                 line={"color": "black", "width": 1.5}, marker={"size": 3}))
    peak_at = s.peak_index
    fig.add_trace(go.Scatter(x=[x[peak_at]], y=[s.totals[peak_at] / _GB], mode="markers+text",
                             name="predicted peak", marker={"color": "black", "size": 9,
                                                            "symbol": "x"},
                             text=[f"peak {format_bytes(s.peak_bytes)}"],
                             textposition="top center"))
    fig.add_hline(y=page.budget_bytes / _GB, line={"color": "#c00000", "dash": "dash"},
                  annotation_text=f"budget {_size(page.budget_bytes)}",
                  annotation_position="top left")
    fig.add_hline(y=page.limit_bytes / _GB, line={"color": "#ff7f00", "dash": "dot"},
                  annotation_text=f"budget - headroom {_size(page.limit_bytes)}",
                  annotation_position="bottom left")
    for start, end, name, colour in ((0.0, s.forward_end_s, "forward", "#dae3f3"),
                                     (s.forward_end_s, s.backward_end_s, "backward", "#fbe5d6"),
                                     (s.backward_end_s, s.step_s, "optimizer", "#e4dfec")):
        if end > start:
            fig.add_vrect(x0=start * 1e3, x1=end * 1e3, fillcolor=colour, opacity=0.35,
                          line_width=0, layer="below", annotation_text=name,
                          annotation_position="bottom left")
    fig.update_layout(title="Memory per GPU over one step, by what holds it", height=520,
                      xaxis_title="ms into the step (predicted clock)", yaxis_title="GB",
                      legend={"orientation": "v"}, margin={"t": 60, "r": 20})
    return fig


def _frontier_figure(page: Page) -> Any:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    f = page.frontier
    assert f is not None
    pts = [p for p in f.points if p.fits]
    x = [p.budget_bytes / _GB for p in pts]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.62, 0.38],
                        vertical_spacing=0.06, specs=[[{"secondary_y": True}], [{}]])
    hover = [f"{p.name}<br>peak {format_bytes(p.peak_bytes)}<br>mesh {p.strategy} {p.mesh}, "
             f"{p.units} units, micro-batch {p.micro_batch}" for p in pts]
    fig.add_trace(go.Scatter(x=x, y=[p.step_s for p in pts], name="best step time (s)",
                             mode="lines+markers", line={"shape": "hv", "color": "#4472c4"},
                             customdata=hover, hovertemplate="%{y:.4g} s at %{x:.1f} GB"
                             "<br>%{customdata}"), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=[p.tokens_per_s for p in pts], name="tokens/s per GPU",
                             mode="lines+markers", line={"shape": "hv", "color": "#70ad47",
                                                         "dash": "dot"}),
                  row=1, col=1, secondary_y=True)
    fig.add_trace(go.Bar(x=x, y=[p.full for p in pts], name="fully checkpointed blocks",
                         marker_color="#c00000"), row=2, col=1)
    fig.add_trace(go.Bar(x=x, y=[p.selective for p in pts], name="selectively checkpointed",
                         marker_color="#ffc000"), row=2, col=1)
    fig.add_trace(go.Scatter(x=x, y=[p.units for p in pts], name="units", mode="lines+markers",
                             line={"shape": "hv", "color": "#404040"}), row=2, col=1)
    user = f.user_budget_bytes / _GB
    fig.add_vline(x=user, line={"color": "#c00000", "dash": "dash"},
                  annotation_text=f"your budget {_size(f.user_budget_bytes)}",
                  annotation_position="top")
    shown = 0
    for change in f.changes():
        if change["knob"] in ("mesh", "units", "micro-batch") and shown < 8:
            shown += 1
            fig.add_annotation(x=change["budget_bytes"] / _GB, y=0.15, yref="y domain",
                               text=f"{change['knob']}: {change['from']} → {change['to']}",
                               showarrow=True, arrowhead=2, ay=-20 - 22 * (shown % 3),
                               font={"size": 10}, bgcolor="rgba(255,255,255,0.8)",
                               row=1, col=1)
    fig.update_layout(title="What more memory buys: the best plan at each budget", height=560,
                      barmode="stack", margin={"t": 60, "r": 20})
    fig.update_yaxes(title_text="step s", row=1, col=1, secondary_y=False, rangemode="tozero")
    fig.update_yaxes(title_text="tokens/s/GPU", row=1, col=1, secondary_y=True,
                     rangemode="tozero")
    fig.update_yaxes(title_text="blocks / units", row=2, col=1)
    fig.update_xaxes(title_text="--mem budget per GPU (GB)", row=2, col=1)
    return fig


def _lane_of(lane: str, label: str) -> str:
    if lane == "wait":
        return "tail" if "tail" in label else "wait"
    if lane == "host":  # [Note: the host floor] in cost/streams.py
        return "host"
    if label.startswith("optimizer"):
        return "optimizer"
    return label.split(" ", 1)[0]


def _timeline_figure(page: Page) -> Any:
    import plotly.graph_objects as go

    rows: dict[str, dict[str, list]] = {}
    for lane, label, start, end in page.time.spans:
        kind = _lane_of(lane, label)
        row, _ = LANES.get(kind, ("compute", "#999999"))
        r = rows.setdefault(kind, {"y": [], "base": [], "x": [], "text": []})
        r["y"].append(f"predicted {row}")
        r["base"].append(start * 1e3)
        r["x"].append(max((end - start) * 1e3, 1e-6))
        r["text"].append(label)
    names = {"FW": "forward", "BW": "backward (and recompute)", "optimizer": "optimizer",
             "AG": "all-gather", "RS": "reduce-scatter", "AR": "all-reduce",
             "wait": "compute waits for an all-gather", "tail": "exposed tail after backward",
             "host": "the host issuing the device's work"}
    fig = go.Figure()
    for kind, r in rows.items():
        fig.add_trace(go.Bar(orientation="h", y=r["y"], x=r["x"], base=r["base"],
                             name=names.get(kind, kind), text=r["text"], textposition="none",
                             marker_color=LANES.get(kind, ("", "#999999"))[1],
                             hovertemplate="%{text}: %{base:.2f} ms + %{x:.2f} ms"))
    measured = page.measured_streams or {}
    for key, colour, label in (("compute", "#2f5597", "measured compute"),
                               ("comm", "#548235", "measured communication"),
                               ("exposed", "#c00000", "measured exposed communication")):
        spans = measured.get(key) or []
        if spans:
            fig.add_trace(go.Bar(orientation="h", y=[label] * len(spans),
                                 x=[max((e - s) * 1e3, 1e-6) for s, e in spans],
                                 base=[s * 1e3 for s, _ in spans], name=label,
                                 marker_color=colour, hovertemplate="%{base:.2f} ms + %{x:.2f} ms"))
    order = ["predicted waits", "predicted communication", "predicted compute"]
    if measured:
        order = ["measured exposed communication", "measured communication",
                 "measured compute"] + order
    title = "One step on two streams (compute, communication) and the waits"
    if "host" in rows:  # the host fell behind somewhere: [Note: the host floor]
        order.append("predicted host")
        title += ", below the host that issues the work"
    fig.update_layout(title=title,
                      barmode="overlay", height=380 + 40 * bool(measured),
                      xaxis_title="ms into the step", margin={"t": 60, "r": 20},
                      yaxis={"categoryorder": "array", "categoryarray": order})
    return fig


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_STYLE = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 24px;
       color: #222; max-width: 1400px; }
h1 { font-size: 22px; margin-bottom: 4px; }
p.meta { margin: 2px 0; color: #444; font-size: 14px; }
p.legend { font-size: 12px; color: #555; }
.section { margin-top: 18px; }
table { border-collapse: collapse; font-size: 12px; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: left; }
th { background: #f2f2f2; }
.notes li { font-size: 13px; color: #444; }
"""


def render_page(page: Page) -> str:
    """The whole page ([Note: a page that loads nothing])."""
    plotly_or_exit()
    figures = [("memory", _memory_figure(page))]
    if page.frontier is not None and any(p.fits for p in page.frontier.points):
        figures.append(("frontier", _frontier_figure(page)))
    figures.append(("timeline", _timeline_figure(page)))
    parts = []
    for i, (name, fig) in enumerate(figures):
        parts.append(f'<div class="section" id="{name}">' + fig.to_html(
            full_html=False, include_plotlyjs=(i == 0), include_mathjax=False, config=CONFIG,
            div_id=f"figure-{name}") + "</div>")
    meta = "".join(f'<p class="meta">{html.escape(line)}</p>' for line in page.header)
    legend = (f'<p class="legend">plan name: {html.escape(page.legend)}</p>'
              if page.legend else "")
    blocks = ""
    if page.blocks:
        blocks = ('<div class="section" id="blocks"><h2>Per block: unit and checkpointing</h2>'
                  + _table(["block", "unit", "checkpointing", "activations it saves",
                            "recompute ms"],
                           [[b["block"], b["unit"], b["mode"],
                             format_bytes(b["saved_bytes"]) if b["saved_bytes"] else "-",
                             f"{b['recompute_s'] * 1e3:.2f}" if b["recompute_s"] else "-"]
                            for b in page.blocks]) + "</div>")
    notes = ("<ul class=\"notes\">" + "".join(f"<li>{html.escape(n)}</li>" for n in page.notes)
             + "</ul>") if page.notes else ""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(page.title)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>{html.escape(page.title)}</h1>{meta}{legend}{notes}{''.join(parts)}{blocks}"
            "</body></html>\n")
