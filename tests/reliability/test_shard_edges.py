"""Reliability under faults (issue 11), edges of sharding on 2 gloo ranks: zero-size and non-finite shards
merge exactly, and the dynamic control channel is rank 0's file sent over the job's group, never pickled.

Statistics are checked against the test's own float64 references, never computed through the monitor's
code. docs/RELIABILITY.md lists every test, its measured result, and the defects these tests found.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from tests.distributed import run_ranks
from tests.reliability.faults import EPS, FULL_OPS, PLAIN_OPS, _listening, check_row, ref


def _shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """FSDP-style flat sharding: ceil(n / world) elements per rank, so the last ranks may hold none."""
    per = -(-full.numel() // world)
    return full.reshape(-1)[per * rank : per * (rank + 1)]


def _shard_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    split_bad = torch.randn(10, generator=g)
    split_bad[1], split_bad[7], split_bad[8] = float("nan"), float("inf"), float("-inf")  # one on each rank
    all_bad_on_rank0 = torch.randn(6, generator=g)
    all_bad_on_rank0[:3] = float("nan")
    return {
        "one_element": torch.tensor([0.75]),  # rank 1 holds no elements
        "no_elements": torch.empty(0),  # nobody holds any
        "split_nonfinite": split_bad,
        "all_nan_on_rank0": all_bad_on_rank0,
        "bf16_odd": torch.randn(7, generator=g).to(torch.bfloat16),
        "zeros_and_values": torch.tensor([0.0, 0.0, 1e-9, 3.0, -2.0]),
    }


def _two_rank_edges(rank: int, world: int, root: str) -> dict:
    import pickle

    import numpy as np
    import torch.distributed as dist

    from trainermon.collect.collector import StepCollector, TransferCounter
    from trainermon.collect.placement import Sharded, TensorPiece
    from trainermon.collect.records import StepScalars
    from trainermon.config import parse_config
    from trainermon.runtime.control import DynamicControl, update_config_file
    from trainermon.stats import EngineOptions, StatsEngine, finalize

    out: dict = {"stats": {}}
    for mode, options in {
        "counting": EngineOptions(nonfinite=True, zeros_eps=EPS),
        "accelerator-path": EngineOptions(nonfinite=True, zeros_eps=EPS, force_masked=True),
        "propagating": EngineOptions(nonfinite=False, zeros_eps=EPS),
    }.items():
        collector = StepCollector(StatsEngine(options), TransferCounter())
        entries = []
        for name, full in _shard_cases().items():
            local = _shard(full, rank, world)
            # The adapters' two ways of saying "no elements here": tensor=None and a zero-size tensor.
            for variant, tensor in (("none", None if local.numel() == 0 else local), ("empty", local)):
                piece = TensorPiece(tensor, Sharded(None), tuple(full.shape), full.dtype)
                entries.append((0, f"{name}/{variant}", None, piece))
        collector.add("param_origin", entries)
        payload = collector.finish(0, StepScalars())
        numel = np.array([r.numel for r in payload.rows], dtype=np.float64)
        values = finalize(payload.partials.numpy(), numel)
        out["stats"][mode] = {
            r.name: {k: float(v[i]) for k, v in values.items()} for i, r in enumerate(payload.rows)
        }
        out["stats"][mode]["_held"] = {n: _shard(f, rank, world).numel() for n, f in _shard_cases().items()}

    # Control: rank 0 alone reads its file; rank 1's own copy is garbage and is never read. The config
    # travels as JSON over a gloo group of the same ranks, never pickled.
    path = os.path.join(root, f"cfg{rank}.json")
    with open(path, "w") as fh:
        fh.write('{"dynamic_on": false}' if rank == 0 else "{ not json, never read")
    listening_before = _listening()
    control = DynamicControl(path, parse_config({"dynamic_on": False}))
    control.attach(None)
    listening_attached = _listening()

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used by the control channel")

    saved = pickle.loads, dist.broadcast_object_list
    pickle.loads, dist.broadcast_object_list = refuse, refuse
    try:
        if rank == 0:
            update_config_file(path, dynamic_on=True, collect_times=7)
            deadline = time.monotonic() + 10
            while not control.watcher.dirty and time.monotonic() < deadline:
                time.sleep(0.01)
        dist.barrier()
        applied = [control.poll() for _ in range(3)]
    finally:
        pickle.loads, dist.broadcast_object_list = saved
    out["control"] = {
        "watcher": control.watcher is not None,
        "group_ranks": dist.get_process_group_ranks(control._group),
        "world_ranks": dist.get_process_group_ranks(dist.group.WORLD),
        "applied": [None if c is None else (c.dynamic_on, c.collect_times) for c in applied],
        "new_listening": sorted(set(listening_attached) - set(listening_before)),
        "after_polls": sorted(set(_listening()) - set(listening_attached)),
    }
    control.close()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_two_rank_edges, world_size=2, timeout=180, root=str(tmp_path_factory.mktemp("edges")))


#: A NaN in some shards only: with NaN counting off, the merged min/max should be NaN (as for a local
#: tensor), but the cross-rank MAX all-reduce drops it (see test_sharded_nan_reaches_min_max).
NAN_IN_ONE_SHARD = ("all_nan_on_rank0",)


@pytest.mark.parametrize("mode", ["counting", "accelerator-path", "propagating"])
def test_zero_size_and_nonfinite_shards_merge_exactly(two_ranks, mode):
    r0, r1 = two_ranks[0]["stats"][mode], two_ranks[1]["stats"][mode]
    assert r1 == {"_held": r1["_held"]}  # sharded rows are written once, by the group's first rank
    assert r1["_held"]["one_element"] == 0 and r1["_held"]["split_nonfinite"] == 5  # the edge is real
    ops = FULL_OPS if mode != "propagating" else PLAIN_OPS
    for name, full in _shard_cases().items():
        want = ref(full, nonfinite=mode != "propagating")
        checked = tuple(op for op in ops if not (mode == "propagating" and name in NAN_IN_ONE_SHARD))
        checked = checked or ("norm", "mean", "zeros", "numel")
        for variant in ("none", "empty"):
            got = {op: str(v) for op, v in r0[f"{name}/{variant}"].items()}
            check_row(got, want, checked, f"{mode} {name}/{variant}")


def test_sharded_nan_reaches_min_max(two_ranks):
    got = two_ranks[0]["stats"]["propagating"]["all_nan_on_rank0/none"]
    assert math.isnan(got["norm"])  # the NaN does show in norm ...
    assert math.isnan(got["min"]) and math.isnan(got["max"])  # ... and, like a local tensor, in min/max


def test_control_channel_is_rank0_file_over_the_job_group(two_ranks):
    c0, c1 = two_ranks[0]["control"], two_ranks[1]["control"]
    assert c0["watcher"] and not c1["watcher"]  # only rank 0 watches (and reads) a file
    assert c0["group_ranks"] == c1["group_ranks"] == c0["world_ranks"] == [0, 1]
    # Both ranks applied rank 0's file at the same poll; rank 1's unreadable copy played no part.
    assert c0["applied"] == c1["applied"] == [(True, 7), None, None]
    for c in (c0, c1):
        # The gloo group's own pair listener (loopback, as MASTER_ADDR), and nothing new after polling.
        assert len(c["new_listening"]) <= 1 and all(ip == "127.0.0.1" for ip, _ in c["new_listening"])
        assert c["after_polls"] == []
