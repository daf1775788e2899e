"""The statistics engine: partial statistics on the tensor's device, exact merging, host finalisation.

Every statistic is a pair (local partial, combiner), so that pieces of one tensor (micro-batches, ZeRO
or FSDP shards, a distributed optimizer's slices) merge exactly:

    partial   combiner   used for
    sumsq     sum        norm = sqrt(sumsq)
    sum       sum        mean = sum / finite count
    min       min        min
    max       max        max
    nans      sum        nans, and the finite count
    infs      sum        infs, and the finite count
    zeros     sum        zeros = fraction with |x| < eps
    numel     sum        kept on the host (shapes are static), never computed on the device

Costs: on the CPU, dense (contiguous or permuted) float32/bf16/fp16 tensors go to the native kernel
(`trainermon.fused`): one read of each tensor, one call for the whole batch, no per-tensor Python beyond
collecting addresses. Everywhere else (accelerators, other dtypes, views with gaps, or no kernel built),
`compute` launches four kernels per chunk of a large tensor (a BLAS dot, a sum, an amin and an amax over
at most CHUNK elements, so the last three read the chunk from cache), writing scalars that are stacked
once per call; small tensors (at most GROUP_MAX elements) of one dtype and size are stacked into
chunk-sized blocks and reduced row-wise, so that hundreds of biases and norm weights cost a few kernels,
not hundreds. Both accumulate in float32 lanes (the kernel adds its 4 Ki-element blocks in double). It
never copies a whole tensor to float64 and never reads a value back to the host, except on the CPU, where
checking for non-finite values costs no device sync.
`reduce_across` is two all-reduces over a process group for any number of rows (one packed SUM, one
packed MAX).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Container, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainermon import fused

logger = logging.getLogger("trainermon")

SUMSQ, SUM, MIN, MAX, NANS, INFS, ZEROS = range(7)
NUM_PARTIALS = 7
PARTIAL_NAMES = ("sumsq", "sum", "min", "max", "nans", "infs", "zeros")
_ADDITIVE = [SUMSQ, SUM, NANS, INFS, ZEROS]
#: Elements per chunk on the CPU. 256 Ki float32 = 1 MiB: the four passes of a chunk (dot, sum, amin,
#: amax) run from L2, which measured fastest on the benchmark machine (1.9x one `_foreach_norm` pass,
#: against 2.6x with 1 Mi chunks); chunked float32 dot products also keep the sum of squares accurate.
CHUNK = 1 << 18
#: Elements per chunk on accelerators: reductions there are memory-bound and accurate tree sums, so the
#: chunk only bounds the float32 temporary of a bf16/fp16 tensor.
DEVICE_CHUNK = 1 << 24
_FAST_DTYPES = (torch.float32, torch.float64)
#: Tensors of at most this many elements are batched: stacked (per dtype and size) into blocks of at most
#: a chunk and reduced row-wise. Measured on the CPU against four kernels per tensor (48 tensors): 4x
#: faster at 4 Ki elements, 25% slower at 16 Ki (the row-wise min/max kernels lose to whole-tensor ones).
GROUP_MAX = 1 << 13

_warned_complex = False


@dataclass(frozen=True)
class EngineOptions:
    """What the engine computes. Derived from the config once; cheap to pass around."""

    nonfinite: bool = True  # count NaN/Inf and compute the other statistics over finite values only
    zeros_eps: float | None = None  # count |x| < eps when set
    #: Force the branch-free masked path everywhere (the accelerator path); used by tests on CPU.
    force_masked: bool = False
    #: Use the native one-pass CPU kernel (`trainermon.fused`) where it is built; tests turn it off to
    #: check the eager path.
    fused: bool = True


def empty_partials(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Identity element of the merge: n rows for tensors (or shards) with no elements."""
    out = torch.zeros((n, NUM_PARTIALS), dtype=torch.float32, device=device)
    out[:, MIN] = math.inf
    out[:, MAX] = -math.inf
    return out


class StatsEngine:
    """Computes partial statistics of batches of tensors. `calls` counts batches (tests read it)."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.calls = 0
        # One reusable chunk-sized staging buffer per dtype for stacking small tensors on the CPU: a fresh
        # 4 MiB allocation per block costs more in page faults than the reductions themselves.
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._zeros: dict[torch.device, torch.Tensor] = {}  # shared zero scalars of the lean path

    def compute(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Return a float32 [len(tensors), NUM_PARTIALS] tensor on the device of the first tensor.

        All tensors must be on one device. No host sync on accelerators; see the module docstring.
        """
        self.calls += 1
        with torch.no_grad():  # activations may require grad; statistics never join the graph
            return self._compute(tensors)

    def _compute(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        n = len(tensors)
        if not n:
            return empty_partials(0)
        device = tensors[0].device
        opts = self.options
        masked_everywhere = opts.nonfinite and (device.type != "cpu" or opts.force_masked)
        eps = opts.zeros_eps
        chunk = CHUNK if device.type == "cpu" else DEVICE_CHUNK
        lean = not masked_everywhere and eps is None
        # Native path: dense CPU tensors of the kernel's dtypes, one read each, one call for all.
        use_fused = lean and opts.fused and fused.AVAILABLE and device.type == "cpu"
        fused_dtypes = fused.DTYPES if use_fused else ()
        fused_order: list[int] = []
        # Lean path, per tensor above GROUP_MAX: seven scalars (four kernels: dot, sum, amin, amax, then
        # three shared zeros), stacked once at the end. No per-tensor allocation or Python bookkeeping.
        scalars: list[torch.Tensor] = []
        singles: list[int] = []
        full_rows: list[torch.Tensor] = []  # [k, NUM_PARTIALS] blocks (masked, zeros-counting, grouped)
        full_order: list[int] = []
        groups: dict[tuple[torch.dtype, int], list[int]] = {}
        zeros = (self._zero(device),) * (NUM_PARTIALS - 4) if lean else ()
        for i, t in enumerate(tensors):
            numel = t.numel()
            if numel == 0:
                continue
            if t.dtype in fused_dtypes and fused.is_dense(t):
                fused_order.append(i)
            elif numel <= GROUP_MAX and not t.is_complex():
                groups.setdefault((t.dtype, numel), []).append(i)
            elif lean and not t.is_complex():
                scalars += _lean_scalars(t.detach().reshape(-1), chunk)
                scalars += zeros
                singles.append(i)
            else:
                full_rows.append(_tensor_partials(t, masked_everywhere, eps, chunk).unsqueeze(0))
                full_order.append(i)
        for (dtype, numel), members in groups.items():
            # Small tensors of one dtype and size are stacked (one chunk-sized copy) so that a few row-wise
            # kernels replace a handful of kernels and Python calls per tensor.
            per_block = max(1, chunk // numel)
            for start in range(0, len(members), per_block):
                part = members[start : start + per_block]
                flats = [tensors[j].reshape(-1) for j in part]
                if device.type == "cpu":
                    with self._lock:  # the staging buffer is shared; CPU kernels finish before we return
                        rows = torch.stack(flats, out=self._stage(dtype, len(part) * numel).view(-1, numel))
                        full_rows.append(_rows_partials(rows, masked_everywhere, eps))
                else:
                    full_rows.append(_rows_partials(torch.stack(flats), masked_everywhere, eps))
                full_order.extend(part)
        if singles:
            block = torch.stack(scalars).view(-1, NUM_PARTIALS)
            full_rows.insert(0, block if block.dtype == torch.float32 else block.float())
            full_order[:0] = singles
        # Rows from other paths than the kernel; the kernel itself counts its rows that are not all
        # finite, so its rows need no finiteness pass below when that count is 0.
        unchecked = len(full_order)
        fused_not_finite = 0
        if fused_order:
            block = torch.empty((len(fused_order), NUM_PARTIALS), dtype=torch.float32)
            fused_not_finite = fused.rows_unchecked([tensors[i] for i in fused_order], block)
            full_rows.insert(0, block)
            full_order[:0] = fused_order
        if not full_rows:
            out = empty_partials(n, device)  # only empty tensors: the merge identity
        elif len(full_order) == n and full_order == list(range(n)):
            out = torch.cat(full_rows) if len(full_rows) > 1 else full_rows[0]
        else:
            out = empty_partials(n, device)  # rows of empty tensors stay the merge identity
            index = torch.tensor(full_order, dtype=torch.long)
            if device.type != "cpu":
                # Pinned and non-blocking: building the index never waits on the device.
                index = index.pin_memory().to(device, non_blocking=True)
            out.index_copy_(0, index, torch.cat(full_rows) if len(full_rows) > 1 else full_rows[0])
        if opts.nonfinite and not masked_everywhere:
            # Find tensors whose fast-pass values are not all finite and recompute only those with the
            # masked path (NaN/Inf counted, the rest over finite values). The sums are checked too: the
            # native kernel's min/max skip a NaN that the sums carry.
            if unchecked or fused_not_finite != 0:
                self._recompute_nonfinite(out, tensors, range(n), True, eps, chunk)
        elif fused_order and fused_not_finite != 0:
            # NaN counting off: non-finite rows of the native kernel are recomputed with torch's
            # propagating semantics, so that min/max are NaN exactly as on the eager path.
            self._recompute_nonfinite(out, tensors, fused_order, False, eps, chunk)
        return out

    @staticmethod
    def _recompute_nonfinite(
        out: torch.Tensor,
        tensors: Sequence[torch.Tensor],
        rows: Container[int],
        masked: bool,
        eps: float | None,
        chunk: int,
    ) -> None:
        """Recompute, among `rows`, those whose sumsq/sum/min/max are not all finite."""
        finite = torch.isfinite(out[:, : MAX + 1]).all(1)
        if bool(finite.all()):
            return
        for i in (~finite).nonzero().flatten().tolist():
            if i in rows and tensors[i].numel():
                out[i] = _tensor_partials(tensors[i], masked, eps, chunk)

    def _zero(self, device: torch.device) -> torch.Tensor:
        zero = self._zeros.get(device)
        if zero is None:
            zero = self._zeros[device] = torch.zeros((), dtype=torch.float32, device=device)
        return zero

    def _stage(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._staging.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, CHUNK), dtype=dtype)
            self._staging[dtype] = buf
        return buf[:numel]


def _as_flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    # A non-contiguous tensor (a transposed activation) is flattened with a transient copy.
    return t.reshape(-1)


def _lean_scalars(flat: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
    """(sumsq, sum, min, max) of a flat tensor as four scalars: per chunk a BLAS dot, a sum, an amin and an
    amax, the last three reading the chunk from cache."""
    fast = flat.dtype in _FAST_DTYPES
    if flat.numel() <= chunk:
        x = flat if fast else flat.float()  # bf16/fp16/int/bool: a chunk-sized float32 copy
        return torch.dot(x, x), x.sum(), x.amin(), x.amax()
    dots, sums, mins, maxs = [], [], [], []
    for x in flat.split(chunk):
        if not fast:
            x = x.float()
        dots.append(torch.dot(x, x))
        sums.append(x.sum())
        mins.append(x.amin())
        maxs.append(x.amax())
    return (
        torch.stack(dots).sum(),
        torch.stack(sums).sum(),
        torch.stack(mins).amin(),
        torch.stack(maxs).amax(),
    )


def _tensor_partials(
    t: torch.Tensor, masked: bool, zeros_eps: float | None, chunk: int = CHUNK
) -> torch.Tensor:
    global _warned_complex
    if t.numel() == 0:
        return empty_partials(1, t.device)[0]
    if t.is_complex():
        if not _warned_complex:
            logger.warning("trainermon: complex tensors are not supported; their statistics are NaN")
            _warned_complex = True
        return torch.full((NUM_PARTIALS,), math.nan, device=t.device)
    flat = _as_flat(t)
    chunks = flat.split(chunk) if flat.numel() > chunk else (flat,)
    parts = [_rows_partials(c.unsqueeze(0), masked, zeros_eps) for c in chunks]
    if len(parts) == 1:
        return parts[0][0]
    stacked = torch.cat(parts)
    return torch.stack(
        [
            stacked[:, SUMSQ].sum(),
            stacked[:, SUM].sum(),
            stacked[:, MIN].amin(),
            stacked[:, MAX].amax(),
            stacked[:, NANS].sum(),
            stacked[:, INFS].sum(),
            stacked[:, ZEROS].sum(),
        ]
    )


def _rows_partials(x: torch.Tensor, masked: bool, zeros_eps: float | None) -> torch.Tensor:
    """Partials of each row of a 2-D tensor [k, m] (k tensors of m elements, or one chunk with k = 1)."""
    if x.dtype not in _FAST_DTYPES:
        x = x.float()  # bf16/fp16/int/bool: a chunk-sized float32 temporary, never the whole tensor
    k, m = x.shape
    if masked:
        finite = torch.isfinite(x)
        n_finite = finite.sum(1)
        nans = torch.isnan(x).sum(1)
        infs = m - n_finite - nans
        xs = torch.where(finite, x, 0.0)
        mn = torch.where(finite, x, math.inf).amin(1)
        mx = torch.where(finite, x, -math.inf).amax(1)
    else:
        xs = x
        nans = infs = None
        if k == 1:
            mn, mx = torch.aminmax(x[0])  # one pass; the row-wise variant is slower on the CPU
            mn, mx = mn.reshape(1), mx.reshape(1)
        else:
            mn, mx = x.amin(1), x.amax(1)
    if k == 1:
        sumsq = torch.dot(xs[0], xs[0]).reshape(1)  # BLAS, no temporary
    else:
        sumsq = torch.linalg.vector_norm(xs, dim=1).square()
    total = xs.sum(1)
    zeros = None
    if zeros_eps is not None:
        zeros = (xs.abs() < zeros_eps).sum(1)
        if masked:
            zeros = zeros - (m - n_finite)  # masked-out entries were set to 0; do not count them
    missing = x.new_zeros((k,), dtype=torch.float32) if nans is None or zeros is None else None
    cols = [
        sumsq,
        total,
        mn,
        mx,
        missing if nans is None else nans,
        missing if infs is None else infs,
        missing if zeros is None else zeros,
    ]
    return torch.stack([c.to(torch.float32) for c in cols], dim=1)


def merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Combine partials of two disjoint pieces (row by row)."""
    out = a.clone()
    out[:, _ADDITIVE] += b[:, _ADDITIVE]
    out[:, MIN] = torch.minimum(a[:, MIN], b[:, MIN])
    out[:, MAX] = torch.maximum(a[:, MAX], b[:, MAX])
    return out


def reduce_across(partials: torch.Tensor, group=None) -> torch.Tensor:
    """Merge each row's partials across the ranks of `group` (two all-reduces, any number of rows).

    Every rank must pass the same rows in the same order; a rank that holds no piece of a tensor
    passes `empty_partials` for its row.
    """
    import torch.distributed as dist

    additive = partials[:, _ADDITIVE].contiguous()
    # A NaN min/max (NaN counting off) must survive the merge, but MAX reductions may drop NaN (gloo
    # does): it travels as a flag column in the same reduction, its slot set to the identity.
    mx, neg_mn = partials[:, MAX], -partials[:, MIN]
    nan = torch.isnan(mx) | torch.isnan(neg_mn)
    extremes = torch.stack(
        [mx.masked_fill(nan, -math.inf), neg_mn.masked_fill(nan, -math.inf), nan.to(partials.dtype)], dim=1
    )
    dist.all_reduce(additive, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    merged_nan = extremes[:, 2] > 0
    out = torch.empty_like(partials)
    out[:, _ADDITIVE] = additive
    out[:, MAX] = extremes[:, 0].masked_fill(merged_nan, math.nan)
    out[:, MIN] = (-extremes[:, 1]).masked_fill(merged_nan, math.nan)
    return out


def finalize(partials: np.ndarray, numel: np.ndarray) -> dict[str, np.ndarray]:
    """Turn host partials [N, NUM_PARTIALS] and element counts [N] into the user-facing statistics."""
    p = partials.astype(np.float64, copy=False)
    numel = numel.astype(np.float64, copy=False)
    finite = numel - p[:, NANS] - p[:, INFS]
    with np.errstate(divide="ignore", invalid="ignore"):
        has = finite > 0
        return {
            "norm": np.sqrt(np.maximum(p[:, SUMSQ], 0.0)),
            "mean": np.where(has, p[:, SUM] / np.where(has, finite, 1.0), np.nan),
            "min": np.where(has, p[:, MIN], np.nan),
            "max": np.where(has, p[:, MAX], np.nan),
            "zeros": np.where(numel > 0, p[:, ZEROS] / np.where(numel > 0, numel, 1.0), np.nan),
            "nans": p[:, NANS],
            "infs": p[:, INFS],
            "numel": numel,
        }
