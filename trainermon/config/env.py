"""Every environment variable trainermon reads, read in one place (once per monitor)."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _flag(value: str | None, default: bool) -> bool:
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "off", "no", "")


@dataclass(frozen=True)
class Env:
    output_dir: str  # MONITOR_OUTPUT_DIR (default ./monitor_output), absolute
    dynamic: bool  # DYNAMIC_MONITOR=true: the config file is watched and `dynamic_on` decides
    local_rank: int  # LOCAL_RANK (Prometheus port offset)
    fused: bool  # TRAINERMON_FUSED (default on): the native CPU kernel


def read_env() -> Env:
    return Env(
        output_dir=os.path.realpath(os.environ.get("MONITOR_OUTPUT_DIR", "./monitor_output")),
        dynamic=os.environ.get("DYNAMIC_MONITOR", "false").strip().lower() == "true",
        local_rank=int(os.environ.get("LOCAL_RANK", "0") or 0),
        fused=_flag(os.environ.get("TRAINERMON_FUSED"), True),
    )
