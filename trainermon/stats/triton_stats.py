"""A fused statistics kernel for CUDA tensors, written in Triton: one read of each tensor for every partial.

The eager device path costs a dozen kernels per chunk (a float32 copy, finite masks, squares, column sums,
an aminmax, a scaling pass), each reading the chunk again. This kernel reads each element once and keeps
all partials in registers, so a batch of gradients costs about what `torch._foreach_norm` costs.

Layout of a call (one per dtype in the batch):
- a small int64 table [3, T + 1] (address, numel and first chunk of each tensor), copied to the device from
  pinned memory without a sync;
- pass 1: one program per chunk of any tensor (it finds its tensor by a binary search of the chunk starts)
  writes one row of partials. Chunks are smaller for small batches, so that a hook's one activation still
  spreads over every multiprocessor (bandwidth needs several programs in flight on each);
- pass 2: one program per tensor merges its chunks' rows into the tensor's row.

Accuracy, the engine's contract (see `engine`): each lane adds RUN = 16 float32 terms, then moves the run's
result into float64 accumulators, so no float32 accumulator adds more than 16 terms (sum within 16u x
sum|x|, sum of squares within 16u relative, u = 2^-24); min and max are exact. A chunk whose float32 result
is not finite (NaN, Inf, or squares that overflow) or whose values are extreme (max |x| above 2^62 or
below 2^-40, where float32 squares overflow or lose precision) is read again in float64, where squares of
float32 values are exact and nothing overflows or underflows; that pass also counts NaN and Inf. So the
second read costs only chunks that hold non-finite or extreme values.

Used by the engine for dense float16/bfloat16/float32 tensors on CUDA when Triton imports; set
TRAINERMON_TRITON=0 to use the eager path. Under TRITON_INTERPRET=1 it also runs on CPU tensors (tests).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from .partials import DTYPE, NUM_PARTIALS, PARTIAL_NAMES

# The kernels write the columns by position.
assert PARTIAL_NAMES == ("sumsq", "sum", "min", "max", "nans", "infs", "zeros")

#: Elements a program reads per load (a power of two), float32 terms per lane before float64, and the
#: largest chunk (a multiple of BLOCK x RUN); the smallest chunk is BLOCK x RUN.
BLOCK = 512
RUN = 16
MAX_CHUNK = 1 << 16
#: Programs per multiprocessor a batch aims for when it picks its chunk size.
PROGRAMS_PER_SM = 8
#: Chunk rows pass 2 merges per step.
MERGE_BLOCK = 128
WARPS = 4
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
logger = logging.getLogger("trainermon")
_broken: list[str] = []  # why the kernel was switched off at run time, once it failed


def enabled() -> bool:
    """Whether the kernel may be used: not switched off, not failed, and Triton imports (checked once)."""
    return not _broken and os.environ.get("TRAINERMON_TRITON", "1") != "0" and _kernels() is not None


def disable(exc: BaseException) -> None:
    """Stop using the kernel in this process after it failed (a Triton that cannot compile for this GPU,
    say): logged once; the engine computes on its eager path from then on."""
    if not _broken:
        _broken.append(repr(exc))
        logger.warning("trainermon: the Triton statistics kernel failed (%r); using the eager path", exc)


def usable(t: torch.Tensor) -> bool:
    """Whether the kernel can read `t`: a non-empty dense float16/bfloat16/float32 tensor."""
    if t.dtype not in DTYPES or t.numel() == 0:
        return False
    if t.is_contiguous():
        return True
    from .fused import is_dense

    return is_dense(t)


def chunk_size(elements: int, device: torch.device) -> int:
    """Elements per program for a batch of `elements`: large enough to amortise a program, small enough
    that the batch gives every multiprocessor PROGRAMS_PER_SM programs."""
    chunk, most = BLOCK * RUN, max(BLOCK * RUN, min(MAX_CHUNK, elements // (PROGRAMS_PER_SM * _sms(device))))
    while chunk * 2 <= most:
        chunk *= 2
    return chunk


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def partials(
    tensors: Sequence[torch.Tensor], masked: bool, eps: float | None, nan_only: bool = False
) -> torch.Tensor:
    """Float64 [len(tensors), NUM_PARTIALS] rows for tensors that are all `usable`, of one dtype and on one
    device, with the eager path's semantics: `masked` counts NaN/Inf and computes the rest over finite
    values (with `nan_only`: counts and leaves out NaN only, Inf being a value and its count 0); otherwise
    sums and min/max propagate NaN/Inf as torch does and the count columns are zero.
    Costs two kernel launches and one small host-to-device copy; no sync."""
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError("triton_stats.partials: Triton is not available")
    dtype, device = tensors[0].dtype, tensors[0].device
    for t in tensors:
        if t.dtype != dtype or t.device != device:
            raise ValueError(f"triton_stats.partials: mixed {dtype}/{t.dtype} or {device}/{t.device}")
    numels = [t.numel() for t in tensors]
    chunk = chunk_size(sum(numels), device)
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + -(-n // chunk))
    count = len(tensors)
    # Dense tensors fill one range starting at data_ptr(), whatever their strides.
    layout = [[t.data_ptr() for t in tensors] + [0], numels + [0], starts]
    if device.type == "cuda":  # from pinned memory: never waits on the device
        table = torch.tensor(layout, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
    else:
        table = torch.tensor(layout, dtype=torch.int64)
    chunks = starts[-1]
    rows = torch.empty((chunks, NUM_PARTIALS), dtype=DTYPE, device=device)
    out = torch.empty((count, NUM_PARTIALS), dtype=DTYPE, device=device)
    search_steps = max(1, count.bit_length())
    search_steps += -search_steps % 4  # a few compiled variants, not one per batch size
    chunk_kernel, merge_kernel, tl_types = kernels
    with _current(device):
        chunk_kernel[(chunks,)](
            table,
            rows,
            count,
            0.0 if eps is None else float(eps),
            DT=tl_types[dtype],
            MASKED=masked,
            NAN_ONLY=masked and nan_only,
            HAS_EPS=eps is not None,
            SEARCH_STEPS=search_steps,
            BLOCK=BLOCK,
            RUN=RUN,
            CHUNK=chunk,
            num_warps=WARPS,
        )
        merge_kernel[(count,)](
            table, rows, out, count, MASKED=masked, NAN_ONLY=masked and nan_only, BLOCK=MERGE_BLOCK
        )
    return out


def _current(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: tensors on another GPU (one process driving several,
    as naive pipeline parallelism does) need theirs made current for the launch."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()  # already current: switching costs two device calls per launch


@functools.cache
def _kernels() -> tuple[Any, Any, dict[torch.dtype, Any]] | None:
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton, or one that fails to load: the eager path serves
        return None

    @triton.jit
    def chunk_kernel(table, rows, count, eps, DT: tl.constexpr, MASKED: tl.constexpr,
                     NAN_ONLY: tl.constexpr, HAS_EPS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                     BLOCK: tl.constexpr, RUN: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
        chunk = tl.program_id(0).to(tl.int64)
        # Which tensor: the last whose first chunk is <= this chunk (table row 2 holds count + 1 starts).
        lo = tl.zeros((), tl.int64)
        hi = lo + count
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            take = tl.load(table + 2 * (count + 1) + mid) <= chunk
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid)
        base = tl.load(table + lo).to(tl.pointer_type(DT))
        numel = tl.load(table + (count + 1) + lo)
        begin = (chunk - tl.load(table + 2 * (count + 1) + lo)) * CHUNK
        lanes = tl.arange(0, BLOCK)
        # Fast pass: float32 runs of RUN terms per lane, each run's result added in float64.
        sumsq = tl.zeros((BLOCK,), tl.float64)
        total = tl.zeros((BLOCK,), tl.float64)
        low = tl.full((BLOCK,), float("inf"), tl.float32)
        high = tl.full((BLOCK,), float("-inf"), tl.float32)
        zeros = tl.zeros((BLOCK,), tl.int32)
        for run in tl.range(0, CHUNK, BLOCK * RUN):
            run_sq = tl.zeros((BLOCK,), tl.float32)
            run_total = tl.zeros((BLOCK,), tl.float32)
            for k in tl.static_range(RUN):
                offs = begin + run + k * BLOCK + lanes
                inside = offs < numel
                x = tl.load(base + offs, mask=inside, other=0.0).to(tl.float32)
                run_sq += x * x
                run_total += x
                low = tl.minimum(low, tl.where(inside, x, float("inf")))
                high = tl.maximum(high, tl.where(inside, x, float("-inf")))
                if HAS_EPS:
                    zeros += (inside & (tl.abs(x) < eps)).to(tl.int32)
            sumsq += run_sq.to(tl.float64)
            total += run_total.to(tl.float64)
        r_sumsq = tl.sum(sumsq, 0)
        r_total = tl.sum(total, 0)
        r_low = tl.min(low, 0).to(tl.float64)
        r_high = tl.max(high, 0).to(tl.float64)
        r_nans = tl.zeros((), tl.float64)
        r_infs = tl.zeros((), tl.float64)
        r_zeros = tl.sum(zeros.to(tl.int64), 0).to(tl.float64)
        big = tl.maximum(tl.abs(r_low), tl.abs(r_high))
        not_finite = (r_sumsq != r_sumsq) | (r_total != r_total) | (r_sumsq == float("inf"))
        not_finite = not_finite | (tl.abs(r_total) == float("inf")) | (big == float("inf"))
        if not_finite | (big > 4.611686018427388e18) | ((big < 9.094947017729282e-13) & (big > 0)):
            # Exact pass (2^62 < max |x|, or 0 < max |x| < 2^-40, or not finite): float64 throughout.
            sumsq = tl.zeros((BLOCK,), tl.float64)
            total = tl.zeros((BLOCK,), tl.float64)
            low = tl.full((BLOCK,), float("inf"), tl.float32)
            high = tl.full((BLOCK,), float("-inf"), tl.float32)
            nans = tl.zeros((BLOCK,), tl.int32)
            infs = tl.zeros((BLOCK,), tl.int32)
            for step in tl.range(0, CHUNK, BLOCK):
                offs = begin + step + lanes
                inside = offs < numel
                x = tl.load(base + offs, mask=inside, other=0.0).to(tl.float32)
                is_nan = x != x
                is_inf = tl.abs(x) == float("inf")
                nans += is_nan.to(tl.int32)
                infs += is_inf.to(tl.int32)
                if NAN_ONLY:  # Inf is a value (the merge writes its count as 0)
                    keep = inside & ~is_nan
                    v = tl.where(keep, x, 0.0).to(tl.float64)
                elif MASKED:
                    keep = inside & ~is_nan & ~is_inf
                    v = tl.where(keep, x, 0.0).to(tl.float64)
                else:
                    keep = inside & ~is_nan  # NaN rows get NaN min/max in pass 2
                    v = x.to(tl.float64)
                sumsq += v * v
                total += v
                low = tl.minimum(low, tl.where(keep, x, float("inf")))
                high = tl.maximum(high, tl.where(keep, x, float("-inf")))
            r_sumsq = tl.sum(sumsq, 0)
            r_total = tl.sum(total, 0)
            r_low = tl.min(low, 0).to(tl.float64)
            r_high = tl.max(high, 0).to(tl.float64)
            r_nans = tl.sum(nans.to(tl.int64), 0).to(tl.float64)
            r_infs = tl.sum(infs.to(tl.int64), 0).to(tl.float64)
        row = rows + chunk * 7
        tl.store(row + 0, r_sumsq)
        tl.store(row + 1, r_total)
        tl.store(row + 2, r_low)
        tl.store(row + 3, r_high)
        tl.store(row + 4, r_nans)
        tl.store(row + 5, r_infs)
        tl.store(row + 6, r_zeros)

    @triton.jit
    def merge_kernel(table, rows, out, count, MASKED: tl.constexpr, NAN_ONLY: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        first = tl.load(table + 2 * (count + 1) + t)
        last = tl.load(table + 2 * (count + 1) + t + 1)
        lanes = tl.arange(0, BLOCK)
        sumsq = tl.zeros((BLOCK,), tl.float64)
        total = tl.zeros((BLOCK,), tl.float64)
        low = tl.full((BLOCK,), float("inf"), tl.float64)
        high = tl.full((BLOCK,), float("-inf"), tl.float64)
        nans = tl.zeros((BLOCK,), tl.float64)
        infs = tl.zeros((BLOCK,), tl.float64)
        zeros = tl.zeros((BLOCK,), tl.float64)
        for start in tl.range(first, last, BLOCK):
            idx = start + lanes
            inside = idx < last
            row = rows + idx * 7
            sumsq += tl.load(row + 0, mask=inside, other=0.0)
            total += tl.load(row + 1, mask=inside, other=0.0)
            low = tl.minimum(low, tl.load(row + 2, mask=inside, other=float("inf")))
            high = tl.maximum(high, tl.load(row + 3, mask=inside, other=float("-inf")))
            nans += tl.load(row + 4, mask=inside, other=0.0)
            infs += tl.load(row + 5, mask=inside, other=0.0)
            zeros += tl.load(row + 6, mask=inside, other=0.0)
        n_nan = tl.sum(nans, 0)
        lo_v = tl.min(low, 0)
        hi_v = tl.max(high, 0)
        dst = out + t * 7
        tl.store(dst + 0, tl.sum(sumsq, 0))
        tl.store(dst + 1, tl.sum(total, 0))
        tl.store(dst + 6, tl.sum(zeros, 0))
        if MASKED:
            tl.store(dst + 2, lo_v)
            tl.store(dst + 3, hi_v)
            tl.store(dst + 4, n_nan)
            if NAN_ONLY:  # Inf is a value: not counted
                tl.store(dst + 5, 0.0)
            else:
                tl.store(dst + 5, tl.sum(infs, 0))
        else:  # torch's semantics: any NaN makes min and max NaN; no counts
            nan = float("nan")
            tl.store(dst + 2, tl.where(n_nan > 0, nan, lo_v))
            tl.store(dst + 3, tl.where(n_nan > 0, nan, hi_v))
            tl.store(dst + 4, 0.0)
            tl.store(dst + 5, 0.0)

    types = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
    return chunk_kernel, merge_kernel, types
