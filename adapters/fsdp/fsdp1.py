"""FSDP1 (`FullyShardedDataParallel`), checked on torch 2.13.

- grad_unreduced: a post-accumulate-grad hook on each FlatParameter. Autograd runs it inside the
  AccumulateGrad node, before FSDP's own post-backward hook (a node post-hook) reduce-scatters, so
  `.grad` is this rank's unsharded flat gradient, accumulated over `no_sync()` micro-batches. It is split
  into the original parameters with the flat parameter's layout.
- grad_reduced, exp_avg/exp_avg_sq, param: the local flat shard. `_shard_param_infos` says which slice of
  the shard belongs to which original parameter; with `use_orig_params=True` the original parameters
  (and their `.grad` and optimizer state) already are those 1-D slices.
- Everything private FSDP1 exposes is read once, in `fsdp1_layout.fsdp1_unit`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from trainermon.collect.placement import LOCAL, Placement, Replicated, Sharded, TensorPiece
from trainermon.names import clean_name
from trainermon.runtime.clip_watch import ClipEntry, torch_clip_entries

from ..base import GRAD_REDUCED, GRAD_UNREDUCED, PARAM, Adapter, AdapterContext, GradTaps, MonitoredParam
from ..common import (
    AgreedRows,
    OncePerStep,
    amp_grad_scale,
    any_over_ranks,
    guarded,
    hook_optimizer_step,
    shard_groups,
    state_values,
    unscaled_grads,
    unwrap,
    wrapper_types,
)
from . import fsdp_imported
from .fsdp1_layout import Fsdp1Unit, Slot, fsdp1_unit, module_order
from .sums import ReduceSums

logger = logging.getLogger("trainermon")


def _fsdp1_class() -> type | None:
    if not fsdp_imported():
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


class Fsdp1Adapter(Adapter):
    """FSDP1 with `use_orig_params` True or False, any sharding strategy (NO_SHARD counts as replicated)."""

    name = "fsdp1"

    def msprobe_unreduced_kind(self, per_micro_batch: bool) -> str:
        return "pre_grad"  # msprobe patches FSDP's post-backward reduction, with monitor_mbs_grad too

    def __init__(self, chunks: Sequence[torch.nn.Module], optimizer: Any, context: AdapterContext) -> None:
        super().__init__(chunks, optimizer, context)
        fsdp_cls = _fsdp1_class()
        assert fsdp_cls is not None
        self._fsdp_cls = fsdp_cls
        self._wrappers = (fsdp_cls, *wrapper_types())
        self._roots = [unwrap(c) for c in self.chunks]
        self._units: list[Fsdp1Unit] = []
        self._unit_names: list[tuple[int, str]] = []  # (vpp_stage, cleaned name of the wrapped module)
        for vpp_stage, chunk in enumerate(self.chunks):
            for name, module in chunk.named_modules():
                if isinstance(module, fsdp_cls):
                    unit = fsdp1_unit(module)
                    if unit is not None:
                        self._units.append(unit)
                        self._unit_names.append((vpp_stage, clean_name(name)))
        self._params: list[MonitoredParam] | None = None
        self._slot_of: dict[int, Slot | None] = {}  # index -> slot (None: a plain, unsharded param)
        self._placement_of: dict[int, Placement] = {}
        self._tapped = False
        # NO_SHARD keeps `.grad` across reduces (it all-reduces in place, as DDP): a later reduce's gradient
        # holds the earlier reduced ones, so only the first is this rank's own. Sharded units free it.
        self._seen = OncePerStep("FSDP (NO_SHARD)")
        self._sums = ReduceSums("FSDP")
        self._taps: GradTaps | None = None
        self._agreed = AgreedRows()  # which sharded rows of optimizer state exist on some rank
        self._grad_rows: dict[tuple[int, ...], list[bool]] = {}  # this step's agreed gradient rows

    @classmethod
    def detect(cls, chunks: Sequence[torch.nn.Module], optimizer: Any) -> bool:
        fsdp_cls = _fsdp1_class()
        return fsdp_cls is not None and any(isinstance(m, fsdp_cls) for c in chunks for m in c.modules())

    def roots(self) -> list[torch.nn.Module]:
        return self._roots

    def is_wrapper_module(self, module: torch.nn.Module) -> bool:
        return isinstance(module, self._wrappers)

    def attach_step(self, events: Any) -> list[Any]:
        if self.optimizer is None:
            return []
        return hook_optimizer_step(self.optimizer, events)

    def clip_entries(self) -> Sequence[Any]:
        from torch.distributed.fsdp import FullyShardedDataParallel

        # FSDP's own clipping scales the sharded gradients itself, not through torch's functions
        return (*torch_clip_entries(), ClipEntry(FullyShardedDataParallel, "clip_grad_norm_", method=True))

    def parameters(self) -> list[MonitoredParam]:
        if self._params is not None:
            return self._params
        order = module_order(self._roots)
        found: list[tuple[tuple[int, int], int, str, torch.nn.Parameter, Slot | None, Placement]] = []
        covered: set[int] = set()
        for unit, (vpp_stage, prefix) in zip(self._units, self._unit_names):
            covered.add(id(unit.flat))
            group = unit.fsdp.process_group
            # HYBRID_SHARD / _HYBRID_SHARD_ZERO2: shards within `process_group`, replicas across
            # `_inter_node_pg` (FSDP1's private name for the replica group, torch 2.13)
            replicas = getattr(unit.fsdp, "_inter_node_pg", None)
            copies = () if replicas is None else (replicas,)
            placement: Placement = (
                Sharded(group, replicated=copies) if unit.sharded else Replicated(group, *copies)
            )
            for k, slot in enumerate(unit.slots):
                if slot.orig is not None:
                    covered.add(id(slot.orig))
                param = slot.orig if slot.orig is not None else slot.flat
                # Frozen: no rows (as DDP/FSDP2). FSDP1 still computes a flat gradient for frozen
                # views under use_orig_params, which no optimizer and no clip_grad_norm_ reads.
                if not param.requires_grad:
                    continue
                name = clean_name(f"{prefix}.{slot.fqn}" if prefix else slot.fqn)
                key = (order.get(id(slot.owner), len(order)), k)
                found.append((key, vpp_stage, name, param, slot, placement))
        # Parameters outside every FSDP unit (a partly wrapped model) are neither sharded nor reduced.
        for vpp_stage, chunk in enumerate(self.chunks):
            for name, p in chunk.named_parameters():
                if id(p) in covered or not p.requires_grad:
                    continue
                owner = chunk.get_submodule(name.rpartition(".")[0])
                found.append(
                    ((order.get(id(owner), len(order)), 0), vpp_stage, clean_name(name), p, None, LOCAL)
                )
        found.sort(key=lambda item: (item[1], item[0]))
        out: list[MonitoredParam] = []
        for _, vpp_stage, name, param, slot, placement in found:
            index = len(out)
            out.append(MonitoredParam(index, vpp_stage, name, param))
            self._slot_of[index] = slot
            self._placement_of[index] = placement
        self._params = out
        return out

    def _slots_by_flat(self) -> dict[int, list[tuple[int, Slot]]]:
        by_flat: dict[int, list[tuple[int, Slot]]] = {}
        for mp in self.parameters():
            slot = self._slot_of[mp.index]
            if slot is not None:
                by_flat.setdefault(id(slot.flat), []).append((mp.index, slot))
        return by_flat

    @staticmethod
    def _split_unsharded(flat_grad: torch.Tensor, entries: list[tuple[int, Slot]]) -> list[torch.Tensor]:
        return [
            flat_grad[s.unsharded_offset : s.unsharded_offset + s.numel].view(s.shape) for _, s in entries
        ]

    # ---- pre-reduce taps ---------------------------------------------------------------------
    def install_grad_taps(self, taps: GradTaps) -> list[Any]:
        handles = []
        self._taps = taps
        by_flat = self._slots_by_flat()
        for unit in self._units:
            entries = by_flat.get(id(unit.flat))
            if entries:
                tap = guarded(self.context.faults, "FSDP1 gradient tap", self._make_tap(unit, entries, taps))
                handles.append(unit.flat.register_post_accumulate_grad_hook(tap))
        self._tapped = True
        return handles

    def report_held_unreduced(self) -> None:
        if self._taps is not None:
            self._sums.flush(self._taps.on_unreduced)

    @property
    def taps_report_unreduced(self) -> bool:
        return self._tapped

    def _make_tap(self, unit: Fsdp1Unit, entries: list[tuple[int, Slot]], taps: GradTaps):
        def tap(flat: torch.Tensor) -> None:
            # Under no_sync() FSDP keeps accumulating; the gradient is reported once, at the backward
            # that reduce-scatters it.
            if not taps.active or flat.grad is None or not unit.syncs_gradients():
                return
            if unit.sharded:
                grads = self._split_unsharded(flat.grad, entries)
                self._sums.add([i for i, _ in entries], grads, taps.on_unreduced)
                return
            fresh = set(self._seen.fresh(i for i, _ in entries))
            chosen = [(i, s) for i, s in entries if i in fresh]
            if chosen:
                taps.on_unreduced([i for i, _ in chosen], self._split_unsharded(flat.grad, chosen))

        return tap

    def new_step(self) -> None:
        self._seen.clear()
        self._sums.clear()
        self._grad_rows.clear()

    def _unreduced_at_step(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        # No taps installed (wg_distribution off at attach): only unwrapped parameters can be read here.
        return [
            TensorPiece.whole(mp.param.grad, LOCAL)
            if self._slot_of[mp.index] is None and mp.param.grad is not None
            else None
            for mp in params
        ]

    def install_microbatch_taps(self, params: Sequence[MonitoredParam], taps: GradTaps) -> list[Any]:
        # A tensor hook on the FlatParameter sees each backward's own unsharded gradient, before it is
        # accumulated into `.grad`.
        wanted = {mp.index for mp in params}
        handles = []
        for entries in self._slots_by_flat().values():
            entries = [(i, s) for i, s in entries if i in wanted]
            if not entries:
                continue

            def hook(grad: torch.Tensor, entries: list[tuple[int, Slot]] = entries) -> None:
                for (index, _), g in zip(entries, self._split_unsharded(grad, entries)):
                    taps.on_microbatch(index, g)

            handles.append(entries[0][1].flat.register_hook(guarded(self.context.faults, "FSDP1 tap", hook)))
        for mp in params:
            if self._slot_of[mp.index] is None:

                def plain_hook(grad: torch.Tensor, index: int = mp.index) -> None:
                    taps.on_microbatch(index, grad)

                handles.append(mp.param.register_hook(plain_hook))
        return handles

    # ---- optimizer-side tensors --------------------------------------------------------------
    def _piece(self, mp: MonitoredParam, flat_source: torch.Tensor | None, orig_source: Any) -> TensorPiece:
        """This rank's piece of parameter `mp`: its slice of a flat shard tensor, or (use_orig_params)
        the tensor that already is that slice."""
        slot = self._slot_of[mp.index]
        assert slot is not None
        placement = self._placement_of[mp.index]
        local: torch.Tensor | None = None
        if slot.shard_offset is not None and slot.shard_numel > 0:
            if isinstance(orig_source, torch.Tensor):
                local = orig_source
            elif flat_source is not None:
                local = flat_source[slot.shard_offset : slot.shard_offset + slot.shard_numel]
            if local is not None and not isinstance(placement, Sharded):
                local = local.view(slot.shape)
        dtype = local.dtype if local is not None else slot.flat.dtype
        if local is None and isinstance(placement, Sharded):
            # No element here: an empty piece on the flat parameter's device, the device the other ranks
            # merge on (CUDA, or CPU under CPU offload), which the process group cannot tell.
            local = slot.flat.detach().new_empty(0)
        return TensorPiece(local, placement, tuple(slot.shape), dtype)

    def read(self, kind: str, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        if kind == GRAD_REDUCED:
            return self._reduced_grads(params)
        if kind == GRAD_UNREDUCED:
            return self._unreduced_at_step(params)
        if kind == PARAM:
            return self._param_values(params)
        return self._optimizer_state(params, kind)

    def _agreement(self, params: Sequence[MonitoredParam], positions: list[int]) -> tuple[list, Any]:
        """The shard groups and the device (a flat parameter's) of the rows at `positions` of `params`."""
        groups = shard_groups(self._placement_of[params[i].index] for i in positions)
        return groups, self._slot_of[params[positions[0]].index].flat.device  # type: ignore[union-attr]

    def _reduced_grads(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        slots = [self._slot_of[mp.index] for mp in params]
        has = [
            mp.param.grad is not None
            if s is None
            else s.flat.grad is not None or (s.orig is not None and s.orig.grad is not None)
            for mp, s in zip(params, slots)
        ]
        # With use_orig_params FSDP1 drops a unit's flat gradient on a rank whose original parameters all
        # lack one (root pre-forward, summon_full_params, state_dict): a rank holding none of a parameter
        # cannot tell whether it has a gradient, so those rows are OR-ed over the shard group.
        sharded = [isinstance(self._placement_of[mp.index], Sharded) for mp in params]
        ask = [i for i, s in enumerate(slots) if s is not None and s.orig is not None and sharded[i]]
        if ask:
            # Once a step: a second read (gradients changed after a clipping) happens on some ranks only.
            key = tuple(params[i].index for i in ask)
            found = self._grad_rows.get(key)
            if found is None:
                found = any_over_ranks([has[i] for i in ask], *self._agreement(params, ask))
                self._grad_rows[key] = found
            for i, on in zip(ask, found):
                has[i] = on
        out: list[TensorPiece | None] = []
        for mp, s, on in zip(params, slots, has):
            if not on:
                out.append(None)  # no gradient on any rank this step
            elif s is None:
                out.append(TensorPiece.whole(mp.param.grad, LOCAL))
            else:
                out.append(self._piece(mp, s.flat.grad, s.orig.grad if s.orig is not None else None))
        if amp_grad_scale(self.optimizer) is not None:
            # a fused optimizer stepped by a (Sharded)GradScaler without unscale_ divides the loss scale out
            # in its kernel: here too, on each piece (a copy of this rank's slice, collected steps only)
            grads = unscaled_grads(self.optimizer, [None if p is None else p.tensor for p in out])
            out = [None if p is None else p._replace(tensor=g) for p, g in zip(out, grads)]
        return out

    def _optimizer_state(self, params: Sequence[MonitoredParam], key: str) -> list[TensorPiece | None]:
        values = state_values(self.optimizer, [mp.param for mp in params], key)
        # A rank holding none of a sharded parameter has no gradient, so no state, for it: whether its
        # row exists is agreed over the ranks.
        ask = [i for i, mp in enumerate(params) if isinstance(self._placement_of[mp.index], Sharded)]
        held = set()
        if ask:
            local = [values[i] is not None for i in ask]
            found = self._agreed.state(
                key, [params[i].index for i in ask], local, *self._agreement(params, ask)
            )
            held = {i for i, on in zip(ask, found) if on}
        asked = set(ask)
        out: list[TensorPiece | None] = []
        for i, (mp, value) in enumerate(zip(params, values)):
            slot = self._slot_of[mp.index]
            # A sharded row only where agreed: state gained between agreements may be on some ranks only.
            if i not in held if i in asked else value is None:
                out.append(None)
            elif slot is None:
                out.append(TensorPiece.whole(value, LOCAL))
            else:
                out.append(
                    self._piece(mp, None, value) if slot.orig is not None else self._piece(mp, value, None)
                )
        return out

    def _param_values(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        out: list[TensorPiece | None] = []
        for mp in params:
            slot = self._slot_of[mp.index]
            if slot is None:
                out.append(TensorPiece.whole(mp.param.detach(), LOCAL))
            else:
                orig = slot.orig.detach() if slot.orig is not None else None
                out.append(self._piece(mp, slot.flat.detach(), orig))
        return out
