"""`HookedModule`: the state the two activation hooks of one module share, and how the hooks behave when
dynamo traces them, when compiled code calls them, and when the model is copied (see `copies`).
The hooks' bodies are `ActivationProbe`'s (`activations`)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch.compiler import is_compiling  # imported with torch itself

from ...copies import drop_copied_hooks
from .module_hooks import not_a_micro_batch
from .slots import UNTAPPED, Names

if TYPE_CHECKING:
    from .activations import ActivationProbe

logger = logging.getLogger("trainermon")


def _timed_call(clock: Any, body: Any, *args: Any) -> Any:
    with clock:  # the whole body is the monitor's own time, not only its rows
        return body(*args)


_OUTSIDE: list[Any] = []
_UNMONITORED = SimpleNamespace(_actv=False, _actv_grad=False)


def _copied() -> HookedModule:
    """A copied `HookedModule` (copy.deepcopy, pickle of the model): its hooks return at once."""
    return HookedModule(_UNMONITORED, 0, "", False, ((), ()))  # type: ignore[arg-type]


def outside_graph() -> Any:
    """`_timed_call` with dynamo disabled, made once for every hook: a disable wrapper per hook cost ~0.4 KB
    each (0.65 MB on an 836-module model)."""
    if not _OUTSIDE:
        import torch.compiler

        _OUTSIDE.append(torch.compiler.disable(_timed_call))
    return _OUTSIDE[0]


def later_pre_hooks(module: torch.nn.Module) -> bool:
    """Whether a forward pre-hook runs after the monitor's on `module` (registered after it, not prepended);
    if so the monitor's is moved to the end of the module's pre-hooks, so that its input views are made of
    what forward receives (PyTorch runs a call's hooks from a copy: from the next call on). ~0.3 us."""
    hooks = module._forward_pre_hooks
    if not hooks or getattr(next(reversed(hooks.values())), "__func__", None) is HookedModule.pre:
        return False
    for key, hook in hooks.items():
        if getattr(hook, "__func__", None) is HookedModule.pre:
            hooks.move_to_end(key)
            return True
    return False


def before_traces(modules: Any) -> None:
    """When the hooks become pinned, and at each trace that reaches them (once per trace, run outside the
    graph: `ModuleHooks.pin_at_trace`): `outside_graph` made, and the monitor's pre-hook moved after
    pre-hooks registered later, so that the traced views are made of what forward receives. A pre-hook
    registered once a graph was traced runs after the monitor's in that graph (dynamo does not guard on
    the hooks' order): documented, not detected (a check in the trace would guard on each module's
    identity, recompiling blocks compiled one by one). ~0.3 us per hooked module and trace."""
    outside_graph()
    for _, _, module in modules:
        later_pre_hooks(module)


try:  # resolved once: importing in the call cost ~2.4 us of its ~5.8 us, per hooked module
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    _SKIP: Any = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)  # the frame and all it calls
except ImportError:  # pragma: no cover - another torch
    set_code_exec_strategy = None


def never_frames_of_their_own() -> None:
    """After a graph break inside a module's forward, dynamo compiles the module's hooks as frames of their
    own (torch 2.11 did so under compiled DDP; a block compiled on its own, `torch.compile(block)`, with a
    break inside does so on any torch). There the traced pre-hook's view of an input is a graph output
    aliasing a graph input, which the compiler rebuilds outside the graph without the view's gradient hook
    (those rows went missing). Such a hook call already sits between graph breaks: run it eagerly (dynamo
    skips these frames and the frames they call; it still inlines the hooks into the frames it traces).

    Set whenever hooks are registered, before any trace can reach them, and again after each reset of
    dynamo's caches by the monitor (a reset forgets the setting of code dynamo has seen): set only when the
    hooks were pinned, during the first trace, it came too late for that trace's frames (session 30: in a
    fresh process the input rows of blocks compiled one by one were lost). Two calls into torch's C
    extension, ~0.2 us each; private API (torch 2.11 to 2.13), a no-op where it is missing."""
    if set_code_exec_strategy is None:
        return
    for hook in (HookedModule.pre, HookedModule.forward):
        set_code_exec_strategy(hook.__code__, _SKIP)


class HookedModule:
    """One hooked module: what its two installed hooks share, the bound methods `pre` and `forward`. An
    object with slots instead of closures: the two body closures, two gate closures and their holders cost
    ~2.5 KB more per module (1.0 MB on a 418-module model, tracemalloc).

    Each hook tests flags first, false on steps that are not collected while the hooks stay installed
    (pinned under torch.compile, see `module_hooks`). Under torch.compile the test is traced (dynamo guards
    on the flags: one recompile when collection first switches on, both graphs cached after); on collected
    steps dynamo traces `traced_pre` / `traced_forward` (operators in the graph that run the monitor's code,
    see `graph_taps`; made once the hooks are pinned), or without them the body runs outside the graph (a
    graph break). Until the hooks are pinned no compiled code can call them, so the body is called directly:
    dynamo's disable wrapper switches its frame callback twice per call (~1.5 ms per step on a 145-module
    model)."""

    __slots__ = (
        "probe",
        "vpp_stage",
        "name",
        "extra",
        "shards",
        "input_names",
        "output_names",
        "traced_pre",
        "traced_forward",
        "given",
    )

    def __init__(self, probe: ActivationProbe, vpp_stage: int, name: str, extra: bool, shards: tuple) -> None:
        self.probe = probe
        self.vpp_stage = vpp_stage
        self.name = name
        self.extra = extra  # hooked for an escalation only: runs on escalating steps
        self.shards = shards  # (input piece labels, output piece labels): `Adapter.activation_shards`
        self.input_names = Names(f"{name}.input")
        self.output_names = Names(f"{name}.output")
        self.traced_pre: Any = None  # the hooks dynamo traces, made once the hooks are pinned
        self.traced_forward: Any = None
        self.given: Any = None  # (args, kwargs) `pre` gave while a later pre-hook existed: see `_late_inputs`

    def __deepcopy__(self, memo: dict) -> HookedModule:
        return _copied()  # a copy of the model (EMA, reference model) is not monitored: `copies`

    def __reduce__(self) -> tuple:
        return (_copied, ())

    def _mine(self, hook: Any) -> bool:
        return getattr(hook, "__self__", None) is self

    def pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        probe = self.probe
        if not module.training and not torch.is_grad_enabled() and is_compiling():  # an evaluation pass
            return self._traced_without_grad()
        if not (probe._actv or probe._actv_grad) or (self.extra and not probe._wide):
            if probe is _UNMONITORED:  # a copy's hook: gone after this call
                drop_copied_hooks(module, self._mine)
            return None
        if is_compiling() or probe.hooks.pinned:  # `pinned` is read only when dynamo is not tracing
            return self._not_eager("traced_pre", HookedModule._eager_pre, module, args, kwargs)
        if not_a_micro_batch():
            return None
        with probe.loop.clock:  # the whole body is the monitor's own time, not only its rows
            return self._eager_pre(module, args, kwargs)

    def forward(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        probe = self.probe
        if not module.training and not torch.is_grad_enabled() and is_compiling():  # an evaluation pass
            self._traced_without_grad()
            if self.traced_forward is not None:  # says the evaluation pass (at trace time), reads no flag
                self.traced_forward(module, args, kwargs, output)
            return None
        if not (probe._actv or probe._actv_grad) or (self.extra and not probe._wide):
            if probe is _UNMONITORED:
                drop_copied_hooks(module, self._mine)
            return None
        if is_compiling() or probe.hooks.pinned:
            body = HookedModule._eager_forward  # outside the graph: the late-hook check too
            return self._not_eager("traced_forward", body, module, args, kwargs, output)
        if not_a_micro_batch():
            return None
        with probe.loop.clock:
            return self._eager_forward(module, args, kwargs, output)

    def _eager_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """The pre-hook's body run eagerly. The input views must be made after every other pre-hook, so
        that the input-gradient row is the gradient of the tensor forward receives, as its actv row is: a
        pre-hook registered after the monitor's (`x * 3`) would replace the view, and the row would be the
        gradient before its change. Such a hook moves the monitor's pre-hook to the end for later calls;
        this call's views are checked by `_late_inputs`. Costs ~0.3 us per call (the last hook's look-up)."""
        result = self.probe._pre_body(self, module, args, kwargs)
        self.given = result if result is not None and later_pre_hooks(module) else None
        return result

    def _eager_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.given is not None:
            self._late_inputs(module, args, kwargs)
        return self.probe._forward_body(self, module, args, kwargs, output)

    def _late_inputs(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """The call on which a later pre-hook was found (`_eager_pre`): where it replaced any of the views
        `pre` gave, this call writes no input-gradient rows for the module (a view's gradient is not the
        received tensor's: 3x it after `x * 3`; the received tensor may be used elsewhere too, or be a
        leaf whose hook would outlive the step). From the next call the monitor's pre-hook runs last."""
        given_args, given_kwargs = self.given
        self.given = None
        bases = self.probe._bases.get(id(module))
        if not bases:
            return
        pairs = list(zip(given_args, args)) + [(v, kwargs.get(k)) for k, v in given_kwargs.items()]
        if all(received is view for view, received in pairs if id(view) in bases):
            return
        for entry in bases.values():
            entry[5].remove()  # the view's own hook
        bases.clear()

    def _traced_without_grad(self) -> None:
        """Traced in eval mode without grad (an evaluation pass), tested before the monitor's flags, so
        that an evaluation graph has no guard on them and is not compiled again for each family switch
        (dynamo's `recompile_limit`); grad mode and `training` are guarded anyway. `training` is read
        first: in training the test costs one attribute read per call. The traced hooks do nothing
        there either (the pre-hook taps gradients only; the forward hook sees an evaluation pass, said
        once at trace time). Eager calls keep their order: an eager body tells a reentrant checkpoint's
        first pass (no grad) from an evaluation pass (`grad_forward`), which a trace never sees."""
        if self.probe is _UNMONITORED:  # a copy's hook (EMA, reference model): nothing to pin
            return
        self.probe.hooks.pin_at_trace()  # as `_not_eager`: compiled code may call the hooks from now on

    def _not_eager(self, traced_slot: str, body: Any, *args: Any) -> Any:
        """Traced by dynamo: the traced hook, or the body outside the graph where it cannot tap this call.
        Pinned and run eagerly (compiled code may call it: a resumed frame after a graph break): the body,
        out of dynamo's reach."""
        probe = self.probe
        if is_compiling():
            probe.hooks.pin_at_trace()  # compiled code may call the hooks from now on; makes `traced_*`
            traced = getattr(self, traced_slot)
            if traced is not None:
                result = traced(*args)
                if result is not UNTAPPED:
                    return result
        elif not_a_micro_batch():  # pinned, run eagerly in a transform or side pass: no micro-batch
            return None
        return outside_graph()(probe.loop.clock, body, self, *args)
