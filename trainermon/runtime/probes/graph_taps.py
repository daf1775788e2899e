"""Activation hooks inside torch.compile'd graphs, without graph breaks.

While dynamo traces a module's hooks on a collected step, the hook does not call its eager body (that
would be a graph break around every hooked module; dynamo then also gives up on a whole `for` loop over
the blocks and compiles each block's pieces as frames of their own: on an 8-layer MLP, 11 frames where one
suffices). It puts one opaque operator call in the graph instead, `trainermon::tap(tensors, site, owner,
call, [])`, which runs the monitor's eager code at run time on the real tensors: the same rows, from the
same statistics code, as in eager mode.

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
  A torch whose dynamo cannot trace such hooks (`HOOKS_IN_GRAPH` false: older than 2.12) gets no
  actv_grad rows from compiled graphs (said once; actv rows as usual). Aliases returned by an autograd
  function, used before, changed training: a module writing its input or output in place (ReLU
  (inplace=True) through a transpose) wrote the caller's tensor without autograd seeing it.
- Gradients of inputs (the pre-hook): each is replaced by a view of it with such a hook, as the eager
  pre-hook does: this module's part of the gradient. A write into the view rebases the caller's tensor,
  so training is unchanged, but unhooks the view (eager mode then hooks the write's node; a graph has no
  node to hook): a module declaring `inplace=True` gets no view and no input row, said once, and a write
  into a view is said once (rows sharing that memory may miss part of their gradient).
- Each call's micro-step is a value in the graph (`trainermon::tap` returns it; `call`, the tap's
  number in the traced frame, keeps the compiler from merging two identical calls), which its gradient
  hooks take: backward may run a step's calls in another order than forward (a module called twice in
  one forward runs backward last call first) or not at all (a forward whose loss is dropped).
- DTensor activations (tensor parallelism) are tapped too: the operators' rule for DTensors records each
  one's local piece with its shard label, as the eager hooks do. With graph breaks at those hooks instead,
  torch 2.13 failed to compile a model whose ReLU(inplace=True) writes a DTensor ("got mixed torch.Tensor
  and DTensor"). The operators and that rule are in `tap_ops`.

The tensors an operator gets are read before it returns, or copied into the hook batch where no kernel
reads them at once (a GPU: one engine call for many taps, not one per tap), never held by reference nor
matched against other tensors (`transient` in `StepCollector.add_local`): the compiler reuses a buffer for
a later result without the version counter seeing it (measured: b's input, tanh(a's output), written over
a's output).

Costs, measured on the 2-core CPU host: the operator's dispatch is 2-4 us; a tensor it takes must exist
in memory (the compiler cannot fuse its producer into the next kernel), which cost 10-25 us in a
microbenchmark built to show it (`x * 2`, tap, `+ 1`); module outputs mostly exist anyway. One call per
hooked forward, one per pre-hook that taps inputs, one per graded tensor in backward: on a
32-layer MLP, ~23 us per call all told, the monitor's statistics and rows included, the same as the eager
hooks (see docs/PERFORMANCE.md).
Recomputation under non-reentrant activation checkpointing inside the compiled region writes no second
row (the rows equal the eager run's, tested).
"""

from __future__ import annotations

from typing import Any

import torch

# imported by activations.py on first use, after it has loaded: no import cycle at load time
from ...stats.kinds import is_dtensor
from .slots import UNTAPPED, input_slots, is_activation, output_slots, replace_slots
from .tap_ops import available, call_in_trace, dtensors_allowed
from .tap_sites import ACTIVATION, GRADED, NOT_TENSOR, OTHER_TENSOR, TapSite, TapSites

__all__ = ["TapSite", "TapSites", "available", "traced_forward_hook", "traced_pre_hook"]

# ---- the hook bodies dynamo traces ------------------------------------------------------------------
# Slot kinds (`tap_sites`): worked out by the traced code (tensor properties dynamo knows while tracing)
# and passed as constants to the site maker, which turns them into names and positions.
try:  # dynamo traces `register_hook` on a graph's intermediate tensors into its backward (torch 2.12+)
    from torch._higher_order_ops.register_hook import register_hook_op  # noqa: F401

    HOOKS_IN_GRAPH = True
except ImportError:  # older: a graph break (an error under fullgraph): no actv_grad in graphs, said once
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
    """The pre-hook as dynamo traces it: each module input whose gradient is wanted is replaced by a view
    of it with a hook (`_grad_hook`), as the eager pre-hook does: the gradient of this module's uses of
    it. A view, not an alias: were the module to write it in place, autograd rebases the caller's tensor
    through a view, whose later uses then get the right gradients (an alias from an autograd function,
    used before, left them wrong). Such a write also unhooks the view (in eager mode too, where the
    forward hook then hooks the write's node instead): a module that says it writes its input
    (`inplace=True`, as ReLU and the like) gets no view and no input row here, said once. On a torch
    without `HOOKS_IN_GRAPH` no gradient is recorded in the graph (said once). Names as the eager pre-hook
    gives them."""

    # The module's key is an input of the graph, not a constant: a 0-d CPU tensor (dynamo guards on an int
    # reached through a module's hooks as on a constant), so that blocks compiled one by one share one
    # graph instead of compiling one each, and a hook compiled as a frame of its own (as under torch
    # 2.11's compiled DDP) still records each module's rows under its own names.
    owner = torch.tensor(module_key, dtype=torch.int64)
    site = probe._taps.pre_site
    say_no_gradients = torch.compiler.assume_constant_result(
        lambda: probe._taps.say_no_gradients()  # a plain function: the marker takes no methods
    )
    say_in_place = torch.compiler.assume_constant_result(lambda view: probe._taps.say_in_place(view))
    say_collective = torch.compiler.assume_constant_result(lambda: probe._taps.say_collective(module_key))

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
        if any(k == GRADED and is_dtensor(v) for k, v in zip(kinds, slots)) and collective_inputs():
            # a hook there may fail the compile (`collective_inputs`): these inputs get no row, said once
            kinds = tuple(ACTIVATION if k == GRADED and is_dtensor(v) else k for k, v in zip(kinds, slots))
            if say_collective() and GRADED not in kinds:  # run by dynamo once, at trace time
                return None
        if not HOOKS_IN_GRAPH:
            say_no_gradients()  # run by dynamo once, at trace time
            return None
        if getattr(module, "inplace", False) is True:
            # its write would unhook the view (see `traced_pre_hook`); said at trace time, once
            views = [i for i in range(len(slots)) if kinds[i] == GRADED and slots[i]._base is not None]
            say_in_place(bool(views))
            return None
        first = _same(slots)
        graded = [i for i in range(len(slots)) if kinds[i] == GRADED and first[i] == i]
        number = site(kinds, keywords, first)
        micro = torch.ops.trainermon.tap([], number, owner, call_in_trace(), [])
        views = [slots[i].view_as(slots[i]) for i in graded]
        for p, view in enumerate(views):
            view.register_hook(_grad_hook(number, owner, p, len(graded), micro))
        view_of = dict(zip(graded, views))
        for i in range(len(slots)):
            if kinds[i] == GRADED:
                slots[i] = view_of[first[i]]
        new_kwargs = dict(zip(keywords, slots[len(args) :]))
        return tuple(slots[: len(args)]), new_kwargs

    return pre_hook


@torch.compiler.assume_constant_result  # run as plain Python while dynamo traces: a constant in the graph
def collective_inputs() -> bool:
    """Whether the frame dynamo is tracing takes a grad-requiring AsyncCollectiveTensor (what a
    tensor-parallel module with `use_local_output` returns: torchtitan's embedding hands one to the first
    block). aot_autograd rebuilds such an input without `requires_grad` in its metadata pass (torch 2.13:
    the wrapper takes its inner tensor's flag), so a DTensor made from it in the graph (SequenceParallel's
    input) does not require gradient there and a hook on it fails the compile ("cannot register a hook on
    a tensor that doesn't require gradient"), while dynamo sees it require gradient. Which DTensor descends
    from it is not known while tracing: no DTensor of the frame gets a gradient hook (inputs of pre-hooks,
    outputs of forward hooks; their actv rows stay). Run at trace time only, never per step (a private
    dynamo API; False where it is missing: taps as before)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        examples = [arg.example for arg in InstructionTranslator.current_tx().output.graphargs]
    except Exception:  # noqa: BLE001 - another torch: taps as before
        return False
    return any(isinstance(t, AsyncCollectiveTensor) and t.requires_grad for t in examples)


def _grad_hook(number: int, owner: torch.Tensor, p: int, n: int, micro: torch.Tensor) -> Any:
    """The hook on graded tensor `p` of `n` of a call whose micro-step is `micro`: dynamo puts its body in
    the backward graph, where it gets the tensor's accumulated gradient (eager mode's hook on the tensor's
    autograd node sees the same). It returns the gradient unchanged: under compiled autograd
    (`compiled_autograd = True` with backward inside the compiled step) the traced hook's result is what
    flows on, and None there failed the compile (a hook returning None means "unchanged" only in eager
    autograd)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grads: list[torch.Tensor | None] = [None] * n
        grads[p] = grad
        torch.ops.trainermon.tap_grad(grads, number, owner, micro, [])
        return grad

    return hook


def traced_forward_hook(probe: Any, name: str, module_key: int) -> Any:
    """The forward hook as dynamo traces it: one `trainermon::tap` with the module's activation inputs and
    outputs (actv rows; the module's forward counted), and a hook on each output whose gradient is wanted
    (`_grad_hook`; none on a torch without `HOOKS_IN_GRAPH`).
    Names as the eager forward hook gives them.

    The tapped tensors, in order: the graded outputs, the activation inputs, the other activation outputs
    (the last two only for actv), each object once."""

    owner = torch.tensor(module_key, dtype=torch.int64)  # an input of the graph: see traced_pre_hook
    site = probe._taps.forward_site

    def say_evaluation_pass() -> bool:
        probe._evaluation_pass(name)  # run by dynamo once, at trace time
        return True

    evaluation_pass = torch.compiler.assume_constant_result(say_evaluation_pass)
    say_no_gradients = torch.compiler.assume_constant_result(lambda: probe._taps.say_no_gradients())
    say_collective = torch.compiler.assume_constant_result(lambda: probe._taps.say_collective(module_key))

    def forward_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not module.training and not torch.is_grad_enabled():
            evaluation_pass()  # as the eager hook: no rows, no micro-batch; dynamo guards on both flags
            return None
        grad = probe._actv_grad and torch.is_grad_enabled()
        if grad and not HOOKS_IN_GRAPH:
            grad = not say_no_gradients()  # run by dynamo once, at trace time
        actv = probe._actv
        inputs = input_slots(args, kwargs)
        outputs = output_slots(output)
        if not (_tappable(inputs) and _tappable(outputs)):
            return UNTAPPED
        in_kinds = tuple(_kind(t, False) for t in inputs)
        out_kinds = tuple(_kind(t, grad) for t in outputs)
        if any(k == GRADED and is_dtensor(t) for k, t in zip(out_kinds, outputs)) and collective_inputs():
            # as in the pre-hook: a DTensor output may stem from that input alone (a norm without weight)
            out_kinds = tuple(
                ACTIVATION if k == GRADED and is_dtensor(t) else k for k, t in zip(out_kinds, outputs)
            )
            say_collective()  # run by dynamo once, at trace time
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
        micro = torch.ops.trainermon.tap(unique, number, owner, call_in_trace(), [])
        leaves = [p for p in range(n_graded) if unique[p].is_leaf]
        if leaves and not _rebuildable(output):
            return UNTAPPED  # a parameter in a namedtuple / ModelOutput: the eager body's view
        for p in leaves:
            # a parameter as an output (Megatron's skip_bias_add bias): a hook on it would stay for good
            # and fire every later step; as in eager mode, hook this call's view of it instead
            unique[p] = unique[p].view_as(unique[p])
        for p in range(n_graded):  # the whole gradient of the tensor, inner uses included
            unique[p].register_hook(_grad_hook(number, owner, p, n_graded, micro))
        if leaves:
            return _with_views(output, graded, view_of_graded, tuple(unique[:n_graded]))
        return None

    return forward_hook


def _rebuildable(output: Any) -> bool:
    return isinstance(output, torch.Tensor) or type(output) in (tuple, list, dict)


def _with_views(output: Any, graded: list[int], view_of_graded: tuple[int, ...], views: tuple) -> Any:
    """`output` with its graded tensors replaced by `views` (of the parameters it returns), numbered as
    `output_slots` numbers them (integer tensors and nested ones included)."""
    return replace_slots(output, {i: views[u] for i, u in zip(graded, view_of_graded)})
