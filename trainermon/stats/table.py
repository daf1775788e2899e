"""The statistics table: every statistic a user can ask for, in one place, and everything derived from it.

A statistic is a (local partial, combiner) pair, as in Transformer Engine's debug statistics: the engine
computes partial columns per tensor piece (`partials.PARTIALS`), pieces merge by each partial's combiner
(sum, min, max), and `finalize` turns merged partials into the values users see. Rows of different
tensors (a layer's parameters for Prometheus, a cell of several ranks offline) combine by each
statistic's `Combine` rule. Config validation, the CSV / Parquet / Prometheus columns, the cross-rank merge
and the offline analysis all read this table; adding a statistic means adding a row here (and its partial
column in `partials`, if it needs a new one).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np


class Kind(Enum):
    FLOAT = "float"  # a real-valued statistic (float64 in Parquet; ndigits significant digits in CSV)
    COUNT = "count"  # an integer count (int64 in Parquet; an integer in CSV)
    META = "meta"  # describes the tensor, not its values (shape, dtype): static, never reduced


class Combine(Enum):
    """How the values of several rows (disjoint pieces or different tensors) combine into one."""

    L2 = "l2"  # sqrt(sum of squares): the norm of the concatenation
    MEAN_BY_FINITE = "mean_by_finite"  # average weighted by each row's finite element count
    MEAN_BY_NUMEL = "mean_by_numel"  # average weighted by each row's element count
    MIN = "min"
    MAX = "max"
    SUM = "sum"
    NONE = "none"  # not combined (metadata)


@dataclass(frozen=True)
class Statistic:
    name: str  # the config's `ops` name and the output column
    kind: Kind
    combine: Combine
    partials: tuple[str, ...]  # the partial columns it is computed from (see partials.PARTIALS)
    help: str


STATISTICS: tuple[Statistic, ...] = (
    Statistic("norm", Kind.FLOAT, Combine.L2, ("sumsq",), "L2 norm (NaN left out; Inf too if counted)"),
    Statistic(
        "mean",
        Kind.FLOAT,
        Combine.MEAN_BY_FINITE,
        ("sum", "nans", "infs"),
        "mean (NaN left out; Inf too if counted)",
    ),
    Statistic("min", Kind.FLOAT, Combine.MIN, ("min",), "smallest element (see norm)"),
    Statistic("max", Kind.FLOAT, Combine.MAX, ("max",), "largest element (see norm)"),
    Statistic("zeros", Kind.FLOAT, Combine.MEAN_BY_NUMEL, ("zeros",), "fraction of elements with |x| < eps"),
    Statistic("nans", Kind.COUNT, Combine.SUM, ("nans",), "NaN elements"),
    Statistic("infs", Kind.COUNT, Combine.SUM, ("infs",), "infinite elements"),
    Statistic("numel", Kind.COUNT, Combine.SUM, (), "elements (from the shape)"),
    Statistic("shape", Kind.META, Combine.NONE, (), "the tensor's shape"),
    Statistic("dtype", Kind.META, Combine.NONE, (), "the tensor's dtype"),
)
BY_NAME = {s.name: s for s in STATISTICS}
#: Every `ops` name, in table order (also the order of the Parquet columns).
OPS = tuple(s.name for s in STATISTICS)
#: Statistics computed from values (not metadata), in table order.
VALUE_STATS = tuple(s.name for s in STATISTICS if s.kind is not Kind.META and s.name != "numel")
FLOAT_STATS = tuple(s.name for s in STATISTICS if s.kind is Kind.FLOAT)
COUNT_STATS = tuple(s.name for s in STATISTICS if s.kind is Kind.COUNT and s.name != "numel")
#: msprobe always writes these two last.
TRAILING_OPS = ("shape", "dtype")


def needs_nonfinite(ops: tuple[str, ...]) -> bool:
    """NaN counting is on: min/max/norm/mean then leave NaN out, and Inf too when `infs` is counted."""
    return "nans" in ops or "infs" in ops


def nan_only(ops: tuple[str, ...]) -> bool:
    """`nans` without `infs` (msprobe has no `infs` op): only NaN is left out and counted; infinities are
    values (norm inf, max +inf, ...), so that an Inf gradient shows in the rows rather than vanishing."""
    return "nans" in ops and "infs" not in ops


def needs_zeros(ops: tuple[str, ...]) -> bool:
    return "zeros" in ops


def combine(groups: np.ndarray, count: int, values: dict[str, np.ndarray], stats: tuple[str, ...]) -> dict:
    """Combine rows into `count` groups (row i belongs to group `groups[i]`) by each statistic's rule.

    `values` holds the rows' finalised statistics plus `numel`; NaN/Inf counts weight the mean when present.
    A statistic whose rows are all NaN is NaN for the group (min/max/mean ignore NaN rows otherwise); with
    counts, the norm covers the finite values, NaN where the group has none."""
    numel = np.asarray(values["numel"], dtype=np.float64)
    nans = np.asarray(values.get("nans", np.zeros_like(numel)), dtype=np.float64)
    infs = np.asarray(values.get("infs", np.zeros_like(numel)), dtype=np.float64)
    finite = np.maximum(numel - nans - infs, 0.0)
    counted = "nans" in values or "infs" in values
    none_finite = (np.bincount(groups, finite, minlength=count) == 0) & (
        np.bincount(groups, numel, minlength=count) > 0
    )
    out: dict[str, np.ndarray] = {}
    with np.errstate(invalid="ignore", divide="ignore"):
        for name in stats:
            rule = BY_NAME[name].combine
            v = np.asarray(values[name], dtype=np.float64)
            if rule is Combine.L2:
                if counted:  # finite-only: a row with no finite value (norm NaN) adds nothing to its group,
                    v = np.where((finite == 0) & (numel > 0), 0.0, v)  # whose own norm is NaN if none has one
                norm = np.sqrt(np.bincount(groups, v * v, minlength=count))
                out[name] = np.where(none_finite, np.nan, norm) if counted else norm
            elif rule in (Combine.MEAN_BY_FINITE, Combine.MEAN_BY_NUMEL):
                weight = finite if rule is Combine.MEAN_BY_FINITE else numel
                ok = ~np.isnan(v) & (weight > 0)  # an infinite mean (Inf not counted) is the group's
                num = np.bincount(groups, np.where(ok, v * weight, 0.0), minlength=count)
                den = np.bincount(groups, np.where(ok, weight, 0.0), minlength=count)
                out[name] = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
            elif rule in (Combine.MIN, Combine.MAX):
                fill = np.inf if rule is Combine.MIN else -np.inf
                acc = np.full(count, fill)
                (np.fmin if rule is Combine.MIN else np.fmax).at(acc, groups, v)
                seen = np.bincount(groups, ~np.isnan(v), minlength=count) > 0
                out[name] = np.where(seen, acc, np.nan)
            elif rule is Combine.SUM:
                out[name] = np.bincount(groups, v, minlength=count)
    return out
