"""The step's sharded rows (pieces of one tensor on several ranks) and their merge across ranks at the
step's end: one packed reduction per process group (see `StepCollector.finish`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainermon.stats import NANS, SUMSQ, empty_partials, grad_sumsq, reduce_across

from .odd import complex_rows
from .placement import TensorPiece
from .records import RowMeta
from .transfer import on_device, to_device


@dataclass
class ShardedRows:
    """The step's rows that are merged across ranks at `finish`, in the order they were added (the same
    on every rank of a group, since every rank adds its piece of each sharded tensor)."""

    rows: list[RowMeta] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # each row's position among all of the step's rows
    over: list[tuple[int, ...]] = field(default_factory=list)  # ids of the groups each row merges over
    writes: list[bool] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)
    flags: list[float] = field(default_factory=list)  # 1: a rank could not compute its piece of the row
    groups: dict[int, Any] = field(default_factory=dict)  # id -> group, every group named by a row

    def append(self, meta: RowMeta, seq: int, over: tuple[Any, ...], writes: bool, device: Any) -> int:
        """A row merged over the groups `over`, its partials the merge's identity until `compute` fills
        this rank's piece in; returns its index."""
        self.rows.append(meta)
        self.order.append(seq)
        self.over.append(tuple(id(g) for g in over))
        for g in over:
            self.groups.setdefault(id(g), g)
        self.writes.append(writes)
        self.parts.append(empty_partials(1, device))
        self.flags.append(0.0)
        return len(self.parts) - 1

    def compute(
        self, engine: Any, pending: list[tuple[int, torch.Tensor]], told: set[str] | None = None
    ) -> list[Any]:
        """This rank's pieces of rows (index, tensor), in one engine call; (row, why) of each unreadable one.
        A piece not computed (unreadable, or the call failed and raises) flags its row: no rank writes a
        row that one rank could not compute, rather than merge the others' pieces as if whole. `told`
        (gradient families only): a complex piece gets the partials of its moduli |z| (`complex_rows`),
        which merge exactly across ranks into the whole gradient's |z| row; cost: one real copy and one
        engine call per complex piece, on collected steps that have one."""
        tensors = [t for _, t in pending]
        try:
            computed, skipped = engine.compute_rows(tensors)
            if skipped and told is not None:  # rare: only steps with a refused piece pay for this
                rows = [(self.rows[index], index) for index, _ in pending]
                complex_rows(engine, computed, skipped, rows, tensors, told)
        except BaseException:
            for index, _ in pending:
                self.flags[index] = 1.0
            raise
        for row, (index, _) in enumerate(pending):
            self.parts[index] = computed[row : row + 1]
            if row in skipped:
                self.flags[index] = 1.0
        return [(self.rows[pending[row][0]], why) for row, why in skipped.items()]


def merge_sharded(sharded: ShardedRows) -> tuple[list[RowMeta], torch.Tensor | None, list[int]]:
    """Merge the sharded rows over each of their groups; return this rank's rows to write, their
    partials and their positions among the step's rows."""
    if not sharded.rows:
        return [], None, []
    local = torch.cat(sharded.parts)
    flags = to_device(sharded.flags, local.device, local.dtype)
    # One dimension at a time, groups in first-appearance order. Ranks that meet in a group must have
    # merged the same dimensions before, else pieces are lost or counted twice; the order is the
    # same on every rank because every rank adds the same sharded rows in the same order and
    # placements list their groups by mesh dimension. (Ordering groups by their global ranks
    # fails: on a 2 x 2 mesh rank 2 would merge dp first while rank 3 merges tp first.)
    for gid in sharded.groups:
        members = [i for i, over in enumerate(sharded.over) if gid in over]
        if len(members) == len(sharded.rows):
            local, bad = reduce_across(local, sharded.groups[gid], flags)
            flags = bad.to(local.dtype)
        else:
            index = to_device(members, local.device)
            part, bad = reduce_across(local[index], sharded.groups[gid], flags[index])
            local[index] = part
            flags[index] = bad.to(local.dtype)
    if all(sharded.writes):
        out, rows, order = local, sharded.rows, sharded.order
    elif not any(sharded.writes):
        return [], None, []
    else:
        keep = [i for i, w in enumerate(sharded.writes) if w]
        index = to_device(keep, local.device)
        out, flags, rows = local[index], flags[index], [sharded.rows[i] for i in keep]
        order = [sharded.order[i] for i in keep]
    # A row that some rank could not compute is marked (a NaN count, which no data can give) and
    # dropped by the worker: deciding here would read the flags back, a device sync.
    out[:, NANS] = torch.where(flags > 0, math.nan, out[:, NANS])
    return rows, out, order


def local_grad_sumsq(rows: list[RowMeta], parts: list[torch.Tensor], sharded: ShardedRows) -> torch.Tensor:
    """This rank's share of the job-wide gradient sum of squares, before any merge: its written local
    `grad_reduced` rows plus its pieces of the sharded ones (a sharded row holds pieces only on the
    ranks that take part, one replica per copy, so the job's sum counts every element once)."""
    device = parts[0].device if parts else (sharded.parts[0].device if sharded.parts else group_device())
    total = torch.zeros((), dtype=torch.float64, device=device)
    for metas, tables in ((rows, parts), (sharded.rows, sharded.parts)):
        mine = [i for i, r in enumerate(metas) if r.family == "grad_reduced"]
        if mine:
            table = torch.cat([on_device(p, device) for p in tables])
            total = total + grad_sumsq(table[to_device(mine, table.device)])
    return total


def job_sumsq_row(local: torch.Tensor, summed: torch.Tensor | None) -> torch.Tensor:
    """One partials row whose SUMSQ is the job-wide gradient sum of squares: `summed` when the step's
    summaries already carried `local` over the default group, else one all-reduce of `local` (8 bytes)."""
    if summed is None:
        import torch.distributed as dist

        summed = local.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    out = empty_partials(1, summed.device)
    out[0, SUMSQ] = summed
    return out


def device_hint(
    entries: Sequence[tuple[int, str, int | None, TensorPiece]], group: Any = None
) -> torch.device:
    """Where this rank builds a sharded row's partials: its piece's device, else (it holds no element,
    e.g. an FSDP rank without a LoRA adapter's shard) the device `group`'s backend needs, so that an
    all-empty rank never hands a CPU tensor to NCCL."""
    for *_, piece in entries:
        if piece.tensor is not None:
            return piece.tensor.device
    return group_device(group)


def group_device(group: Any = None) -> torch.device:
    """The device `group`'s (default: the default group's) collectives run on, for a rank with no tensor
    to tell (adapters give an empty piece on its parameter's device where they can): CPU for a group with
    a CPU backend (gloo, also `cpu:gloo,cuda:nccl`, which CPU offload uses), else its accelerator (NCCL,
    HCCL). Read from the backend string, without torch's deprecated `_get_pg_default_device`; never a
    device this machine lacks."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return torch.device("cpu")
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        kind = accelerator_of(str(dist.get_backend(pg)), [torch.device(t).type for t in pg._device_types])
        module = getattr(torch, kind, None) if kind else None
        if module is not None and module.is_available():
            return torch.device(kind, module.current_device())
    except Exception:  # noqa: BLE001 - no group, or a torch without these calls: CPU (gloo)
        pass
    return torch.device("cpu")


def accelerator_of(backend: str, device_types: list[str]) -> str | None:
    """The accelerator a group's collectives need, from its backend string ("gloo", "nccl",
    "cpu:gloo,cuda:nccl", "undefined") and device types; None where a CPU backend serves."""
    if ":" in backend:
        pairs = [pair.partition(":") for pair in backend.split(",")]
        if any(device.strip() == "cpu" for device, _, _ in pairs):
            return None
        return next((device.strip() for device, _, _ in pairs), None)
    if backend == "gloo" or "cpu" in device_types:
        return None
    return next((t for t in device_types if t != "cpu"), None)


def by_device(rows: list, tensors: list[torch.Tensor]) -> list[tuple[list, list[torch.Tensor]]]:
    first = tensors[0].device
    if all(t.device == first for t in tensors):  # the common case: no regrouping
        return [(rows, tensors)]
    devices: dict[torch.device, tuple[list, list[torch.Tensor]]] = {}
    for row, t in zip(rows, tensors):
        bucket = devices.setdefault(t.device, ([], []))
        bucket[0].append(row)
        bucket[1].append(t)
    return list(devices.values())
