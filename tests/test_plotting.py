"""The benchmarks' figures: written as palette PNGs that keep every mark of the plot."""

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import plotting  # noqa: E402


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    x = np.arange(1, 65)
    for k, style in enumerate(["o-", "^--", ":", "s-"]):
        ax.plot(x, np.log2(x) * (k + 1), style, label=f"series {k}")
    ax.bar([8, 16, 32], [3, 5, 4], alpha=0.5)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig, plt


def test_a_saved_figure_is_a_smaller_palette_png_with_the_same_marks(tmp_path):
    from PIL import Image

    fig, plt = _figure()
    plain, compact = tmp_path / "plain.png", tmp_path / "compact.png"
    fig.savefig(plain, dpi=110)
    plotting.save_png(fig, compact)
    plt.close(fig)
    with Image.open(plain) as a, Image.open(compact) as b:
        assert b.mode == "P" and a.size == b.size
        rgb_a = np.asarray(a.convert("RGB"), dtype=np.int16)
        rgb_b = np.asarray(b.convert("RGB"), dtype=np.int16)
    assert compact.stat().st_size < plain.stat().st_size
    # each series keeps its colour: the pixels drawn in it come back within 8 of it per channel; a
    # 4-colour palette, the negative control, must move them further
    import matplotlib.colors

    for k in range(4):
        colour = np.array([round(v * 255) for v in matplotlib.colors.to_rgb(f"C{k}")])
        drawn = (rgb_a == colour).all(axis=2)
        assert drawn.sum() > 100, k
        assert np.abs(rgb_b[drawn] - colour).max() <= 8, k
        with Image.open(plain) as a:
            control = np.asarray(a.convert("RGB").quantize(4).convert("RGB"), dtype=np.int16)
        assert np.abs(control[drawn] - colour).max() > 8, k
