"""The merges' collectives on NCCL with CUDA tensors: the all-gather path and the two all-reduces of a
large job (`stats.partials.GATHER_BYTES`), for the sharded merge (`reduce_across`) and the cross-rank
summaries (`CrossRank._merge`). Gloo runs them on 4 ranks in `tests/scale/test_merge_paths.py`; this
checks what gloo cannot: that NCCL takes their dtypes and ops (int64 MAX, float64 SUM and MAX) on device
buffers and gives back what the gather gives. One GPU allows one NCCL rank (two ranks may not share a
device), so the ranks' rows merge with themselves: the values must come back unchanged. Skipped without
CUDA (run by `benchmarks/gpu.sh`)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.scale.test_merge_paths import _rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")


def _on_nccl(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from trainermon.collect.xrank import CrossRank
    from trainermon.stats import partials

    dist.destroy_process_group()  # run_ranks starts gloo; this rank goes over to NCCL on its own
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(0)
    rows, flags = (t.cuda() for t in _rows(0))
    found: dict = {"rows": rows.cpu().tolist(), "flags": (flags > 0).cpu().tolist()}
    merger = CrossRank(0, 1)
    keys = torch.randint(-(2**62), 2**62, (5, 3), dtype=torch.int64, device="cuda")
    sums = torch.randn(5, 4, dtype=torch.float64, device="cuda")
    found["keys"], found["sums"] = keys.cpu().tolist(), sums.cpu().tolist()
    for path, limit in (("gather", partials.GATHER_BYTES), ("reduce", 0)):
        partials.GATHER_BYTES = limit
        out, bad = partials.reduce_across(rows.clone(), None, flags.clone())
        assert out.device.type == "cuda"
        k, s = merger._merge(keys.clone(), sums.clone())
        found[path] = [out.cpu().tolist(), bad.cpu().tolist(), k.cpu().tolist(), s.cpu().tolist()]
        found[path + "_by"] = merger.merged_by
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return found


def test_both_merge_paths_on_nccl():
    found = run_ranks(_on_nccl, world_size=1)[0]
    assert (found["gather_by"], found["reduce_by"]) == ("all_gather", "all_reduce")
    want = torch.tensor(found["rows"], dtype=torch.float64)
    for path in ("gather", "reduce"):
        rows, bad, keys, sums = found[path]
        rows = torch.tensor(rows, dtype=torch.float64)
        assert torch.equal(rows.isnan(), want.isnan()), path
        assert torch.equal(rows.nan_to_num(), want.nan_to_num()), path  # one rank: nothing added
        assert bad == found["flags"], path
        assert keys == found["keys"] and sums == found["sums"], path
