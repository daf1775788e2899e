"""The engine's eager path: partials of a tensor, or of the rows of a 2-D tensor, from torch operations.

It serves whatever no one-pass kernel reads (accelerators without Triton, other dtypes, views with gaps,
the CPU with no native kernel built) and recomputes the rows a kernel found not finite. Each chunk costs a
few kernels: a square, two column sums, an aminmax, float64 sums of 1/RUN of the chunk (and one scaling
pass where no value may be read back). The accuracy contract and its proof are in `engine`'s docstring.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from . import fused
from .partials import DTYPE, MAX, MIN, empty_partials

#: Elements per chunk on the CPU (eager path): measured fastest (5.7x the floor; 2^18: 7.9x, 2^22: 9.5x).
CHUNK = 1 << 20
#: Elements per chunk on accelerators (bounds the float32 temporaries of a half-precision chunk).
DEVICE_CHUNK = 1 << 22
#: Elements a float32 accumulator adds before its result moves to float64.
RUN = 16
_HALF = (torch.float16, torch.bfloat16)
#: Largest magnitude whose float32 squares stay finite over a run (16 x 2^124 < 2^128) ...
_BIG = 2.0**62
#: ... and below which squares may underflow float32 enough to matter.
_TINY = 2.0**-40


class Mode(NamedTuple):
    """How one batch is computed: derived from the options and the batch's device."""

    masked: bool  # NaN/Inf counted, the other statistics over finite values, in every computation
    eps: float | None  # count |x| < eps
    branch_free: bool  # never read a value back to decide (accelerators, and the CPU tests of their path)
    chunk: int
    #: with `masked`: only NaN is counted and left out; infinities are values (`ops` without `infs`)
    nan_only: bool = False


def recompute_nonfinite(out: torch.Tensor, sources: Sequence[torch.Tensor | None], mode: Mode) -> None:
    """Recompute the rows whose sumsq/sum/min/max are not all finite from `sources[i]` (the plain tensor
    the row was computed from; None: leave the row). CPU only: this reads values back."""
    finite = torch.isfinite(out[:, : MAX + 1]).all(1)
    if bool(finite.all()):
        return
    for i in (~finite).nonzero().flatten().tolist():
        t = sources[i]
        if t is not None and t.numel():
            out[i] = tensor_partials(t, mode)


def flat_pieces(t: torch.Tensor, chunk: int) -> Iterator[torch.Tensor]:
    """Contiguous 1-D pieces of at most `chunk` elements that together hold each element of `t` once.

    A dense tensor (contiguous or permuted) is read as the memory range it fills, without a copy; a view
    with gaps is cut along its outermost dimension and copied one piece at a time."""
    n = t.numel()
    if fused.is_dense(t):
        flat = t.reshape(-1) if t.is_contiguous() else t.as_strided((n,), (1,))
        yield from (flat.split(chunk) if n > chunk else (flat,))
        return
    if n <= chunk:
        yield t.reshape(-1).contiguous()  # a copy of at most one chunk
        return
    dims = [d for d in range(t.dim()) if t.shape[d] > 1]
    dim = max(dims, key=lambda d: t.stride(d))
    per = max(1, chunk // (n // t.shape[dim]))
    for start in range(0, t.shape[dim], per):
        yield from flat_pieces(t.narrow(dim, start, min(per, t.shape[dim] - start)), chunk)


def tensor_partials(t: torch.Tensor, mode: Mode) -> torch.Tensor:
    """One row for a whole tensor, chunk by chunk."""
    if t.numel() == 0:
        return empty_partials(1, t.device)[0]
    parts = [rows_partials(piece.unsqueeze(0), mode) for piece in flat_pieces(t, mode.chunk)]
    if len(parts) == 1:
        return parts[0][0]
    stacked = torch.cat(parts)
    row = stacked.sum(0)
    row[MIN] = stacked[:, MIN].amin()
    row[MAX] = stacked[:, MAX].amax()
    return row


def rows_partials(x: torch.Tensor, mode: Mode) -> torch.Tensor:
    """Float64 partials of each row of a contiguous 2-D tensor [k, m] (k tensors of m elements, or one
    chunk with k = 1)."""
    if x.dtype in _HALF:
        x = x.float()  # a chunk-sized temporary, never the whole tensor
    elif x.dtype != torch.float32:
        x = x.to(DTYPE)  # float64 itself, integers and bools are reduced in float64
    x = x.contiguous()  # `_sums` views rows of RUN consecutive elements (a no-op for every caller's chunks)
    k, m = x.shape
    nans = infs = None
    if mode.masked:
        if mode.nan_only:  # "finite" here: the kept elements, NaN-free; Inf is a value, its count stays 0
            finite = ~torch.isnan(x)
            n_finite = finite.sum(1)
            nans = m - n_finite
        else:
            finite = torch.isfinite(x)
            n_finite = finite.sum(1)
            nans = torch.isnan(x).sum(1)
            infs = m - n_finite - nans
        xs = torch.where(finite, x, 0.0)
        mn, mx = _minmax(torch.where(finite, x, float("inf")), torch.where(finite, x, float("-inf")))
    else:
        xs = x
        mn, mx = _minmax(x, x)
    sumsq, total = _sums(xs, mn, mx, mode.branch_free)
    zeros = None
    if mode.eps is not None:
        zeros = (xs.abs() < mode.eps).sum(1)
        if mode.masked:
            zeros = zeros - (m - n_finite)  # masked-out entries were set to 0; do not count them
    none = torch.zeros((k,), dtype=DTYPE, device=x.device)
    cols = [sumsq, total, mn, mx, none if nans is None else nans, none if infs is None else infs]
    cols.append(none if zeros is None else zeros)
    return torch.stack([c.to(DTYPE) for c in cols], dim=1)


_local = threading.local()


def _scratch(like: torch.Tensor) -> torch.Tensor:
    """A temporary shaped like `like`: on the CPU from a per-thread buffer, because a fresh chunk-sized
    allocation per chunk costs more in page faults than the arithmetic (accelerator allocators cache)."""
    if like.device.type != "cpu":
        return torch.empty_like(like)
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < like.numel() or buf.dtype != like.dtype:
        with torch.inference_mode(False):  # made under inference_mode, no later call could write it
            buf = _local.buf = torch.empty(max(like.numel(), CHUNK), dtype=like.dtype)
    return buf[: like.numel()].view(like.shape)


def _minmax(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row minima of `low` and maxima of `high` ([k, m]); one row is reduced whole, which torch does many
    times faster than a row-wise reduction of one row."""
    if low.shape[0] == 1:
        if low is high:
            mn, mx = torch.aminmax(low)
            return mn.reshape(1), mx.reshape(1)
        return low.amin().reshape(1), high.amax().reshape(1)
    return low.amin(1), high.amax(1)


def _sums(
    x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, branch_free: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 (sum of squares, sum) of each row of a contiguous [k, m] float32 or float64 tensor whose
    row minima and maxima are `mn` and `mx`, with no float32 accumulator adding more than RUN terms and
    no float32 square overflowing or underflowing (the bound in the module docstring).

    Each row's first RUN x width elements are viewed as RUN rows of `width` and reduced across those RUN
    rows (at most RUN terms per column, in whatever order torch adds them, and a column-wise reduction is
    as fast as a flat one); the `width` column results are added in float64, as is the tail."""
    if x.dtype == DTYPE:
        return (x * x).sum(1), x.sum(1)
    amax = torch.maximum(-mn, mx)
    scale = None
    if not branch_free:
        extreme = (amax >= _BIG) | ((amax > 0) & (amax < _TINY))
        wide_rows = extreme.nonzero().flatten().tolist() if bool(extreme.any()) else []
    else:
        # No host read on accelerators: every row is scaled by a power of two (exact) that brings its
        # largest magnitude to [0.5, 1), so that no square can overflow or underflow; one extra pass.
        exponent = torch.frexp(torch.where(torch.isfinite(amax), amax, 0.0))[1].clamp(-126, 127)
        scale = torch.ldexp(torch.ones_like(amax), -exponent)
        x = x * scale.unsqueeze(1)
        wide_rows = []
    k, m = x.shape
    width = m // RUN
    whole = width * RUN
    sumsq = torch.zeros((k,), dtype=DTYPE, device=x.device)
    total = torch.zeros((k,), dtype=DTYPE, device=x.device)
    if width:
        square = torch.mul(x, x, out=_scratch(x))  # one rounding per square
        view = ((k, RUN, width), (m, width, 1))
        total = x.as_strided(*view).sum(1).to(DTYPE).sum(1)
        sumsq = square.as_strided(*view).sum(1).to(DTYPE).sum(1)
    if whole < m:
        rest = x[:, whole:].to(DTYPE)
        total = total + rest.sum(1)
        sumsq = sumsq + (rest * rest).sum(1)
    for i in wide_rows:  # CPU: rows of extreme magnitude, again in float64
        wide = x[i].to(DTYPE)
        sumsq[i] = torch.dot(wide, wide)
        total[i] = wide.sum()
    if scale is not None:
        inverse = scale.to(DTYPE).reciprocal()
        total = total * inverse
        sumsq = sumsq * inverse * inverse
    return sumsq, total
