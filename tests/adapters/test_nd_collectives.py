"""The collectives trainermon itself issues per collected step under a 2-D layout (FSDP2 over tensor
parallelism, 2 x 2 ("dp", "tp") on 4 gloo ranks): one packed all-gather per process group, whatever the
number of tensors, and their payload; on the default group, the job-wide gradient norm rides in the
cross-rank summaries' all-gather (one more float64 row), so that group too sees one collective.

Every `torch.distributed` collective is wrapped in each rank; a call counts as the monitor's when a frame
of trainermon's code (core, adapters, exporters) is on the stack. The same training runs with 2 and with 8
FFN layers (4x the sharded rows): the count per group is the same, the payload grows with the rows. The
first collected step also agrees the cross-rank layout (two all-gathers on the CPU group, once per run
and whenever the set of rows changes); the steady-state steps after it are the ones asserted.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

from tests.adapters.test_dtensor_nd import _model
from tests.distributed import run_ranks
from trainermon.stats.partials import GATHER_OP

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all_single",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
    "reduce",
    "gather",
    "scatter",
)
STEPS = 3
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS = tuple(os.path.join(REPO, d) + os.sep for d in ("trainermon", "adapters", "exporters"))


def _from_monitor() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.realpath(frame.f_code.co_filename)
        if path.startswith(OURS):
            return True
        frame = frame.f_back
    return False


def _bytes(args: tuple, kwargs: dict) -> int:
    import torch

    total = 0
    for a in list(args) + list(kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _run(rank: int, world: int, out_root: str, layers: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from trainermon import TrainerMon

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    model.layers.extend(type(model.layers[0])() for _ in range(layers - len(model.layers)))
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, f"layers{layers}")
    cfg = os.path.join(out_root, f"layers{layers}-{rank}.json")
    with open(cfg, "w") as fh:
        body = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True}
        json.dump({**body, "ops": ["norm", "min", "max", "mean"]}, fh)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)

    known = {
        tuple(dist.get_process_group_ranks(mesh["dp"].get_group())): "dp",
        tuple(dist.get_process_group_ranks(mesh["tp"].get_group())): "tp",
    }

    def label(group) -> str:
        if group is None or group is dist.group.WORLD:
            return "world"
        return known.get(tuple(dist.get_process_group_ranks(group)), "cpu")  # the gloo copy of the world

    step_calls: dict[str, list] = defaultdict(list)
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if _from_monitor():
                step_calls[label(kwargs.get("group"))].append((name, _bytes(args, kwargs)))
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    per_step = []
    try:
        for step in range(STEPS):
            step_calls.clear()
            gen = torch.Generator().manual_seed(100 * step + mesh["dp"].get_local_rank())
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            per_step.append({g: list(calls) for g, calls in step_calls.items()})
        monitor.flush()
        rows = len(monitor.last_batch.rows) if monitor.last_batch is not None else 0
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    monitor.close()
    dist.barrier()
    return [{"rows": rows, "faults": dict(monitor.faults.counts)}, *per_step]


def _both(rank: int, world: int, out_root: str) -> dict:
    return {layers: _run(rank, world, out_root, layers) for layers in (2, 8)}


def test_one_packed_reduction_per_group_per_collected_step(tmp_path: Path) -> None:
    results = run_ranks(_both, world_size=4, timeout=900, out_root=str(tmp_path))
    report = {}
    for layers in (2, 8):
        for rank, res in enumerate(r[layers] for r in results):
            info, steps = res[0], res[1:]
            assert info["faults"] == {}, (layers, rank, info)
            # dp and tp: the sharded rows' merge; world: the cross-rank summaries; cpu: their layout check
            assert set(steps[0]) == {"dp", "tp", "world", "cpu"}, (layers, rank, steps[0])
            # the first step agrees the layout: the ranks' key-list digests (24 bytes each, sent and
            # received: 24 + 4 x 24); every rank holds the same list here, so nothing more travels
            cpu = steps[0]["cpu"]
            assert [n for n, _ in cpu] == ["all_reduce", "all_gather"], steps[0]
            assert cpu[1][1] == 24 * (1 + len(results)), cpu
            for step in steps[1:]:
                assert set(step) == {"dp", "tp", "world", "cpu"}, (layers, rank, step)
                for group, calls in step.items():
                    if group == "world":
                        # the summaries' one all-gather, the job-wide gradient norm of a model split
                        # over ranks inside it
                        assert [n for n, _ in calls] == [GATHER_OP], (layers, rank, calls)
                    elif group == "cpu":  # the layout check: one int64 all-reduce
                        assert calls == [("all_reduce", 8)], (layers, rank, calls)
                    else:
                        assert len(calls) == 1 and calls[0][0] == GATHER_OP, (group, calls)
            if rank == 0:
                report[layers] = {g: calls for g, calls in steps[-1].items()}
    # Same count with 4x the tensors; the payload of the sharded merge grows with the rows
    assert report[8]["dp"][0][1] > report[2]["dp"][0][1] and report[8]["tp"][0][1] > report[2]["tp"][0][1]
    print("\nmonitor collectives per collected step (rank 0; op, bytes passed: input + output buffers):")
    for layers, groups in report.items():
        print(f"  {layers} FFN layers: {json.dumps(groups, sort_keys=True)}")
