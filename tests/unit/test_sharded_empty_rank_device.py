"""Where a rank holding no element of a sharded row (an FSDP rank without a LoRA adapter's shard) builds
its partials, which must be where the other ranks merge: an adapter's empty piece carries its parameter's
device; with no tensor at all, the group's device: CPU for a group with a CPU backend (gloo, and
`cpu:gloo,cuda:nccl`, which CPU offload uses), the accelerator for NCCL/HCCL. Real gloo groups in a child
process; the backend strings of NCCL/HCCL groups (which cannot be made here) are given to the function."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tests.distributed import free_port
from trainermon.collect.placement import Sharded, TensorPiece
from trainermon.collect.sharded import accelerator_of, device_hint, group_device

CHILD = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from trainermon.collect.placement import Sharded, TensorPiece
    from trainermon.collect.sharded import device_hint, group_device

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group(sys.argv[1], rank=0, world_size=1)
    group = dist.new_group([0])
    empty = [(0, "grad_reduced", None, TensorPiece(None, Sharded(group), (4, 4), torch.float32))]
    print(device_hint(empty, group).type, group_device().type)  # no tensor made: no CUDA here
    dist.destroy_process_group()
    """
)


def _devices(backend: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, backend, str(free_port())], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_a_gloo_group_stays_on_cpu():
    assert _devices("gloo") == ["cpu", "cpu"]  # a sharded row, the default group
    assert _devices("cpu:gloo,cuda:gloo") == ["cpu", "cpu"]  # gloo serves CUDA too: CPU tensors stay


@pytest.mark.parametrize(
    "backend, types, want",
    [
        ("cpu:gloo,cuda:nccl", ["cuda", "cpu"], None),  # CPU offload's group: the tensors are on CPU
        ("cuda:nccl,cpu:gloo", ["cuda", "cpu"], None),
        ("undefined", ["cuda", "cpu"], None),  # init_process_group() without a backend
        ("nccl", ["cuda"], "cuda"),
        ("hccl", ["npu"], "npu"),
        ("cuda:nccl", ["cuda"], "cuda"),
        ("gloo", ["cpu", "cuda"], None),
        ("cpu:gloo,cuda:gloo", ["cuda", "cpu"], None),
    ],
)
def test_the_accelerator_a_groups_backend_needs(backend, types, want):
    # No GPU here: the backend string a NCCL group reports is given, since it cannot be created.
    assert accelerator_of(backend, types) == want


def test_a_piece_keeps_its_own_device_and_no_group_means_cpu():
    piece = TensorPiece(torch.ones(2), Sharded(None), (4,), torch.float32)
    assert device_hint([(0, "grad_reduced", None, piece)], None) == torch.device("cpu")
    # an adapter's empty piece says where its parameter lives (the meta device stands for CUDA here)
    empty = TensorPiece(torch.empty(0, device="meta"), Sharded(None), (4,), torch.float32)
    assert device_hint([(0, "exp_avg", None, empty)], None) == torch.device("meta")
    assert group_device(None) == torch.device("cpu")  # no process group in this test process
