"""One plot shape for the benchmarks (metrics against tree budget, one column per panel value) and
the one way they write their results and figures."""

from __future__ import annotations

import json
from typing import Callable


def save_results(rows: list[dict], json_path: str | None, plot_path: str | None = None,
                 plot: Callable[[str], None] | None = None) -> None:
    """Write `rows` to `json_path` (if given) and call `plot(png)`: `plot_path`, else next to the JSON
    (no PNG without a `plot`)."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {json_path}")
    if plot is None:
        return
    png = plot_path or (json_path.rsplit(".", 1)[0] + ".png" if json_path else None)
    if png:
        plot(png)
        print(f"wrote {png}")


def save_png(fig, path, dpi: int = 110) -> None:
    """`fig.savefig(path, dpi=dpi)`, then `compact_png(path)`."""
    fig.savefig(path, dpi=dpi)
    compact_png(path)


def compact_png(path, colors: int = 256) -> None:
    """Rewrite the PNG at `path` with a palette of `colors` (median cut): these line and bar plots on
    white keep their look at about a third of matplotlib's RGBA bytes, which matters for figures kept
    in the repository (the whole tree travels to a GPU machine for the GPU check)."""
    from PIL import Image

    with Image.open(path) as im:
        palette = im.convert("RGB").quantize(colors, method=Image.Quantize.MEDIANCUT)
    palette.save(path, optimize=True)


def plot_vs_budget(rows: list[dict], panel_key: str, panel_values: list, panel_title: str,
                   series: list[tuple[str, str, str]], lines: list[tuple[str, str]],
                   metrics: list[tuple[str, str]], path: str) -> None:
    """rows: benchmark records; series (method, style, label) are drawn against "budget";
    lines (method, color) are horizontal references; metrics (key, axis label) are the rows.
    With no fixed-budget rows at all there is no budget axis: the methods are drawn as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(r["method"] == m for r in rows for m, _, _ in series):
        _plot_bars(plt, rows, panel_key, panel_values, panel_title, lines, metrics, path)
        return

    fig, axes = plt.subplots(len(metrics), len(panel_values), figsize=(5.5 * len(panel_values), 3.5 * len(metrics)),
                             squeeze=False)
    for col, value in enumerate(panel_values):
        sub = [r for r in rows if r[panel_key] == value]
        for row, (key, label) in enumerate(metrics):
            ax = axes[row][col]
            for method, style, name in series:
                pts = sorted((r["budget"], r[key]) for r in sub if r["method"] == method)
                if pts:
                    ax.plot(*zip(*pts), style, label=name)
            for method, color in lines:
                for r in sub:
                    if r["method"] == method:
                        ax.axhline(r[key], color=color, ls=":", label=method)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tree budget B (draft nodes)")
            ax.set_ylabel(label)
            ax.set_title(panel_title.format(value))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)


def _plot_bars(plt, rows: list[dict], panel_key: str, panel_values: list, panel_title: str,
               methods: list[tuple[str, str]], metrics: list[tuple[str, str]], path: str) -> None:
    """One bar per method (in `methods` order, its colour), value written on top; a panel per value."""
    fig, axes = plt.subplots(len(metrics), len(panel_values), figsize=(5.5 * len(panel_values), 3.5 * len(metrics)),
                             squeeze=False)
    for col, value in enumerate(panel_values):
        sub = {r["method"]: r for r in rows if r[panel_key] == value}
        shown = [(m, c) for m, c in methods if m in sub]
        for row, (key, label) in enumerate(metrics):
            ax = axes[row][col]
            heights = [sub[m][key] for m, _ in shown]
            bars = ax.bar(range(len(shown)), heights, color=[c for _, c in shown])
            ax.bar_label(bars, fmt="%.2f" if max(heights, default=0) < 10 else "%.1f", fontsize=8)
            ax.set_xticks(range(len(shown)), [m for m, _ in shown], rotation=20, ha="right", fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(panel_title.format(value))
            ax.grid(alpha=0.3, axis="y")
            ax.margins(y=0.12)
    fig.tight_layout()
    save_png(fig, path)
