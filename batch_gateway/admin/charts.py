"""Line charts as inline SVG, drawn on the server (no script, no CDN).

:func:`line_chart` takes time series ``{label: [(unix_s, value), ...]}`` and returns SVG markup with
axes, three horizontal grid lines, an optional dashed threshold line, relative time labels
(``-5m`` … ``now``) and a legend.
"""

from __future__ import annotations

from markupsafe import Markup, escape

COLORS = ("#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed", "#0891b2", "#be185d", "#4d7c0f")
"""Series colours, in order (colour-blind-distinguishable Tailwind 600 shades)."""


def _ago(seconds: float) -> str:
    if seconds < 1:
        return "now"
    if seconds < 120:
        return f"-{seconds:.0f}s"
    if seconds < 7200:
        return f"-{seconds / 60:.0f}m"
    return f"-{seconds / 3600:.1f}h"


def _fmt(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 or value == int(value) else f"{value:.2g}"


def line_chart(series: dict[str, list[tuple[float, float]]], *, title: str, unit: str = "",
               now: float, y_max: float | None = None, threshold: float | None = None,
               width: int = 640, height: int = 200) -> Markup:
    """An SVG chart of ``series`` (points ``(unix_s, value)``) up to ``now`` (Unix s).

    The y axis runs from 0 to ``y_max`` (default: the largest value or ``threshold``; 1 when all are 0);
    ``threshold`` draws a dashed red line. With no point at all it says "no data yet".
    """
    left, right, top, bottom = 48, 12, 24, 28
    plot_w, plot_h = width - left - right, height - top - bottom
    points = [p for values in series.values() for p in values]
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
             f'role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
             f'<text x="{left}" y="15" class="chart-title">{escape(title)}'
             f'{escape(" (" + unit + ")") if unit else ""}</text>']
    if not points:
        parts.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" text-anchor="middle" '
                     'class="chart-empty">no data yet</text></svg>')
        return Markup("".join(parts))
    t0 = min(t for t, _ in points)
    span = max(now - t0, 1.0)
    top_value = y_max if y_max is not None else max([v for _, v in points] + [threshold or 0.0])
    top_value = top_value if top_value > 0 else 1.0  # an idle series (all 0) is drawn on 0..1

    def x(t: float) -> float:
        return left + (t - t0) / span * plot_w

    def y(v: float) -> float:
        return top + plot_h - min(max(v, 0.0), top_value) / top_value * plot_h

    for fraction in (0.0, 0.5, 1.0):
        gy = y(top_value * fraction)
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{gy:.1f}" y2="{gy:.1f}" class="grid"/>'
                     f'<text x="{left - 6}" y="{gy + 4:.1f}" text-anchor="end" class="tick">'
                     f'{_fmt(top_value * fraction)}</text>')
    for fraction in (0.0, 0.5, 1.0):
        tx = left + fraction * plot_w
        anchor = ("start", "middle", "end")[int(fraction * 2)]
        parts.append(f'<text x="{tx:.1f}" y="{height - 8}" text-anchor="{anchor}" class="tick">'
                     f'{_ago(span * (1 - fraction))}</text>')
    if threshold is not None:
        ty = y(threshold)
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{ty:.1f}" y2="{ty:.1f}" class="threshold"/>')
    legend_x = left + plot_w
    for index, (label, values) in enumerate(series.items()):
        color = COLORS[index % len(COLORS)]
        if values:
            path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in sorted(values))
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
            if len(values) == 1:
                t, v = values[0]
                parts.append(f'<circle cx="{x(t):.1f}" cy="{y(v):.1f}" r="3" fill="{color}"/>')
        legend_x -= 8 + 7 * len(label) + 14
        parts.append(f'<rect x="{legend_x}" y="7" width="10" height="10" fill="{color}"/>'
                     f'<text x="{legend_x + 14}" y="16" class="legend">{escape(label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
