"""The two ways ranks merge partial rows (`stats.partials.reduce_across`): the all-gather a small group
uses, and the two all-reduces a group of thousands of ranks takes instead (`GATHER_BYTES`), on 4 gloo
ranks, against a merge of every rank's rows computed in the test.

The rows hold what merges meet: pieces of one tensor, ranks with no piece (the identity: min +inf, max
-inf), a NaN min or max (NaN counting off), flags on some ranks, and a -0.0. Sums: four float64 terms in
[-2, 2], so partial sums within [-8, 8]; each of the three additions rounds by at most 2^-53 x 8, in the
all-reduce's order and in the test's rank order alike: the two differ by at most 2 x 3 x 8 x 2^-53
(5.3e-15; a wrong merge is off by the size of a term). The gather adds in rank order, as the test does,
and is held to exact equality."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from tests.distributed import run_ranks
from trainermon.stats.partials import GATHER_OP

WORLD, ROWS = 4, 6


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    from trainermon.stats.partials import MAX, MIN, empty_partials

    gen = torch.Generator().manual_seed(100 + rank)
    rows = torch.rand(ROWS, 7, generator=gen, dtype=torch.float64) * 4 - 2
    rows[:, MIN], rows[:, MAX] = rows[:, MIN].minimum(rows[:, MAX]), rows[:, MIN].maximum(rows[:, MAX])
    if rank == 1:
        rows[1] = empty_partials(1)[0]  # this rank holds no piece of row 1
    if rank == 2:
        rows[2, MAX] = math.nan  # a NaN seen with NaN counting off
    if rank == 3:
        rows[3, MIN] = math.nan
    rows[4] = empty_partials(1)[0]  # no rank holds a piece of row 4
    rows[5, MIN] = -0.0 if rank == 0 else 0.5
    flags = torch.zeros(ROWS, dtype=torch.float64)
    flags[0] = float(rank == 3)
    return rows, flags


def _merge_both(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from trainermon.stats import partials

    calls: list[str] = []
    for name in (partials.GATHER_OP, "all_reduce"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    rows, flags = _rows(rank)
    with warnings.catch_warnings(record=True) as caught:  # torch's deprecations reach every user's log
        warnings.simplefilter("always")
        gathered = partials.reduce_across(rows.clone(), None, flags.clone())
        gather_calls = list(calls)
        partials.GATHER_BYTES = 0
        reduced = partials.reduce_across(rows.clone(), None, flags.clone())
        plain = partials.reduce_across(rows.clone(), None)  # no flags given: the rows alone
    return {
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "gather": [gathered[0].tolist(), gathered[1].tolist()],
        "reduce": [reduced[0].tolist(), reduced[1].tolist()],
        "plain": plain.tolist(),
        "calls": [gather_calls, calls[len(gather_calls) :]],
    }


#: Each rank's row keys for three agreements of the summaries' layout: ranks 0 and 1 hold one list, 2 and
#: 3 another (two pipeline stages, say); then every rank its own (rank-specific rows); then every rank the
#: same list (data-parallel replicas).
def _keys(rank: int, agreement: int) -> list[tuple]:
    if agreement == 0:
        names = ("a", "b") if rank < 2 else ("b", "c")
    elif agreement == 1:
        names = ("c", f"r{rank}")
    else:
        names = ("c", "d")
    return [("actv", 0, name, 0) for name in names]


def _agree_thrice(rank: int, world: int) -> dict:
    """Three agreements of the key union (`CrossRank._agree`), with the collectives each made (the
    all-reduce with its length in bytes)."""
    import torch.distributed as dist

    from trainermon.collect.xrank import CrossRank

    xrank = CrossRank(rank, world)
    xrank.attach()
    found: dict = {"unions": [], "calls": []}
    for agreement in range(3):
        calls: list = []
        real = {name: getattr(dist, name) for name in ("all_gather", "broadcast", "all_reduce")}
        for name, fn in real.items():

            def counted(*a, _fn=fn, _name=name, _calls=calls, **k):
                _calls.append([_name, a[0].numel()] if _name == "all_reduce" else _name)
                return _fn(*a, **k)

            setattr(dist, name, counted)
        try:
            xrank._agree(_keys(rank, agreement))
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)
        found["unions"].append([list(k) for k in xrank.keys])
        found["calls"].append(calls)
    found["slots"] = [[list(k), v] for k, v in xrank.slots.items()]
    return found


def _launch(rank: int, world: int) -> dict:
    return {"merge": _merge_both(rank, world), "agree": _agree_thrice(rank, world)}


@pytest.fixture(scope="module")
def launched() -> list[dict]:
    """One 4-rank launch for the tests of this module."""
    return run_ranks(_launch, world_size=WORLD)


def test_gather_and_all_reduce_merge_alike(launched):
    from trainermon.stats.partials import ADDITIVE, MAX, MIN

    results = [r["merge"] for r in launched]
    every = [_rows(rank) for rank in range(WORLD)]
    want = every[0][0].clone()
    for rows, _ in every[1:]:
        want[:, ADDITIVE] += rows[:, ADDITIVE]
    stacked = torch.stack([rows for rows, _ in every])
    want[:, MIN] = stacked[:, :, MIN].amin(0)  # NaN-propagating, as the merge must be
    want[:, MAX] = stacked[:, :, MAX].amax(0)
    want_flags = [any(float(flags[i]) > 0 for _, flags in every) for i in range(ROWS)]
    assert math.isnan(want[2, MAX]) and math.isnan(want[3, MIN]) and want[4, MIN] == math.inf
    for rank, found in enumerate(results):
        assert found["calls"] == [[GATHER_OP], ["all_reduce"] * 4], found["calls"]
        assert found["warnings"] == [], found["warnings"]
        gathered = torch.tensor(found["gather"][0], dtype=torch.float64)
        reduced = torch.tensor(found["reduce"][0], dtype=torch.float64)
        assert torch.equal(gathered.isnan(), want.isnan()) and torch.equal(reduced.isnan(), want.isnan())
        assert torch.equal(gathered.nan_to_num(), want.nan_to_num()), rank  # rank order: exact
        torch.testing.assert_close(reduced, want, rtol=0, atol=48 * 2.0**-53, equal_nan=True)
        # min and max are exact whatever the path (no arithmetic), the identity rows included
        for column in (MIN, MAX):
            assert torch.equal(reduced[:, column].nan_to_num(), want[:, column].nan_to_num()), (rank, column)
        assert found["gather"][1] == want_flags and found["reduce"][1] == want_flags, rank
        assert torch.equal(
            torch.tensor(found["plain"], dtype=torch.float64).nan_to_num(), reduced.nan_to_num()
        )


def test_each_distinct_key_list_travels_once(launched):
    """The layout's union of keys is what a gather of every rank's list gives (rank order, then each
    rank's order, the agreed keys first). After the digests' all-gather, the distinct lists travel in one
    all-reduce of exactly their bytes, however many there are (two lists over four ranks, then four), and
    nothing travels when every rank holds the same list."""
    key = [["actv", 0, n, 0] for n in ("a", "b", "c", "r0", "r1", "r2", "r3", "d")]
    unions = [key[:3], key[:7], key]
    sizes = [
        sum(len(json.dumps([list(k) for k in _keys(r, agreement)])) for r in ranks)
        for agreement, ranks in ((0, (0, 2)), (1, (0, 1, 2, 3)))
    ]
    for rank, result in enumerate(launched):
        found = result["agree"]
        assert found["unions"] == unions, rank
        assert found["calls"] == [
            ["all_gather", ["all_reduce", sizes[0]]],
            ["all_gather", ["all_reduce", sizes[1]]],
            ["all_gather"],
        ], rank
        assert found["slots"] == [[k, i] for i, k in enumerate(key)], rank
