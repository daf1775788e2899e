"""What every adapter needs, written once: unwrapping, per-step "seen" sets, handle groups, optimizer
hooks, optimizer-state lookup, and fail-open hooks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from trainermon.collect.records import StepScalars
from trainermon.copies import CopySafe
from trainermon.failsafe import FaultLog

from .base import StepEvents
from .state_init import late, maybe, state_init_step, watch
from .wrapped import hookable, nested_step

logger = logging.getLogger("trainermon")

#: Attributes through which wrappers hold the module they wrap: torch.compile, FSDP1, activation
#: checkpointing (`module` is not among them: it is a common name for a real submodule).
WRAPPED_ATTRS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def wrapper_types() -> tuple[type, ...]:
    """torch's wrapper classes that exist in this build (torch.compile, DDP, checkpoint wrapper)."""
    types: list[type] = []
    try:
        from torch._dynamo.eval_frame import OptimizedModule

        types.append(OptimizedModule)
    except Exception:  # noqa: BLE001 - optional in builds without dynamo
        pass
    try:
        from torch.nn.parallel import DistributedDataParallel

        types.append(DistributedDataParallel)
    except Exception:  # noqa: BLE001 - optional in builds without torch.distributed
        pass
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

        types.append(ActivationWrapper)
    except Exception:  # noqa: BLE001
        pass
    return tuple(types)


def unwrap(module: torch.nn.Module, extra: tuple[type, ...] = ()) -> torch.nn.Module:
    """The model inside any number of wrappers: torch's (`WRAPPED_ATTRS`, DDP's `.module`) and `extra`
    types, which hold theirs as `.module` (Megatron's DDP and Float16Module)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp_like = (DistributedDataParallel, *extra)
    while True:
        if isinstance(module, torch.jit.ScriptModule):  # hooks and module lookups fail on it
            raise TypeError(
                f"trainermon: cannot monitor a TorchScript module ({type(module).__name__}, a "
                "torch.jit.ScriptModule from torch.jit.script or torch.jit.trace): monitor the eager "
                "nn.Module (call set_monitor on the model before scripting it, or train the eager model)"
            )
        inner = next((module._modules[a] for a in WRAPPED_ATTRS if module._modules.get(a) is not None), None)
        if inner is None and ddp_like and isinstance(module, ddp_like):
            inner = getattr(module, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner


def is_wrapper(module: torch.nn.Module, extra: tuple[type, ...] = ()) -> bool:
    if isinstance(module, torch.jit.ScriptModule):  # a scripted submodule of an eager model: no wrapper
        return False
    return unwrap(module, extra) is not module


class Handles:
    """Several removable handles behind one `remove()`; more can be added later (lazy registration)."""

    def __init__(self, items: Iterable[Any] = ()) -> None:
        self.items: list[Any] = list(items)

    def remove(self) -> None:
        for handle in self.items:
            handle.remove()
        self.items.clear()


class Restore:
    """Undoes an instance-level patch: removes `obj.<name>` so the class attribute shows again."""

    def __init__(self, obj: Any, name: str, patched: Any) -> None:
        self.obj, self.name, self.patched = obj, name, patched

    def remove(self) -> None:
        if self.obj.__dict__.get(self.name) is self.patched:
            del self.obj.__dict__[self.name]


#: Calls of a step's closure after its first now running (LBFGS evaluates the loss several times in one
#: `step(closure)`): their reduces are that step's by design, not a double reduce. A count, not per thread:
#: autograd runs the reduce hooks on its own device threads.
CLOSURE_RERUNS = [0]

#: Steps another optimizer took over monitored parameters since the monitored one's last step boundary
#: (counted by the skipped-step probe, zeroed at each boundary): their backwards, not a missing no-sync
#: mode, explain a second reduce in one step (the monitored optimizer replaced mid-run), which that
#: probe names instead.
FOREIGN_STEPPED = [0]


class OncePerStep:
    """Parameter indices already reported this step; warns once per run when a framework reduces the same
    gradients twice in a step (gradient accumulation without its no-sync mode), but not from a closure's
    later calls inside one `step(closure)` (`CLOSURE_RERUNS`), nor after another optimizer stepped the
    monitored parameters since the last boundary (`FOREIGN_STEPPED`)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.seen: set[int] = set()
        self._warned = False

    def fresh(self, indices: Iterable[int]) -> list[int]:
        """The indices not reported yet this step (and marks them reported)."""
        indices = list(indices)
        new = [i for i in indices if i not in self.seen]
        if len(new) < len(indices) and not self._warned and not CLOSURE_RERUNS[0] and not FOREIGN_STEPPED[0]:
            self._warned = True
            logger.warning(
                "trainermon: %s reduced gradients more than once in one step (gradient accumulation "
                "without its no-sync mode, or two backwards before one optimizer step); grad_unreduced "
                "records the first reduce only",
                self.what,
            )
        self.seen.update(new)
        return new

    def clear(self) -> None:
        self.seen.clear()


class RowSpans:
    """Where a tap's rows lie among the collector's step rows (`StepCollector.mark` pairs), so that rows
    of gradients the loop then cleared unused (a GAN's generator loss through the monitored model, FGSM)
    can be taken out. `mark` is set by whoever owns the collector (the skip probe); None: not kept."""

    def __init__(self) -> None:
        self.mark: Callable[[], tuple] | None = None
        self.spans: list[list] = []

    def around(self, report: Callable[[], None]) -> None:
        """`report()`, its rows' span kept: two marks (three list lengths under the loop's lock) a call,
        on collected steps only; adjacent spans merge (one per backward)."""
        mark = self.mark
        if mark is None:
            report()
            return
        start = mark()
        report()
        end = mark()
        if end != start:
            if self.spans and self.spans[-1][1] == start:
                self.spans[-1][1] = end
            else:
                self.spans.append([start, end])

    def take(self) -> list[list]:
        """The spans kept since the last `take` or `clear` (and forget them)."""
        spans, self.spans = self.spans, []
        return spans

    def clear(self) -> None:
        self.spans = []


def guarded(faults: FaultLog, where: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` that never raises into the caller (a hook inside backward or forward): a failure is recorded
    in `faults` (logged once, counted) and None returned."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the whole point: never break the training step
            faults.record(where, exc)
            return None

    return call


def _after_closure(closure: Callable[[], Any], pre: Callable[[], None]) -> Callable[[], Any]:
    """`closure` that fires `pre` once, after its first call: the gradients exist only then. Its later calls
    run counted in `CLOSURE_RERUNS` (two integer updates a call)."""
    fired = [False]

    def call() -> Any:
        if fired[0]:
            CLOSURE_RERUNS[0] += 1
            try:
                return closure()
            finally:
                CLOSURE_RERUNS[0] -= 1
        loss = closure()
        if not fired[0]:
            fired[0] = True
            with torch.no_grad():  # optimizers run the closure under enable_grad; reads build no graph
                pre()
        return loss

    return call


def with_wrapped_closure(args: tuple, kwargs: dict, wrap: Callable[[Any], Any]) -> tuple[tuple, dict] | None:
    """A step pre-hook's new (args, kwargs): the step's closure replaced by `wrap(closure)`; None when the
    step has no closure. torch passes the optimizer itself as args[0], so a positional closure
    (`step(closure)`, LBFGS's documented form) is args[1]."""
    if callable(kwargs.get("closure")):
        return args, {**kwargs, "closure": wrap(kwargs["closure"])}
    if len(args) > 1 and callable(args[1]):
        return (args[0], wrap(args[1]), *args[2:]), kwargs
    return None


def _pre_hook(events: StepEvents) -> Callable[..., Any]:
    """torch's step pre-hook. A step given a closure (Lightning's automatic optimization, LBFGS) runs
    forward and backward inside `step()`, after this hook: the pre event then fires from the closure."""
    pre = torch.compiler.disable(events.pre)  # the closure runs inside a compiled step() too

    def hook(optimizer: Any, args: tuple, kwargs: dict) -> Any:
        if (maybe[0] or (late[0] and not optimizer.state)) and state_init_step(optimizer):
            return None  # DCP making the state of a fresh optimizer (lr 0): no training step
        if nested_step(optimizer):
            return None  # the outer step()'s hook fired the event (and wrapped the closure) already
        wrapped = with_wrapped_closure(args, kwargs, lambda closure: _after_closure(closure, pre))
        if wrapped is None:
            events.pre()
        return wrapped

    return hook


def _post_hook(events: StepEvents) -> Callable[..., None]:
    """torch's step post-hook; the one of an inner, nested `step()` is not the step's end.

    A fused optimizer stepped by a GradScaler (`_step_supports_amp_scaling`) is always called and skips
    the update in its kernel when the scaler set `optimizer.found_inf` non-zero: that tensor goes out as
    `update_skipped`, read by the worker (no host sync here)."""

    def hook(optimizer: Any, args: tuple, kwargs: dict) -> None:
        if not nested_step(optimizer) and not (maybe[0] and state_init_step(optimizer, end=True)):
            found_inf = getattr(optimizer, "found_inf", None)
            fused = isinstance(found_inf, torch.Tensor) and getattr(
                optimizer, "_step_supports_amp_scaling", False
            )
            events.post(StepScalars(update_skipped=found_inf if fused else None))

    return hook


def hook_optimizer_step(optimizer: Any, events: StepEvents) -> list[Any]:
    """Fire `events` around this optimizer instance's `step()`: torch's step hooks where the optimizer
    has them, else a wrapper of this instance's `step` (a framework optimizer). The steps torch's
    distributed checkpoint runs to make a fresh optimizer's state fire none (`state_init`)."""
    if hookable(optimizer):
        # Never traced: under a compiled step() dynamo traced the events (torch 2.11: a guard assertion,
        # only step 0 written) and `nested_step`'s stack walk (a warning per compile)
        return [
            optimizer.register_step_pre_hook(CopySafe(torch.compiler.disable(_pre_hook(events)))),
            optimizer.register_step_post_hook(CopySafe(torch.compiler.disable(_post_hook(events)))),
            watch(),
        ]
    if callable(getattr(optimizer, "step", None)):
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            events.pre()
            out = original(*args, **kwargs)
            events.post(StepScalars())
            return out

        optimizer.step = patched = CopySafe(step, original)
        return [Restore(optimizer, "step", patched)]
    raise TypeError(f"trainermon: optimizer {type(optimizer).__name__} has no step() to hook")


def amp_grad_scale(optimizer: Any) -> torch.Tensor | None:
    """The loss scale still in the gradients, which the optimizer's own kernel divides out: a fused
    optimizer (`_step_supports_amp_scaling`) stepped by a GradScaler that did not `unscale_` it (the
    scaler set `optimizer.grad_scale` for that step and left `.grad` scaled); else None. After
    `scaler.unscale_` the scaler leaves `grad_scale` None. Costs two attribute reads, no host sync."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    scale = getattr(optimizer, "grad_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def unscaled_grads(optimizer: Any, grads: list[Any]) -> list[Any]:
    """`grads` as the optimizer applies them: divided by `amp_grad_scale` on their device when it is set
    (a temporary copy of each, in its dtype, on collected steps only), else `grads` themselves."""
    scale = amp_grad_scale(optimizer)
    if scale is None:
        return grads
    return [None if g is None else g / scale.to(g.device, non_blocking=True) for g in grads]


def state_value(optimizer: Any, param: torch.Tensor, key: str) -> torch.Tensor | None:
    """`optimizer.state[param][key]` when it is a tensor, else None."""
    return state_values(optimizer, (param,), key)[0]


def state_values(optimizer: Any, params: Sequence[torch.Tensor], key: str) -> list[torch.Tensor | None]:
    """`optimizer.state[p][key]` of every parameter when it is a tensor, else None; the state table looked
    up once (the update-side families read every parameter on every collected step)."""
    state = getattr(optimizer, "state", None)
    if state is None:
        return [None] * len(params)
    out: list[torch.Tensor | None] = []
    for p in params:
        entry = state.get(p)  # not state[p]: `state` may be a defaultdict (one hash of the tensor, not two)
        value = None if entry is None else entry.get(key)
        out.append(value if isinstance(value, torch.Tensor) else None)
    return out


def any_over_ranks(flags: Sequence[bool], groups: Sequence[Any], device: torch.device) -> list[bool]:
    """Each flag OR-ed over the ranks of every group in `groups` (in that order, the same on every rank).
    Costs one MAX all-reduce of len(flags) int32 per group, and one read back (a device sync)."""
    import torch.distributed as dist

    if not flags or not (dist.is_available() and dist.is_initialized()):
        return list(flags)
    t = torch.tensor(list(flags), dtype=torch.int32).to(device)
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


#: The longest gap, in reads of one state key (collected steps), between two agreements on parameters
#: that had no state on any rank at the last one.
AGREE_EVERY_MAX = 64


class _KeyRows:
    """What `AgreedRows` knows of one state key; the same on every rank (filled from agreed results)."""

    __slots__ = ("held", "asked", "reads", "due", "gap")

    def __init__(self) -> None:
        self.held: set[int] = set()  # parameters found with state on some rank (state that exists stays)
        self.asked: set[int] = set()  # parameters asked about at least once
        self.reads = 0  # reads of this key so far: every rank counts them alike (each could agree)
        self.due = 0  # the read at which parameters without state are asked about again
        self.gap = 1


class AgreedRows:
    """Which sharded parameters have a row of a family, decided the same way on every rank.

    The packed reduction of sharded rows needs the same rows on every rank, but whether a parameter has
    a gradient or optimizer state is known only where its elements are: under FSDP1 a rank holding no
    element of a parameter (a LoRA adapter inside a layer's flat parameter, all on rank 0) has neither
    its gradient nor its optimizer state. Each rank's flags are OR-ed over the shard groups. State that
    exists stays, so a parameter found with state `key` is not asked about again. One without state on
    any rank (a never-used head, an unrouted expert) is asked about again on a schedule every rank
    follows alike: after 1, 2, 4, ... reads of the key, at most every `AGREE_EVERY_MAX`; at once for a
    parameter never asked about (one the adapter added after `add_param_group`), and the back-off starts
    over after an agreement that found new state or asked about a new parameter. Between agreements the
    answer for such a parameter stays False on every rank even where this rank now holds state: a row
    written from local state then must exist on every rank alike (FSDP2's DTensor state), else wait.
    """

    def __init__(self) -> None:
        self._keys: dict[str, _KeyRows] = {}

    def state(
        self, key: str, indices: Sequence[int], local: Sequence[bool], groups: Sequence[Any], device: Any
    ) -> list[bool]:
        """Whether parameter `indices[i]` holds state `key` on some rank (`local[i]`: on this one, used
        only when agreeing). `indices` and the calls for `key` must be the same on every rank of `groups`.
        Costs `any_over_ranks` on the reads the schedule picks while some parameter of `indices` has no
        state (about log2 of the reads up to 64, then one in 64), else a set lookup per parameter."""
        rows = self._keys.get(key)
        if rows is None:
            rows = self._keys[key] = _KeyRows()
        held, read = rows.held, rows.reads
        rows.reads = read + 1
        ask = [i for i, index in enumerate(indices) if index not in held]
        fresh = any(indices[i] not in rows.asked for i in ask)
        if ask and (read >= rows.due or fresh):
            found = any_over_ranks([local[i] for i in ask], groups, device)
            new = [indices[i] for i, f in zip(ask, found) if f]
            held.update(new)
            rows.asked.update(indices[i] for i in ask)
            # New state or a new parameter: others may follow soon (an expert routed, a group added).
            rows.gap = 1 if new or fresh else min(2 * rows.gap, AGREE_EVERY_MAX)
            rows.due = read + rows.gap
        return [index in held for index in indices]


def shard_groups(placements: Iterable[Any]) -> list[Any]:
    """The distinct `over` groups of sharded placements, in the order they first appear."""
    out: dict[int, Any] = {}
    for placement in placements:
        for group in getattr(placement, "over", ()):
            out.setdefault(id(group), group)
    return list(out.values())
