"""matplotlib figures (object API on an Agg canvas: no display, no pyplot state); each returns a Figure."""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import pandas as pd

from .trends import downsample

#: Most y tick labels drawn on a heatmap (every k-th layer is labelled above that).
MAX_YTICKS = 40


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _integer_locator() -> Any:
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def png_bytes(fig: Any, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def heatmap_binning(stat: str) -> str:
    """How a heatmap bins steps when it has too many: the minimum for `min`, the mean for `mean`,
    otherwise the maximum (so a spike stays visible)."""
    return {"min": "min", "mean": "mean"}.get(stat, "max")


def plot_heatmap(
    df: pd.DataFrame,
    title: str,
    stat: str = "norm",
    nonfinite: pd.DataFrame | None = None,
    max_columns: int = 500,
) -> Any:
    """Layers (rows, model order, top to bottom) x steps. Log colour scale for positive statistics
    spanning more than a decade; cells with a NaN/Inf in magenta; cells without a row in light grey.
    Above `max_columns` steps, steps are binned (see `heatmap_binning`); the title says so."""
    import matplotlib
    from matplotlib import colors

    shown, width = downsample(df, max_columns, heatmap_binning(stat))
    bad = None
    if nonfinite is not None:
        bad, _ = downsample(nonfinite, max_columns, "any")
    data = shown.to_numpy(dtype=np.float64)
    finite = data[np.isfinite(data)]
    n_layers, n_cols = data.shape
    fig = _figure(12, min(max(3.0, 0.14 * n_layers + 1.8), 16.0))
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#dddddd")
    norm = None
    if finite.size:
        lo, hi = float(finite.min()), float(finite.max())
        positive = finite[finite > 0]
        if lo >= 0 and positive.size and hi / positive.min() > 10:
            norm = colors.LogNorm(vmin=float(positive.min()), vmax=hi)
            data = np.where(data > 0, data, np.where(np.isnan(data), np.nan, positive.min()))
        elif hi > lo:
            norm = colors.Normalize(vmin=lo, vmax=hi)
    masked = np.ma.masked_invalid(data)
    image = ax.imshow(masked, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    if bad is not None and bad.to_numpy().any():
        overlay = np.ma.masked_where(~bad.to_numpy(dtype=bool), np.ones_like(data))
        ax.imshow(
            overlay,
            aspect="auto",
            interpolation="nearest",
            cmap=colors.ListedColormap(["#ff00ff"]),
            vmin=0,
            vmax=1,
        )
    fig.colorbar(image, ax=ax, label=stat, shrink=0.9)
    step_every = max(1, math.ceil(n_layers / MAX_YTICKS))
    ticks = list(range(0, n_layers, step_every))
    ax.set_yticks(ticks, [str(shown.index[i]) for i in ticks], fontsize=7)
    xt = np.unique(np.linspace(0, n_cols - 1, num=min(n_cols, 10)).round().astype(int)) if n_cols else []
    ax.set_xticks(list(xt), [str(shown.columns[i]) for i in xt], fontsize=8)
    ax.set_xlabel("step" if width == 1 else f"step (bins of {width} steps, {heatmap_binning(stat)} per bin)")
    ax.set_title(title + ("" if width == 1 else f"  [{df.shape[1]} steps shown as {n_cols} columns]"))
    return fig


def plot_global_norm(series: pd.Series, spikes: pd.DataFrame | None = None) -> Any:
    """The global gradient norm over steps (log scale), spikes marked in red, NaN/Inf steps in magenta."""
    fig = _figure(12, 4)
    ax = fig.add_subplot()
    steps = series.index.to_numpy()
    values = series.to_numpy(dtype=np.float64)
    ok = np.isfinite(values) & (values > 0)
    ax.plot(steps[ok], values[ok], lw=1, color="#1f77b4", label="global grad norm")
    if ok.any():
        ax.set_yscale("log")
    bad = ~np.isfinite(values)
    for s in steps[bad]:
        ax.axvline(s, color="#ff00ff", lw=0.8, alpha=0.6)
    if bad.any():
        ax.plot([], [], color="#ff00ff", label="NaN/Inf")
    if spikes is not None and len(spikes):
        ax.scatter(spikes["step"], spikes["value"], color="red", zorder=3, label="spike")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(_integer_locator())
    ax.set_ylabel("norm")
    ax.set_title("global gradient norm (grad_reduced, all ranks)")
    ax.legend(loc="best", fontsize=8)
    ax.grid(True, alpha=0.3)
    return fig


def plot_growth(df: pd.DataFrame, title: str) -> Any:
    """Horizontal bars: growth (end / start) of the top layers, log scale."""
    rows = df[np.isfinite(df["growth"].astype(float)) & (df["growth"].astype(float) > 0)]
    fig = _figure(10, max(2.5, 0.3 * len(rows) + 1.2))
    ax = fig.add_subplot()
    if len(rows):
        y = np.arange(len(rows))
        growths = rows["growth"].to_numpy(dtype=float)
        ax.barh(y, growths, color=np.where(growths >= 1, "#d62728", "#2ca02c"))
        ax.set_yticks(y, rows["layer"].tolist(), fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", lw=0.8)
    else:
        ax.text(0.5, 0.5, "no layer with a positive start value", ha="center", va="center")
    ax.set_xlabel("growth (end / start)")
    ax.set_title(title)
    return fig


def plot_divergence(df: pd.DataFrame, title: str, rtol: float, first_step: int | None = None) -> Any:
    """Top: the statistic in both runs; bottom: the relative difference and the threshold."""
    fig = _figure(10, 5.5)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    steps = df.index.to_numpy()
    top.plot(steps, df["run"].to_numpy(dtype=float), lw=1.2, label="run")
    top.plot(steps, df["benchmark"].to_numpy(dtype=float), lw=1.2, ls="--", label="benchmark")
    top.legend(fontsize=8)
    top.set_title(title, fontsize=10)
    top.grid(True, alpha=0.3)
    rel = df["rel_diff"].to_numpy(dtype=float)
    shown = np.where(np.isfinite(rel), np.maximum(rel, 1e-12), np.nan)
    bottom.plot(steps, shown, lw=1, color="#d62728")
    bottom.axhline(rtol, color="black", ls=":", lw=1, label=f"rtol {rtol:g}")
    bottom.set_yscale("log")
    bottom.set_ylabel("rel. diff (0 drawn at 1e-12)")
    bottom.xaxis.set_major_locator(_integer_locator())
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    bottom.grid(True, alpha=0.3)
    if first_step is not None:
        for ax in (top, bottom):
            ax.axvline(first_step, color="#ff7f0e", lw=1)
    return fig
