"""PyTorch FSDP: FSDP1 (`FullyShardedDataParallel`, flat parameters) and FSDP2 (`fully_shard`, DTensors).

Where each family is read (checked on torch 2.13, see shared/FRAMEWORKS.md):

FSDP1
- grad_unreduced: a post-accumulate-grad hook on each FlatParameter. Autograd runs it inside the
  AccumulateGrad node, before FSDP's own post-backward hook (a node post-hook) reduce-scatters, so
  `.grad` is this rank's unsharded flat gradient, accumulated over `no_sync()` micro-batches. It is split
  into the original parameters with the flat parameter's layout.
- grad_reduced, exp_avg/exp_avg_sq, param: the local flat shard. `_shard_param_infos` says which slice of
  the shard belongs to which original parameter; with `use_orig_params=True` the original parameters
  (and their `.grad` and optimizer state) already are those 1-D slices.
- Everything private FSDP1 exposes is read once, in `_fsdp1_unit`.

FSDP2
- grad_unreduced: FSDP2 unshards in a forward pre-hook that it prepends; a forward pre-hook of ours,
  registered after `fully_shard`, then finds the unsharded plain Parameters on the module and puts a
  post-accumulate-grad hook on each (once per object). It fires before FSDP2's post-backward
  reduce-scatter. Whether this backward reduces (`set_requires_gradient_sync`) and the gradient
  accumulated in the reduce dtype over earlier micro-batches are private: read in `_fsdp2_unit`.
- grad_reduced, exp_avg/exp_avg_sq, param: DTensors; `.to_local()` is this rank's `Shard` piece.

Sharded pieces are `TensorPiece(local slice or None, Sharded(group), full shape, dtype)`; the core merges
partial statistics with one packed reduction. Nothing is ever gathered here (no `summon_full_params`, no
`full_tensor()`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainermon.names import clean_name
from trainermon.placement import LOCAL, Placement, Replicated, Sharded, TensorPiece

from .base import Adapter, GradTaps, MonitoredParam

logger = logging.getLogger("trainermon")


# ==== shared helpers ============================================================================
def _fsdp_imported() -> bool:
    # A model can only contain FSDP modules if the user imported FSDP; this keeps `detect` free of the
    # import for everyone else.
    return "torch.distributed.fsdp" in sys.modules


def _wrapper_types() -> tuple[type, ...]:
    types: list[type] = []
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

        types.append(ActivationWrapper)
    except Exception:  # noqa: BLE001 - optional on builds without torch.distributed
        pass
    try:
        from torch._dynamo.eval_frame import OptimizedModule

        types.append(OptimizedModule)
    except Exception:  # noqa: BLE001
        pass
    return tuple(types)


def _unwrap_once(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module a wrapper wraps (FSDP1, checkpoint wrapper, torch.compile), or None."""
    for attr in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"):
        inner = module._modules.get(attr)
        if inner is not None:
            return inner
    return None


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while (inner := _unwrap_once(module)) is not None:
        module = inner
    return module


class _Once:
    """Logs a failing hook once instead of raising into the backward pass."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.logged = False

    def __call__(self, exc: BaseException) -> None:
        if not self.logged:
            self.logged = True
            logger.error("trainermon: %s failed (%s: %s); continuing", self.what, type(exc).__name__, exc)


class _Handles:
    """Several removable handles behind one `remove()`, plus handles added later (lazy registration)."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def remove(self) -> None:
        for h in self.items:
            h.remove()
        self.items.clear()


def _state_value(optimizer: Any, param: torch.Tensor, key: str) -> torch.Tensor | None:
    state = getattr(optimizer, "state", None)
    if state is None or param not in state:
        return None
    value = state[param].get(key)
    return value if isinstance(value, torch.Tensor) else None


def _optimizer_has_key(optimizer: Any, params: Sequence[torch.Tensor], key: str) -> bool:
    # Decides whether a state row exists at all, the same way on every rank (each rank holds state for
    # some piece of the model), so that the sharded rows line up for the packed reduction.
    return any(_state_value(optimizer, p, key) is not None for p in params)


def _module_order(chunks: Sequence[torch.nn.Module]) -> dict[int, int]:
    order: dict[int, int] = {}
    for chunk in chunks:
        for m in chunk.modules():
            order.setdefault(id(m), len(order))
    return order


# ==== FSDP1 =====================================================================================
@dataclass(frozen=True)
class _Slot:
    """One original parameter inside an FSDP1 FlatParameter."""

    flat: torch.nn.Parameter
    owner: torch.nn.Module  # the module the original parameter belongs to
    fqn: str  # relative to the FSDP unit's wrapped module
    shape: torch.Size
    unsharded_offset: int  # in the unsharded flat gradient (alignment padding included)
    numel: int
    shard_offset: int | None  # in the local flat shard; None when this rank holds none of it
    shard_numel: int
    orig: torch.nn.Parameter | None  # the original Parameter (use_orig_params=True), else None


@dataclass
class _Fsdp1Unit:
    fsdp: torch.nn.Module
    flat: torch.nn.Parameter
    slots: list[_Slot]
    sharded: bool
    use_orig_params: bool
    syncs_gradients: Callable[[], bool]


def _fsdp1_unit(fsdp: torch.nn.Module) -> _Fsdp1Unit | None:
    """Everything the adapter reads from FSDP1's private state, in one place.

    FSDP1 has no public API for where an original parameter lives in its FlatParameter; these attributes
    are stable from torch 2.1 to 2.13. Returns None for a unit that manages no parameters.
    """
    handle = getattr(fsdp, "_handle", None)
    if handle is None:
        return None
    flat = handle.flat_param
    needed = ("_fqns", "_shapes", "_numels", "_numels_with_padding", "_is_padding_mask", "_shard_param_infos")
    missing = [a for a in needed if not hasattr(flat, a)]
    if missing or not hasattr(handle, "_use_orig_params") or not hasattr(fsdp, "_sync_gradients"):
        raise RuntimeError(
            f"trainermon: FSDP1 in torch {torch.__version__} lacks the FlatParameter layout attributes "
            f"{missing or ['_use_orig_params/_sync_gradients']}; the FSDP adapter is tested with torch 2.13"
        )
    use_orig = bool(handle._use_orig_params)
    origs = list(flat._params) if use_orig and flat._params is not None else [None] * len(flat._fqns)
    owners = [info.module for info in flat._param_infos]
    offsets: list[int] = []
    position = 0
    for numel, is_pad in zip(flat._numels_with_padding, flat._is_padding_mask):
        if not is_pad:
            offsets.append(position)
        position += numel
    slots = []
    for i, fqn in enumerate(flat._fqns):
        info = flat._shard_param_infos[i]
        slots.append(
            _Slot(
                flat=flat,
                owner=owners[i],
                fqn=fqn,
                shape=torch.Size(flat._shapes[i]),
                unsharded_offset=offsets[i],
                numel=int(flat._numels[i]),
                shard_offset=int(info.offset_in_shard) if info.in_shard else None,
                shard_numel=int(info.numel_in_shard) if info.in_shard else 0,
                orig=origs[i],
            )
        )
    return _Fsdp1Unit(
        fsdp=fsdp,
        flat=flat,
        slots=slots,
        sharded=bool(handle.uses_sharded_strategy),
        use_orig_params=use_orig,
        syncs_gradients=lambda: bool(fsdp._sync_gradients),
    )


def _fsdp1_class() -> type | None:
    if not _fsdp_imported():
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


class Fsdp1Adapter(Adapter):
    """FSDP1 with `use_orig_params` True or False, any sharding strategy (NO_SHARD counts as replicated)."""

    name = "fsdp1"

    def __init__(
        self, chunks: Sequence[torch.nn.Module], optimizer: Any, dp_group: Any, tp_group: Any
    ) -> None:
        super().__init__(chunks, optimizer, dp_group, tp_group)
        fsdp_cls = _fsdp1_class()
        assert fsdp_cls is not None
        self._fsdp_cls = fsdp_cls
        self._wrappers = (fsdp_cls, *_wrapper_types())
        self._roots = [_unwrap(c) for c in self.chunks]
        self._units: list[_Fsdp1Unit] = []
        self._unit_names: list[tuple[int, str]] = []  # (vpp_stage, cleaned name of the wrapped module)
        for vpp_stage, chunk in enumerate(self.chunks):
            for name, module in chunk.named_modules():
                if isinstance(module, fsdp_cls):
                    unit = _fsdp1_unit(module)
                    if unit is not None:
                        self._units.append(unit)
                        self._unit_names.append((vpp_stage, clean_name(name)))
        if self.dp_group is None and self._units:
            self.dp_group = self._units[0].fsdp.process_group
        self._params: list[MonitoredParam] | None = None
        self._slot_of: dict[int, _Slot | None] = {}  # index -> slot (None: a plain, unsharded param)
        self._placement_of: dict[int, Placement] = {}
        self._tapped = False
        self._seen: set[int] = set()
        self._warned_multi_reduce = False
        self._fail = _Once("FSDP1 gradient tap")

    @classmethod
    def detect(cls, chunks: Sequence[torch.nn.Module], optimizer: Any) -> bool:
        fsdp_cls = _fsdp1_class()
        return fsdp_cls is not None and any(isinstance(m, fsdp_cls) for c in chunks for m in c.modules())

    def roots(self) -> list[torch.nn.Module]:
        return self._roots

    def is_wrapper_module(self, module: torch.nn.Module) -> bool:
        return isinstance(module, self._wrappers)

    def parameters(self) -> list[MonitoredParam]:
        if self._params is not None:
            return self._params
        order = _module_order(self._roots)
        found: list[tuple[tuple[int, int], int, str, torch.nn.Parameter, _Slot | None, Placement]] = []
        covered: set[int] = set()
        for unit, (vpp_stage, prefix) in zip(self._units, self._unit_names):
            covered.add(id(unit.flat))
            group = unit.fsdp.process_group
            placement: Placement = Sharded(group) if unit.sharded else Replicated(group)
            for k, slot in enumerate(unit.slots):
                if slot.orig is not None:
                    covered.add(id(slot.orig))
                name = clean_name(f"{prefix}.{slot.fqn}" if prefix else slot.fqn)
                param = slot.orig if slot.orig is not None else slot.flat
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

    def _slots_by_flat(self) -> dict[int, list[tuple[int, _Slot]]]:
        by_flat: dict[int, list[tuple[int, _Slot]]] = {}
        for mp in self.parameters():
            slot = self._slot_of[mp.index]
            if slot is not None:
                by_flat.setdefault(id(slot.flat), []).append((mp.index, slot))
        return by_flat

    @staticmethod
    def _split_unsharded(flat_grad: torch.Tensor, entries: list[tuple[int, _Slot]]) -> list[torch.Tensor]:
        return [
            flat_grad[s.unsharded_offset : s.unsharded_offset + s.numel].view(s.shape) for _, s in entries
        ]

    # ---- pre-reduce taps ---------------------------------------------------------------------
    def install_grad_taps(self, taps: GradTaps) -> list[Any]:
        handles = []
        by_flat = self._slots_by_flat()
        for unit in self._units:
            entries = by_flat.get(id(unit.flat))
            if entries:
                handles.append(
                    unit.flat.register_post_accumulate_grad_hook(self._make_tap(unit, entries, taps))
                )
        self._tapped = True
        return handles

    def _make_tap(self, unit: _Fsdp1Unit, entries: list[tuple[int, _Slot]], taps: GradTaps):
        def tap(flat: torch.Tensor) -> None:
            if not taps.active:
                return
            try:
                # Under no_sync() FSDP keeps accumulating; the gradient is reported once, at the backward
                # that reduce-scatters it.
                if flat.grad is None or not unit.syncs_gradients():
                    return
                fresh = [(i, s) for i, s in entries if i not in self._seen]
                if len(fresh) < len(entries) and not self._warned_multi_reduce:
                    self._warned_multi_reduce = True
                    logger.warning(
                        "trainermon: FSDP reduce-scattered gradients more than once in one step (gradient "
                        "accumulation without no_sync()); grad_unreduced records the first reduce only"
                    )
                if not fresh:
                    return
                self._seen.update(i for i, _ in fresh)
                taps.on_unreduced([i for i, _ in fresh], self._split_unsharded(flat.grad, fresh))
            except Exception as exc:  # noqa: BLE001 - never break the backward pass
                self._fail(exc)

        return tap

    def new_step(self) -> None:
        self._seen.clear()

    def unreduced_grads(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None] | None:
        if self._tapped:
            return None
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

            def hook(grad: torch.Tensor, entries: list[tuple[int, _Slot]] = entries) -> None:
                try:
                    for (index, _), g in zip(entries, self._split_unsharded(grad, entries)):
                        taps.on_microbatch(index, g)
                except Exception as exc:  # noqa: BLE001
                    self._fail(exc)

            handles.append(entries[0][1].flat.register_hook(hook))
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
        return TensorPiece(local, placement, tuple(slot.shape), dtype)

    def reduced_grads(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        out: list[TensorPiece | None] = []
        for mp in params:
            slot = self._slot_of[mp.index]
            if slot is None:
                out.append(None if mp.param.grad is None else TensorPiece.whole(mp.param.grad, LOCAL))
            elif slot.flat.grad is None and (slot.orig is None or slot.orig.grad is None):
                out.append(None)  # no gradient in this unit on any rank this step
            else:
                orig_grad = slot.orig.grad if slot.orig is not None else None
                out.append(self._piece(mp, slot.flat.grad, orig_grad))
        return out

    def optimizer_state(self, params: Sequence[MonitoredParam], key: str) -> list[TensorPiece | None]:
        if not _optimizer_has_key(self.optimizer, [mp.param for mp in self.parameters()], key):
            return [None] * len(params)
        out: list[TensorPiece | None] = []
        for mp in params:
            slot = self._slot_of[mp.index]
            value = _state_value(self.optimizer, mp.param, key)
            if slot is None:
                out.append(None if value is None else TensorPiece.whole(value, LOCAL))
            elif slot.orig is not None:
                out.append(self._piece(mp, None, value))
            else:
                out.append(self._piece(mp, value, None))
        return out

    def param_values(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        out: list[TensorPiece | None] = []
        for mp in params:
            slot = self._slot_of[mp.index]
            if slot is None:
                out.append(TensorPiece.whole(mp.param.detach(), LOCAL))
            else:
                orig = slot.orig.detach() if slot.orig is not None else None
                out.append(self._piece(mp, slot.flat.detach(), orig))
        return out


# ==== FSDP2 =====================================================================================
@dataclass
class _Fsdp2Unit:
    reduces_gradients: Callable[[], bool]
    accumulated_grad: Callable[[torch.Tensor], torch.Tensor | None]


def _fsdp2_unit(module: torch.nn.Module) -> _Fsdp2Unit:
    """The two facts FSDP2 keeps private, read in one place.

    - whether the coming post-backward reduce-scatters (`set_requires_gradient_sync` has no getter);
    - the gradient accumulated over earlier micro-batches in the reduce dtype (with a mixed-precision
      policy whose reduce dtype differs from the param dtype, FSDP2 moves it off `.grad`).
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    state = get_state() if callable(get_state) else None
    if state is None or not hasattr(state, "_fsdp_param_group"):
        raise RuntimeError(
            f"trainermon: FSDP2 in torch {torch.__version__} has no '_get_fsdp_state()._fsdp_param_group' "
            f"on {type(module).__name__}; the FSDP adapter is tested with torch 2.13"
        )

    def group() -> Any:
        return state._fsdp_param_group

    def reduces_gradients() -> bool:
        g = group()
        return True if g is None else bool(g.reduce_grads)

    def accumulated_grad(unsharded_param: torch.Tensor) -> torch.Tensor | None:
        g = group()
        for fsdp_param in [] if g is None else g.fsdp_params:
            if getattr(fsdp_param, "_unsharded_param", None) is unsharded_param:
                return fsdp_param.unsharded_accumulated_grad
        return None

    return _Fsdp2Unit(reduces_gradients, accumulated_grad)


def _fsdp2_module_class() -> type | None:
    if not _fsdp_imported():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def _dtensor_placement(p: torch.Tensor) -> Placement:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return LOCAL
    mesh = p.device_mesh
    shard_dims = [d for d, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    if len(shard_dims) == 1:
        # HSDP (Replicate, Shard): the shard group holds the whole tensor, replicas hold copies.
        return Sharded(mesh.get_group(shard_dims[0]))
    if not shard_dims:
        return Replicated(mesh.get_group(0) if mesh.ndim == 1 else None)
    raise NotImplementedError(f"trainermon: DTensor placements {p.placements} (several sharded mesh dims)")


class Fsdp2Adapter(Adapter):
    """FSDP2 (`fully_shard`), with or without a MixedPrecisionPolicy."""

    name = "fsdp2"

    def __init__(
        self, chunks: Sequence[torch.nn.Module], optimizer: Any, dp_group: Any, tp_group: Any
    ) -> None:
        super().__init__(chunks, optimizer, dp_group, tp_group)
        module_cls = _fsdp2_module_class()
        assert module_cls is not None
        self._module_cls = module_cls
        self._wrappers = _wrapper_types()
        self._roots = [_unwrap(c) for c in self.chunks]
        self._params: list[MonitoredParam] | None = None
        self._placement_of: dict[int, Placement] = {}
        # FSDP module -> [(index, owner module, attribute)] for the parameters it shards.
        self._managed: list[tuple[torch.nn.Module, list[tuple[int, torch.nn.Module, str]]]] = []
        self._hooked: dict[int, Any] = {}  # id(unsharded param) -> (param, handle)
        self._seen: set[int] = set()
        self._warned_multi_reduce = False
        self._fail = _Once("FSDP2 gradient tap")

    @classmethod
    def detect(cls, chunks: Sequence[torch.nn.Module], optimizer: Any) -> bool:
        module_cls = _fsdp2_module_class()
        return module_cls is not None and any(isinstance(m, module_cls) for c in chunks for m in c.modules())

    def roots(self) -> list[torch.nn.Module]:
        return self._roots

    def is_wrapper_module(self, module: torch.nn.Module) -> bool:
        return bool(self._wrappers) and isinstance(module, self._wrappers)

    def parameters(self) -> list[MonitoredParam]:
        if self._params is not None:
            return self._params
        out: list[MonitoredParam] = []
        index_of: dict[int, int] = {}
        for vpp_stage, root in enumerate(self._roots):
            for name, p in root.named_parameters():
                if p.requires_grad:
                    index_of[id(p)] = len(out)
                    self._placement_of[len(out)] = _dtensor_placement(p)
                    out.append(MonitoredParam(len(out), vpp_stage, clean_name(name), p))
        # Each parameter belongs to its nearest enclosing fully_shard-ed module.
        for root in self._roots:
            self._collect_managed(root, None, index_of)
        self._params = out
        return out

    def _collect_managed(
        self, module: torch.nn.Module, fsdp_owner: list | None, index_of: dict[int, int]
    ) -> None:
        if isinstance(module, self._module_cls):
            fsdp_owner = []
            self._managed.append((module, fsdp_owner))
        if fsdp_owner is not None:
            for attr, p in module._parameters.items():
                if p is not None and id(p) in index_of:
                    fsdp_owner.append((index_of[id(p)], module, attr))
        for child in module.children():
            self._collect_managed(child, fsdp_owner, index_of)

    # ---- pre-reduce taps ---------------------------------------------------------------------
    def install_grad_taps(self, taps: GradTaps) -> list[Any]:
        from torch.distributed.tensor import DTensor

        self.parameters()
        handles = []
        for fsdp_module, managed in self._managed:
            if not managed:
                continue
            unit = _fsdp2_unit(fsdp_module)

            def pre_hook(_module: torch.nn.Module, _args: Any, managed=managed, unit=unit) -> None:
                # Runs after FSDP2's own (prepended) pre-forward hook has unsharded the parameters.
                if not taps.active or not torch.is_grad_enabled():
                    return
                try:
                    for index, owner, attr in managed:
                        p = owner._parameters.get(attr)
                        if p is None or isinstance(p, DTensor) or id(p) in self._hooked:
                            continue
                        handle = p.register_post_accumulate_grad_hook(self._make_tap(index, unit, taps))
                        self._hooked[id(p)] = (p, handle)
                except Exception as exc:  # noqa: BLE001
                    self._fail(exc)

            handles.append(fsdp_module.register_forward_pre_hook(pre_hook))
        return handles

    def _make_tap(self, index: int, unit: _Fsdp2Unit, taps: GradTaps):
        def tap(p: torch.Tensor) -> None:
            if not taps.active or p.grad is None:
                return
            try:
                if not unit.reduces_gradients():
                    return  # accumulating without sync: reported at the backward that reduces
                if index in self._seen:
                    if not self._warned_multi_reduce:
                        self._warned_multi_reduce = True
                        logger.warning(
                            "trainermon: FSDP2 reduce-scattered gradients more than once in one step "
                            "(accumulation without set_requires_gradient_sync(False)); grad_unreduced "
                            "records the first reduce only"
                        )
                    return
                self._seen.add(index)
                grad = p.grad
                earlier = unit.accumulated_grad(p)
                if earlier is not None:
                    grad = earlier + grad  # what FSDP2 is about to reduce-scatter (transient)
                taps.on_unreduced([index], [grad])
            except Exception as exc:  # noqa: BLE001 - never break the backward pass
                self._fail(exc)

        return tap

    def new_step(self) -> None:
        self._seen.clear()

    def unreduced_grads(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None] | None:
        return None

    def install_microbatch_taps(self, params: Sequence[MonitoredParam], taps: GradTaps) -> list[Any]:
        # Each micro-batch's own gradient: a tensor hook on the unsharded parameter (fires before it is
        # accumulated into `.grad`), registered once per step and object in a forward pre-hook.
        from torch.distributed.tensor import DTensor

        self.parameters()
        wanted = {mp.index for mp in params}
        group = _Handles()
        hooked: set[int] = set()
        for fsdp_module, managed in self._managed:
            mine = [m for m in managed if m[0] in wanted]
            if not mine:
                continue

            def pre_hook(_module: torch.nn.Module, _args: Any, mine=mine) -> None:
                if not torch.is_grad_enabled():
                    return
                try:
                    for index, owner, attr in mine:
                        p = owner._parameters.get(attr)
                        if p is None or isinstance(p, DTensor) or id(p) in hooked:
                            continue
                        hooked.add(id(p))
                        group.items.append(
                            p.register_hook(lambda g, index=index: taps.on_microbatch(index, g))
                        )
                except Exception as exc:  # noqa: BLE001
                    self._fail(exc)

            group.items.append(fsdp_module.register_forward_pre_hook(pre_hook))
        return [group]

    # ---- optimizer-side tensors --------------------------------------------------------------
    def _piece(self, mp: MonitoredParam, value: torch.Tensor | None) -> TensorPiece | None:
        if value is None:
            return None
        placement = self._placement_of[mp.index]
        with torch.no_grad():
            local = value.to_local() if hasattr(value, "to_local") else value
        if isinstance(placement, Sharded) and local.numel() == 0:
            local = None  # this rank holds no elements of the parameter
        return TensorPiece(local, placement, tuple(mp.param.shape), value.dtype)

    def reduced_grads(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        return [self._piece(mp, mp.param.grad) for mp in params]

    def optimizer_state(self, params: Sequence[MonitoredParam], key: str) -> list[TensorPiece | None]:
        if not _optimizer_has_key(self.optimizer, [mp.param for mp in self.parameters()], key):
            return [None] * len(params)
        out: list[TensorPiece | None] = []
        for mp in params:
            value = _state_value(self.optimizer, mp.param, key)
            piece = self._piece(mp, value)
            if piece is None and not isinstance(self._placement_of[mp.index], Sharded):
                out.append(None)
            elif piece is None:
                # Keep the row on every rank so the packed reduction lines up.
                out.append(
                    TensorPiece(None, self._placement_of[mp.index], tuple(mp.param.shape), mp.param.dtype)
                )
            else:
                out.append(piece)
        return out

    def param_values(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        return [self._piece(mp, mp.param.detach()) for mp in params]

    def close(self) -> None:
        for _p, handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
