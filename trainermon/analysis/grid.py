"""Per-(tensor, step, micro-step) accumulators of one family: the only state a scan keeps per row.

How rows combine into one cell. Several rows can describe the same (tensor, step, micro_step):

- ranks that each hold a disjoint piece of it: tensor-parallel shards of a `grad_reduced`,
  `exp_avg(_sq)` or `param_*` tensor (trainermon writes a sharded tensor once per shard group, as exact
  full statistics, so these come from tensor parallelism); or each rank's own activations and
  pre-reduce gradients (`actv`, `actv_grad`, `grad_unreduced`, written by every rank);
- ranks that hold a copy of it: msprobe writes replicated tensors on every data-parallel rank (and
  tensor-parallel-replicated parameters on every tensor-parallel rank).

A cell is the statistic of all the elements its rows describe, with copies counted once:
`norm = sqrt(sum of norm^2)`, `min = min`, `max = max`, `zeros` weighted by numel and `mean` by the
finite elements, numel - nans - infs (the statistics cover finite values; numel without the counts; by row
when numel is unknown), `nans` and `infs` summed. Copies are recognised in two ways: a whole rank whose
rows of a family are all exactly an earlier rank's is skipped by the scan (see `scan.py`), and
within a cell, rows whose norm, min, max and mean (those the rows hold) are each bit-identical are one
tensor seen several times (counted once). The norm alone is not enough: a LayerNorm output's norm is
about sqrt(numel) whatever its input, so every rank's own activations share it at CSV's 6 digits while
their min and max differ. Different pieces equal in all four would be taken for copies (all-zero
pieces give the same result either way).

Memory is proportional to tensors x (step, micro_step) cells, never to rows or ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from trainermon.stats.table import BY_NAME, STATISTICS, Combine

from .source import Batch

#: micro_step is encoded into a column key with the step: key = step * MICRO_BASE + micro_step + 1.
MICRO_BASE = 1 << 20

#: Accumulator arrays per combining rule of the statistics table (`{s}`: the statistic's name).
_ARRAYS = {
    Combine.L2: ("n_{s}", "sq_{s}"),
    Combine.MEAN_BY_FINITE: ("w_{s}", "s_{s}"),
    Combine.MEAN_BY_NUMEL: ("w_{s}", "s_{s}"),
    Combine.MIN: ("n_{s}", "{s}"),
    Combine.MAX: ("n_{s}", "{s}"),
    Combine.SUM: ("n_{s}", "{s}"),
}
_NEEDS = {
    st.name: tuple(a.format(s=st.name) for a in _ARRAYS[st.combine])
    for st in STATISTICS
    if st.combine in _ARRAYS
}
_NEEDS.pop("numel", None)  # element counts come with the rows, not as a statistic of cells
#: Statistics that mark copies: each also keeps its first value per cell and whether every row equals it.
COPY_MARKS = ("norm", "min", "max", "mean")
for _mark in COPY_MARKS:
    _NEEDS[_mark] += (f"first_{_mark}", f"same_{_mark}")


def with_copy_marks(stats: list[str]) -> list[str]:
    """`stats`, and with the norm every other copy mark: which rows are copies must not depend on the
    statistics asked for (`--stat norm` alone would take equal-norm pieces for copies)."""
    return list(dict.fromkeys([*stats, *COPY_MARKS])) if "norm" in stats else list(stats)


_RULE = {name: BY_NAME[name].combine for name in _NEEDS}
# ratio (update), load_cv (moe_load): one writer per tensor or router, so a cell has one row; MAX if a
# copy appears.
for _extra in ("ratio", "load_cv"):
    _NEEDS[_extra] = (f"n_{_extra}", _extra)
    _RULE[_extra] = Combine.MAX


def combine_rule(stat: str) -> Combine:
    """How the rows of one cell combine for `stat` (the statistics table's rule, or MAX for the family
    columns above): the pyarrow scan and the SQL engines (`sqlplan.py`) accumulate by this one rule."""
    rule = _RULE.get(stat)
    if rule is None:
        raise KeyError(f"no combining rule for statistic {stat!r} (known: {sorted(_RULE)})")
    return rule


_FILL = {f"first_{s}": np.nan for s in COPY_MARKS}
_FILL.update({f"same_{s}": True for s in COPY_MARKS})
_FILL.update({s: np.inf for s, r in _RULE.items() if r is Combine.MIN})
_FILL.update({s: -np.inf for s, r in _RULE.items() if r is Combine.MAX})
_DTYPE: dict[str, type] = {f"same_{s}": bool for s in COPY_MARKS}
_DTYPE.update({f"n_{s}": np.int32 for s, r in _RULE.items() if r is not Combine.MEAN_BY_FINITE})


def col_key(step: np.ndarray, micro: np.ndarray) -> np.ndarray:
    return step * MICRO_BASE + (micro + 1)


def split_key(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keys = np.asarray(keys, dtype=np.int64)
    return keys // MICRO_BASE, keys % MICRO_BASE - 1


class _Axis:
    """Dense indices for keys, in insertion order."""

    def __init__(self) -> None:
        self.index: dict = {}
        self.keys: list = []

    def lookup(self, keys: list) -> np.ndarray:
        out = np.empty(len(keys), dtype=np.int64)
        for i, key in enumerate(keys):
            idx = self.index.get(key)
            if idx is None:
                idx = self.index[key] = len(self.keys)
                self.keys.append(key)
            out[i] = idx
        return out

    def __len__(self) -> int:
        return len(self.keys)


#: An actv_grad name: `{module}.input`, `.input_{i}`, `.input_{keyword}`, `.output`, `.output_{i}`.
_IO_NAME = re.compile(r"\.(input|output)(?:_([^.]*))?$")


def grad_positions(keys: list[tuple[int, str]]) -> list[int]:
    """Each actv_grad tensor's position in msprobe's order, from `keys` ((vpp_stage, name)) in order of
    first appearance: a module's input rows then its output rows, the module placed where its last input
    row is (its first output row when it has none). The CSV exporter writes this order and Parquet keeps
    the arrival order (outputs first); ordering both here gives one model order for both."""
    groups: dict[tuple, list] = {}  # (vpp, module) -> [last input, first output, [(slot, index)]]
    for i, (vpp, name) in enumerate(keys):
        m = _IO_NAME.search(name)
        if m is None:
            module, output, slot = name, 0, (0, -1)
        else:
            sfx = m.group(2)
            module, output = name[: m.start()], int(m.group(1) == "output")
            slot = (0, -1) if sfx is None else (0, int(sfx)) if sfx.isdigit() else (1, 0)
        group = groups.setdefault((vpp, module), [-1, -1, []])
        if not output:
            group[0] = i
        elif group[1] < 0:
            group[1] = i
        group[2].append(((output, *slot, i), i))
    anchored = sorted(groups.values(), key=lambda g: g[0] if g[0] >= 0 else g[1])
    out = [0] * len(keys)
    for p, i in enumerate(i for g in anchored for _, i in sorted(g[2])):
        out[i] = p
    return out


def _finite_weight(batch: Batch, numel: np.ndarray) -> np.ndarray:
    """numel - nans - infs per row (as the online combine, `stats.table.combine`): a mean covers the
    finite elements. Counts not collected (or missing on a row) count as 0."""
    known = ~np.isnan(batch.numel) if batch.numel is not None else np.zeros(len(numel), dtype=bool)
    out = numel.copy()
    for stat in ("nans", "infs"):
        got = batch.stats.get(stat)
        if got is not None:
            values, valid = got
            count = np.where(known, np.nan_to_num(values, nan=0.0), 0.0)  # numel unknown: weight 1 stays
            out -= count if valid is None else np.where(valid, count, 0.0)
    return np.maximum(out, 0.0)


class CellGrid:
    """Accumulators for one family over tensors (rows) x (step, micro_step) (columns)."""

    def __init__(self, family: str, stats: list[str]) -> None:
        self.family = family
        self.stats = [s for s in stats if s in _NEEDS]
        self.tensors = _Axis()  # (vpp_stage, name)
        self.first_rank: list[int] = []  # rank each tensor was first seen on
        self.cols = _Axis()  # column keys (step, micro_step)
        self.seen_stats: set[str] = set()
        self.rows = 0
        self._cap = (0, 0)
        self.acc: dict[str, np.ndarray] = {}
        self._names = sorted({a for s in self.stats for a in _NEEDS[s]})
        self._final: dict[str, Final] = {}
        self._grow(64, 64)

    # ---- storage ------------------------------------------------------------------------------------
    def _grow(self, rows: int, cols: int) -> None:
        r0, c0 = self._cap
        r1 = max(r0, rows if rows <= r0 else max(rows, 2 * r0))
        c1 = max(c0, cols if cols <= c0 else max(cols, 2 * c0))
        if (r1, c1) == (r0, c0):
            return
        for name in self._names:
            new = np.full((r1, c1), _FILL.get(name, 0), dtype=_DTYPE.get(name, np.float64))
            old = self.acc.get(name)
            if old is not None:
                new[:r0, :c0] = old
            self.acc[name] = new
        self._cap = (r1, c1)

    # ---- accumulation ---------------------------------------------------------------------------------
    def add(self, batch: Batch) -> None:
        n = len(batch)
        if n == 0:
            return
        self._final.clear()
        before = len(self.tensors)
        tensor_idx = self.tensors.lookup(batch.tensors)
        self.first_rank.extend([batch.rank] * (len(self.tensors) - before))
        rows = tensor_idx[batch.codes]
        keys = col_key(batch.step, batch.micro)
        uniq, inverse = np.unique(keys, return_inverse=True)
        cols = self.cols.lookup(uniq.tolist())[inverse.ravel()]
        self._grow(len(self.tensors), len(self.cols))
        flat = rows * self._cap[1] + cols
        self.rows += n
        with np.errstate(invalid="ignore", over="ignore"):
            self._accumulate(batch, flat, n)

    def _accumulate(self, batch: Batch, flat: np.ndarray, n: int) -> None:
        weight = finite = None
        # Rows of empty tensors (numel 0) have no elements: their NaN mean/min/max are no values.
        empty = None if batch.numel is None else batch.numel == 0
        has_empty = empty is not None and bool(empty.any())
        for stat in self.stats:
            got = batch.stats.get(stat)
            if got is None:
                continue
            values, valid = got
            if has_empty and stat in ("mean", "min", "max", "zeros"):
                valid = ~empty if valid is None else valid & ~empty
            f, v = (flat, values) if valid is None else (flat[valid], values[valid])
            if f.size == 0:
                continue
            self.seen_stats.add(stat)
            acc = self.acc
            rule = _RULE[stat]
            if stat in COPY_MARKS:
                first = acc[f"first_{stat}"].ravel()
                same = acc[f"same_{stat}"].ravel()
                # Rows in arbitrary order: a cell stays "all the same" while every value equals the first
                # one stored for it (NaN never equals, so a NaN cell is never taken for copies).
                fresh = np.isnan(first[f])
                first[f[fresh]] = v[fresh]
                differs = first[f] != v
                same[f[differs]] = False
            if rule is Combine.L2:
                np.add.at(acc[f"n_{stat}"].ravel(), f, 1)
                np.add.at(acc[f"sq_{stat}"].ravel(), f, v * v)
            elif rule in (Combine.MEAN_BY_FINITE, Combine.MEAN_BY_NUMEL):
                if weight is None:
                    weight = (
                        np.ones(n)
                        if batch.numel is None
                        else np.where(np.isnan(batch.numel), 1.0, batch.numel)
                    )
                w = weight
                if rule is Combine.MEAN_BY_FINITE and batch.numel is not None:
                    if finite is None:
                        finite = _finite_weight(batch, weight)
                    w = finite
                w = w if valid is None else w[valid]
                np.add.at(acc[f"w_{stat}"].ravel(), f, w)
                np.add.at(acc[f"s_{stat}"].ravel(), f, v * w)
            elif rule is Combine.MIN:
                np.add.at(acc[f"n_{stat}"].ravel(), f, 1)
                np.minimum.at(acc[stat].ravel(), f, v)
            elif rule is Combine.MAX:
                np.add.at(acc[f"n_{stat}"].ravel(), f, 1)
                np.maximum.at(acc[stat].ravel(), f, v)
            else:  # Combine.SUM: nans, infs
                np.add.at(acc[f"n_{stat}"].ravel(), f, 1)
                np.add.at(acc[stat].ravel(), f, v)

    # ---- results ------------------------------------------------------------------------------------
    def order(self) -> np.ndarray:
        """Tensor indices in model order: by vpp_stage, then by first appearance (ranks in order); for
        actv_grad, msprobe's order (`grad_positions`), whatever order the file has. Costs O(tensors)."""
        pos = grad_positions(self.tensors.keys) if self.family == "actv_grad" else range(len(self.tensors))
        keys = [(vpp, p, i) for i, ((vpp, _name), p) in enumerate(zip(self.tensors.keys, pos))]
        return np.asarray([i for _vpp, _p, i in sorted(keys)], dtype=np.int64)

    def labels(self, order: np.ndarray | None = None) -> list[str]:
        """`name`, or `{vpp}:{name}` (msprobe's spelling) when the family has several vpp stages."""
        order = self.order() if order is None else order
        multi = len({vpp for vpp, _ in self.tensors.keys}) > 1
        return [
            f"{self.tensors.keys[i][0]}:{self.tensors.keys[i][1]}" if multi else self.tensors.keys[i][1]
            for i in order
        ]

    def col_keys(self) -> np.ndarray:
        return np.asarray(self.cols.keys, dtype=np.int64)

    def _view(self, name: str) -> np.ndarray:
        return self.acc[name][: len(self.tensors), : len(self.cols)]

    def combined(self, by: str = "cell") -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """(accumulators, column keys, tensor order): tensors in model order, columns sorted by key.

        by="cell": one column per (step, micro_step); by="step": micro-steps merged into their step
        (column keys are then steps). Copies within a cell are counted once here.
        """
        order = self.order()
        keys = self.col_keys()
        col_order = np.argsort(keys, kind="stable")
        keys = keys[col_order]
        index = np.ix_(order, col_order)
        out: dict[str, np.ndarray] = {}
        for name in self._names:
            if not name.startswith(("first_", "same_")):
                out[name] = self._view(name)[index]
        if "sq_norm" in out:
            n = out["n_norm"]
            copies = n > 1
            for mark in COPY_MARKS:  # every value statistic the rows hold agrees
                if f"same_{mark}" in self.acc:
                    copies = copies & self._view(f"same_{mark}")[index]
            if copies.any():
                first = self._view("first_norm")[index]
                out["sq_norm"] = np.where(copies, first * first, out["sq_norm"])
                for stat in ("nans", "infs"):
                    if stat in out:  # counts of copies: one copy's count
                        out[stat] = np.where(copies, out[stat] / np.maximum(n, 1), out[stat])
            del copies
        if by == "step":
            steps, _micro = split_key(keys)
            uniq, starts = np.unique(steps, return_index=True)
            if len(uniq) == len(keys):  # no micro-steps to merge
                return out, uniq, order
            for name, arr in out.items():
                if arr.shape[1] == 0:
                    continue
                rule = _RULE.get(name)  # min, max, and the family columns (MAX) keep their rule
                if rule is Combine.MIN:
                    out[name] = np.minimum.reduceat(arr, starts, axis=1)
                elif rule is Combine.MAX:
                    out[name] = np.maximum.reduceat(arr, starts, axis=1)
                else:
                    out[name] = np.add.reduceat(arr.astype(np.float64), starts, axis=1)
            return out, uniq, order
        return out, keys, order

    def finalize(self, by: str = "step") -> Final:
        """Every statistic as a matrix (cached until the next `add`)."""
        cached = self._final.get(by)
        if cached is not None:
            return cached
        acc, keys, order = self.combined(by)
        values: dict[str, np.ndarray] = {}
        present: dict[str, np.ndarray] = {}
        bad = np.zeros((len(order), len(keys)), dtype=bool)
        with np.errstate(invalid="ignore", divide="ignore"):
            for stat in self.stats:
                rule = _RULE[stat]
                weighted = rule in (Combine.MEAN_BY_FINITE, Combine.MEAN_BY_NUMEL)
                here = acc[f"w_{stat}" if weighted else f"n_{stat}"] > 0
                if rule is Combine.L2:
                    value = np.sqrt(acc[f"sq_{stat}"])
                elif weighted:
                    value = acc[f"s_{stat}"] / acc[f"w_{stat}"]
                else:
                    value = acc[stat].astype(np.float64)
                value = np.where(here, value, np.nan)
                if stat in ("nans", "infs"):
                    bad |= np.nan_to_num(value, nan=0.0) > 0
                else:
                    bad |= here & ~np.isfinite(value)
                if stat in self.seen_stats:
                    values[stat], present[stat] = value, here
        del acc
        final = Final(self.family, keys, order, self.labels(order), values, present, bad, by)
        self._final[by] = final
        return final

    def values(self, stat: str, by: str = "step") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(matrix [tensor, column], column keys, tensor order) of one statistic; NaN where no row."""
        final = self.finalize(by)
        if stat not in final.values:
            raise KeyError(f"{self.family}: no {stat!r} values (statistics seen: {sorted(final.values)})")
        return final.values[stat], final.keys, final.order


@dataclass
class Final:
    """A family's statistics as matrices: rows = tensors in model order, columns sorted by key."""

    family: str
    keys: np.ndarray  # column keys: steps (by="step") or step * MICRO_BASE + micro_step + 1 (by="cell")
    order: np.ndarray  # tensor index (into CellGrid.tensors.keys) of each row
    labels: list[str]
    values: dict[str, np.ndarray]
    present: dict[str, np.ndarray]
    nonfinite: np.ndarray  # a NaN/Inf statistic or a non-zero NaN/Inf count in the cell
    by: str
