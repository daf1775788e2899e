"""The Triton statistics kernel against float64 references computed here, and the engine's use of it.

The kernel runs natively on a CUDA GPU (benchmarks/gpu.sh runs this file there). Without one it runs under
Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors when Triton is installed; CI installs no Triton, so
there only the fallback test runs and the rest are skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest
import torch

from trainermon.stats import (
    INFS,
    MAX,
    MIN,
    NANS,
    SUM,
    SUMSQ,
    ZEROS,
    EngineOptions,
    StatsEngine,
    triton_stats,
)

CUDA = torch.cuda.is_available()
HAVE_TRITON = importlib.util.find_spec("triton") is not None
if HAVE_TRITON and not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are first built
# Triton 3.6's interpreter cannot take a loop bound loaded from memory under NumPy >= 2.4 (int() of a
# 1-element array); compiled kernels are unaffected.
INTERPRETER_OK = tuple(int(v) for v in np.__version__.split(".")[:2]) < (2, 4)
needs_kernel = pytest.mark.skipif(
    not HAVE_TRITON or not (CUDA or INTERPRETER_OK),
    reason="needs Triton, and a CUDA GPU or NumPy < 2.4 for the interpreter",
)
DEVICE = torch.device("cuda" if CUDA else "cpu")
CONTRACT = 16 * 2.0**-24 + 1e-12


def reference(t: torch.Tensor, masked: bool, eps: float | None) -> list[float]:
    """The row the engine promises, from a float64 copy (independent of both engine paths)."""
    x = t.detach().double().cpu().flatten()
    nan, inf = torch.isnan(x), torch.isinf(x)
    finite = ~(nan | inf)
    zeros = float((x.abs() < eps).sum()) if eps is not None else 0.0
    if masked:
        v = x[finite]
        lo = float(v.min()) if v.numel() else math.inf
        hi = float(v.max()) if v.numel() else -math.inf
        return [float((v * v).sum()), float(v.sum()), lo, hi, float(nan.sum()), float(inf.sum()), zeros]
    lo, hi = (math.nan, math.nan) if bool(nan.any()) else (float(x.min()), float(x.max()))
    return [float((x * x).sum()), float(x.sum()), lo, hi, 0.0, 0.0, zeros]


def check_rows(
    got: torch.Tensor, tensors: list[torch.Tensor], masked: bool, eps: float | None, rel: float = CONTRACT
) -> None:
    # `rel` bounds the sum's error relative to sum|x| and the sum of squares' relative error: the engine's
    # contract is 16u = 9.5e-7 (u = 2^-24; float32 runs of 16 terms) plus float64 additions (< 1e-12 for
    # these sizes); chunks the kernel reads again in float64 are within 1e-12 (squares of float32 values
    # are exact there and each float64 accumulator adds at most CHUNK / BLOCK terms, then trees).
    got = got.cpu()
    for i, t in enumerate(tensors):
        want = reference(t, masked, eps)
        x = t.detach().double().cpu().flatten()
        ok = x[torch.isfinite(x)] if masked else x
        l1 = float(ok.abs().sum()) if ok.numel() else 0.0
        for col, bound in ((SUMSQ, rel * want[SUMSQ]), (SUM, rel * l1)):
            if math.isfinite(want[col]):
                assert abs(float(got[i, col]) - want[col]) <= bound, (i, col, float(got[i, col]), want[col])
            else:
                assert str(float(got[i, col])) == str(want[col]), (i, col)  # inf, -inf or nan alike
        for col in (MIN, MAX, NANS, INFS, ZEROS):  # exact
            a, b = float(got[i, col]), want[col]
            assert a == b or (math.isnan(a) and math.isnan(b)), (i, col, a, b)


def small_chunks(monkeypatch) -> int:
    """Chunks of 512 elements (blocks of 32): many chunks per tensor, and quick in the interpreter."""
    monkeypatch.setattr(triton_stats, "BLOCK", 32)
    monkeypatch.setattr(triton_stats, "MAX_CHUNK", 32 * triton_stats.RUN)
    return 32 * triton_stats.RUN


def adversarial(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    big = 3e38 if dtype == torch.float32 else (6e4 if dtype == torch.float16 else 3e38)
    sizes = (1, 5, 1023, 1024, 1025, 3000, 4 * 1024 + 1, 9000)
    out = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    out[1][2] = float("nan")
    out[2][7], out[2][8] = float("inf"), -float("inf")
    out[3][:100] = 0.0
    out[4][:] = float("nan")  # no finite value: masked min/max stay at the identity
    out[5][::3] = big  # squares overflow float32, never float64
    out[5][1::3] = -big
    out[6] = (out[6] * 1e-30).to(dtype) if dtype == torch.float32 else out[6]  # tiny squares
    out[7][4000] = float("inf")  # Inf only: sums become inf, unmasked min/max take it
    m = torch.randn(64, 48, generator=g).to(dtype)
    out.append(m.t())  # dense but permuted: read as the range it fills
    out.append(torch.randn(5000, generator=g).to(dtype)[17:])  # a storage offset
    return [t.to(DEVICE) for t in out]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-3])
def test_kernel_matches_float64_reference(monkeypatch, dtype, masked, eps):
    small_chunks(monkeypatch)
    tensors = adversarial(dtype)
    assert all(triton_stats.usable(t) for t in tensors)
    check_rows(triton_stats.partials(tensors, masked, eps), tensors, masked, eps)


@needs_kernel
def test_many_tensors_find_their_chunks(monkeypatch):
    """The binary search over chunk starts: 150 tensors of uneven sizes, chunks of one run."""
    chunk = small_chunks(monkeypatch)
    g = torch.Generator().manual_seed(3)
    sizes = [int(s) for s in torch.randint(1, 3 * chunk, (150,), generator=g)]
    tensors = [(torch.randn(n, generator=g) + i).to(DEVICE) for i, n in enumerate(sizes)]
    check_rows(triton_stats.partials(tensors, True, None), tensors, True, None)


@needs_kernel
def test_extreme_chunks_are_read_again_exactly(monkeypatch):
    """Chunks whose values overflow float32 squares, are tiny, or hold NaN/Inf go through the float64
    pass: their rows are within 1e-12, not the fast path's 16u, while a plain chunk beside them in the same
    tensor is still right."""
    chunk = small_chunks(monkeypatch)
    g = torch.Generator().manual_seed(5)
    huge = torch.randn(3 * chunk, generator=g) * 1e30  # squares overflow float32
    tiny = torch.randn(2 * chunk + 3, generator=g) * 1e-20
    mixed = torch.randn(4 * chunk, generator=g)
    mixed[chunk + 5] = float("nan")
    tensors = [t.to(DEVICE) for t in (huge, tiny)]
    check_rows(triton_stats.partials(tensors, True, None), tensors, True, None, rel=1e-12)
    check_rows(triton_stats.partials([mixed.to(DEVICE)], True, None), [mixed], True, None)


@pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a CUDA GPU and Triton")
def test_engine_uses_kernel_on_cuda(monkeypatch):
    """On CUDA the engine sends dense float tensors to the kernel, one call per dtype, and the rest (an
    int tensor, a strided view) to the eager path; rows come back in input order."""
    calls = []
    real = triton_stats.partials
    monkeypatch.setattr(triton_stats, "partials", lambda ts, *a: calls.append(len(ts)) or real(ts, *a))
    g = torch.Generator().manual_seed(1)
    tensors = [
        torch.randn(3000, generator=g).cuda(),
        torch.randn(50, 60, generator=g).bfloat16().cuda(),
        torch.arange(10).cuda(),
        torch.randn(100, 100, generator=g).cuda()[:, ::2],
        torch.randn(1 << 20, generator=g).cuda(),
    ]
    rows = StatsEngine(EngineOptions()).compute(tensors)
    assert sorted(calls) == [1, 2]
    check_rows(rows, tensors, True, None, rel=CONTRACT)  # both paths keep the engine's contract


@pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a CUDA GPU and Triton")
def test_hook_batch_goes_straight_to_the_kernel(monkeypatch):
    """A hook's batch (plain dense tensors of one dtype, a Parameter among them) takes the engine's short
    path: one kernel call with every tensor, rows in input order; a kernel that fails there leaves the rows
    to the eager path and is switched off once."""
    calls = []
    real = triton_stats.partials
    monkeypatch.setattr(triton_stats, "partials", lambda ts, *a: calls.append(len(ts)) or real(ts, *a))
    g = torch.Generator().manual_seed(2)
    tensors = [
        torch.randn(4, 1024, generator=g).bfloat16().cuda(),
        torch.nn.Parameter(torch.randn(3000, generator=g).bfloat16().cuda()),
        torch.randn(7, generator=g).bfloat16().cuda(),
    ]
    tensors[2][3] = float("nan")
    engine = StatsEngine(EngineOptions())
    check_rows(engine.compute(tensors), tensors, True, None, rel=CONTRACT)
    assert calls == [3]

    def broken(*_):
        raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(triton_stats, "_broken", [])
    monkeypatch.setattr(triton_stats, "partials", broken)
    check_rows(engine.compute(tensors), tensors, True, None, rel=CONTRACT)
    assert not triton_stats.enabled()


@pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs a CUDA GPU and Triton")
def test_kernel_at_scale_cuda():
    """A 2^27-element bf16 tensor and a 2^26-element float32 one, against float64 on the CPU."""
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [
        (torch.randn(1 << 27, device="cuda", generator=g) * 3 + 1).bfloat16(),
        torch.rand(1 << 26, device="cuda", generator=g),
    ]
    for t in tensors:
        row = triton_stats.partials([t], True, None).cpu()[0]
        x = t.double().cpu()
        assert abs(float(row[SUMSQ]) - float((x * x).sum())) <= CONTRACT * float((x * x).sum())
        assert abs(float(row[SUM]) - float(x.sum())) <= CONTRACT * float(x.abs().sum())
        assert float(row[MIN]) == float(x.min()) and float(row[MAX]) == float(x.max())


def test_usable_says_what_the_kernel_reads():
    assert triton_stats.usable(torch.zeros(4, 4).t())
    assert triton_stats.usable(torch.zeros(8, dtype=torch.bfloat16))
    assert not triton_stats.usable(torch.zeros(8, 8)[:, ::2])  # gaps: eager path, a chunk at a time
    assert not triton_stats.usable(torch.zeros(8, dtype=torch.float64))
    assert not triton_stats.usable(torch.zeros(8, dtype=torch.int32))
    assert not triton_stats.usable(torch.zeros(0))


def test_failing_kernel_falls_back_once(monkeypatch, caplog):
    """A kernel that fails (no compiler for this GPU, say) is switched off for the process with one warning,
    and the rows of that batch come from the eager path: nothing is lost. (No Triton needed: the failure is
    simulated; the engine's `_kernel_rows` is what a CUDA batch goes through.)"""
    monkeypatch.setattr(triton_stats, "_broken", [])

    def broken(*_):
        raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(triton_stats, "partials", broken)
    engine = StatsEngine(EngineOptions(force_masked=True, fused=False))
    tensors = [torch.randn(100), torch.tensor([1.0, float("nan"), 3.0])]
    mode = engine.mode_for(torch.device("cpu"))
    with caplog.at_level("WARNING", logger="trainermon"):
        rows = torch.cat(engine._kernel_rows(tensors, mode))
        engine._kernel_rows(tensors, mode)
    check_rows(rows, tensors, True, None, rel=9.6e-7)  # the engine's contract for float32
    assert not triton_stats.enabled()
    assert sum("Triton statistics kernel failed" in r.getMessage() for r in caplog.records) == 1
