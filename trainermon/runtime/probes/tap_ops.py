"""The operators that put the monitor's activation hooks inside torch.compile'd graphs (see `graph_taps`).

- `trainermon::tap(tensors, site, owner, call, shards) -> micro` records tensors through a site and
  returns the call's micro-step (a 0-d int64 CPU tensor); `trainermon::tap_grad(grads, site, owner,
  micro, shards)` records gradients with the micro-step of the call that made them. `call` numbers the
  taps of one traced frame (`call_in_trace`): the compiler's common-subexpression pass ignores side
  effects, and merged two identical calls (a pre-hook tapping no tensors, `b(b(h))`) into one, whose
  micro-step both calls' gradient rows then took. The micro-step travels with
  the call through the graph, as each eager hook carries its own: backward runs a step's calls in its
  own order (reversed within one forward, or some never), which a queue of micro-steps got wrong.
  The traced hooks (`graph_taps`) call `tap` in the forward graph and `tap_grad` from tensor hooks that
  dynamo puts in the backward graph.
- Both operators are marked side-effectful (`torch.fx.node.has_side_effect`), so that the compiler keeps
  them although they return nothing. (Registering them as effectful ops instead threads an effect token
  through the graph, which DDP's graph splitter, `optimize_ddp`, mis-wires: "a and b must have same
  reduction dim, but got [1, 0] X [512, 512]"; `test_ddp_and_fsdp2_on_two_ranks`.) Where the operators
  cannot be registered (`available()` false), the hooks keep the graph-break path.
- DTensors: `local_pieces` is the operators' rule for them (registered on the first DTensor a traced
  hook sees). It calls the operator again with the local tensors and their shard labels, so the hooks of a
  tensor-parallel model stay in the graph.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ...stats.kinds import local_view

logger = logging.getLogger("trainermon")

#: site number -> the site's shape (graph_taps.SiteShape), which gives the site of each module (`owner`)
_SITES: dict[int, Any] = {}


def _site(site: int, owner: torch.Tensor) -> Any:
    """The recording site of (shape number, module), made on its first call; None once closed. `owner`:
    the module's key in a 0-d int64 CPU tensor (read without a device sync)."""
    shape = _SITES.get(site)
    return None if shape is None else shape.at(int(owner))


_state: dict[str, Any] = {}  # "ops": the registered operators, or "error": why registering failed;
# "dtensor": whether the rule for DTensors is registered


def available() -> bool:
    """Whether the tap operators are registered (registering them on first use)."""
    if "ops" not in _state and "error" not in _state:
        try:
            _state["ops"] = _register_ops()
        except Exception as exc:  # noqa: BLE001 - the graph-break path stays, rows as before
            _state["error"] = exc
            logger.info("trainermon: activation taps in compiled graphs unavailable (%s); graph breaks", exc)
    return "ops" in _state


def _register_ops() -> Any:
    """`trainermon::tap` and `trainermon::tap_grad`, defined through `torch.library.Library` with a kernel
    for every backend: `torch.library.custom_op`'s Python layers cost ~20 us more per call. `shards`: a
    shard label per tensor, filled in where DTensors were given (`local_pieces`); [] for plain tensors."""

    def tap(
        tensors: list[torch.Tensor], site: int, owner: torch.Tensor, call: int, shards: list[str]
    ) -> torch.Tensor:
        found = _site(site, owner)
        return torch.tensor(0 if found is None else found.forward(tensors, shards), dtype=torch.int64)

    def tap_grad(
        grads: list[torch.Tensor | None], site: int, owner: Any, micro: torch.Tensor, shards: list[str]
    ) -> None:
        found = _site(site, owner)
        if found is not None:
            found.backward(grads, shards, int(micro))

    library = torch.library.Library("trainermon", "DEF")
    # CUDA graphs (`mode="reduce-overhead"`) replay kernels, not Python. Captured into a graph, a tap's
    # allocations made CUDA-graph trees fail the user's step ("tensor(s) in the cudagraph pool not tracked
    # as outputs", H100), and replays would run none of its code. Tagged unsafe, inductor keeps it out:
    # it runs it between the graph's partitions (graph partitioning, on by default in torch 2.11 and
    # 2.13) or, without partitioning, leaves that graph without CUDA graphs. A torch without the tag
    # captures it; the tap then records nothing and says so (`CapturingCudaGraph`).
    unsafe = getattr(torch.Tag, "cudagraph_unsafe", None)
    tags = (unsafe,) if unsafe is not None else ()
    library.define(
        "tap(Tensor[] tensors, int site, Tensor owner, int call, str[] shards) -> Tensor", tags=tags
    )
    library.define(
        "tap_grad(Tensor?[] grads, int site, Tensor owner, Tensor micro, str[] shards) -> ()", tags=tags
    )
    fakes = {"tap": lambda *args: torch.empty((), dtype=torch.int64), "tap_grad": lambda *args: None}
    for name, kernel in (("tap", tap), ("tap_grad", tap_grad)):
        library.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"trainermon::{name}", fakes[name], lib=library)
        # the compiler keeps the call although nothing may use what it returns
        torch.fx.node.has_side_effect(getattr(torch.ops.trainermon, name).default)
    return library


def local_pieces(cls: Any, op: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """The operators' rule for DTensors: called again with each DTensor's local tensor and its shard label.
    Under torch.compile this runs while the graph is traced (the labels become constants of the graph:
    the placements and this rank's mesh coordinate are fixed there), so the compiled graph calls the
    operator on plain tensors; no collective, no copy. Without it DTensor's dispatch would refuse the
    operators (no sharding rule), and the hooks of a module that sees DTensors would break the graph,
    which torch 2.13 then fails to compile around an in-place module (see `graph_taps`)."""
    tensors, site, middle = args[0], args[1], args[1:-1]  # (tensors, site, owner, call | micro, shards)
    locals_, shards = [], []
    try:
        for t in tensors:
            local, label = local_view(t) if t is not None else (None, "")
            locals_.append(local)
            shards.append(label)
    except Exception as exc:  # noqa: BLE001 - no rows from this call, never a failed compile
        shape = _SITES.get(site)  # not the module's site: this may run while the graph is traced
        if shape is not None:
            shape.probe.loop.faults.record(
                "DTensor activation tap", exc, "this call's rows are not written by the compiled graph"
            )
        return torch.zeros((), dtype=torch.int64) if op is torch.ops.trainermon.tap.default else None
    return op(locals_, *middle, shards)


_trace: list[Any] = [None, 0]  # the frame being traced (a weak reference to its context), taps so far


@torch.compiler.assume_constant_result  # run as plain Python while dynamo traces: a constant in the graph
def call_in_trace() -> int:
    """The number of this tap call among those of the frame dynamo is tracing (0, 1, ...), the `call`
    argument of `trainermon::tap`: it keeps identical calls apart in the graph. Counted from 0 in each
    frame, so that a frame traced again gives the same graph (the compiler's caches key on it)."""
    context = torch._guards.TracingContext.try_get()
    if context is None or _trace[0] is None or _trace[0]() is not context:
        _trace[0] = None if context is None else weakref.ref(context)
        _trace[1] = 0
    _trace[1] += 1
    return _trace[1] - 1


@torch.compiler.assume_constant_result  # run as plain Python while dynamo traces: no graph break
def dtensors_allowed() -> bool:
    """Whether the operators take DTensors: registers `local_pieces` for them, once, when a traced hook
    first sees one. False where that cannot be done (a torch without `register_torch_dispatch`): those
    hooks then run outside the graph, as before."""
    if "dtensor" not in _state:
        try:
            from torch.distributed.tensor import DTensor

            for op in (torch.ops.trainermon.tap.default, torch.ops.trainermon.tap_grad.default):
                torch.library.register_torch_dispatch(op, DTensor, local_pieces, lib=_state["ops"])
            _state["dtensor"] = True
        except Exception as exc:  # noqa: BLE001 - the graph-break path stays
            _state["dtensor"] = False
            logger.info("trainermon: DTensor activations in compiled graphs break the graph (%s)", exc)
    return _state["dtensor"]
