"""What flows from the training thread to the background worker and on to the exporters."""

from __future__ import annotations

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
)
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


@dataclass
class StepPayload:
    """A step's statistics on their way to the worker: partials still to be finalised."""

    step: int
    rows: list[RowMeta]
    partials: torch.Tensor  # host tensor [len(rows), NUM_PARTIALS], maybe still being copied
    ready: Any = None  # an event to wait on before reading `partials` (accelerators), else None
    extras: dict[str, float] = field(default_factory=dict)


@dataclass
class StatBatch:
    """A step's finalised statistics, as exporters see them: rows plus one column per statistic."""

    step: int
    rows: list[RowMeta]
    values: dict[str, np.ndarray]
    extras: dict[str, float] = field(default_factory=dict)
