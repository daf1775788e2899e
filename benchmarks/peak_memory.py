"""This process's peak memory, read from /proc/self/status (the overhead benchmark's RSS probes)."""

from __future__ import annotations

import contextlib
import resource


def peak_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not getrusage: ru_maxrss survives exec, so a probe spawned from the
    big benchmark process would report the parent's peak."""
    status = _proc_status()
    if "VmHWM" in status:
        return status["VmHWM"]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # not Linux: best effort


def peak_anon_mb() -> float:
    """The peak of anonymous memory (heap, tensors), as VmHWM less the file-backed and shared pages resident
    now: those are mapped at import and do not change during the steps (checked: RssFile moved by under
    0.3 MB over 12 steps of (c)), but they differ between hosts (on a kernel that maps library text in
    large folios, torch's resident text grew by ~90 MB), which inflates VmHWM there and shrinks every
    percentage against it. NaN where /proc is not readable."""
    status = _proc_status()
    if "VmHWM" not in status:
        return float("nan")
    return status["VmHWM"] - status.get("RssFile", 0.0) - status.get("RssShmem", 0.0)


def _proc_status() -> dict[str, float]:
    """/proc/self/status's memory lines, MB."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="utf-8") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) / 1024.0
    return out
