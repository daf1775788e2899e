"""Finding the torch DistributedDataParallel that reduces a monitored model's gradients, wherever the user
put it: among the wrappers of what `set_monitor` got (`torch.compile(DDP(m))`: the DDP is the compiled
wrapper's `_orig_mod`), or around the module `set_monitor` got (`set_monitor(m)` while `DDP(m)` trains, or
`torch.compile(m)` inside a DDP). Without it `grad_unreduced` would be read after DDP's all-reduce: every
rank the same averaged gradient, silently."""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from typing import Any

import torch

from .common import WRAPPED_ATTRS, unwrap

logger = logging.getLogger("trainermon")


def ddp_among_wrappers(module: torch.nn.Module) -> Any:
    """The first DistributedDataParallel in the chain of wrappers from `module` down to the model (the
    chain `unwrap` walks), else None. A few attribute reads: called once per chunk at set_monitor."""
    from torch.nn.parallel import DistributedDataParallel

    seen = 0
    while isinstance(module, torch.nn.Module) and seen < 32:  # a guard against wrappers in a circle
        if isinstance(module, DistributedDataParallel):
            return module
        if isinstance(module, torch.jit.ScriptModule):  # no wrapper; its _modules has no .get
            return None
        children = module._modules
        inner = next((children[a] for a in WRAPPED_ATTRS if a in children and children[a] is not None), None)
        if inner is None:
            return None
        module, seen = inner, seen + 1
    return None


def ddps_wrapping(roots: Sequence[torch.nn.Module]) -> list[Any]:
    """The live DistributedDataParallel objects whose model (wrappers aside) is or holds one of `roots`,
    in the order of `roots`, each once. Only where a process group exists (no DDP without one). Cost: one
    pass over the garbage collector's objects (~0.1-0.4 s in a process holding a GPT-2-sized model) and a
    walk of each DDP's modules, so called once per run, never per step."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    from torch.nn.parallel import DistributedDataParallel

    wanted = {id(r): i for i, r in enumerate(roots)}
    found: dict[int, Any] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): some lazy module proxies warn when asked for __class__
        if issubclass(type(obj), DistributedDataParallel):
            inner = getattr(obj, "module", None)
            if not isinstance(inner, torch.nn.Module):
                continue
            # the model itself, or a model holding it (set_monitor(m.body) while DDP(m) trains)
            for module in unwrap(inner).modules():
                index = wanted.get(id(module))
                if index is not None and index not in found:
                    found[index] = obj
    unique: list[Any] = []
    for i in sorted(found):
        if all(found[i] is not d for d in unique):
            unique.append(found[i])
    return unique


def say_post_reduce(loud: bool) -> None:
    """Said once per run (the caller looks once): several ranks, and no DDP around the monitored model,
    so `grad_unreduced` is `.grad` at the optimizer step, after any all-reduce done outside DDP. A warning
    when `set_monitor` got a `dp_group` (something reduces the gradients), else an INFO line (ranks that
    train alone, or split the model, reduce nothing)."""
    log = logger.warning if loud else logger.info
    log(
        "trainermon: no DistributedDataParallel wraps the monitored model (none among its wrappers nor "
        "among live objects at the first collected step): grad_unreduced is each rank's .grad at the "
        "optimizer step, after any all-reduce done outside DDP (then the same on every rank); pass the "
        "DDP-wrapped model to set_monitor"
    )
