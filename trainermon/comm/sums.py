"""The per-step sums of a `CommRecorder` (`recorder`): one summed statistics row per (op, group, call
site, input/output, micro-step), their in-place merge, and the micro-step of a receive that is known only
when the next pass starts (`PendingMicro`, settled when the step's rows are taken)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainermon.stats.partials import ADDITIVE, MAX, MIN


@dataclass
class Sum:
    """One key's statistics over the step's calls (merged in place as calls complete)."""

    row: torch.Tensor  # [1, NUM_PARTIALS]
    calls: int
    numel: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class PendingMicro:
    """The micro-step of a receive made between passes, set when the next pass starts (a pipeline stage
    receives a micro-batch's input or gradient before the pass that uses it); `value` until then: the
    micro-step of the pass that ran last. Hashed by identity: a key of the sums until `take`."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value


def settle_micro(sums: dict[tuple, Sum]) -> dict[tuple, Sum]:
    """The sums with every pending micro-step replaced by its value, sums of one key merged."""
    out: dict[tuple, Sum] = {}
    for key, s in sums.items():
        if type(key[4]) is PendingMicro:
            key = (*key[:4], key[4].value)
        old = out.get(key)
        if old is None:
            out[key] = s
            continue
        merge_into(old.row, s.row)
        old.calls += s.calls
        old.numel += s.numel
        old.nbytes += s.nbytes
    return out


def merge_into(row: torch.Tensor, other: torch.Tensor) -> None:
    """Partials of another piece merged into `row` in place (few kernels: it runs per call)."""
    other = other.to(row.device)
    row[:, ADDITIVE] += other[:, ADDITIVE]
    torch.minimum(row[:, MIN], other[:, MIN], out=row[:, MIN])
    torch.maximum(row[:, MAX], other[:, MAX], out=row[:, MAX])
