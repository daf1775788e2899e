"""The native one-pass CPU kernel (trainermon/stats/_fused.c) against float64 references, at the sizes where
its vector loop, its float32 runs, its scalar tail and its 4 Ki-element blocks meet, and with NaN/Inf in each
of those parts. The accuracy contract itself is tested on every path in test_engine_accuracy.py."""

from __future__ import annotations

import math
import os
import platform
import shutil
import subprocess

import pytest
import torch

from tests.helpers import ref_stats
from trainermon.stats import NUM_PARTIALS, EngineOptions, StatsEngine, engine, fused

# Around every edge of the kernel's loops: groups of 16 and 32 elements, runs of 16 groups of 32 (512), a
# group of 16 left after the groups of 32, blocks of 4096
SIZES = [1, 7, 15, 16, 17, 31, 32, 33, 48, 63, 255, 256, 257, 271, 511, 512, 528, 4080, 4095, 4096, 4097]
SIZES += [4096 + 48, 8192 + 5, 1_000_003]
DTYPES = sorted(fused.DTYPES, key=str) if fused.AVAILABLE else []


def _cpu_has_simd() -> bool:
    if platform.machine() in ("aarch64", "arm64"):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def test_kernel_is_built_where_it_can_be():
    """With a C compiler at install time and an AVX2/NEON CPU, the kernel must be there: otherwise every
    other test here would quietly test nothing."""
    if not (shutil.which("cc") or shutil.which("gcc")) or not _cpu_has_simd():
        pytest.skip(f"no C compiler or no AVX2/NEON here; kernel: {fused.KIND}")
    if os.environ.get("TRAINERMON_FUSED", "1") == "0":
        pytest.skip("this run checks the eager path (TRAINERMON_FUSED=0)")
    assert fused.AVAILABLE, f"native kernel unavailable: {fused.KIND}"
    assert fused.KIND in ("avx2", "neon")
    assert torch.float32 in fused.DTYPES and torch.bfloat16 in fused.DTYPES


needs_kernel = pytest.mark.skipif(not fused.AVAILABLE, reason=f"native kernel: {fused.KIND}")


def _rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    out = torch.full((len(tensors), NUM_PARTIALS), -7.0, dtype=torch.float64)
    fused.rows(tensors, out)
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_match_float64_at_every_boundary(dtype):
    torch.manual_seed(0)
    tensors = [(torch.randn(n) * 3 - 0.5).to(dtype) for n in SIZES]
    out = _rows(tensors)
    for i, t in enumerate(tensors):
        x = t.double()
        # The kernel's bound (see _fused.c): 16 x 2^-24 of the sum of magnitudes, for both sums.
        assert out[i, 0].item() == pytest.approx(float((x * x).sum()), rel=9.6e-7), (dtype, t.numel())
        tol = 9.6e-7 * float(x.abs().sum())
        assert abs(out[i, 1].item() - float(x.sum())) <= tol, t.numel()
        assert out[i, 2].item() == float(x.min()) and out[i, 3].item() == float(x.max()), t.numel()
        assert out[i, 4:].tolist() == [0.0, 0.0, 0.0]


@needs_kernel
def test_sums_of_a_16m_tensor_are_accurate():
    """Float32 runs of 16 per lane, added in double: far tighter than any float32 accumulator."""
    torch.manual_seed(1)
    t = torch.rand(1 << 24) + 0.5  # all positive: the sum has no cancellation to hide errors
    out = _rows([t])
    x = t.double()
    assert out[0, 0].item() == pytest.approx(float((x * x).sum()), rel=9.6e-7)
    assert out[0, 1].item() == pytest.approx(float(x.sum()), rel=9.6e-7)


@needs_kernel
@pytest.mark.parametrize("where", [0, 9, 4095, 4096, 5000, 8204], ids=lambda w: f"at{w}")
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_nonfinite_values_never_leave_a_row_looking_finite(where, bad):
    """A NaN is skipped by the min/max instructions but must reach the sums; an Inf must show somewhere.
    The engine recomputes exactly the rows that are not all finite."""
    t = torch.randn(8192 + 13)
    t[where] = float(bad)
    row = _rows([t])[0, :4]
    assert not bool(torch.isfinite(row).all())
    if bad == "nan":
        assert math.isnan(row[0].item()) and math.isnan(row[1].item())
    # The kernel's own count of rows that are not all finite, which lets the engine skip its check.
    out = torch.empty(4, NUM_PARTIALS, dtype=torch.float64)
    batch = [torch.randn(100), t, torch.randn(5000), t.bfloat16()]
    assert fused.rows(batch, out) == 2
    assert fused.rows(batch[::2], out[:2]) == 0
    huge = torch.full((10,), 1e30)  # finite values whose squares overflow float32: summed in double
    assert fused.rows([huge], out[:1]) == 0
    assert out[0, 0].item() == pytest.approx(10 * float(huge[0]) ** 2, rel=1e-12)


@needs_kernel
@pytest.mark.parametrize("nonfinite", [True, False], ids=["nan-counting", "propagating"])
def test_engine_checks_finiteness_only_when_needed(monkeypatch, nonfinite):
    """A batch the kernel handled alone, all finite: no finiteness pass. A NaN, or rows from another
    path: the check runs and recomputes the bad rows."""
    calls = []
    real = engine.recompute_nonfinite

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(engine, "recompute_nonfinite", spy)
    stats = StatsEngine(EngineOptions(nonfinite=nonfinite))
    clean = [torch.randn(300), torch.randn(64, 64)]
    stats.compute(clean)
    assert calls == []
    bad = [torch.randn(300), torch.randn(64, 64)]
    bad[1][3, 3] = float("nan")
    out = stats.compute(bad)
    assert calls == [1]
    if nonfinite:
        assert out[1, 4].item() == 1  # counted, and the rest over the finite values
        assert out[1, 3].item() == pytest.approx(float(bad[1].nan_to_num(-99).max()))
    else:
        assert math.isnan(out[1, 2].item()) and math.isnan(out[1, 3].item())
    stats.compute([torch.randn(300), torch.randn(10).double()])  # a float64 row: not from the kernel
    assert calls == [1, 1] if nonfinite else calls == [1]


@needs_kernel
@pytest.mark.parametrize("nonfinite", [True, False], ids=["nan-counting", "propagating"])
def test_engine_results_equal_the_eager_path(nonfinite):
    """Same rows from the kernel and from eager torch, including the NaN/Inf semantics of each mode."""
    torch.manual_seed(2)
    tensors = [torch.randn(n) for n in (5, 300, 5000, 70_000)]
    tensors[1][17] = float("nan")
    tensors[2][4999] = float("inf")
    tensors[3][:] = float("-inf")
    tensors.append(torch.randn(40, 40).bfloat16())
    native = StatsEngine(EngineOptions(nonfinite=nonfinite)).compute(tensors)
    eager = StatsEngine(EngineOptions(nonfinite=nonfinite, fused=False)).compute(tensors)
    torch.testing.assert_close(native, eager, rtol=2e-6, atol=1e-6, equal_nan=True)
    if nonfinite:
        assert native[1, 4].item() == 1 and native[2, 5].item() == 1 and native[3, 5].item() == 70_000
        ref = ref_stats(tensors[1])
        assert native[1, 2].item() == pytest.approx(ref["min"])
        assert native[1, 3].item() == pytest.approx(ref["max"])
    else:
        assert math.isnan(native[1, 2].item()) and math.isnan(native[1, 3].item())  # torch's amin/amax


@needs_kernel
def test_engine_sends_only_qualifying_tensors_to_the_kernel(monkeypatch):
    seen: list[list[int]] = []
    real = fused.run

    def spy(plans, out):
        seen.append([address for address, _, _ in plans])
        return real(plans, out)

    monkeypatch.setattr(fused, "run", spy)
    base = torch.randn(64, 32)
    half = torch.randn(3).half()
    permuted = torch.randn(2, 3, 4, 5).permute(0, 2, 3, 1)  # dense, in another order: read as it lies
    tensors = [base, base[:, ::2], torch.randn(10).double(), torch.arange(9), torch.empty(0), half, permuted]
    out = StatsEngine(EngineOptions()).compute(tensors)
    assert len(seen) == 1  # one call for the whole batch
    expected = [base] + ([half] if torch.float16 in fused.DTYPES else []) + [permuted]
    assert seen[0] == [t.data_ptr() for t in expected]
    for i, t in enumerate(tensors):
        if t.numel():
            x = t.double()
            assert out[i, 0].item() == pytest.approx(float(x.square().sum()), rel=1e-6), i
            assert abs(out[i, 1].item() - float(x.sum())) <= 1e-6 * float(x.abs().sum()), i
            assert (out[i, 2].item(), out[i, 3].item()) == (float(x.min()), float(x.max())), i


@pytest.mark.parametrize(
    "make, dense",
    [
        (lambda: torch.randn(6, 7), True),
        (lambda: torch.randn(6, 7).t(), True),
        (lambda: torch.randn(2, 3, 4).permute(2, 0, 1), True),
        (lambda: torch.randn(1, 5, 1, 3).transpose(0, 3), True),  # size-1 dims have arbitrary strides
        (lambda: torch.randn(6, 7)[:, 1:], False),
        (lambda: torch.randn(6, 7)[::2], False),
        (lambda: torch.randn(7).expand(3, 7), False),
        (lambda: torch.randn(4, 4).diagonal(), False),
    ],
)
def test_is_dense(make, dense):
    t = make()
    assert fused.is_dense(t) is dense
    if dense:  # the claim behind it: the elements are exactly one gap-free range from data_ptr()
        n = t.numel()
        flat = torch.as_strided(t, (n,), (1,), t.storage_offset())
        assert sorted(flat.tolist()) == sorted(t.flatten().tolist())


@needs_kernel
def test_rows_rejects_what_the_kernel_cannot_read():
    out = torch.empty(1, NUM_PARTIALS, dtype=torch.float64)
    with pytest.raises(ValueError, match="unsupported tensor"):
        fused.rows([torch.randn(8, 8)[:, ::2]], out)  # gaps: raw reads would see other values
    with pytest.raises(ValueError, match="unsupported tensor"):
        fused.rows([torch.randn(1).expand(100)], out)  # stride 0: raw reads would run out of bounds
    with pytest.raises(ValueError, match="unsupported tensor"):
        fused.rows([torch.randn(8).double()], out)
    with pytest.raises(ValueError, match="expected"):
        fused.rows([torch.randn(8)], torch.empty(2, NUM_PARTIALS, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64"):
        fused.rows([torch.randn(8)], torch.empty(1, NUM_PARTIALS))
    freed = torch.randn(64)
    freed.untyped_storage().resize_(0)  # what FSDP does to unsharded parameters: the address is gone
    neg = torch._neg_view(torch.randn(8))  # the sign lives in a bit the raw memory does not show

    class Sub(torch.Tensor):
        pass

    for t in (freed, neg, torch.randn(8).as_subclass(Sub), torch.nn.Parameter(torch.randn(8))):
        assert fused.supports(t) is (type(t) is torch.nn.Parameter), type(t)


TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/ (this file is in tests/unit/)
HARNESS = os.path.join(TESTS, "native", "kernel_check.c")
KERNEL = os.path.join(os.path.dirname(TESTS), "trainermon", "stats", "_fused.c")


@pytest.mark.parametrize("arch", ["native", "aarch64"])
def test_kernel_bound_in_c_on_each_architecture(arch, tmp_path):
    """The kernel's C code, compiled on its own with a long-double reference harness: natively (AVX2 here),
    and for aarch64 (its NEON path) run under qemu, where the cross compiler and qemu are installed
    (`.ci/run` installs them; the test says so when they are missing)."""
    if arch == "native":
        cc, runner = shutil.which("cc") or shutil.which("gcc"), []
        if cc is None:
            pytest.skip("no C compiler")
    else:
        cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
        if cc is None or qemu is None:
            pytest.skip(
                "aarch64-linux-gnu-gcc and qemu-aarch64 are not installed (apt-get install "
                "gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)"
            )
        runner = [qemu]
    exe = tmp_path / f"kernel_check_{arch}"
    flags = ["-O2", "-std=c11", "-DTM_STANDALONE"] + (["-static"] if arch != "native" else [])
    subprocess.run([cc, *flags, "-o", str(exe), HARNESS, KERNEL, "-lm"], check=True, capture_output=True)
    proc = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    if proc.returncode == 2:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert ", 0 failed" in proc.stdout and ("neon" in proc.stdout) == (arch == "aarch64"), proc.stdout


@needs_kernel
@pytest.mark.parametrize("nonfinite", [True, False], ids=["nan-counting", "propagating"])
def test_kernel_row_equals_compute_rows(nonfinite):
    """`kernel_row` (one tensor, written at a row of the caller's table, what hooks use) gives exactly the
    row `compute_rows` gives, NaN/Inf included (a tensor that requires grad, as an activation does, must
    not trip autograd in the recompute), and refuses what the kernel cannot read."""
    torch.manual_seed(3)
    engine = StatsEngine(EngineOptions(nonfinite=nonfinite))
    tensors = [torch.randn(n) for n in (1, 17, 4097, 70_000)]
    tensors[1][3] = float("nan")
    tensors[2][:] = float("inf")
    tensors += [torch.randn(8, 9, 10).permute(2, 0, 1), torch.randn(33).bfloat16()]
    tensors.append(torch.randn(20, requires_grad=True) * float("nan"))
    table = torch.full((len(tensors) + 2, NUM_PARTIALS), -7.0, dtype=torch.float64)
    calls = engine.calls
    for row, t in enumerate(tensors):
        assert engine.kernel_row(t, table, row + 1)
    assert engine.calls == calls + len(tensors)
    expected = engine.compute(tensors)
    assert torch.equal(table[1:-1].isnan(), expected.isnan())
    assert torch.equal(table[1:-1].nan_to_num(), expected.nan_to_num())
    assert (table[0] == -7.0).all() and (table[-1] == -7.0).all()  # nothing outside its row
    for t in (torch.randn(10).double(), torch.randn(8, 8)[:, ::2], torch.empty(0), torch.arange(4)):
        assert not engine.kernel_row(t, table, 0)
    assert (table[0] == -7.0).all()
    with pytest.raises(ValueError):
        engine.kernel_row(tensors[0], table, len(table))  # past the end: never a raw write
    with pytest.raises(ValueError):
        engine.kernel_row(tensors[0], table.float(), 0)
    with pytest.raises(ValueError):
        engine.kernel_row(tensors[0], table.t(), 0)
    other = torch.full((3, NUM_PARTIALS), -7.0, dtype=torch.float64)  # another table: checked, then used
    assert engine.kernel_row(tensors[3], other, 2)
    assert torch.equal(other[2], expected[3]) and (other[:2] == -7.0).all()
    assert engine.kernel_row(tensors[3], table, 0) and torch.equal(table[0], expected[3])  # back again
    with pytest.raises(ValueError):
        engine.kernel_row(tensors[0], other, -1)
    x = torch.randn(5)
    with pytest.raises(ValueError):  # the native entry refuses a code it has no reader for
        fused._native.stats_one(x.data_ptr(), 5, 9, other.data_ptr())
    assert fused._native.stats_one(tensors[1].data_ptr(), 17, 0, other.data_ptr()) == 1  # the NaN row
    assert engine.writes_rows_directly()
    assert not StatsEngine(EngineOptions(zeros_eps=1e-6)).writes_rows_directly()
    assert not StatsEngine(EngineOptions(fused=False)).writes_rows_directly()
    assert not StatsEngine(EngineOptions(force_masked=True)).writes_rows_directly()
