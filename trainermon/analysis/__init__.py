"""Offline analysis of monitor output: per-layer trends, plots, and run-vs-benchmark comparison.

Reads trainermon's Parquet dataset, trainermon's CSV output and msprobe's CSV output (detected), in
bounded batches. Python API (pandas DataFrames / Series, dataclasses, matplotlib Figures):

    from trainermon.analysis import analyze, compare, write_analysis_report, write_comparison_report

    a = analyze("monitor_output")            # heatmaps, global_norm, spikes, growth, first_nonfinite
    a.heatmaps[("grad_reduced", "norm")]     # DataFrame: layers (model order) x steps
    write_analysis_report(a, "report_dir")   # report.html, findings.json, *.png

    c = compare("run_output", "benchmark_output", rtol=0.01)
    c.first                                  # Divergence(family, name, step, ...) or None
    c.per_family, c.divergent, c.only_in_run, c.only_in_benchmark

Lower level: `open_run` (detect and stream a RUN), `scan` (one pass into per-family grids) and the
views in `trends` (`heatmap`, `global_grad_norm`, `find_spikes`, `growth`, `first_nonfinite`).
matplotlib is needed only for figures and reports (`pip install 'trainermon[analysis]'`).
"""

from .analyze import Analysis, analyze
from .compare import Comparison, Divergence, compare, relative_difference
from .scan import RunSummary, scan
from .source import Batch, RunSource, open_run
from .trends import (
    downsample,
    find_spikes,
    first_nonfinite,
    global_grad_norm,
    growth,
    heatmap,
    nonfinite_cells,
)

__all__ = [
    "Analysis",
    "Batch",
    "Comparison",
    "Divergence",
    "RunSource",
    "RunSummary",
    "analyze",
    "compare",
    "downsample",
    "find_spikes",
    "first_nonfinite",
    "global_grad_norm",
    "growth",
    "heatmap",
    "nonfinite_cells",
    "open_run",
    "relative_difference",
    "scan",
    "write_analysis_report",
    "write_comparison_report",
    "plot_heatmap",
    "plot_global_norm",
    "plot_growth",
    "plot_divergence",
]


def __getattr__(name: str):
    # Reports and plots import matplotlib: only when they are used.
    if name in ("write_analysis_report", "write_comparison_report"):
        from . import report

        return getattr(report, name)
    if name in ("plot_heatmap", "plot_global_norm", "plot_growth", "plot_divergence"):
        from . import plots

        return getattr(plots, name)
    raise AttributeError(f"module 'trainermon.analysis' has no attribute {name!r}")
