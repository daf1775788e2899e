"""TrainerMon: the public object. Attaches to a model and optimizer, runs the step lifecycle.

Lifecycle of one step (step = optimizer step, from `start_iteration`):

    begin_step   decide whether the step is collected; install or remove activation hooks and
                 micro-batch taps (nothing is installed on steps that are not collected)
    forward      actv (module forward hooks), registering output/input gradient hooks for actv_grad
    backward     actv_grad, grad_unreduced (adapter taps), per-micro-batch gradients
    opt pre-step grad_unreduced (when read at the step), grad_reduced, param_origin
    opt post-step exp_avg, exp_avg_sq, param_updated; then end_step: one packed reduction for sharded
                 tensors, one device-to-host copy, hand-off to the background worker; next begin_step

Every hook is fail-open: an error is logged once, counted in `faults`, and training continues.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import torch

from .collector import StepCollector, TransferCounter
from .config import ConfigError, MonitorConfig, load_config
from .control import DynamicControl
from .failsafe import FaultLog
from .names import clean_name, squash_name, unique_names
from .placement import LOCAL, TensorPiece
from .records import StatBatch
from .schedule import Schedule
from .stats import EngineOptions, StatsEngine
from .worker import BackgroundWorker

logger = logging.getLogger("trainermon")


class PrintStructDone(SystemExit):
    """Raised after the first step when `print_struct` is on: the structure is written, the run stops."""


def _dist_info(process_group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _is_float_tensor(t: Any) -> bool:
    """Activations are floating point, complex or quantized tensors (the engine reads or refuses them,
    never silently); integer tensors (token ids, masks) are not activations."""
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex() or t.is_quantized)


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """Top-level activation tensors of a module's inputs or outputs (tensor, tuple/list, dict values)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if _is_float_tensor(obj) else []
    if isinstance(obj, (tuple, list)):
        return [t for t in obj if _is_float_tensor(t)]
    if isinstance(obj, dict):
        return [t for t in obj.values() if _is_float_tensor(t)]
    return []


def _replace_tensors(obj: Any, by_id: dict[int, torch.Tensor]) -> Any:
    """`obj` (a tensor, tuple, list or dict of them) with the tensors whose id is in `by_id` replaced."""
    if isinstance(obj, torch.Tensor):
        return by_id.get(id(obj), obj)
    if isinstance(obj, (tuple, list)):
        items = [by_id.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in obj]
        return type(obj)(items) if type(obj) in (tuple, list) else obj
    if isinstance(obj, dict):
        return {k: by_id.get(id(v), v) if isinstance(v, torch.Tensor) else v for k, v in obj.items()}
    return obj


def _same_pieces(a: list, b: list) -> bool:
    """The two lists describe the very same tensors with the same placement."""
    return (
        a is b
        or len(a) == len(b)
        and all(
            (x is None and y is None)
            or (x is not None and y is not None and x.placement == y.placement and x.tensor is y.tensor)
            for x, y in zip(a, b)
        )
    )


def _io_names(base: str, count: int) -> list[str]:
    return [base] if count == 1 else [f"{base}_{i}" for i in range(count)]


def _struct_of(tensors: list[torch.Tensor]) -> list[dict[str, Any]]:
    return [{"shape": list(t.shape), "dtype": str(t.dtype)} for t in tensors]


class TrainerMon:
    """msprobe-compatible training monitor.

    >>> monitor = TrainerMon("monitor_config.json")
    >>> monitor.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)

    Construction reads and validates the config (raises `ConfigError` on bad input); nothing else in
    the monitor ever raises into training.
    """

    def __init__(
        self,
        config_file_path: str | os.PathLike,
        process_group: Any = None,
        params_have_main_grad: bool | None = None,
        opt_ty: str | None = None,
    ) -> None:
        self.config_file_path = str(config_file_path)
        self.config: MonitorConfig = load_config(config_file_path)
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad
        if opt_ty is not None:
            logger.info("trainermon: opt_ty=%r is ignored; the optimizer is detected from the object", opt_ty)
        self.dynamic = os.environ.get("DYNAMIC_MONITOR", "false").strip().lower() == "true"
        self.control: DynamicControl | None = None
        if self.dynamic:
            self.control = DynamicControl(
                self.config_file_path, self.config, polling=self.config.dynamic_watch == "polling"
            )
        self.rank, self.world_size = _dist_info(process_group)
        self.faults = FaultLog()
        self.engine = StatsEngine(
            EngineOptions(
                nonfinite=self.config.wants_nonfinite,
                zeros_eps=self.config.eps if self.config.wants_zeros else None,
            )
        )
        self.transfers = TransferCounter()
        self.collector = StepCollector(self.engine, self.transfers, self.faults)
        self.schedule = Schedule(self.config)
        self.output_root = os.path.realpath(os.environ.get("MONITOR_OUTPUT_DIR", "./monitor_output"))
        self.run_dir = self._new_run_dir()

        self.current_step = 0
        self.collecting = False  # anything is collected this step
        self.scheduled = False  # the configured families are collected this step
        self.escalating = False  # activations are collected because of a recent anomaly
        self._actv_on = self._actv_grad_on = False
        self._escalate_pending = 0  # set by the worker thread, applied at the next step boundary
        self._escalate_until = -1
        self._all_module_names: list | None = None
        self.detector = None
        #: Seconds the monitor spent on the training thread in the current (or last) collected step.
        self.monitor_time_s = 0.0
        self.last_batch: StatBatch | None = None
        self.adapter = None
        self.worker: BackgroundWorker | None = None
        self._attached = False
        self._closed = False
        self._lock = threading.Lock()
        self._params: list = []
        self._names: list[str] = []
        self._module_names: list[tuple[int, str, torch.nn.Module]] = []
        self._step_handles: list[Any] = []  # hooks that live for one collected step
        self._always_handles: list[Any] = []
        self._module_calls: dict[int, int] = {}
        self._mbs_calls: dict[int, int] = {}
        self._struct: dict[str, dict] = {}
        self._stacks: dict[str, str] = {}  # module name -> call stack, recorded once, written at step end
        self._stacks_written: set[str] = set()
        self._optimizer_hooked = False
        self._step_started_at = 0.0
        self._grad_taps = None
        self._warned_manual_step = False
        ref = weakref.ref(self)
        atexit.register(lambda: (m := ref()) is not None and m.close())

    def _new_run_dir(self) -> str:
        stamp = datetime.now().strftime("%b%d_%H-%M-%S")
        return os.path.join(self.output_root, f"{stamp}-rank{self.rank}-{uuid.uuid4().hex[:8]}")

    # ==== public API ===========================================================================
    def set_monitor(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        grad_acc_steps: int = 1,
        optimizer: Any = None,
        dp_group: Any = None,
        tp_group: Any = None,
        start_iteration: int = 0,
    ) -> None:
        """Attach to `model` (a module or a list of model chunks, vpp_stage = index) and `optimizer`.

        Installs the optimizer step hooks (per instance) and the adapter's always-on taps, creates this
        rank's output directory and starts the background worker. Raises only for invalid arguments.
        """
        from trainermon.adapters import GradTaps, select_adapter

        if self._attached:
            raise RuntimeError("trainermon: set_monitor() was already called on this monitor")
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
            raise TypeError("trainermon: set_monitor(model=...) needs a torch.nn.Module or a list of them")
        if isinstance(grad_acc_steps, bool) or not isinstance(grad_acc_steps, int) or grad_acc_steps < 1:
            raise ValueError(f"trainermon: grad_acc_steps must be a positive integer, got {grad_acc_steps!r}")
        if isinstance(start_iteration, bool) or not isinstance(start_iteration, int) or start_iteration < 0:
            raise ValueError(
                f"trainermon: start_iteration must be a non-negative integer, got {start_iteration!r}"
            )

        self.adapter = select_adapter(chunks, optimizer, dp_group, tp_group)
        self.grad_acc_steps = self.adapter.grad_acc_steps(grad_acc_steps)
        self.current_step = start_iteration
        self._select_params()
        self._select_modules()

        self._make_detector()
        observers = [self._observe] if self.detector is None else [self.detector, self._observe]
        self.worker = BackgroundWorker(
            self._open_exporters(),
            self.faults,
            self.config.queue_size,
            observers,
            self.config.write_interval_s,
        )

        self._grad_taps = GradTaps(self._on_unreduced, self._on_microbatch)
        if self.config.wg_distribution or self.dynamic:  # dynamic: a later config may switch wg on
            self._always_handles += self.adapter.install_grad_taps(self._grad_taps)
        if self.control is not None:
            self.control.attach(self.process_group)  # collective across ranks
        step_optimizer = self.adapter.step_optimizer()
        if step_optimizer is not None:
            self._hook_optimizer(step_optimizer)
        self._attached = True
        logger.info(
            "trainermon: attached (%s adapter, %d parameters, %d modules); output in %s",
            self.adapter.name,
            len(self._params),
            len(self._module_names),
            self.run_dir,
        )
        self._begin_step()

    def _make_detector(self) -> None:
        """Anomaly rules from `alert.rules`; the detector runs on the worker before the exporters."""
        from .anomaly import AnomalyDetector, parse_rules

        rules = parse_rules(self.config.alert.rules)
        if self.detector is not None:
            self.detector.rules = rules  # a reloaded config: keep the history, change the rules
            return
        if not rules:
            return
        pp_stage = 0
        if self.process_group is not None:
            import torch.distributed as dist

            pp_stage = dist.get_group_rank(self.process_group, self.rank)
        self.detector = AnomalyDetector(rules, self.output_root, self.rank, pp_stage)
        self.detector.on_anomaly.append(self._escalate)
        if self.worker is not None:
            self.worker.observers.insert(0, self.detector)

    def _open_exporters(self) -> list:
        from trainermon.exporters import RunInfo, build_exporters

        run_id = os.path.basename(self.run_dir).rsplit("-", 1)[-1]
        run = RunInfo(self.run_dir, self.output_root, self.rank, self.world_size, run_id, self.config)
        try:
            return build_exporters(run, faults=self.faults)
        except Exception as exc:  # noqa: BLE001 - a sink that cannot open must not stop training
            self.faults.record("exporter open", exc, "output is off for this run, training continues")
            return []

    def step(self) -> None:
        """Mark the end of a training step by hand, for loops whose optimizer cannot be hooked.

        Collects the optimizer-side families from the current gradients, state and parameters, then
        ends the step. Do not call it when an optimizer was given to `set_monitor` (its hooks do this).
        """
        if self._optimizer_hooked:
            if not self._warned_manual_step:
                self._warned_manual_step = True
                logger.warning("trainermon: step() ignored: the optimizer's own step hooks advance the step")
            return
        self._on_pre_step()
        self._on_post_step()

    def close(self) -> None:
        """Flush every collected step to the exporters and stop the worker. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._remove_step_hooks()
        if self.control is not None:
            self.control.close()
        for handle in self._always_handles:
            try:
                handle.remove()
            except Exception:  # noqa: BLE001
                pass
        self._always_handles.clear()
        if self.adapter is not None:
            try:
                self.adapter.close()
            except Exception as exc:  # noqa: BLE001
                self.faults.record("adapter close", exc)
        if self.worker is not None:
            self.worker.close()
        if self.detector is not None:
            self.detector.close()

    def flush(self, timeout: float | None = 60.0) -> None:
        """Wait until every step handed to the worker is written by the exporters."""
        if self.worker is not None:
            self.worker.flush(timeout)

    @property
    def dropped_rows(self) -> int:
        return 0 if self.worker is None else self.worker.dropped_rows

    # ==== selection ============================================================================
    def _select_params(self) -> None:
        targets = self.config.targets
        chosen = []
        for mp in self.adapter.parameters():
            prefixed = f"{mp.vpp_stage}:{mp.name}"
            if not targets or any(
                mp.name.startswith(t) or prefixed.startswith(t) or squash_name(mp.name).startswith(t)
                for t in targets
            ):
                chosen.append(mp)
        names = [mp.name for mp in chosen]
        if self.config.squash_name:
            names = unique_names([squash_name(n) for n in names], names)
        self._params = chosen
        self._names = names
        self._param_pos = {mp.index: i for i, mp in enumerate(chosen)}

    def _select_modules(self) -> None:
        cfg = self.config
        self._module_names = []
        self._all_module_names: list | None = None  # built on first escalation
        if not (cfg.collects_actv or cfg.collects_actv_grad):
            return
        if cfg.module_ranks and self.rank not in cfg.module_ranks:
            return
        self._module_names = self._modules(every=cfg.all_xy or cfg.print_struct or not cfg.targets)

    def _modules(self, every: bool) -> list[tuple[int, str, torch.nn.Module]]:
        cfg = self.config
        out = []
        seen: set[int] = set()
        for vpp_stage, root in enumerate(self.adapter.roots()):
            for name, module in root.named_modules():
                if not name or id(module) in seen or self.adapter.is_wrapper_module(module):
                    continue
                name = clean_name(name)
                if every or name in cfg.targets or f"{vpp_stage}:{name}" in cfg.targets:
                    seen.add(id(module))
                    shown = squash_name(name) if cfg.squash_name else name
                    out.append((vpp_stage, shown, module))
        return out

    # ==== step lifecycle =======================================================================
    def _wants_step(self, step: int) -> bool:
        if self.dynamic and not self.config.dynamic_on:
            return False
        return self.schedule.wants(step)

    def _poll_control(self) -> None:
        """Dynamic mode: apply a new config from the watched file, on every rank at this same step."""
        try:
            new = self.control.poll()
        except Exception as exc:  # noqa: BLE001
            self.faults.record("dynamic control", exc)
            return
        if new is not None:
            self._apply_config(new)

    def _apply_config(self, cfg: MonitorConfig) -> None:
        old = self.config
        self.config = cfg
        self.engine.options = EngineOptions(
            nonfinite=cfg.wants_nonfinite, zeros_eps=cfg.eps if cfg.wants_zeros else None
        )
        self.schedule = Schedule(cfg)  # a new config restarts the collection count
        self._make_detector()
        self._select_params()
        self._select_modules()
        if self.worker is not None:
            self.worker.set_interval(cfg.write_interval_s)
        output_keys = ("ops", "format", "step_count_per_record", "ndigits", "csv", "parquet", "prometheus")
        if self.worker is not None and any(getattr(old, k) != getattr(cfg, k) for k in output_keys):
            self.run_dir = self._new_run_dir()  # new columns or sinks: a new output directory
            self.worker.replace_exporters(self._open_exporters())
        logger.info(
            "trainermon: config reloaded at step %d: dynamic_on=%s, collect_times=%d",
            self.current_step,
            cfg.dynamic_on,
            cfg.collect_times,
        )

    def _begin_step(self) -> None:
        self._step_started_at = time.perf_counter()
        if self.control is not None:
            self._poll_control()
        # scheduled: the configured families; escalating: every module's activations after an anomaly.
        self.scheduled = self._wants_step(self.current_step)
        if self._escalate_pending:
            self._escalate_until = self.current_step + self._escalate_pending - 1
            self._escalate_pending = 0
        self.escalating = self.current_step <= self._escalate_until
        self.collecting = self.scheduled or self.escalating
        cfg = self.config
        self._actv_on = (self.scheduled and cfg.collects_actv) or self.escalating
        self._actv_grad_on = (self.scheduled and cfg.collects_actv_grad) or self.escalating
        self._module_calls.clear()
        self._mbs_calls.clear()
        if self.adapter is not None and hasattr(self.adapter, "new_step"):
            self.adapter.new_step()
        self._remove_step_hooks()
        if self._grad_taps is not None:
            self._grad_taps.active = self.scheduled and cfg.wg_distribution
        if not self.collecting:
            return
        t0 = time.perf_counter()
        self._install_module_hooks()
        if self.scheduled and cfg.wg_distribution and cfg.monitor_mbs_grad:
            self._step_handles += self.adapter.install_microbatch_taps(self._params, self._grad_taps)
        self.monitor_time_s = time.perf_counter() - t0

    def _escalate(self, step: int, anomalies: list) -> None:
        """Worker thread: an anomaly outside the activations asks for activations of the next steps."""
        if self.config.alert.escalate_steps and any(a.family not in ("actv", "actv_grad") for a in anomalies):
            self._escalate_pending = self.config.alert.escalate_steps

    def _remove_step_hooks(self) -> None:
        for handle in self._step_handles:
            handle.remove()
        self._step_handles.clear()

    def _hook_optimizer(self, optimizer: Any) -> None:
        if hasattr(optimizer, "register_step_pre_hook") and hasattr(optimizer, "register_step_post_hook"):
            self._always_handles.append(optimizer.register_step_pre_hook(lambda *_: self._on_pre_step()))
            self._always_handles.append(optimizer.register_step_post_hook(lambda *_: self._on_post_step()))
        elif callable(getattr(optimizer, "step", None)):
            # Not a torch Optimizer (e.g. a framework wrapper): wrap this instance's step only.
            original = optimizer.step
            monitor = self

            def step(*args: Any, **kwargs: Any) -> Any:
                monitor._on_pre_step()
                out = original(*args, **kwargs)
                monitor._on_post_step()
                return out

            optimizer.step = step

            class _Restore:
                def remove(self) -> None:
                    optimizer.__dict__.pop("step", None)

            self._always_handles.append(_Restore())
        else:
            raise TypeError(f"trainermon: optimizer {type(optimizer).__name__} has no step() to hook")
        self._optimizer_hooked = True

    def _on_pre_step(self) -> None:
        if not self.scheduled:
            return
        try:
            self._collect_pre_step()
        except Exception as exc:  # noqa: BLE001
            self.faults.record("optimizer pre-step", exc)

    def _on_post_step(self) -> None:
        try:
            if self.scheduled:
                self._collect_post_step()
            if self.collecting:
                self._end_collected_step()
        except PrintStructDone:
            raise
        except Exception as exc:  # noqa: BLE001
            self.faults.record("optimizer post-step", exc)
            self.collector.reset()
        self.current_step += 1
        try:
            self._begin_step()
        except Exception as exc:  # noqa: BLE001
            self.faults.record("begin step", exc)
            self.collecting = self.scheduled = self.escalating = False

    def _entries(self, pieces: list[TensorPiece | None], micro_step: int | None = None):
        return [
            (mp.vpp_stage, name, micro_step, piece)
            for mp, name, piece in zip(self._params, self._names, pieces)
            if piece is not None
        ]

    def _collect_pre_step(self) -> None:
        cfg = self.config
        if cfg.wg_distribution:
            reduced = self.adapter.reduced_grads(self._params)
            if not cfg.monitor_mbs_grad and self.adapter.single_replica():
                unreduced = reduced  # no data-parallel reduction exists
            else:
                unreduced = None if cfg.monitor_mbs_grad else self.adapter.unreduced_grads(self._params)
            if unreduced is not None and _same_pieces(unreduced, reduced):
                # No reduction happened (plain PyTorch): one computation gives both families.
                self._add("grad_unreduced", self._entries(unreduced), also_as="grad_reduced")
            else:
                if unreduced is not None:
                    self._add("grad_unreduced", self._entries(unreduced))
                self._add("grad_reduced", self._entries(reduced))
            self.collector.extras.update(self.adapter.extras())
        if cfg.param_distribution:
            self._add("param_origin", self._entries(self.adapter.param_values(self._params)))

    def _collect_post_step(self) -> None:
        cfg = self.config
        if cfg.wg_distribution:
            self.collector.extras.update(self.adapter.post_step_extras())
        if cfg.mv_distribution:
            self._add("exp_avg", self._entries(self.adapter.optimizer_state(self._params, "exp_avg")))
            self._add("exp_avg_sq", self._entries(self.adapter.optimizer_state(self._params, "exp_avg_sq")))
        if cfg.param_distribution:
            self._add("param_updated", self._entries(self.adapter.param_values(self._params)))

    def _add(self, family: str, entries: list, also_as: str | None = None) -> None:
        t0 = time.perf_counter()
        with self._lock:
            self.collector.add(family, entries, also_as=also_as)
        self.monitor_time_s += time.perf_counter() - t0

    def _add_local(
        self, family: str, vpp_stage: int, labels: Sequence[str], micro: int | None, tensors: Sequence
    ) -> None:
        t0 = time.perf_counter()
        with self._lock:
            self.collector.add_local(family, vpp_stage, labels, micro, tensors)
        self.monitor_time_s += time.perf_counter() - t0

    def _end_collected_step(self) -> None:
        t0 = time.perf_counter()
        if self.scheduled:
            self.schedule.mark_collected()
        payload = self.collector.finish(self.current_step)
        if payload is not None and self.worker is not None:
            self.worker.submit(payload)
        self.monitor_time_s += time.perf_counter() - t0
        if payload is not None:
            # Time the monitor spent on the training thread this step (hooks, statistics, hand-off).
            payload.extras["monitor_time_ms"] = self.monitor_time_s * 1e3
        if self._stacks and self.config.stack_info:
            self._write_stack_info()
        if self.config.print_struct:
            self._write_struct_and_stop()
        if self.control is not None and self.config.dynamic_on and self.schedule.exhausted:
            # The last collection of this switch-on is done: off in the file (rank 0 writes it) and, on
            # every rank at this same step, in memory, without waiting for the watcher to see the write.
            self.control.switch_off_in_file()
            self.config = dataclasses.replace(self.config, dynamic_on=False)

    # ==== gradient taps ========================================================================
    def _on_unreduced(self, indices: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
        try:
            entries = []
            for index, grad in zip(indices, grads):
                pos = self._param_pos.get(index)
                if pos is not None and not self.config.monitor_mbs_grad:
                    mp = self._params[pos]
                    entries.append((mp.vpp_stage, self._names[pos], None, TensorPiece.whole(grad, LOCAL)))
            if entries:
                self._add("grad_unreduced", entries)
        except Exception as exc:  # noqa: BLE001
            self.faults.record("grad_unreduced tap", exc)

    def _on_microbatch(self, index: int, grad: torch.Tensor) -> None:
        try:
            pos = self._param_pos.get(index)
            if pos is None or not self.collecting:
                return
            micro = self._mbs_calls.get(index, 0)
            self._mbs_calls[index] = micro + 1
            mp = self._params[pos]
            self._add(
                "grad_unreduced", [(mp.vpp_stage, self._names[pos], micro, TensorPiece.whole(grad, LOCAL))]
            )
        except Exception as exc:  # noqa: BLE001
            self.faults.record("micro-batch gradient tap", exc)

    # ==== activation hooks =====================================================================
    def _install_module_hooks(self) -> None:
        modules = self._module_names
        if self.escalating:
            if self._all_module_names is None:
                self._all_module_names = self._modules(every=True)
            modules = self._all_module_names
        if not (self._actv_on or self._actv_grad_on or self.config.print_struct):
            return
        for vpp_stage, name, module in modules:
            if self._actv_grad_on:
                self._step_handles.append(
                    module.register_forward_pre_hook(self._make_pre_hook(vpp_stage, name), with_kwargs=True)
                )
            self._step_handles.append(
                module.register_forward_hook(self._make_fwd_hook(vpp_stage, name), with_kwargs=True)
            )

    def _make_pre_hook(self, vpp_stage: int, name: str):
        def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
            # Give the module views of its inputs, so a hook on a view sees exactly the gradient that
            # flows into this module (not the sum over every consumer of the same tensor).
            try:
                if torch._C._current_graph_task_id() != -1 or not torch.is_grad_enabled():
                    return None  # recomputation in backward (activation checkpointing), or no autograd
                micro = self._module_calls.get(id(module), 0)
                keys = [i for i, a in enumerate(args) if _is_float_tensor(a)]
                keys += [k for k, v in kwargs.items() if _is_float_tensor(v)]
                labels = _io_names(f"{name}.input_grad", len(keys))
                new_args, new_kwargs = list(args), dict(kwargs)
                # One view per distinct tensor: a module called as attn(h, h, h) must still see the same
                # object three times (nn.MultiheadAttention takes its packed self-attention path only
                # when query is key is value; distinct views cost an extra projection and ~4% memory).
                views: dict[int, tuple[torch.Tensor, list[str]]] = {}
                for key, label in zip(keys, labels):
                    holder = new_args if isinstance(key, int) else new_kwargs
                    tensor = holder[key]
                    if tensor.requires_grad:
                        if id(tensor) not in views:
                            views[id(tensor)] = (tensor.view_as(tensor), [])
                        view, view_labels = views[id(tensor)]
                        view_labels.append(label)
                        holder[key] = view
                for view, view_labels in views.values():
                    view.register_hook(self._make_grad_hook("actv_grad", vpp_stage, view_labels, micro))
                return tuple(new_args), new_kwargs
            except Exception as exc:  # noqa: BLE001
                self.faults.record("forward pre-hook", exc)
                return None

        return pre_hook

    def _make_fwd_hook(self, vpp_stage: int, name: str):
        cfg = self.config

        def fwd_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            try:
                if torch._C._current_graph_task_id() != -1:
                    return  # recomputed forward inside backward: already counted
                key = id(module)
                micro = self._module_calls.get(key, 0)
                self._module_calls[key] = micro + 1
                inputs = _tensors_in(args) + _tensors_in(kwargs)
                outputs = _tensors_in(output)
                if cfg.print_struct:
                    if name not in self._struct:
                        self._struct[name] = {
                            "class": type(module).__name__,
                            "input": _struct_of(inputs),
                            "output": _struct_of(outputs),
                        }
                    return
                if cfg.stack_info and name not in self._stacks and name not in self._stacks_written:
                    self._stacks[name] = "".join(traceback.format_stack(limit=32)[:-2])
                if self._actv_on and (inputs or outputs):
                    labels = _io_names(f"{name}.input", len(inputs)) + _io_names(
                        f"{name}.output", len(outputs)
                    )
                    self._add_local("actv", vpp_stage, labels, micro, inputs + outputs)
                if self._actv_grad_on and torch.is_grad_enabled():
                    leaves: dict[int, torch.Tensor] = {}
                    for label, t in zip(_io_names(f"{name}.output_grad", len(outputs)), outputs):
                        if t.requires_grad:
                            if t.is_leaf:
                                # A parameter returned as an output (Megatron's skip_bias_add bias): a hook
                                # on it would fire for every later backward and never go away, so this
                                # call's output becomes a view of it, hooked for this call only.
                                view = leaves[id(t)] = t.view_as(t)
                                t = view
                            t.register_hook(self._make_grad_hook("actv_grad", vpp_stage, [label], micro))
                    if leaves:
                        return _replace_tensors(output, leaves)
            except Exception as exc:  # noqa: BLE001
                self.faults.record("forward hook", exc)

        return fwd_hook

    def _make_grad_hook(self, family: str, vpp_stage: int, labels: list[str], micro: int):
        """A gradient hook writing one row per label (one tensor passed as several inputs: one row each,
        computed once)."""

        def grad_hook(grad: torch.Tensor) -> None:
            try:
                if self.collecting and grad is not None:
                    self._add_local(family, vpp_stage, labels, micro, (grad,) * len(labels))
            except Exception as exc:  # noqa: BLE001
                self.faults.record("activation-gradient hook", exc)

        return grad_hook

    # ==== side outputs =========================================================================
    def _observe(self, batch: StatBatch) -> None:
        """Runs on the worker thread for every finalised step."""
        self.last_batch = batch

    def _write_stack_info(self) -> None:
        import csv

        try:
            os.makedirs(self.run_dir, exist_ok=True)
            path = os.path.join(self.run_dir, "stack_info.csv")
            new = not os.path.exists(path)
            with open(path, "a", encoding="utf-8", newline="") as fh:
                writer = csv.writer(fh)
                if new:
                    writer.writerow(["name", "stack"])
                for name, stack in self._stacks.items():
                    writer.writerow([name, stack])
            self._stacks_written.update(self._stacks)
            self._stacks = {}
        except Exception as exc:  # noqa: BLE001
            self.faults.record("stack_info", exc)

    def _write_struct_and_stop(self) -> None:
        out_dir = os.path.join(self.output_root, "module_struct", f"rank{self.rank}")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "module_struct.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self._struct, fh, indent=2)
        self.close()
        message = f"trainermon: print_struct is on: module structure written to {path}; stopping the run"
        logger.warning(message)
        raise PrintStructDone(message)


__all__ = ["TrainerMon", "ConfigError", "PrintStructDone"]
