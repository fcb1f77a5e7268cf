"""One plot shape for the benchmarks (metrics against tree budget, one column per panel value) and
the one way they write their results."""

from __future__ import annotations

import json
from typing import Callable


def save_results(rows: list[dict], json_path: str | None, plot_path: str | None, plot: Callable[[str], None]) -> None:
    """Write `rows` to `json_path` (if given) and call `plot(png)`: `plot_path`, else next to the JSON."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {json_path}")
    png = plot_path or (json_path.rsplit(".", 1)[0] + ".png" if json_path else None)
    if png:
        plot(png)
        print(f"wrote {png}")


def plot_vs_budget(rows: list[dict], panel_key: str, panel_values: list, panel_title: str,
                   series: list[tuple[str, str, str]], lines: list[tuple[str, str]],
                   metrics: list[tuple[str, str]], path: str) -> None:
    """rows: benchmark records; series (method, style, label) are drawn against "budget";
    lines (method, color) are horizontal references; metrics (key, axis label) are the rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=110)
