"""What identifies a tensor's values within a step, so that a tensor seen by several hooks (a module's
output that is the next module's input, or a view of it) is reduced once (see `StepCollector.add_local`)."""

from __future__ import annotations

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: Positions in a value key of what the collector reads back from it instead of from the tensor again.
KEY_ADDRESS, KEY_SHAPE, KEY_DTYPE, KEY_VERSION = 2, 4, 6, 8


def value_key(t: torch.Tensor) -> tuple | None:
    """What identifies a tensor's values: its storage (the object and its size, not only its address),
    the place and layout of its elements in it, and its version counter (shared by views, bumped by
    in-place writes). None where that cannot be read: such tensors are always computed.

    A key found in the cache is trusted only if the tensor that was computed still has that same key
    (`StepCollector._still_holds`): Megatron's pipeline schedules free an output's memory with `out.data =
    torch.empty(1)` while the tensor object lives on, and the next micro-batch's tensor of that shape gets
    the same address (and may get a storage object at the same address too). Not detected: a storage
    refilled in place without autograd seeing it (`storage.resize_(0)`, then `resize_(n)` and a raw copy)."""
    if type(t) not in _PLAIN or t.layout is not torch.strided or t.is_neg() or t.is_conj():
        return None  # only plain tensors: a view bit or a subclass changes what the same memory means
    try:
        if not t.numel():
            return None
        storage = t.untyped_storage()
        return (
            storage._cdata,
            storage.nbytes(),
            t.data_ptr(),
            t.storage_offset(),
            tuple(t.shape),  # a torch.Size is never untracked by the garbage collector; a tuple is
            t.stride(),
            t.dtype,
            t.device,
            t._version,
        )
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
