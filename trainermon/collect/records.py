"""What flows from the training thread to the background worker and on to the exporters.

A submitted `StepPayload` is immutable (frozen, tuples): the worker reads it while training goes on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # annotations only: the offline tools import this module without torch or numpy
    import numpy as np
    import torch

#: Families in the order their hooks run within a step (used for output ordering and docs).
FAMILIES = (
    "actv",
    "actv_grad",
    "grad_unreduced",
    "grad_reduced",
    "param_origin",
    "exp_avg",
    "exp_avg_sq",
    "param_updated",
    "comm",
    "update",
    "moe_load",
    "attn_logit",
)
#: mv_distribution's families beyond Adam's: other optimizers' state keys (`runtime.moments.STATE_KEYS`).
STATE_FAMILIES = (
    "max_exp_avg_sq",
    "exp_inf",
    "momentum_buffer",
    "sum",
    "square_avg",
    "grad_avg",
    "acc_delta",
    "prev",
    "step_size",
    "ax",
    "row_var",
    "col_var",
    "variance",
    "exp_avg_sq_row",
    "exp_avg_sq_col",
)
#: The config switch that turns each family on (for a section, `cc_distribution` and
#: `attn_logit_distribution`, its `enable`). Used by the CLI's `on --families` and by the warnings about
#: switches that select nothing (`runtime.targets`).
FAMILY_SWITCH = {
    "actv": "xy_distribution",
    "actv_grad": "xy_distribution",
    "grad_unreduced": "wg_distribution",
    "grad_reduced": "wg_distribution",
    "param_origin": "param_distribution",
    "param_updated": "param_distribution",
    **dict.fromkeys(("exp_avg", "exp_avg_sq", *STATE_FAMILIES), "mv_distribution"),
    "comm": "cc_distribution",
    "update": "update_distribution",
    "moe_load": "moe_distribution",
    "attn_logit": "attn_logit_distribution",
}
#: Families whose rows carry a micro_step column (msprobe's layout), besides grad_unreduced with
#: monitor_mbs_grad.
MICRO_STEP_FAMILIES = ("actv", "actv_grad")


class RowMeta(NamedTuple):
    """What one output row describes. A named tuple: built per monitored tensor on the training thread,
    where a frozen dataclass costs several times more to create."""

    family: str
    vpp_stage: int
    name: str
    micro_step: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    #: Where this rank's row holds only a piece of the tensor: which piece ("" = the whole tensor).
    shard: str = ""
    #: `comm` rows: the collective calls this row sums over, and the bytes they moved on this rank.
    calls: int = 0
    nbytes: int = 0


class RowMetaCache:
    """One RowMeta per distinct row, kept across steps, so that a collected step builds no new row
    objects for rows it has seen before. Why: a named tuple is always tracked by the garbage collector,
    and the thousands a step built outlived young collections; their promotion made CPython run full
    collections (~140 ms on a training process's heap) every few collected steps.

    Bounded by the rows steps use, not by the rows ever seen: where shapes change every step (MoE
    experts' token counts), rows pile up (on the many-expert benchmark model, 5186 after 2 steps, 14582
    after 120, +13 MB of RSS where the model alone grew 3.5 MB). Once the cache holds half again a step's
    rows (and 1024 more), `end_step` sets it aside; the next collected step takes back the rows it uses
    (the same objects), and the ones it did not use are dropped at the step after."""

    def __init__(self) -> None:
        self._rows: dict[tuple, RowMeta] = {}
        self._aside: dict[tuple, RowMeta] = {}

    def get(self, fields: tuple) -> RowMeta:
        """The RowMeta of (family, vpp_stage, name, micro_step, shape, dtype, numel, shard, calls, nbytes):
        every field, so that the row itself is its key (a named tuple equals the plain tuple of its fields):
        no second tuple kept per row (~120 bytes each, 0.6 MB on the many-expert model's 5186 rows)."""
        row = self._rows.get(fields)
        if row is None:
            row = self._aside.pop(fields, None) if self._aside else None
            if row is None:
                row = RowMeta(*fields)
            self._rows[row] = row
        return row

    def end_step(self, used: int) -> None:
        """After a collected step that wrote `used` rows."""
        if self._aside:
            self._aside = {}  # rows the step after the setting aside did not use
        elif len(self._rows) > used + max(used // 2, 1024):
            self._aside, self._rows = self._rows, {}

    def __len__(self) -> int:
        return len(self._rows) + len(self._aside)


@dataclass(frozen=True)
class StepScalars:
    """Per-step values known on the training thread, beside the rows. A value may still be a 0-d device
    tensor (a loss scale on the GPU): the worker reads it, never the training thread."""

    loss_scale: float | torch.Tensor | None = None
    optimizer_grad_norm: float | None = None  # the framework optimizer's own norm (Megatron's step())
    #: the optimizer skipped its update (loss-scale overflow); a fused optimizer's: the scaler's found_inf
    #: tensor (non-zero: skipped), which the worker turns into a bool before any sink sees it
    update_skipped: bool | torch.Tensor | None = None
    #: ... but the training loop skipped it itself (no loss scaler's step was called): its Inf/NaN are
    #: anomalies. False for a scaler's skip and for a framework's own (Megatron, DeepSpeed: overflows).
    own_skip: bool = False
    monitor_time_ms: float = 0.0  # the monitor's own time on the training thread this step
    scheduled: bool = True  # the configured families were collected (False: an escalation-only step)
    #: this rank's grad_reduced rows are not the whole model's (DDP's late, unreduced parameters on a rank
    #: that does not write the reduced ones): no global norm rather than theirs alone
    partial_grads: bool = False

    @property
    def scaler_skip(self) -> bool:
        """A loss scaler skipped the update for its overflow: Inf/NaN gradients by design, no anomaly."""
        return bool(self.update_skipped) and not self.own_skip


@dataclass(frozen=True)
class StepPayload:
    """A step's statistics on their way to the worker: partials still to be finalised."""

    step: int
    rows: tuple[RowMeta, ...]
    partials: torch.Tensor  # host tensor [len(rows), NUM_PARTIALS], maybe still being copied
    ready: Any = None  # an event to wait on before reading `partials` (accelerators), else None
    scalars: StepScalars = field(default_factory=StepScalars)
    #: Sum of norm^2 of the grad_reduced rows written by every rank of the job (a host 0-d tensor read
    #: after `ready`), where the model is split over ranks; None: this rank's own rows are the model.
    job_grad_sumsq: Any = None
    #: Extra host rows of the same transfer (cross-rank summaries, packed), and what decodes them.
    tail: Any = None
    tail_meta: Any = None


@dataclass(frozen=True)
class Derived:
    """What the worker derives from a step and from the run so far."""

    #: sqrt of the sum of grad_reduced norm^2 over the written rows (of the whole job where it is split)
    global_grad_norm: float | None = None
    loss_scale: float | None = None
    dropped_rows: int = 0  # cumulative: rows dropped because the queue was full
    monitor_faults: int = 0  # cumulative: failures inside the monitor (caught)
    anomalies_total: Mapping[str, int] = field(default_factory=dict)  # cumulative, by rule


@dataclass(frozen=True)
class StatBatch:
    """A step's finalised statistics, as exporters see them: rows plus one column per statistic."""

    step: int
    rows: tuple[RowMeta, ...] | list[RowMeta]
    values: dict[str, np.ndarray]
    scalars: StepScalars = field(default_factory=StepScalars)
    derived: Derived = field(default_factory=Derived)
    #: Cross-rank summaries of the per-rank families (`collect.xrank.XRankTable`), on the writing rank
    xrank: Any = None


#: Families summarised across ranks (`collect.xrank`): those whose rows are each rank's own values.
XRANK_FAMILIES = ("actv", "actv_grad", "grad_unreduced")
#: Columns of a cross-rank summary row, after its key (family, vpp_stage, name, micro_step, stat).
XRANK_COLUMNS = ("max", "min", "mean", "max_rank", "min_rank", "nans", "infs", "nonfinite_rank", "ranks")
