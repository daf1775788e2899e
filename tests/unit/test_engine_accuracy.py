"""The engine's accuracy contract (trainermon/stats/engine.py), on adversarial data, on every path.

Contract, for float32, bf16 and fp16 tensors, whatever the host's SIMD, the grouping, the chunking and the
order: norm within 1e-6 relative of a float64 reference, mean within 1e-6 relative plus 1e-6 x rms,
min/max/NaN/Inf counts exact. The bounds are proven in the engine's and the kernel's docstrings; these
cases are where a float32 accumulator fails them (the engine before this contract erred by 3.6e-5 on a
quarter-million-element tensor, and by far more on the large-offset and all-equal cases below).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainermon.stats import CHUNK, GROUP_MAX, EngineOptions, StatsEngine, finalize

PATHS = {
    "native": {},  # the one-pass kernel where built (dense CPU float32/bf16/fp16), eager torch otherwise
    "cpu-eager": {"fused": False},
    "accelerator-path": {"force_masked": True},  # branch-free: what runs on GPUs and NPUs
    "zeros-counting": {"zeros_eps": 1e-30},  # the masked CPU path that counts near-zeros
}
NORM_RTOL = 1e-6
MEAN_RTOL = 1e-6  # plus MEAN_RTOL x rms absolute


def _reference(t: torch.Tensor) -> dict[str, float]:
    """float64 statistics over the finite values, with numpy's pairwise sums (error ~1e-15 here)."""
    x = t.detach().to(torch.float64).reshape(-1).numpy()
    finite = x[np.isfinite(x)]
    n = finite.size
    return {
        "norm": float(np.sqrt(np.sum(finite * finite))),
        "mean": float(np.sum(finite) / n) if n else math.nan,
        "min": float(finite.min()) if n else math.nan,
        "max": float(finite.max()) if n else math.nan,
        "nans": float(np.isnan(x).sum()),
        "infs": float(np.isinf(x).sum()),
        "numel": float(x.size),
    }


def _check(values: dict[str, np.ndarray], i: int, ref: dict[str, float], what: str) -> None:
    norm, mean = float(values["norm"][i]), float(values["mean"][i])
    assert abs(norm - ref["norm"]) <= NORM_RTOL * ref["norm"], f"{what}: norm {norm!r} vs {ref['norm']!r}"
    rms = ref["norm"] / math.sqrt(max(ref["numel"] - ref["nans"] - ref["infs"], 1.0))
    if math.isnan(ref["mean"]):
        assert math.isnan(mean), what
    else:
        bound = MEAN_RTOL * abs(ref["mean"]) + MEAN_RTOL * rms
        assert abs(mean - ref["mean"]) <= bound, (
            f"{what}: mean {mean!r} vs {ref['mean']!r} (bound {bound:.3g})"
        )
    for op in ("min", "max", "nans", "infs"):
        got, want = float(values[op][i]), ref[op]
        assert got == want or (math.isnan(got) and math.isnan(want)), f"{what}: {op} {got!r} vs {want!r}"


def _run(path: str, tensors: list[torch.Tensor]) -> dict[str, np.ndarray]:
    engine = StatsEngine(EngineOptions(**PATHS[path]))
    partials = engine.compute(tensors)
    assert partials.dtype == torch.float64
    return finalize(partials.numpy(), np.array([t.numel() for t in tensors], dtype=np.float64))


def _adversarial(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    big = 3.0e38 if dtype != torch.float16 else 6.0e4
    tiny = 1.0e-38 if dtype != torch.float16 else 1.0e-7
    alternating = torch.ones(1_000_003) * 1.25
    alternating[1::2] = -1.25
    mixed = torch.randn(1_000_000, generator=g)
    mixed[torch.randint(0, 1_000_000, (500,), generator=g)] = math.nan
    mixed[torch.randint(0, 1_000_000, (300,), generator=g)] = math.inf
    mixed[torch.randint(0, 1_000_000, (200,), generator=g)] = -math.inf
    cases = {
        "offset mean >> std": 1000.0 + 0.01 * torch.randn(CHUNK * 3 + 5, generator=g),
        "all equal": torch.full((1_000_001,), 0.1),
        "near overflow": big * (0.5 + 0.5 * torch.rand(100_003, generator=g)),
        "near overflow, signs": big * torch.randn(50_000, generator=g).sign(),
        "near underflow": tiny * (1 + torch.rand(100_003, generator=g)),
        "subnormal": torch.full((70_001,), 1e-42 if dtype == torch.float32 else tiny / 4),
        "alternating signs": alternating,
        "mixed NaN/Inf": mixed,
        "small, offset": 300.0 + torch.rand(GROUP_MAX, generator=g),
    }
    return {name: t.to(dtype) for name, t in cases.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_adversarial_values_meet_the_bound(path, dtype):
    cases = _adversarial(dtype)
    values = _run(path, list(cases.values()))
    for i, (name, t) in enumerate(cases.items()):
        _check(values, i, _reference(t), f"{name} ({dtype}, {path})")


@pytest.mark.parametrize("path", PATHS)
def test_thirty_million_elements_offset_from_zero(path):
    """3e7 elements whose mean is 1e5 times their spread: every float32 accumulation of this length fails
    the bound by orders of magnitude; runs of 16 added in float64 do not."""
    g = torch.Generator().manual_seed(3)
    t = 1.0e4 + 0.1 * torch.randn(30_000_017, generator=g)
    values = _run(path, [t, t[1:].view(-1)[::1]])  # the second from an odd offset: other alignment
    _check(values, 0, _reference(t), f"3e7 ({path})")
    _check(values, 1, _reference(t[1:]), f"3e7 at offset 1 ({path})")


def _views() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    base = 50.0 + torch.randn(1200, 900, generator=g)
    row = 7.0 + torch.rand(1, 3000, generator=g)
    return {
        "non-contiguous (every third column)": base[:, ::3],
        "non-contiguous, large (gaps)": (20.0 + torch.randn(2, CHUNK + 77, generator=g))[:, 1:],
        "transposed": base.t(),
        "permuted 3-D": base.view(30, 40, 900).permute(2, 0, 1),
        "expanded (stride 0)": row.expand(500, 3000),
        "expanded inner dim": (5.0 + torch.rand(400, 1, generator=g)).expand(400, 700),
        "offset view": base.view(-1)[12_345:],
        "narrowed rows": base[100:1000],
        "0-dim": torch.tensor(-2.5),
        "one element": torch.tensor([3.0]),
    }


@pytest.mark.parametrize("path", PATHS)
def test_views_are_read_exactly(path):
    views = _views()
    for dtype in (torch.float32, torch.bfloat16):
        tensors = [v.to(dtype) if dtype != torch.float32 else v for v in views.values()]
        values = _run(path, tensors)
        for i, name in enumerate(views):
            _check(values, i, _reference(tensors[i]), f"{name} ({dtype}, {path})")


@pytest.mark.parametrize("path", PATHS)
def test_hundreds_in_one_call_each_meet_the_bound(path):
    """Grouping (small tensors stacked per size), chunking and the kernel's batch, all in one call, with
    offsets that make float32 sums fail: every row is its own tensor's, within the bound."""
    g = torch.Generator().manual_seed(5)
    tensors = []
    for k in range(320):
        n = [1, 15, 16, 17, 100, 4095, GROUP_MAX, GROUP_MAX + 1, 50_000][k % 9]
        dtype = [torch.float32, torch.bfloat16, torch.float16, torch.float64][k % 4]
        t = (float(k % 13) * 40.0 - 100.0) + torch.randn(n, generator=g)
        if k % 5 == 0:
            t = torch.randn(n, 2, generator=g)[:, 1] + 64.0  # a strided view among them
        tensors.append(t.to(dtype))
    values = _run(path, tensors)
    for i, t in enumerate(tensors):
        _check(values, i, _reference(t), f"tensor {i} ({t.dtype}, {t.numel()}, {path})")


@pytest.mark.parametrize("path", PATHS)
def test_float64_and_integers_are_reduced_in_float64(path):
    big = torch.tensor([2**40 + 1, -(2**40), 3, 2**30], dtype=torch.int64)
    f64 = torch.tensor([1e150, -1e150, 1e-150, 5.0], dtype=torch.float64)
    flags = torch.tensor([True, False, True, True])
    values = _run(path, [big, f64, flags])
    assert values["mean"][0] == (2**40 + 1 - 2**40 + 3 + 2**30) / 4
    assert values["min"][0] == -(2**40) and values["max"][0] == 2**40 + 1
    assert values["norm"][1] == pytest.approx(math.sqrt(2) * 1e150, rel=1e-12)
    assert values["mean"][2] == 0.75 and values["norm"][2] == pytest.approx(math.sqrt(3), rel=1e-15)
