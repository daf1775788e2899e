"""The statistics engine: partial statistics (see `partials`) of batches of tensors, on their device.

Accuracy contract, on every path and device, for any data, length (up to 1e9 elements), layout, grouping
and order (tests/unit/test_engine_accuracy.py checks it on adversarial inputs). With u = 2^-24:

- float32, bf16 and fp16 tensors: the sum of squares within 16u (9.6e-7) relative, so `norm` within 4.8e-7
  relative; the sum within 16u x sum|x|, so `mean` within 9.6e-7 x rms of the exact mean (rms = norm /
  sqrt(numel) bounds mean |x|); `min`, `max`, NaN, Inf and zero counts exact. float64 tensors: relative
  1e-10. Integers and bools: reduced in float64, exact up to 2^53.
- Why: no float32 accumulator ever adds more than RUN = 16 terms, and any order of adding k terms errs
  by at most (k - 1) roundings of their magnitudes (one more for the rounded squares). The native kernel
  adds float32 runs of 16 per lane into double lanes (`_fused.c`); the eager path views each chunk as 16
  rows and reduces across them, then adds the column results in float64. float64 additions contribute at
  most chunk x 2^-53 (3e-11). Squares never overflow or underflow float32: the kernel sums blocks of
  extreme magnitude in float64, the eager path does so for such rows on the CPU and, where it may not read
  a value back to decide (accelerators), scales every chunk by an exact power of two first.

Costs: on the CPU, dense (contiguous or permuted) float32/bf16/fp16 tensors go to the native kernel
(`fused`): one read of each tensor, one call for the whole batch. On CUDA with Triton, the same tensors go
to the Triton kernel (`triton_stats`): one read of each tensor, two launches per dtype in the batch (1.24x
`torch._foreach_norm` over an H200's gradients; the eager path below took 132x). Everywhere else (NPU, other
dtypes, views with gaps, or no kernel built) each chunk of at most CHUNK (CPU) or DEVICE_CHUNK elements
costs a few kernels: a square, two column sums, an aminmax, float64 sums of 1/16 of the chunk (and one
scaling pass on accelerators); small tensors (at most GROUP_MAX elements) of one dtype and size are stacked
and reduced row-wise, so that hundreds of biases cost a few kernels. Nothing copies a whole tensor (a view
with gaps is copied one chunk at a time), and nothing reads a value back to the host except on the CPU,
where it costs no sync.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import fused, triton_stats
from .kinds import Readable, Unreadable, readable
from .partials import DTYPE, MAX, MIN, NUM_PARTIALS, empty_partials, scale_and_pad

logger = logging.getLogger("trainermon")

#: Elements per chunk on the CPU (eager path): measured fastest (5.7x the floor; 2^18: 7.9x, 2^22: 9.5x).
CHUNK = 1 << 20
#: Elements per chunk on accelerators (bounds the float32 temporaries of a half-precision chunk).
DEVICE_CHUNK = 1 << 22
#: Tensors of at most this many elements are stacked (per dtype and size) and reduced row-wise.
GROUP_MAX = 1 << 13
#: Elements a float32 accumulator adds before its result moves to float64.
RUN = 16
_HALF = (torch.float16, torch.bfloat16)
_ROW_BYTES = NUM_PARTIALS * 8  # one float64 row of partials
#: Largest magnitude whose float32 squares stay finite over a run (16 x 2^124 < 2^128) ...
_BIG = 2.0**62
#: ... and below which squares may underflow float32 enough to matter.
_TINY = 2.0**-40


@dataclass(frozen=True)
class EngineOptions:
    """What the engine computes. Derived from the config once; cheap to pass around."""

    nonfinite: bool = True  # count NaN/Inf and compute the other statistics over finite values only
    zeros_eps: float | None = None  # count |x| < eps when set
    #: Force the branch-free masked path everywhere (the accelerator path); used by tests on CPU.
    force_masked: bool = False
    #: Use the native one-pass CPU kernel where it is built; tests turn it off to check the eager path.
    fused: bool = True


class _Mode(NamedTuple):
    """How one batch is computed: derived from the options and the batch's device."""

    masked: bool  # NaN/Inf counted, the other statistics over finite values, in every computation
    eps: float | None  # count |x| < eps
    branch_free: bool  # never read a value back to decide (accelerators, and the CPU tests of their path)
    chunk: int


class StatsEngine:
    """Computes partial statistics of batches of tensors. `calls` counts batches (tests read it)."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.calls = 0
        # One reusable chunk-sized staging buffer per dtype for stacking small tensors on the CPU: a fresh
        # 4 MiB allocation per block costs more in page faults than the reductions themselves.
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        self._lock = threading.Lock()
        # The last `kernel_row` table (checked once, kept so that its id is not reused) and its layout
        self._table: torch.Tensor | None = None
        self._table_rows = 0
        self._table_address = 0

    def compute(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Float64 [len(tensors), NUM_PARTIALS] partials on the device of the first tensor; a tensor that
        cannot be read (see `kinds`) gets a row of NaN. All tensors must be on one device."""
        partials, _ = self.compute_rows(tensors)
        return partials

    def compute_rows(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[int, Unreadable]]:
        """`compute`, plus {row: why} for the tensors that could not be read (their rows are NaN)."""
        self.calls += 1
        with torch.no_grad():  # activations may require grad; statistics never join the graph
            return self._compute(tensors)

    def writes_rows_directly(self) -> bool:
        """Whether `kernel_row` may be used: the kernel is built and computes these options."""
        opts = self.options
        return opts.fused and fused.AVAILABLE and opts.zeros_eps is None and not opts.force_masked

    def kernel_row(self, t: torch.Tensor, out: torch.Tensor, row: int) -> bool:
        """Write `t`'s partials into `out[row]` now with one native kernel call (the values of
        `compute_rows([t])`), or return False, writing nothing, when the kernel cannot read `t`. `out`: a
        contiguous float64 CPU [n, NUM_PARTIALS] table, never resized in place once used here (its layout
        is checked when it is first seen). ~2 us of Python instead of ~15 us: a hook can read its tensor
        while it is in cache rather than hold it for a batch. Costs one read, no sync."""
        plan = fused.plan(t)
        if plan is None or not plan[1]:
            return False
        if out is not self._table:
            self._check_table(out)
        if not 0 <= row < self._table_rows:
            raise ValueError(f"kernel_row: row {row} of a table of shape {tuple(out.shape)}")
        self.calls += 1
        if fused.run_one(plan, self._table_address + row * _ROW_BYTES):
            mode = _Mode(self.options.nonfinite, None, False, CHUNK)
            with torch.no_grad():  # an activation may require grad
                _recompute_nonfinite(out[row : row + 1], (t,), mode)
        return True

    def _check_table(self, out: torch.Tensor) -> None:
        """Check a `kernel_row` table once and keep its address: the kernel writes raw memory there."""
        if out.dtype is not DTYPE or not out.is_cpu or not out.is_contiguous():
            raise ValueError(
                f"kernel_row: needs a contiguous float64 CPU table, got {out.dtype} on {out.device}"
            )
        if out.dim() != 2 or out.shape[1] != NUM_PARTIALS:
            raise ValueError(f"kernel_row: table of shape {tuple(out.shape)}")
        self._table, self._table_rows, self._table_address = out, len(out), out.data_ptr()

    def mode_for(self, device: torch.device) -> _Mode:
        """How a batch on `device` is computed under these options."""
        opts = self.options
        branch_free = device.type != "cpu" or opts.force_masked
        chunk = CHUNK if device.type == "cpu" else DEVICE_CHUNK
        return _Mode(opts.nonfinite and branch_free, opts.zeros_eps, branch_free, chunk)

    def _compute(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[int, Unreadable]]:
        n = len(tensors)
        device = _device_of(tensors)
        opts = self.options
        mode = self.mode_for(device)
        branch_free, eps = mode.branch_free, mode.eps
        use_fused = not branch_free and eps is None and opts.fused and fused.AVAILABLE
        use_triton = device.type == "cuda" and opts.fused and triton_stats.enabled()
        by_kernel: dict[torch.dtype, list[int]] = {}  # rows for the Triton kernel, per dtype
        if use_fused:
            fast = _all_kernel(tensors, n, opts.nonfinite)
            if fast is not None:
                return fast, {}
        out = empty_partials(n, device)
        skipped: dict[int, Unreadable] = {}
        items: list[Readable | None] = [None] * n  # what the eager path reads (kernel rows need none)
        kernel: list[int] = []
        plans: list[tuple[int, int, int]] = []
        groups: dict[tuple[torch.dtype, int], list[int]] = {}
        blocks: list[torch.Tensor] = []
        order: list[int] = []
        for i, t in enumerate(tensors):
            if use_fused:
                plan = fused.plan(t)  # the common case: a dense CPU float tensor, one read by the kernel
                if plan is not None:
                    if plan[1]:
                        kernel.append(i)
                        plans.append(plan)
                    continue
            try:
                item = items[i] = readable(t)
            except Unreadable as exc:
                skipped[i] = exc
                continue
            numel = item.tensor.numel()
            if numel == 0:
                continue
            if use_triton and triton_stats.usable(item.tensor):
                by_kernel.setdefault(item.tensor.dtype, []).append(i)
            elif numel <= GROUP_MAX:
                groups.setdefault((item.tensor.dtype, numel), []).append(i)
            else:
                blocks.append(_tensor_partials(item.tensor, mode).unsqueeze(0))
                order.append(i)
        for (dtype, numel), members in groups.items():
            per_block = max(1, mode.chunk // numel)
            for start in range(0, len(members), per_block):
                part = members[start : start + per_block]
                flats = [items[j].tensor.reshape(-1) for j in part]
                if device.type == "cpu":
                    with self._lock:  # the staging buffer is shared; CPU kernels finish before we return
                        rows = torch.stack(flats, out=self._stage(dtype, len(part) * numel).view(-1, numel))
                        blocks.append(_rows_partials(rows, mode))
                else:
                    blocks.append(_rows_partials(torch.stack(flats), mode))
                order.extend(part)
        for members in by_kernel.values():
            blocks.extend(self._kernel_rows([items[j].tensor for j in members], mode))
            order.extend(members)
        not_finite = 0
        if kernel:
            block = torch.empty((len(kernel), NUM_PARTIALS), dtype=DTYPE)
            not_finite = fused.run(plans, block)
            blocks.insert(0, block)
            order[:0] = kernel
        if blocks:
            rows = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
            if order == list(range(n)):
                out = rows
            else:
                index = torch.tensor(order, dtype=torch.long)
                if device.type != "cpu":
                    index = index.pin_memory().to(device, non_blocking=True)  # never waits on the device
                out.index_copy_(0, index, rows)
        if opts.nonfinite and not mode.masked:
            # Rows from the fast paths whose values are not all finite are recomputed masked (NaN/Inf
            # counted, the rest over finite values). The native kernel counts its own such rows, so when
            # it computed everything and found none, the check is skipped.
            if len(kernel) < len(order) or not_finite:
                sources = [item.tensor if item is not None else None for item in items]
                for i in kernel:
                    sources[i] = tensors[i]
                _recompute_nonfinite(out, sources, mode._replace(masked=True))
        elif kernel and not_finite:
            # NaN counting off: the kernel's min/max skip NaN; recompute with torch's propagating semantics.
            sources = [None] * n
            for i in kernel:
                sources[i] = tensors[i]
            _recompute_nonfinite(out, sources, mode)
        for i in skipped:
            out[i] = float("nan")
        for i, item in enumerate(items):
            if item is not None and (item.multiplicity != 1 or item.implicit_zeros):
                scale_and_pad(out[i], item.multiplicity, item.implicit_zeros, eps is not None)
        return out, skipped

    def _kernel_rows(self, tensors: list[torch.Tensor], mode: _Mode) -> list[torch.Tensor]:
        """Rows of a batch of one dtype from the Triton kernel; from the eager path if it fails."""
        try:
            return [triton_stats.partials(tensors, mode.masked, mode.eps)]
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile here must not lose the rows
            triton_stats.disable(exc)
            return [_tensor_partials(t, mode).unsqueeze(0) for t in tensors]

    def _stage(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._staging.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, CHUNK), dtype=dtype)
            self._staging[dtype] = buf
        return buf[:numel]


def _all_kernel(tensors: Sequence[torch.Tensor], n: int, nonfinite: bool) -> torch.Tensor | None:
    """The common case of a hook's batch: every tensor dense, non-empty and read by the kernel. One
    allocation and one kernel call, no identity-row fill or reordering (the general path's ~40 us of
    per-call Python on top of the kernel). None when any tensor needs the general path."""
    plans = []
    for t in tensors:
        plan = fused.plan(t)
        if plan is None or not plan[1]:
            return None
        plans.append(plan)
    out = torch.empty((n, NUM_PARTIALS), dtype=DTYPE)
    not_finite = fused.run(plans, out)
    if not_finite:
        if nonfinite:
            _recompute_nonfinite(out, tensors, _Mode(True, None, False, CHUNK))
        else:  # the kernel's min/max skip NaN: recompute with torch's propagating semantics
            _recompute_nonfinite(out, tensors, _Mode(False, None, False, CHUNK))
    return out


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            return t.device
    return torch.device("cpu")


def _recompute_nonfinite(out: torch.Tensor, sources: Sequence[torch.Tensor | None], mode: _Mode) -> None:
    """Recompute the rows whose sumsq/sum/min/max are not all finite from `sources[i]` (the plain tensor
    the row was computed from; None: leave the row). CPU only: this reads values back."""
    finite = torch.isfinite(out[:, : MAX + 1]).all(1)
    if bool(finite.all()):
        return
    for i in (~finite).nonzero().flatten().tolist():
        t = sources[i]
        if t is not None and t.numel():
            out[i] = _tensor_partials(t, mode)


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


def _tensor_partials(t: torch.Tensor, mode: _Mode) -> torch.Tensor:
    """One row for a whole tensor, chunk by chunk."""
    if t.numel() == 0:
        return empty_partials(1, t.device)[0]
    parts = [_rows_partials(piece.unsqueeze(0), mode) for piece in flat_pieces(t, mode.chunk)]
    if len(parts) == 1:
        return parts[0][0]
    stacked = torch.cat(parts)
    row = stacked.sum(0)
    row[MIN] = stacked[:, MIN].amin()
    row[MAX] = stacked[:, MAX].amax()
    return row


def _rows_partials(x: torch.Tensor, mode: _Mode) -> torch.Tensor:
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
