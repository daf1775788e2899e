"""actv and actv_grad: module hooks, armed only on collected steps.

- actv: a forward hook records each selected module's floating-point inputs and outputs, named as msprobe
  names them: inputs are numbered over the tensor arguments (positional, then keyword), outputs over the
  elements of a tuple or list output (`name.output_0`, `name.output_1`; one element or a tensor:
  `name.output`); an element that is not a tensor (None) gets a NaN row, as msprobe writes it. Integer
  tensors (token ids, masks) keep their number but get no row. A dict output's tensor values are
  numbered in order (msprobe writes none).
- actv_grad rows carry the same names as the tensors' actv rows (`name.input`, `name.output_1`, in the
  actv_grad files), numbered as msprobe's backward hook numbers them: inputs over the positional tensor
  arguments; a keyword argument's gradient is `name.input_{keyword}` (msprobe writes none).
- actv_grad: a forward pre-hook gives the module views of its inputs, so that a hook on each view sees
  exactly the gradient that flows into this module (not the sum over every consumer of the tensor); the
  forward hook hooks each output. A parameter returned as an output (Megatron's skip_bias_add bias) is
  replaced by a view of it for this call: a hook on the parameter would fire for every later backward.
- A module that writes an input view in place (ReLU(inplace=True)) rebases it, and the view's hooked node
  leaves the graph: the forward hook, seeing the input's version move, hooks the write's node instead, for
  that row and for view outputs of earlier modules the write bypasses (`written.hook_written_input`).
- A forward recomputed during backward (activation checkpointing) is not counted twice. Under reentrant
  checkpointing the first forward runs without grad, so its outputs never see a gradient: the probe
  remembers that forward's micro-step and hooks the recomputed tensors instead (no second actv row;
  which first forward a recomputed call repeats: `recompute`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainermon.config import MonitorConfig
from trainermon.copies import CopySafe

from ..plan import StepPlan
from ..selection import select_modules
from .base import Probe
from .grad_rows import GradRowsCache
from .hooked_module import HookedModule, before_traces, never_frames_of_their_own
from .module_hooks import ModuleHooks, ModuleTree, in_backward
from .recompute import Recomputes
from .slots import input_slots, is_activation, no_values, output_slots, padded, replace_tensors
from .unrun import unrun_modules, warn_unrun
from .written import mark_view, release, settle_input_views

logger = logging.getLogger("trainermon")


def _names(names: list[str]) -> str:
    return (", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")) or "none"


class ActivationProbe(Probe):
    def __init__(self, loop: Any) -> None:
        super().__init__(loop)
        self.modules: list[tuple[int, str, torch.nn.Module]] = []
        self._every: list | None = None  # every module, built on first escalation
        # when the module hooks exist (see `module_hooks`)
        self.hooks = ModuleHooks(self._register, self._make_traced_hooks, before_traces)
        self._calls: dict[int, int] = {}  # module id -> forward calls this step (the micro_step)
        self._actv = self._actv_grad = self._wide = False
        self._recomputes = Recomputes(loop)  # reentrant checkpointing's first passes and recomputes
        # module id -> {id(view): (tensor, ...)} for the input views its pre-hook made (`_hook_view`), until
        # its forward hook: the actv row of an input is then its tensor's row, found by object (no value
        # key to build), and a view the module wrote in place gets its input-gradient hook moved
        self._bases: dict[int, dict[int, tuple]] = {}
        self._grad_rows = GradRowsCache(loop)
        self._two_paths: list[Any] = []  # this step's written.TwoPaths, released at the next step's begin
        self._taps: Any = None  # graph_taps.TapSites once the hooks are pinned where the tap operators exist
        self._hooked: dict[int, HookedModule] = {}  # module id -> its hooks' state, once hooked
        self._said_eval = False
        self._first: list[Any] = []  # the one-shot root hooks of a collected step (`_first_forward`)
        self._tree = ModuleTree()  # the module tree the selection was made on (model surgery: `_reselect`)
        self._check_unrun = self._targeted = False  # unrun modules: said once per (re)configure

    def configure(self, config: MonitorConfig) -> None:
        self._use(self._select(config), families_off=not (config.collects_actv or config.collects_actv_grad))
        self._check_unrun = True  # at the next collected step's end (`unrun`), again after each reload
        self._targeted = bool(config.targets) and not config.all_xy  # modules the user named

    def post_optim(self, plan: StepPlan) -> None:
        # compiled code counts forwards too (the output taps: `tap_sites`)
        if self._check_unrun and (plan.actv or plan.actv_grad) and self.modules:
            self._check_unrun = False
            warn_unrun(unrun_modules(self.modules, self._calls), len(self.modules), plan.step, self._targeted)

    def _select(self, config: MonitorConfig) -> list[tuple[int, str, torch.nn.Module]]:
        if (config.collects_actv or config.collects_actv_grad) and (
            not config.module_ranks or self.loop.rank in config.module_ranks
        ):
            return select_modules(self.loop.adapter, config, every=config.all_xy or not config.targets)
        return []

    def _use(
        self, modules: list[tuple[int, str, torch.nn.Module]], force: bool = False, families_off: bool = False
    ) -> bool:
        """Hook `modules` from now on; False when they are the ones hooked already (no churn) unless `force`
        (the escalation's modules may have changed). Costs a walk of the module tree (`ModuleTree.take`)
        and, when they differ, re-hooking every module; pinned hooks stay as they are when the modules are
        the same or none because the families are off (`ModuleHooks.keeps`: no reset of dynamo's caches)."""
        if modules:
            self._tree.take(self.loop.adapter.roots())
        else:
            self._tree.clear()
        stale = not modules and not families_off and bool(self.hooks.modules)  # kept while off: remove
        same = [(v, n, id(m)) for v, n, m in modules] == [(v, n, id(m)) for v, n, m in self.modules]
        if not force and not stale and same:
            return False  # a reload that selects the same modules keeps the hooks as they are
        self._every = None
        keep = not force and self.hooks.keeps(modules, families_off)
        if not keep:  # kept hooks keep their state (`_hooked`): the traced hooks find it at run time
            # keep the state of modules that stay under the same name; a gone module's id may be reused by
            # a new one once freed, and a reload may rename a module (`squash_name`)
            hooked = self.hooks.modules  # not `self.modules`: [] while the families were off
            same = {(v, n, id(m)) for v, n, m in modules} & {(v, n, id(m)) for v, n, m in hooked}
            kept = {key for _, _, key in same}
            self._hooked = {k: h for k, h in self._hooked.items() if k in kept}
        self.modules = modules
        self.hooks.reset(modules, self.loop.adapter.roots(), keep)  # removes the hooks on gone modules too
        return True

    def _reselect(self, step: int) -> None:
        """The model's module tree changed (a module replaced, added or removed: model surgery): the
        modules are selected again, as at configure, and re-hooked; the hooks on modules that left the
        model are removed (a detached module still called gives no rows). Runs on collected steps only."""
        old = self.modules
        try:
            # the escalation's list may hold a gone module: rebuilt (a rare re-hook of every module)
            self._use(self._select(self.loop.config), force=self._every is not None)
        except Exception as exc:  # noqa: BLE001 - the hooks stay as they were
            self._tree.take(self.loop.adapter.roots())  # said once, not at every collected step
            self.loop.faults.record("activation modules re-selected", exc, "actv rows follow the old modules")
            return
        now = {id(m) for _, _, m in self.modules}
        before = {id(m) for _, _, m in old}
        gone = [n for _, n, m in old if id(m) not in now]
        new = [n for _, n, m in self.modules if id(m) not in before]
        if not gone and not new:
            return
        logger.warning(
            "trainermon: step %d: the model's modules changed; actv/actv_grad modules selected again: no "
            "longer monitored %s; newly monitored %s",
            step,
            _names(gone),
            _names(new),
        )

    def begin(self, plan: StepPlan) -> None:
        if self._first:
            self._drop_first()
        if (plan.actv or plan.actv_grad) and self.modules:
            if self.hooks.pinned:  # compiled code may not call a root hook added now: checked here
                if self._tree.changed():
                    self._reselect(plan.step)
            else:  # model surgery happens between steps, after this boundary: checked at the first forward
                self._first = [
                    root.register_forward_pre_hook(CopySafe(self._first_forward), prepend=True)
                    for root in self.loop.adapter.roots()
                ]
        release(self._two_paths)
        self._calls.clear()
        self._recomputes.clear()
        self._bases.clear()
        if self._taps:
            self._taps.begin_step()
        self._actv, self._actv_grad = plan.actv, plan.actv_grad
        self._arm(plan.escalating)

    def _first_forward(self, module: torch.nn.Module, args: Any) -> None:
        """A root's first forward in a collected step (eager), a one-shot hook: re-selects the modules if
        the module tree changed since they were selected (`ModuleTree.changed`), before any of them runs.
        Prepended: the roots' other hooks of this call still run (PyTorch iterates over a copy)."""
        try:
            if torch.compiler.is_compiling():
                return
            self._drop_first()
            with self.loop.clock:
                if self._tree.changed():
                    self._reselect(self.loop.step)
                    self._arm(self._wide)
        except Exception as exc:  # noqa: BLE001
            self.loop.faults.record("module tree check", exc)

    def _drop_first(self) -> None:
        for handle in self._first:
            handle.remove()
        self._first = []

    def _arm(self, escalating: bool) -> None:
        self._wide = escalating and (self._actv or self._actv_grad)
        self.hooks.arm(self._actv or self._actv_grad)
        if self._wide:
            if self._every is None:
                self._every = select_modules(self.loop.adapter, self.loop.config, every=True)
            self.hooks.add(self._every, extra=True)

    def _register(self, vpp_stage: int, name: str, module: torch.nn.Module, extra: bool) -> list[Any]:
        hooked = self._hooked.get(id(module))
        if hooked is None or hooked.extra != extra:
            try:
                shards = self.loop.adapter.activation_shards(module)
            except Exception as exc:  # noqa: BLE001 - a framework's layout read wrongly costs the labels only
                self.loop.faults.record("activation shard labels", exc, "its rows have no shard label")
                shards = ((), ())
            hooked = self._hooked[id(module)] = HookedModule(self, vpp_stage, name, extra, shards)
        if self.hooks.pinned:
            self._fill_traced(hooked, id(module))
        never_frames_of_their_own()  # before any trace can reach this hook
        return [
            module.register_forward_pre_hook(hooked.pre, with_kwargs=True),
            module.register_forward_hook(
                hooked.forward, with_kwargs=True, prepend=self.loop.adapter.activation_hooks_first
            ),
        ]

    def _make_traced_hooks(self) -> None:
        """When the hooks become pinned (compiled code may call them from now on): the traced hooks of the
        modules hooked so far. Before any trace reaches them: see `ModuleHooks`."""
        before_traces(self.hooks.modules)  # now, so that no trace has to: see `before_traces`
        never_frames_of_their_own()
        for key, hooked in self._hooked.items():
            self._fill_traced(hooked, key)

    def _fill_traced(self, hooked: HookedModule, key: int) -> None:
        if self._taps is None:
            from . import graph_taps

            self._taps = graph_taps.TapSites(self) if graph_taps.available() else False
        if self._taps and hooked.traced_pre is None:
            from .graph_taps import traced_forward_hook, traced_pre_hook

            hooked.traced_pre = traced_pre_hook(self, key)  # names come from `_hooked[key]` at run time
            hooked.traced_forward = traced_forward_hook(self, hooked.name, key)

    def close(self) -> None:
        self._drop_first()
        release(self._two_paths)
        self.hooks.close()
        if self._taps:
            self._taps.close()

    # ---- hooks ---------------------------------------------------------------------------------
    def _pre_body(self, hooked: HookedModule, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """The forward pre-hook (`HookedModule.pre`): views of the inputs whose gradients are wanted."""
        try:
            if not self._actv_grad or not torch.is_grad_enabled():
                return None
            if in_backward():  # a recompute: hook it only if the first pass could not be hooked
                if not self._recomputes.waiting(id(module)):
                    return None
                micro = self._recomputes.enter(id(module))
            else:
                micro = self._calls.get(id(module), 0)
            if len(args) == 1 and not kwargs:  # most modules: one tensor in (the general path, shorter)
                tensor = args[0]
                if not (is_activation(tensor) and tensor.requires_grad) or no_values(tensor):
                    return None
                pieces = hooked.shards[0]
                piece = pieces[0] if pieces else ""
                labels = (hooked.input_names.base,)
                view, entry = self._hook_view(hooked.vpp_stage, tensor, labels, micro, piece)
                self._bases[id(module)] = {id(view): entry}
                return (view,), kwargs
            positional = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            numbered = dict(zip(positional, hooked.input_names(len(positional))))
            keys = [i for i in positional if is_activation(args[i])]
            labels = [numbered[i] for i in keys]
            for k, v in kwargs.items():
                if is_activation(v):
                    keys.append(k)
                    labels.append(f"{hooked.name}.input_{k}")
            pieces = hooked.shards[0]
            new_args, new_kwargs = list(args), dict(kwargs)
            # One view per distinct tensor: a module called as attn(h, h, h) must still see the same
            # object three times (nn.MultiheadAttention takes its packed self-attention path only
            # when query is key is value; distinct views cost an extra projection and ~4% memory).
            views: dict[int, tuple[list[str], str, torch.Tensor]] = {}
            for position, (key, label) in enumerate(zip(keys, labels)):
                holder = new_args if isinstance(key, int) else new_kwargs
                tensor = holder[key]
                if tensor.requires_grad and not no_values(tensor):  # a nested one: no view, no rows
                    if id(tensor) not in views:
                        piece = pieces[position] if position < len(pieces) else ""
                        views[id(tensor)] = ([], piece, tensor)
                    views[id(tensor)][0].append(label)
            made: dict[int, tuple] = {}  # id(tensor) -> its view, hooked for all its labels, and entry
            for tid, (view_labels, piece, tensor) in views.items():
                try:  # one tensor's failure costs the others of the call none of their rows
                    made[tid] = self._hook_view(hooked.vpp_stage, tensor, tuple(view_labels), micro, piece)
                except Exception as exc:  # noqa: BLE001
                    self.loop.faults.record("forward pre-hook", exc, f"no actv_grad row for {view_labels[0]}")
            for key in keys:
                holder = new_args if isinstance(key, int) else new_kwargs
                view = made.get(id(holder[key]))
                if view is not None:
                    holder[key] = view[0]
            if made:
                self._bases[id(module)] = {id(view): entry for view, entry in made.values()}
            return tuple(new_args), new_kwargs
        except Exception as exc:  # noqa: BLE001
            self.loop.faults.record("forward pre-hook", exc)
            return None

    def _evaluation_pass(self, name: str) -> None:
        if not self._said_eval:
            self._said_eval = True
            logger.info(
                "trainermon: %s ran in eval mode without grad (an evaluation pass): such forwards get no "
                "actv rows and do not count as micro-batches of the training step",
                name,
            )

    def _hook_view(
        self, vpp_stage: int, tensor: torch.Tensor, labels: tuple[str, ...], micro: int, piece: str
    ) -> tuple[torch.Tensor, tuple]:
        """A view of `tensor` for this module alone, whose gradient is this module's input gradient, and
        its `_bases` entry: the tensor, its version, the view, its hooked node, the hook and its handle
        (should the module write the view in place, the forward hook finds the write's node from these)."""
        view = tensor.view_as(tensor)
        node = view.grad_fn
        rows = (  # a recomputed call's `micro` is its recompute.Call: micro-step set once it is over
            self._grad_rows.get(vpp_stage, labels, micro, piece, 0)
            if type(micro) is int
            else self._recomputes.rows(micro, vpp_stage, labels, piece, 0)
        )
        return view, (tensor, tensor._version, view, node, rows, node.register_prehook(rows))

    def _forward_body(
        self, hooked: HookedModule, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any
    ) -> Any:
        """The forward hook (`HookedModule.forward`): actv rows, and hooks on the outputs' gradients."""
        loop = self.loop
        vpp_stage = hooked.vpp_stage
        try:
            if not module.training and not torch.is_grad_enabled() and not self.hooks.grad_forward:
                self._evaluation_pass(hooked.name)  # between steps (eval(), no_grad): not a micro-batch
                return None
            key = id(module)
            bases = self._bases.pop(key, None) if self._bases else None
            recompute = in_backward()
            if recompute:  # recomputed forward inside backward: its actv row is already written
                if not torch.is_grad_enabled() or not self._recomputes.waiting(key):
                    return None
                micro = self._recomputes.leave(key)
            else:
                micro = self._calls.get(key, 0)
                self._calls[key] = micro + 1
                if self._actv_grad and not torch.is_grad_enabled():
                    self._recomputes.first_pass(key, micro)
            outputs = output_slots(output)
            out_labels = hooked.output_names(len(outputs))
            in_pieces, out_pieces = hooked.shards
            out_pieces = padded(out_pieces, len(outputs))
            if self._actv and not recompute:
                if len(args) == 1 and not kwargs:  # most modules: one argument (input_slots, shorter)
                    inputs = [args[0]] if isinstance(args[0], torch.Tensor) else []
                else:
                    inputs = input_slots(args, kwargs)
                if bases:  # the pre-hook's views: their tensors, the same values (see `_bases`)
                    inputs = [entry[0] if (entry := bases.get(id(t))) else t for t in inputs]
                in_labels = hooked.input_names(len(inputs))
                tensors, labels, pieces = [], [], []
                for label, t, piece in zip(
                    in_labels + out_labels, inputs + outputs, padded(in_pieces, len(inputs)) + out_pieces
                ):
                    if is_activation(t):
                        tensors.append(t)
                        labels.append(label)
                        pieces.append(piece)
                if tensors:
                    loop.record_local("actv", vpp_stage, labels, micro, tensors, pieces)
                if not isinstance(output, torch.Tensor):  # None in an output tuple: msprobe's NaN row
                    missing = [lb for lb, t in zip(out_labels, outputs) if not isinstance(t, torch.Tensor)]
                    if missing:
                        loop.record_missing("actv", vpp_stage, missing, micro)
            if self._actv_grad and torch.is_grad_enabled():
                leaves: dict[int, torch.Tensor] = {}
                aliased = False  # an output is a view: a later write into its base bypasses its node
                for label, t, piece in zip(out_labels, outputs, out_pieces):
                    if is_activation(t) and t.requires_grad:
                        if t.is_leaf:  # a parameter as an output: hook this call's view of it
                            view = leaves[id(t)] = loop.adapter.leaf_output_view(t)
                            t = view
                        node = t.grad_fn
                        index = t.output_nr
                        rows = (
                            self._grad_rows.get(vpp_stage, (label,), micro, piece, index)
                            if type(micro) is int
                            else self._recomputes.rows(micro, vpp_stage, (label,), piece, index)
                        )
                        handle = node.register_prehook(rows)
                        if t._base is not None:
                            mark_view(node, rows, t, handle)
                            aliased = True
                if bases:
                    settle_input_views(loop, bases, aliased, self._two_paths)
                if leaves:
                    return replace_tensors(output, leaves)
        except Exception as exc:  # noqa: BLE001
            loop.faults.record("forward hook", exc)
        return None
