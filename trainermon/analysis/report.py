"""Write reports: PNG files, one self-contained HTML page (the PNGs embedded as base64) and JSON findings."""

from __future__ import annotations

import base64
import html
import json
import os
from collections.abc import Iterable
from typing import Any

import pandas as pd

from .analyze import Analysis
from .compare import Comparison
from .jsonutil import jsonable
from .plots import png_bytes

_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.4em 0; }
.note { color: #555; font-size: 0.9em; } .bad { color: #b00; font-weight: bold; } .ok { color: #070; }
"""


def _table(df: pd.DataFrame, max_rows: int = 50) -> str:
    if df is None or len(df) == 0:
        return "<p class='note'>none</p>"
    more = (
        f"<p class='note'>{len(df) - max_rows} more rows in the JSON findings</p>"
        if len(df) > max_rows
        else ""
    )
    return (
        df.head(max_rows).to_html(index=False, na_rep="", float_format=lambda v: f"{v:.6g}", border=0) + more
    )


def _img(data: bytes, alt: str) -> str:
    encoded = base64.b64encode(data).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}">'


def _write_figures(figs: Iterable[tuple[str, Any]], out_dir: str, dpi: int) -> dict[str, tuple[str, bytes]]:
    """Draw each figure, write its PNG and drop the figure before the next one is made."""
    written = {}
    for stem, fig in figs:
        data = png_bytes(fig, dpi)
        fig.clear()
        path = os.path.join(out_dir, f"{stem}.png")
        with open(path, "wb") as fh:
            fh.write(data)
        written[stem] = (path, data)
    return written


def _page(title: str, body: list[str]) -> str:
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _ranks(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 20 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"


def _notes(notes: list[str]) -> str:
    return "".join(f"<p class='note'>{html.escape(n)}</p>" for n in notes)


def _drop_stale_figures(out_dir: str, json_name: str, written: dict) -> None:
    """Remove the PNGs an earlier report in `out_dir` listed (its `json_name`) that this one did not write:
    a reused --out must not keep a divergence plot beside a report that says none."""
    try:
        with open(os.path.join(out_dir, json_name), encoding="utf-8") as fh:
            earlier = json.load(fh).get("figures", {})
    except (OSError, ValueError, AttributeError):
        return  # none, or not ours: nothing is removed
    kept = {os.path.basename(path) for path, _ in written.values()}
    for name in set(earlier.values()) - kept if isinstance(earlier, dict) else ():
        if isinstance(name, str) and name == os.path.basename(name) and name.endswith(".png"):
            try:
                os.remove(os.path.join(out_dir, name))
            except OSError:
                pass  # gone already


def write_analysis_report(
    analysis: Analysis, out_dir: str | os.PathLike, dpi: int = 100, max_columns: int = 500
) -> dict[str, Any]:
    """Write `report.html`, `findings.json` and one PNG per figure into `out_dir`; return their paths
    ({"html": ..., "json": ..., "png": {stem: path}})."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    findings = analysis.findings()
    written = _write_figures(analysis.iter_figures(max_columns=max_columns), out_dir, dpi)
    _drop_stale_figures(out_dir, "findings.json", written)
    findings["figures"] = {stem: os.path.basename(path) for stem, (path, _) in written.items()}
    findings["heatmap_max_columns"] = max_columns
    json_path = os.path.join(out_dir, "findings.json")
    with open(json_path, "w", encoding="utf-8") as fh:
        json.dump(jsonable(findings), fh, indent=1)

    run = findings["run"]
    body = [f"<h1>trainermon analysis: {html.escape(run['path'])}</h1>"]
    steps = findings["steps"]
    body.append(
        f"<p>{html.escape(run['kind'])} output, ranks {_ranks(run['ranks'])}, "
        f"steps {steps['first']}&ndash;{steps['last']} ({steps['count']} collected), "
        f"{run['rows_read']:,} rows read in {run['seconds']:.1f} s.</p>"
    )
    body.append(_notes(findings["notes"]))

    body.append("<h2>First NaN / Inf</h2>")
    first = findings["first_nonfinite"]["first"]
    if first is None:
        body.append("<p class='ok'>no NaN or Inf in the statistics read</p>")
    else:
        micro = "" if first.get("micro_step") is None else f", micro-step {first['micro_step']}"
        body.append(
            f"<p class='bad'>step {first['step']}{micro}: {html.escape(first['family'])} "
            f"{html.escape(first['name'])} (rank {first['rank']})</p>"
        )
        body.append(_table(analysis.first_nonfinite, 20))

    xr = findings.get("xrank")
    if xr is not None:  # the monitor's cross-rank summaries (family xrank): which rank
        body.append("<h2>Across ranks</h2>")
        first = xr["first_nonfinite"]
        if first is None:
            body.append("<p class='ok'>no rank saw a NaN or Inf in the summarised families</p>")
        else:
            micro = "" if first.get("micro_step") is None else f", micro-step {first['micro_step']}"
            what = " ".join(html.escape(first[k]) for k in ("family", "name", "stat"))
            body.append(
                f"<p class='bad'>first non-finite: step {first['step']}{micro}: {what}, "
                f"first on rank {first['rank']}</p>"
            )
        body.append(_table(pd.DataFrame(xr["largest"])))

    body.append("<h2>Global gradient norm</h2>")
    gn = findings["global_grad_norm"]
    if "global_grad_norm" in written:
        body.append(
            "<p class='note'>sqrt of the sum of squares of every grad_reduced tensor's norm per step, all "
            "ranks combined (shards summed, copies counted once). Spikes: log(norm) more than "
            f"{analysis.spike_rule['z']:g} robust deviations above the median of the previous "
            f"{analysis.spike_rule['window']} steps, from step {analysis.spike_rule['warmup']} on (the "
            "first steps only fill the window).</p>"
        )
        body.append(_img(written["global_grad_norm"][1], "global gradient norm"))
        spikes = analysis.spikes
        body.append(f"<p>{len(spikes)} spike(s); largest norm {gn['max']} at step {gn['max_step']}</p>")
        body.append(_table(spikes, 30))
    else:
        body.append("<p class='note'>no grad_reduced norms in this run</p>")

    body.append("<h2>Top layers by growth</h2>")
    for fam, df in analysis.growth.items():
        body.append(f"<h3>{html.escape(fam)} ({html.escape(analysis.growth_stat)})</h3>")
        stem = f"growth_{fam}"
        if stem in written:
            body.append(_img(written[stem][1], stem))
        body.append(_table(df))

    body.append("<h2>Layer &times; step heatmaps</h2>")
    body.append(
        f"<p class='note'>Layers in model order, top to bottom. Magenta: a NaN or Inf in the cell; grey: "
        f"no row. Runs with more than {max_columns} steps are binned (max per bin; min for 'min', mean "
        "for 'mean'), as each plot's x label says.</p>"
    )
    for item in findings["heatmaps"]:
        stem = item["figure"]
        if stem in written:
            body.append(f"<h3>{html.escape(item['family'])} {html.escape(item['stat'])}</h3>")
            body.append(_img(written[stem][1], stem))

    body.append("<h2>Anomalies recorded during the run</h2>")
    an = findings["anomalies"]
    if an["count"] == 0:
        body.append("<p class='note'>none recorded (or no anomaly_detected/ directory next to the run)</p>")
    else:
        body.append(f"<p>{an['count']} anomalies: {html.escape(json.dumps(an['by_rule']))}</p>")
        body.append(_table(pd.DataFrame(analysis.anomalies[:50])))

    html_path = os.path.join(out_dir, "report.html")
    with open(html_path, "w", encoding="utf-8") as fh:
        fh.write(_page("trainermon analysis", body))
    return {"html": html_path, "json": json_path, "png": {s: p for s, (p, _) in written.items()}}


def write_comparison_report(
    comparison: Comparison, out_dir: str | os.PathLike, dpi: int = 100, max_plots: int = 6
) -> dict[str, Any]:
    """Write `compare.html`, `compare.json` and the divergence PNGs into `out_dir`; return their paths."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    findings = comparison.findings()
    written = _write_figures(comparison.iter_figures(max_plots=max_plots), out_dir, dpi)
    _drop_stale_figures(out_dir, "compare.json", written)
    findings["figures"] = {stem: os.path.basename(path) for stem, (path, _) in written.items()}
    json_path = os.path.join(out_dir, "compare.json")
    with open(json_path, "w", encoding="utf-8") as fh:
        json.dump(jsonable(findings), fh, indent=1)

    run, bench = findings["run"], findings["benchmark"]
    body = ["<h1>trainermon compare</h1>"]
    body.append(
        f"<p>run: {html.escape(run['path'])} ({html.escape(run['kind'])})<br>"
        f"benchmark: {html.escape(bench['path'])} ({html.escape(bench['kind'])})<br>"
        f"statistics {html.escape(', '.join(comparison.stats))}; a cell diverges when "
        f"|run - benchmark| / max(|benchmark|, 1e-12) &gt; {comparison.rtol:g}"
        + (f" (+ atol {comparison.atol:g})" if comparison.atol else "")
        + ", or when one side is NaN/Inf and the other is not.</p>"
    )
    first = comparison.first
    # a family with no cell lined up was not checked: "no divergence" must not cover it
    unchecked = comparison.per_family.loc[comparison.per_family["cells_compared"] == 0, "family"].tolist()
    if first is None and unchecked:
        body.append(
            f"<p class='bad'>no divergence in the cells compared; families with 0 cells compared (NOT "
            f"checked): {html.escape(', '.join(unchecked))}</p>"
        )
    elif first is None:
        body.append("<p class='ok'>no divergence</p>")
    else:
        micro = "" if first.micro_step is None else f", micro-step {first.micro_step}"
        body.append(
            f"<p class='bad'>first divergence: step {first.step}{micro}, {html.escape(first.family)} "
            f"{html.escape(first.label)} ({html.escape(first.stat)}: run {first.run_value:.6g}, benchmark "
            f"{first.benchmark_value:.6g}, relative difference {first.rel_diff:.3g})</p>"
        )
    body.append(_notes(comparison.notes + run["notes"] + bench["notes"]))
    body.append("<h2>Per family</h2>")
    body.append(_table(comparison.per_family))
    if comparison.families_only_in_run or comparison.families_only_in_benchmark:
        body.append(
            f"<p>families only in the run: {comparison.families_only_in_run}; only in the benchmark: "
            f"{comparison.families_only_in_benchmark}</p>"
        )
    body.append("<h2>Diverging tensors (in the order they diverged)</h2>")
    body.append(_table(comparison.divergent))
    for stem, (_path, data) in written.items():
        body.append(_img(data, stem))
    body.append("<h2>Tensors only in the run</h2>")
    body.append(_table(comparison.only_in_run, 200))
    body.append("<h2>Tensors only in the benchmark</h2>")
    body.append(_table(comparison.only_in_benchmark, 200))
    html_path = os.path.join(out_dir, "compare.html")
    with open(html_path, "w", encoding="utf-8") as fh:
        fh.write(_page("trainermon compare", body))
    return {"html": html_path, "json": json_path, "png": {s: p for s, (p, _) in written.items()}}
