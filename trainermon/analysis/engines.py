"""Run the analysis's row-level SQL (`sqlplan.py`) on DuckDB (embedded) or Spark, and build the same
`RunSummary` a pyarrow `scan` builds, so the findings come from the same code whatever the engine.

Neither duckdb nor pyspark is imported before an engine is asked for; a missing one is an ImportError
naming the package and the pip extra (`trainermon[duckdb]`, `trainermon[spark]`).

Paths: a local RUN is detected as `open_run` does and its selected part files are handed to the engine
(so family/rank/step/run-id pruning and the run-id pointer behave as with pyarrow). A URL
(`s3://`, `s3a://`, `gs://`, `hdfs://`, `abfss://`, `file://`...) is a Parquet dataset root read by the
engine itself: DuckDB needs its httpfs extension and credentials (`CREATE SECRET`), Spark the Hadoop
connector of the scheme (e.g. `hadoop-aws` for `s3a://`) on its class path.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from . import sqlplan
from .grid import CellGrid, col_key
from .rank_steps import FAMILY as STEPS_FAMILY
from .rank_steps import missing_steps_note
from .runs import Replaced, reading_order, run_order
from .scan import MAX_NONFINITE_ROWS, RunSummary, copies_note
from .source import ALL_STATS, RunSource, SourceFile, family_order

ENGINES = ("pyarrow", "duckdb", "spark")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_SPARK: dict[str, Any] = {}  # master -> SparkSession (one per process: Spark starts slowly)


def is_url(path: Any) -> bool:
    return isinstance(path, str) and _URL.match(path) is not None


def check_engine(engine: str) -> str:
    if engine not in ENGINES and engine != "auto":
        raise ValueError(f"engine: got {engine!r}; allowed: {['auto', *ENGINES]}")
    return engine


def resolve_engine(engine: str, sources: Iterable[Any]) -> str:
    """ "auto": DuckDB when every source is a Parquet dataset (or a URL) and duckdb is installed (it
    measured 2.4x faster than pyarrow on 10^8 rows, docs/ANALYSIS.md), else pyarrow. Others as given."""
    if check_engine(engine) != "auto":
        return engine
    import importlib.util

    parquet = all(is_url(s) or getattr(s, "kind", None) == "parquet" for s in sources)
    return "duckdb" if parquet and importlib.util.find_spec("duckdb") is not None else "pyarrow"


def _require(module: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"the {extra} engine needs the '{module}' package, which is not installed: "
            f"pip install 'trainermon[{extra}]'"
        ) from exc


# ---- sessions -------------------------------------------------------------------------------------------
class _DuckDB:
    dialect = sqlplan.DUCKDB

    def __init__(self) -> None:
        duckdb = _require("duckdb", "duckdb")
        self.con = duckdb.connect()
        self.con.execute("SET enable_progress_bar = false")
        threads = os.environ.get("TRAINERMON_DUCKDB_THREADS")
        if threads:
            if not threads.strip().isdigit() or int(threads) < 1:
                raise ValueError(
                    f"TRAINERMON_DUCKDB_THREADS={threads!r}: allowed: a positive integer (DuckDB's threads)"
                )
            self.con.execute(f"SET threads = {int(threads)}")

    def register(self, paths: list[str]) -> None:
        """`paths` in reading order (family, rank, name): file_index numbers them in that order; a
        glob (a URL) has no such order and is numbered by `sqlplan.base_select`."""
        listing = "[" + ", ".join(sqlplan.quote(p) for p in paths) + "]"
        self.file_ordinal = not any("*" in p for p in paths)
        self.con.execute(
            "CREATE OR REPLACE TEMP VIEW src AS SELECT * EXCLUDE (filename, file_row_number), "
            "filename AS _fname, file_row_number AS _rn, file_index AS _fi FROM read_parquet("
            f"{listing}, "
            "hive_partitioning = true, union_by_name = true, filename = true, file_row_number = true)"
        )

    def view(self, name: str, sql: str) -> None:
        self.con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS {sql}")

    def frame(self, sql: str) -> Any:
        return self.con.execute(sql).df()

    def close(self) -> None:
        self.con.close()


class _Spark:
    dialect = sqlplan.SPARK
    file_ordinal = False

    def __init__(self, master: str | None) -> None:
        _require("pyspark", "spark")
        master = master or os.environ.get("TRAINERMON_SPARK_MASTER") or "local[*]"
        session = _SPARK.get(master)
        if session is None or session.sparkContext._jsc is None:
            from pyspark.sql import SparkSession

            builder = SparkSession.builder.master(master).appName("trainermon-analysis")
            for key, value in {
                "spark.ui.enabled": "false",
                "spark.ui.showConsoleProgress": "false",
                "spark.sql.execution.arrow.pyspark.enabled": "true",
                "spark.sql.session.timeZone": "UTC",
            }.items():
                builder = builder.config(key, value)
            if master.startswith("local"):
                builder = builder.config("spark.sql.shuffle.partitions", "8")
            session = _SPARK[master] = builder.getOrCreate()
            session.sparkContext.setLogLevel("ERROR")
        self.spark = session

    def register(self, paths: list[str], base: str) -> None:
        """One read per dataset root (Spark's basePath must lie above every path): the dataset's parts and
        the temporary parts of CSV steps beside it (`mixed.py`, in a root of their own) are read apart and
        unioned by name. Costs one file listing per root."""
        roots: dict[str, list[str]] = {}
        for path in paths:
            roots.setdefault(_dataset_root(path, base), []).append(path)
        df = None
        for root, group in roots.items():
            part = self.spark.read.option("basePath", root).option("mergeSchema", "true").parquet(*group)
            fname = "_metadata.file_path"
            if len(roots) > 1:  # files sort by _fname: lead with the file's name, as `source.select` sorts
                fname = f"concat(regexp_extract({fname}, '[^/]*$', 0), '|', {fname})"  # path: unique
            part = part.selectExpr("*", f"{fname} AS _fname", "_metadata.row_index AS _rn")
            df = part if df is None else df.unionByName(part, allowMissingColumns=True)
        assert df is not None, "no paths to register"
        df.createOrReplaceTempView("src")

    def view(self, name: str, sql: str) -> None:
        self.spark.sql(sql).createOrReplaceTempView(name)

    def frame(self, sql: str) -> Any:
        return self.spark.sql(sql).toPandas()

    def close(self) -> None:
        pass  # the session is kept for the next scan (a new one takes seconds)


def session(engine: str, spark_master: str | None = None) -> Any:
    if check_engine(engine) == "duckdb":
        return _DuckDB()
    if engine == "spark":
        return _Spark(spark_master)
    raise ValueError("the pyarrow engine has no SQL session")


def stop_spark() -> None:
    """Stop the Spark sessions this process started."""
    while _SPARK:
        _SPARK.popitem()[1].stop()


# ---- sources --------------------------------------------------------------------------------------------
def open_url(url: str, sess: Any, run_id: str | None = None) -> RunSource:
    """A dataset root at a URL: families and ranks listed by the engine."""
    base = url.rstrip("/")
    pattern = f"{base}/family=*/rank=*/part-*.parquet"
    _register(sess, [pattern], base)
    cond = sqlplan.where(None, None, None, run_id)
    listing = sess.frame(f"SELECT DISTINCT family, CAST(rank AS INT) AS rank FROM src WHERE {cond}")
    files = [
        SourceFile(str(r.family), int(r.rank), pattern, run_id, None, None, 0)
        for r in listing.itertuples(index=False)
    ]
    if not files and run_id is not None:
        ids = sess.frame("SELECT DISTINCT run_id FROM src WHERE run_id IS NOT NULL")["run_id"]
        if len(ids):
            raise FileNotFoundError(
                f"run id {run_id!r} is not in {url!r} (the run ids there: {sorted(map(str, ids))})"
            )
    if not files:
        raise FileNotFoundError(f"no trainermon Parquet dataset rows at {url!r}")
    files.sort(key=lambda f: (family_order(f.family), f.family, f.rank))
    return RunSource(url, "parquet", url, files, run_id)


def _dataset_root(path: str, base: str) -> str:
    """The dataset root holding part file `path`: `base` when under it, else the folder above its
    `family=` folder (a temporary part of CSV steps, `mixed.py`)."""
    if path.startswith(base.rstrip("/") + "/"):
        return base
    parts = path.split("/")
    at = max((i for i, p in enumerate(parts) if p.startswith("family=")), default=0)
    return "/".join(parts[:at]) if at > 0 else base


def _register(sess: Any, paths: list[str], base: str) -> None:
    if isinstance(sess, _Spark):
        sess.register(paths, base)
    else:
        sess.register(paths)


# ---- the scan -------------------------------------------------------------------------------------------
def engine_scan(
    source: RunSource,
    engine: str,
    family_stats: dict[str, list[str]],
    steps: tuple[int, int] | None = None,
    ranks: Iterable[int] | None = None,
    spark_master: str | None = None,
    sess: Any = None,
    xrank: bool = False,
) -> RunSummary:
    """What `scan.scan` computes, by SQL on `engine`. family_stats: statistics per family to read."""
    if source.kind != "parquet":
        raise ValueError(
            f"the {engine} engine reads Parquet datasets; {source.path!r} holds {source.kind} output "
            "(convert it with `trainermon convert`, or use --engine pyarrow)"
        )
    own = sess is None
    sess = session(engine, spark_master) if own else sess
    t0 = time.monotonic()
    try:
        fams = [f for f in family_stats if f in source.families()]
        stats = [s for s in ALL_STATS if any(s in family_stats[f] for f in fams)]
        rank_list = None if ranks is None else sorted({int(r) for r in ranks})
        files = source.select(fams, rank_list, steps)
        order = run_order(source)  # several runs of a rank (a restart): later runs' steps win (runs.py)
        files = reading_order(files, order)  # the pyarrow scan's: tensors come in the same order
        if xrank:  # rank 0's summaries of every rank: not narrowed by `ranks`, as with pyarrow
            files += source.select(["xrank"], None, steps)
        summary = RunSummary(source, {f: CellGrid(f, family_stats[f]) for f in fams}, {}, {}, {}, steps=steps)
        summary.notes.extend(source.notes)
        if not files:
            summary.seconds = time.monotonic() - t0
            return summary
        if is_url(source.root) and files[0].size == 0:
            _register(sess, [files[0].path], source.root.rstrip("/"))
        else:
            _register(sess, list(dict.fromkeys(f.path for f in files)), source.root)  # reading order
        summary.files_read = len({f.path for f in files})
        if xrank and "xrank" in source.families():
            cond = sqlplan.where(None, None, steps, source.run_id)
            summary.xrank_rows = sess.frame(sqlplan.xrank_sql(cond, order))
        if fams:
            cond = sqlplan.where(fams, rank_list, steps, source.run_id)
            _base(sess, stats, cond, order, summary)
            summary.copies.update(_copies(sess, stats))
            if summary.copies:
                cond = f"{cond} AND {sqlplan.exclude(summary.copies)}"
                _base(sess, stats, cond, order)
                summary.notes.append(copies_note(summary.copies))
            cells = sess.frame(sqlplan.cells_sql(stats))
            summary.rows_read = int(cells["_rows"].sum()) if len(cells) else 0
            for fam, part in cells.groupby("family", sort=False):
                _fill(summary.grids[str(fam)], part, stats)
            bad = sess.frame(sqlplan.nonfinite_sql(stats, MAX_NONFINITE_ROWS))
            _nonfinite(summary, bad, family_stats)
            if STEPS_FAMILY in fams:
                _missing_steps(summary, sess.frame(sqlplan.rank_steps_sql(STEPS_FAMILY)))
    finally:
        if own:
            sess.close()
    summary.seconds = time.monotonic() - t0
    return summary


def _base(sess: Any, stats: list[str], cond: str, order: dict, summary: RunSummary | None = None) -> None:
    """View `base`: the rows read; with several runs of a rank, only the latest run's of each step (and
    the note on the steps replaced, when `summary` is given)."""
    if not order:
        sess.view("base", sqlplan.base_select(stats, cond, sess.file_ordinal, sess.dialect))
        return
    sess.view("raw", sqlplan.base_select(stats, cond, sess.file_ordinal, sess.dialect, order))
    sess.view("base", sqlplan.latest_runs("raw"))
    if summary is not None:
        run_id = {i: r for r, i in order.items()}
        replaced = Replaced()
        for r in sess.frame(sqlplan.replaced_sql("raw")).itertuples(index=False):
            replaced.add(
                str(r.family), int(r.rank), int(r.step), run_id.get(int(r.lo)), run_id.get(int(r.hi)), order
            )
        note = replaced.note()
        if note:
            summary.notes.append(note)


def _missing_steps(summary: RunSummary, frame: Any) -> None:
    by_rank: dict[int, list[int]] = {}
    for rank, step in zip(frame["rank"].tolist(), frame["step"].tolist()):
        by_rank.setdefault(int(rank), []).append(int(step))
    note = missing_steps_note(by_rank)
    if note:
        summary.notes.append(note)


def _copies(sess: Any, stats: list[str]) -> dict[tuple[str, int], int]:
    """(family, rank) -> the earlier rank whose rows it copies (equal fingerprints)."""
    prints = sess.frame(sqlplan.fingerprint_sql(sess.dialect, stats))
    seen: dict[tuple, int] = {}
    copies: dict[tuple[str, int], int] = {}
    for r in prints.sort_values(["family", "rank"]).itertuples(index=False):
        key = (str(r.family), int(r.n), int(r.h))
        if key in seen:
            copies[(str(r.family), int(r.rank))] = seen[key]
        else:
            seen[key] = int(r.rank)
    return copies


def _fill(grid: CellGrid, cells: Any, stats: list[str]) -> None:
    """Set a grid's accumulators from the engine's cells (what `CellGrid.add` would have summed)."""
    tensors = cells[["t_ord", "vpp_stage", "name", "first_rank"]].drop_duplicates("t_ord")
    tensors = tensors.sort_values("t_ord")
    grid.tensors.lookup([(int(v), str(n)) for v, n in zip(tensors["vpp_stage"], tensors["name"])])
    grid.first_rank.extend(int(r) for r in tensors["first_rank"])
    keys = col_key(cells["step"].to_numpy(np.int64), cells["micro"].to_numpy(np.int64))
    uniq, inverse = np.unique(keys, return_inverse=True)
    cols = grid.cols.lookup(uniq.tolist())[inverse.ravel()]
    grid._grow(len(grid.tensors), len(grid.cols))
    rows = cells["t_ord"].to_numpy(np.int64) - 1
    flat = rows * grid._cap[1] + cols
    grid.rows += int(cells["_rows"].sum())
    grid._final.clear()
    for name, arr in grid.acc.items():
        if name in cells:  # a NULL aggregate (no row) becomes NaN: only read where a count says rows
            col = cells[name]
            values = col.fillna(True).to_numpy(bool) if arr.dtype == bool else col.to_numpy(np.float64)
            arr.ravel()[flat] = values
    for stat in grid.stats:
        n = f"w_{stat}" if f"w_{stat}" in cells else f"n_{stat}"
        if n in cells and float(np.nansum(cells[n].to_numpy(np.float64, na_value=np.nan))) > 0:
            grid.seen_stats.add(stat)


def _nonfinite(summary: RunSummary, bad: Any, family_stats: dict[str, list[str]]) -> None:
    for fam, part in bad.groupby("family", sort=False):
        fam = str(fam)
        summary.nonfinite_counts[fam] = int(part["bad_rows"].iloc[0])
        kept = []
        for r in part.to_dict(orient="records"):
            row: dict[str, Any] = {
                "family": fam,
                "rank": int(r["rank"]),
                "vpp_stage": int(r["vpp_stage"]),
                "name": str(r["name"]),
                "step": int(r["step"]),
                "micro_step": None if int(r["micro"]) < 0 else int(r["micro"]),
            }
            for stat in family_stats.get(fam, []):
                if stat in r and not r[f"_null_{stat}"]:
                    row[stat] = float(r[stat])
            kept.append(row)
        summary.nonfinite_rows[fam] = kept
