"""Validation of the training-health keys that take more than true / false."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .schema import AttnLogitConfig

KEY = "attn_logit_distribution"
MAX_SAMPLE = 1 << 20


def attn_logit(value: Any, fail: Callable[[str, Any, str], Exception]) -> AttnLogitConfig:
    """`attn_logit_distribution`: true / false, or {"enable": bool, "sample": positive int}."""
    if isinstance(value, bool):
        return AttnLogitConfig(enable=value)
    if not isinstance(value, dict):
        raise fail(KEY, value, 'true, false or {"enable": true, "sample": N}')
    unknown = sorted(str(k) for k in value if k not in ("enable", "sample"))
    if unknown:
        raise fail(f"{KEY}.{unknown[0]}", value[unknown[0]], "only the keys 'enable' and 'sample'")
    enable = value.get("enable", True)
    if not isinstance(enable, bool):
        raise fail(f"{KEY}.enable", enable, "true or false")
    sample = value.get("sample", AttnLogitConfig.sample)
    if isinstance(sample, float) and sample.is_integer():
        sample = int(sample)
    if isinstance(sample, bool) or not isinstance(sample, int) or not 1 <= sample <= MAX_SAMPLE:
        raise fail(f"{KEY}.sample", sample, f"an integer in [1, {MAX_SAMPLE}] (query positions per sequence)")
    return AttnLogitConfig(enable=enable, sample=sample)
