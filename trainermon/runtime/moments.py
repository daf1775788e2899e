"""Which optimizer-state tensors `mv_distribution` writes, and under which family names.

A family is the optimizer's own state key, so rows say what they are:

    Adam, AdamW, NAdam, RAdam, SparseAdam, FusedAdam, DeepSpeedCPUAdam   exp_avg, exp_avg_sq
                                                                         (+ max_exp_avg_sq with amsgrad)
    Adamax                  exp_avg, exp_inf
    SGD, Muon               momentum_buffer (SGD: only with momentum != 0)
    Adagrad                 sum
    RMSprop                 square_avg (+ momentum_buffer with momentum, grad_avg when centered)
    Adadelta                square_avg, acc_delta
    Rprop                   prev, step_size
    ASGD                    ax
    Adafactor               row_var and col_var (a factored parameter, >= 2-D: the row and column
                            second-moment factors, each its own row with its own shape), variance (1-D)
    Lion                    exp_avg

Optimizer classes are matched by name along their MRO (subclasses inherit; third-party classes need no
import). Any other optimizer is reported under the keys of its state that hold tensors of the
parameter's shape, found in its state once it has some (at `set_monitor` or after its first update).
When nothing matches, one warning names the optimizer and this list. The keys are decided from the
optimizer's class and hyperparameters, the same on every rank (sharded rows must line up for the packed
reduction), except for unknown optimizers found from their state.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("trainermon")

_ADAM = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
STATE_KEYS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("Adam", "AdamW", "NAdam", "RAdam", "SparseAdam", "FusedAdam", "DeepSpeedCPUAdam"), _ADAM
    ),
    "Adamax": ("exp_avg", "exp_inf"),
    "SGD": ("momentum_buffer",),
    "Muon": ("momentum_buffer",),
    "Adagrad": ("sum",),
    "RMSprop": ("square_avg", "momentum_buffer", "grad_avg"),
    "Adadelta": ("square_avg", "acc_delta"),
    "Rprop": ("prev", "step_size"),
    "ASGD": ("ax",),
    "Adafactor": ("row_var", "col_var", "variance"),
    "Lion": ("exp_avg",),
}

#: Keys that exist only under a hyperparameter: (group key, test of its value). A key is kept when some
#: param group has that hyperparameter and passes the test (an optimizer without it never makes the key).
_CONDITIONS = {
    "momentum_buffer": ("momentum", lambda v: v != 0),
    "grad_avg": ("centered", bool),
    "max_exp_avg_sq": ("amsgrad", bool),
}

SUPPORTED = (
    "Adam-family exp_avg/exp_avg_sq, Adamax exp_inf, SGD (with momentum) and Muon momentum_buffer, "
    "Adagrad sum, RMSprop square_avg/momentum_buffer/grad_avg, Adadelta square_avg/acc_delta, Rprop "
    "prev/step_size, ASGD ax, Adafactor row_var/col_var/variance, Lion exp_avg; other optimizers: "
    "state tensors of the parameter's shape"
)


def state_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers holding the state behind a framework optimizer: itself, `.optimizer` of a
    wrapper (DeepSpeed's ZeRO, Megatron's), each of Megatron's `chained_optimizers`."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "param_groups"):
        if "_optimizer_step_pre_hooks" in vars(optimizer):  # initialised as a torch optimizer
            return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained:
        return [o for inner in chained for o in state_optimizers(inner)]
    inner = getattr(optimizer, "optimizer", None)
    return [] if inner is None or inner is optimizer else state_optimizers(inner)


def _documented(opt: torch.optim.Optimizer) -> tuple[str, ...] | None:
    for cls in type(opt).__mro__:
        keys = STATE_KEYS.get(cls.__name__)
        if keys is not None:
            return tuple(
                k for k in keys if k not in _CONDITIONS or any(_applies(k, g) for g in opt.param_groups)
            )
    return None


def _applies(key: str, group: dict) -> bool:
    hyper, test = _CONDITIONS[key]
    return hyper in group and bool(test(group[hyper]))


def _from_state(opt: torch.optim.Optimizer) -> tuple[str, ...]:
    """Keys of tensors shaped like their parameter, in the order the state first shows them."""
    keys: dict[str, None] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape:
                    keys[key] = None
    return tuple(keys)


class MomentKeys:
    """The state keys to write for this run's optimizer (`keys`, decided once, or after the first update
    for an unknown optimizer whose state is still empty); warns once when there are none."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizers = state_optimizers(optimizer)
        self.name = " + ".join(dict.fromkeys(type(o).__name__ for o in self.optimizers)) or (
            type(optimizer).__name__ if optimizer is not None else "none"
        )
        self.keys: tuple[str, ...] | None = None
        self.warned = False
        self._decide(after_update=False)

    def _decide(self, after_update: bool) -> None:
        if not self.optimizers:
            self.keys = ()
            return
        keys: dict[str, None] = {}
        for opt in self.optimizers:
            documented = _documented(opt)
            if documented is None:
                if not opt.state and not after_update:
                    return  # unknown, no state yet: decided after its first update
                documented = _from_state(opt)
            keys.update(dict.fromkeys(documented))
        self.keys = tuple(keys)

    def for_step(self) -> tuple[str, ...]:
        """The keys to read after this step's update."""
        if self.keys is None:
            self._decide(after_update=True)
            self.warn_if_none()
        return self.keys or ()

    def warn_if_none(self) -> None:
        if self.keys == () and not self.warned:
            self.warned = True
            if self.name == "none":
                what = "no optimizer was given to set_monitor"
            elif not self.optimizers:
                what = f"no torch optimizer found in {self.name}"
            else:
                what = f"{self.name} with these hyperparameters keeps no state to write"
            logger.warning(
                "trainermon: mv_distribution writes nothing: %s. Supported: %s",
                what,
                SUPPORTED,
            )
