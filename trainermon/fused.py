"""The native one-pass CPU kernel (`trainermon/_fused.c`), when it was built and this CPU has its SIMD.

`rows(tensors, out)` writes (sumsq, sum, min, max, 0, 0, 0) for each tensor in one read of its bytes
and one call for the whole batch, releasing the GIL while it runs; it is single-threaded. Only dense CPU
tensors (contiguous or permuted, see `is_dense`) of the dtypes in `DTYPES` qualify; the engine sends
every other tensor through its eager-torch path. A NaN is skipped by min/max here but propagates through
the sums, so callers must recompute any row whose four values are not all finite (`StatsEngine` does).

Set TRAINERMON_FUSED=0 to turn the kernel off (the engine then uses eager torch everywhere).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

logger = logging.getLogger("trainermon")

try:
    from trainermon import _fused as _native
except ImportError:  # not compiled (no C compiler at install time): eager torch only
    _native = None

_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1}
if _native is not None and _native.HAVE_F16:
    _CODES[torch.float16] = 2

_disabled = os.environ.get("TRAINERMON_FUSED", "1").strip().lower() in ("0", "false", "off", "no")
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


def supports(t: torch.Tensor) -> bool:
    """Whether `rows` can take this tensor (no copy, no conversion of the whole tensor)."""
    return AVAILABLE and t.device.type == "cpu" and t.dtype in _CODES and is_dense(t)


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
    """Fill `out` (float32 [len(tensors), 7], contiguous, CPU) with one row per tensor; return how many
    rows have a non-finite sumsq, sum, min or max (a NaN or Inf in the tensor).

    Every tensor must pass `supports`; this is checked here because the kernel reads raw addresses.
    """
    if not (out.dtype == torch.float32 and out.is_contiguous() and out.device.type == "cpu"):
        raise ValueError("fused.rows: out must be a contiguous float32 CPU tensor")
    if out.shape != (len(tensors), 7):
        raise ValueError(f"fused.rows: out has shape {tuple(out.shape)}, expected ({len(tensors)}, 7)")
    for t in tensors:
        if not supports(t):
            raise ValueError(f"fused.rows: unsupported tensor (dtype {t.dtype}, device {t.device})")
    return rows_unchecked(tensors, out)


def rows_unchecked(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> int:
    """`rows` for callers that already checked `supports` for every tensor and the shape of `out`: dense
    CPU tensors of `DTYPES` (any other layout would make the kernel read the wrong or out-of-bounds
    memory)."""
    return _native.stats(
        [t.data_ptr() for t in tensors],
        [t.numel() for t in tensors],
        [_CODES[t.dtype] for t in tensors],
        out.data_ptr(),
    )
