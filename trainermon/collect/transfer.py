"""The engine's single device-to-host transfer point: one per collected step."""

from __future__ import annotations

from typing import Any

import torch


class TransferCounter:
    """Counts device-to-host transfers of statistics; the monitor promises one per collected step."""

    def __init__(self) -> None:
        self.count = 0


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list (indices, flags) as a tensor on `device` without a sync: `torch.tensor(values,
    device=...)` copies from pageable memory and waits for the stream, stalling the training thread once
    per call; this copies from pinned memory, ordered on the current stream (costs one async copy)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; a host tensor goes through pinned memory without a sync (`t.to(device)` from
    pageable memory waits for the stream: one stall of the training thread per call)."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type != "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


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
