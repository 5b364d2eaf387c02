"""Charts of the benchmarks: a standalone SVG line chart (no dependency; the isolation and frontier
plots) and the matplotlib plots of ``backfill bench simulate-scale`` (matplotlib is the optional
``bench`` extra, imported only when those are drawn)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def nice_step(span: float, at_most: int) -> float:
    """The smallest of 1, 2, 5 × 10^k that cuts ``span`` (> 0) into at most ``at_most`` steps."""
    step = 10.0 ** math.floor(math.log10(span / at_most)) if span > 0 else 1.0
    for factor in (1, 2, 5, 10):
        if span / (step * factor) <= at_most:
            return step * factor
    return step * 10


def svg_line_chart(series: dict[str, list[tuple[float, float]]], *, title: str, x_label: str, y_label: str,
                   hlines: dict[str, float], vlines: dict[str, float], width: int = 860, height: int = 340) -> str:
    """A standalone SVG line chart (inline styles, no script): ``series`` ``{label: [(x, y)]}``,
    dashed horizontal reference lines ``hlines`` ``{label: y}`` and vertical markers ``vlines``
    ``{label: x}``. Axes start at 0."""
    from xml.sax.saxutils import escape

    colors = ("#2563eb", "#d97706", "#6b7280", "#7c3aed", "#059669", "#db2777", "#0891b2", "#65a30d", "#111827")
    left, right, bottom = 56, 16, 44
    legend: list[tuple[float, int]] = []  # (x, row) of each series' legend entry: rows wrap at the width
    lx, row = left + 8.0, 0
    for label in list(series)[:len(colors)]:
        if lx + 14 + 7 * len(label) > width - right and lx > left + 8:
            lx, row = left + 8.0, row + 1
        legend.append((lx, row))
        lx += 24 + 7 * len(label)
    top = 40 + 14 * row
    pw, ph = width - left - right, height - top - bottom
    xs = [x for pts in series.values() for x, _ in pts] + list(vlines.values())
    ys = [y for pts in series.values() for _, y in pts] + list(hlines.values())
    x_max = max(xs, default=1.0) or 1.0
    y_max = (max(ys, default=1.0) or 1.0) * 1.1

    def px(x: float) -> float:
        return left + x / x_max * pw

    def py(y: float) -> float:
        return top + ph - y / y_max * ph

    font = 'font-family="sans-serif" font-size="11" fill="#374151"'
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}"><rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-family="sans-serif" font-size="14" fill="#111827">{escape(title)}</text>']
    for k in range(int(y_max / (y_step := nice_step(y_max, 6))) + 1):
        y = k * y_step
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#e5e7eb"/>'
                   f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end" {font}>{y:g}</text>')
    for k in range(int(x_max / (x_step := nice_step(x_max, 10))) + 1):
        out.append(f'<text x="{px(k * x_step):.1f}" y="{top + ph + 16}" text-anchor="middle" {font}>'
                   f'{k * x_step:g}</text>')
    out.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + ph}" stroke="#6b7280"/>'
               f'<line x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" stroke="#6b7280"/>'
               f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle" {font}>{escape(x_label)}</text>'
               f'<text x="14" y="{top + ph / 2}" text-anchor="middle" transform="rotate(-90 14 {top + ph / 2})" '
               f'{font}>{escape(y_label)}</text>')
    for label, value in vlines.items():
        side = f'x="{px(value) + 4:.1f}"' if px(value) < left + pw * 0.8 else \
            f'x="{px(value) - 4:.1f}" text-anchor="end"'
        out.append(f'<line x1="{px(value):.1f}" x2="{px(value):.1f}" y1="{top}" y2="{top + ph}" stroke="#9ca3af" '
                   f'stroke-dasharray="2,3"/><text {side} y="{top + 12}" {font}>{escape(label)}</text>')
    for label, value in hlines.items():
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(value):.1f}" y2="{py(value):.1f}" stroke="#dc2626" '
                   f'stroke-dasharray="6,4"/><text x="{left + 6}" y="{py(value) + 14:.1f}" '
                   f'font-family="sans-serif" font-size="11" fill="#dc2626">{escape(label)}</text>')
    for (label, points), color, (legend_x, legend_row) in zip(series.items(), colors, legend):
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        ly = 26 + 14 * legend_row
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.6"/>'
                   f'<rect x="{legend_x:.0f}" y="{ly}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{legend_x + 14:.0f}" y="{ly + 9}" {font}>{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _lane_p99(lane: str) -> Callable[[dict[str, Any]], float | None]:
    """A run's TTFT p99 (s) of ``lane``; None when the run had no request on it."""
    def get(run: dict[str, Any]) -> float | None:
        got = run["lanes"].get(lane)
        return None if got is None else got["ttft_p99_s"]
    return get


def scale_plot(payload: dict[str, Any], path: Path, lanes: Sequence[str]) -> Path:
    """``backfill bench simulate-scale``'s six panels against the engine count as one PNG at
    ``path`` (its folder is created), from the sweep's ``payload`` (``runs``: one dict per engine
    count and policy with ``engines``, ``policy``, ``decision_p50_ms``, ``index_bytes``,
    ``captured_reuse``, ``ttft_p50_vs_round_robin`` and ``lanes[lane]["ttft_p99_s"]``;
    ``options``): decision p50, index memory, captured reuse, TTFT p50 ÷ round-robin, and TTFT p99
    per lane of ``lanes`` for the first two routed policies. Matplotlib's Agg backend. Returns
    ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    runs = payload["runs"]
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    sizes = sorted({r["engines"] for r in runs})
    colours = {p: f"C{i}" for i, p in enumerate(policies)}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), constrained_layout=True)

    def engines_axis(ax: Any) -> None:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("engines")

    def series(policy: str, get: Callable[[dict[str, Any]], float | None]) -> tuple[list[int], list[float]]:
        xs, ys = [], []
        for r in sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["engines"]):
            y = get(r)
            if y is not None:
                xs.append(r["engines"])
                ys.append(y)
        return xs, ys

    def panel(ax: Any, title: str, ylabel: str, get: Callable[[dict[str, Any]], float | None],
              only: Sequence[str] | None = None, log_y: bool = False) -> None:
        for policy in policies:
            if only is not None and policy not in only:
                continue
            xs, ys = series(policy, get)
            ax.plot(xs, ys, marker="o", label=policy, color=colours[policy])
        if log_y:
            ax.set_yscale("log")
        engines_axis(ax)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)

    routed = [p for p in policies if p != "round-robin"]
    panel(axes[0][0], "decision p50 (one scheduling decision)", "ms", lambda r: r["decision_p50_ms"], log_y=True)
    axes[0][0].axhline(0.3, color="grey", linestyle="--", linewidth=1)
    axes[0][0].text(axes[0][0].get_xlim()[0], 0.3, " goal 0.3 ms at 256", va="bottom", fontsize=8, color="grey")
    panel(axes[0][1], "prefix index memory", "MiB", lambda r: r["index_bytes"] / 2**20, only=routed)
    panel(axes[0][2], "captured reuse (cached ÷ oracle-reusable)", "share", lambda r: r["captured_reuse"])
    panel(axes[1][0], "TTFT p50 ÷ round-robin (same size)", "ratio", lambda r: r["ttft_p50_vs_round_robin"])
    lane_styles = {"interactive": "-", "async": "--", "batch": ":"}
    for ax, policy in zip((axes[1][1], axes[1][2]), (routed or policies)[:2] + [None] * 2):
        if policy is None:
            ax.axis("off")
            continue
        for lane in lanes:
            xs, ys = series(policy, _lane_p99(lane))
            if xs:
                ax.plot(xs, ys, marker="o", linestyle=lane_styles[lane], label=lane)
        ax.set_yscale("log")
        engines_axis(ax)
        ax.set_title(f"TTFT p99 by lane, {policy}")
        ax.set_ylabel("s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    opts = payload["options"]
    fig.suptitle(f"backfill simulate at scale: {opts['requests_per_engine']} requests per engine, "
                 f"{opts['tenants']} tenants, interactive + async + batch (seed {opts['seed']})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
