"""Compare a run with its benchmark run: align, find the first divergence, tabulate per family.

Alignment: rows are matched by (family, vpp_stage, name, step, micro_step); on each side, the rows of
every rank for that key are first combined into one value (see `grid.py`: shards combined, copies
counted once), so two runs with different parallel layouts are compared on the same full tensors.

Relative difference: `|run - benchmark| / max(|benchmark|, tiny)` (tiny = 1e-12). A cell diverges when
that exceeds `rtol` (plus `atol / max(|benchmark|, tiny)` when an absolute tolerance is given), or when
one side is non-finite (a NaN or Inf value, or a non-zero nans/infs count) and the other is not. Two
non-finite values are equal (NaN vs NaN, Inf vs Inf, NaN vs Inf alike). Such a non-finite divergence has
relative difference inf (also in `max_rel_diff`, counted in `cells_nonfinite`) and a `cause` naming the
column that is non-finite on one side only, as "{column} {benchmark} -> {run}" (`nans 0 -> 3`); when the
compared statistic itself is finite on both sides, the divergence reports that column (`stat`, values).

The first divergence is the earliest (step, micro_step) with any diverging cell, and within it the
first tensor in execution order: micro-batches in order (rows without a micro-step, such as optimizer
state, after every micro-batch), then families in the order their hooks run within a step (actv,
actv_grad, grad_unreduced, grad_reduced, param_origin, exp_avg, exp_avg_sq, param_updated), then model
order. Tensors, steps and families present in only one run are listed, never silently dropped.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .compare_keys import NothingCompared, key_notes, nothing_compared, rank_notes
from .grid import split_key, with_copy_marks
from .jsonutil import describe, jsonable, records
from .runs import REDONE
from .scan import RunSummary, scan
from .source import FAMILY_STATS, FLOAT_STATS, RunSource, family_order

TINY = 1e-12


def relative_difference(run: Any, benchmark: Any, tiny: float = TINY) -> np.ndarray:
    """|run - benchmark| / max(|benchmark|, tiny), elementwise."""
    a, b = np.asarray(run, dtype=np.float64), np.asarray(benchmark, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.abs(a - b) / np.maximum(np.abs(b), tiny)


@dataclass(frozen=True)
class Divergence:
    family: str
    vpp_stage: int
    name: str
    step: int
    micro_step: int | None
    stat: str
    run_value: float
    benchmark_value: float
    rel_diff: float
    label: str = ""  # the name, or `{vpp}:{name}` when the family has several vpp stages
    cause: str = ""  # a non-finite divergence: "{column} {benchmark} -> {run}" (`_explain`)


def _label(vpp: int, name: str, multi: bool) -> str:
    return f"{vpp}:{name}" if multi else name


@dataclass
class Comparison:
    run: RunSummary
    benchmark: RunSummary
    rtol: float
    atol: float
    stats: list[str]
    first: Divergence | None
    per_family: pd.DataFrame
    divergent: pd.DataFrame
    only_in_run: pd.DataFrame
    only_in_benchmark: pd.DataFrame
    families_only_in_run: list[str]
    families_only_in_benchmark: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        return self.first is not None

    def series(self, family: str, name: str, vpp_stage: int = 0, stat: str | None = None) -> pd.DataFrame:
        """Per step (micro-steps merged): the statistic in both runs and their relative difference."""
        stat = stat or self.stats[0]
        parts = {}
        for side, summary in (("run", self.run), ("benchmark", self.benchmark)):
            grid = summary.grids[family]
            final = grid.finalize("step")
            idx = grid.tensors.index.get((vpp_stage, name))
            if idx is None or stat not in final.values:
                parts[side] = pd.Series(dtype=np.float64)
                continue
            row = int(np.flatnonzero(final.order == idx)[0])
            here = final.present[stat][row]
            parts[side] = pd.Series(final.values[stat][row][here], index=final.keys[here])
        df = pd.concat(parts, axis=1).sort_index()
        df.index.name = "step"
        df["rel_diff"] = relative_difference(df["run"], df["benchmark"])
        return df

    def findings(self) -> dict:
        """JSON-ready summary (the same content as the report)."""
        return {
            "run": describe(self.run),
            "benchmark": describe(self.benchmark),
            "rtol": self.rtol,
            "atol": self.atol,
            "stats": self.stats,
            "relative_difference": "|run - benchmark| / max(|benchmark|, 1e-12)",
            "diverged": self.diverged,
            "first_divergence": None if self.first is None else jsonable(asdict(self.first)),
            "per_family": records(self.per_family),
            "divergent_tensors": records(self.divergent.head(200)),
            "divergent_tensors_total": int(len(self.divergent)),
            "only_in_run": records(self.only_in_run),
            "only_in_benchmark": records(self.only_in_benchmark),
            "families_only_in_run": self.families_only_in_run,
            "families_only_in_benchmark": self.families_only_in_benchmark,
            "notes": self.notes,
        }

    def figures(self, max_plots: int = 6) -> dict[str, Any]:
        """{file stem: matplotlib Figure}: the first diverging tensors in both runs."""
        return dict(self.iter_figures(max_plots))

    def iter_figures(self, max_plots: int = 6) -> Iterator[tuple[str, Any]]:
        from .plots import plot_divergence

        for i, r in enumerate(self.divergent.head(max_plots).itertuples(index=False)):
            df = self.series(r.family, r.name, r.vpp_stage, r.stat)
            title = f"{r.family} {r.label} ({r.stat}): first diverges at step {r.first_step}"
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"diverge_{i:02d}_{r.family}_{r.label}")
            yield stem, plot_divergence(df, title, self.rtol, r.first_step)


def _explain(fa: Any, fb: Any, cell: tuple[int, int, int, int], stat: str, va: float, vb: float) -> tuple:
    """(stat, run value, benchmark value, cause) of a non-finite divergence at `cell` (row, column in
    `fa`, row, column in `fb`). A NaN/Inf in the compared statistic is its own cause; otherwise the cell
    is non-finite through another column (a nans/infs count: the norm covers the finite values only),
    which is reported instead, so the message names what actually differs."""
    ra, ca, rb, cb = cell
    if not (math.isfinite(va) and math.isfinite(vb)):
        return stat, va, vb, f"{stat} {vb:.6g} -> {va:.6g}"
    floats = [c for c in fa.values if c not in ("nans", "infs")]
    for col in ["nans", "infs", *floats]:
        in_a, in_b = col in fa.values, col in fb.values
        if not (in_a and in_b):
            # a count only one run recorded (`ops` differ): a non-zero one is the cause, named as such
            if col in ("nans", "infs") and (in_a or in_b):
                a = float(fa.values[col][ra, ca]) if in_a and fa.present[col][ra, ca] else math.nan
                b = float(fb.values[col][rb, cb]) if in_b and fb.present[col][rb, cb] else math.nan
                if a > 0 or b > 0:
                    shown = [f"{x:.6g}" if there else "(no column)" for x, there in ((b, in_b), (a, in_a))]
                    return col, a, b, f"{col} {shown[0]} -> {shown[1]}"
            continue
        a = float(fa.values[col][ra, ca]) if fa.present[col][ra, ca] else math.nan
        b = float(fb.values[col][rb, cb]) if fb.present[col][rb, cb] else math.nan
        if col in ("nans", "infs"):
            a_bad, b_bad = a > 0, b > 0  # NaN (no row of the count) compares False: not bad
            a, b = (0.0 if math.isnan(x) else x for x in (a, b))
        else:
            a_bad = fa.present[col][ra, ca] and not math.isfinite(a)
            b_bad = fb.present[col][rb, cb] and not math.isfinite(b)
        if a_bad != b_bad:
            return col, a, b, f"{col} {b:.6g} -> {a:.6g}"
    side = "run" if fa.nonfinite[ra, ca] else "benchmark"
    return stat, va, vb, f"non-finite in the {side}"  # not expected: every flag comes from a column


def _tensor_rows(grid, order: np.ndarray) -> list[tuple[int, str]]:
    return [grid.tensors.keys[i] for i in order]


def compare(
    run: str | os.PathLike | RunSource,
    benchmark: str | os.PathLike | RunSource,
    rtol: float = 0.01,
    atol: float = 0.0,
    stats: Iterable[str] = ("norm",),
    families: Iterable[str] | None = None,
    steps: tuple[int, int] | None = None,
    progress: bool | None = None,
    batch_size: int = 65_536,
    engine: str = "pyarrow",
    spark_master: str | None = None,
) -> Comparison:
    """Compare `run` with `benchmark` (paths or `RunSource`s) on `stats` (default the norm).

    engine: "pyarrow", "duckdb" or "spark" reads the rows (`engines.py`), or "auto" (duckdb when both
    are Parquet and it is installed); the comparison of the cells is this function's, for every engine.
    spark_master: Spark's master URL (default local[*]).
    """
    from .analyze import open_with
    from .engines import engine_scan, resolve_engine

    if not rtol >= 0 or not atol >= 0:
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol!r} atol={atol!r}")
    src_a, eng_a = open_with(run, engine, spark_master)
    src_b, eng_b = open_with(benchmark, engine, spark_master)
    engine = eng_a if eng_a == eng_b else resolve_engine(engine, [src_a, src_b])
    stats = list(stats)
    allowed = [*FLOAT_STATS, "nans", "infs", *(s for extra in FAMILY_STATS.values() for s in extra)]
    if [s for s in stats if s not in allowed]:  # a typo must not read as "not in both runs"
        raise KeyError(f"unknown statistics {[s for s in stats if s not in allowed]}; allowed: {allowed}")
    # xrank rows summarise other families over ranks (analyze reports them); not tensors to align
    fam_a = [f for f in src_a.families() if f != "xrank"]
    fam_b = [f for f in src_b.families() if f != "xrank"]
    all_a, all_b = fam_a, fam_b
    wanted = None if families is None else list(dict.fromkeys(families))
    if wanted is not None:
        unknown = [f for f in wanted if f not in fam_a and f not in fam_b]
        if unknown:  # a typo must not read as "the runs share no family"
            raise KeyError(
                f"families {unknown} are in neither run: {src_a.path!r} has {fam_a}, "
                f"{src_b.path!r} has {fam_b}"
            )
        fam_a = [f for f in fam_a if f in wanted]
        fam_b = [f for f in fam_b if f in wanted]
    common = [f for f in fam_a if f in fam_b]
    scan_stats = with_copy_marks(list(dict.fromkeys(stats + ["nans", "infs"])))
    kw: dict[str, Any] = {"stats": scan_stats, "steps": steps, "progress": progress, "batch_size": batch_size}
    if engine == "pyarrow":
        sum_a = scan(src_a, families=common, label="run", **kw)
        sum_b = scan(src_b, families=common, label="benchmark", **kw)
    else:
        wanted_stats = {f: scan_stats for f in common}
        sum_a = engine_scan(src_a, engine, wanted_stats, steps, spark_master=spark_master)
        sum_b = engine_scan(src_b, engine, wanted_stats, steps, spark_master=spark_master)
    notes: list[str] = rank_notes(src_a, src_b)
    notes += [
        f"{which}: {n}" for which, s in (("run", sum_a), ("benchmark", sum_b)) for n in s.notes if REDONE in n
    ]

    per_family, divergent_parts, only_a_rows, only_b_rows = [], [], [], []
    firsts: list[tuple[tuple, Divergence]] = []
    for family in common:
        ga, gb = sum_a.grids[family], sum_b.grids[family]
        fa, fb = ga.finalize("cell"), gb.finalize("cell")
        ta, tb = _tensor_rows(ga, fa.order), _tensor_rows(gb, fb.order)
        pos_b = {k: i for i, k in enumerate(tb)}
        set_a = set(ta)
        ia = np.asarray([i for i, k in enumerate(ta) if k in pos_b], dtype=np.int64)
        ib = np.asarray([pos_b[ta[i]] for i in ia], dtype=np.int64)
        only_a = [k for k in ta if k not in pos_b]
        only_b = [k for k in tb if k not in set_a]
        only_a_rows += [{"family": family, "vpp_stage": v, "name": n} for v, n in only_a]
        only_b_rows += [{"family": family, "vpp_stage": v, "name": n} for v, n in only_b]
        keys, ca, cb = np.intersect1d(fa.keys, fb.keys, assume_unique=True, return_indices=True)
        # Columns in execution order: by step, micro-batches in order, then rows without a micro-step.
        k_step, k_micro = split_key(keys)
        perm = np.lexsort((np.where(k_micro < 0, np.iinfo(np.int64).max, k_micro), k_step))
        keys, ca, cb = keys[perm], ca[perm], cb[perm]
        multi = len({v for v, _ in ta} | {v for v, _ in tb}) > 1
        steps_a, steps_b = set(split_key(fa.keys)[0].tolist()), set(split_key(fb.keys)[0].tolist())
        usable = [s for s in stats if s in fa.values and s in fb.values]
        missing = [s for s in stats if s not in usable]
        if missing:
            notes.append(f"{family}: {missing} not in both runs, not compared")
        shape = (len(ia), len(keys))
        div = np.zeros(shape, dtype=bool)
        compared = np.zeros(shape, dtype=bool)
        rel = np.zeros(shape)
        which = np.full(shape, -1, dtype=np.int64)
        va_first = np.full(shape, np.nan)
        vb_first = np.full(shape, np.nan)
        rel_first = np.full(shape, np.nan)  # the relative difference of the statistic `which` names
        nfa = fa.nonfinite[np.ix_(ia, ca)]
        nfb = fb.nonfinite[np.ix_(ib, cb)]
        for si, stat in enumerate(usable):
            a = fa.values[stat][np.ix_(ia, ca)]
            b = fb.values[stat][np.ix_(ib, cb)]
            here = fa.present[stat][np.ix_(ia, ca)] & fb.present[stat][np.ix_(ib, cb)]
            a_bad, b_bad = nfa | ~np.isfinite(a), nfb | ~np.isfinite(b)
            r = relative_difference(a, b)
            both_ok = here & ~a_bad & ~b_bad
            limit = rtol + atol / np.maximum(np.abs(b), TINY)
            d_s = here & ((a_bad != b_bad) | (both_ok & (r > limit)))
            r_s = np.where(both_ok, r, np.where(here & (a_bad != b_bad), np.inf, 0.0))
            new = d_s & (which < 0)
            which[new] = si
            va_first[new], vb_first[new], rel_first[new] = a[new], b[new], r_s[new]
            div |= d_s
            compared |= here
            rel = np.fmax(rel, np.where(here, r_s, 0.0))
        n_div = int(div.sum())
        first_step = first_micro = first_name = None
        if n_div:
            cols_any = div.any(axis=0)
            j = int(np.argmax(cols_any))
            i = int(np.argmax(div[:, j]))
            step, micro = (int(x[0]) for x in split_key(keys[j : j + 1]))
            vpp, name = ta[int(ia[i])]
            first_step, first_micro = step, (None if micro < 0 else micro)
            first_name = _label(vpp, name, multi)
            rows_any = np.flatnonzero(div.any(axis=1))
            first_col = np.argmax(div[rows_any], axis=1)
            fsteps, fmicros = split_key(keys[first_col])
            shown = []  # (stat, run value, benchmark value, cause) at each tensor's first divergence
            for k, c in zip(rows_any.tolist(), first_col.tolist()):
                got = (usable[int(which[k, c])], float(va_first[k, c]), float(vb_first[k, c]))
                cell = (int(ia[k]), int(ca[c]), int(ib[k]), int(cb[c]))
                shown.append(_explain(fa, fb, cell, *got) if np.isinf(rel_first[k, c]) else (*got, ""))
            stat_i, va_i, vb_i, cause = shown[int(np.searchsorted(rows_any, i))]  # row i diverges first at j
            d = Divergence(
                family, vpp, name, step, first_micro, stat_i, va_i, vb_i, float(rel_first[i, j]), first_name,
                cause,
            )  # fmt: skip
            firsts.append(((step, math.inf if micro < 0 else micro, family_order(family), family, i), d))
            part = pd.DataFrame(
                {
                    "family": family,
                    "vpp_stage": [ta[int(ia[k])][0] for k in rows_any],
                    "name": [ta[int(ia[k])][1] for k in rows_any],
                    "label": [_label(*ta[int(ia[k])], multi) for k in rows_any],
                    "first_step": fsteps,
                    "first_micro_step": [None if m < 0 else int(m) for m in fmicros],
                    "stat": [x[0] for x in shown],
                    "run_value": [x[1] for x in shown],
                    "benchmark_value": [x[2] for x in shown],
                    "rel_diff_at_first": rel_first[rows_any, first_col],
                    "cause": [x[3] for x in shown],
                    "divergent_cells": div[rows_any].sum(axis=1),
                    "max_rel_diff": np.where(div[rows_any], rel[rows_any], 0.0).max(axis=1),
                    "_micro": [math.inf if m < 0 else m for m in fmicros],
                    "_fam": family_order(family),
                    "_pos": rows_any,
                }
            )
            divergent_parts.append(part)
        notes += key_notes(family, fa.keys, fb.keys, int(compared.sum()))
        # inf where a cell diverges by being non-finite on one side only: a finite maximum next to such
        # cells would read as "diverged by at most that much"
        nonfinite_div = div & np.isinf(rel)
        per_family.append(
            {
                "family": family,
                "tensors_compared": len(ia),
                "only_in_run": len(only_a),
                "only_in_benchmark": len(only_b),
                "steps_compared": len(set(split_key(keys)[0].tolist())),
                "steps_only_in_run": len(steps_a - steps_b),
                "steps_only_in_benchmark": len(steps_b - steps_a),
                "cells_compared": int(compared.sum()),
                "cells_divergent": n_div,
                "cells_nonfinite": int(nonfinite_div.sum()),
                "first_divergent_step": first_step,
                "first_divergent_micro_step": first_micro,
                "first_divergent_tensor": first_name,
                "max_rel_diff": float(rel[compared].max()) if compared.any() else 0.0,
            }
        )
    if not sum(row["cells_compared"] for row in per_family):
        raise NothingCompared(nothing_compared(sum_a, sum_b, all_a, all_b, common, notes, wanted, steps))
    columns = ["family", "vpp_stage", "name", "label", "first_step", "first_micro_step", "stat", "run_value"]
    columns += ["benchmark_value", "rel_diff_at_first", "cause", "divergent_cells", "max_rel_diff"]
    if divergent_parts:
        divergent = pd.concat(divergent_parts, ignore_index=True)
        divergent = divergent.sort_values(["first_step", "_micro", "_fam", "family", "_pos"], kind="stable")
        divergent = divergent[columns].reset_index(drop=True)
    else:
        divergent = pd.DataFrame(columns=columns)
    first = min(firsts, key=lambda x: x[0])[1] if firsts else None
    pf_cols = ["family", "tensors_compared", "only_in_run", "only_in_benchmark", "steps_compared"]
    pf_cols += ["steps_only_in_run", "steps_only_in_benchmark", "cells_compared", "cells_divergent"]
    pf_cols += ["cells_nonfinite"]
    pf_cols += [
        "first_divergent_step",
        "first_divergent_micro_step",
        "first_divergent_tensor",
        "max_rel_diff",
    ]
    name_cols = ["family", "vpp_stage", "name"]
    return Comparison(
        run=sum_a,
        benchmark=sum_b,
        rtol=rtol,
        atol=atol,
        stats=stats,
        first=first,
        per_family=pd.DataFrame(per_family, columns=pf_cols),
        divergent=divergent,
        only_in_run=pd.DataFrame(only_a_rows, columns=name_cols),
        only_in_benchmark=pd.DataFrame(only_b_rows, columns=name_cols),
        families_only_in_run=[f for f in fam_a if f not in fam_b],
        families_only_in_benchmark=[f for f in fam_b if f not in fam_a],
        notes=notes,
    )
