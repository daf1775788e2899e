"""The statistics engine: partial statistics (see `partials`) of batches of tensors, on their device.

Accuracy contract, on every path and device, for any data, length (up to 1e9 elements), layout, grouping
and order (tests/unit/test_engine_accuracy.py checks it on adversarial inputs). With u = 2^-24:

- float32, bf16 and fp16 tensors: the sum of squares within 16u (9.6e-7) relative, so `norm` within 4.8e-7
  relative; the sum within 16u x sum|x|, so `mean` within 9.6e-7 x rms of the exact mean (rms = norm /
  sqrt(numel) bounds mean |x|); `min`, `max`, NaN, Inf and zero counts exact. float64 tensors: relative
  1e-10 for values within about 1e-154..1e154 in magnitude (their squares are summed in float64, the
  partials' own type: beyond that range `norm` overflows to inf or underflows to 0; mean, min, max and
  the counts stay exact). Integers and bools: reduced in float64, exact up to 2^53.
- Why: no float32 accumulator ever adds more than RUN = 16 terms, and any order of adding k terms errs
  by at most (k - 1) roundings of their magnitudes (one more for the rounded squares). The native kernel
  adds float32 runs of 16 per lane into double lanes (`_fused.c`), and so does the Triton kernel on CUDA
  (`triton_stats`); the eager path views each chunk as 16 rows and reduces across them, then adds the
  column results in float64. float64 additions contribute at most chunk x 2^-53 (3e-11). Squares never
  overflow or underflow float32: both kernels sum blocks of extreme magnitude in float64 (the Triton
  kernel rereads such chunks), the eager path does so for such rows on the CPU and, where it may not read
  a value back to decide (accelerators), scales every chunk by an exact power of two first.

Costs: on the CPU, dense (contiguous or permuted) float32/bf16/fp16 tensors go to the native kernel
(`fused`): one read of each tensor, one call for the whole batch. On CUDA with Triton, the same tensors go
to the Triton kernel (`triton_stats`): one read of each tensor, two launches per dtype in the batch (1.11x
`torch._foreach_norm` over an H100's gradients, 1.24x on an H200; the eager path took 131x). Everywhere
else (NPU, other dtypes, views with gaps, or no kernel built) each chunk of at most CHUNK (CPU) or
DEVICE_CHUNK elements costs a few kernels: a square, two column sums, an aminmax, float64 sums of 1/16 of
the chunk (and one scaling pass on accelerators); small tensors (at most GROUP_MAX elements) of one dtype
and size are stacked and reduced row-wise, so that hundreds of biases cost a few kernels. Nothing copies a
whole tensor (a view with gaps is copied one chunk at a time), and nothing reads a value back to the host
except on the CPU, where it costs no sync.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import fused, triton_stats
from .eager import CHUNK, DEVICE_CHUNK, Mode, recompute_nonfinite, rows_partials, tensor_partials
from .kinds import Readable, Unreadable, readable
from .partials import DTYPE, NUM_PARTIALS, empty_partials, scale_and_pad

logger = logging.getLogger("trainermon")

#: Tensors of at most this many elements are stacked (per dtype and size) and reduced row-wise.
GROUP_MAX = 1 << 13
_ROW_BYTES = NUM_PARTIALS * 8  # one float64 row of partials


class CapturingCudaGraph(RuntimeError):
    """Raised instead of computing while the current CUDA stream captures a graph: kernels launched there
    would run only on replays, into buffers nobody reads, and the capture's rows would be uninitialised
    memory. The hook that called is counted as a fault and logged once; the capture goes on."""

    def __init__(self) -> None:
        super().__init__(
            "a CUDA graph is being captured: trainermon computes nothing inside CUDA graphs, and their "
            "replays run no hooks, so the captured modules get no rows while the graph replays"
        )


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph. A flag read where CUDA was never
    initialised; one runtime query otherwise; never a sync."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def check_not_capturing() -> None:
    """Raise `CapturingCudaGraph` while a capture is under way (see `capturing`), whatever the tensors:
    a hook's first tensor may be on the CPU and the next on the GPU."""
    if capturing():
        raise CapturingCudaGraph()


@dataclass(frozen=True)
class EngineOptions:
    """What the engine computes. Derived from the config once; cheap to pass around."""

    nonfinite: bool = True  # count NaN/Inf and compute the other statistics over finite values only
    #: with `nonfinite`: count and leave out NaN only, infinities being values (`ops` without `infs`)
    nan_only: bool = False
    zeros_eps: float | None = None  # count |x| < eps when set
    #: Force the branch-free masked path everywhere (the accelerator path); used by tests on CPU.
    force_masked: bool = False
    #: Use a one-pass kernel where there is one (the native CPU kernel where built, the Triton kernel on
    #: CUDA); tests turn it off to check the eager path.
    fused: bool = True


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
            mode = Mode(self.options.nonfinite, None, False, CHUNK, self.options.nan_only)
            with torch.no_grad():  # an activation may require grad
                recompute_nonfinite(out[row : row + 1], (t,), mode)
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

    def mode_for(self, device: torch.device) -> Mode:
        """How a batch on `device` is computed under these options."""
        opts = self.options
        branch_free = device.type != "cpu" or opts.force_masked
        chunk = CHUNK if device.type == "cpu" else DEVICE_CHUNK
        return Mode(opts.nonfinite and branch_free, opts.zeros_eps, branch_free, chunk, opts.nan_only)

    def _compute(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[int, Unreadable]]:
        n = len(tensors)
        device = _device_of(tensors)
        if device.type == "cuda":
            check_not_capturing()
        opts = self.options
        mode = self.mode_for(device)
        branch_free, eps = mode.branch_free, mode.eps
        use_fused = not branch_free and eps is None and opts.fused and fused.AVAILABLE
        use_triton = device.type == "cuda" and opts.fused and triton_stats.enabled()
        by_kernel: dict[torch.dtype, list[int]] = {}  # rows for the Triton kernel, per dtype
        if use_fused:
            fast = _all_kernel(tensors, n, opts.nonfinite, opts.nan_only)
            if fast is not None:
                return fast, {}
        elif use_triton and n:
            fast = _all_triton(tensors, mode)
            if fast is not None:
                return fast, {}
            use_triton = triton_stats.enabled()  # off if the short path's call just failed
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
                blocks.append(tensor_partials(item.tensor, mode).unsqueeze(0))
                order.append(i)
        for (dtype, numel), members in groups.items():
            per_block = max(1, mode.chunk // numel)
            for start in range(0, len(members), per_block):
                part = members[start : start + per_block]
                flats = [items[j].tensor.reshape(-1) for j in part]
                if device.type == "cpu":
                    with self._lock:  # the staging buffer is shared; CPU kernels finish before we return
                        rows = torch.stack(flats, out=self._stage(dtype, len(part) * numel).view(-1, numel))
                        blocks.append(rows_partials(rows, mode))
                else:
                    blocks.append(rows_partials(torch.stack(flats), mode))
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
        if blocks and order == list(range(n)):
            # every row computed, in order: no identity rows to fill (on a GPU, three launches fewer)
            out = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        else:
            out = empty_partials(n, device)
            if blocks:
                rows = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
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
                recompute_nonfinite(out, sources, mode._replace(masked=True))
        elif kernel and not_finite:
            # NaN counting off: the kernel's min/max skip NaN; recompute with torch's propagating semantics.
            sources = [None] * n
            for i in kernel:
                sources[i] = tensors[i]
            recompute_nonfinite(out, sources, mode)
        for i in skipped:
            out[i] = float("nan")
        for i, item in enumerate(items):
            if item is not None and (item.multiplicity != 1 or item.implicit_zeros):
                scale_and_pad(out[i], item.multiplicity, item.implicit_zeros, eps is not None)
        return out, skipped

    def _kernel_rows(self, tensors: list[torch.Tensor], mode: Mode) -> list[torch.Tensor]:
        """Rows of a batch of one dtype from the Triton kernel; from the eager path if it fails."""
        try:
            return [triton_stats.partials(tensors, mode.masked, mode.eps, mode.nan_only)]
        except torch.cuda.OutOfMemoryError:
            raise  # a passing shortage: the hook counts it; the kernel stays on
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile here must not lose the rows
            triton_stats.disable(exc)
            return [tensor_partials(t, mode).unsqueeze(0) for t in tensors]

    def _stage(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._staging.get(dtype)
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):  # made under inference_mode, no later call could write it
                buf = torch.empty(max(numel, CHUNK), dtype=dtype)
            self._staging[dtype] = buf
        return buf[:numel]


def _all_kernel(
    tensors: Sequence[torch.Tensor], n: int, nonfinite: bool, nan_only: bool = False
) -> torch.Tensor | None:
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
            recompute_nonfinite(out, tensors, Mode(True, None, False, CHUNK, nan_only))
        else:  # the kernel's min/max skip NaN: recompute with torch's propagating semantics
            recompute_nonfinite(out, tensors, Mode(False, None, False, CHUNK))
    return out


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _all_triton(tensors: Sequence[torch.Tensor], mode: Mode) -> torch.Tensor | None:
    """The common case of a hook's batch on CUDA: plain dense tensors of one dtype the Triton kernel reads.
    One kernel call with no per-tensor bookkeeping (the general path took 30 us more per call on an H100's
    host: 177 against 147 us). None when any tensor needs the general path, or when the kernel fails (it
    is then off)."""
    first = tensors[0]
    if type(first) not in _PLAIN or first.dtype not in triton_stats.DTYPES:
        return None
    dtype, device = first.dtype, first.device
    for t in tensors:
        if (
            type(t) not in _PLAIN
            or t.dtype is not dtype
            or t.layout is not torch.strided
            or t.is_nested
            or t.is_neg()
            or not t.is_contiguous()
            or t.numel() == 0
            or t.device != device
        ):
            return None
    try:
        return triton_stats.partials(tensors, mode.masked, mode.eps, mode.nan_only)
    except torch.cuda.OutOfMemoryError:
        raise  # a passing shortage: the hook counts it; the kernel stays on
    except Exception as exc:  # noqa: BLE001 - the general path computes the rows on the eager path
        triton_stats.disable(exc)
        return None


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            return t.device
    return torch.device("cpu")
