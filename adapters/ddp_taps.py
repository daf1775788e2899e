"""DDP's reduce taps: each rank's gradient before DDP all-reduces it, and which parameters DDP reduces.

`DdpReduceTaps` is a mixin of `torch_ddp.TorchAdapter`, which provides `chunks`, `context`, `optimizer`,
`_roots`, `_ddps` (the DDPs around the model), `parameters()`, `splits_model`, `_replica_of`,
`_plain_copies` and `_replica`.

- Pre-reduce gradient: a post-accumulate-grad hook on each parameter, on the backward that DDP reduces
  (its forward ran with gradient sync on, i.e. outside `no_sync()`; a forward pre-hook on each DDP
  remembers it). Armed on collected steps only (`arm_grad_taps`): no per-parameter work otherwise.
  A gradient accumulated under `no_sync()` of a parameter the syncing forward does not use (layer drop,
  routing; `find_unused_parameters`) gets no such hook call, yet DDP reduces it: it is taken right after
  that forward, before the backward can divide it in place (`_take_unused`).
- The set DDP's reducer holds (`_reducer_held`, read from its buckets): a parameter made trainable after
  DDP was built is never all-reduced (`_say_unreduced`); its rows are this rank's own. One frozen after
  the build and unfrozen later is reduced: its rows are DDP's (one writer).
- A DDP made after set_monitor around the monitored model is looked for once (`_late_ddps`).
- The collector spans of the taps' rows (`row_spans`): taken out when the loop clears those gradients
  unused (`gradients_unused`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainermon.runtime.side_passes import SIDE_PASSES

from .base import GradTaps, MonitoredParam
from .common import OncePerStep, RowSpans, guarded
from .ddp_find import ddps_wrapping, say_post_reduce
from .pipelining import on_stage_reduce

logger = logging.getLogger("trainermon")


class DdpReduceTaps:
    """Mixin: DDP's pre-reduce taps and the parameters its reducer holds (state set by `_init_taps`)."""

    def _init_taps(self) -> None:
        """The taps' state; `_ddps` is known (the DDPs found at set_monitor). No hook is made here."""
        self._looked_late = False
        self._late_handles: list[Any] = []
        self._tapped = False
        self._seen = OncePerStep("DDP")
        self.row_spans = RowSpans()  # where the taps' rows lie: taken out when the loop clears them unused
        self._held = self._reducer_held()  # what DDP's reducer holds (see _reducer_held)
        self._unreduced: set[int] = set()  # parameters trainable later, which DDP does not reduce
        self._taps: GradTaps | None = None
        self._report_tap: Any = None
        self._syncing: list[tuple[Any, list]] = []  # (DDP, [reduces the latest forward's backward])
        self._armed: list[Any] = []  # this step's post-accumulate-grad hooks
        self._armed_params: dict[int, list[tuple[torch.Tensor, int]]] = {}  # id(DDP) -> (param, index)
        self._accumulated: set[int] = set()
        self._after: list[Any] = []  # a syncing forward's one-shot forward hook (`_take_unused`)

    def _reducer_held(self) -> set[int]:
        """The ids of the parameters DDP reduces: those its reducer was built with (trainable and not
        ignored when DDP was built, whatever their flag now), and those of `delay_all_reduce_named_params`.
        torch keeps no Python list of them. Those trainable now are taken when their count and bytes
        equal what DDP's logging data says its reducer holds (the usual case: nothing frozen or unfrozen
        since the build; no allocation); else they are read from the reducer's buckets, once per DDP
        found (`_get_zeros_like_grad_buckets` allocates one zero copy of the bucketed gradients, freed at
        once). Without that private API, those trainable now are taken (said)."""
        held: set[int] = set()
        for d in self._ddps:
            delayed = {id(p) for p in getattr(d, "_delay_all_reduce_params", ())}
            held.update(delayed)
            # ignored on purpose (`_ddp_params_and_buffers_to_ignore`: the user reduces them): not said
            ignored = getattr(d, "parameters_to_ignore", None) or ()
            held.update(id(p) for n, p in d.module.named_parameters() if n in ignored)
            reducer = getattr(d, "reducer", None)
            if reducer is None and getattr(d, "_delay_all_reduce_all_params", False):
                continue  # every parameter's all-reduce is delayed: held above, no reducer
            now = [
                p
                for p in getattr(d, "_module_parameters", None) or d.module.parameters()
                if p.requires_grad and id(p) not in delayed
            ]
            if _as_built(d, now):
                held.update(id(p) for p in now)
                continue
            try:
                buckets = reducer._get_zeros_like_grad_buckets()  # type: ignore[union-attr]
                held.update(id(p) for b in buckets for p in b.parameters())
                del buckets
            except Exception:  # noqa: BLE001 - another torch: fall back to the flags now
                logger.warning(
                    "trainermon: could not read which parameters DistributedDataParallel's reducer holds "
                    "(torch's private Reducer API changed): those trainable now are taken as reduced by "
                    "DDP, so a parameter frozen or unfrozen since DDP was built may be misplaced in the rows"
                )
                held.update(
                    id(p)
                    for p in getattr(d, "_module_parameters", None) or d.module.parameters()
                    if p.requires_grad
                )
        return held

    def _say_held_unreduced(self, params: list[MonitoredParam]) -> None:
        """At set_monitor (or when a DDP made later is found): monitored parameters trainable now that
        DDP's reducer does not hold (frozen when DDP was built, unfrozen since). A set lookup each, once."""
        if self._ddps and not getattr(self, "_tensor_parallel", False):
            self._say_unreduced([mp for mp in params if id(mp.param) not in self._held])

    def _find_ddps(self) -> bool:
        """Looks among live objects for DDPs around the monitored modules (one pass over the garbage
        collector's objects, ~0.1-0.4 s; never per step). Whether it looked (a process group exists)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return False
        self._ddps = ddps_wrapping(self._roots)
        if self._ddps:
            logger.info(
                "trainermon: found the DistributedDataParallel around the monitored model among live "
                "objects: grad_unreduced is each rank's gradient before DDP's all-reduce"
            )
        return True

    def _say_unreduced(self, params: list[MonitoredParam]) -> None:
        """Parameters that became trainable after DDP was built: its reducer never all-reduces them (each
        rank steps its own copy with its own gradient). Their rows are this rank's (every rank writes
        them), and a tap on them writes their `.grad` as grad_unreduced (re-armed at the next step)."""
        if not params:
            return
        self._unreduced.update(id(mp.param) for mp in params)
        names = [mp.name for mp in params]
        logger.warning(
            "trainermon: %s became trainable after DistributedDataParallel was built: DDP does not "
            "all-reduce them (each rank updates its own copy with its own gradient, so the replicas "
            "diverge; build the DDP again with them trainable to have them reduced). Their grad_reduced, "
            "param and optimizer-state rows are written by every rank (this rank's values), and their "
            "gradient as grad_unreduced",
            ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else ""),
        )
        self._disarm()  # armed again at the next collected step, with a tap on them

    def new_step(self) -> None:
        self._accumulated.clear()
        self._seen.clear()
        self.row_spans.clear()

    def gradients_unused(self) -> list[list]:
        """The loop cleared the gradients of a backward no optimizer step used (a GAN's generator loss
        through the monitored model, FGSM): the next reduce of this step is recorded afresh. Returns the
        collector spans of the rows the taps took from them, to be taken out (no tensor work)."""
        self._seen.clear()
        return self.row_spans.take()

    def install_grad_taps(self, taps: GradTaps) -> list[Any]:
        self._taps = taps
        self._report_tap = guarded(self.context.faults, "DDP gradient tap", self._report)
        return self._watch_ddps()

    def _watch_ddps(self) -> list[Any]:
        handles: list[Any] = []
        for ddp in self._ddps:
            syncing = [True]  # whether DDP reduces the backward of the latest forward

            def remember(module: Any, args: Any, syncing: list = syncing) -> None:
                # a pipeline stage's shape inference (a side pass) runs DDP outside no_sync(): no reduce
                syncing[0] = torch.is_grad_enabled() and module.require_backward_grad_sync
                syncing[0] = syncing[0] and SIDE_PASSES.depth == 0
                if self._armed and syncing[0]:  # a collected step's syncing forward only
                    self._note_accumulated(module)

            def reduces_next(syncing: list = syncing) -> None:
                syncing[0] = True

            handles.append(ddp.register_forward_pre_hook(remember))
            # a pipeline stage runs every forward under no_sync() and reduces in its last backward
            handles.append(on_stage_reduce("last_backward", ddp, reduces_next))
            self._syncing.append((ddp, syncing))
        self._tapped = bool(self._ddps)
        return handles

    def arm_grad_taps(self, active: bool) -> None:
        """The per-parameter hooks exist only on steps that collect them: a Python call per parameter
        per backward is measurable on steps that collect nothing (docs/PERFORMANCE.md)."""
        if not active or self._taps is None:
            self._disarm()
            return
        if self._armed:
            return
        if not self._syncing:  # no DDP: nothing to arm (no per-step work)
            return
        by_id = {id(mp.param): mp for mp in self.parameters()}
        taps, report = self._taps, self._report_tap
        for ddp, syncing in self._syncing:
            for p in ddp.module.parameters():
                mp = by_id.get(id(p))
                if mp is None or not p.requires_grad:  # frozen since the selection: torch refuses a hook
                    continue

                def tap(param: torch.Tensor, index: int = mp.index, syncing: list = syncing) -> None:
                    if taps.active and syncing[0]:
                        report(index, param.grad, taps)
                    elif not syncing[0]:
                        self._accumulated.add(id(param))

                self._armed.append(p.register_post_accumulate_grad_hook(tap))
                self._armed_params.setdefault(id(ddp), []).append((p, mp.index))

    def _note_accumulated(self, ddp: Any) -> None:
        """A collected step's syncing forward of `ddp`, which may leave parameters unused: those with a
        gradient already (accumulated under `no_sync()`) are looked at once the forward returned
        (`_take_unused`). A `.grad` test per tapped parameter; nothing where DDP requires every
        parameter to be used (then every one gets its tap call; static_graph: DDP looks for none, and a
        reentrant checkpoint's parameters are outside the forward's graph). Only gradients a `no_sync()`
        backward of this step accumulated (`_accumulated`), not stale or zeroed ones."""
        self._drop_after()
        if not getattr(ddp, "find_unused_parameters", False) or getattr(ddp, "static_graph", False):
            return
        acc = self._accumulated
        held = [(p, i) for p, i in self._armed_params.get(id(ddp), ()) if id(p) in acc and p.grad is not None]
        if not held:
            return
        take = guarded(self.context.faults, "DDP unused-gradient tap", self._take_unused)

        def after(module: Any, args: Any, output: Any) -> None:
            self._drop_after()
            take(output, held)

        self._after.append(ddp.register_forward_hook(after))

    def _take_unused(self, output: Any, held: list[tuple[torch.Tensor, int]]) -> None:
        """Rows of the accumulated gradients in `held` whose parameters the forward's graph does not
        reach: DDP's reducer marks them ready and all-reduces them at the first hook of the backward, and
        no tap fires for them. Their `.grad` now is this rank's gradient before that reduce (undivided
        even as a bucket view). Costs a walk of the autograd graph from the outputs, on collected steps
        whose syncing forward follows `no_sync()` micro-batches; it stops once every one is reached."""
        taps, report = self._taps, self._report_tap
        if taps is None or not taps.active:
            return
        left = {id(p): (p, i) for p, i in held}
        _unreach(output, left)
        for p, i in left.values():
            report(i, p.grad, taps)

    def _drop_after(self) -> None:
        for handle in self._after:
            handle.remove()
        self._after.clear()

    def _late_ddps(self) -> None:
        """At the end of the first collected step that reads gradients, with no DDP found at set_monitor:
        a DDP made since around the monitored model is looked for once (one pass over live objects). If
        found, this step writes no grad_unreduced (its gradients are reduced already; the taps arm from
        the next collected step on); none found in a job of several ranks is said once (grad_unreduced is
        then `.grad` at the step: after any all-reduce done outside DDP)."""
        self._looked_late = True
        looked = self._find_ddps()
        if self._ddps:
            if not self._plain_copies:
                self._replica = self._replica_of(self.context.dp_group)
            self._late_handles = self._watch_ddps()
            self._held = self._reducer_held()
            self._say_held_unreduced(self.parameters())
        elif looked and not self.splits_model:
            say_post_reduce(loud=self.context.dp_group is not None)

    def _disarm(self) -> None:
        for handle in self._armed:
            handle.remove()
        self._armed.clear()
        self._armed_params.clear()
        self._accumulated.clear()
        self._drop_after()

    def close(self) -> None:
        self._disarm()
        for handle in self._late_handles:
            handle.remove()
        self._late_handles.clear()

    @property
    def taps_report_unreduced(self) -> bool:
        return self._tapped

    def _report(self, index: int, grad: torch.Tensor | None, taps: GradTaps) -> None:
        if grad is not None and self._seen.fresh((index,)):
            self.row_spans.around(lambda: taps.on_unreduced((index,), (grad,)))


def _unreach(output: Any, left: dict[int, tuple[torch.Tensor, int]]) -> None:
    """Takes out of `left` (id(param) -> entry) the parameters the autograd graph of `output` reaches (as
    DDP's `find_unused_parameters` search does); stops once `left` is empty. One visit per graph node."""
    try:
        from torch.nn.parallel.distributed import _find_tensors

        tensors = list(_find_tensors(output))
    except Exception:  # noqa: BLE001 - another torch: tensors at the top level or in a tuple/list/dict
        items = output.values() if isinstance(output, dict) else output
        tensors = [t for t in (items if isinstance(items, (tuple, list)) else [items]) if torch.is_tensor(t)]
    stack: list[Any] = []
    for t in tensors:
        left.pop(id(t), None)  # a parameter returned as it is
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
    seen: set[Any] = set()
    while stack and left:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad: a leaf's gradient
        if var is not None:
            left.pop(id(var), None)
            continue
        stack.extend(f for f, _ in fn.next_functions if f is not None and f not in seen)


def _as_built(ddp: Any, trainable: list[torch.nn.Parameter]) -> bool:
    """Whether `trainable` has the count and bytes of the parameters DDP's reducer was built with (its
    logging data: `num_parameter_tensors`, `total_parameter_size_bytes`). A few dict reads, once."""
    try:
        data = ddp._get_ddp_logging_data()
        count, size = int(data["num_parameter_tensors"]), int(data["total_parameter_size_bytes"])
    except Exception:  # noqa: BLE001 - another torch: read the buckets
        return False
    return count == len(trainable) and size == sum(p.numel() * p.element_size() for p in trainable)
