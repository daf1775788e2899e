"""`seed_all`: msprobe's reproducibility helper, so that `from msprobe.pytorch import TrainerMon, seed_all`
keeps working with the import swapped for trainermon."""

from __future__ import annotations

import logging
import os
import random
import sys
from typing import Any

logger = logging.getLogger("trainermon")

MAX_SEED = 2**32 - 1
#: What `mode=True` sets in the environment: cuBLAS's deterministic workspace and HCCL's deterministic
#: reductions (Ascend). NCCL has no such switch: its reductions repeat for a fixed topology and sizes.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "HCCL_DETERMINISTIC": "true"}


def seed_all(seed: int = 1234, mode: bool = False, rm_dropout: bool = False) -> None:
    """Seed Python's `random`, `PYTHONHASHSEED`, NumPy, torch on the CPU and every CUDA device, and the
    NPU back end when torch_npu is already imported (it is never imported here). `mode=True` also turns
    on torch's deterministic algorithms, cuDNN's deterministic mode (benchmarking off) and the variables
    in `DETERMINISTIC_ENV`; `rm_dropout=True` makes every dropout in `torch.nn.functional` use p = 0 for
    the rest of the process. Costs nothing per step; call it once, before building the model."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed_all: seed={seed!r}; allowed: an integer from 0 to {MAX_SEED}")
    for key, value in (("mode", mode), ("rm_dropout", rm_dropout)):
        if not isinstance(value, bool):
            raise ValueError(f"seed_all: {key}={value!r}; allowed: true or false")
    import numpy as np
    import torch

    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    npu = sys.modules.get("torch_npu")
    if npu is not None and hasattr(npu, "npu"):
        npu.npu.manual_seed_all(seed)
    if mode:
        os.environ.update(DETERMINISTIC_ENV)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    if rm_dropout:
        _remove_dropout()
    logger.info("trainermon: seed_all(seed=%d, mode=%s, rm_dropout=%s)", seed, mode, rm_dropout)


_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


def _remove_dropout() -> None:
    """Every functional dropout (and so every nn.Dropout module) keeps all values: p is forced to 0."""
    import torch.nn.functional as F

    for name in _DROPOUTS:
        original = getattr(F, name, None)
        if original is None or getattr(original, "_trainermon_no_dropout", False):
            continue

        def no_dropout(input, p=0.5, training=True, inplace=False, _original=original):  # noqa: A002
            return _original(input, 0.0, training, inplace)

        no_dropout._trainermon_no_dropout = True
        setattr(F, name, no_dropout)
    _remove_attention_dropout(F)


def _remove_attention_dropout(F: Any) -> None:
    """`scaled_dot_product_attention`'s own dropout (transformers' sdpa attention; MultiheadAttention
    calls it through the module's global name): `dropout_p` forced to 0."""
    original = getattr(F, "scaled_dot_product_attention", None)
    if original is None or getattr(original, "_trainermon_no_dropout", False):
        return

    def no_attention_dropout(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 4:  # (query, key, value, attn_mask, dropout_p, ...)
            args = (*args[:4], 0.0, *args[5:])
        if "dropout_p" in kwargs:
            kwargs["dropout_p"] = 0.0
        return original(*args, **kwargs)

    no_attention_dropout._trainermon_no_dropout = True
    F.scaled_dot_product_attention = no_attention_dropout
