"""Cross-rank summaries of the per-rank families (activations, their gradients, pre-reduce gradients).

Per collected (scheduled) step, for every row key (family, vpp_stage, name, micro_step) held by any rank
and every float statistic of the config: the max, min and mean over the ranks holding the row, the rank
holding the max and the min (the lowest such rank on ties), NaN and Inf counts summed over ranks, and the
lowest rank whose row was non-finite. Rank 0 writes them as the family `xrank`.

Cost per collected step, whatever the number of rows: one all-gather of the step's packed table over
the default group (on the rows' device; the int64 keys ride bit for bit beside the float64 sums, merged
by max and by sums in rank order on every rank), plus one 8-byte all-reduce on a CPU (gloo) group that
checks the layout (below). An all-gather receives world x table: 160 bytes per row with 4 statistics, so
1,000 rows at 1,000 ranks would receive 160 MB per rank per collected step, into a buffer of that size
on the device. Hence the gather only while world x table is at most `stats.partials.GATHER_BYTES`
(4 MiB: 1,000 rows up to 26 ranks, 100 rows up to 262); beyond, two all-reduces (int64 max of the
keys, float64 sum of the rest), which receive about twice the table whatever the world size. The choice
is the same on every rank (the table's size is agreed) and on every step until the layout changes.
The results travel to the host in the step's single transfer (`StepCollector.finish(tail=...)`);
decoding happens on the worker.

Layout: a packed reduction needs the same table on every rank, but ranks may hold different rows
(`module_ranks`, pipeline stages, escalated activations). The table is laid out by an agreed list of keys,
the union over ranks, ordered by rank then by each rank's row order. Each step every rank checks on the
host whether all its rows have a slot; the OR of that check over ranks (the gloo all-reduce: no device
sync) is known to every rank at the same step, and when it is set the ranks agree a new union of their
key lists (`key_union`: each distinct list sent once, in at most two collectives; only on steps whose rows
changed, usually the first) before reducing. A rank lacking a row fills its slot with the identity
(absent), so every rank reduces the same table and no rank waits on another: no deadlock whatever the row
sets. `ranks` says how many ranks held each row.

Max and argmax in one reduction: each float64 value becomes an order-preserving int64 key whose lowest
b bits (b = bits of world_size - 1) are replaced by (world_size - 1 - rank), so an int64 MAX gives the
largest value and, among equal values, the lowest rank. The reported max and min are therefore the
values with their b lowest mantissa bits cleared: relative error below 2^(b-52) (4e-12 at 10,000 ranks),
far below the statistics' own accuracy (float32 accumulation, about 5e-7).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainermon.stats import INFS, MAX, MIN, NANS, NUM_PARTIALS, SUM, SUMSQ, ZEROS
from trainermon.stats import partials as stats_partials
from trainermon.stats.table import FLOAT_STATS

from .key_union import union_of_keys
from .records import XRANK_FAMILIES, RowMeta
from .transfer import on_device, to_device

_ABSENT = -(2**63)
_FLIP = 0x7FFF_FFFF_FFFF_FFFF

Key = tuple  # (family, vpp_stage, name, micro_step)


@dataclass(frozen=True)
class XRankLayout:
    """What the worker needs to decode a step's summaries: the agreed keys and the statistics."""

    keys: tuple[Key, ...]
    stats: tuple[str, ...]
    world_size: int

    @property
    def tail_rows(self) -> int:
        """Rows of NUM_PARTIALS float64 the packed results take in the step's transfer."""
        return math.ceil(len(self.keys) * _width(len(self.stats)) / NUM_PARTIALS)


@dataclass(frozen=True)
class XRankTable:
    """A step's summaries as exporters see them: one row per (key, statistic); `values` by column."""

    rows: tuple[tuple, ...]  # (family, vpp_stage, name, micro_step, stat)
    values: dict[str, np.ndarray]  # XRANK_COLUMNS; ranks are -1 where no rank had a value

    def columns(self) -> dict[str, Any]:
        """The rows as columns of the tidy table (Parquet names; micro_step -1: none)."""
        rows = self.rows
        out: dict[str, Any] = {
            "vpp_stage": [r[1] for r in rows],
            "name": [r[2] for r in rows],
            "micro_step": np.array([-1 if r[3] is None else r[3] for r in rows], dtype=np.int64),
            "xrank_family": [r[0] for r in rows],
            "xrank_stat": [r[4] for r in rows],
        }
        out.update({c: self.values[c] for c in ("max", "min", "mean", "nans", "infs")})
        out.update({c: self.values[c].tolist() for c in ("max_rank", "min_rank", "nonfinite_rank", "ranks")})
        return out


def _width(n_stats: int) -> int:
    """int64 columns (max keys, min keys, non-finite tag) and float64 columns (sums, counts, nans, infs,
    present): the packed row of one key."""
    return (2 * n_stats + 1) + (2 * n_stats + 3)


def _bits(world_size: int) -> int:
    return max(1, (world_size - 1).bit_length())


def _to_key(v: torch.Tensor, tag: torch.Tensor, bits: int) -> torch.Tensor:
    """Order-preserving int64 keys of float64 `v` (NaN: absent), low `bits` replaced by `tag`."""
    raw = (v + 0.0).view(torch.int64)  # -0.0 + 0.0 is +0.0: a zero keeps key 0 (not 5e-324 back)
    key = torch.where(raw < 0, raw ^ _FLIP, raw)
    key = (key & ~((1 << bits) - 1)) | tag
    return torch.where(torch.isnan(v), torch.full_like(key, _ABSENT), key)


def _from_key(key: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Values and ranks back from reduced keys (NaN and -1 where no rank had a value)."""
    bits = _bits(world_size)
    mask = (1 << bits) - 1
    absent = key == _ABSENT
    rank = np.where(absent, -1, world_size - 1 - (key & mask))
    k = key & ~np.int64(mask)
    raw = np.where(k < 0, k ^ np.int64(_FLIP), k)
    value = np.where(absent, np.nan, raw.view(np.float64))
    return value, rank


def _statistics(table: torch.Tensor, numel: torch.Tensor, stats: Sequence[str]) -> torch.Tensor:
    """The float statistics of partial rows, on their device (`stats.finalize`, in torch)."""
    finite = numel - table[:, NANS] - table[:, INFS]
    has = finite > 0
    nan = torch.full_like(finite, math.nan)
    columns = {
        # no finite value in a non-empty tensor: NaN, as finalize says (not a healthy-looking 0)
        "norm": torch.where(has | (numel == 0), torch.sqrt(torch.clamp(table[:, SUMSQ], min=0.0)), nan),
        "mean": torch.where(has, table[:, SUM] / torch.where(has, finite, 1.0), nan),
        "min": torch.where(has, table[:, MIN], nan),
        "max": torch.where(has, table[:, MAX], nan),
        "zeros": torch.where(numel > 0, table[:, ZEROS] / torch.clamp(numel, min=1.0), nan),
    }
    return torch.stack([columns[s] for s in stats], dim=1)


class CrossRank:
    """Built once per monitor; `reduce` is collective over every rank of the job (call it on every
    rank at the same scheduled steps: they are a function of the config, the same everywhere)."""

    def __init__(self, rank: int, world_size: int, faults: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.faults = faults
        self.broken = False  # a reduction failed (a rank died): no summaries for the rest of the run
        self.keys: tuple[Key, ...] = ()
        self.slots: dict[Key, int] = {}
        self.agreements = 0  # how often the ranks agreed a new layout (tests, docs)
        self.merged_by = ""  # the last step's collective: "all_gather" or "all_reduce" (tests, docs)
        self.cpu_group: Any = None

    def attach(self) -> None:
        """Collective at set_monitor: the CPU group of the layout check."""
        import torch.distributed as dist

        if self.world_size > 1:
            self.cpu_group = dist.new_group(backend="gloo")

    def tail(self, scheduled: bool, config: Any) -> Any:
        """`StepCollector.finish`'s tail for this step: the summaries on scheduled steps (the same on
        every rank, unlike escalation-only steps), with `xrank_summary` on and more than one rank."""
        if self.broken or not (scheduled and config.xrank_summary and self.cpu_group is not None):
            return None
        stats = tuple(s for s in FLOAT_STATS if s in config.ops) or ("norm",)
        return lambda rows, parts, add: self._reduce_or_stop(rows, parts, stats, add)

    def _reduce_or_stop(
        self, rows: Sequence[RowMeta], parts: Sequence[torch.Tensor], stats: Any, add: Any
    ) -> tuple:
        """`reduce`; should it fail (a rank died, the group is gone), the summaries stop for the rest of the
        run and the step goes on without them: each rank's own rows are still written."""
        try:
            return self.reduce(rows, parts, stats, add)
        except Exception as exc:  # noqa: BLE001 - never into the training loop, never the step's rows
            if self.faults is None:
                raise
            self.broken = True
            self.faults.record(
                "cross-rank summaries", exc, "switched off for the rest of the run; rows go on"
            )
            return None, None, None

    def reduce(
        self,
        rows: Sequence[RowMeta],
        parts: Sequence[torch.Tensor],
        stats: Sequence[str],
        add: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, XRankLayout | None, torch.Tensor | None]:
        """The packed summaries of this step's local rows (`rows`, partials `parts` in the same order):
        rows to append to the step's transfer and the layout to decode them, on rank 0 (None, None
        elsewhere), and `add` (a float64 scalar, e.g. the job's gradient sum of squares) summed over
        every rank, or None if not given. Collective: one all-gather on the default group (the scalar
        rides in it as one more row), or two all-reduces there on a large job
        (`stats.partials.GATHER_BYTES`), and one 8-byte all-reduce on the CPU group."""
        import torch.distributed as dist

        stats = tuple(stats)
        mine = [i for i, r in enumerate(rows) if r.family in XRANK_FAMILIES]
        local_keys = _keys([rows[i] for i in mine])
        outside = torch.tensor([int(any(k not in self.slots for k in local_keys))], dtype=torch.int64)
        dist.all_reduce(outside, op=dist.ReduceOp.MAX, group=self.cpu_group)
        if int(outside[0]):
            self._agree(local_keys)
        device = parts[0].device if parts else _default_device()
        n, s = len(self.keys), len(stats)
        spare = 0 if add is None else 1  # the scalar's row, after the n rows of the summaries
        bits = _bits(self.world_size)
        tag = self.world_size - 1 - self.rank
        keys = torch.full((n + spare, 2 * s + 1), _ABSENT, dtype=torch.int64, device=device)
        sums = torch.zeros((n + spare, 2 * s + 3), dtype=torch.float64, device=device)
        if add is not None:
            sums[n, 0] = on_device(add, device)
        if mine:
            table = torch.cat([on_device(p, device) for p in parts])[to_device(mine, device)]
            numel = to_device([float(rows[i].numel) for i in mine], device, torch.float64)
            values = _statistics(table, numel, stats)
            slot = to_device([self.slots[k] for k in local_keys], device)
            present = ~torch.isnan(values)
            # a row without elements (a None output's placeholder, an empty tensor) holds no non-finite value
            bad = (table[:, NANS] + table[:, INFS] > 0) | (~torch.isfinite(values).all(dim=1) & (numel > 0))
            packed = torch.cat(
                [
                    _to_key(values, torch.full((), tag, device=device), bits),
                    _to_key(-values, torch.full((), tag, device=device), bits),
                    torch.where(bad, tag, -1).unsqueeze(1).to(torch.int64),
                ],
                dim=1,
            )
            keys[slot] = packed
            sums[slot] = torch.cat(
                [
                    torch.where(present, values, 0.0),
                    present.to(torch.float64),
                    table[:, NANS : INFS + 1],
                    torch.ones((len(mine), 1), dtype=torch.float64, device=device),
                ],
                dim=1,
            )
        if n + spare == 0:
            return None, None, None
        keys, sums = self._merge(keys, sums)
        summed = None if add is None else sums[n, 0]
        if n == 0 or self.rank != 0:
            return None, None, summed
        keys, sums = keys[:n], sums[:n]
        layout = XRankLayout(self.keys, stats, self.world_size)
        flat = torch.cat([keys.view(torch.float64).flatten(), sums.flatten()])
        pad = layout.tail_rows * NUM_PARTIALS - flat.numel()
        flat = torch.cat([flat, torch.zeros(pad, dtype=torch.float64, device=device)])
        return flat.view(-1, NUM_PARTIALS), layout, summed

    def _merge(self, keys: torch.Tensor, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's keys (max over ranks) and sums (added): one all-gather while the world's tables
        fit in `stats.partials.GATHER_BYTES`, else two all-reduces (sums added in the backend's order
        rather than rank order: a mean may differ from the gather's in its last bits)."""
        import torch.distributed as dist

        received = self.world_size * (keys.numel() + sums.numel()) * 8
        if received <= stats_partials.GATHER_BYTES:
            self.merged_by = "all_gather"
            return _gather_merge(keys, sums)
        self.merged_by = "all_reduce"
        dist.all_reduce(keys, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums)
        return keys, sums

    def _agree(self, local_keys: list[Key]) -> None:
        """The union of every rank's keys (and the agreed ones) on the CPU group: each distinct key list
        travels once (`key_union`), data-parallel ranks holding the same ones."""
        self.keys = union_of_keys(self.keys, local_keys, self.rank, self.world_size, self.cpu_group)
        self.slots = {k: i for i, k in enumerate(self.keys)}
        self.agreements += 1


def _gather_merge(keys: torch.Tensor, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's keys (int64, max over ranks) and sums (float64, added in rank order) in one
    collective: the keys travel bit for bit as float64 next to the sums (no arithmetic touches them in
    transit), so the step costs one all-gather on the default group instead of two all-reduces."""
    import torch.distributed as dist

    width = keys.shape[1]
    packed = torch.cat([keys.view(torch.float64), sums], dim=1).contiguous()
    world = dist.get_world_size()
    gathered = torch.empty(
        (world * packed.shape[0], packed.shape[1]), dtype=packed.dtype, device=packed.device
    )
    stats_partials.gather_into(gathered, packed)  # ranks stacked along dim 0 (gloo's form)
    gathered = gathered.view(world, *packed.shape)
    merged_keys = gathered[:, :, :width].contiguous().view(torch.int64).amax(0)
    merged_sums = gathered[0, :, width:].clone()
    for r in range(1, gathered.shape[0]):
        merged_sums += gathered[r, :, width:]
    return merged_keys, merged_sums


def decode(layout: XRankLayout, tail: np.ndarray) -> XRankTable:
    """Worker side: a step's `XRankTable` from the host rows `reduce` appended to the transfer."""
    n, s, world = len(layout.keys), len(layout.stats), layout.world_size
    flat = np.ascontiguousarray(tail, dtype=np.float64).reshape(-1)
    keys = flat[: n * (2 * s + 1)].view(np.int64).reshape(n, 2 * s + 1)
    sums = flat[n * (2 * s + 1) : n * _width(s)].reshape(n, 2 * s + 3)
    vmax, rmax = _from_key(keys[:, :s], world)
    vmin_neg, rmin = _from_key(keys[:, s : 2 * s], world)
    tag = keys[:, 2 * s]
    first_bad = np.where(tag < 0, -1, world - 1 - tag)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(sums[:, s : 2 * s] > 0, sums[:, :s] / sums[:, s : 2 * s], np.nan)
    columns = {
        "max": vmax,
        "min": -vmin_neg,
        "mean": mean,
        "max_rank": rmax,
        "min_rank": rmin,
        "nans": np.repeat(sums[:, 2 * s : 2 * s + 1], s, axis=1),
        "infs": np.repeat(sums[:, 2 * s + 1 : 2 * s + 2], s, axis=1),
        "nonfinite_rank": np.repeat(first_bad[:, None], s, axis=1),
        "ranks": np.repeat(sums[:, 2 * s + 2 : 2 * s + 3], s, axis=1),
    }
    present = sums[:, 2 * s + 2] > 0  # keys of the agreed layout that no rank held this step
    index = [(i, j) for i in np.flatnonzero(present) for j in range(s)]
    rows = tuple((*layout.keys[i][:4], layout.stats[j]) for i, j in index)
    ii = np.array([i for i, _ in index], dtype=np.int64)
    jj = np.array([j for _, j in index], dtype=np.int64)
    values = {c: v[ii, jj] for c, v in columns.items()}
    for c in ("max_rank", "min_rank", "nonfinite_rank", "ranks", "nans", "infs"):
        values[c] = values[c].astype(np.int64)
    return XRankTable(rows, values)


def _key(row: RowMeta) -> Key:
    return (row.family, row.vpp_stage, row.name, row.micro_step)


def _keys(rows: Sequence[RowMeta]) -> list[Key]:
    """The rows' keys; a rank's second row under one name (two modules squashed to one name) gets the
    occurrence as a fifth element: a slot of its own, not the first row's slot overwritten."""
    seen: dict[Key, int] = {}
    out = []
    for row in rows:
        key = _key(row)
        n = seen.get(key, 0)
        seen[key] = n + 1
        out.append(key if n == 0 else (*key, n))
    return out


def _default_device() -> torch.device:
    """Where a rank with no rows builds its table: the device the default group's collectives run on."""
    from .sharded import group_device

    return group_device()
