"""The native one-pass CPU kernel (`trainermon/stats/_fused.c`), when it was built and this CPU has its SIMD.

`rows(tensors, out)` writes float64 (sumsq, sum, min, max, 0, 0, 0) for each tensor in one read of its bytes
and one call for the whole batch, releasing the GIL while it runs; it is single-threaded. Its accuracy
bound is in the C file's header (and the engine's docstring). Only tensors that pass `supports` reach it:
the kernel reads raw addresses, so anything it cannot read as plain memory (a subclass, a view with a
sign bit, a freed storage, a gap between elements) takes the engine's eager-torch path instead. A NaN is
skipped by min/max here but propagates through the sums, so callers must recompute any row whose four
values are not all finite (`StatsEngine` does).

Set TRAINERMON_FUSED=0 (or false, off, no) to turn the kernel off (the engine then uses eager torch
everywhere). It is read once, when this module is first imported (`from trainermon import TrainerMon`);
unset or empty means on, an unknown value is warned about and means on
(`trainermon.config.env.fused_enabled`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from trainermon.config.env import fused_enabled

from .partials import NUM_PARTIALS

logger = logging.getLogger("trainermon")
if NUM_PARTIALS != 7:  # ROW in _fused.c: the kernel writes rows of 7 partials
    raise ImportError(
        f"trainermon: the native kernel writes 7 partials per row, the engine has {NUM_PARTIALS}"
    )

try:
    from trainermon.stats import _fused as _native
except ImportError:  # not compiled (no C compiler at install time): eager torch only
    _native = None
_stats_one = getattr(_native, "stats_one", None)

_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1}
if _native is not None and _native.HAVE_F16:
    _CODES[torch.float16] = 2
_TENSOR, _PARAMETER, _STRIDED = torch.Tensor, torch.nn.Parameter, torch.strided
_ITEMSIZE = (4, 2, 2)  # by code

_disabled = not fused_enabled()  # the variable's one reader (config.env), read here once, at import
AVAILABLE: bool = _native is not None and _native.SIMD != "none" and not _disabled
#: Which kernel runs: "avx2", "neon", or why none does.
KIND: str = (
    "disabled by TRAINERMON_FUSED"
    if _disabled
    else "not built"
    if _native is None
    else _native.SIMD
    if _native.SIMD != "none"
    else "no SIMD on this CPU"
)

#: Dtypes the kernel reads (float16 only where the CPU converts it in hardware).
DTYPES = frozenset(_CODES)


def plan(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(address, element count, dtype code) when the kernel may read `t`, else None: exactly a plain
    `torch.Tensor` or `Parameter` (a subclass may hold no memory of its own), strided, on the CPU, of a
    kernel dtype, not nested, without a negative bit, dense, at a real address, with a storage that holds
    every element (FSDP frees unsharded parameters with `resize_(0)`). One attribute read each: this runs
    for every tensor of every collected step."""
    cls = type(t)
    if (cls is not _TENSOR and cls is not _PARAMETER) or t.layout is not _STRIDED:
        return None
    code = _CODES.get(t.dtype)
    if code is None or not t.is_cpu or t.is_nested or t.is_neg():
        return None
    n = t.numel()
    if not (t.is_contiguous() or is_dense(t)):
        return None
    try:
        held = t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):  # a wrapper without storage (torch.func transforms)
        return None
    if held < (t.storage_offset() + n) * _ITEMSIZE[code]:
        return None
    ptr = t.data_ptr()
    return (ptr, n, code) if ptr else None  # address 0: a wrapper without memory (functionalization)


def supports(t: torch.Tensor) -> bool:
    """Whether `rows` may read this tensor (see `plan`)."""
    return AVAILABLE and plan(t) is not None and t.numel() > 0


def is_dense(t: torch.Tensor) -> bool:
    """Whether the tensor's elements fill one gap-free memory range starting at `data_ptr()`, in any order
    (contiguous, or a permutation of a contiguous tensor such as an attention transpose). The statistics
    do not depend on element order, so the kernel can read that range as it lies."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def rows(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> int:
    """Fill `out` (float64 [len(tensors), 7], contiguous, CPU) with one row per tensor; return how many
    rows have a non-finite sumsq, sum, min or max (a NaN or Inf in the tensor).

    Every tensor is checked with `supports` here, because the kernel reads raw addresses."""
    if not (out.dtype == torch.float64 and out.is_contiguous() and out.device.type == "cpu"):
        raise ValueError("fused.rows: out must be a contiguous float64 CPU tensor")
    if out.shape != (len(tensors), NUM_PARTIALS):
        raise ValueError(
            f"fused.rows: out has shape {tuple(out.shape)}, expected ({len(tensors)}, {NUM_PARTIALS})"
        )
    for t in tensors:
        if not supports(t):
            raise ValueError(f"fused.rows: unsupported tensor ({type(t).__name__}, dtype {t.dtype})")
    return rows_unchecked(tensors, out)


def rows_unchecked(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> int:
    """`rows` for callers that checked `supports` for every tensor and the shape of `out`."""
    plans = [plan(t) for t in tensors]
    return run([p for p in plans if p is not None], out)


def run(plans: Sequence[tuple[int, int, int]], out: torch.Tensor) -> int:
    """The kernel over `plan` results (each of a tensor with elements), into `out` (float64 [len, 7]).
    Returns how many rows are not all finite."""
    return run_at(plans, out.data_ptr())


def run_one(plan: tuple[int, int, int], address: int) -> int:
    """`run_at` for one tensor's plan: no lists built (~1 us less per call). Returns 1 when the row is not
    all finite. An extension built before this entry existed takes `run_at`."""
    if _stats_one is None:
        return run_at((plan,), address)
    return _stats_one(plan[0], plan[1], plan[2], address)


def run_at(plans: Sequence[tuple[int, int, int]], address: int) -> int:
    """`run`, writing its rows from `address` on (the caller owns len(plans) x 7 float64 there)."""
    return _native.stats([p[0] for p in plans], [p[1] for p in plans], [p[2] for p in plans], address)
