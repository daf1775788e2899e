"""The environment trainermon reads (`config/env.py`): the rank on the node comes from the launcher that
set one (torchrun's LOCAL_RANK, else Slurm's, Open MPI's, hydra's, MVAPICH2's); under srun or mpirun,
which set no LOCAL_RANK, every rank of a node used to read 0 and bind the same Prometheus port."""

from __future__ import annotations

import logging

import pytest

from trainermon.config.env import ADVERTISE_HOST_VAR, LOCAL_RANK_VARS, read_env


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*LOCAL_RANK_VARS, ADVERTISE_HOST_VAR):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name", LOCAL_RANK_VARS)
def test_each_launchers_local_rank_is_read(clean_env, name):
    clean_env.setenv(name, "3")
    env = read_env()
    assert (env.local_rank, env.local_rank_from) == (3, name)


def test_torchrun_wins_and_none_set_is_zero(clean_env):
    assert (read_env().local_rank, read_env().local_rank_from) == (0, "")
    clean_env.setenv("SLURM_LOCALID", "5")
    clean_env.setenv("LOCAL_RANK", "1")
    assert read_env().local_rank == 1


def test_a_malformed_value_is_said_and_passed_over(clean_env, caplog):
    clean_env.setenv("LOCAL_RANK", "x1")
    clean_env.setenv("SLURM_LOCALID", "2")
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        env = read_env()
    assert (env.local_rank, env.local_rank_from) == (2, "SLURM_LOCALID")
    assert "LOCAL_RANK='x1' is not a non-negative integer" in caplog.text


def test_advertise_host_per_node(clean_env):
    assert read_env().advertise_host is None
    clean_env.setenv(ADVERTISE_HOST_VAR, " node7.cluster ")
    assert read_env().advertise_host == "node7.cluster"
