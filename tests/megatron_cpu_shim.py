"""TEST-ONLY: let the real megatron-core 0.16.1 run on the CPU. Never imported by the library.

Megatron-Core hard-codes CUDA in the paths the tests exercise: grad buffers are allocated on
`torch.cuda.current_device()`, optimizer scalars with `device='cuda'`, parameter types are compared with
`'torch.cuda.FloatTensor'`, and the tensor-parallel RNG tracker saves and restores CUDA generator state.
`install()` patches just enough for those paths to run unchanged on the CPU:

- `torch.cuda.current_device()` answers "cpu"; `synchronize` / `empty_cache` do nothing;
- a `TorchFunctionMode` rewrites `device="cuda..."` keyword arguments and `.to("cuda")` to the CPU, makes
  `Tensor.cuda()` the identity and answers `Tensor.type()` with the `torch.cuda.` prefix;
- the CUDA RNG state functions (torch's and Megatron's) read and write the CPU generator.

The patch is process-wide and permanent, so it is installed only inside spawned test worker processes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CpuForCuda(TorchFunctionMode):
    """Routes every CUDA device request to the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _cpu_rng_get(*_: Any, **__: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_rng_set(state: torch.Tensor, *_: Any, **__: Any) -> None:
    torch.set_rng_state(state)


def install() -> None:
    """Patch torch.cuda and Megatron's RNG helpers for CPU execution (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *_, **__: None
    torch.cuda.empty_cache = lambda *_, **__: None
    torch.cuda.get_rng_state = _cpu_rng_get
    torch.cuda.set_rng_state = _cpu_rng_set
    torch.cuda.random.get_rng_state = _cpu_rng_get
    torch.cuda.random.set_rng_state = _cpu_rng_set
    # Not torch.manual_seed: it seeds CUDA too, which would call back into this patch.
    torch.cuda.manual_seed = torch.default_generator.manual_seed
    torch.cuda.manual_seed_all = torch.default_generator.manual_seed
    mode = _CpuForCuda()
    mode.__enter__()  # stays on for the life of the worker process

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _cpu_rng_get
    mrandom._set_cuda_rng_state = _cpu_rng_set


def install_moe() -> None:
    """MoE on CPU: megatron-core 0.16.1's `moe_utils` reads `te_general_gemm` in the router's forward
    but defines it only when Transformer Engine imports (a NameError without it); define it as absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
