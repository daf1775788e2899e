"""The file_sd target files of a job's ranks: stale ones of earlier runs removed, and the address said.

A rank that dies without closing its sink (SIGKILL, a crash, torchrun ending the survivors with SIGTERM:
no handler is installed for it, since a Python handler would defer the signal while the main thread waits
in a native call, a hung collective included) leaves `rank{R}-{run_id}.json` behind: Prometheus keeps
scraping its address, a dead port (TargetDown forever) or, after a relaunch on the same fixed port, the
new run's endpoint a second time under the dead run's `run_id`. Each file records the writer's pid and
host (`__meta_*` labels: Prometheus drops them after relabeling), so that the next sink of the same rank
can tell a dead writer's file from a live job's.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import socket
import sys
from typing import Any

logger = logging.getLogger("trainermon")

PID_LABEL = "__meta_trainermon_pid"
HOST_LABEL = "__meta_trainermon_host"

#: Addresses already said on this process's stderr (a reopened sink on the same address says nothing).
_ANNOUNCED: set[str] = set()


def writer_labels() -> dict[str, str]:
    """The labels that identify this process as a target file's writer."""
    return {PID_LABEL: str(os.getpid()), HOST_LABEL: socket.gethostname()}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # sends nothing: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return True  # cannot tell: keep the file
    return True


def _is_stale(body: Any, target: str, host: str) -> bool:
    if not isinstance(body, list):
        return False
    for group in body:
        if not isinstance(group, dict):
            continue
        if target in (group.get("targets") or []):
            return True  # our address: whoever wrote it is gone (the port is ours now)
        labels = group.get("labels") or {}
        pid = labels.get(PID_LABEL)
        if labels.get(HOST_LABEL) == host and isinstance(pid, str) and pid.isdigit():
            if int(pid) != os.getpid() and not _pid_alive(int(pid)):
                return True
    return False


def remove_stale(directory: str, rank: int, own_path: str, target: str) -> list[str]:
    """Remove the target files of this rank (`rank{R}-*.json`, other than `own_path`) whose writer is a
    dead process of this host, or whose target is `target` (the address this sink now holds). Files of a
    live job (another run of the same rank on this host, or another host's) stay. Costs a directory
    listing and a read of each of the rank's files, once when the sink opens."""
    host = socket.gethostname()
    removed = []
    for path in glob.glob(os.path.join(glob.escape(directory), f"rank{rank}-*.json")):
        if os.path.abspath(path) == os.path.abspath(own_path):
            continue
        try:
            with open(path, encoding="utf-8") as fh:
                body = json.load(fh)
        except (OSError, ValueError):
            continue  # unreadable or being replaced: not ours to judge
        if not _is_stale(body, target, host):
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("trainermon: could not remove the stale Prometheus target file %s: %s", path, exc)
            continue
        removed.append(path)
        logger.info("trainermon: removed the stale Prometheus target file %s of an ended run", path)
    return removed


def announce(url: str, rank: int, sd_dir: str | None, run_dir: str) -> None:
    """Say where the endpoint listens, once per address and process (local rank 0 only: its node's other
    ranks' addresses are in their prometheus.json): through the `trainermon` logger at INFO when logging
    is configured, else on stderr (a training script sets up no logging)."""
    if url in _ANNOUNCED:
        return
    _ANNOUNCED.add(url)
    where = f"; file_sd target files in {sd_dir}" if sd_dir else ""
    message = (
        f"trainermon: Prometheus metrics of rank {rank} at {url}{where} "
        f"(each rank's address: prometheus.json in its run directory, e.g. {run_dir})"
    )
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        logger.info("%s", message)
    else:
        print(message, file=sys.stderr, flush=True)
