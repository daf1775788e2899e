"""Every environment variable trainermon reads, read in one place (once per monitor; TRAINERMON_FUSED once
per process, at import)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("trainermon")


#: TRAINERMON_FUSED's spellings; unset or empty: on (the default). Anything else: on, with one warning.
FUSED_VAR = "TRAINERMON_FUSED"
FUSED_OFF = ("0", "false", "off", "no")
FUSED_ON = ("1", "true", "on", "yes")
_fused: bool | None = None  # read once per process, by the first `fused_enabled()` call


def fused_enabled() -> bool:
    """Whether TRAINERMON_FUSED allows the native CPU kernel: the one reader of the variable. It is read
    once per process, when `trainermon.stats.fused` is first imported (by `from trainermon import
    TrainerMon`): the kernel's availability is fixed then, so a later change of the variable has no
    effect. Costs one dict lookup after the first call."""
    global _fused
    if _fused is None:
        raw = os.environ.get(FUSED_VAR, "")
        value = raw.strip().lower()
        _fused = value not in FUSED_OFF
        if value and value not in FUSED_OFF + FUSED_ON:
            logger.warning(
                "environment variable %s=%r is not one of %s (off) or %s (on); the native kernel stays on",
                FUSED_VAR,
                raw,
                list(FUSED_OFF),
                list(FUSED_ON),
            )
    return _fused


#: msprobe's DYNAMIC_MONITOR: only "true" (any case) switches dynamic mode on, "false" (its default) off.
DYNAMIC_VAR = "DYNAMIC_MONITOR"
_dynamic_warned: set[str] = set()


def _dynamic() -> bool:
    """msprobe's meaning (`== 'true'`, any case); any other non-empty value is said once per value, since
    static mode then collects even where the config says `dynamic_on: false`."""
    raw = os.environ.get(DYNAMIC_VAR, "")
    value = raw.strip().lower()
    if value and value not in ("true", "false") and raw not in _dynamic_warned:
        _dynamic_warned.add(raw)
        logger.warning(
            "environment variable %s=%r: allowed 'true' (dynamic mode) or 'false'; dynamic mode is off, "
            "so the config's dynamic_on is not read and the static schedule collects",
            DYNAMIC_VAR,
            raw,
        )
    return value == "true"


#: Where a process's rank on its node is found: torchrun's variable, then those of launchers that do not
#: set it (Open MPI's mpirun, MPICH / Intel MPI's hydra, MVAPICH2, then Slurm's srun), first set wins.
#: Slurm's is last: an sbatch batch step exports SLURM_LOCALID=0, which the ranks of an mpirun started
#: inside it inherit, so it is only trusted when no MPI launcher said otherwise.
LOCAL_RANK_VARS = (
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "SLURM_LOCALID",
)
#: A node's own address for Prometheus' discovery file: set per node by the launcher script, where one
#: config file (rank 0's, which every rank runs) cannot hold each node's name.
ADVERTISE_HOST_VAR = "TRAINERMON_ADVERTISE_HOST"


@dataclass(frozen=True)
class Env:
    output_dir: str  # MONITOR_OUTPUT_DIR (default ./monitor_output), absolute
    dynamic: bool  # DYNAMIC_MONITOR=true: the config file is watched and `dynamic_on` decides
    local_rank: int  # the rank on this node (Prometheus port offset), from `local_rank_from`
    fused: bool  # TRAINERMON_FUSED (default on) as read at import: `fused_enabled`
    local_rank_from: str = "LOCAL_RANK"  # the variable `local_rank` came from ("" when none is set: 0)
    advertise_host: str | None = None  # TRAINERMON_ADVERTISE_HOST (overrides `prometheus.advertise_host`)


def _local_rank() -> tuple[int, str]:
    """(rank on this node, the variable it came from); (0, "") when no launcher set one. A malformed
    value is said and passed over: it only offsets the Prometheus port, never worth stopping a job."""
    for name in LOCAL_RANK_VARS:
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        if raw.isdigit():
            return int(raw), name
        logger.warning(
            "environment variable %s=%r is not a non-negative integer (the rank of this process on its "
            "node); it is ignored",
            name,
            raw,
        )
    return 0, ""


def read_env() -> Env:
    """The environment, read once per monitor (at construction)."""
    local_rank, local_rank_from = _local_rank()
    return Env(
        output_dir=os.path.realpath(os.environ.get("MONITOR_OUTPUT_DIR", "./monitor_output")),
        dynamic=_dynamic(),
        local_rank=local_rank,
        fused=fused_enabled(),
        local_rank_from=local_rank_from,
        advertise_host=os.environ.get(ADVERTISE_HOST_VAR, "").strip() or None,
    )
