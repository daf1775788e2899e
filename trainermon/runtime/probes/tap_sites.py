"""The run-time side of the compiled activation hooks (`graph_taps`): what each traced hook call records.

- `TapSites`: a probe's site shapes, numbered for the operators while dynamo traces (`pre_site`,
  `forward_site`: one per traced structure of a call, which slots are tensors, activations, graded).
- `SiteShape.at(owner)`: the `TapSite` of one module for that shape, made at its first call.
- `TapSite.forward` / `backward`: the rows of one call, run by the operators in `tap_ops`.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections import deque
from typing import Any

import torch

from ..side_passes import SIDE_PASSES
from .slots import io_names, padded
from .tap_ops import _SITES

#: Slot kinds, worked out by the traced code and passed to the site makers as constants.
NOT_TENSOR, OTHER_TENSOR, ACTIVATION, GRADED = 0, 1, 2, 3
logger = logging.getLogger("trainermon")
_NUMBERS = itertools.count(1)


class TapSite:
    """What one traced hook call records at run time.

    - `forward(tensors)` -> the call's micro-step: on a module's outputs (`counts` true), the module's
      forward count (then counted); on its inputs (the pre-hook), the count as it stands. actv rows as
      `actv` says, NaN rows for `missing`. The graph hands the micro-step to the gradient hooks of the
      same call. Inside a framework's own pass (`side_passes.side_pass`) it records and counts nothing.
    - `backward(grads, shards, micro)`: actv_grad rows, one per label of each tapped tensor that has a
      gradient, with the micro-step of the call that made it (as each eager hook carries its own).
    """

    __slots__ = ("probe", "module_key", "vpp_stage", "counts", "actv", "missing", "grads", "replays", "got")

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
        self.replays: deque[int] = deque()  # this step's micro-steps, for recomputed calls (`forward`)
        self.got = False  # a gradient reached `backward` this step (`TapSites.begin_step` checks)

    def forward(self, tensors: list[torch.Tensor], shards: list[str]) -> int:
        probe = self.probe
        loop = probe.loop
        micro = 0
        with loop.clock:
            try:
                if not loop.plan.collecting or SIDE_PASSES.depth:
                    # a framework's own pass (pipelining's shape inference), as the eager hooks skip it
                    # (`not_a_micro_batch`): no row, no micro-step, nothing kept for a replay
                    return micro
                if torch._C._current_graph_task_id() != -1:
                    # activation checkpointing recomputes the call in backward: its rows are written.
                    # The oldest micro-step not yet replayed is this call's when backward runs the
                    # micro-batches in forward order (accumulation, 1F1B); other orders mislabel (README)
                    return self.replays.popleft() if self.replays else micro
                calls = probe._calls
                micro = calls.get(self.module_key, 0)
                if self.counts:
                    calls[self.module_key] = micro + 1
                if self.grads:
                    if not self.replays:
                        probe._taps.replaying.append(self)
                    self.replays.append(micro)
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
            except Exception as exc:  # noqa: BLE001
                loop.faults.record("compiled forward hook", exc)
        return micro

    def backward(self, grads: list[torch.Tensor | None], shards: list[str], micro: int) -> None:
        loop = self.probe.loop
        with loop.clock:
            try:
                if not loop.plan.collecting or SIDE_PASSES.depth:  # a framework's own pass: no row
                    return
                labels, tensors, pieces = [], [], []
                for i, ((names, piece), grad) in enumerate(zip(self.grads, grads)):
                    if grad is not None:
                        labels += names
                        tensors += [grad] * len(names)
                        pieces += [(shards and shards[i]) or piece] * len(names)
                if tensors:
                    self.got = True
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
        self.replaying: list[TapSite] = []  # sites holding micro-steps for recomputation (`begin_step`)
        self._said_no_gradients = self._said_in_place = self._said_view_write = False
        self._said_collective = False
        self._lost_checks = 3  # collected steps on which `begin_step` looks for lost gradients
        self._said_lost: set[str] = set()  # "input", "output": each said once
        # plain functions (dynamo's constant-result marker does not take bound methods)
        self.pre_site = torch.compiler.assume_constant_result(lambda *shape: self._pre_number(*shape))
        self.forward_site = torch.compiler.assume_constant_result(lambda *shape: self._forward_number(*shape))

    def say_in_place(self, view: bool) -> bool:
        if not self._said_in_place:
            self._said_in_place = True
            logger.warning(
                "trainermon: inside torch.compile'd code, modules that write their input in place "
                "(inplace=True) get no input actv_grad row (eager mode writes it); their other rows are "
                "written"
            )
        if view and not self._said_view_write:
            self._said_view_write = True
            logger.warning(
                "trainermon: inside torch.compile'd code, a module writes a view in place (inplace=True on "
                "a reshaped, flattened or sliced tensor): the actv_grad rows of tensors that share that "
                "memory and were hooked before the write can miss part of their gradient; eager mode "
                "writes them exactly"
            )
        return True

    def say_collective(self, module_key: int) -> bool:
        if not self._said_collective:
            self._said_collective = True
            hooked = self.probe._hooked.get(module_key)
            logger.warning(
                "trainermon: inside torch.compile'd code, module %s (and any other module in a compiled "
                "frame that takes a grad-requiring AsyncCollectiveTensor, a tensor-parallel output with "
                "use_local_output) gets no actv_grad row for its DTensor inputs and outputs: torch's "
                "compiler fails on a gradient hook on a DTensor made from such a tensor; their actv rows and "
                "other rows are written",
                hooked.name if hooked is not None else module_key,
            )
        return True

    def say_no_gradients(self) -> bool:
        if not self._said_no_gradients:
            self._said_no_gradients = True
            logger.warning(
                "trainermon: this torch cannot trace tensor hooks in compiled graphs (2.12 or later can): "
                "modules inside torch.compile'd code get no actv_grad rows (their actv rows are written)"
            )
        return True

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
        """Forget the last step's micro-steps kept for recomputed calls (most never are). Only the sites
        that kept one (those called with graded tensors): this runs on every step, collected or not."""
        if self._lost_checks and self.replaying:
            self._lost_checks -= 1
            self._say_lost_gradients()
        for site in self.replaying:
            site.replays.clear()
            site.got = False
        self.replaying.clear()

    def _say_lost_gradients(self) -> None:
        """Gradient hooks the compiler lost, said once per kind naming the modules (those rows are not
        written), on the first few collected steps, only after dynamo has broken a graph (both known
        losses need one):

        - inputs: a module whose pre-hook tapped graded inputs, whose input gradient hooks never fired
          while gradients reached its own outputs or its submodules: where a graph break inside the
          module's forward splits a block compiled on its own (`torch.compile(block)`), the pre-hook's
          view of an input leaves its graph as an alias of the graph's input, which the compiler rebuilds
          without the view's hook (no fix found that keeps an in-place write into the input reaching the
          caller);
        - outputs: a module whose output gradient hooks never fired while gradients reached its
          submodules: an output that is a view of another tensor (GPT-2's `transformer` returns a reshape
          of its last norm's output) and leaves its graph at a later break is rebuilt by the compiler
          outside the graph, without its hook (torch 2.13).

        (A module whose output, or whose submodules, do not depend on the tensor differentiably would be
        named too; eager mode writes no row there either.)"""
        dynamo_utils = sys.modules.get("torch._dynamo.utils")
        if dynamo_utils is None or not dynamo_utils.counters["graph_break"]:
            return
        hooked = self.probe._hooked
        name = {id(s): hooked[s.module_key].name for s in self.replaying if s.module_key in hooked}
        got = [name[id(s)] for s in self.replaying if s.got and id(s) in name]
        for kind, outputs in (("input", False), ("output", True)):
            quiet = {
                name[id(s)] for s in self.replaying if s.counts == outputs and not s.got and id(s) in name
            }
            # an input's loss shows in the module's own rows too; an output's only in its submodules'
            names = sorted(
                n for n in quiet if any((g == n and not outputs) or g.startswith(f"{n}.") for g in got)
            )
            if names and kind not in self._said_lost:
                self._said_lost.add(kind)
                self._say(kind, names)
        if len(self._said_lost) == 2:
            self._lost_checks = 0

    @staticmethod
    def _say(kind: str, names: list[str]) -> None:
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        why = (
            "a graph break inside the forward of a module compiled on its own loses them, where eager mode "
            "writes them; a module whose output does not depend on its input has none in eager mode either"
            if kind == "input"
            else "an output that is a view of another tensor and leaves its graph at a graph break after "
            "the module loses them, where eager mode writes them: avoid the break (a .item() or print in "
            "a hook) or return a tensor that is not a view"
        )
        logger.warning(
            "trainermon: inside torch.compile'd code, the %s gradient hooks of module(s) %s never fired "
            "while gradients reached them: no %s actv_grad rows for them (%s). Their other rows are written",
            kind,
            ", ".join(names[:8]) + more,
            kind,
            why,
        )

    def close(self) -> None:
        if self._lost_checks and self.replaying:
            self._say_lost_gradients()  # the last step's, when no step began after it
        for number in self._by_key.values():
            _SITES.pop(number, None)
        self._by_key.clear()
