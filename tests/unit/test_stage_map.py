"""`pipelining.stage_map` and the adapters' `agree` on 2 gloo ranks (one launch for the module), where the
job imports torch.distributed.pipelining:

- a job that builds no stage is told nothing above INFO; a stage built for a monitored module after
  set_monitor, where only stage indices could tell the stages apart, is warned about;
- a stage that runs DDP(m) or torch.compile(m) is found for m, and one that runs m for DDP(m);
- a failure on one rank before the comparison (here: the tensor-parallel mesh's coordinate) raises on
  none, and every rank falls back alike: no stage map, plain parameters copies over every rank.

The ranks import pipelining; this test process does not (it changes how other tests' jobs run).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """The trainermon logger's messages at WARNING or above, while the block runs."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("trainermon")
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)


def _worker(rank: int, world: int) -> dict:
    pipelining = importlib.import_module("torch.distributed.pipelining")  # importlib: binds no `torch`
    from adapters import pipelining as ours
    from adapters.base import AdapterContext
    from adapters.torch_ddp import TorchAdapter

    torch.manual_seed(0)
    cpu = torch.device("cpu")
    solo = [dist.new_group([r]) for r in range(world)]  # a one-rank pipeline per rank
    out: dict = {}

    # 1. no stage at set_monitor: quiet; a stage built for the model afterwards: said
    plain = nn.Sequential(nn.Linear(4, 4))  # the same names on both ranks: only stage indices differ
    adapter = TorchAdapter([plain], None, AdapterContext())  # patches PipelineStage (`watch_stages`)
    with _warnings() as said:
        adapter.agree(dist.group.WORLD)
    out["quiet"] = said
    with _warnings() as said:
        late = pipelining.PipelineStage(plain, 0, 1, cpu, group=solo[rank])
    out["late"] = said

    # 2. stages that run a wrapper of the monitored module, or the module of a monitored wrapper
    m1, m2, m3 = (nn.Sequential(nn.Linear(4, 4)) for _ in range(3))
    ddp1, ddp3 = nn.parallel.DistributedDataParallel(m1), nn.parallel.DistributedDataParallel(m3)
    stages = [
        pipelining.PipelineStage(ddp1, 1, 4, cpu, group=solo[rank]),
        pipelining.PipelineStage(torch.compile(m2), 2, 4, cpu, group=solo[rank]),
        pipelining.PipelineStage(m3, 3, 4, cpu, group=solo[rank]),
    ]
    out["indices"] = [ours._stage_indices([m]) for m in (m1, m2, ddp3)]
    del late, stages

    # 3. tensor parallelism, a different stage per rank (other names), a local failure on rank 1
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = nn.Module()
    model.add_module(f"layer{rank}", parallelize_module(nn.Linear(4, 4), mesh, ColwiseParallel()))
    model.plain = nn.Linear(4, 4)  # a plain parameter beside DTensor ones: `copies_among`
    control = TorchAdapter([model], None, AdapterContext())
    control.agree(dist.group.WORLD)
    out["control"] = {"splits": control._stages.splits(), "replica": repr(control._replica)}
    adapter = TorchAdapter([model], None, AdapterContext())
    if rank == 1:
        used = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))

        def broken() -> None:
            raise RuntimeError("injected: no coordinate")

        used.get_coordinate = broken
    raised = None
    with _warnings() as said:
        try:
            adapter.agree(dist.group.WORLD)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            raised = repr(exc)
    total = torch.ones(1)
    dist.all_reduce(total)  # the ranks still run the same collectives
    out["failure"] = {
        "raised": raised,
        "stages": adapter._stages is not None,
        "replica": repr(adapter._replica),
        "groups": adapter._replica.groups if hasattr(adapter._replica, "groups") else "none",
        "faults": adapter.context.faults.total,
        "said": said,
        "total": float(total),
    }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_worker, world_size=2, timeout=600)


def test_imported_without_stages_is_quiet_and_a_late_stage_is_said(results):
    for r in results:
        assert r["quiet"] == [], r["quiet"]
        assert len(r["late"]) == 1 and "after set_monitor" in r["late"][0], r["late"]


def test_stages_are_found_through_wrappers(results):
    for r in results:
        assert r["indices"] == [[1], [2], [3]]


def test_a_local_failure_in_agree_falls_back_alike_on_every_rank(results):
    for r in results:  # without the failure: a map that splits, plain parameters local to each stage
        assert r["control"]["splits"] and "Replicated" not in r["control"]["replica"], r["control"]
    failures = [r["failure"] for r in results]
    assert [f["raised"] for f in failures] == [None, None], failures
    assert [f["faults"] for f in failures] == [0, 1], failures
    for f in failures:
        assert f["total"] == 2.0
        assert not f["stages"] and f["groups"] == (None,), f  # copies over every rank, as without a map
        assert any("rank(s) [1] could not prepare" in s for s in f["said"]), f["said"]
