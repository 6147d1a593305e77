"""PNG heatmaps of attention weights, one panel per head (needs the optional matplotlib)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mha_client.analysis import attention_entropy

MATPLOTLIB_MISSING = "install matplotlib (pip install 'mha-serve[plot]') to render heatmaps"
PANELS_PER_ROW = 4
PANEL_INCHES = (3.6, 3.0)  # width, height of one head's panel


def require_matplotlib() -> None:
    """ImportError saying how to install matplotlib when it is missing (it is optional)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(MATPLOTLIB_MISSING) from None


def save_heatmap(
    weights: np.ndarray,
    heads: Sequence[int],
    path: str | Path,
    title: str | None = None,
    query_start: int = 0,
) -> None:
    """Write weights (h, R, S) of one sequence as a PNG: one panel per head with a colorbar.

    heads names each panel ("head 3, entropy 1.23 nats"); query_start labels the rows with
    their query positions. Pass only real rows and keys: padding would skew the colours.
    """
    w = np.asarray(weights, dtype=np.float32)
    if w.ndim != 3:
        raise ValueError(f"weights have shape {w.shape}; expected (heads, rows, keys)")
    if len(heads) != w.shape[0]:
        raise ValueError(f"{len(heads)} head labels for {w.shape[0]} heads of weights")
    if w.size == 0:
        raise ValueError(f"weights of shape {w.shape} are empty: no rows or keys to draw")
    require_matplotlib()
    # The Agg canvas on a bare Figure renders without pyplot, so the caller's global
    # backend and figure registry stay untouched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    num_heads, num_rows, num_keys = w.shape
    cols = min(num_heads, PANELS_PER_ROW)
    rows = math.ceil(num_heads / cols)
    fig = Figure(figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    entropy = attention_entropy(w)  # (h,)
    # Pixel centres on the query/key indices, so ticks read as positions.
    extent = (-0.5, num_keys - 0.5, query_start + num_rows - 0.5, query_start - 0.5)
    for i, ax in enumerate(axes.flat):
        if i >= num_heads:
            ax.set_axis_off()
            continue
        image = ax.imshow(
            w[i], cmap="viridis", vmin=0.0, aspect="auto", interpolation="nearest", extent=extent
        )
        ax.set_title(f"head {heads[i]}, entropy {entropy[i]:.2f} nats", fontsize=10)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        fig.colorbar(image, ax=ax)
    if title:
        fig.suptitle(title)
    fig.savefig(path, format="png", dpi=100)
