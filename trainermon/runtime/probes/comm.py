"""Communication monitoring (`cc_distribution`): the probe that arms the collective wrappers on collected
steps only, and at each collected step's end turns what they saw into `comm` rows and runs the invariant
checks (see `trainermon.comm`).

    begin(plan)      scheduled step: patch the watched collectives (and count forwards for micro_step);
                     any other step: every patch undone, nothing runs
    post_optim       the step's sums become rows of the step's collector (before its one transfer); the
                     check table goes through one all-reduce; violations become AnomalyComm records
    close()          every patch undone

With DDP, the gradient all-reduces run inside the C++ reducer, out of reach of any Python patch: when
`cc_distribution` is on, the probe installs a delegating hook that runs DDP's default all-reduce through
`torch.distributed` and hands the slot to a hook the user registers later (`trainermon.comm.ddp_slot`),
not in `cc_log_only` mode (said once: a Python hook there would change DDP's arithmetic and cost every
step, for a listing). The cross-rank checks: `comm_table`."""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from trainermon.comm.checks import Violation
from trainermon.comm.ddp_slot import share_slot
from trainermon.comm.patch import Patches
from trainermon.comm.pipe_passes import PIPE
from trainermon.comm.recorder import CommRecorder, PendingMicro
from trainermon.comm.spec import BATCH_P2P, all_specs
from trainermon.config import MonitorConfig
from trainermon.copies import CopySafe

from ..lifecycle import weak_method
from ..plan import StepPlan
from ..side_passes import SIDE_PASSES
from .base import Probe
from .comm_ops import OpsSpy, warn_unmatched, write_sites
from .comm_table import CheckTable
from .module_hooks import in_backward

logger = logging.getLogger("trainermon")


class CommProbe(CheckTable, Probe):
    def __init__(self, loop: Any) -> None:
        super().__init__(loop)
        # The wrappers (in torch.distributed, process-wide) hold the recorder: it reaches the loop and this
        # probe weakly, so a monitor dropped without close() is freed (then its wrappers call through).
        self.recorder = CommRecorder(weak_method(self._compute), loop.faults.record, loop.rank, loop._lock)
        ref = weakref.ref(loop)
        # the monitor's own: calls made inside its code on the thread that is in it (not a hook's Future
        # callback on gloo's thread meanwhile)
        self.recorder.busy = lambda: (alive := ref()) is None or alive.clock.busy_here()
        self.recorder.micro = weak_method(self._micro)
        self.recorder.recv_micro = weak_method(self._recv_micro)
        self.patches = Patches()
        self.enabled = False
        self.specs: list = []
        self.batch = False
        self.violations: list[tuple[int, Violation]] = []  # (step, violation), for tools and tests
        self.unchecked = 0
        self._counts: list[int] = []  # forwards this step per hooked root (a virtual pipeline's chunks)
        self._current = 0  # the micro-step of the forward that ran last
        self._in_forward = self._pipeline = False
        self._backward: int | None = None  # the micro-step of the backward that ran last, if it is newer
        self._waiting: list[PendingMicro] = []  # receives made between passes: labelled by the next pass
        self._forward_handles: list[Any] = []
        self._ddp_done: set[int] = set()
        self._attached = False
        self._warned: set[str] = set()
        self._pending: Any = None  # a check table still on its way to the host (accelerators)
        self._rows = True  # this rank writes comm rows (`module_ranks`; its checks run all the same)
        self._spy: OpsSpy | None = None  # `ops` set: what the first collected step called (`comm_ops`)

    def _compute(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        with self.loop._lock:
            return self.loop.engine.compute_rows(tensors)

    # ==== lifecycle ==============================================================================
    def configure(self, config: MonitorConfig) -> None:
        cc = config.cc_distribution
        self._rows = not config.module_ranks or self.loop.rank in config.module_ranks
        self._off()
        self.patches.forget_aliases()
        self.enabled = cc.enable
        self.recorder.configure(cc)
        wanted = set(cc.ops) if cc.ops is not None else None
        self.specs = [s for s in all_specs() if wanted is None or s.config in wanted]
        self.batch = wanted is None or BATCH_P2P in wanted
        # `ops` set: every collective (functional ones only if watched) is wrapped at the next collected
        # step, to name those called if none of `ops` is (`comm_ops.OpsSpy`); that step's end unwraps them,
        # so the next install wraps only `ops`' again
        self._spy = OpsSpy(self.recorder, wanted) if wanted is not None and self.enabled else None
        self._warned.discard("ops")  # said again after a reload that still sees none
        if self.enabled and self._attached:
            self._hook_ddp()
        if self.enabled and cc.cc_log_only and self._ddp_done:
            self._warn_once(  # a registered comm hook cannot be removed: the full mode's stays
                "log_only_kept",
                "trainermon: cc_log_only after the full mode: DDP keeps the delegating comm hook installed "
                "then (a comm hook cannot be removed), so its gradient all-reduces are listed from now on",
            )

    def attach(self) -> list[Any]:
        # After the other probes: the DDP adapter's own comm hook (wg_distribution) comes first.
        self._attached = True
        if self.enabled:
            self._hook_ddp()
        return []

    def begin(self, plan: StepPlan) -> None:
        if self._pending is not None:
            self._settle_pending()
        if not (self.enabled and plan.scheduled):
            if self.recorder.on or self.patches.installed:
                self._off()
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            self._warn_once(
                "no_dist",
                "trainermon: cc_distribution is on but torch.distributed is not initialized: no collective "
                "to watch, so no comm rows (the check runs again at each collected step)",
            )
            return
        self._hook_ddp()  # a DDP the adapter found since (after the first collected step)
        self.recorder.reset()
        self._current, self._in_forward, self._backward = 0, False, None
        self._waiting.clear()
        PIPE.reset(True)
        if not self.patches.installed:
            self._pipeline = _pipeline_stages(self.loop.adapter) > 1
            if self._spy is not None and self._spy.counting:
                # batch_isend_irecv as configured: wrapped, it would hide the isend/irecv it makes
                # functional collectives only when watched: their wrappers break a fullgraph compile
                spied = [s for s in all_specs() if not s.functional or s.config in self._spy.wanted]
                self.patches.install(spied, self.batch, self._spy)
            else:
                self.patches.install(self.specs, self.batch, self.recorder)
            # every chunk of a virtual pipeline, each counting its own micro-batches; elsewhere the first
            # root's forwards say the micro-step (and backward k follows forward k)
            roots = self.loop.adapter.roots()
            self._counts = [0] * len(roots if self._pipeline else roots[:1])
            for chunk, root in enumerate(roots[: len(self._counts)]):
                hook = root.register_forward_pre_hook(
                    CopySafe(functools.partial(self._count, chunk)), prepend=True
                )
                self._forward_handles.append(hook)
                if self._pipeline:
                    done = CopySafe(functools.partial(self._forward_done, chunk))
                    self._forward_handles.append(root.register_forward_hook(done))
        self._counts = [0] * len(self._counts)
        self.recorder.on = True

    # ==== micro_step ================================================================================
    # A pipeline schedule interleaves passes (1F1B: backward k after forward k+pp-s-1) and moves data
    # between them: a collective belongs to the pass it is made in (a backward's all-reduces) or the one
    # that just ran (an output or gradient sent after it); under a pipeline schedule, a receive made between
    # passes belongs to the next pass, whichever kind it is (the next forward's input, the next backward's
    # gradient). Without one, every call takes the latest forward (backward k follows forward k), and no
    # hook beyond the forward pre-hook is installed.
    def _count(self, chunk: int, module: Any, args: Any) -> None:
        if SIDE_PASSES.depth:  # a framework's own pass (pipelining's shape inference): no micro-batch
            return
        self._counts[chunk] += 1
        self._current = self._counts[chunk] - 1
        self._in_forward, self._backward = True, None
        self._label_waiting(self._current)

    def _forward_done(self, chunk: int, module: Any, args: Any, output: Any) -> None:
        self._in_forward = False
        # a side pass runs no micro-batch's backward; a traced root has no node to hook (reading grad_fn
        # breaks the graph)
        if SIDE_PASSES.depth or torch.compiler.is_compiling():
            return
        node = _grad_node(output)
        if node is not None:  # its pre-hook runs first in this forward's backward: that backward's start
            node.register_prehook(_BackwardStart(self, self._counts[chunk] - 1))

    def _backward_start(self, micro: int) -> None:
        self._backward = micro
        self._label_waiting(micro)

    def _label_waiting(self, micro: int) -> None:
        if self._waiting:
            for pending in self._waiting:
                pending.value = micro
            self._waiting.clear()

    def _micro(self) -> int:
        """The micro-step of the pass running or that ran last: a few attribute reads per collective."""
        if PIPE.micro is not None:  # a torch.distributed.pipelining stage's pass: its schedule says which
            return PIPE.micro
        return self._backward if self._backward is not None else self._current

    def _recv_micro(self) -> int | PendingMicro:
        """A receive between passes: a label the next pass sets (one small object per such receive)."""
        if not self._pipeline or self._in_forward or PIPE.micro is not None or in_backward():
            return self._micro()
        pending = PendingMicro(self._micro())  # kept if no pass follows in the step
        self._waiting.append(pending)
        return pending

    def post_optim(self, plan: StepPlan) -> None:
        if not self.recorder.on:
            return
        recorder = self.recorder
        late = recorder.settle()
        if late:
            self._warn_once("late", "trainermon: %d collective(s) had not completed at the step's end", late)
        warn_unmatched(self)
        spied = self._spy is not None and self._spy.counting
        if spied:
            message = self._spy.verdict(plan.step)
            if message is not None:
                self._warn_once("ops", message)
        try:
            self._take(plan)
        finally:
            if spied:
                self._off()  # the spy's wrappers of every collective go: the next install wraps only `ops`'

    def _take(self, plan: StepPlan) -> None:
        """The step's comm rows to the collector, and the cross-rank checks (a collective on every rank)."""
        recorder = self.recorder
        if recorder.config.cc_log_only:
            write_sites(self)
            recorder.reset()
            return
        checks: list = []
        try:
            rows, parts, entries = recorder.take()
            checks = entries if recorder.config.check else []
            if self._rows:
                with self.loop._lock:
                    self.loop.collector.add_computed(rows, parts)
        except Exception as exc:  # noqa: BLE001 - the check below must still run: other ranks wait in it
            self.loop.faults.record("comm rows", exc, "this step's comm rows are dropped")
        finally:
            recorder.reset()
            PIPE.reset(False)  # no p2p tagging on the steps that follow until the next collected one
        if recorder.config.check and self.loop.world_size > 1 and not self.loop.joined:
            self._check(plan.step, checks)

    def close(self) -> None:
        self._off()
        self._settle_pending(wait=True)

    def release(self) -> Callable[[], None]:
        """What undoes this probe's process-wide patches without holding the probe or the loop: queued by
        `lifecycle` if the monitor is dropped unclosed."""
        return functools.partial(_release, self.patches)

    def _off(self) -> None:
        self.recorder.on = False
        PIPE.reset(False)
        self.patches.uninstall()
        for handle in self._forward_handles:
            handle.remove()
        self._forward_handles.clear()

    # ==== DDP, log-only, warnings =================================================================
    def _hook_ddp(self) -> None:
        """Shares the comm-hook slot of each DDP the adapter has found and this probe has not hooked: the
        DDP may sit under torch.compile or around the module set_monitor got, or be found after the first
        collected step (then hooked at the next one's `begin`). A short list walk per collected step."""
        finder = getattr(self.loop.adapter, "torch_ddps", None)
        for ddp in finder() if finder is not None else []:
            if id(ddp) in self._ddp_done:
                continue
            if self.recorder.config.cc_log_only:
                # Not hooked: the delegate's Python all-reduce is not DDP's C++ one bit for bit (3 ranks:
                # 1.5e-8 apart), costs ~10 us per bucket per backward and takes the slot of a builtin hook
                self._warn_once(
                    "log_only_ddp",
                    "trainermon: cc_log_only: DDP's gradient all-reduces run in its C++ reducer and are not "
                    "in comm_call_sites.csv; cc_distribution without cc_log_only records them (through a "
                    "Python comm hook on DDP)",
                )
                continue
            self._ddp_done.add(id(ddp))
            try:
                share_slot(ddp)
            except Exception as exc:  # noqa: BLE001 - DDP refused: its own path stays
                logger.warning(
                    "trainermon: cc_distribution cannot see DDP's gradient all-reduces (%s); "
                    "collectives called from Python are still watched",
                    exc,
                )

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)


class _BackwardStart:
    """The pre-hook of a forward's output node: its backward has started (one per forward, collected
    steps only; slots, no closure cells, as `GradRows`)."""

    __slots__ = ("probe", "micro")

    def __init__(self, probe: CommProbe, micro: int) -> None:
        self.probe, self.micro = probe, micro

    def __call__(self, grad_outputs: tuple) -> None:
        self.probe._backward_start(self.micro)


def _release(patches: Patches) -> None:
    if patches.installed:
        patches.uninstall()
        PIPE.reset(False)  # a dropped monitor's collected step left the stages' tagging on


def _grad_node(output: Any) -> Any:
    """The autograd node of the forward's first output tensor that has one (None: no backward will run)."""
    if isinstance(output, torch.Tensor):
        return output.grad_fn
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor) and item.grad_fn is not None:
                return item.grad_fn
    if isinstance(output, dict):
        return _grad_node(list(output.values()))
    return None


def _pipeline_stages(adapter: Any) -> int:
    """The pipeline's stage count as the adapter knows it (1: none, or not known)."""
    try:
        return int(adapter.coordinates().get("pp", (0, 1))[1])
    except Exception:  # noqa: BLE001 - a layout read wrongly costs the receives' labels only
        return 1
