"""The engine's single device-to-host transfer point: one per collected step."""

from __future__ import annotations

from typing import Any

import torch


class TransferCounter:
    """Counts device-to-host transfers of statistics; the monitor promises one per collected step."""

    def __init__(self) -> None:
        self.count = 0


def transfer_to_host(partials: torch.Tensor, counter: TransferCounter) -> tuple[torch.Tensor, Any]:
    """The engine's single transfer point. On an accelerator the copy is non-blocking into pinned memory
    and an event is returned for the worker to wait on; the training thread does not wait."""
    counter.count += 1
    if partials.device.type == "cpu":
        return partials, None
    if partials.device.type == "npu":
        from trainermon._device import torch_npu

        torch_npu()  # registers the NPU back-end's events and pinned memory with torch
    host = torch.empty(partials.shape, dtype=partials.dtype, pin_memory=True)
    host.copy_(partials, non_blocking=True)
    event = torch.Event(device=partials.device)
    event.record()
    return host, event
