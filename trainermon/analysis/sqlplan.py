"""The analysis's row-level work as SQL, one text for every engine (DuckDB, Spark SQL).

Rows become cells here: the GROUP BY over (family, vpp_stage, name, step, micro_step) produces exactly
the accumulators `grid.CellGrid` keeps per cell (`grid.py` documents how rows combine), plus each
tensor's first appearance (model order) and the rows at each family's first non-finite step. Everything
after that (heatmaps, global grad norm, spikes, growth, first non-finite ordering, first divergence)
reads cells, whose number is the size of the result (tensors x collected steps), not of the rows; it is
the same code for every engine (`trends.py`, `compare.py`), so every engine gives the same findings.

The view `src` must have the Parquet columns plus `family`, `rank` (Hive partitions), `_fname` (the part
file) and `_rn` (the row's index in its file). Only these SQL features are used, with the spelling both
engines accept: CAST, CASE, count_if, greatest, min_by, bit_xor, isnan, regexp_replace, window
row_number; the row hash is the dialect's (`Dialect.hash_fn`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from trainermon.stats.table import Combine

from .grid import COPY_MARKS, combine_rule

NAN = "CAST('NaN' AS DOUBLE)"
_INF = "CAST('Infinity' AS DOUBLE)"


@dataclass(frozen=True)
class Dialect:
    name: str
    hash_fn: str  # a 64-bit hash of several columns
    zero: str = "0.0"  # `base`'s `_z`: see `_isnan`


# DuckDB's zero is volatile (see `_isnan`); Spark's optimizer does not fold isnan() by statistics, and
# its CTE rewrite fails on a volatile column read twice (PLAN_VALIDATION_FAILED_RULE_IN_BATCH, 4.x).
DUCKDB = Dialect("duckdb", "hash", zero="0 * random()")
SPARK = Dialect("spark", "xxhash64")


def quote(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def where(
    families: Iterable[str] | None,
    ranks: Iterable[int] | None,
    steps: tuple[int, int] | None,
    run_id: str | None,
) -> str:
    """The row filter (families, ranks, inclusive step range, run id) as a WHERE clause body."""
    parts = ["TRUE"]
    if families is not None:
        parts.append(f"family IN ({', '.join(quote(f) for f in families) or 'NULL'})")
    if ranks is not None:
        parts.append(f"CAST(rank AS INT) IN ({', '.join(str(int(r)) for r in ranks) or 'NULL'})")
    if steps is not None:
        parts.append(f"step BETWEEN {int(steps[0])} AND {int(steps[1])}")
    if run_id is not None:
        parts.append(f"run_id = {quote(run_id)}")
    return " AND ".join(parts)


def base_select(
    stats: list[str],
    cond: str,
    file_ordinal: bool = False,
    dialect: Dialect = SPARK,
    runs: dict | None = None,
) -> str:
    """Rows as the analysis reads them: names unwrapped (leading `module.` segments dropped, as the
    pyarrow reader does), micro_step -1 where none, `_empty` for numel 0, `_w` the mean weight (`_wf`:
    by finite elements), and `_ord` the row's position in reading order (file by rank then name, then
    row in the file), an integer (a struct would make the aggregation three times slower).
    file_ordinal: `src` has `_fi`, each file's position in that order (DuckDB's file_index over a sorted
    list); else the files are numbered here (a DISTINCT over the file column, cheap, and a join).
    runs: run id -> start position (`runs.run_order`): adds `_run`, for `latest_runs`."""
    cols = ", ".join(f"CAST(s.{st} AS DOUBLE) AS {st}" for st in stats)
    if runs:
        cols += f", {run_case(runs, 's.run_id')} AS _run"
    select = (
        "SELECT s.family, CAST(s.rank AS INT) AS rank, CAST(s.vpp_stage AS INT) AS vpp_stage, "
        "regexp_replace(s.name, '^(module[.])+', '') AS name, CAST(s.step AS BIGINT) AS step, "
        "CAST(COALESCE(s.micro_step, -1) AS INT) AS micro, "
        f"{cols}, COALESCE(s.numel = 0, FALSE) AS _empty, {dialect.zero} AS _z, "
        "COALESCE(CAST(s.numel AS DOUBLE), 1.0) AS _w, "
        f"{_finite_weight(stats)} AS _wf, "
    )
    if file_ordinal:
        ordinal = "CAST(s._fi AS BIGINT) * 4294967296 + CAST(s._rn AS BIGINT)"
        return f"{select}{ordinal} AS _ord FROM src s WHERE {cond}"
    return (
        "WITH files AS (SELECT family AS _ff, _fname AS _fn, row_number() OVER (PARTITION BY family "
        "ORDER BY CAST(rank AS INT), _fname) AS _fo FROM "
        f"(SELECT DISTINCT family, rank, _fname FROM src WHERE {cond}) d) "
        f"{select}CAST(f._fo AS BIGINT) * 4294967296 + CAST(s._rn AS BIGINT) AS _ord "
        f"FROM src s JOIN files f ON s.family = f._ff AND s._fname = f._fn WHERE {cond}"
    )


def run_case(runs: dict, column: str = "run_id") -> str:
    """`column` (a run id) as its start position in `runs` (`runs.run_order`), -1 for an unknown run."""
    whens = " ".join(f"WHEN {quote(r)} THEN {int(i)}" for r, i in runs.items() if r is not None)
    return f"CASE {column} {whens} ELSE -1 END"


def latest_runs(raw: str = "raw") -> str:
    """The rows of view `raw` (a `base_select` with `runs`) whose run is the latest-started one that wrote
    their (family, rank, step): a restart's re-done steps replace the crashed run's (`runs.py`)."""
    return (
        f"SELECT r.* FROM {raw} r JOIN (SELECT family, rank, step, max(_run) AS _last FROM {raw} "
        "GROUP BY family, rank, step) k ON r.family = k.family AND r.rank = k.rank AND r.step = k.step "
        "WHERE r._run = k._last"
    )


def replaced_sql(raw: str = "raw") -> str:
    """(family, rank, step, earliest run, latest run) of the steps that several runs of a rank wrote."""
    return (
        f"SELECT family, rank, step, min(_run) AS lo, max(_run) AS hi FROM (SELECT DISTINCT family, rank, "
        f"step, _run FROM {raw}) d GROUP BY family, rank, step HAVING count(*) > 1"
    )


def _finite_weight(stats: list[str]) -> str:
    """`_wf`, the weight of a MEAN_BY_FINITE statistic: numel - nans - infs (`grid._finite_weight`)."""
    counts = "".join(f" - COALESCE(CAST(s.{c} AS DOUBLE), 0.0)" for c in ("nans", "infs") if c in stats)
    if not counts:
        return "COALESCE(CAST(s.numel AS DOUBLE), 1.0)"
    return f"CASE WHEN s.numel IS NULL THEN 1.0 ELSE greatest(CAST(s.numel AS DOUBLE){counts}, 0.0) END"


def _isnan(v: str) -> str:
    """isnan(v) that no engine can answer from a Parquet file's min/max statistics: those leave NaN out,
    and DuckDB 2.0 took them as proof that a column holds none (it folded isnan() to FALSE and found no
    NaN in a run that had some). `_z` is `base`'s zero, volatile where the dialect needs it (a column:
    Spark refuses a volatile expression inside an aggregate); adding it keeps every value as it is."""
    return f"isnan({v} + _z)"


def _aggregates(stat: str) -> list[str]:
    """The accumulators of one statistic (names as in `grid._NEEDS`), as SQL aggregates, by the rule
    the pyarrow scan uses (`grid.combine_rule`: the family columns `ratio` and `load_cv` included)."""
    rule = combine_rule(stat)
    # mean/min/max/zeros of an empty tensor (numel 0) are NaN by definition: not values.
    v = f"CASE WHEN NOT _empty THEN {stat} END" if stat in ("mean", "min", "max", "zeros") else stat
    marks = []
    if stat in COPY_MARKS:  # every row bit-identical (and none NaN): copies of one tensor (grid.py)
        marks = [
            f"min({v}) AS first_{stat}",
            f"(count_if({_isnan(v)}) = 0 AND min({v}) = max({v})) AS same_{stat}",
        ]
    return marks + _rule_aggregates(stat, rule, v)


def _rule_aggregates(stat: str, rule: Combine, v: str) -> list[str]:
    if rule is Combine.L2:
        return [f"count({v}) AS n_{stat}", f"sum({v} * {v}) AS sq_{stat}"]
    if rule in (Combine.MEAN_BY_FINITE, Combine.MEAN_BY_NUMEL):
        w = "_wf" if rule is Combine.MEAN_BY_FINITE else "_w"  # a mean covers the finite elements
        return [
            f"sum(CASE WHEN {v} IS NOT NULL THEN {w} END) AS w_{stat}",
            f"sum({v} * {w}) AS s_{stat}",
        ]
    if rule in (Combine.MIN, Combine.MAX):
        fn = "min" if rule is Combine.MIN else "max"
        # numpy's minimum/maximum propagate NaN; SQL orders NaN above every number: say it explicitly
        return [
            f"count({v}) AS n_{stat}",
            f"CASE WHEN count_if({_isnan(v)}) > 0 THEN {NAN} ELSE {fn}({v}) END AS {stat}",
        ]
    return [f"count({v}) AS n_{stat}", f"sum({v}) AS {stat}"]  # Combine.SUM: nans, infs


def cells_sql(stats: list[str]) -> str:
    """One row per (family, tensor, step, micro_step) of view `base`, with `t_ord`: the tensor's
    position in its family in order of first appearance (rank, then file, then row)."""
    aggs = ", ".join(a for s in stats for a in _aggregates(s))
    return (
        "WITH cells AS (SELECT family, vpp_stage, name, step, micro, count(*) AS _rows, "
        f"min(_ord) AS _ord, min_by(rank, _ord) AS _r, {aggs} FROM base "
        "GROUP BY family, vpp_stage, name, step, micro), "
        "tensors AS (SELECT family, vpp_stage, name, min(_ord) AS _ord, min_by(_r, _ord) AS _r FROM cells "
        "GROUP BY family, vpp_stage, name), "
        "ordered AS (SELECT family, vpp_stage, name, _r AS first_rank, row_number() OVER "
        "(PARTITION BY family ORDER BY _ord) AS t_ord FROM tensors) "
        "SELECT c.*, o.first_rank, o.t_ord FROM cells c JOIN ordered o "
        "ON c.family = o.family AND c.vpp_stage = o.vpp_stage AND c.name = o.name"
    )


def bad_expr(stats: list[str]) -> str:
    """A row with a NaN or Inf statistic or a non-zero nans/infs count (as `scan._NonFinite`)."""
    terms = []
    for s in stats:
        if s in ("nans", "infs"):
            terms.append(f"COALESCE({s} > 0, FALSE)")
        else:
            hit = f"({_isnan(s)} OR {s} = {_INF} OR {s} = -{_INF}) AND NOT _empty"  # no elements: no values
            terms.append(f"COALESCE({hit}, FALSE)")
    return " OR ".join(terms) or "FALSE"


def nonfinite_sql(stats: list[str], limit: int) -> str:
    """Per family: how many rows are non-finite, and the rows at its first step with any (at most
    `limit`, in file order)."""
    cols = ", ".join(stats)
    nulls = ", ".join(f"{s} IS NULL AS _null_{s}" for s in stats)  # NULL: not collected; NaN: a value
    return (
        f"WITH bad AS (SELECT family, rank, vpp_stage, name, step, micro, {cols}, _ord FROM base "
        f"WHERE {bad_expr(stats)}), "
        "firsts AS (SELECT family, min(step) AS first_step, count(*) AS bad_rows FROM bad GROUP BY family), "
        "kept AS (SELECT b.*, f.bad_rows, row_number() OVER (PARTITION BY b.family "
        "ORDER BY b._ord) AS k FROM bad b JOIN firsts f "
        "ON b.family = f.family AND b.step = f.first_step) "
        f"SELECT family, rank, vpp_stage, name, step, micro, {cols}, {nulls}, bad_rows FROM kept "
        f"WHERE k <= {int(limit)} "
        "ORDER BY family, k"
    )


def fingerprint_sql(dialect: Dialect, stats: list[str]) -> str:
    """Per (family, rank): the row count and the XOR of every row's hash (names, steps, statistics),
    an order-free fingerprint of the rank's rows: equal fingerprints are a copy (msprobe writes
    replicated tensors on every rank; `scan.py` decides on all of a rank's rows too)."""
    cols = ", ".join(["vpp_stage", "name", "step", "micro"] + stats)
    return (
        f"SELECT family, rank, count(*) AS n, bit_xor({dialect.hash_fn}({cols})) AS h FROM base "
        "GROUP BY family, rank"
    )


def rank_steps_sql(family: str) -> str:
    """The distinct (rank, step) pairs of `family`'s rows (`rank_steps.py`)."""
    return f"SELECT rank, step FROM base WHERE family = {quote(family)} GROUP BY rank, step"


def exclude(copies: Iterable[tuple[str, int]]) -> str:
    """A WHERE clause body dropping the (family, rank) pairs of `copies`."""
    by_family: dict[str, list[int]] = {}
    for fam, rank in copies:
        by_family.setdefault(fam, []).append(int(rank))
    terms = [
        f"NOT (family = {quote(f)} AND CAST(rank AS INT) IN ({', '.join(map(str, sorted(r)))}))"
        for f, r in sorted(by_family.items())
    ]
    return " AND ".join(terms) or "TRUE"


XRANK_COLUMNS = (
    "vpp_stage", "name", "step", "micro_step", "xrank_family", "xrank_stat", "max", "min", "mean",
    "nans", "infs", "max_rank", "min_rank", "nonfinite_rank", "ranks",
)  # fmt: skip


def xrank_sql(cond: str, runs: dict | None = None) -> str:
    """The cross-rank summary rows (family `xrank`, rank 0), for `xrank.xrank_findings`.
    runs: run id -> start position (`runs.run_order`): a step several runs wrote is read from the latest
    (`latest_runs`, as the tensor families), else a restart's crashed run would give the findings."""
    micro = "CAST(micro_step AS INT) AS micro_step"
    cols = ", ".join(micro if c == "micro_step" else c for c in XRANK_COLUMNS)
    if not runs:
        return f"SELECT {cols} FROM src WHERE family = 'xrank' AND {cond}"
    raw = (
        f"SELECT family, CAST(rank AS INT) AS rank, {cols}, {run_case(runs)} AS _run FROM src "
        f"WHERE family = 'xrank' AND {cond}"
    )
    return (
        f"WITH xraw AS ({raw}), xkept AS ({latest_runs('xraw')}) SELECT {', '.join(XRANK_COLUMNS)} FROM xkept"
    )
