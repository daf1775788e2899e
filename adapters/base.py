"""The adapter interface: adapters describe a framework's model and optimizer; the core acts.

Every adapter answers the same questions, and nothing more:

- the model view: the user's model chunks (`roots`), its parameters under their own names
  (`parameters`), and which modules are only wrappers (`is_wrapper_module`);
- the step events: it calls `events.pre()` when the step's reduced gradients are ready and the update
  has not run, and `events.post(scalars)` when the update is done (`attach_step`);
- the gradients seen in backward: pre-reduce taps (`install_grad_taps`) and each micro-batch's own
  gradient (`install_microbatch_taps`), reported to the core's `GradTaps`;
- where each family's tensors live, as `TensorPiece`s with placements (`read`).

The core never imports a framework; adapters import theirs lazily. Failures inside an adapter's hooks
go to the monitor's `FaultLog` (`self.context.faults`), never into the training loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.compiler import is_compiling  # imported with torch itself

from trainermon.collect.placement import Local, Placement, Sharded, TensorPiece
from trainermon.collect.records import StepScalars
from trainermon.failsafe import FaultLog

from .dtensor import use_stage_map
from .pipelining import stage_map, watch_stages

#: What `read` is asked for: the two gradient families, the parameter, or an optimizer-state key.
GRAD_REDUCED, GRAD_UNREDUCED, PARAM = "grad_reduced", "grad_unreduced", "param"


@dataclass(frozen=True)
class MonitoredParam:
    index: int  # position in the adapter's parameter list; the key used by taps
    vpp_stage: int
    name: str  # the single-process model's name, wrapper segments removed
    param: torch.nn.Parameter
    #: This rank's copy is a piece of the full parameter (a tensor-parallel shard): how its own rows
    #: (pre-reduce gradients) label it, e.g. `Shard(0)[tp=1/2]`.
    local_shard: str = ""


@dataclass
class AdapterContext:
    """What `set_monitor` was told, and where adapter failures are counted."""

    dp_group: Any = None
    tp_group: Any = None
    process_group: Any = None  # msprobe's `process_group` (its pipeline group, in its Megatron example)
    grad_acc_steps: int = 1
    faults: FaultLog = field(default_factory=FaultLog)


class StepEvents:
    """The two moments of a step the core acts on; the adapter calls them from the framework's step."""

    def __init__(self, pre: Callable[[], None], post: Callable[[StepScalars], None]) -> None:
        self.pre = pre
        self.post = post


class GradTaps:
    """Callbacks the core hands to an adapter for gradients seen during backward. `active` is a plain
    attribute so that an always-installed tap returns at once on steps that are not collected."""

    def __init__(
        self,
        on_unreduced: Callable[[Sequence[int], Sequence[torch.Tensor]], None],
        on_microbatch: Callable[[int, torch.Tensor], None],
    ) -> None:
        self.active = False
        self.on_unreduced = on_unreduced
        self.on_microbatch = on_microbatch


def _microbatch_hook(taps: GradTaps, index: int) -> Callable[[torch.Tensor], None]:
    """A parameter's micro-batch hook. Eager: one `is_compiling()` call beyond the report. Under compiled
    autograd dynamo traces a parameter's hooks: the report runs outside the trace (a graph break), since
    traced, the collector's bookkeeping guarded the graph and recompiled at every row it added."""

    def hook(grad: torch.Tensor) -> None:
        if is_compiling():
            _report_outside(taps, index, grad)
        else:
            taps.on_microbatch(index, grad)

    return hook


@torch.compiler.disable
def _report_outside(taps: GradTaps, index: int, grad: torch.Tensor) -> None:
    taps.on_microbatch(index, grad)


class Adapter(ABC):
    name: str = "base"

    def __init__(self, chunks: Sequence[torch.nn.Module], optimizer: Any, context: AdapterContext) -> None:
        self.chunks = list(chunks)
        self.optimizer = optimizer
        self.context = context
        watch_stages()  # torch.distributed.pipelining: its shape inference, where it reduces gradients

    #: What `set_monitor` was given, unwrapped down to `optimizer` (`select_adapter` sets it).
    optimizer_chain: list[Any] = []

    #: The framework's own forward hooks replace module outputs with new tensors (DeepSpeed ZeRO-3), so
    #: the activation hooks go before them: after them, an output's gradient would lack the module's own
    #: uses of it (`return y, f(y)`).
    activation_hooks_first: bool = False

    @classmethod
    def owns_optimizer(cls, optimizer: Any) -> bool:
        """A framework optimizer this adapter reads itself, which is not to be unwrapped (`.optimizer`
        of Megatron's and DeepSpeed's optimizers is their inner torch optimizer)."""
        return False

    @classmethod
    @abstractmethod
    def detect(cls, chunks: Sequence[torch.nn.Module], optimizer: Any) -> bool:
        """True when this adapter handles these objects (checked by type, not by class name alone)."""

    # ---- the model view ------------------------------------------------------------------------
    @abstractmethod
    def roots(self) -> list[torch.nn.Module]:
        """The unwrapped model chunks; module names are relative to these (vpp_stage = index)."""

    def torch_ddps(self) -> list[Any]:
        """The torch DistributedDataParallel objects that reduce the monitored model's gradients, as found
        so far (a DDP found after set_monitor joins later): by default the chunks that are one. A list
        built from what the adapter holds: cheap, read at collected steps only (`cc_distribution`)."""
        from torch.nn.parallel import DistributedDataParallel

        return [c for c in self.chunks if isinstance(c, DistributedDataParallel)]

    def global_name(self, vpp_stage: int, name: str) -> str:
        """The name a single-process model gives the module `name` of chunk `vpp_stage` (pipeline stages
        renumber their layers, expert parallelism its experts). Parameters come named already."""
        return name

    def coordinates(self) -> dict[str, list[int]]:
        """This rank's place in the parallel layout, {"tp": [rank, size], ...}; empty when unknown."""
        return {}

    def activation_shards(self, module: torch.nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Labels for the module's activation inputs and outputs (by position) that are pieces of a
        larger tensor on this rank (a column-parallel layer's output), e.g. `Shard(-1)[tp=1/2]`. By default,
        the inputs and outputs that torch's tensor parallelism turns from a sharded DTensor into a local
        piece (`adapters.tp_styles`)."""
        from .tp_styles import local_input_shards, local_output_shards

        return local_input_shards(module), local_output_shards(module)

    def leaf_output_view(self, param: torch.Tensor) -> torch.Tensor:
        """This call's view of a parameter a module returns as an output (Megatron's `skip_bias_add`): the
        output-gradient hook goes on the view's node. Called only for such outputs, on collected steps."""
        return param.view_as(param)

    def msprobe_unreduced_kind(self, per_micro_batch: bool) -> str:
        """How msprobe's tags name this framework's gradients before the reduction: `acc_grad` where it
        reads them at the parameters' gradient accumulation (plain PyTorch, DDP, and with
        `monitor_mbs_grad`), `pre_grad` where it patches the framework's reduction. Names only."""
        return "acc_grad"

    #: Ranks may hold different pipeline stages (torch.distributed.pipelining): `agree` maps them.
    pipelined: bool = False

    def agree(self, group: Any, failed: bool = False) -> None:
        """Collective over `group` (a gloo group of every rank; None when not distributed), on every rank,
        once, at `set_monitor`: the ranks compare what they hold. A `pipelined` adapter learns which ranks
        hold its pipeline stage (`pipelining.stage_map`: one all-gather of four int64). Never raises: a
        rank that fails before the all-gather (`failed`: in a subclass's own preparation, recorded there)
        still takes part, and every rank then falls back alike to no map."""
        stages = None
        if self.pipelined:
            try:
                roots = self.roots()
            except Exception as exc:  # noqa: BLE001 - the collective runs all the same
                self.context.faults.record("pipeline stage comparison", exc, "no stage map on any rank")
                roots, failed = [], True
            stages = stage_map(roots, self.chunks, group, self.context.faults, failed)
        self._stages = stages
        use_stage_map(self._stages)  # process-wide: a previous monitor's map goes

    @property
    def splits_model(self) -> bool:
        """The model's tensors are spread over ranks that write different ones (pipeline stages, tensor
        or expert parallelism): the global gradient norm sums every rank's written rows (one extra
        one-element all-reduce per step that collects gradients)."""
        return False

    def is_wrapper_module(self, module: torch.nn.Module) -> bool:
        """Modules that only wrap another one (not reported as layers)."""
        return False

    def token_placement(self) -> Placement:
        """How the tokens a layer sees are spread over ranks (for token counts such as MoE expert load):
        by default each rank of the default group routes its own batch; one process: its own."""
        import torch.distributed as dist

        return Sharded(None) if dist.is_available() and dist.is_initialized() else Local()

    def attention_site(self, module: torch.nn.Module) -> Any:
        """The attention site of `module` for the attn_logit family (adapters/attention.py), or None."""
        from .attention import find_site

        return find_site(module)

    @abstractmethod
    def parameters(self) -> list[MonitoredParam]:
        """Every trainable parameter, in model order, named as the user names it."""

    def new_parameters(self) -> list[MonitoredParam]:
        """Parameters that became trainable since `parameters()` was built (unfrozen, or given to the
        optimizer with `add_param_group`), now appended to it with new indices; [] when none (the
        default: adapters whose framework fixes its parameters at setup)."""
        return []

    # ---- the step ------------------------------------------------------------------------------
    @abstractmethod
    def attach_step(self, events: StepEvents) -> list[Any]:
        """Make the framework's step call `events.pre()` and `events.post(scalars)`; return removable
        handles. No handles and no calls when there is no optimizer to hook (the user calls
        `TrainerMon.step()`)."""

    def new_step(self) -> None:  # noqa: B027 - optional hook
        """Called at every step boundary, before the next step's backward."""

    def clip_entries(self) -> Sequence[Any]:
        """The functions that clip this framework's gradients in place between backward and the
        optimizer's pre-step (`trainermon.runtime.clip_watch.ClipEntry`): the step's gradients are read
        before the first of them runs. None, the default: the framework clips inside its optimizer step,
        after the pre-step (Megatron, DeepSpeed)."""
        return ()

    # ---- gradients seen in backward ----------------------------------------------------------------
    def install_grad_taps(self, taps: GradTaps) -> list[Any]:
        """Install always-on pre-reduce taps that call `taps.on_unreduced` during backward. Returns handles.
        An adapter that installs none reads the pre-reduce gradient at the step (`read(GRAD_UNREDUCED)`)."""
        return []

    def arm_grad_taps(self, active: bool) -> None:  # noqa: B027 - optional hook
        """Called at every step boundary with whether this step collects the taps' gradients: an adapter
        whose taps cost something per call installs them here, for those steps only."""

    @property
    def taps_report_unreduced(self) -> bool:
        """The taps report grad_unreduced (so it is not read at the step)."""
        return False

    def report_held_unreduced(self) -> None:
        """Reports the grad_unreduced the taps held back until the step's gradients are final (FSDP's sums
        of a step's reduces), when the core reads them: at the optimizer's pre-step, the user's clipping or
        a step closed without the optimizer (a skipped step). Called again if they are read again."""
        return None

    def single_replica(self) -> bool:
        """True when no data-parallel reduction exists (one replica): the pre- and post-reduce gradients
        are then the same tensors and the core computes them once."""
        return False

    def install_microbatch_taps(self, params: Sequence[MonitoredParam], taps: GradTaps) -> list[Any]:
        """Install taps (only for a collected step) that report each micro-batch's own gradient. The
        default is a tensor hook per parameter, which fires with each backward's gradient before it is
        accumulated into `.grad`; adapters whose parameters are flattened or sharded override it. torch
        refuses a hook on a parameter frozen at the step boundary (`requires_grad=False`: Lightning's
        `toggle_optimizer`, or the user's own freezing): it is tapped by the first forward of its module
        that finds it trainable again (`untoggle_optimizer` before its backward), else it has no
        gradient and no micro-batch row this step."""
        handles: list[Any] = []
        frozen = []
        for mp in params:
            if mp.param.requires_grad:
                handles.append(mp.param.register_hook(_microbatch_hook(taps, mp.index)))
            else:
                frozen.append(mp)
        if frozen:
            handles += self._tap_when_unfrozen(frozen, taps)
        return handles

    def _tap_when_unfrozen(self, frozen: list[MonitoredParam], taps: GradTaps) -> list[Any]:
        """A forward pre-hook on each module owning a frozen parameter: when a forward that records a
        graph finds it trainable, its micro-batch hook is registered (once). Removed with the step's
        handles. A parameter used outside its module's forward is not seen."""
        from .common import Handles, guarded  # (common imports this module)

        owners = self._param_owners(frozen)
        pending: dict[int, tuple[torch.nn.Module, list[MonitoredParam]]] = {}
        for mp in frozen:
            module = owners.get(id(mp.param))
            if module is not None:
                pending.setdefault(id(module), (module, []))[1].append(mp)
        group = Handles()
        # what is still untapped: read at the step's end (`GradientProbe`), to say rows that were lost
        group.waiting = [waiting for _, waiting in pending.values()]  # type: ignore[attr-defined]
        group.waiting.append([mp for mp in frozen if owners.get(id(mp.param)) is None])
        for module, waiting in pending.values():

            def pre_hook(_module: Any, _args: Any, waiting: list[MonitoredParam] = waiting) -> None:
                if not waiting or not torch.is_grad_enabled():
                    return
                for mp in [mp for mp in waiting if mp.param.requires_grad]:
                    waiting.remove(mp)
                    group.items.append(mp.param.register_hook(_microbatch_hook(taps, mp.index)))

            hook = guarded(self.context.faults, "micro-batch tap of an unfrozen parameter", pre_hook)
            group.items.append(module.register_forward_pre_hook(hook))
        return [group]

    def _param_owners(self, wanted: list[MonitoredParam]) -> dict[int, torch.nn.Module | None]:
        """id(parameter) -> the module that holds it directly; built once (again if a parameter in
        `wanted` is not in it: the model changed), on a collected step with a frozen parameter only."""
        owners = getattr(self, "_owners", None)
        if owners is None or any(id(mp.param) not in owners for mp in wanted):
            owners = {}
            for root in self.roots():
                for module in root.modules():
                    for p in module.parameters(recurse=False):
                        owners.setdefault(id(p), module)
            for mp in wanted:  # held outside the model (an optimizer's own tensor): not looked for again
                owners.setdefault(id(mp.param), None)
            self._owners = owners
        return owners

    # ---- where each family lives -------------------------------------------------------------------
    @abstractmethod
    def read(self, kind: str, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        """One piece per parameter (None: no such tensor on any rank this step) of `kind`: GRAD_REDUCED
        (what the optimizer uses, loss scale divided out), GRAD_UNREDUCED (read at the step when no tap
        reports it), PARAM (the values the optimizer updates), or an optimizer-state key ('exp_avg')."""

    def read_whole(
        self, kind: str, params: Sequence[MonitoredParam]
    ) -> tuple[Placement, list[torch.Tensor | None]] | None:
        """`read` where the adapter knows, without looking at each tensor, that every piece of `kind` is a
        whole plain tensor (no DTensor) under one placement that is not `Sharded`: that placement and the
        tensors (None where `read` gives None), which the core records without a `TensorPiece` each. None,
        the default: the core calls `read`."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Remove anything the adapter installed."""
