"""When the activation hooks exist on the model's modules: only on the steps that use them while the model
runs eagerly, and for the rest of the run once torch.compile may have traced it.

Why not always: a module with any forward hook leaves PyTorch's fast call path, even when the hook returns
at once, which costs ~7 us per module call on a cold cache (measured: +1.0 ms per step on a 145-module
model, +2.6% of its step, with no statistic collected). So in eager mode the hooks are added at the
beginning of a collected step and removed at the beginning of the next step that collects none.

Why pinned under torch.compile: dynamo does not guard on module hooks, so a graph traced while the hooks
were absent would never call them. Three cases, each ending with the hooks installed for good ("pinned",
their bodies gated by flags as before):

- graphs compiled before the hooks were chosen (before `set_monitor`, or before a reload that selects
  other modules): dynamo's caches are reset once, so they recompile with the hooks;
- the model (or a wrapper that calls it) traced later: a forward pre-hook kept on each root module sees
  the trace (`torch.compiler.is_compiling()`) and, through a function dynamo runs while tracing
  (`assume_constant_result`: no graph break), installs the hooks before dynamo goes on into the
  submodules, so the very first trace has them (no extra compile);
- anything else compiled while the hooks were absent (a block compiled on its own, whose root runs
  eagerly): seen by dynamo's graph counter at the next collected step, which then resets the caches once,
  and logs it. A block compiled on its own while the hooks were present pins them when dynamo traces the
  first hook (`pin_at_trace`, called by the hooks while traced).

The hooks that dynamo traces (`graph_taps`) are made when the hooks are pinned (`on_pin`), not before: an
eager run never needs them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainermon.copies import CopySafe
from trainermon.runtime.side_passes import SIDE_PASSES

logger = logging.getLogger("trainermon")

#: register(vpp_stage, name, module, extra) -> the handles of the hooks it added to `module`
Register = Callable[[int, str, torch.nn.Module, bool], list[Any]]
#: called once, when the hooks become pinned, before any compiled code can call them
OnPin = Callable[[], None]


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (0 before it is imported: no import here)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    return 0 if dynamo_utils is None else dynamo_utils.counters["stats"]["unique_graphs"]


def compiled_before() -> bool:
    """Whether torch.compile has already compiled a graph in this process."""
    return graphs_compiled() > 0


def recompile_with_hooks(reason: str = "") -> None:
    """Graphs compiled without the hooks never call them: drop dynamo's caches once, so every compiled
    function recompiles at its next call, this time with the hooks in its graph. Cost: one recompile of each
    compiled function in the process. `reason`: why, when it is not the first choice of modules (said at
    WARNING: a reload caused it)."""
    try:
        import torch._dynamo

        torch._dynamo.reset()
        from .hooked_module import never_frames_of_their_own  # here: hooked_module imports this module

        never_frames_of_their_own()  # the reset forgot it for code dynamo had seen
        if reason:
            logger.warning(
                "trainermon: %s while compiled graphs exist, whose hooks are fixed at trace time: dynamo's"
                " caches were reset, so every compiled function in the process (not only the model)"
                " recompiles once at its next call",
                reason,
            )
        else:
            logger.info(
                "trainermon: graphs compiled without the activation hooks do not call them; dynamo's caches"
                " were reset, so compiled code recompiles once at its next call, with the hooks"
            )
    except Exception as exc:  # noqa: BLE001 - the model trains as before; the rows would stay empty
        logger.warning(
            "trainermon: torch.compile compiled graphs without the activation hooks and dynamo's caches could"
            " not be reset (%s); actv/actv_grad stay empty for them: call set_monitor before the first"
            " compiled forward",
            exc,
        )


class ModuleHooks:
    """The hooked modules and their handles. `reset` chooses new modules, `arm` runs at every step's
    beginning, `add` hooks more modules (escalation), `close` removes everything. Costs: `arm` is a few
    attribute reads on steps that keep the current state; installing costs ~5 us per module (on the first
    collected step after steps without collection), removing ~2 us."""

    def __init__(
        self,
        register: Register,
        on_pin: OnPin | None = None,
        on_trace: Callable[[Sequence], None] | None = None,
    ) -> None:
        self._register = register
        self._on_pin = on_pin
        #: run with the hooked modules once per trace that reaches the hooks (the user's hooks registered
        #: since the pin are ordered before the monitor's ones in that graph: `hooked_module.before_traces`)
        self._on_trace = on_trace
        self._traced_at = -1  # dynamo's graph count when `_on_trace` last ran
        self.pinned = False  # installed for the rest of the run (compiled code may call them)
        self._handles: dict[int, list[Any]] = {}  # module id -> its hooks' handles
        self._watchers: list[Any] = []  # the roots' hooks: trace sentinels, and `grad_forward`
        #: a root's forward that began with grad on is running (eager only): a module inside it that runs
        #: without grad in eval mode is a reentrant checkpoint's first pass, not an evaluation pass
        self.grad_forward = False
        self._modules: Sequence[tuple[int, str, torch.nn.Module]] = ()
        self._graphs_without = 0  # dynamo's graph count when the hooks were last removed
        #: pins the hooks when dynamo traces a call of this function (see `reset`); made by `reset`
        self.pin_at_trace: Callable[[], bool] = lambda: True

    @property
    def modules(self) -> Sequence[tuple[int, str, torch.nn.Module]]:
        """The modules hooked (or hooked on collected steps); kept while the activation families are off."""
        return self._modules

    def keeps(self, modules: Sequence[tuple[int, str, torch.nn.Module]], families_off: bool) -> bool:
        """Whether `reset(modules)` keeps the installed hooks as they are: pinned, and the same modules, or
        none only because the activation families are off (each hook then returns at once: its flags are
        false, and dynamo guards on them). Removing pinned hooks, or hooking new modules, would need a reset
        of dynamo's caches: every compiled function in the process recompiles. Costs a list comparison."""
        if not (self.pinned and self._handles):
            return False
        if not modules:
            return families_off
        return [(v, n, id(m)) for v, n, m in modules] == [(v, n, id(m)) for v, n, m in self._modules]

    def reset(
        self,
        modules: Sequence[tuple[int, str, torch.nn.Module]],
        roots: Sequence[torch.nn.Module],
        keep: bool = False,
    ) -> None:
        """Hook `modules` from now on (none: remove everything). Pinned at once when graphs exist already.
        `keep` (see `keeps`): the hooks stay as they are. Otherwise, once pinned with graphs compiled, a
        change of the hooked modules resets dynamo's caches (said at WARNING)."""
        if keep:
            if modules:
                self._modules = modules
            return
        before = {id(m) for _, _, m in self._modules}
        self.close()
        self._modules = modules
        if not modules:
            return
        import torch.compiler  # not at module level: the core imports no framework machinery eagerly

        # Run by dynamo while it traces (a constant to the graph: no graph break, fullgraph=True works)
        def pin_at_trace() -> bool:
            self._pin()
            if self._on_trace is not None and (count := graphs_compiled()) != self._traced_at:
                self._traced_at = count  # once per trace: the count moves when a trace ends
                self._on_trace(self._modules)
            return True

        self.pin_at_trace = torch.compiler.assume_constant_result(pin_at_trace)
        pin = self.pin_at_trace

        def watch(module: torch.nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                pin()
            else:
                self.grad_forward = torch.is_grad_enabled()

        def done(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not torch.compiler.is_compiling():
                self.grad_forward = False

        for root in roots:
            self._watchers.append(root.register_forward_pre_hook(CopySafe(watch)))
            self._watchers.append(root.register_forward_hook(CopySafe(done), always_call=True))
        if compiled_before():
            self._set_pinned()
        if self.pinned:
            self.add(modules, extra=False)
            if compiled_before():
                new = [n for _, n, m in modules if id(m) not in before]
                recompile_with_hooks(_why(new, bool(before)))
            return
        self._graphs_without = graphs_compiled()

    def arm(self, wanted: bool) -> None:
        """At a step's beginning: the hooks exist on this step iff it collects (unless pinned)."""
        if self.pinned:
            return
        if wanted and not self._handles:
            if graphs_compiled() != self._graphs_without:  # traced while the hooks were absent
                self._pin()
                recompile_with_hooks()
                return
            self.add(self._modules, extra=False)
        elif not wanted and self._handles:
            self._remove_hooks()
            self._graphs_without = graphs_compiled()

    def add(self, modules: Sequence[tuple[int, str, torch.nn.Module]], extra: bool) -> None:
        """Hook the modules not hooked yet."""
        handles = self._handles
        for vpp_stage, name, module in modules:
            if id(module) not in handles:
                handles[id(module)] = self._register(vpp_stage, name, module, extra)

    def _pin(self) -> None:
        if not self.pinned:
            self._set_pinned()
            self.add(self._modules, extra=False)

    def _set_pinned(self) -> None:
        if not self.pinned:
            self.pinned = True
            if self._on_pin is not None:
                self._on_pin()

    def _remove_hooks(self) -> None:
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles.clear()

    def close(self) -> None:
        self._remove_hooks()
        for handle in self._watchers:
            handle.remove()
        self._watchers.clear()
        self.grad_forward = False


def _why(new: list[str], hooked_before: bool) -> str:
    """Why the hooked modules changed (for `recompile_with_hooks`); "" for the first choice of modules."""
    if not hooked_before:
        return ""
    if new:
        more = f" and {len(new) - 4} more" if len(new) > 4 else ""
        return (
            f"the activation modules changed: modules not hooked were selected ({', '.join(new[:4])}{more})"
        )
    return "the activation modules changed: modules no longer selected lose their hooks"


class ModuleTree:
    """What the model's module tree looked like when the activation modules were selected: each module's
    child slots (dict, key, child) and their count, so that a module replaced, added or removed anywhere
    under the roots (`model.head = nn.Linear(...)`) is seen. `changed` costs one dict read per module
    (~90 us for 800 modules, measured on a shared CPU), and runs on collected steps only."""

    def __init__(self) -> None:
        self._slots: list[tuple[dict, str, Any]] = []
        self._sizes: list[tuple[dict, int]] = []

    def take(self, roots: Sequence[torch.nn.Module]) -> None:
        self._slots, self._sizes = [], []
        for root in roots:
            for module in root.modules():
                if isinstance(module, torch.jit.ScriptModule):  # its slots are fixed (and hold no `get`)
                    continue
                children = module._modules
                self._sizes.append((children, len(children)))
                self._slots.extend((children, k, c) for k, c in children.items())

    def clear(self) -> None:
        self._slots, self._sizes = [], []

    def changed(self) -> bool:
        return not (
            all(len(d) == n for d, n in self._sizes) and all(d.get(k) is c for d, k, c in self._slots)
        )


def not_a_micro_batch() -> bool:
    """A call inside a torch.func transform (vmap, grad, functionalize: per-sample gradients): its tensors
    are wrappers without addressable values, and the call is not one of the step's micro-batches; or a
    framework's own pass (`side_passes`)."""
    return _functorch_level() is not None or SIDE_PASSES.depth > 0


_functorch_level = torch._C._functorch.maybe_current_level


def in_backward() -> bool:
    """A forward recomputed inside backward (activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1
