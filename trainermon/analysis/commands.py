"""The `trainermon analyze` and `trainermon compare` commands (argument parsing lives in trainermon/cli.py).

Kept apart from the CLI's other commands so that `trainermon on/off` never imports pandas or the engines.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..cli import STEPS, step_range
from .analyze import _open, analyze
from .compare import compare
from .engines import is_url, resolve_engine
from .report import write_analysis_report, write_comparison_report
from .source import open_run


def _split(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def _error(exc: Exception) -> int:
    """Bad input, or an engine's own error (DuckDB, Spark, Arrow on a damaged file): one line, exit 2."""
    if isinstance(exc, (FileNotFoundError, KeyError, ValueError, ImportError)):
        message = str(exc.args[0] if exc.args else exc)  # ours: may list names on more lines
    else:  # an engine's: its first line (DuckDB appends the SQL it ran)
        message = (f"{type(exc).__name__}: {exc}".strip().splitlines() or [""])[0]
    if "JAVA_GATEWAY_EXITED" in message or "JAVA_HOME" in message:
        message = f"the Spark engine needs a Java 17+ runtime (JAVA_HOME, or java on PATH): {message}"
    print(f"error: {message}", file=sys.stderr)
    return 2


def _write(writer: Any, result: Any, out: str, **options: Any) -> dict | None:
    """The report's paths, or None (said) when `--out` cannot be written."""
    try:
        return writer(result, out, **options)
    except OSError as exc:
        print(f"error: --out {out!r}: cannot write the report: {exc}", file=sys.stderr)
        return None


def _progress(args: argparse.Namespace) -> bool | None:
    return True if args.progress else False if args.no_progress else None


def run_analyze(args: argparse.Namespace) -> int:
    """`trainermon analyze RUN`: read RUN, write the report, print the findings; 2 on bad input."""

    # each option parsed on its own: an error names only the one that is wrong
    try:
        steps = step_range(args.steps)
    except ValueError:
        print(f"error: --steps {args.steps!r}: allowed: {STEPS}", file=sys.stderr)
        return 2
    try:
        ranks = [int(r) for r in _split(args.ranks) or []] or None
    except ValueError:
        given = ",".join(args.ranks)
        print(f"error: --ranks {given!r}: allowed: integer ranks, R or R,R,...", file=sys.stderr)
        return 2
    try:
        if is_url(args.run):  # object storage: listed by the engine
            engine = resolve_engine(args.engine, [args.run])
            source = _open(args.run, engine, args.spark_master, args.run_id)
        else:
            source = open_run(args.run, prefer=args.format, run_id=args.run_id)
            engine = resolve_engine(args.engine, [source])
        result = analyze(
            source,
            families=_split(args.family),
            stats=_split(args.stat),
            steps=steps,
            ranks=ranks,
            top=args.top,
            progress=_progress(args),
            engine=engine,
            spark_master=args.spark_master,
        )
    except Exception as exc:  # noqa: BLE001 - bad input or an engine's error: 2, never a traceback
        return _error(exc)
    if not result.summary.rows_read:
        given = {
            "--family": args.family,
            "--steps": args.steps,
            "--ranks": args.ranks,
            "--run-id": args.run_id,
        }
        filters = " ".join(f"{k} {','.join(v) if isinstance(v, list) else v}" for k, v in given.items() if v)
        print(f"error: no rows in {args.run!r} for {filters or 'the given filters'}", file=sys.stderr)
        return 2
    paths = _write(
        write_analysis_report, result, args.out or "trainermon_report", max_columns=args.max_columns
    )
    if paths is None:
        return 2
    summary = result.summary
    print(
        f"{source.kind} run {args.run}: {summary.rows_read:,} rows, families {summary.families} "
        f"(engine {engine}, {summary.seconds:.1f} s)"
    )
    if len(result.first_nonfinite):
        r = result.first_nonfinite.iloc[0]
        print(f"first NaN/Inf: step {r['step']} {r['family']} {r['name']} (rank {r['rank']})")
    else:
        print("no NaN/Inf")
    xr = result.xrank
    if xr is not None and xr["first_nonfinite"] is not None:
        f = xr["first_nonfinite"]
        where = f"step {f['step']} {f['family']} {f['name']}"
        print(f"across ranks: first NaN/Inf at {where} on rank {f['rank']}")
    if len(result.spikes):
        print(f"global grad norm spikes at steps {result.spikes['step'].tolist()[:20]}")
    for fam, table in result.growth.items():
        top = ", ".join(f"{r.layer} x{r.growth:.3g}" for r in table.head(3).itertuples(index=False))
        print(f"top growth of {result.growth_stat} in {fam}: {top}")
    if result.anomalies:
        print(f"{len(result.anomalies)} anomalies recorded")
    for note in summary.notes:
        print(f"note: {note}")
    print(f"report: {os.path.abspath(paths['html'])} ({len(paths['png'])} plots), findings: {paths['json']}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    """`trainermon compare RUN BENCHMARK`: 0 no divergence, 1 divergence, 2 bad input."""

    try:
        steps = step_range(args.steps)
    except ValueError:
        print(f"error: --steps {args.steps!r}: allowed: {STEPS}", file=sys.stderr)
        return 2
    try:
        urls = [p for p in (args.run, args.benchmark) if is_url(p)]
        engine = resolve_engine(args.engine, urls)  # a URL needs an engine: resolve before opening
        run, bench = (
            _open(p, engine, args.spark_master, run_id)
            if is_url(p)
            else open_run(p, prefer=args.format, run_id=run_id)
            for p, run_id in ((args.run, args.run_id), (args.benchmark, args.benchmark_run_id))
        )
        engine = resolve_engine(args.engine, [run, bench])
        result = compare(
            run,
            bench,
            rtol=args.rtol,
            atol=args.atol,
            stats=_split(args.stat) or ["norm"],
            families=_split(args.family),
            steps=steps,
            progress=_progress(args),
            engine=engine,
            spark_master=args.spark_master,
        )
    except Exception as exc:  # noqa: BLE001 - exit 1 means "diverged": an error is 2, never a traceback
        return _error(exc)
    paths = _write(
        write_comparison_report, result, args.out or "trainermon_compare", max_plots=args.max_plots
    )
    if paths is None:
        return 2
    table = result.per_family
    print(
        f"compared {int(table['cells_compared'].sum()):,} cells of {len(table)} families (rtol {args.rtol:g})"
    )
    if len(result.only_in_run) or len(result.only_in_benchmark):
        print(
            f"tensors only in the run: {len(result.only_in_run)}, only in the benchmark: "
            f"{len(result.only_in_benchmark)} (listed in the report)"
        )
        for r in result.only_in_run.head(10).itertuples(index=False):
            print(f"  only in run: {r.family} {r.name}")
        for r in result.only_in_benchmark.head(10).itertuples(index=False):
            print(f"  only in benchmark: {r.family} {r.name}")
    if result.families_only_in_run or result.families_only_in_benchmark:
        print(
            f"families only in the run: {result.families_only_in_run}, "
            f"only in the benchmark: {result.families_only_in_benchmark}"
        )
    for which, source in (("run", run), ("benchmark", bench)):
        for note in getattr(source, "notes", []):
            print(f"note ({which}): {note}")
    for note in result.notes:
        print(f"note: {note}")
    first = result.first
    unchecked = result.per_family.loc[result.per_family["cells_compared"] == 0, "family"].tolist()
    if first is None and unchecked:  # "no divergence" must not cover a family nothing was compared of
        print(f"no divergence in the cells compared; NOT checked (0 cells compared): {', '.join(unchecked)}")
    elif first is None:
        print("no divergence")
    else:
        micro = "" if first.micro_step is None else f" micro-step {first.micro_step}"
        print(
            f"first divergence: step {first.step}{micro} {first.family} {first.label} {first.stat}: "
            f"run {first.run_value:.6g} benchmark {first.benchmark_value:.6g} "
            f"(rel. diff {first.rel_diff:.3g}{'; ' + first.cause if first.cause else ''})"
        )
    print(f"report: {os.path.abspath(paths['html'])}, findings: {paths['json']}")
    return 1 if result.diverged else 0
