"""`analyze`: one scan of a run, then every finding of the report (tables, series, figures)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from .engines import check_engine, engine_scan, is_url, open_url, resolve_engine, session
from .grid import with_copy_marks
from .jsonutil import describe, jsonable, records
from .layer_tables import expert_load_last_step, head_logits_last_step
from .scan import RunSummary, scan
from .source import FAMILY_STATS, FLOAT_STATS, RunSource, open_run
from .superseded import split_anomalies, superseded_note
from .trends import (
    find_spikes,
    first_nonfinite,
    global_grad_norm,
    growth,
    heatmap,
    nonfinite_cells,
)
from .xrank import read_xrank, xrank_findings

#: Statistics drawn as heatmaps by default (those the run has).
DEFAULT_STATS = ("norm", "mean", "min", "max")
SPIKE_DEFAULTS = {"window": 50, "warmup": 10, "z": 6.0, "min_rel": 0.1}


@dataclass
class Analysis:
    summary: RunSummary
    heatmaps: dict[tuple[str, str], pd.DataFrame]
    nonfinite: dict[str, pd.DataFrame]
    global_norm: pd.Series
    spikes: pd.DataFrame
    growth: dict[str, pd.DataFrame]
    growth_stat: str
    first_nonfinite: pd.DataFrame
    anomalies: list[dict]
    spike_rule: dict = field(default_factory=lambda: dict(SPIKE_DEFAULTS))
    #: MoE routers x experts: tokens routed at the last step (None without moe_load rows)
    expert_load: pd.DataFrame | None = None
    xrank: dict | None = None  # findings of the cross-rank summaries (`xrank.xrank_findings`)
    engine: str = "pyarrow"
    #: attention layers x heads: each head's largest pre-softmax logit at the last step (attn_logit)
    head_logits: pd.DataFrame | None = None
    #: anomaly records of steps a restart re-did (a later run wrote them): not in `anomalies`
    superseded_anomalies: list[dict] = field(default_factory=list)

    def findings(self) -> dict:
        """The report's findings as JSON-ready data (figures are referred to by file stem)."""
        steps = sorted({int(s) for df in self.heatmaps.values() for s in df.columns})
        steps_all = steps or [int(s) for s in self.global_norm.index]
        first = None
        if len(self.first_nonfinite):
            first = records(self.first_nonfinite.head(1))[0]
        per_family = {}
        for fam, rows in self.summary.nonfinite_rows.items():
            if rows:
                per_family[fam] = {
                    "first_step": int(rows[0]["step"]),
                    "rows_with_nan_or_inf": int(self.summary.nonfinite_counts.get(fam, 0)),
                }
        gn = self.global_norm
        finite = gn[gn.notna() & (gn != float("inf"))]
        return {
            "run": describe(self.summary),
            "steps": {
                "first": steps_all[0] if steps_all else None,
                "last": steps_all[-1] if steps_all else None,
                "count": len(steps_all),
            },
            "heatmaps": [
                {
                    "family": fam,
                    "stat": stat,
                    "layers": int(df.shape[0]),
                    "steps": int(df.shape[1]),
                    "figure": _stem("heatmap", fam, stat),
                }
                for (fam, stat), df in self.heatmaps.items()
            ],
            "global_grad_norm": {
                "definition": "sqrt(sum over grad_reduced tensors of norm^2), all ranks combined",
                "steps": [int(s) for s in gn.index],
                "values": [jsonable(float(v)) for v in gn.to_numpy()],
                "max": float(finite.max()) if len(finite) else None,
                "max_step": int(finite.idxmax()) if len(finite) else None,
                "figure": "global_grad_norm" if len(gn) else None,
            },
            "spikes": records(self.spikes),
            "spike_rule": self.spike_rule,
            "growth": {
                fam: {"stat": self.growth_stat, "top": records(df), "figure": _stem("growth", fam)}
                for fam, df in self.growth.items()
            },
            "first_nonfinite": {
                "first": first,
                "per_family": per_family,
                "rows": records(self.first_nonfinite.head(50)),
            },
            "anomalies": {
                "count": len(self.anomalies),
                "by_rule": dict(Counter(a.get("rule") for a in self.anomalies)),
                "first": [jsonable(a) for a in self.anomalies[:50]],
                "superseded": {
                    "count": len(self.superseded_anomalies),
                    "by_run": dict(Counter(a.get("run_id") for a in self.superseded_anomalies)),
                    "first": [jsonable(a) for a in self.superseded_anomalies[:50]],
                },
            },
            "xrank": self.xrank,
            "engine": self.engine,
            "notes": self.summary.notes,
            "expert_load": None
            if self.expert_load is None
            else {
                "step": int(self.expert_load.attrs.get("step", -1)),
                "layers": list(self.expert_load.index),
                "tokens": [[jsonable(float(v)) for v in row] for row in self.expert_load.to_numpy()],
                "figure": "moe_expert_load",
            },
            "head_logits": None
            if self.head_logits is None
            else {
                "step": int(self.head_logits.attrs.get("step", -1)),
                "layers": list(self.head_logits.index),
                "max_logit": [[jsonable(float(v)) for v in row] for row in self.head_logits.to_numpy()],
                "figure": "attn_head_logits",
            },
        }

    def figures(self, max_columns: int = 500) -> dict[str, Any]:
        """{file stem: matplotlib Figure} for every plot of the report."""
        return dict(self.iter_figures(max_columns))

    def iter_figures(self, max_columns: int = 500) -> Iterator[tuple[str, Any]]:
        """(file stem, Figure) one at a time (the report draws and drops each in turn)."""
        from .plots import plot_global_norm, plot_growth, plot_heatmap

        for (fam, stat), df in self.heatmaps.items():
            title = f"{fam} {stat} per layer (model order) and step"
            bad = self.nonfinite.get(fam)
            yield _stem("heatmap", fam, stat), plot_heatmap(df, title, stat, bad, max_columns)
        if len(self.global_norm):
            yield "global_grad_norm", plot_global_norm(self.global_norm, self.spikes)
        for fam, df in self.growth.items():
            title = f"{fam}: top layers by growth of {self.growth_stat} (end / start of the run)"
            yield _stem("growth", fam), plot_growth(df, title)
        if self.expert_load is not None:
            step = self.expert_load.attrs.get("step")
            title = f"MoE tokens per expert (router x expert) at step {step}"
            fig = plot_heatmap(self.expert_load, title, "tokens", None, 10_000)
            fig.axes[0].set_xlabel("expert")
            yield "moe_expert_load", fig
        if self.head_logits is not None:
            step = self.head_logits.attrs.get("step")
            title = f"Largest pre-softmax attention logit (layer x head) at step {step}"
            fig = plot_heatmap(self.head_logits, title, "max logit", None, 10_000)
            fig.axes[0].set_xlabel("head")
            yield "attn_head_logits", fig


def _stem(*parts: str) -> str:
    return "_".join(p.replace("/", "-") for p in parts)


def analyze(
    run: str | os.PathLike | RunSource,
    families: Iterable[str] | None = None,
    stats: Iterable[str] | None = None,
    steps: tuple[int, int] | None = None,
    ranks: Iterable[int] | None = None,
    top: int = 10,
    spike_rule: dict | None = None,
    progress: bool | None = None,
    batch_size: int = 65_536,
    engine: str = "pyarrow",
    spark_master: str | None = None,
) -> Analysis:
    """Scan `run` once and compute the report's findings.

    families: families for heatmaps, growth and NaN/Inf search (default: all in the run). The global
    gradient norm always reads `grad_reduced` norms when the run has them. stats: heatmap statistics
    (default: norm, mean, min, max, those the run has). steps: inclusive (first, last). ranks: a subset.
    engine: "pyarrow" (stream in this process), "duckdb" or "spark" (SQL, `engines.py`), or "auto"
    (duckdb for Parquet when installed, else pyarrow; the CLI's default); the same findings from each.
    spark_master: the Spark master URL (default local[*]).
    """
    source, engine = open_with(run, engine, spark_master)
    # xrank rows summarise other families over ranks: their own findings, not a family of tensors
    available = [f for f in source.families() if f != "xrank"]
    if families is None:
        fams = available
    else:
        fams = list(dict.fromkeys(families))
        unknown = [f for f in fams if f not in available]
        if "xrank" in unknown and "xrank" in source.families():  # there, but not a family of tensors
            raise KeyError(
                f"--family xrank: the cross-rank summaries in {source.path!r} are read automatically (the "
                f"report's xrank findings); choose --family among {available}"
            )
        if unknown:
            raise KeyError(f"families {unknown} are not in {source.path!r} (it has {available})")
    if ranks is not None:
        ranks = [int(r) for r in ranks]
        present = sorted({r for f in fams for r in source.ranks(f)})
        missing = sorted(set(ranks) - set(present))
        if missing:  # a wrong rank must not read as "no rows for the given filters"
            which = "" if families is None else f" for families {fams}"
            raise KeyError(f"ranks {missing} are not in {source.path!r}{which} (it has ranks {present})")
    wanted = list(DEFAULT_STATS if stats is None else stats)
    bad_stats = [s for s in wanted if s not in FLOAT_STATS + ("nans", "infs")]
    if bad_stats:
        raise KeyError(f"unknown statistics {bad_stats}; allowed: {list(FLOAT_STATS) + ['nans', 'infs']}")
    scan_stats = with_copy_marks(list(dict.fromkeys(wanted + ["nans", "infs"])))
    family_stats = {f: scan_stats + list(FAMILY_STATS.get(f, ())) for f in fams}
    if "grad_reduced" in available and "grad_reduced" not in fams:
        family_stats["grad_reduced"] = with_copy_marks(["norm", "nans", "infs"])
    if engine == "pyarrow":
        summary = scan(
            source,
            families=list(family_stats),
            family_stats=family_stats,
            steps=steps,
            ranks=ranks,
            progress=progress,
            batch_size=batch_size,
            label="analyze",
        )
        summary.xrank_rows = read_xrank(source, steps)
    else:
        summary = engine_scan(source, engine, family_stats, steps, ranks, spark_master, xrank=True)
    summary.ranks = ranks
    if "grad_reduced" not in fams:
        summary.nonfinite_rows.pop("grad_reduced", None)
        summary.nonfinite_counts.pop("grad_reduced", None)
    heatmaps: dict[tuple[str, str], pd.DataFrame] = {}
    nonfinite: dict[str, pd.DataFrame] = {}
    growth_tables: dict[str, pd.DataFrame] = {}
    growth_stat = "norm" if "norm" in wanted else wanted[0]
    for fam in fams:
        grid = summary.grids[fam]
        if not len(grid.tensors):
            continue
        nonfinite[fam] = nonfinite_cells(summary, fam)
        for stat in wanted + list(FAMILY_STATS.get(fam, ())):  # update: a ratio heatmap as well
            if stat in grid.seen_stats:
                heatmaps[(fam, stat)] = heatmap(summary, fam, stat)
        if growth_stat in grid.seen_stats:
            growth_tables[fam] = growth(summary, fam, growth_stat, top=top)
    if stats is not None and summary.rows_read:
        _check_recorded(summary, fams, wanted, source.path)
    rule = {**SPIKE_DEFAULTS, **(spike_rule or {})}
    norm = global_grad_norm(summary)
    anomalies, gone = split_anomalies(source, steps, ranks)
    if gone:
        summary.notes.append(superseded_note(gone))
    return Analysis(
        summary=summary,
        heatmaps=heatmaps,
        nonfinite=nonfinite,
        global_norm=norm,
        spikes=find_spikes(norm, **rule),
        growth=growth_tables,
        growth_stat=growth_stat,
        # the statistics asked for: the copy marks scanned with the norm are not the user's columns
        first_nonfinite=first_nonfinite(summary).drop(
            columns=[s for s in scan_stats if s not in wanted + ["nans", "infs"]], errors="ignore"
        ),
        anomalies=anomalies,
        superseded_anomalies=gone,
        spike_rule=rule,
        expert_load=expert_load_last_step(source, steps) if "moe_load" in fams else None,
        xrank=xrank_findings(summary.xrank_rows, summary.grids),
        engine=engine,
        head_logits=head_logits_last_step(source, steps) if "attn_logit" in fams else None,
    )


def _check_recorded(summary: RunSummary, fams: list[str], wanted: list[str], path: Any) -> None:
    """Statistics asked for by name that the selected families never recorded: an error when none was,
    a note naming them when some were (a report without them must not look complete)."""
    seen = set().union(*(summary.grids[f].seen_stats for f in fams if f in summary.grids))
    missing = [s for s in wanted if s not in seen]
    if missing and len(missing) == len(wanted):
        raise KeyError(
            f"statistics {missing} are not recorded in {path!r} for families {fams} (the run's config "
            "`ops` chose what was recorded)"
        )
    if missing:
        summary.notes.append(
            f"statistics {missing} are not recorded in the selected rows: no heatmap for them"
        )


def open_with(
    run: str | os.PathLike | RunSource, engine: str, spark_master: str | None, run_id: str | None = None
) -> tuple[RunSource, str]:
    """(source, engine): "auto" resolved (`engines.resolve_engine`) once the RUN's kind is known."""
    check_engine(engine)
    if engine == "auto" and not is_url(run):
        source = _open(run, "pyarrow", spark_master, run_id)
        return source, resolve_engine(engine, [source])
    engine = resolve_engine(engine, [run])
    return _open(run, engine, spark_master, run_id), engine


def _open(
    run: str | os.PathLike | RunSource, engine: str, spark_master: str | None, run_id: str | None = None
) -> RunSource:
    """A RunSource; a URL (s3://...) is listed by the engine (pyarrow reads local paths only)."""
    if isinstance(run, RunSource):
        return run
    if is_url(run):
        if engine == "pyarrow":
            raise ValueError(f"{run!r}: the pyarrow engine reads local paths; use --engine duckdb or spark")
        sess = session(engine, spark_master)
        try:
            return open_url(str(run), sess, run_id)
        finally:
            sess.close()
    return open_run(run, run_id=run_id)
