"""N-D placements in the core (collect/placement.py + StepCollector), on a 2 x 2 gloo mesh of 4 ranks.

Mesh: rank = 2 * dp + tp. Tensors are split over tensor parallel (tp), over data parallel (dp), over both,
copied over one or both, in one step, mixed in the order adapters add them. Every rank adds its piece; the
test then checks, against statistics of the full tensors computed here in float64:

- each row's values and full shape, written by exactly one rank (the one at coordinate 0 of every group);
- one packed all-gather per distinct group per step, none for replicated rows;
- the job-wide gradient sum of squares (`job_grad_norm`) on every rank: one all-reduce on the default
  group, or none when it rides in the cross-rank summaries' all-gather.

The rows are sharded over several groups, so the collector merges one mesh dimension at a time; ranks
that meet in a group must have merged the same dimensions before. Two orders that break this were
tried: groups sorted by their global ranks (rank 2's dp group (0, 2) sorts before its tp group (2, 3),
rank 3's does not), and first appearance on ranks that skip the rows of a copy they do not write
(ranks 1 and 3 skip `dp_only`, so they would see tp first and count pieces twice).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from tests.distributed import run_ranks
from trainermon.stats.partials import GATHER_OP

FULL_SHAPES = {"both": (8, 6), "tp_only": (4, 5), "dp_only": (9,), "tp_dp_copy": (6, 2), "copy": (3, 3)}


def _full(name: str):
    import torch

    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(FULL_SHAPES[name], generator=gen, dtype=torch.float64).float()


def _mesh_rank(rank: int, world: int) -> dict:
    import numpy as np
    import torch.distributed as dist

    from trainermon.collect.collector import StepCollector, TransferCounter
    from trainermon.collect.placement import Replicated, Sharded, TensorPiece
    from trainermon.collect.records import StepScalars
    from trainermon.collect.xrank import CrossRank
    from trainermon.stats import EngineOptions, StatsEngine, finalize

    dp, tp = divmod(rank, 2)
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, dp_group = tp_groups[dp], dp_groups[tp]

    calls: list[tuple] = []
    real, real_gather = dist.all_reduce, getattr(dist, GATHER_OP)

    def ranks(group) -> tuple:
        return tuple(dist.get_process_group_ranks(group)) if group is not None else ("world",)

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(("all_reduce", *ranks(group)))
        return real(tensor, op=op, group=group, async_op=async_op)

    def counting_gather(output, tensor, group=None, async_op=False):
        calls.append(("all_gather", *ranks(group)))
        return real_gather(output, tensor, group=group, async_op=async_op)

    xrank = CrossRank(rank, world)
    xrank.attach()  # its CPU group, before the collectives are counted
    summaries = SimpleNamespace(xrank_summary=True, ops=("norm", "min", "max", "mean"))

    def add_rows(collector) -> None:
        entries = []
        # dp-only first on purpose: the first-appearance order is dp before tp for this family...
        full = _full("dp_only")
        piece = full.flatten().chunk(2)[dp]
        entries.append(
            (
                0,
                "dp_only",
                None,
                TensorPiece(piece, Sharded(dp_group, replicated=(tp_group,)), (9,), full.dtype),
            )
        )
        collector.add("grad_reduced", entries)
        # ...and rows over (tp, dp) come after it; the merge order stays per mesh dimension because
        # the placements name (tp, dp) in that order and dp first appeared as a lone group before.
        entries = []
        full = _full("both")
        tp_piece = full.chunk(2, dim=0)[tp]  # tensor parallel along dim 0
        dp_piece = tp_piece.flatten().tensor_split([7])[dp]  # an uneven distributed-optimizer split
        entries.append(
            (0, "both", None, TensorPiece(dp_piece, Sharded(tp_group, dp_group), (8, 6), full.dtype))
        )
        full = _full("tp_only")
        entries.append(
            (
                0,
                "tp_only",
                None,
                TensorPiece(
                    full.chunk(2, dim=1)[tp], Sharded(tp_group, replicated=(dp_group,)), (4, 5), full.dtype
                ),
            )
        )
        full = _full("tp_dp_copy")
        entries.append(
            (0, "tp_dp_copy", None, TensorPiece(full, Replicated(dp_group, tp_group), (6, 2), full.dtype))
        )
        collector.add("grad_reduced", entries)
        full = _full("copy")
        collector.add(
            "param_updated", [(0, "copy", None, TensorPiece(full, Replicated(None), (3, 3), full.dtype))]
        )

    dist.all_reduce = counting
    setattr(dist, GATHER_OP, counting_gather)
    try:
        collector = StepCollector(StatsEngine(EngineOptions(nonfinite=True)), TransferCounter())
        add_rows(collector)
        calls.clear()
        payload = collector.finish(0, StepScalars(), job_grad_norm=True)
        steps = [(payload, list(calls))]
        # the same step with the cross-rank summaries' tail: the job norm rides in their all-gather
        add_rows(collector)
        calls.clear()
        tail = xrank.tail(True, summaries)
        steps.append((collector.finish(1, StepScalars(), job_grad_norm=True, tail=tail), list(calls)))
    finally:
        dist.all_reduce = real
        setattr(dist, GATHER_OP, real_gather)

    def table(payload) -> dict:
        numel = np.array([r.numel for r in payload.rows], dtype=np.float64)
        values = finalize(payload.partials[: len(payload.rows)].numpy(), numel)
        return {
            (r.family, r.name): {"shape": list(r.shape), **{k: float(v[i]) for k, v in values.items()}}
            for i, r in enumerate(payload.rows)
        }

    return {
        "rows": table(steps[0][0]),
        "rows_with_summaries": table(steps[1][0]),
        "calls": steps[0][1],
        "calls_with_summaries": steps[1][1],
        "job_sumsq": [float(p.job_grad_sumsq) for p, _ in steps],
    }


def test_nd_placements_merge_exactly_and_write_once() -> None:
    results = run_ranks(_mesh_rank, world_size=4)
    writers: dict[tuple, list[int]] = {}
    for rank, res in enumerate(results):
        for key in res["rows"]:
            writers.setdefault(key, []).append(rank)
    assert writers == {
        ("grad_reduced", "dp_only"): [0],
        ("grad_reduced", "both"): [0],
        ("grad_reduced", "tp_only"): [0],
        ("grad_reduced", "tp_dp_copy"): [0],
        ("param_updated", "copy"): [0],
    }
    for (_family, name), got in results[0]["rows"].items():
        x = _full(name).double()
        assert got["shape"] == list(FULL_SHAPES[name])
        # the engine's documented accuracy (README): norm 5e-7 relative, mean 1e-6 x rms; a lost or
        # doubled piece is off by percents
        rms = float(x.pow(2).mean().sqrt())
        assert math.isclose(got["norm"], float(x.norm()), rel_tol=5e-7), (name, got["norm"], float(x.norm()))
        assert abs(got["mean"] - float(x.mean())) <= 1e-6 * rms, (name, got["mean"], float(x.mean()))
        assert got["min"] == float(x.min()) and got["max"] == float(x.max()), name
    # one packed reduction (one all-gather) per distinct group, then the job norm's all-reduce on the world;
    # with the cross-rank summaries on, the job norm rides in their one all-gather on the world (after
    # their layout check on the CPU group) and no all-reduce is left on the world
    grad_sumsq = sum(
        float(_full(n).double().pow(2).sum()) for n in ("dp_only", "both", "tp_only", "tp_dp_copy")
    )
    for rank, res in enumerate(results):
        dp, tp = divmod(rank, 2)
        merges = [("all_gather", tp, tp + 2), ("all_gather", 2 * dp, 2 * dp + 1)]
        assert res["calls"] == [*merges, ("all_reduce", "world")], (rank, res["calls"])
        summaries = [("all_reduce", 0, 1, 2, 3), ("all_gather", "world")]
        assert res["calls_with_summaries"] == summaries + merges, (rank, res["calls_with_summaries"])
        assert res["rows_with_summaries"] == res["rows"], rank
        for got in res["job_sumsq"]:
            assert math.isclose(got, grad_sumsq, rel_tol=1e-6), (rank, got, grad_sumsq)


def _failing_rank(rank: int, world: int) -> dict:
    from trainermon.collect.collector import StepCollector, TransferCounter
    from trainermon.collect.placement import Sharded, TensorPiece
    from trainermon.collect.records import StepScalars
    from trainermon.stats import EngineOptions, StatsEngine

    collector = StepCollector(StatsEngine(EngineOptions(nonfinite=True)), TransferCounter())

    def piece(name: str) -> TensorPiece:
        full = _full(name)
        return TensorPiece(full.flatten().chunk(world)[rank], Sharded(None), FULL_SHAPES[name], full.dtype)

    def out_of_memory(tensors):
        raise RuntimeError("CUDA out of memory (simulated)")

    raised = False
    if rank == 1:  # one rank's engine call fails (an allocation, say); the other computes its piece
        collector.engine.compute_rows = out_of_memory
    try:
        collector.add("grad_reduced", [(0, "both", None, piece("both"))])
    except RuntimeError:
        raised = True
    if rank == 1:
        del collector.engine.compute_rows  # the class's method again
    collector.add("grad_reduced", [(0, "dp_only", None, piece("dp_only"))])
    payload = collector.finish(0, StepScalars())
    rows = {r.name: [float(v) for v in payload.partials[i]] for i, r in enumerate(payload.rows)}
    return {"raised": raised, "rows": rows}


def test_a_failed_engine_call_leaves_no_sharded_row():
    """A sharded row whose piece one rank could not compute is flagged (NaN count: the worker drops it),
    not merged from the other ranks' pieces as if it were whole; the next row is exact."""
    from trainermon.stats import NANS, SUMSQ

    results = run_ranks(_failing_rank, world_size=2)
    assert [r["raised"] for r in results] == [False, True]
    rows = results[0]["rows"]
    assert math.isnan(rows["both"][NANS]), rows["both"]
    want = float(_full("dp_only").double().pow(2).sum())
    assert math.isclose(rows["dp_only"][SUMSQ], want, rel_tol=1e-6), (rows["dp_only"], want)
    assert rows["dp_only"][NANS] == 0
