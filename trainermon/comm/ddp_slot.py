"""DDP's single communication-hook slot, shared with the user.

DDP runs its gradient all-reduces inside the C++ reducer, where no Python patch sees them, unless a
communication hook is registered: then the hook issues them through `torch.distributed`. DDP accepts one
hook per model, once. To watch DDP's collectives without taking that slot from the user, `cc_distribution`
registers a delegating hook that runs DDP's default all-reduce (the same arithmetic) until the user
registers their own (fp16/bf16 compression, PowerSGD, ...), and makes this model's `register_comm_hook`
fill the delegate instead of raising. A model that has a hook already is left alone: its hook runs through
Python and is seen as it is. The delegate stays after `close()` (DDP cannot remove a hook); it then only
forwards to the user's hook or the default all-reduce, with nothing patched around it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("trainermon")


class DelegatingHook:
    """The hook DDP calls for each bucket; forwards to the user's hook once there is one."""

    def __init__(self, model: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        # Weakly: DDP's C++ reducer holds the hook (and so this delegate), unseen by the garbage collector;
        # a strong link back would keep the model alive forever (a cycle through C++).
        self.model = weakref.ref(model)
        self.state: object = model.process_group
        self.hook: Callable = default_hooks.allreduce_hook
        self.user = False

    def __call__(self, state: object, bucket):  # DDP checks the parameter is named `bucket`
        return self.hook(self.state, bucket)

    def register(self, state: object, hook: Callable) -> None:
        """Stands in for `model.register_comm_hook`: the user's hook replaces the default, once."""
        if self.user:
            raise RuntimeError(
                "register_comm_hook can only be called once (a communication hook is registered already)"
            )
        model = self.model()
        if model is not None:
            model._check_comm_hook(hook)  # DDP's own validation of the hook's signature
        self.state, self.hook, self.user = state, hook, True
        logger.info(
            "trainermon: DDP communication hook %s runs inside the monitor's delegate (cc_distribution)",
            getattr(hook, "__qualname__", hook),
        )


def share_slot(model: Any) -> bool:
    """Install the delegate on a DDP model without a hook; False when it has one (left as it is).

    Cost: one Python call per bucket per backward, on every step (DDP's hook cannot be toggled)."""
    if getattr(model, "_comm_hooks", None):
        return False
    delegate = DelegatingHook(model)

    def trainermon_delegating_hook(state: object, bucket):  # DDP wants a function with these names
        return delegate(state, bucket)

    model.register_comm_hook(None, trainermon_delegating_hook)
    model.register_comm_hook = delegate.register  # this model only; later user registrations land here
    return True
