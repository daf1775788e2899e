"""Edges of set_monitor's arrival check (trainermon.runtime.arrival) and of the config file's
compare-and-swap write (trainermon.runtime.config_file), found by a review; single process, a HashStore
standing in for the job's store (the check uses only set/add/wait/check, which every store has)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time

import pytest
import torch.distributed as dist

from trainermon.config.values import ConfigError
from trainermon.runtime import arrival, config_file


def _both_arrive(store: dist.Store) -> None:
    threads = [threading.Thread(target=arrival.wait_for_all, args=(r, 2, 5.0)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)


def test_elastic_restart_does_not_reuse_the_last_attempts_keys(monkeypatch):
    """torchrun keeps its store across restarts while the process's call count starts again: attempt 1's
    lone rank must still wait and fail, not pass on attempt 0's count (it returned at once)."""
    store = dist.HashStore()
    monkeypatch.setattr(arrival, "_store", lambda: store)
    monkeypatch.setattr(arrival, "_calls", itertools.count())
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    _both_arrive(store)  # attempt 0: both ranks there
    monkeypatch.setattr(arrival, "_calls", itertools.count())  # a new process
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"rank\(s\) 1 of 2"):
        arrival.wait_for_all(0, 2, 0.5)
    assert time.monotonic() - began >= 0.4


@pytest.mark.parametrize(
    ("raw", "expected", "warned"),
    [
        ("nan", arrival.DEFAULT_TIMEOUT_S, True),
        ("often", arrival.DEFAULT_TIMEOUT_S, True),
        ("inf", arrival.LONGEST_S, False),
        ("1e15", arrival.LONGEST_S, False),
        ("30", 30.0, False),
    ],
)
def test_timeout_values(monkeypatch, caplog, raw, expected, warned):
    """nan made set_monitor fail at once and inf after the warning's 60 s (an overflow taken for a
    missing rank): nan is refused with a warning, inf and huge values are capped."""
    monkeypatch.setenv(arrival.TIMEOUT_VAR, raw)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        assert arrival.timeout_s() == expected
    assert bool([r for r in caplog.records if arrival.TIMEOUT_VAR in r.getMessage()]) == warned


def test_only_the_first_ranks_look_up_the_missing(monkeypatch):
    """Each look-up is a store request per rank: on 1000s of ranks every waiting rank asking would send
    millions; ranks from NAMING_RANKS on say where the names are."""
    calls: list = []

    class Counting:
        def check(self, keys: list) -> bool:
            calls.append(keys)
            return False

    store = Counting()
    said = arrival._missing(store, "k", 1000, arrival.NAMING_RANKS)  # noqa: SLF001
    assert not calls and "ranks 0-" in said
    said = arrival._missing(store, "k", 40, 0)  # noqa: SLF001
    assert said.startswith("0, 1, 2") and said.endswith("and 8 more") and len(calls) == 40


def test_interrupted_swap_never_loses_the_config_file(tmp_path, monkeypatch):
    """A signal's exception (a SIGTERM handler raising, Ctrl-C) between the rename aside and the link:
    the file was deleted with the aside copy; it must stay, with its content."""
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"dynamic_on": True, "collect_times": 2}))
    before = path.read_bytes()

    def interrupted(src: str, dst: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "link", interrupted)
    with pytest.raises(KeyboardInterrupt):
        config_file.update_config_file(str(path), dynamic_on=False)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["cfg.json"]  # no temporary or aside file left
