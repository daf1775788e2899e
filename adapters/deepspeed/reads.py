"""DeepSpeed: reading gradients, parameters and optimizer state where the engine keeps them.

Where the optimizer-side tensors live (all local reads, no communication; merged by the core's one
packed reduction per step)
- stage 0, fp32 (basic torch optimizer): `p.grad` (all-reduced at the boundary), `optimizer.state[p]`
  and `p` itself, the same on every data-parallel rank (Replicated).
- stage 0, bf16/fp16 (FP16_UnfusedOptimizer): the low-precision `p.grad` (unscaled: the engine scales
  the loss for ZeRO optimizers only, `engine_scales_loss`), and float32 masters in `fp32_groups` whose
  state lives in the inner optimizer (Replicated).
- ZeRO-1/2 (DeepSpeedZeroOptimizer) and BF16_Optimizer: `p._hp_mapping` says which slice of `p` this
  rank's flat float32 partition holds (`lp_fragment_address`) and where in the partition
  (`hp_fragment_address`); the partition's optimizer state is indexed the same way; the reduced
  gradient fragment comes from the optimizer's gradient dictionary (Sharded).
- ZeRO-3 (DeepSpeedZeroOptimizer_Stage3): `safe_get_local_grad`, `safe_get_local_fp32_param` and
  `safe_get_local_optimizer_state` return this rank's partition of the flattened parameter, padded on the
  last ranks; the padding is cut off here (Sharded).

The `safe_get_full_*` functions all-reduce once per parameter and are never used here (tests only).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from trainermon.collect.placement import Placement, Replicated, Sharded, TensorPiece

from ..base import GRAD_REDUCED, PARAM, MonitoredParam
from . import layout
from .engine import zero12_grad_dict

logger = logging.getLogger("trainermon")


class DeepSpeedReads:
    """The adapter's `read`: this rank's piece of each tensor (a mixin; the state is the adapter's)."""

    def read(self, kind: str, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        if kind == GRAD_REDUCED:
            self._grad_scale = self._applied_scale()  # read once per step, not per parameter
            return [self._piece(mp, "grad") for mp in params]
        if kind == PARAM:
            return [self._piece(mp, "param") for mp in params]
        if kind in ("grad", "param"):
            return [None] * len(params)  # never a state key (those names are the two reads above)
        return [self._piece(mp, kind) for mp in params]  # an optimizer-state key; GRAD_UNREDUCED: no key

    def _piece(self, mp: MonitoredParam, what: str) -> TensorPiece | None:
        kind = self.kind.name
        if kind == "zero12":
            return self._zero12_piece(mp.param, what)
        if kind == "zero3":
            return self._zero3_piece(mp.param, what)
        return self._replicated_piece(mp.param, what)

    def _unscale(self, grad: torch.Tensor) -> torch.Tensor:
        scale = self._grad_scale
        if scale is None or scale == 1.0:
            return grad
        return grad.to(torch.float32) / scale  # fp16 only: the recorded gradient is the unscaled one

    def _replicated_piece(self, p: torch.nn.Parameter, what: str) -> TensorPiece | None:
        tied = self._tied.get(id(p))
        placement: Placement = Replicated(
            layout.expert_data_group(p) or self._dp_group, *([tied] if tied is not None else [])
        )
        if what == "grad":
            return None if p.grad is None else self._whole(self._unscale(p.grad), placement)
        master = self._fp32_master.get(id(p), p) if self.kind.name == "fp16_wrapper" else p
        if what == "param":
            return self._whole(master.detach(), placement)
        inner = self.optimizer if self.kind.name == "torch" else self.optimizer.optimizer
        value = inner.state.get(master, {}).get(what)
        return self._whole(value, placement) if isinstance(value, torch.Tensor) else None

    @staticmethod
    def _whole(t: torch.Tensor, placement: Placement) -> TensorPiece:
        return TensorPiece(t, placement, tuple(t.shape), t.dtype)

    # ZeRO-1/2 and BF16_Optimizer: this rank's fragment of each parameter, through `_hp_mapping`.
    def _zero12_partition(self, group: int) -> torch.Tensor:
        opt = self.optimizer
        flats = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_groups_flat_partition
        return flats[group]

    def _zero12_piece(self, p: torch.nn.Parameter, what: str) -> TensorPiece | None:
        opt = self.optimizer
        group = self._zero12_group.get(id(p))
        if group is None:
            return None
        tied = self._tied.get(id(p))
        placement = Sharded(opt.real_dp_process_group[group], replicated=(tied,) if tied is not None else ())
        flat = self._zero12_partition(group)
        frag = getattr(p, "_hp_mapping", None)
        if what == "grad":
            # The row exists on every rank when the optimizer holds reduced gradients for the group.
            grads = zero12_grad_dict(opt).get(group)
            if grads is None:
                if not self._said_no_grads:  # an optimizer layout this adapter does not know: say so
                    self._said_no_grads = True
                    logger.warning(
                        "trainermon: %s holds no reduced gradients for parameter group %d that trainermon "
                        "can read: grad_reduced rows of its parameters are left out",
                        type(opt).__name__,
                        group,
                    )
                return None
            local = None
            if frag is not None:
                g = frag.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
                lp = frag.lp_fragment_address
                if g.numel() != lp.numel:  # BF16_Optimizer keeps the whole parameter's gradient
                    g = g.narrow(0, lp.start, lp.numel)
                local = self._unscale(g)
            return TensorPiece(local, placement, tuple(p.shape), grads[0].dtype if grads else p.dtype)
        if what == "param":
            source = flat
        else:
            state = opt.optimizer.state.get(flat, {})
            source = state.get(what)
            if not isinstance(source, torch.Tensor) or source.shape != flat.shape:
                return None  # decided from the partition's state, the same on every rank
        local = None
        if frag is not None:
            hp = frag.hp_fragment_address
            local = source.narrow(0, hp.start, hp.numel)
        return TensorPiece(local, placement, tuple(p.shape), source.dtype)

    # ZeRO-3: this rank's partition of the flattened parameter (local APIs, no communication).
    def _zero3_piece(self, p: torch.nn.Parameter, what: str) -> TensorPiece | None:
        from deepspeed.utils import (
            safe_get_local_fp32_param,
            safe_get_local_grad,
            safe_get_local_optimizer_state,
        )

        group = getattr(p, "ds_process_group", None) or self.optimizer.dp_process_group
        try:
            if what == "grad":
                local = safe_get_local_grad(p)
            elif what == "param":
                local = safe_get_local_fp32_param(p)
            else:
                local = safe_get_local_optimizer_state(p, what)
        except KeyError:
            return None  # no such state yet; every rank holds a partition, so all agree
        if local is None:
            return None
        local = local.reshape(-1)
        if what == "grad":
            local = self._unscale(local)
        # Partitions are equal-sized; the last ranks' tails are padding beyond the parameter's numel.
        import torch.distributed as dist

        size = local.numel()
        valid = max(0, min(size, int(p.ds_numel) - dist.get_rank(group=group) * size))
        dtype = local.dtype
        piece = local.narrow(0, 0, valid) if valid > 0 else None
        return TensorPiece(piece, Sharded(group), tuple(p.ds_shape), dtype)
