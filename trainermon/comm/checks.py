"""Invariant checks of the step's collectives, from the statistics the monitor already has.

Each rank packs one line per checked (op, reduction, group, call site, source) into a table with one block
per rank of the job ([world, MAX_CHECKS, FIELDS], zeros elsewhere); one all-reduce (sum) over the default
group gives every rank every rank's lines: the step's single extra reduction. Each rank then checks its
own outputs against the combination of its group's inputs:

    all_reduce    sum: out_sum = sum_r in_sum_r;  avg: out_sum = sum_r in_sum_r / W;  max/min exactly
    broadcast     out_sum and out_max equal the source's in_sum and in_max
    all_gather    out_sum = sum_r in_sum_r;  out_max = max_r in_max_r;  out_min = min_r in_min_r
    reduce_scatter   sum_r out_sum_r = sum_r in_sum_r (/ W for avg);  max_r out_max_r = max_r in_max_r
                     (a rank holds one piece of the result: a violation names every rank of the group)

Sums are compared within the rounding the reduction itself may make: a float reduction of W values per
element is off by at most (W - 1) u sum|x| (u: the dtype's unit roundoff), and sum|x| <= sqrt(n sumsq), so
the tolerance is (W + 1) u sum_r sqrt(n_r sumsq_r), plus the engine's own bound on each sum it compares
(16 u' sum|x| for 16- and 32-bit floats, u' = 2^-24). Max and min are compared exactly. Calls of
one key within a step are summed first: the invariants are linear (max: monotone), so they hold for the
sums too.

A key where any rank's input held a NaN or Inf is not checked (counted as unchecked): the statistics
are over finite values (or NaN/Inf themselves), and a reduction spreads NaN/Inf to ranks whose inputs
were finite, so no sum can be compared. A non-finite output from finite inputs is a violation
(`nonfinite`), unless a sum of the inputs' largest magnitudes could overflow the dtype (unchecked).

Integer sums are exact (the engine reduces integers in float64, exact up to 2^53) but wrap on overflow,
as torch's reductions do: a sum or average over integers whose summed input range could leave the dtype's
range is unchecked, and so is an integer average (rounded per element); others are compared exactly.
A bool sum is a logical OR in torch (gloo and NCCL alike): the output's count of True lies between the
largest input count and the inputs' total, and its max is the inputs' max."""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from trainermon.stats.partials import INFS, MAX, MIN, NANS, SUM, SUMSQ, empty_partials

logger = logging.getLogger("trainermon")
MAX_CHECKS = 64
FIELDS = (
    "key", "in_sum", "in_max", "in_min", "in_abs", "out_sum", "out_max", "out_min", "out_abs", "n",
    "in_bad", "out_bad",
)  # fmt: skip
KEY, IN_SUM, IN_MAX, IN_MIN, IN_ABS, OUT_SUM, OUT_MAX, OUT_MIN, OUT_ABS, N, IN_BAD, OUT_BAD = range(
    len(FIELDS)
)
#: Said once per process: keys skipped because of NaN/Inf.
_said: set[str] = set()
_UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24, torch.float64: 2.0**-53}
#: The statistics engine's own bound on a sum: 16 u sum|x| for 16- and 32-bit floats, 1e-10 relative for
#: float64 (trainermon.stats.engine), exact for integers.
_ENGINE = {torch.float16: 16 * 2.0**-24, torch.bfloat16: 16 * 2.0**-24, torch.float32: 16 * 2.0**-24}


@dataclass(frozen=True)
class CheckKey:
    check: str  # "reduce", "broadcast", "gather", "scatter"
    op: str
    redop: str
    group: str
    ranks: tuple[int, ...]
    site: str
    src: int | None

    def code(self) -> float:
        """A 48-bit number that names the key identically on every rank (exact in float64)."""
        text = repr((self.check, self.op, self.redop, self.ranks, self.site, self.src))
        return float(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "big") + 1)


@dataclass
class CheckEntry:
    dtype: torch.dtype
    in_row: torch.Tensor | None = None  # [1, NUM_PARTIALS] summed over the step's calls
    out_row: torch.Tensor | None = None
    in_numel: int = 0
    out_numel: int = 0


@dataclass(frozen=True)
class Violation:
    key: CheckKey
    stat: str
    got: float
    expected: float
    ranks: tuple[int, ...]


def pack(
    entries: list[tuple[CheckKey, CheckEntry]], rank: int, world: int, device: torch.device
) -> torch.Tensor:
    """This rank's block of the table (every other block zero): a few kernels for all lines at once."""
    table = torch.zeros((world, MAX_CHECKS, len(FIELDS)), dtype=torch.float64, device=device)
    entries = entries[:MAX_CHECKS]
    if not entries:
        return table
    blank = empty_partials(1, device)
    ins = torch.cat([blank if e.in_row is None else e.in_row.to(device) for _, e in entries])
    outs = torch.cat([blank if e.out_row is None else e.out_row.to(device) for _, e in entries])
    host = torch.tensor(
        [
            [key.code(), e.in_numel, e.out_numel, e.in_row is not None, e.out_row is not None]
            for key, e in entries
        ],
        dtype=torch.float64,
    ).to(device)
    block = table[rank, : len(entries)]
    block[:, KEY] = host[:, 0]
    for side, (s_sum, s_max, s_min, s_abs, s_bad), numel, present in (
        (ins, (IN_SUM, IN_MAX, IN_MIN, IN_ABS, IN_BAD), host[:, 1], host[:, 3]),
        (outs, (OUT_SUM, OUT_MAX, OUT_MIN, OUT_ABS, OUT_BAD), host[:, 2], host[:, 4]),
    ):
        # NaN/Inf counted (`nans`/`infs` in ops), or seen in the statistics themselves (not counted):
        # at least 1 then. A row of no finite value has min/max +-inf with its count above 0.
        counted = side[:, NANS] + side[:, INFS]
        seen = ~torch.isfinite(side[:, [SUMSQ, SUM]]).all(1) | torch.isnan(side[:, [MIN, MAX]]).any(1)
        seen |= (counted == 0) & (torch.isinf(side[:, MIN]) | torch.isinf(side[:, MAX])) & (numel > 0)
        ok = present > 0
        block[:, s_bad] = torch.where(ok, torch.maximum(counted, seen.to(counted.dtype)), 0.0)
        block[:, s_sum] = torch.where(ok, side[:, SUM], 0.0)
        block[:, s_max] = torch.where(ok, side[:, MAX], 0.0)
        block[:, s_min] = torch.where(ok, side[:, MIN], 0.0)
        block[:, s_abs] = torch.where(ok, torch.sqrt(side[:, SUMSQ] * numel), 0.0)
    block[:, N] = torch.maximum(host[:, 1], host[:, 2])
    return table


def evaluate(
    table: np.ndarray, entries: list[tuple[CheckKey, CheckEntry]], rank: int
) -> tuple[list[Violation], int]:
    """Check this rank's entries against the gathered table; returns the violations and how many keys
    could not be checked (a member of the group had no line for it: a call site that differs by rank;
    or NaN/Inf in an input of the group: see the module's docstring)."""
    found: list[Violation] = []
    unchecked = nonfinite = 0
    index = [{float(c): j for j, c in enumerate(table[r, :, KEY]) if c} for r in range(table.shape[0])]
    for key, e in entries[:MAX_CHECKS]:
        code = key.code()
        mine = table[rank, index[rank][code]]
        members = [r for r in key.ranks if code in index[r]]
        if len(members) != len(key.ranks):
            unchecked += 1
            continue
        lines = np.stack([table[r, index[r][code]] for r in members])
        bad = _nonfinite(key, e, mine, lines, rank)
        if bad is None:
            found += _check(key, e, mine, lines, rank)
        elif bad is _SKIP:
            nonfinite += 1
        else:
            found.append(bad)
    if nonfinite and "nonfinite" not in _said:
        _said.add("nonfinite")
        logger.warning(
            "trainermon: cc_distribution checks skip (count as unchecked) a collective whose inputs hold "
            "NaN or Inf, or whose finite inputs may overflow (or wrap: integers): no sum can be compared "
            "(%d now; said once)",
            nonfinite,
        )
    return found, unchecked + nonfinite


_SKIP = object()


def _nonfinite(
    key: CheckKey, e: CheckEntry, mine: np.ndarray, lines: np.ndarray, rank: int
) -> Violation | object | None:
    """None: no NaN/Inf anywhere, check the key. `_SKIP`: an input of the group held NaN/Inf, or a
    finite input's sum may have overflowed into an Inf output. A Violation: NaN/Inf out of finite in."""
    if lines[:, IN_BAD].any():
        return _SKIP
    if _may_wrap(key, e.dtype, lines):
        return _SKIP
    scatter = key.check == "scatter"
    got = float(lines[:, OUT_BAD].sum()) if scatter else float(mine[OUT_BAD])
    if not got:
        return None
    if key.redop in ("sum", "avg") and key.check in ("reduce", "scatter") and e.dtype.is_floating_point:
        # finite inputs whose sum overflows give Inf (even NaN) legitimately: not checked then
        biggest = float(np.maximum(np.abs(lines[:, IN_MAX]), np.abs(lines[:, IN_MIN])).sum())
        w = len(key.ranks)
        if biggest * (1 + (w + 1) * _UNIT.get(e.dtype, 0.0)) >= torch.finfo(e.dtype).max:
            return _SKIP
    return Violation(key, "nonfinite", got, 0.0, key.ranks if scatter else (rank,))


def _may_wrap(key: CheckKey, dtype: torch.dtype, lines: np.ndarray) -> bool:
    """An integer sum/avg whose true value may leave the dtype's range (torch wraps it), or an integer
    average (rounded per element): no sum can be compared. Each element's sum lies within the sum over
    ranks of the inputs' min and max."""
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return False
    if key.redop not in ("sum", "avg") or key.check not in ("reduce", "scatter"):
        return False
    if key.redop == "avg":
        return True
    info = torch.iinfo(dtype)
    return float(lines[:, IN_MAX].sum()) > info.max or float(lines[:, IN_MIN].sum()) < info.min


def _check(key: CheckKey, e: CheckEntry, mine: np.ndarray, lines: np.ndarray, rank: int) -> list[Violation]:
    u = _UNIT.get(e.dtype, 0.0)
    engine = _ENGINE.get(e.dtype, 1e-10 if e.dtype == torch.float64 else 0.0)
    w = len(key.ranks)
    abs_in = float(lines[:, IN_ABS].sum())
    abs_out = float(lines[:, OUT_ABS].sum())
    if not engine and abs_in + abs_out >= 2.0**53:  # integers: float64 sums stop being exact
        engine = 1e-10
    out: list[Violation] = []

    def compare(stat: str, got: float, expected: float, tol: float, ranks: tuple[int, ...]) -> None:
        bad = (
            not math.isclose(got, expected, rel_tol=0.0, abs_tol=tol)
            if math.isfinite(expected)
            else (got != expected and not (math.isnan(got) and math.isnan(expected)))
        )
        if bad:
            out.append(Violation(key, stat, got, expected, ranks))

    me = (rank,)
    if e.dtype == torch.bool and key.redop in ("sum", "avg") and key.check in ("reduce", "scatter"):
        # a logical OR: as many True as the input with most, at most all of them; max is the inputs' max
        ranks = me if key.check == "reduce" else key.ranks
        got = float(mine[OUT_SUM]) if key.check == "reduce" else float(lines[:, OUT_SUM].sum())
        low, high = float(lines[:, IN_SUM].max()), float(lines[:, IN_SUM].sum())
        compare("sum", got, min(max(got, low), high), 0.0, ranks)
        mine_max = float(mine[OUT_MAX]) if key.check == "reduce" else float(lines[:, OUT_MAX].max())
        compare("max", mine_max, float(lines[:, IN_MAX].max()), 0.0, ranks)
        return out
    if key.check == "reduce":
        if key.redop in ("sum", "avg"):
            div = w if key.redop == "avg" else 1
            tol = (w + 1) * u * abs_in / div + engine * (abs_in / div + float(mine[OUT_ABS]))
            compare("sum", float(mine[OUT_SUM]), float(lines[:, IN_SUM].sum()) / div, tol, me)
        elif key.redop == "max":
            compare("max", float(mine[OUT_MAX]), float(lines[:, IN_MAX].max()), 0.0, me)
        elif key.redop == "min":
            compare("min", float(mine[OUT_MIN]), float(lines[:, IN_MIN].min()), 0.0, me)
    elif key.check == "broadcast" and key.src in key.ranks:
        src = lines[list(key.ranks).index(key.src)]
        tol = engine * (float(src[IN_ABS]) + float(mine[OUT_ABS]))
        compare("sum", float(mine[OUT_SUM]), float(src[IN_SUM]), tol, me)
        compare("max", float(mine[OUT_MAX]), float(src[IN_MAX]), 0.0, me)
    elif key.check == "gather":
        tol = engine * (abs_in + float(mine[OUT_ABS]))
        compare("sum", float(mine[OUT_SUM]), float(lines[:, IN_SUM].sum()), tol, me)
        compare("max", float(mine[OUT_MAX]), float(lines[:, IN_MAX].max()), 0.0, me)
        compare("min", float(mine[OUT_MIN]), float(lines[:, IN_MIN].min()), 0.0, me)
    elif key.check == "scatter":
        if key.redop in ("sum", "avg"):
            div = w if key.redop == "avg" else 1
            tol = (w + 1) * u * abs_in / div + engine * (abs_in / div + abs_out)
            compare(
                "sum", float(lines[:, OUT_SUM].sum()), float(lines[:, IN_SUM].sum()) / div, tol, key.ranks
            )
        elif key.redop == "max":
            compare("max", float(lines[:, OUT_MAX].max()), float(lines[:, IN_MAX].max()), 0.0, key.ranks)
    return out
