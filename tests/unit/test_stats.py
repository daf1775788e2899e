"""The statistics engine: exact partials, NaN/Inf handling, dtypes, shapes, and exact merging of shards."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.helpers import ref_stats
from trainermon.stats import (
    CHUNK,
    GROUP_MAX,
    MAX,
    MIN,
    EngineOptions,
    StatsEngine,
    empty_partials,
    finalize,
    merge,
)

#: The engine's three CPU-reachable paths: the native one-pass kernel, eager torch (the kernel off), and
#: the branch-free masked path that accelerators run.
PATHS = {
    "native": {},
    "cpu-eager": {"fused": False},
    "accelerator-path": {"force_masked": True},
}


def _engine(path: str, **options) -> StatsEngine:
    return StatsEngine(EngineOptions(**PATHS[path], **options))


def _final(engine: StatsEngine, tensors: list[torch.Tensor]) -> dict[str, np.ndarray]:
    partials = engine.compute(tensors).numpy()
    numel = np.array([t.numel() for t in tensors], dtype=np.float64)
    return finalize(partials, numel)


def _check(values: dict[str, np.ndarray], i: int, ref: dict[str, float], rtol: float = 1e-5) -> None:
    for op in ("norm", "mean", "min", "max", "nans", "infs"):
        got, want = float(values[op][i]), ref[op]
        if math.isnan(want):
            assert math.isnan(got), op
        else:
            assert got == pytest.approx(want, rel=rtol, abs=1e-6 * max(ref["norm"], 1e-30)), op


@pytest.mark.parametrize("path", PATHS)
def test_plain_values(path):
    torch.manual_seed(0)
    tensors = [torch.randn(7, 5), torch.randn(100) * 3 + 1, torch.tensor([2.5]), torch.randn(3, 4, 5)]
    values = _final(_engine(path), tensors)
    for i, t in enumerate(tensors):
        _check(values, i, ref_stats(t))


@pytest.mark.parametrize("path", PATHS)
def test_nan_and_inf_are_counted_and_excluded(path):
    t = torch.tensor([1.0, float("nan"), -3.0, float("inf"), 2.0, float("-inf"), float("nan")])
    all_bad = torch.tensor([float("nan"), float("inf")])
    values = _final(_engine(path), [t, all_bad])
    assert values["nans"][0] == 2 and values["infs"][0] == 2
    assert values["min"][0] == -3.0 and values["max"][0] == 2.0
    assert values["mean"][0] == pytest.approx(0.0) and values["norm"][0] == pytest.approx(math.sqrt(14))
    assert values["nans"][1] == 1 and values["infs"][1] == 1
    # no finite value: every statistic of the finite values is NaN (a norm of 0 would read as healthy)
    assert math.isnan(values["min"][1]) and math.isnan(values["mean"][1]) and math.isnan(values["norm"][1])


@pytest.mark.parametrize("path", ["native", "cpu-eager"])
def test_without_nan_counting_nan_propagates_visibly(path):
    values = _final(_engine(path, nonfinite=False), [torch.tensor([1.0, float("nan")])])
    assert math.isnan(values["norm"][0]) and math.isnan(values["max"][0]) and math.isnan(values["min"][0])


def test_zeros_fraction():
    t = torch.tensor([0.0, 1e-12, 1.0, -2.0, 0.0, float("nan")])
    values = _final(StatsEngine(EngineOptions(zeros_eps=1e-8)), [t])
    assert values["zeros"][0] == pytest.approx(3 / 6)  # 0, 1e-12, 0; the NaN is not a zero


@pytest.mark.parametrize("path", ["native", "cpu-eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.bool])
def test_dtypes(dtype, path):
    torch.manual_seed(0)
    t = (torch.randn(1000) * 4).to(dtype)
    values = _final(_engine(path), [t])
    _check(values, 0, ref_stats(t), rtol=1e-5)


def test_empty_and_non_contiguous():
    torch.manual_seed(0)
    base = torch.randn(64, 32)
    tensors = [torch.empty(0), base.t(), base[:, ::3]]
    values = _final(StatsEngine(EngineOptions()), tensors)
    assert values["numel"][0] == 0 and values["norm"][0] == 0 and math.isnan(values["mean"][0])
    _check(values, 1, ref_stats(base.t()))
    _check(values, 2, ref_stats(base[:, ::3]))


@pytest.mark.parametrize("path", ["native", "cpu-eager"])
def test_large_tensor_is_chunked_and_accurate(path):
    torch.manual_seed(0)
    t = torch.randn(3 * CHUNK + 17) * 2 + 0.5
    t[CHUNK + 5] = float("nan")
    values = _final(_engine(path), [t])
    _check(values, 0, ref_stats(t), rtol=1e-6)


def test_shards_merge_exactly():
    """Partials of disjoint pieces merge to the statistics of the whole (the ZeRO/FSDP contract)."""
    torch.manual_seed(0)
    full = torch.randn(1000)
    full[10] = float("inf")
    pieces = [full[:300], full[300:301], full[301:]]
    engine = StatsEngine(EngineOptions())
    merged = empty_partials(1)
    for piece in pieces:
        merged = merge(merged, engine.compute([piece]))
    whole = engine.compute([full])
    values = finalize(merged.numpy(), np.array([1000.0]))
    _check(values, 0, ref_stats(full))
    assert merged[0, MIN] == whole[0, MIN] and merged[0, MAX] == whole[0, MAX]


def test_unreadable_tensors_are_reported_not_computed():
    """A complex tensor (no min/max) and a tensor whose storage was released (reading it crashes eager
    torch): NaN rows, and `compute_rows` names why, so that callers skip them and count a fault."""
    freed = torch.randn(100)
    freed.untyped_storage().resize_(0)
    tensors = [torch.ones(3), torch.ones(3, dtype=torch.complex64), freed, torch.full((4,), 2.0)]
    partials, skipped = StatsEngine(EngineOptions()).compute_rows(tensors)
    assert sorted(skipped) == [1, 2]
    assert skipped[1].kind == "complex tensor" and skipped[2].kind == "tensor with a released storage"
    assert torch.isnan(partials[1]).all() and torch.isnan(partials[2]).all()
    values = finalize(partials.numpy(), np.array([3.0, 3.0, 100.0, 4.0]))
    assert values["norm"][0] == pytest.approx(math.sqrt(3)) and values["norm"][3] == pytest.approx(4.0)


@pytest.mark.parametrize("path", ["native", "cpu-eager"])
@pytest.mark.parametrize("nonfinite", [True, False], ids=["nan-counting", "plain"])
def test_every_path_in_one_call_keeps_rows_in_order(nonfinite, path):
    """Sizes on both sides of the grouping threshold and of the chunk size, every dtype, non-contiguous
    views and empty tensors, all in one call: each row matches a float64 reference of its own tensor."""
    torch.manual_seed(0)
    sizes = [1, 7, GROUP_MAX, GROUP_MAX + 1, CHUNK - 3, CHUNK, CHUNK + 1, 2 * CHUNK + 11]
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.bool]
    tensors = []
    for k, n in enumerate(sizes):
        dtype = dtypes[k % len(dtypes)]
        tensors.append((torch.randn(n) * 3 - 1).to(dtype))
        tensors.append(torch.empty(0, dtype=dtype))
        wide = torch.randn(n, 2) * 2 + 0.5
        tensors.append(wide[:, 1])  # non-contiguous: every other element
    tensors.append(torch.randn(GROUP_MAX + 5).to(torch.complex64).real)  # a view of a complex tensor
    values = _final(_engine(path, nonfinite=nonfinite), tensors)
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            assert values["norm"][i] == 0 and math.isnan(values["min"][i]), i
            continue
        _check(values, i, ref_stats(t), rtol=1e-6)  # the engine's contract, whatever the dtype
