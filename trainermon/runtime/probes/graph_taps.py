"""Activation hooks inside torch.compile'd graphs, without graph breaks.

While dynamo traces a module's hooks on a collected step, the hook does not call its eager body (that
would be a graph break around every hooked module; dynamo then also gives up on a whole `for` loop over
the blocks and compiles each block's pieces as frames of their own: on an 8-layer MLP, 11 frames where one
suffices). It puts one opaque operator call in the graph instead, `trainermon::tap(tensors, site, [])`, which
runs the monitor's eager code at run time on the real tensors: the same rows, from the same statistics
code, as in eager mode.

- `site` is an integer constant in the graph: the shape of the call (which slots are tensors, activations,
  graded), numbered once per shape while dynamo traces (`torch.compiler.assume_constant_result`: a
  constant, no graph break). The module is a second argument, `owner`: its key in a 0-d CPU tensor, an
  input of the graph rather than a constant, so that identical blocks compiled one by one (torchtitan's
  way) share their graphs. At run time (`SiteShape.at`) the pair gives a `TapSite`, made on its first
  call, holding what the eager hook would work out per call (row names, shard labels, which slots are
  missing).
- Gradients of outputs: a `register_hook` on each output tensor whose gradient is wanted, whose body
  (`trainermon::tap_grad`) dynamo puts in the backward graph. It gets the tensor's accumulated gradient,
  as the eager hook on the tensor's autograd node does, including what flows back through the module's
  own uses of the tensor (`return y, f(y)`). The output is returned as it is, so any container works.
  A torch whose dynamo cannot trace such hooks (`HOOKS_IN_GRAPH` false: older than 2.12) gets aliases
  from `Tap` in the output instead, which see only the gradient through the returned tensor.
- Gradients of inputs (the pre-hook): they pass through `Tap`, an autograd function whose forward returns
  aliases of them (their memory, no copy) and whose backward calls `trainermon::tap_grad` with their
  gradients: this module's part, as the eager pre-hook's view gives. An in-place module
  (ReLU(inplace=True)) writes into the alias: the input gradient of such a module, which eager mode
  misses (its pre-hook's view is rebased by the write), is written here.
- DTensor activations (tensor parallelism) are tapped too: the operators' rule for DTensors records each
  one's local piece with its shard label, as the eager hooks do. With graph breaks at those hooks instead,
  torch 2.13 failed to compile a model whose ReLU(inplace=True) writes a DTensor ("got mixed torch.Tensor
  and DTensor"). The operators, `Tap` and that rule are in `tap_ops`.

The tensors an operator gets are read before it returns and never kept nor matched against other
tensors (`transient` in `StepCollector.add_local`): the compiler reuses a buffer for a later result
without the version counter seeing it (measured: b's input, tanh(a's output), written over a's output).

Costs, measured on the 2-core CPU host: the operator's dispatch is 2-4 us; a tensor it takes must exist
in memory (the compiler cannot fuse its producer into the next kernel), which cost 10-25 us in a
microbenchmark built to show it (`x * 2`, tap, `+ 1`); module outputs mostly exist anyway. One call per
hooked forward, one per pre-hook that taps inputs, one per graded output or `Tap` in backward: on a
32-layer MLP, ~23 us per call all told, the monitor's statistics and rows included, the same as the eager
hooks (see docs/PERFORMANCE.md).
Recomputation under non-reentrant activation checkpointing inside the compiled region writes no second
row (the rows equal the eager run's, tested).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

import torch

# imported by activations.py on first use, after it has loaded: no import cycle at load time
from ...stats.kinds import is_dtensor
from .slots import UNTAPPED, input_slots, io_names, is_activation, output_slots, padded
from .tap_ops import _SITES, Tap, available, dtensors_allowed

__all__ = ["TapSite", "TapSites", "available", "traced_forward_hook", "traced_pre_hook"]
_NUMBERS = itertools.count(1)


class TapSite:
    """What one traced hook call records at run time.

    - `forward(tensors)`: on a module's outputs (`counts` true), the call's micro-step is the module's
      forward count (then counted); on its inputs (the pre-hook), the count as it stands. actv rows as
      `actv` says, NaN rows for `missing`; the micro-step is queued for the backward when gradients are
      tapped.
    - `backward(grads)`: actv_grad rows, one per label of each tapped tensor, with the micro-step of the
      forward that made it (first in, first out: micro-batches run backward in the order they ran forward).
      Unlike eager mode, where each tensor's hook carries its micro-step, this assumes every forward run
      with grad enabled gets its backward in the same step: one that never does (a forward whose result
      is dropped) shifts the later backward rows of that module by one micro-step.
    """

    __slots__ = ("probe", "module_key", "vpp_stage", "counts", "actv", "missing", "grads", "micros")

    def __init__(
        self,
        probe: Any,
        module_key: int,
        vpp_stage: int,
        counts: bool,
        actv: tuple[tuple[int, str, str], ...],
        missing: tuple[str, ...],
        grads: tuple[tuple[tuple[str, ...], str], ...],
    ) -> None:
        self.probe, self.module_key, self.vpp_stage, self.counts = probe, module_key, vpp_stage, counts
        self.actv = actv  # (position in tensors, label, shard label) per actv row
        self.missing = missing  # labels of output slots that are not tensors
        self.grads = grads  # (labels, shard label) per graded tensor, in order
        self.micros: list[deque[int]] = [deque() for _ in grads]  # per graded tensor: hooks fire apart

    def forward(self, tensors: list[torch.Tensor], shards: list[str]) -> None:
        probe = self.probe
        loop = probe.loop
        with loop.clock:
            try:
                if not loop.plan.collecting:
                    return
                calls = probe._calls
                micro = calls.get(self.module_key, 0)
                if self.counts:
                    calls[self.module_key] = micro + 1
                if self.actv and probe._actv:
                    loop.record_local(
                        "actv",
                        self.vpp_stage,
                        [label for _, label, _ in self.actv],
                        micro,
                        [tensors[i] for i, _, _ in self.actv],
                        [(shards and shards[i]) or piece for i, _, piece in self.actv],
                        transient=True,  # the compiler may reuse these buffers once the call returns
                    )
                if self.missing and probe._actv:
                    loop.record_missing("actv", self.vpp_stage, list(self.missing), micro)
                if self.grads:
                    if not any(self.micros):
                        probe._taps.waiting.append(self)
                    for queue in self.micros:
                        queue.append(micro)
            except Exception as exc:  # noqa: BLE001
                loop.faults.record("compiled forward hook", exc)

    def backward(self, grads: list[torch.Tensor | None], shards: list[str]) -> None:
        loop = self.probe.loop
        with loop.clock:
            try:
                micro = 0
                for queue, grad in zip(self.micros, grads):
                    if grad is not None and queue:  # every graded tensor of a call: one micro-step
                        micro = queue.popleft()
                if not loop.plan.collecting:
                    return
                labels, tensors, pieces = [], [], []
                for i, ((names, piece), grad) in enumerate(zip(self.grads, grads)):
                    if grad is not None:
                        labels += names
                        tensors += [grad] * len(names)
                        pieces += [(shards and shards[i]) or piece] * len(names)
                if tensors:
                    loop.record_local(
                        "actv_grad", self.vpp_stage, labels, micro, tensors, pieces, transient=True
                    )
            except Exception as exc:  # noqa: BLE001
                loop.faults.record("compiled activation-gradient hook", exc)


class SiteShape:
    """One (hook, traced structure): the `TapSite` of each module that calls it, made on its first call."""

    __slots__ = ("probe", "make", "sites")

    def __init__(self, probe: Any, make: Any) -> None:
        self.probe = probe
        self.make = make  # owner -> TapSite
        self.sites: dict[int, TapSite] = {}

    def at(self, owner: int) -> TapSite:
        site = self.sites.get(owner)
        if site is None:
            site = self.sites[owner] = self.make(owner)
        return site


class TapSites:
    """A probe's site shapes, one per (hook, traced structure), numbered for the operators. `pre_site` and
    `forward_site` are what the traced hooks call: one function per probe for every module, so that dynamo
    has nothing module-specific to guard on (the module is the `owner` tensor, an input of the graph)."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self._by_key: dict[tuple, int] = {}
        self.waiting: list[TapSite] = []  # sites that queued a micro-step this step (see `begin_step`)
        # plain functions (dynamo's constant-result marker does not take bound methods)
        self.pre_site = torch.compiler.assume_constant_result(lambda *shape: self._pre_number(*shape))
        self.forward_site = torch.compiler.assume_constant_result(lambda *shape: self._forward_number(*shape))

    def number(self, key: tuple, make: Any) -> int:
        """The shape number for `key`; `make(owner)` gives a module's site (trace time only)."""
        number = self._by_key.get(key)
        if number is None:
            number = self._by_key[key] = next(_NUMBERS)
            _SITES[number] = SiteShape(self.probe, make)
        return number

    def _pre_number(self, kinds: tuple[int, ...], keywords: tuple[str, ...], first: tuple[int, ...]) -> int:
        probe = self.probe

        def make(owner: int) -> TapSite:
            hooked = probe._hooked[owner]
            name = hooked.name
            positional = len(kinds) - len(keywords)
            tensor_positions = [i for i in range(positional) if kinds[i] != NOT_TENSOR]
            numbered = dict(zip(tensor_positions, io_names(f"{name}.input", len(tensor_positions))))
            activations = [i for i, kind in enumerate(kinds) if kind >= ACTIVATION]
            pieces = hooked.shards[0]
            grads: dict[int, tuple[list[str], str]] = {}
            for position, i in enumerate(activations):
                if kinds[i] != GRADED:
                    continue
                label = numbered[i] if i < positional else f"{name}.input_{keywords[i - positional]}"
                if first[i] not in grads:
                    grads[first[i]] = ([], pieces[position] if position < len(pieces) else "")
                grads[first[i]][0].append(label)
            rows = tuple((tuple(labels), piece) for labels, piece in grads.values())
            return TapSite(probe, owner, hooked.vpp_stage, False, (), (), rows)

        return self.number(("pre", kinds, keywords, first), make)

    def _forward_number(
        self,
        in_kinds: tuple[int, ...],
        out_kinds: tuple[int, ...],
        alone: bool,
        actv: bool,
        same: tuple[int, ...],
    ) -> tuple[int, tuple[int, ...], int]:
        probe = self.probe
        graded = [i for i, kind in enumerate(out_kinds) if kind == GRADED]
        in_take = [i for i, kind in enumerate(in_kinds) if kind >= ACTIVATION] if actv else []
        unique = [p for p, first in enumerate(same) if first == p]
        slot = {p: unique.index(same[p]) for p in range(len(same))}  # position -> tapped tensor
        view_of_graded = tuple(slot[p] for p in range(len(graded)))

        def make(owner: int) -> TapSite:
            hooked = probe._hooked[owner]
            in_labels = io_names(f"{hooked.name}.input", len(in_kinds))
            out_labels = io_names(f"{hooked.name}.output", len(out_kinds))
            in_pieces, out_pieces = hooked.shards
            in_pieces, out_pieces = padded(in_pieces, len(in_kinds)), padded(out_pieces, len(out_kinds))
            rows: list[tuple[int, str, str]] = []
            if actv:
                out_take = [i for i, kind in enumerate(out_kinds) if kind == ACTIVATION]
                at = {i: slot[p] for p, i in enumerate(graded)}
                at.update({i: slot[len(graded) + len(in_take) + p] for p, i in enumerate(out_take)})
                rows = [(slot[len(graded) + p], in_labels[i], in_pieces[i]) for p, i in enumerate(in_take)]
                rows += [(at[i], out_labels[i], out_pieces[i]) for i in sorted(at)]
            missing = ()
            if actv and not alone:
                missing = tuple(out_labels[i] for i, kind in enumerate(out_kinds) if kind == NOT_TENSOR)
            grads: dict[int, tuple[list[str], str]] = {}
            for p, i in enumerate(graded):
                grads.setdefault(slot[p], ([], out_pieces[i]))[0].append(out_labels[i])
            rows_of_grads = tuple((tuple(labels), piece) for labels, piece in grads.values())
            return TapSite(probe, owner, hooked.vpp_stage, True, tuple(rows), missing, rows_of_grads)

        key = ("fwd", in_kinds, out_kinds, alone, actv, same)
        return self.number(key, make), view_of_graded, len(set(view_of_graded))

    def begin_step(self) -> None:
        """Forget gradients still awaited from an earlier step (a forward without its backward). Only the
        sites that queued one: this runs on every step, collected or not."""
        if self.waiting:
            for site in self.waiting:
                for queue in site.micros:
                    queue.clear()
            self.waiting.clear()

    def close(self) -> None:
        for number in self._by_key.values():
            _SITES.pop(number, None)
        self._by_key.clear()


# ---- the hook bodies dynamo traces ------------------------------------------------------------------
# Slot kinds, worked out by the traced code (tensor properties dynamo knows while tracing) and passed as
# constants to the site maker, which turns them into names and positions (plain Python, run once).
NOT_TENSOR, OTHER_TENSOR, ACTIVATION, GRADED = 0, 1, 2, 3
try:  # dynamo traces `register_hook` on a graph's intermediate tensors into its backward (torch 2.12+)
    from torch._higher_order_ops.register_hook import register_hook_op  # noqa: F401

    HOOKS_IN_GRAPH = True
except ImportError:  # older: a graph break, an error under fullgraph; the outputs get `Tap` aliases
    HOOKS_IN_GRAPH = False
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _tappable(values: list[Any]) -> bool:
    """Whether the operators can take these values: plain tensors, and DTensors (`tap_ops.local_pieces`;
    the rule is registered at trace time, on the first one seen). Other tensor subclasses: no."""
    for value in values:
        if isinstance(value, torch.Tensor) and type(value) not in _PLAIN:
            if not (is_dtensor(value) and dtensors_allowed()):
                return False
    return True


def _kind(value: Any, graded: bool) -> int:
    if not isinstance(value, torch.Tensor):
        return NOT_TENSOR
    if not is_activation(value):
        return OTHER_TENSOR
    return GRADED if graded and value.requires_grad else ACTIVATION


def _same(values: list[Any]) -> tuple[int, ...]:
    """For each value, the first position holding the same object (an autograd function takes a tensor
    once: `mix(h, h)`, or a module returning its input; a tensor given twice gets one tap, two names)."""
    first = []
    for i in range(len(values)):
        j = i
        for k in range(i):
            if values[k] is values[i]:
                j = k
                break
        first.append(j)
    return tuple(first)


def traced_pre_hook(probe: Any, module_key: int) -> Any:
    """The pre-hook as dynamo traces it: the module's inputs whose gradients are wanted pass through a
    `Tap` (the eager pre-hook's views, here aliases made in the graph). Names as the eager pre-hook gives
    them."""

    # The module's key is an input of the graph, not a constant: a 0-d CPU tensor (dynamo guards on an int
    # reached through a module's hooks as on a constant), so that blocks compiled one by one share one
    # graph instead of compiling one each, and a hook compiled as a frame of its own (as under torch
    # 2.11's compiled DDP) still records each module's rows under its own names.
    owner = torch.tensor(module_key, dtype=torch.int64)
    site = probe._taps.pre_site

    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if not probe._actv_grad or not torch.is_grad_enabled():
            return None
        keywords = tuple(kwargs.keys())
        slots = list(args) + list(kwargs.values())
        if not _tappable(slots):
            return UNTAPPED
        kinds = tuple(_kind(v, True) for v in slots)
        if GRADED not in kinds:
            return None
        first = _same(slots)
        graded = [i for i in range(len(slots)) if kinds[i] == GRADED and first[i] == i]
        views = Tap.apply(site(kinds, keywords, first), owner, len(graded), *[slots[i] for i in graded])
        view_of = dict(zip(graded, views))
        for i in range(len(slots)):
            if kinds[i] == GRADED:
                slots[i] = view_of[first[i]]
        new_kwargs = dict(zip(keywords, slots[len(args) :]))
        return tuple(slots[: len(args)]), new_kwargs

    return pre_hook


def _grad_hook(number: int, owner: torch.Tensor, p: int, n: int) -> Any:
    """The hook on graded output `p` of `n`: dynamo puts its body in the backward graph, where it gets the
    tensor's accumulated gradient (eager mode's hook on the tensor's autograd node sees the same)."""

    def hook(grad: torch.Tensor) -> None:
        grads: list[torch.Tensor | None] = [None] * n
        grads[p] = grad
        torch.ops.trainermon.tap_grad(grads, number, owner, [])

    return hook


def traced_forward_hook(probe: Any, name: str, module_key: int) -> Any:
    """The forward hook as dynamo traces it: one `trainermon::tap` with the module's activation inputs and
    outputs (actv rows; the module's forward counted), and a hook on each output whose gradient is wanted
    (`_grad_hook`; on a torch without `HOOKS_IN_GRAPH`, a `Tap` whose aliases replace them in the output).
    Names as the eager forward hook gives them.

    The tapped tensors, in order: the graded outputs, the activation inputs, the other activation outputs
    (the last two only for actv), each object once."""

    owner = torch.tensor(module_key, dtype=torch.int64)  # an input of the graph: see traced_pre_hook
    site = probe._taps.forward_site

    def say_evaluation_pass() -> bool:
        probe._evaluation_pass(name)  # run by dynamo once, at trace time
        return True

    evaluation_pass = torch.compiler.assume_constant_result(say_evaluation_pass)

    def forward_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not module.training and not torch.is_grad_enabled():
            evaluation_pass()  # as the eager hook: no rows, no micro-batch; dynamo guards on both flags
            return None
        grad = probe._actv_grad and torch.is_grad_enabled()
        actv = probe._actv
        inputs = input_slots(args, kwargs)
        outputs = output_slots(output)
        if not (_tappable(inputs) and _tappable(outputs)):
            return UNTAPPED
        if grad and not HOOKS_IN_GRAPH and not _rebuildable(output):
            # an older torch: the aliases must replace the outputs, and this output (a namedtuple, a
            # ModelOutput) cannot be rebuilt with them; the eager body hooks its tensors' nodes instead
            for t in outputs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    return UNTAPPED
        in_kinds = tuple(_kind(t, False) for t in inputs)
        out_kinds = tuple(_kind(t, grad) for t in outputs)
        graded = [i for i, kind in enumerate(out_kinds) if kind == GRADED]
        tensors = [outputs[i] for i in graded]
        if actv:
            tensors += [t for t, kind in zip(inputs, in_kinds) if kind >= ACTIVATION]
            tensors += [t for t, kind in zip(outputs, out_kinds) if kind == ACTIVATION]
        if not tensors:
            return None
        same = _same(tensors)
        alone = isinstance(output, torch.Tensor)
        number, view_of_graded, n_graded = site(in_kinds, out_kinds, alone, actv, same)
        unique = [t for p, t in enumerate(tensors) if same[p] == p]
        if not graded or HOOKS_IN_GRAPH:
            torch.ops.trainermon.tap(unique, number, owner, [])
            leaves = [p for p in range(n_graded) if unique[p].is_leaf]
            if leaves and not _rebuildable(output):
                return UNTAPPED  # a parameter in a namedtuple / ModelOutput: the eager body's view
            for p in leaves:
                # a parameter as an output (Megatron's skip_bias_add bias): a hook on it would stay for
                # good and fire every later step; as in eager mode, hook this call's view of it instead
                unique[p] = unique[p].view_as(unique[p])
            for p in range(n_graded):  # the whole gradient of the tensor, inner uses included
                unique[p].register_hook(_grad_hook(number, owner, p, n_graded))
            if leaves:
                return _with_aliases(output, graded, view_of_graded, tuple(unique[:n_graded]))
            return None
        return _with_aliases(output, graded, view_of_graded, Tap.apply(number, owner, n_graded, *unique))

    return forward_hook


def _rebuildable(output: Any) -> bool:
    return isinstance(output, torch.Tensor) or type(output) in (tuple, list, dict)


def _with_aliases(output: Any, graded: list[int], view_of_graded: tuple[int, ...], views: tuple) -> Any:
    """`output` with its graded tensors replaced by `views`: the `Tap`'s aliases (torch without
    `HOOKS_IN_GRAPH`: their gradients reach the site, but only the part that flows through the returned
    tensor), or the views of parameters returned as outputs."""
    if isinstance(output, torch.Tensor):
        return views[0]
    if isinstance(output, dict):
        rebuilt_output = dict(output)
        keys = [k for k, v in output.items() if is_activation(v)]
        for i, u in zip(graded, view_of_graded):
            rebuilt_output[keys[i]] = views[u]
        return rebuilt_output
    slots = list(output)
    for i, u in zip(graded, view_of_graded):
        slots[i] = views[u]
    return type(output)(slots)
