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

Costs: `compute` launches a handful of kernels per tensor (one BLAS dot, one sum, one aminmax per chunk
of at most 1 Mi elements, so the second and third pass hit cache) and accumulates in float32. It never
copies a whole tensor to float64 and never reads a value back to the host, except on the CPU, where
checking for non-finite values costs no device sync. `reduce` is two all-reduces over a process group
for any number of rows (one packed SUM, one packed MAX).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger("trainermon")

SUMSQ, SUM, MIN, MAX, NANS, INFS, ZEROS = range(7)
NUM_PARTIALS = 7
PARTIAL_NAMES = ("sumsq", "sum", "min", "max", "nans", "infs", "zeros")
_ADDITIVE = [SUMSQ, SUM, NANS, INFS, ZEROS]
#: Elements per chunk. 1 Mi float32 = 4 MiB: the three passes of a chunk run from cache, and chunked
#: float32 dot products keep the sum of squares accurate to ~1e-6 relative even for 100M elements.
CHUNK = 1 << 20
_FAST_DTYPES = (torch.float32, torch.float64)

_warned_complex = False


@dataclass(frozen=True)
class EngineOptions:
    """What the engine computes. Derived from the config once; cheap to pass around."""

    nonfinite: bool = True  # count NaN/Inf and compute the other statistics over finite values only
    zeros_eps: float | None = None  # count |x| < eps when set
    #: Force the branch-free masked path everywhere (the accelerator path); used by tests on CPU.
    force_masked: bool = False


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

    def compute(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Return a float32 [len(tensors), NUM_PARTIALS] tensor on the device of the first tensor.

        All tensors must be on one device. No host sync on accelerators; see the module docstring.
        """
        self.calls += 1
        if not tensors:
            return empty_partials(0)
        device = tensors[0].device
        opts = self.options
        masked_everywhere = opts.nonfinite and (device.type != "cpu" or opts.force_masked)
        rows = [_tensor_partials(t, masked_everywhere, opts.zeros_eps) for t in tensors]
        out = torch.stack(rows)
        if opts.nonfinite and not masked_everywhere:
            # On the CPU this check is free: find tensors whose fast-pass min/max are not finite and
            # recompute only those with the masked path (NaN/Inf counted, the rest over finite values).
            bad = ~torch.isfinite(out[:, MIN]) | ~torch.isfinite(out[:, MAX])
            if bool(bad.any()):
                for i in bad.nonzero().flatten().tolist():
                    if tensors[i].numel():
                        out[i] = _tensor_partials(tensors[i], True, opts.zeros_eps)
        return out


def _as_flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    # A non-contiguous tensor (a transposed activation) is flattened with a transient copy.
    return t.reshape(-1)


def _tensor_partials(t: torch.Tensor, masked: bool, zeros_eps: float | None) -> torch.Tensor:
    global _warned_complex
    if t.numel() == 0:
        return empty_partials(1, t.device)[0]
    if t.is_complex():
        if not _warned_complex:
            logger.warning("trainermon: complex tensors are not supported; their statistics are NaN")
            _warned_complex = True
        return torch.full((NUM_PARTIALS,), math.nan, device=t.device)
    flat = _as_flat(t)
    chunks = flat.split(CHUNK) if flat.numel() > CHUNK else (flat,)
    parts = [_chunk_partials(c, masked, zeros_eps) for c in chunks]
    if len(parts) == 1:
        return parts[0]
    stacked = torch.stack(parts)
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


def _chunk_partials(x: torch.Tensor, masked: bool, zeros_eps: float | None) -> torch.Tensor:
    if x.dtype not in _FAST_DTYPES:
        x = x.float()  # bf16/fp16/int/bool: a chunk-sized float32 temporary, never the whole tensor
    zero = x.new_zeros(())
    if masked:
        finite = torch.isfinite(x)
        nans = torch.isnan(x).sum().to(torch.float32)
        infs = (x.numel() - finite.sum() - nans).to(torch.float32)
        xs = torch.where(finite, x, zero)
        mn = torch.where(finite, x, math.inf).amin()
        mx = torch.where(finite, x, -math.inf).amax()
    else:
        xs = x
        nans = infs = zero.float()
        mn, mx = torch.aminmax(x)
    sumsq = torch.dot(xs, xs)
    total = xs.sum()
    zeros = (xs.abs() < zeros_eps).sum() if zeros_eps is not None else zero
    if zeros_eps is not None and masked:
        zeros = zeros - (x.numel() - finite.sum())  # masked-out entries were set to 0; do not count them
    return torch.stack(
        [
            sumsq.float(),
            total.float(),
            mn.float(),
            mx.float(),
            nans.float(),
            infs.float(),
            zeros.float(),
        ]
    )


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
    extremes = torch.stack([partials[:, MAX], -partials[:, MIN]], dim=1).contiguous()
    dist.all_reduce(additive, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    out = torch.empty_like(partials)
    out[:, _ADDITIVE] = additive
    out[:, MAX] = extremes[:, 0]
    out[:, MIN] = -extremes[:, 1]
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
