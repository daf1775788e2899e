"""Optional accelerator back-ends, imported defensively.

torch_npu is the Ascend back-end. Importing it can fail in many ways on a machine without Ascend
software (ImportError, RuntimeError from its C extension, OSError for a missing driver library), so any
Exception means "not available". The monitor needs nothing from it beyond registering the "npu" device
with torch: statistics use device-generic torch operations and `torch.Event`.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType

logger = logging.getLogger("trainermon")
_npu: ModuleType | None = None
_checked = False


def torch_npu() -> ModuleType | None:
    """The torch_npu module if it imports cleanly, else None (never raises)."""
    global _npu, _checked
    if not _checked:
        _checked = True
        try:
            import torch_npu as mod  # type: ignore[import-not-found]

            _npu = mod
        except Exception as exc:  # noqa: BLE001 - any failure means the back-end is unusable here
            if "torch_npu" in sys.modules or not isinstance(exc, ModuleNotFoundError):
                logger.warning(
                    "trainermon: torch_npu is installed but failed to import (%s); NPU is off", exc
                )
            _npu = None
    return _npu


def _reset_for_tests() -> None:
    global _npu, _checked
    _npu, _checked = None, False
