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
    """Whether a target file belongs to an ended run: written on this host by a dead process, or (same
    host, or a file without writer labels) naming the address this sink now holds."""
    if not isinstance(body, list):
        return False
    addressed, writer = False, None
    for group in body:
        if not isinstance(group, dict):
            continue
        addressed = addressed or target in (group.get("targets") or [])
        labels = group.get("labels") or {}
        pid = labels.get(PID_LABEL)
        if isinstance(pid, str) and pid.isdigit():
            writer = (labels.get(HOST_LABEL), int(pid))
    if writer is None:
        return addressed  # an older file: the address alone tells (the port is ours now)
    if writer[0] != host:
        return False  # another host's file: its pid means nothing here, nor does 127.0.0.1
    return addressed or (writer[1] != os.getpid() and not _pid_alive(writer[1]))


def _rank_of(path: str) -> int | None:
    name = os.path.basename(path)
    head = name.split("-", 1)[0][len("rank") :]
    return int(head) if head.isdigit() else None


def remove_stale(
    directory: str, rank: int, own_path: str, target: str, world_size: int = 0, local_rank: int = -1
) -> list[str]:
    """Remove target files of ended runs: this rank's (`rank{R}-*.json`, other than `own_path`) whose
    writer is a dead process of this host or that name `target` (the address this sink now holds); and,
    on local rank 0, those of ranks this job does not have (`rank >= world_size`: a relaunch with fewer
    ranks) written on this host by a dead process. Files of a live job or another host stay. Costs a
    directory listing and a read of the files named, once when the sink opens (no rank reads every
    rank's files: at thousands of ranks on a shared file system that would be millions of reads)."""
    host = socket.gethostname()
    removed = []
    paths = glob.glob(os.path.join(glob.escape(directory), f"rank{rank}-*.json"))
    if local_rank == 0 and world_size > 0:
        for path in glob.glob(os.path.join(glob.escape(directory), "rank*-*.json")):
            other = _rank_of(path)
            if other is not None and other >= world_size:
                paths.append(path)
    for path in paths:
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
