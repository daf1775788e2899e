"""Plain PyTorch and torch DistributedDataParallel.

- Pre-reduce gradient under DDP: a DDP communication hook sees each bucket's local gradients before it
  all-reduces them (then averages, as DDP's default does). `.grad` cannot be used for this: with
  `gradient_as_bucket_view=True` DDP has already divided it by the world size. With gradient
  accumulation under `no_sync()` the bucket holds the accumulated local gradient of the step.
- Each micro-batch's own gradient: a tensor hook on the leaf parameter, which autograd calls with the
  incoming gradient before it is accumulated into `.grad` (and before DDP sees it).
- Without DDP there is no reduction: the pre-reduce gradient is `.grad` at the optimizer step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from trainermon.names import clean_name
from trainermon.placement import LOCAL, Replicated, TensorPiece

from .base import Adapter, GradTaps, MonitoredParam

logger = logging.getLogger("trainermon")


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
            module = module._orig_mod  # torch.compile wrapper
        else:
            return module


class TorchAdapter(Adapter):
    name = "torch"

    def __init__(
        self, chunks: Sequence[torch.nn.Module], optimizer: Any, dp_group: Any, tp_group: Any
    ) -> None:
        super().__init__(chunks, optimizer, dp_group, tp_group)
        from torch.nn.parallel import DistributedDataParallel

        self._ddps = [c for c in self.chunks if isinstance(c, DistributedDataParallel)]
        self._roots = [_unwrap(c) for c in self.chunks]
        if self._ddps and self.dp_group is None:
            self.dp_group = self._ddps[0].process_group
        self._replica = Replicated(self.dp_group) if (self._ddps or dp_group is not None) else LOCAL
        self._params: list[MonitoredParam] | None = None
        self._comm_hooked = False
        self._seen_this_step: set[int] = set()
        self._warned_multi_reduce = False

    @classmethod
    def detect(cls, chunks: Sequence[torch.nn.Module], optimizer: Any) -> bool:
        return all(isinstance(c, torch.nn.Module) for c in chunks)

    def roots(self) -> list[torch.nn.Module]:
        return self._roots

    def is_wrapper_module(self, module: torch.nn.Module) -> bool:
        return _unwrap(module) is not module

    def parameters(self) -> list[MonitoredParam]:
        if self._params is None:
            out: list[MonitoredParam] = []
            for vpp_stage, root in enumerate(self._roots):
                for name, p in root.named_parameters():
                    if p.requires_grad:
                        out.append(MonitoredParam(len(out), vpp_stage, clean_name(name), p))
            self._params = out
        return self._params

    # ---- pre-reduce taps ---------------------------------------------------------------------
    def install_grad_taps(self, taps: GradTaps) -> list[Any]:
        if not self._ddps:
            return []
        index_of = {id(mp.param): mp.index for mp in self.parameters()}
        for ddp in self._ddps:
            self._register_comm_hook(ddp, taps, index_of)
        self._comm_hooked = True
        return []

    def _register_comm_hook(self, ddp: Any, taps: GradTaps, index_of: dict[int, int]) -> None:
        import torch.distributed as dist

        group = ddp.process_group
        adapter = self

        # No annotations: DDP validates hook annotations against the real classes, and this module's
        # postponed (string) annotations would fail that check.
        def allreduce_with_tap(state, bucket):  # noqa: ANN001, ANN202
            if taps.active:
                adapter._report_bucket(bucket, taps, index_of)
            tensor = bucket.buffer()
            tensor.div_(dist.get_world_size(group))
            work = dist.all_reduce(tensor, group=group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])

        ddp.register_comm_hook(None, allreduce_with_tap)

    def _report_bucket(self, bucket: Any, taps: GradTaps, index_of: dict[int, int]) -> None:
        indices, grads = [], []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            i = index_of.get(id(p))
            if i is None:
                continue
            if i in self._seen_this_step:
                if not self._warned_multi_reduce:
                    self._warned_multi_reduce = True
                    logger.warning(
                        "trainermon: DDP reduced gradients more than once in one step (gradient "
                        "accumulation without no_sync()); grad_unreduced records the first reduce only"
                    )
                continue
            self._seen_this_step.add(i)
            indices.append(i)
            grads.append(g)
        if indices:
            taps.on_unreduced(indices, grads)

    def new_step(self) -> None:
        self._seen_this_step.clear()

    def single_replica(self) -> bool:
        return self._replica is LOCAL and not self._comm_hooked

    def unreduced_grads(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None] | None:
        if self._comm_hooked:
            return None
        return [None if mp.param.grad is None else TensorPiece.whole(mp.param.grad, LOCAL) for mp in params]

    # ---- optimizer-side tensors --------------------------------------------------------------
    def _piece(self, t: torch.Tensor | None) -> TensorPiece | None:
        if t is None:
            return None
        return TensorPiece.whole(t, self._replica)

    def reduced_grads(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        return [self._piece(mp.param.grad) for mp in params]

    def optimizer_state(self, params: Sequence[MonitoredParam], key: str) -> list[TensorPiece | None]:
        state = getattr(self.optimizer, "state", None)
        if state is None:
            return [None] * len(params)
        out = []
        for mp in params:
            value = state.get(mp.param, {}).get(key) if mp.param in state else None
            out.append(self._piece(value) if isinstance(value, torch.Tensor) else None)
        return out

    def param_values(self, params: Sequence[MonitoredParam]) -> list[TensorPiece | None]:
        return [self._piece(mp.param.data) for mp in params]
