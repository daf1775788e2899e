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
    transformers' Adafactor exp_avg_sq_row and exp_avg_sq_col (factored, >= 2-D), exp_avg_sq (1-D),
                            exp_avg (with beta1)

Optimizer classes are matched by name along their MRO (subclasses inherit; third-party classes need no
import); where two packages use one name for different state, by package and name first. A documented
optimizer whose state, after an update, holds none of its keys (another class of the same name) is
said once and reported from its state as an unknown one would be. Any other optimizer is reported
under the keys of its state that hold tensors of the parameter's shape, found in its state once it has
some (at `set_monitor` or after its first update).
When nothing matches, one warning names the optimizer and this list. The keys are decided from the
optimizer's class and hyperparameters, the same on every rank (sharded rows must line up for the packed
reduction), except for unknown optimizers found from their state; the conditional ones again on each
collected step from the hyperparameters (add_param_group, load_state_dict change them). Parameter-shaped
state tensors under other keys are named once in a warning, not written (keys found mid-run from a rank's
own state could differ between ranks).
torch's ZeroRedundancyOptimizer: the keys of its local optimizer (`.optim`), from its class only (its
state is on each parameter's owning rank alone); read by `adapters/zero_redundancy.py`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("trainermon")


def is_zero_redundancy(optimizer: Any) -> bool:
    """torch's ZeroRedundancyOptimizer (or a subclass), matched by class name along the MRO: no import
    of torch.distributed.optim (a look at a few class names, at set_monitor)."""
    return any(cls.__name__ == "ZeroRedundancyOptimizer" for cls in type(optimizer).__mro__)


def overlapped(optimizer: Any) -> bool:
    """ZeroRedundancyOptimizer's `overlap_with_ddp=True`: its local optimizer runs from DDP's
    communication hook (its state is not read)."""
    return bool(getattr(optimizer, "_overlap_with_ddp", False))


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

#: Classes whose name another package's class also has, with other state: (top-level package, name).
QUALIFIED_KEYS: dict[tuple[str, str], tuple[str, ...]] = {
    ("transformers", "Adafactor"): ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg"),
}

#: Keys that exist only under a hyperparameter: (group key, test of its value). A key is kept when some
#: param group has that hyperparameter and passes the test (an optimizer without it never makes the key).
_CONDITIONS = {
    "momentum_buffer": ("momentum", lambda v: v != 0),
    "grad_avg": ("centered", bool),
    "max_exp_avg_sq": ("amsgrad", bool),
}
_QUALIFIED_CONDITIONS = {("transformers", "Adafactor"): {"exp_avg": ("beta1", lambda v: v is not None)}}

SUPPORTED = (
    "Adam-family exp_avg/exp_avg_sq, Adamax exp_inf, SGD (with momentum) and Muon momentum_buffer, "
    "Adagrad sum, RMSprop square_avg/momentum_buffer/grad_avg, Adadelta square_avg/acc_delta, Rprop "
    "prev/step_size, ASGD ax, Adafactor row_var/col_var/variance, Lion exp_avg, transformers' Adafactor "
    "exp_avg_sq_row/exp_avg_sq_col/exp_avg_sq/exp_avg; other optimizers: "
    "state tensors of the parameter's shape"
)


def state_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers holding the state behind a framework optimizer: itself, `.optimizer` of a
    wrapper (DeepSpeed's ZeRO, Megatron's), each of Megatron's `chained_optimizers`."""
    if optimizer is None:
        return []
    if is_zero_redundancy(optimizer):  # its own .state stays empty: the state is in its local optimizer
        local = getattr(optimizer, "optim", None)
        return [local] if isinstance(local, torch.optim.Optimizer) and not overlapped(optimizer) else []
    if isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "param_groups"):
        if "_optimizer_step_pre_hooks" in vars(optimizer):  # initialised as a torch optimizer
            return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained:
        return [o for inner in chained for o in state_optimizers(inner)]
    inner = getattr(optimizer, "optimizer", None)
    return [] if inner is None or inner is optimizer else state_optimizers(inner)


def _class_keys(opt: torch.optim.Optimizer) -> tuple[tuple[str, ...], dict] | None:
    """The keys documented for the optimizer's class (along its MRO) and their hyperparameter conditions."""
    for cls in type(opt).__mro__:
        qualified = (cls.__module__.split(".")[0], cls.__name__)
        keys = QUALIFIED_KEYS.get(qualified, STATE_KEYS.get(cls.__name__))
        if keys is not None:
            return keys, _QUALIFIED_CONDITIONS.get(qualified, _CONDITIONS)
    return None


def _select(keys: tuple[str, ...], conditions: dict, groups: list[dict]) -> tuple[str, ...]:
    """The keys the param groups' hyperparameters allow (a few dict looks per group)."""
    return tuple(k for k in keys if _made(k, conditions, groups))


def _documented(opt: torch.optim.Optimizer) -> tuple[str, ...] | None:
    found = _class_keys(opt)
    return None if found is None else _select(*found, opt.param_groups)


def _made(key: str, conditions: dict, groups: list[dict]) -> bool:
    """The optimizer makes `key`: unconditionally, or some group has the hyperparameter that allows it."""
    if key not in conditions:
        return True
    hyper, test = conditions[key]
    return any(hyper in group and bool(test(group[hyper])) for group in groups)


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
    """The state keys to write for this run's optimizer (`keys`: decided at set_monitor, or after the first
    update for an unknown optimizer whose state is still empty; a documented optimizer's conditional keys
    decided again when its param groups' hyperparameters change); warns once when there are none, and once
    per key name for parameter-shaped state tensors it does not write."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizers = state_optimizers(optimizer)
        self.name = " + ".join(dict.fromkeys(type(o).__name__ for o in self.optimizers)) or (
            type(optimizer).__name__ if optimizer is not None else "none"
        )
        # ZeroRedundancyOptimizer: state only on each parameter's owner, so its keys must come from the
        # local optimizer's class (the same on every rank), never from a rank's own state
        self.zero = optimizer is not None and is_zero_redundancy(optimizer)
        if self.zero:
            self.name = f"ZeroRedundancyOptimizer({self.name})" if self.optimizers else self.name
        self.keys: tuple[str, ...] | None = None
        self.warned = False
        self._unchecked: list[torch.optim.Optimizer] = []  # documented: are its keys in its state?
        # id(optimizer) -> (class keys, conditions): its keys follow its param groups' hyperparameters
        self._rules: dict[int, tuple[tuple[str, ...], dict]] = {}
        # id(optimizer) -> key names of its state already looked at (None: no look yet)
        self._seen: dict[int, set[str]] = {}
        self._said: set[str] = set()  # extra key names already warned about
        self._decide(after_update=False)

    def _decide(self, after_update: bool) -> None:
        if not self.optimizers:
            self.keys = ()
            return
        self._of: dict[int, tuple[str, ...]] = {}  # id(optimizer) -> its keys
        self._unchecked = []
        self._rules = {}
        for opt in self.optimizers:
            rule = _class_keys(opt)
            if rule is None and self.zero:
                documented: tuple[str, ...] = ()  # an undocumented local optimizer: said by warn_if_none
            elif rule is None:
                if not opt.state and not after_update:
                    return  # unknown, no state yet: decided after its first update
                documented = _from_state(opt)
            else:
                self._rules[id(opt)] = rule
                documented = _select(*rule, opt.param_groups)
                if documented and not self.zero:  # (under ZeRO a rank-local fallback would split the ranks)
                    self._unchecked.append(opt)
            self._of[id(opt)] = documented
        self._join()

    def _join(self) -> None:
        self.keys = tuple(dict.fromkeys(k for keys in self._of.values() for k in keys))

    def for_step(self) -> tuple[str, ...]:
        """The keys to read after this step's update; called on collected steps only. Costs a look at each
        param group's few conditional hyperparameters and at one parameter's state entry (the first time
        an optimizer has state, and when that entry shows a new key name: one walk over its whole state)."""
        if self.keys is None:
            self._decide(after_update=True)
            self.warn_if_none()
        elif self._rules:
            self._redecide()
        if self._unchecked:
            self._check_documented()
        if self.keys is not None:
            self._look_for_extras()
        return self.keys or ()

    def _redecide(self) -> None:
        """Conditional keys again from the hyperparameters (add_param_group, load_state_dict change them):
        these are alike on every rank, so sharded rows stay aligned; said once per change."""
        before = self.keys
        for opt in self.optimizers:
            rule = self._rules.get(id(opt))
            if rule is None:
                continue
            keys = _select(*rule, opt.param_groups)
            old = self._of[id(opt)]
            if keys != old:
                self._of[id(opt)] = keys
                if not old and not self.zero and opt not in self._unchecked:
                    self._unchecked.append(opt)
        self._join()
        if self.keys != before:
            logger.info(
                "trainermon: mv_distribution: the param groups of %s changed (add_param_group or "
                "load_state_dict); its state keys are now %s (were %s)%s",
                self.name,
                "/".join(self.keys or ()) or "none",
                "/".join(before or ()) or "none",
                "; the warning that it writes nothing no longer holds" if self.warned and self.keys else "",
            )

    def _check_documented(self) -> None:
        for opt in [o for o in self._unchecked if o.state]:
            self._unchecked.remove(opt)
            expected = self._of[id(opt)]
            if any(k in entry for entry in opt.state.values() for k in expected):
                continue
            found = _from_state(opt)
            logger.warning(
                "trainermon: mv_distribution: the state of %s.%s holds none of the keys %s documented for "
                "its class name (another class of that name?); writing the state tensors shaped like their "
                "parameter instead: %s",
                type(opt).__module__,
                type(opt).__qualname__,
                "/".join(expected),
                "/".join(found) or "none",
            )
            self._of[id(opt)] = found
            self._rules.pop(id(opt), None)  # its keys come from its state now, not its class
            self._join()

    def _look_for_extras(self) -> None:
        """Parameter-shaped state tensors under keys outside `keys`: named once in a warning, not written
        (adding a key mid-run from one rank's state could differ between ranks and misalign merged rows)."""
        for opt in self.optimizers:
            if not opt.state:
                continue
            seen = self._seen.get(id(opt))
            if seen is not None:
                entry = next(iter(opt.state.values()))
                if all(k in seen for k in entry):
                    continue  # the usual collected step: one entry's few key names
            found = _from_state(opt)
            self._seen[id(opt)] = (seen or set()) | set(found) | set(next(iter(opt.state.values())))
            chosen = self._of.get(id(opt), ())
            extra = [k for k in found if k not in chosen and k not in self._said]
            if extra:
                self._said.update(extra)
                logger.warning(
                    "trainermon: mv_distribution: the state of %s holds tensors shaped like their parameter "
                    "under %s, which get no rows (the keys written are %s, fixed so that every rank writes "
                    "the same ones)",
                    type(opt).__name__,
                    "/".join(extra),
                    "/".join(chosen) or "none",
                )

    def warn_if_none(self) -> None:
        if self.keys == () and not self.warned:
            self.warned = True
            if self.name == "none":
                what = "no optimizer was given to set_monitor"
            elif self.zero and not self.optimizers:
                what = (
                    "torch's ZeroRedundancyOptimizer with overlap_with_ddp=True steps its local optimizer "
                    "from DDP's communication hook, outside ZeroRedundancyOptimizer.step(), and its state "
                    "is not read; grad_* and param_* rows are not affected"
                )
            elif self.zero and _documented(self.optimizers[0]) is None:
                what = (
                    f"{self.name} keeps each parameter's state on its owning rank only, and the state keys "
                    "of that local optimizer class are not documented here (they must be known alike on "
                    "every rank); grad_* and param_* rows are not affected"
                )
            elif not self.optimizers:
                what = f"no torch optimizer found in {self.name}"
            elif self._rules:
                what = f"{self.name} with these hyperparameters keeps no per-parameter state to write"
            else:  # e.g. LBFGS: its state is flat, under its first parameter
                what = f"{self.name} keeps no per-parameter state (no state tensor shaped like its parameter)"
            logger.warning(
                "trainermon: mv_distribution writes nothing: %s. Supported: %s",
                what,
                SUPPORTED,
            )
