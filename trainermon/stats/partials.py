"""Partial statistics: the float64 rows the engine computes, how pieces of one tensor merge, and how a row
becomes the statistics users see.

A row has one column per partial; every statistic is a (local partial, combiner) pair, so that pieces of
one tensor (micro-batches, ZeRO or FSDP shards, a distributed optimizer's slices, a tensor-parallel shard)
merge exactly:

    partial   combiner   used for
    sumsq     sum        norm = sqrt(sumsq)
    sum       sum        mean = sum / finite count
    min       min        min
    max       max        max
    nans      sum        nans, and the finite count
    infs      sum        infs, and the finite count
    zeros     sum        zeros = fraction with |x| < eps
    numel     sum        kept on the host (shapes are static), never computed on the device

Rows are float64 on every device: a float32 row would lose the accuracy the engine guarantees as soon
as rows of many pieces are added, and could not hold the norm of a tensor of large float32 values.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import numpy as np
import torch


class Merge(Enum):
    SUM = "sum"
    MIN = "min"
    MAX = "max"


#: The partial columns, in row order, with the combiner that merges pieces of one tensor.
PARTIALS = (
    ("sumsq", Merge.SUM),
    ("sum", Merge.SUM),
    ("min", Merge.MIN),
    ("max", Merge.MAX),
    ("nans", Merge.SUM),
    ("infs", Merge.SUM),
    ("zeros", Merge.SUM),
)
PARTIAL_NAMES = tuple(name for name, _ in PARTIALS)
SUMSQ, SUM, MIN, MAX, NANS, INFS, ZEROS = (PARTIAL_NAMES.index(n) for n in PARTIAL_NAMES)
NUM_PARTIALS = len(PARTIALS)
ADDITIVE = [i for i, (_, merge) in enumerate(PARTIALS) if merge is Merge.SUM]
DTYPE = torch.float64
#: The largest all-gather (bytes received per rank: world x table) a merge across ranks makes; larger
#: tables (thousands of ranks) take all-reduces instead, which receive about twice the table at any world
#: size. The same on every rank: the table's shape is.
GATHER_BYTES = 4 << 20


def empty_partials(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Identity element of the merge: n rows for tensors (or shards) with no elements."""
    out = torch.zeros((n, NUM_PARTIALS), dtype=DTYPE, device=device)
    out[:, MIN] = math.inf
    out[:, MAX] = -math.inf
    return out


def merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Combine partials of two disjoint pieces (row by row)."""
    out = a.clone()
    out[:, ADDITIVE] += b[:, ADDITIVE]
    out[:, MIN] = torch.minimum(a[:, MIN], b[:, MIN])
    out[:, MAX] = torch.maximum(a[:, MAX], b[:, MAX])
    return out


def scale_and_pad(row: torch.Tensor, multiplicity: int, implicit_zeros: int, count_zeros: bool) -> None:
    """In place, for one row: each element counted `multiplicity` times (broadcast dimensions), then
    `implicit_zeros` zeros added (the elements a sparse tensor does not store)."""
    if multiplicity != 1:
        row[ADDITIVE] *= multiplicity
    if implicit_zeros:
        row[MIN] = torch.clamp(row[MIN], max=0.0)
        row[MAX] = torch.clamp(row[MAX], min=0.0)
        if count_zeros:
            row[ZEROS] += implicit_zeros


#: The all-gather into one tensor: torch 2.13 names it `all_gather_single` and warns on the old name,
#: which 2.11 has alone.
GATHER_OP = (
    "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
)


def gather_into(out: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> None:
    """All-gather `tensor` from every rank of `group` into `out` (ranks stacked along dim 0): one
    collective."""
    import torch.distributed as dist

    getattr(dist, GATHER_OP)(out, tensor, group=group)  # looked up per call: cc_distribution patches it


def reduce_across(partials: torch.Tensor, group: Any = None, flags: torch.Tensor | None = None):
    """Merge each row's partials across the ranks of `group`: one collective (an all-gather of the packed
    rows and flags), whatever the number of rows; each rank then merges the gathered rows itself (sums
    in rank order, min/max, flags OR-ed). Payload per rank: world x rows x (NUM_PARTIALS + 1) x 8 bytes
    received, against two all-reduces of rows x NUM_PARTIALS before (bytes traded for one round trip:
    the merged rows are a few hundred per step). Where that exceeds `GATHER_BYTES` (a group of thousands
    of ranks), two all-reduces instead (`_reduce_merge`).

    Every rank must pass the same rows in the same order; a rank that holds no piece of a tensor passes
    `empty_partials` for its row. `flags` (one float per row, 0 or 1) travel in the same collective and
    come back OR-ed over the ranks: a rank flags a row it could not compute, so that no rank writes it.
    A NaN min/max (NaN counting off) survives the merge (torch's min/max propagate it). Returns the merged
    rows, and the merged flags when `flags` was given.
    """
    import torch.distributed as dist

    n = partials.shape[0]
    column = torch.zeros((n, 1), dtype=partials.dtype, device=partials.device)
    if flags is not None:
        column = flags.to(partials.dtype).reshape(n, 1)
    packed = torch.cat([partials, column], dim=1).contiguous()
    world = dist.get_world_size(group)
    if world * packed.numel() * packed.element_size() > GATHER_BYTES:
        out, bad = _reduce_merge(partials, column, group)
        return out if flags is None else (out, bad)
    gathered = torch.empty((world * n, packed.shape[1]), dtype=packed.dtype, device=packed.device)
    gather_into(gathered, packed, group)  # ranks stacked along dim 0 (gloo's form)
    gathered = gathered.view(world, n, packed.shape[1])
    out = gathered[0, :, :NUM_PARTIALS].clone()
    for r in range(1, world):  # rank order: every rank adds the same terms in the same order
        out[:, ADDITIVE] += gathered[r, :, ADDITIVE]
    out[:, MIN] = gathered[:, :, MIN].amin(0)
    out[:, MAX] = gathered[:, :, MAX].amax(0)
    if flags is None:
        return out
    return out, gathered[:, :, NUM_PARTIALS].amax(0) > 0


def _reduce_merge(partials: torch.Tensor, flags: torch.Tensor, group: Any) -> tuple[torch.Tensor, Any]:
    """`reduce_across` by two all-reduces: a sum of the additive columns, a max of [max, -min, flag,
    NaN max, NaN min]. A NaN min or max travels as a column of its own (a backend's max may drop a
    NaN, where the gather's `amin`/`amax` keep it) and is put back after."""
    import torch.distributed as dist

    sums = partials[:, ADDITIVE].contiguous()
    top, low = partials[:, MAX], -partials[:, MIN]
    extremes = torch.stack(
        [
            torch.where(torch.isnan(top), -math.inf, top),  # (nan_to_num would clip the infinities)
            torch.where(torch.isnan(low), -math.inf, low),
            flags[:, 0],
            torch.isnan(top).to(partials.dtype),
            torch.isnan(low).to(partials.dtype),
        ],
        dim=1,
    )
    dist.all_reduce(sums, group=group)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    out = torch.empty_like(partials)
    out[:, ADDITIVE] = sums
    out[:, MAX] = torch.where(extremes[:, 3] > 0, math.nan, extremes[:, 0])
    out[:, MIN] = torch.where(extremes[:, 4] > 0, math.nan, -extremes[:, 1])
    return out, extremes[:, 2] > 0


def grad_sumsq(rows: Any) -> Any:
    """The sum of squares behind a global gradient norm, as `clip_grad_norm_` forms it: NaN when any
    element is NaN, else inf when any is inf. With `nans`/`infs` counted, a row's `sumsq` leaves out what
    is counted (NaN, and Inf with `infs`), so the counts put those back. numpy rows or torch rows (on the
    device, no sync); a row marked dropped (NaN count) adds nothing."""
    if isinstance(rows, np.ndarray):
        with np.errstate(invalid="ignore"):
            nans, infs = rows[:, NANS] > 0, rows[:, INFS] > 0
        return rows[:, SUMSQ].sum() + (math.nan if nans.any() else 0.0) + (math.inf if infs.any() else 0.0)
    bad = torch.where(rows[:, NANS] > 0, math.nan, 0.0) + torch.where(rows[:, INFS] > 0, math.inf, 0.0)
    return rows[:, SUMSQ].sum() + bad.sum()


def finalize(partials: np.ndarray, numel: np.ndarray) -> dict[str, np.ndarray]:
    """Turn host partials [N, NUM_PARTIALS] and element counts [N] into the user-facing statistics.

    With `nans`/`infs` counted, norm/mean/min/max are of the elements not counted (the finite ones; with
    `nans` alone the non-NaN ones, whose infinities are values and whose `infs` column is 0, so the same
    division by `numel - nans - infs` serves both), and NaN where a non-empty tensor has none (decided
    here, from the merged counts, so every engine and every shard merge agrees):
    its partials are the merge's identities, and a norm of 0 would read as a healthy zero gradient. An empty
    tensor keeps norm 0. A few numpy passes over N rows, on the worker."""
    p = partials.astype(np.float64, copy=False)
    numel = numel.astype(np.float64, copy=False)
    finite = numel - p[:, NANS] - p[:, INFS]
    with np.errstate(divide="ignore", invalid="ignore"):
        has = finite > 0
        norm = np.sqrt(np.maximum(p[:, SUMSQ], 0.0))
        return {
            "norm": np.where(has | (numel == 0), norm, np.nan),
            "mean": np.where(has, p[:, SUM] / np.where(has, finite, 1.0), np.nan),
            "min": np.where(has, p[:, MIN], np.nan),
            "max": np.where(has, p[:, MAX], np.nan),
            "zeros": np.where(numel > 0, p[:, ZEROS] / np.where(numel > 0, numel, 1.0), np.nan),
            "nans": p[:, NANS],
            "infs": p[:, INFS],
            "numel": numel,
        }
