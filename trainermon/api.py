"""TrainerMon: msprobe's public object, a thin façade over the step loop (`runtime.loop.StepLoop`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from .collect.records import StatBatch
from .config import ConfigError, MonitorConfig, parse_config, read_env
from .failsafe import FaultLog
from .inmemory import metric_dict
from .runtime.control import read_config_or_defer
from .runtime.growth import ManualGrads
from .runtime.lifecycle import same_target
from .runtime.loop import StepLoop
from .runtime.plan import plan_step
from .runtime.probes.activations import ActivationProbe
from .runtime.probes.side_outputs import PrintStructDone

logger = logging.getLogger("trainermon")


class TrainerMon:
    """msprobe-compatible training monitor.

    >>> monitor = TrainerMon("monitor_config.json")
    >>> monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)

    Construction reads and validates the config (raises `ConfigError` on bad input) and the environment
    (`MONITOR_OUTPUT_DIR`, `DYNAMIC_MONITOR`); nothing else in the monitor ever raises into training.
    """

    def __init__(
        self,
        config_file_path: str | os.PathLike,
        process_group: Any = None,
        params_have_main_grad: bool | None = None,
        opt_ty: str | None = None,
    ) -> None:
        if opt_ty is not None:
            logger.info("trainermon: opt_ty=%r is ignored; the optimizer is detected from the object", opt_ty)
        if params_have_main_grad is not None:
            logger.debug(
                "trainermon: params_have_main_grad is detected from the parameters; the value is unused"
            )
        check_group("TrainerMon", "process_group", process_group, non_member=False)
        self.config_file_path = os.path.abspath(os.fspath(config_file_path))  # the cwd may change later
        env = read_env()
        raw = read_config_or_defer(self.config_file_path, env.dynamic)  # None: rank 0's, at set_monitor
        config = parse_config(raw if raw is not None else {"dynamic_on": False}, source=self.config_file_path)
        self.loop = StepLoop(config, env, self.config_file_path, process_group, raw=raw)
        self.grad_acc_steps = 1
        self._said_off: set[str] = set()  # in-memory calls whose family is off, warned once each
        self._said: set[str] = set()  # other one-time warnings (ignored arguments, deprecated calls)
        self._manual = ManualGrads(self.loop.faults)
        # A monitor made in a helper and not kept lives on in its model's hooks (which hold the loop); the
        # loop is flushed at exit, or once its model and optimizer are garbage (`runtime.lifecycle`).

    def set_monitor(
        self, model: torch.nn.Module | Sequence[torch.nn.Module], *args: Any, **kwargs: Any
    ) -> None:
        """Attach to `model` (a module or a list of model chunks, vpp_stage = index) and `optimizer`.

        Hooks the optimizer's step (per instance) and the adapter's always-on taps, opens this rank's
        output and starts the background worker. Collective with more than one rank: every rank must call
        it (a store check first, `runtime.arrival`; then the groups it makes). Raises only for invalid
        arguments, a second call, or a rank that does not call it within TRAINERMON_SET_MONITOR_TIMEOUT_S.

        Arguments: `grad_acc_steps=1, optimizer=None, dp_group=None, tp_group=None,
        start_iteration=0`, by keyword or in one of msprobe's two positional orders: the older
        `(model, grad_acc_steps, optimizer, dp_group, tp_group, start_iteration)` and msprobe 26's
        `(model, optimizer, grad_acc_steps, tp_group, dp_group, start_iteration)`, told apart by
        whether the second argument is an integer. A wrapped optimizer (accelerate's, Lightning's, any
        object holding it as `.optimizer`) is unwrapped; one log line says what was hooked."""
        from trainermon.adapters import AdapterContext, select_adapter
        from trainermon.adapters.wrapped import describe_chain

        bound = bind_set_monitor_args(args, kwargs)
        grad_acc_steps, optimizer = bound["grad_acc_steps"], bound["optimizer"]
        dp_group, tp_group, start_iteration = bound["dp_group"], bound["tp_group"], bound["start_iteration"]

        if self.loop.adapter is not None:
            raise RuntimeError("trainermon: set_monitor() was already called on this monitor")
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
            raise TypeError("trainermon: set_monitor(model=...) needs a torch.nn.Module or a list of them")
        for key, value, low in (
            ("grad_acc_steps", grad_acc_steps, 1),
            ("start_iteration", start_iteration, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "a positive" if low else "a non-negative"
                raise ValueError(f"trainermon: {key} must be {kind} integer, got {value!r}")
        check_group("set_monitor", "dp_group", dp_group)
        check_group("set_monitor", "tp_group", tp_group)
        context = AdapterContext(
            dp_group, tp_group, self.loop.process_group, grad_acc_steps, self.loop.faults
        )
        adapter = select_adapter(chunks, optimizer, context)
        self.grad_acc_steps = context.grad_acc_steps  # the framework's own count where it has one
        self._replace_older(adapter)
        self.loop.attach(adapter, start_iteration)
        self._manual.arm(self.loop)
        hooked = (
            describe_chain([o for o in adapter.optimizer_chain if o is not None], adapter.optimizer)
            if self.loop.hooked
            else "none hooked: call monitor.step() after optimizer.step(), before zero_grad()"
        )
        logger.info(
            "trainermon: attached (%s adapter, %d parameters, optimizer %s); output in %s",
            adapter.name,
            len(self.loop.selection.params),
            hooked,
            self.run_dir,
        )

    def _replace_older(self, adapter: Any) -> None:
        """An unclosed monitor of this process on the same model (a chunk of it) or optimizer is closed,
        with a warning: a re-run notebook cell would otherwise stack monitors that all hook and write."""
        for older in same_target(self.loop, adapter):
            logger.warning(
                "trainermon: another monitor is still attached to this model or optimizer (output %s), "
                "never closed (a re-run notebook cell?): closing it now; call monitor.close() when done "
                "with a monitor",
                older.outputs.run_dir,
            )
            older.close()

    def set_wrapped_optimizer(self, optimizer: Any) -> None:
        """msprobe's older interface: the optimizer that a later `monitor_gnorm_with_ad` attaches to."""
        self._wrapped_optimizer = optimizer

    def monitor_gnorm_with_ad(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        optimizer: Any = None,
        grad_acc_steps: int = 1,
        tp_group: Any = None,
        dp_group: Any = None,
        start_iteration: int = 0,
    ) -> None:
        """msprobe's older name for `set_monitor`, in its argument order; without `optimizer`, the one given
        to `set_wrapped_optimizer` (msprobe logs an error and monitors nothing when there is none: this
        raises instead)."""
        if optimizer is None:
            optimizer = getattr(self, "_wrapped_optimizer", None)
        if optimizer is None:
            raise TypeError(
                "trainermon: monitor_gnorm_with_ad() needs an optimizer: pass optimizer=... or call "
                "set_wrapped_optimizer(optimizer) first"
            )
        self.set_monitor(
            model,
            optimizer=optimizer,
            grad_acc_steps=grad_acc_steps,
            tp_group=tp_group,
            dp_group=dp_group,
            start_iteration=start_iteration,
        )

    # ---- msprobe's in-memory metrics (its "api" format; any format here) ----------------------------
    def generate_wgrad_metrics(self, post_grad_dict: dict | None = None) -> tuple[dict, dict]:
        """(reduced, unreduced) gradient statistics of the last collected step: its `grad_reduced` and
        `grad_unreduced` rows as `{tag: {statistic: float64 0-d tensor}}`, keyed by msprobe's tags
        (`reduced["0:fc.weight/rank0/post_grad"]["norm"]`). Call after the optimizer step: msprobe reads
        the gradients at the call, trainermon gives the step it finished. Waits for the background worker
        to process the submitted steps (the sinks are not flushed); no collective, no device work. ({}, {})
        before a collected step or without `wg_distribution` (said once). `post_grad_dict`: msprobe 26.2's
        argument (the gradients its own optimizer hook read), accepted and ignored (the monitor reads them
        itself; said once when not empty)."""
        if post_grad_dict is not None and not isinstance(post_grad_dict, dict):
            raise TypeError(
                f"trainermon: generate_wgrad_metrics(post_grad_dict=...) takes a dict (ignored), got "
                f"{type(post_grad_dict).__name__}"
            )
        if post_grad_dict and self._once("post_grad_dict"):
            logger.warning(
                "trainermon: generate_wgrad_metrics(post_grad_dict): the %d gradients passed are ignored; "
                "the statistics are the monitor's own of the last collected step",
                len(post_grad_dict),
            )
        batch = self._finished("generate_wgrad_metrics", "wg_distribution", self.config.wg_distribution)
        return self._metrics(batch, "grad_reduced"), self._metrics(batch, "grad_unreduced")

    def generate_xy_metrics(self) -> tuple[dict, dict]:
        """(actv, actv_grad): the activation and activation-gradient statistics of the last collected step,
        as `generate_wgrad_metrics` gives the gradients' (`actv["0:fc.output:0/rank0/actv"]["norm"]`,
        with the micro-step). Same call point and cost; ({}, {}) without `xy_distribution`/`all_xy`."""
        on = self.config.collects_actv or self.config.collects_actv_grad
        batch = self._finished("generate_xy_metrics", "xy_distribution", on)
        return self._metrics(batch, "actv"), self._metrics(batch, "actv_grad")

    def reload_xy(self, xy_distribution: bool = False) -> None:
        """msprobe's deprecated switch of `xy_distribution` (said once; the config key, or its edit under
        `DYNAMIC_MONITOR=true`, is the way). Applies at once, as msprobe's does: called between steps (after
        the optimizer step), the next step collects activations (or not) by the new value. A later reload
        of the config file (dynamic mode) sets the key again from the file."""
        if not isinstance(xy_distribution, bool):
            raise TypeError(f"trainermon: reload_xy() takes true or false, got {xy_distribution!r}")
        if self._once("reload_xy"):
            logger.warning(
                "trainermon: reload_xy() is deprecated (as in msprobe): set the config key 'xy_distribution' "
                "(with DYNAMIC_MONITOR=true, edit it in the config file)"
            )
        loop = self.loop
        if xy_distribution == loop.config.xy_distribution:
            return
        config = dataclasses.replace(loop.config, xy_distribution=xy_distribution)
        loop.config = config  # no other probe reads xy_distribution: the activation probe alone is told
        probe = next((p for p in loop.probes if isinstance(p, ActivationProbe)), None)
        if probe is None:  # before set_monitor: attach reads the config
            loop.xy_override = xy_distribution
            return
        between_steps = not probe._calls  # noqa: SLF001 - no hooked forward ran in this step yet
        probe.configure(config)  # hooks the selected modules, or removes the hooks
        if between_steps:  # the step begun at the last optimizer step follows the new value
            loop.plan = plan_step(config, loop.plan.step, loop.plan.scheduled, loop.plan.escalating)
            probe.begin(loop.plan)

    def _once(self, key: str) -> bool:
        if key in self._said:
            return False
        self._said.add(key)
        return True

    def _finished(self, call: str, key: str, on: bool) -> StatBatch | None:
        if not on:
            if call not in self._said_off:
                self._said_off.add(call)
                logger.warning("trainermon: %s(): %s is off in the config: no statistics to give", call, key)
            return None
        self._reached()
        return self.loop.last_batch

    def _metrics(self, batch: StatBatch | None, family: str) -> dict:
        adapter, mbs = self.loop.adapter, self.config.monitor_mbs_grad
        unreduced = "pre_grad" if adapter is None else adapter.msprobe_unreduced_kind(mbs)
        return metric_dict(batch, family, self.loop.rank, self.config.ops, unreduced)

    def step(self) -> None:
        """Mark the end of a training step by hand, for loops whose optimizer cannot be hooked: call it after
        `optimizer.step()` and before `zero_grad()`.

        Collects the gradients and the updated parameters, then ends the step; not the optimizer's state
        (no optimizer was given: mv_distribution says so at set_monitor), nor param_origin and update
        (both need the parameters before the update; said once). Ignored (with one
        warning) when the optimizer's own step advances the monitor. Costs on other steps: a few flag
        checks; on collected ones see `runtime.growth.ManualGrads`."""
        loop = self.loop
        if loop.closed:  # nothing to write to, and the model is released
            return
        if loop.hooked:
            if not getattr(self, "_warned_manual_step", False):
                self._warned_manual_step = True
                logger.warning("trainermon: step() ignored: the optimizer's own step hooks advance the step")
            return
        # read at a clipping already: those rows stand, whatever zero_grad() did since
        gone = self._manual.gone(judge=not loop._grads_read)  # noqa: SLF001
        self._check_manual_step(gone)
        loop.manual_step(grads=gone is None)
        self._manual.arm(loop)

    def _check_manual_step(self, gone: str | None) -> None:
        """What `step()` cannot give, said once: param_origin and update (it runs after the update), and
        gradients cleared since the last backward (`zero_grad()` before `step()`). A parameter scan on
        collected steps only, until said, when the gradient watch could not tell."""
        config, loop = self.config, self.loop
        if "manual params" not in self._said and (config.param_distribution or config.update_distribution):
            self._once("manual params")
            missing = ["param_origin"] * config.param_distribution + ["update"] * config.update_distribution
            logger.warning(
                "trainermon: step() runs after your update, when the parameters before it are gone "
                "(param_origin holds the updated parameters there, update 0): no %s rows in this mode; "
                "param_updated is read at step(). Pass the optimizer to set_monitor (a torch optimizer's "
                "step is hooked) for them",
                " or ".join(missing),
            )
        if not (config.wg_distribution and loop.plan.collecting) or "manual grads" in self._said:
            return
        if gone is None and loop.adapter is not None and not loop._grads_read:  # noqa: SLF001
            if all(p.grad is None for r in loop.adapter.roots() for p in r.parameters()):
                gone = "none"
        if gone is not None:
            self._once("manual grads")
            logger.warning(
                "trainermon: step() at step %d found no gradients of the last backward (%s: zero_grad() "
                "before step()?): no gradient rows at such steps (said once); call step() after "
                "optimizer.step() and before zero_grad()",
                loop.step,
                "set to None" if gone == "none" else "zeroed in place",
            )

    def flush(self, timeout: float | None = 60.0) -> None:
        """Wait until every step handed to the worker is written by the exporters."""
        if self.loop.worker is not None:
            self.loop.worker.flush(timeout)

    def _reached(self) -> None:
        """Wait (at most 60 s) until the worker has processed every submitted step; the sinks are not
        flushed (a per-step call would cut a Parquet part per step)."""
        if self.loop.worker is not None:
            self.loop.worker.reached(60.0)

    def close(self) -> None:
        """Flush every collected step to the exporters and stop the worker. Idempotent. In a forked child
        (os.fork) it does nothing: the parent writes the steps and owns the sinks. Without it, the monitor
        is closed at exit, or once its model and optimizer are garbage. A closed monitor holds neither its
        model nor its optimizer (no hook of its stays on them); its read-only views and the last step's
        in-memory metrics still answer; `step()` does nothing."""
        self._manual.gone(judge=False)  # its hook off the model
        self.loop.close()

    def state_dict(self) -> dict:
        """The monitoring position to save with a checkpoint: the step, the schedule's count of collected
        steps, the dynamic state, escalation, and the anomaly rules' history (per rank: torch.save each
        rank's; through torch.distributed.checkpoint the history does not come back, said at load). Waits
        until the worker has processed every submitted step, so that the rules' history is complete."""
        self._reached()
        return self.loop.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved `state_dict` (before or after `set_monitor`; collective in dynamic mode
        when after). The step counter continues from the saved step."""
        self.loop.load_state_dict(state)
        self._manual.gone(judge=False)
        self._manual.arm(self.loop)  # for the restored step's plan

    # ---- read-only views -------------------------------------------------------------------------
    @property
    def run_dir(self) -> str:
        return self.loop.outputs.run_dir

    @property
    def config(self) -> MonitorConfig:
        return self.loop.config

    @property
    def current_step(self) -> int:
        return self.loop.step

    @property
    def faults(self) -> FaultLog:
        return self.loop.faults

    @property
    def last_batch(self) -> StatBatch | None:
        """The last step the worker finalised (tests and interactive use)."""
        return self.loop.last_batch

    @property
    def dropped_rows(self) -> int:
        return 0 if self.loop.worker is None else self.loop.worker.dropped_rows


__all__ = ["ConfigError", "PrintStructDone", "TrainerMon"]


_OLD_ORDER = ("grad_acc_steps", "optimizer", "dp_group", "tp_group", "start_iteration")
_MSPROBE_26_ORDER = ("optimizer", "grad_acc_steps", "tp_group", "dp_group", "start_iteration")


def check_group(call: str, key: str, value: Any, non_member: bool = True) -> None:
    """TypeError unless `value` is None, a ProcessGroup or (where `non_member`: dp_group, tp_group) torch's
    mark for a rank outside a group made by `new_group` on every rank (`GroupMember.NON_GROUP_MEMBER`): a
    name failed at every collected step. `process_group` has no such mark: its ranks must all be in it.
    Free."""
    dist = torch.distributed
    group_type = getattr(dist, "ProcessGroup", None)
    if value is None or (group_type is not None and isinstance(value, group_type)):
        return
    member = getattr(dist, "GroupMember", None)
    mark = getattr(member, "NON_GROUP_MEMBER", None) if member is not None else None
    if non_member and type(value) is int and value == mark:
        return
    allowed = " (e.g. from dist.new_group, or its GroupMember.NON_GROUP_MEMBER)" if non_member else ""
    outside = "" if non_member else " holding this rank"
    raise TypeError(
        f"trainermon: {call}({key}=...) got {value!r} (type {type(value).__name__}); allowed: None or a "
        f"torch.distributed ProcessGroup{outside}{allowed}"
    )


def bind_set_monitor_args(args: tuple, kwargs: dict) -> dict[str, Any]:
    """`set_monitor`'s arguments after `model`, by name (see `TrainerMon.set_monitor`)."""
    first = args[0] if args else None
    old = isinstance(first, int) and not isinstance(first, bool)
    order = _OLD_ORDER if (old or not args) else _MSPROBE_26_ORDER
    if len(args) > len(order):
        raise TypeError(f"trainermon: set_monitor() takes at most {len(order) + 1} positional arguments")
    bound: dict[str, Any] = {
        "grad_acc_steps": 1,
        "optimizer": None,
        "dp_group": None,
        "tp_group": None,
        "start_iteration": 0,
    }
    bound.update(zip(order, args))
    for key, value in kwargs.items():
        if key not in bound:
            raise TypeError(
                f"trainermon: set_monitor() got an unexpected argument {key!r}; allowed: {list(bound)}"
            )
        if key in order[: len(args)]:
            raise TypeError(f"trainermon: set_monitor() got {key!r} both by position and by name")
        bound[key] = value
    return bound
