"""Which tensors the engine can read, and how: every tensor a hook or an adapter hands over passes here.

`readable(t)` returns a `Readable`: a plain strided tensor whose values the engine reduces, plus what turns
its statistics into those of `t` (a multiplicity for broadcast dimensions, the zeros a sparse tensor does
not store, the piece of a DTensor it is). What cannot be read exactly raises `Unreadable` with the reason;
the caller skips that row and counts one fault. Nothing here copies a dense tensor or syncs a device.

    kind                                   read as
    plain Tensor / Parameter               itself (checked: its storage holds every element it addresses;
                                           FSDP frees unsharded parameters with `storage.resize_(0)`, and
                                           reading such a tensor crashes even eager torch)
    expanded view (stride 0)               the view with those dimensions of size 1, times their sizes
    negative view (`_neg_view`)            itself; eager torch resolves the sign, the native kernel refuses it
    subclass without __torch_dispatch__    `as_subclass(torch.Tensor)`: the same memory
    DTensor                                `to_local()`, labelled with its placement and mesh coordinate
    AsyncCollectiveTensor                  its result, once its collective completed (`trigger_wait()`)
    sparse COO / CSR / CSC / BSR / BSC     the stored values, plus the implicit zeros
    quantized                              `dequantize()` (one float copy; quantized tensors are small)
    mkldnn                                 `to_dense()`
    complex, nested, meta, fake, functional
    or vmap wrappers, other __torch_dispatch__
    subclasses                             unreadable (no real values, or no defined min/max)
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch

PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_TENSOR, _PARAMETER, _STRIDED = torch.Tensor, torch.nn.Parameter, torch.strided
#: Real dtypes: the engine reads these (float8 variants and other exotic dtypes go to the slow path).
_REAL_DTYPES = frozenset(
    (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool)
    + (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
)


#: Floating dtypes that eager torch casts to float64 besides those above. Packed ones (float4_e2m1fn_x2)
#: are floating point too but have no cast: refused here, never handed to an engine.
_CASTABLE_FLOATS = frozenset(
    dtype
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if (dtype := getattr(torch, name, None)) is not None
)


class Unreadable(Exception):
    """The tensor's values cannot be read exactly. `kind` names the kind of tensor (one log line per kind);
    the message says why."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"{kind}: {why}")
        self.kind = kind


class Readable(NamedTuple):
    tensor: torch.Tensor  # plain strided tensor whose elements are reduced
    multiplicity: int = 1  # each element stands for this many (dimensions broadcast with stride 0)
    implicit_zeros: int = 0  # zeros not stored (sparse layouts)
    shard: str = ""  # DTensor: which piece of the full tensor this local value is ("" = all of it)


def readable(t: Any) -> Readable:
    """How to read `t` (see the module docstring). Raises `Unreadable`. Cost: a few attribute reads for a
    plain tensor; never a copy of a dense tensor, never a device sync."""
    cls = type(t)
    if (
        (cls is _TENSOR or cls is _PARAMETER)
        and t.layout is _STRIDED
        and t.dtype in _REAL_DTYPES  # not complex, not quantized
        and not (t.is_nested or t.is_meta or t.is_neg())
    ):
        return _strided(t)
    if not isinstance(t, torch.Tensor):
        raise Unreadable(type(t).__name__, "not a tensor")
    if is_dtensor(t):
        return _dtensor(t)
    if type(t).__name__ == "AsyncCollectiveTensor":  # a functional collective's pending result
        return readable(t.trigger_wait())
    if type(t) not in PLAIN_TYPES:
        if torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python):
            raise Unreadable(
                type(t).__name__,
                "a tensor subclass with __torch_dispatch__ whose values trainermon cannot read",
            )
        t = t.as_subclass(torch.Tensor)  # a subclass over ordinary memory: read that memory
    return _special(t)


def _special(t: torch.Tensor) -> Readable:
    """The slow path: classify a plain-typed tensor whose dispatch keys are not known to be plain."""
    keys = torch._C._dispatch_keys(t)
    if t.is_meta:
        raise Unreadable("meta tensor", "it has no values")
    if keys.has(torch._C.DispatchKey.Python):
        raise Unreadable("tensor with Python dispatch", "a fake or traced tensor has no values to read")
    if torch._is_functional_tensor(t) or torch._C._functorch.is_functorch_wrapped_tensor(t):
        raise Unreadable("functionalized or vmap tensor", "its values are not addressable")
    if t.is_nested:
        raise Unreadable("nested tensor", "not supported")
    if t.is_complex():
        raise Unreadable("complex tensor", f"{t.dtype}: min and max are not defined")
    layout = t.layout
    if layout is torch.sparse_coo:
        values = t.coalesce().values() if not t.is_coalesced() else t.values()
        return Readable(_strided(values).tensor, 1, t.numel() - values.numel())
    if layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        values = t.values()
        return Readable(_strided(values).tensor, 1, t.numel() - values.numel())
    if t.is_quantized:
        return _strided(t.dequantize())
    if layout is not torch.strided:
        if t.is_mkldnn:
            return _strided(t.to_dense())
        raise Unreadable(f"{layout} tensor", "this layout is not supported")
    if t.dtype not in _REAL_DTYPES and t.dtype not in _CASTABLE_FLOATS:
        raise Unreadable(f"{t.dtype} tensor", "this dtype is not supported")
    return _strided(t)


def _strided(t: torch.Tensor) -> Readable:
    """A strided tensor with ordinary memory: check that the memory is there, fold broadcast dimensions."""
    n = t.numel()
    if n == 0:
        return _new(t, 1)
    multiplicity = 1
    if t.is_contiguous():
        last = t.storage_offset() + n - 1
    else:
        last = t.storage_offset()
        for size, step in zip(t.shape, t.stride()):
            if size > 1:
                if step == 0:
                    multiplicity *= size
                else:
                    last += (size - 1) * step
    try:
        held = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError) as exc:
        raise Unreadable("tensor without storage", str(exc)) from None
    if held < (last + 1) * t.element_size():
        raise Unreadable(
            "tensor with a released storage",
            f"shape {list(t.shape)} but {held} bytes of storage (freed, e.g. by FSDP's resize_(0) of "
            "unsharded parameters): its values are gone",
        )
    if multiplicity > 1:
        for dim, (size, step) in enumerate(zip(t.shape, t.stride())):
            if size > 1 and step == 0:
                t = t.narrow(dim, 0, 1)
    return _new(t, multiplicity)


def _new(t: torch.Tensor, multiplicity: int) -> Readable:
    return tuple.__new__(Readable, (t, multiplicity, 0, ""))  # twice as fast as Readable(...): hot path


def is_dtensor(t: torch.Tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _dtensor(t: Any) -> Readable:
    """The local piece of a DTensor, labelled `Shard(0)[dp=1/2]`-style for each mesh dimension that does not
    replicate it ("" when every dimension replicates it: the local value is the whole tensor)."""
    with torch.no_grad():
        local = t.to_local()
    label = shard_label(t.placements, t.device_mesh)
    inner = readable(local)
    return Readable(inner.tensor, inner.multiplicity, inner.implicit_zeros, label)


def shard_label(placements: Any, mesh: Any) -> str:
    """`Shard(0)[tp=1/2]` parts, one per mesh dimension that shards the tensor or holds a partial sum of it
    (`StridedShard(0,sf=2)`, `Partial(sum)`), with this rank's coordinate and the dimension's size."""
    if all(placement.is_replicate() for placement in placements):
        return ""  # the whole tensor; no mesh query (while torch.compile traces, the mesh may be a stand-in)
    names = getattr(mesh, "mesh_dim_names", None) or [str(i) for i in range(mesh.ndim)]
    coords = mesh.get_coordinate() or [0] * mesh.ndim
    parts = []
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        if placement.is_partial():
            kind = f"Partial({placement.reduce_op})"
        elif hasattr(placement, "split_factor"):
            kind = f"StridedShard({placement.dim},sf={placement.split_factor})"
        else:
            kind = f"Shard({getattr(placement, 'dim', '?')})"
        parts.append(f"{kind}[{names[dim]}={coords[dim]}/{mesh.size(dim)}]")
    return " ".join(parts)


def local_view(t: Any) -> tuple[Any, str]:
    """(the values this rank holds, shard label): a DTensor's local tensor and its placement label; any
    other object is returned as it is, with "" (the engine classifies it further)."""
    if type(t) in PLAIN_TYPES or not is_dtensor(t):
        return t, ""
    with torch.no_grad():
        return t.to_local(), shard_label(t.placements, t.device_mesh)
