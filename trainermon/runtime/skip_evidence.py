"""What explains a skipped step: a loss scaler's evidence, or non-finite gradients the loop skipped on.

`SkipEvidence` is a mixin of `skips.SkippedStepProbe` (which holds the state it reads and clears it at
each boundary): the calls from `scaler_watch` and the checks `_cleared` makes before it closes a step.

Only a skip a loss scaler explains is "the scaler at work": while a probe is attached, the scalers'
`step` and `unscale_` are watched at class level (`scaler_watch`) and tell the probe when called on the
monitored optimizer or a wrapper of it. A skipped step is the scaler's when its `step` was called since
the last boundary, or when its `unscale_` found Inf/NaN (a loop that unscales, clips, and skips
`scaler.step` on a non-finite norm: a routine overflow; the found_inf tensors are read on that skipped
step only). Any other skipped step is the loop's own (it found NaN gradients, or any reason of its own,
and did not call `optimizer.step()`): still closed and flagged `update_skipped`, but also `own_skip`, so
that `AnomalyNan` reports its non-finite gradients. A framework's reported step call (`step_called`) is
no explanation: Lightning calls `on_before_optimizer_step` under every precision plugin, scaler or not;
its mixed-precision plugins step through `scaler.step`, which the watch sees. The watch's handle is
among `attach()`'s: the last probe detached puts the original methods back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parameter import is_lazy


class SkipEvidence:
    """Mixin: the evidence a skip probe weighs. The probe provides the state below and `_ours(optimizer)`
    (the monitored optimizer or a wrapper of it)."""

    loop: Any
    trained: bool  # a backward reached the optimizer's parameters since the last boundary
    scaled: bool  # a loss scaler's step() was called on the optimizer since the last boundary
    found_inf: list[Any]  # ... or its unscale_(): the scaler's found_inf tensors
    others_inf: list[Any]  # found_inf of a scaler's unscale_ of another optimizer since backward
    watched: list[Any]  # the hooked parameters: the ones whose gradients `_nonfinite` reads

    def scaler_step(self, optimizer: Any) -> None:
        """A loss scaler's `step(optimizer)` is starting (before the optimizer's step, whose boundary
        clears the mark again): a skip until the next boundary is the scaler's."""
        if self._ours(optimizer):
            self.scaled = True

    def scaler_unscaled(self, scaler: Any, optimizer: Any) -> None:
        """A loss scaler's `unscale_(optimizer)` returned: keep copies of its found_inf tensors (no read
        here: no host sync), so that a skip the loop then makes on a non-finite clip norm is known as an
        overflow. Copies (0-d, one small device op each): `update()` adds the other optimizers' found_inf
        into the first tensor in place."""
        ours = self._ours(optimizer)
        if ours or self.trained:  # another's only after a backward reached ours (one scaler, a GAN)
            state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
            found = [t.clone() for t in (state or {}).get("found_inf_per_device", {}).values()]
            if ours:
                self.found_inf = found
            else:
                self.others_inf += found

    def _overflowed(self, found_inf: list | None = None) -> bool:
        """The last `unscale_` found Inf/NaN (a host read, on a skipped step only)."""
        try:
            return any(float(t.sum()) != 0 for t in (self.found_inf if found_inf is None else found_inf))
        except Exception as exc:  # noqa: BLE001 - the skip is still closed, as the loop's own
            self.loop.faults.record("scaler found_inf", exc)
            return False

    def _others_overflowed(self) -> bool:
        """A scaler's unscale_ of another optimizer, after a backward reached ours, found Inf/NaN: one
        scaler for a GAN's two optimizers, whose generator overflow flowed into the discriminator's
        gradients. Those gradients were no step of ours (a host read, on such a zero_grad() only)."""
        found, self.others_inf = self.others_inf, []
        # ours unscaled since the boundary and finite (else the scaler's skip): its non-finite came later
        return bool(found) and not self.found_inf and self._overflowed(found)

    def _by_scaler(self) -> bool:
        """A scaler's step since the boundary, or an overflow its unscale_ found."""
        return self.scaled or self._overflowed()

    def _alike_everywhere(self) -> bool:
        """Every rank holds the same gradients (one process; DDP's, all-reduced, the model not split), so
        a check of them decides alike on every rank. Others (FSDP's shards, pipeline stages, tensor-
        parallel pieces, ranks that do not reduce) may differ by rank, and a decision that differed would
        split the ranks' step counters (their collectives then mismatch): there the step is closed without
        looking, as a skipped one."""
        adapter = self.loop.adapter
        return self.loop.world_size == 1 or bool(getattr(adapter, "grads_alike_on_every_rank", False))

    def _nonfinite(self) -> bool:
        """The gradient of the first or the last of the optimizer's parameters (those hooked: a NaN loss,
        or a NaN reaching the first layer through backward, shows there) holds Inf/NaN: two norms and one
        host read (a device sync on an accelerator), at each zero_grad() after a backward with no step
        (a GAN's or FGSM's every iteration). A DTensor's (tensor-parallel pieces by rank) in a job of
        several ranks counts as one, as above."""
        grads = []
        for p in self.watched:
            grad = None if is_lazy(p) else p.grad
            if callable(getattr(grad, "to_local", None)):
                if self.loop.world_size > 1:
                    return True
                grad = grad.to_local()
            if grad is not None:
                grads.append(grad._values() if grad.is_sparse else grad)
        by_device: dict[Any, list] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        for same in by_device.values():
            try:
                norms = torch._foreach_norm(same)
            except Exception:  # noqa: BLE001 - a dtype foreach lacks: one at a time
                norms = [g.abs().max() if g.numel() else g.new_zeros(()) for g in same]
            if not bool(torch.isfinite(torch.stack([n.float() for n in norms])).all()):
                return True
        return False
