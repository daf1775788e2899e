"""The step loop: the only owner of step state, and the only caller of collectives.

Lifecycle of one step (step = optimizer step, from `start_iteration`):

    begin        poll the dynamic config (one small broadcast when distributed), plan the step
                 (`plan.plan_step`), apply escalation, `probe.begin(plan)`: hooks are armed only on
                 collected steps
    forward /    activation hooks and gradient taps add rows to the collector (`record`, `record_local`)
    backward
    grads        `probe.grads_final`: the reduced gradients are read where the user clips them, before the
                 clipping scales them (`clip_watch`; again, replacing that read, if a backward changed
                 them before a later clipping), else at the pre-step
    pre          the adapter's `events.pre()`: reduced gradients ready, update not run: `probe.pre_optim`
    post         the adapter's `events.post(scalars)`: `probe.post_optim`, then, on a collected step, one
                 packed reduction per process group and one device-to-host copy (`StepCollector.finish`),
                 the immutable payload to the worker, `probe.end`; then the next step's begin

Every probe call is fail-open: an error is logged once, counted in `faults`, and training continues.
Costs per step that is not collected: one flag check per hook that is always installed, the control poll
(dynamic mode), and the plan.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from trainermon.adapters.base import StepEvents
from trainermon.collect.collector import StepCollector
from trainermon.collect.records import StatBatch, StepScalars
from trainermon.collect.transfer import TransferCounter
from trainermon.collect.xrank import CrossRank
from trainermon.config import Env, MonitorConfig
from trainermon.failsafe import FaultLog
from trainermon.pipeline.derive import Deriver
from trainermon.pipeline.worker import BackgroundWorker
from trainermon.stats.engine import StatsEngine, check_not_capturing

from .arrival import wait_for_all
from .control import DynamicControl
from .escalation import Escalation
from .lifecycle import on_drop, release, settle, track, weak_method
from .outputs import Outputs
from .owntime import OwnTime
from .plan import Schedule, StepPlan, plan_step
from .reloads import ConfigChanges, engine_options
from .resume_state import check_state, restore_state, saved_state
from .selection import ParamSelection, select_params
from .uneven import check_stepping, joinables, joining, say_paused, watch_notices

logger = logging.getLogger("trainermon")


def dist_info() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class StepLoop(ConfigChanges):
    def __init__(
        self, config: MonitorConfig, env: Env, config_path: str, process_group: Any = None, raw: Any = None
    ) -> None:
        self.config = config
        self._raw = raw  # the file's JSON as this rank read it (rank 0's is shared at attach)
        self._config_path = config_path
        self.env = env
        self.process_group = process_group
        self.faults = FaultLog()
        self.rank, self.world_size = dist_info()
        self.engine = StatsEngine(engine_options(config))
        self.transfers = TransferCounter()
        self.collector = StepCollector(self.engine, self.transfers, self.faults)
        self.xrank = CrossRank(self.rank, self.world_size, self.faults)
        self.schedule = Schedule(config, anchored=env.dynamic and config.dynamic_on)  # (see _reload)
        self.escalation = Escalation()
        self.outputs = Outputs(env, self.rank, self.world_size, self.faults)
        self.control = (
            DynamicControl(config_path, config, polling=config.dynamic_watch == "polling")
            if env.dynamic
            else None
        )
        self.step = self.first_step = 0
        self.plan = StepPlan(step=0)
        self.adapter: Any = None
        self.worker: BackgroundWorker | None = None
        self.detector: Any = None
        self.selection = ParamSelection()
        self.probes: list[Any] = []
        self.hooked = False  # the adapter fires the step events (else the user calls step())
        self.last_batch: StatBatch | None = None
        self.clock = OwnTime()  # the monitor's time on the training thread
        self._step_mark = 0.0
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._subscribers: list[Callable[[MonitorConfig], None]] = []
        self._pending_state: dict | None = None
        self._grads_read = False  # this step's gradients were read (at clipping or at the pre-step)
        self._grads_rows: tuple = ((), ())  # the collector's marks around that read
        self.closed = False
        self.pid = os.getpid()  # a forked child's close() touches nothing (`lifecycle`)
        self._untrack: Callable[[], None] | None = None
        self.xy_override: bool | None = None  # `reload_xy` before set_monitor (kept when rank 0's applies)
        self.joined = False  # a Join context (uneven inputs): no collectives of the monitor's own
        self._joinables: list | None = None  # what a Join context may be over (`uneven.joinables`)
        self._stepping = 0  # under Join: ranks stepping at the last look (0: not looked/all; -1: never)

    # ==== attaching ================================================================================
    def attach(self, adapter: Any, start_iteration: int) -> None:
        """Wire the probes, the worker and the adapter's step events; begin the first step."""
        from . import probes as p
        from .growth import NewParamsProbe
        from .skips import SkippedStepProbe

        # Before any collective, and before anything is attached (a failed call can be made again): a rank
        # that never calls set_monitor is named within a bound, not after the group's 30-min timeout.
        wait_for_all(self.rank, self.world_size)
        settle()  # what collected monitors left in torch's registries (never removed from a weakref callback)
        self.adapter = adapter
        self.step = self.first_step = self.start_iteration = start_iteration
        self.outputs.coords = adapter.coordinates()
        self.outputs.unreduced_kind = adapter.msprobe_unreduced_kind
        self.xrank.attach()  # collective: a CPU group (the summaries' layout check, the run id)
        adapter.agree(self.xrank.cpu_group)  # collective: which ranks hold the same pipeline stage
        self.outputs.share(self.xrank.cpu_group)  # collective: rank 0's run id on every rank
        self._agree_config()  # collective: rank 0's config on every rank, before the sinks open
        self.detector = self._make_detector()
        deriver = Deriver(self.faults, self.detector)
        self.worker = BackgroundWorker(
            self.outputs.open(self.config),
            self.faults,
            deriver,
            self.config.queue_size,
            observers=(weak_method(self._observe),),  # the worker thread must not keep the loop alive
            interval_s=self.config.write_interval_s,
        )
        worker = self.worker
        deriver.dropped = lambda: worker.dropped_rows
        self._untrack = track(self)  # flushed at exit, or once the model and optimizer are garbage
        self.probes = [
            NewParamsProbe(self),
            p.ActivationProbe(self),
            p.GradientProbe(self),
            p.OptimizerProbe(self),
            *(probe(self) for probe in p.HEALTH_PROBES),  # update, moe_load, attn_logit
            p.SideOutputsProbe(self),
            SkippedStepProbe(self),
            p.CommProbe(self),
        ]
        on_drop(self._untrack, self.probes[-1].release())  # its collective wrappers, should it be dropped
        self.subscribe(self._reselect)
        self.subscribe(self._configure_collector)
        for probe in self.probes:
            self.subscribe(probe.configure)
        self._publish(self.config)
        for probe in self.probes:
            try:  # a probe that cannot attach (an odd model) leaves the others working
                self._handles += probe.attach()
            except Exception as exc:  # noqa: BLE001
                self.faults.record(f"attaching {type(probe).__name__}", exc)
        step_handles = adapter.attach_step(StepEvents(self.on_pre_optim, self.on_post_optim))
        self.hooked = bool(step_handles)
        self._handles += step_handles
        if self._pending_state is not None:
            restore_state(self, self._pending_state)
        self._begin()

    def subscribe(self, fn: Callable[[MonitorConfig], None]) -> None:
        """`fn(config)` runs now-and-then: at attach and at every config reload (the one reload path)."""
        self._subscribers.append(fn)

    def _reselect(self, config: MonitorConfig) -> None:
        self.selection = select_params(self.adapter, config)

    def _configure_collector(self, config: MonitorConfig) -> None:
        self.collector.hold_bytes_accelerator = config.accelerator_hold_mib << 20

    def _publish(self, config: MonitorConfig) -> None:
        self.config = config
        for fn in self._subscribers:
            fn(config)

    def _make_detector(self) -> Any:
        from trainermon.pipeline.anomaly import AnomalyDetector

        alert, group = self.config.alert, self.process_group
        detector = AnomalyDetector.for_job(
            alert, self.outputs.root, self.rank, group, self.outputs.run_id, ops=self.config.ops
        )
        detector.on_anomaly.append(weak_method(self._escalate))  # run by the worker: weakly
        return detector

    def _escalate(self, step: int, anomalies: list) -> None:
        """Worker thread: an anomaly outside the activations asks for every module's activations."""
        if any(a.family not in ("actv", "actv_grad") for a in anomalies):
            self.escalation.request(self.config.alert.escalate_steps)

    def _observe(self, batch: StatBatch) -> None:
        self.last_batch = batch  # worker thread

    # ==== rows (called by probes, from hooks) ========================================================
    def record(self, family: str, entries: list, also_as: str | None = None) -> None:
        """Rows for (vpp_stage, name, micro_step, TensorPiece) entries (see `StepCollector.add`)."""
        with self.clock, self._lock:
            self.collector.add(family, entries, also_as=also_as)

    def record_params(self, family: str, kind: str, also_as: str | None = None) -> None:
        """Rows of the selected parameters' `kind` tensors (an `Adapter.read` kind): from the adapter's
        `read_whole` where it gives them (no piece per tensor), else from `read` through `record`."""
        adapter, sel = self.adapter, self.selection
        whole = adapter.read_whole(kind, sel.params)
        if whole is None:
            self.record(family, sel.entries(adapter.read(kind, sel.params)), also_as)
            return
        placement, tensors = whole
        with self.clock, self._lock:
            self.collector.add_whole(family, sel.stages, sel.names, tensors, placement, also_as)

    def record_local(
        self,
        family: str,
        vpp_stage: int,
        labels: list,
        micro: int | None,
        tensors: Any,
        shards: Sequence[str] = (),
        transient: bool = False,
    ) -> None:
        """Rows for this rank's own tensors seen by a hook (see `StepCollector.add_local`, and there for
        `transient`). The hook that calls it holds `clock` for its whole body (what it costs besides the
        rows is the monitor's too)."""
        with self._lock:
            self.collector.add_local(family, vpp_stage, labels, micro, tensors, shards, transient)

    def record_missing(self, family: str, vpp_stage: int, labels: list, micro: int | None) -> None:
        """NaN rows for module outputs that are not tensors (see `StepCollector.add_missing`); the calling
        hook holds `clock`, as for `record_local`."""
        with self._lock:
            self.collector.add_missing(family, vpp_stage, labels, micro)

    # ==== the step events ===========================================================================
    def on_grads_final(self, again: bool = False) -> None:
        """The step's gradients are final: the probes read them (`grads_final`), once a step. Called by the
        user's gradient clipping before it scales them (`clip_watch`), else at the optimizer's pre-step.
        `again`: they changed since that read; its rows are taken out and the gradients read anew."""
        if not self.plan.scheduled or (self._grads_read and not again):
            return
        with self.clock:
            check_stepping(self)  # under Join: the writer of replicated rows may have run out of inputs
            with self._lock:
                start = self.collector.restart(self._grads_rows if self._grads_read else None)
            self._grads_read = True
            self._each("grads_final", "reading the step's gradients")
            with self._lock:
                self._grads_rows = (start, self.collector.mark())

    def on_pre_optim(self) -> None:
        if not self.plan.scheduled:
            return
        self.on_grads_final()
        with self.clock:
            self._each("pre_optim", "optimizer pre-step")

    def on_post_optim(self, scalars: StepScalars) -> None:
        with self.clock:
            try:
                # A step captured into a CUDA graph: no device work (transfers, collectives) in it
                check_not_capturing()
                if self.plan.scheduled:
                    self._each("post_optim", "optimizer post-step")
                if self.plan.collecting:
                    self._end_collected(scalars)
            except Exception as exc:  # noqa: BLE001 - PrintStructDone is no Exception: it propagates
                self.faults.record("optimizer post-step", exc)
                self.collector.reset()
            self.step += 1
            try:
                self._begin()
            except Exception as exc:  # noqa: BLE001
                self.faults.record("begin step", exc)
                self.plan = StepPlan(step=self.step)

    def manual_step(self, grads: bool = True) -> None:
        """The step boundary for loops whose optimizer is not hooked (`TrainerMon.step()`, after the update):
        no pre-step (param_origin, update: the parameters before the update are gone). `grads`: False when
        the gradients were cleared since the backward (no rows rather than zeros)."""
        if grads and self.plan.scheduled:
            self.on_grads_final()
        self.on_post_optim(StepScalars())

    def _each(self, method: str, where: str) -> None:
        for probe in self.probes:
            try:
                getattr(probe, method)(self.plan)
            except Exception as exc:  # noqa: BLE001
                self.faults.record(where, exc)

    def _check_join(self) -> None:
        if self.joined or self.world_size == 1 or self.adapter is None:
            return
        if self._joinables is None:
            self._joinables = joinables(self.adapter)
        if joining(self._joinables):
            self.joined = True
            say_paused()
            self._handles.append(watch_notices())  # who still steps, from DDP's own per-forward all-reduce

    def _begin(self) -> None:
        self._check_join()
        if self.control is not None and not self.joined:
            self._poll_control()
        config = self.config
        scheduled = (self.control is None or config.dynamic_on) and self.schedule.wants(self.step)
        escalating = not self.off_by_file and self.escalation.active_at(self.step)
        self.plan = plan_step(config, self.step, scheduled, escalating)
        self._step_mark = self.clock.now()
        self._grads_read = False
        if self.adapter is not None:
            self.adapter.new_step()
        self._each("begin", "begin step")  # each probe on its own: one failing skips no other's begin

    def _end_collected(self, scalars: StepScalars) -> None:
        plan = self.plan
        if plan.scheduled:
            self.schedule.mark_collected()
        job_norm = plan.grads and self.adapter is not None and self.adapter.splits_model
        # DDP with late, unreduced parameters on a rank that does not write the reduced ones: no global norm
        partial = plan.grads and not getattr(self.adapter, "holds_every_grad_row", lambda: True)()
        self._check_join()
        tail = self.xrank.tail(plan.scheduled and not self.joined, self.config)  # (collective)
        payload = self.collector.finish(plan.step, scalars, job_grad_norm=job_norm, tail=tail)
        own_ms = (self.clock.now() - self._step_mark) * 1e3
        scalars = dataclasses.replace(
            payload.scalars, monitor_time_ms=own_ms, scheduled=plan.scheduled, partial_grads=partial
        )
        payload = dataclasses.replace(payload, scalars=scalars)
        if self.worker is not None:
            self.worker.submit(payload)  # immutable from here on
        for probe in self.probes:
            probe.end(plan)
        if self.control is not None and self.config.dynamic_on and self.schedule.exhausted:
            # The last collection of this switch-on is done: off in the file (rank 0 writes it) and, on
            # every rank at this same step, in memory, without waiting for the watcher to see the write.
            self.control.switch_off_in_file()
            self.config = dataclasses.replace(self.config, dynamic_on=False)
        if plan.scheduled and self.schedule.exhausted and self.worker is not None:
            self.worker.collection_stopped()  # the schedule's last collection: sinks drop step values

    # ==== checkpoint ===================================================================================
    def state_dict(self) -> dict:
        return saved_state(self)

    def load_state_dict(self, state: dict) -> None:
        check_state(state)  # all of it, here: never an error mid-way through a restore
        if self.adapter is None:
            # applied when set_monitor attaches: a copy, as checked (the caller may reuse its dict)
            self._pending_state = copy.deepcopy(state)
            return
        restore_state(self, state)
        for probe in self.probes:  # the current step's plan came from the state before the load
            probe.begin(StepPlan(step=self.step))
        self.collector.reset()
        self._begin()

    # ==== shutdown =====================================================================================
    def close(self) -> None:
        """Detach, write every queued step and close the sinks. In a forked child (another pid) nothing:
        the parent writes the inherited rows and owns the sinks."""
        if self.closed or os.getpid() != self.pid:
            return
        self.closed = True
        if self._untrack is not None:
            self._untrack()
        settle()
        if self.adapter is not None and self.control is None:  # static mode: say a start never reached
            unreached = self.schedule.start_not_reached(self.first_step, self.step)
            if unreached:
                logger.warning("trainermon: %s", unreached)
        for probe in self.probes:
            try:
                probe.close()
            except Exception as exc:  # noqa: BLE001
                self.faults.record("probe close", exc)
        if self.control is not None:
            self.control.close()
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self._handles.clear()
        if self.adapter is not None:
            try:
                self.adapter.close()
            except Exception as exc:  # noqa: BLE001
                self.faults.record("adapter close", exc)
        if self.worker is not None:
            self.worker.close()
        if self.detector is not None:
            self.detector.close()
        release(self)  # a monitor kept after close() must not keep the model and optimizer alive
