"""Dynamic mode on two ranks: switching on the same step, ranks starting with different files."""

from __future__ import annotations

import json
import os

import pytest

from tests.distributed import run_ranks
from tests.unit.dynamic_common import BASE, _collected_steps, _train, _wait_dirty
from trainermon import TrainerMon
from trainermon.runtime.control import update_config_file


# ---- two ranks -----------------------------------------------------------------------------------
def _two_rank_switch(rank: int, world: int, root: str, own_group: bool) -> list[int]:
    # Each rank reads its own copy of the config: a filesystem on which rank 1 sees edits 3 steps late.
    # own_group: each rank passes a group of itself alone as process_group (msprobe's Megatron insertion
    # passes the pipeline group: one rank with PP=1); the decision is still the job's.
    import torch.distributed as dist

    group = dist.new_subgroups(group_size=1)[0] if own_group else None
    os.environ["DYNAMIC_MONITOR"] = "true"
    out = os.path.join(root, f"out{rank}")
    os.environ["MONITOR_OUTPUT_DIR"] = out
    path = os.path.join(root, f"cfg{rank}.json")
    with open(path, "w") as fh:
        json.dump(BASE, fh)
    lag = 0 if rank == 0 else 3

    def edit(**changes):
        def act(monitor):
            update_config_file(path, **changes)
            if monitor.loop.control.watcher is not None:
                _wait_dirty(monitor)

        return act

    _train(path, 12, {2 + lag: edit(dynamic_on=True), 6 + lag: edit(dynamic_on=False)}, group)
    return _collected_steps(out)


@pytest.mark.parametrize("own_group", [False, True], ids=["default-group", "process_group-of-one"])
def test_two_ranks_switch_on_the_same_step(tmp_path, own_group):
    """With a process_group of one rank each, each rank once decided alone: rank 1 switched 3 steps
    late here, and with xrank summaries on the first rank to switch waited in their collective forever."""
    steps = run_ranks(_two_rank_switch, world_size=2, timeout=120, root=str(tmp_path), own_group=own_group)
    assert steps[0] == steps[1] == [3, 4, 5, 6]


def _starting_apart(rank: int, world_size: int, root: str, resumed: bool) -> list[int]:
    # Each rank reads its own file, and they disagree when the ranks start (a `trainermon on` landing
    # between two ranks' start): rank 0 says on, rank 1 off. Resumed: a checkpoint's monitor state (on,
    # one of the three collections done) loaded before set_monitor.
    os.environ["DYNAMIC_MONITOR"] = "true"
    out = os.path.join(root, f"out{rank}")
    os.environ["MONITOR_OUTPUT_DIR"] = out
    path = os.path.join(root, f"cfg{rank}.json")
    with open(path, "w") as fh:
        json.dump({**BASE, "dynamic_on": rank == 0, "collect_times": 3, "dynamic_watch": "polling"}, fh)

    def resume(monitor: TrainerMon) -> None:
        if resumed:
            state = monitor.state_dict()
            monitor.load_state_dict({**state, "step": 5, "dynamic_on": True, "schedule_collected": 1})

    _train(path, 5, {}, before_attach=resume)
    return _collected_steps(out)


@pytest.mark.parametrize("resumed", [False, True], ids=["started", "resumed"])
def test_ranks_that_start_with_different_files_follow_rank_0(resumed):
    """Each rank kept the config it read at start: rank 0 collected and waited in the cross-rank
    summaries' collective, which rank 1 never ran (the job hung). Rank 0's config reaches every rank at
    the first step, before a restored state: rank 1 adopting rank 0's config after the restore started
    its collect_times count over, and the ranks parted at step 7 (a hang again)."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        steps = run_ranks(_starting_apart, world_size=2, timeout=120, root=root, resumed=resumed)
    assert steps[0] == steps[1] == ([5, 6] if resumed else [0, 1, 2])
