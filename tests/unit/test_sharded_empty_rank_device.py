"""A rank holding no element of any sharded row (an FSDP rank without a LoRA adapter's shard) builds its
partials on the device its group's backend needs, not on the CPU: NCCL cannot all-gather a CPU tensor.
No GPU here: the backend's answer (`_get_pg_default_device`) is replaced by a stand-in that returns the
`meta` device and records the group it was asked about; the real gloo answer (CPU) is checked too."""

from __future__ import annotations

import torch
import torch.distributed.distributed_c10d as c10d

from trainermon.collect.placement import Sharded, TensorPiece
from trainermon.collect.sharded import ShardedRows, device_hint, group_device, local_grad_sumsq


def _empty(group: object) -> list:
    return [(0, "grad_reduced", None, TensorPiece(None, Sharded(group), (4, 4), torch.float32))]


def test_an_empty_rank_asks_its_groups_backend(monkeypatch):
    asked = []

    def stand_in(group=None):  # what NCCL would answer: its CUDA device
        asked.append(group)
        return torch.device("meta")

    monkeypatch.setattr(c10d, "_get_pg_default_device", stand_in)
    group = object()
    assert device_hint(_empty(group), group) == torch.device("meta")
    assert asked == [group]
    total = local_grad_sumsq([], [], ShardedRows())  # no rows at all: the default group's device
    assert total.device == torch.device("meta") and asked[-1] is None


def test_a_piece_keeps_its_own_device_and_no_group_means_cpu():
    piece = TensorPiece(torch.ones(2), Sharded(None), (4,), torch.float32)
    assert device_hint([(0, "grad_reduced", None, piece)], None) == torch.device("cpu")
    assert group_device(None) == torch.device("cpu")  # no process group in this test process
