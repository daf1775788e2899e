"""The monitor's state through torch.distributed.checkpoint (DCP), as FSDP2 jobs save everything.

DCP builds its load plan from the new monitor's `state_dict()`, and keeps one copy of each non-tensor key
across ranks. Before: the rules' history (nested dicts keyed by data-dependent tuples) was not in the new
monitor's (empty) history, so it came back empty without a word (a spike after the resume went unseen);
a plain `state_dict()` in the DCP dict failed ("Missing key in checkpoint state_dict: monitor.detector").
Now each rank's history is one opaque entry under a key that names the rank (`detector_rank{R}`).

The references: the history the saving monitor held, and the records of an uninterrupted run.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import write_config
from trainermon import TrainerMon
from trainermon.pipeline.anomaly import load_anomalies

CUT = 5  # steps 0..CUT-1 before the save; step CUT has a 1000x loss spike
RULES = [
    {"rule_name": "AnomalySpike", "args": {"warmup": 3}},
    {"rule_name": "AnomalyTurbulence", "args": {"threshold": 50.0}},
]


def _config(path) -> str:
    return write_config(
        path, wg_distribution=True, xy_distribution=True, ops=["norm"], alert={"rules": RULES, "dump": True}
    )


def _model(world_size: int = 1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _train(model, opt, steps, rank: int) -> None:
    for step in steps:
        data = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(data).pow(2).sum() * (1000.0 if step == CUT else 1.0)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _at_cut(out_dir: str, monitor: TrainerMon, rank: int) -> list[tuple]:
    records = load_anomalies(out_dir, run_ids={monitor.loop.outputs.run_id})
    return sorted(
        (r["rule"], r["family"], r["name"], r["stat"], r["value"])
        for r in records
        if r["step"] == CUT and r["rank"] == rank
    )


def _uninterrupted(config: str, out_dir: str, rank: int = 0, world_size: int = 1) -> list[tuple]:
    model, opt = _model(world_size)
    monitor = TrainerMon(config)
    monitor.set_monitor(model, optimizer=opt)
    _train(model, opt, range(CUT + 1), rank)
    monitor.close()
    return _at_cut(out_dir, monitor, rank)


def _first_part(config: str, rank: int = 0, world_size: int = 1):
    model, opt = _model(world_size)
    monitor = TrainerMon(config)
    monitor.set_monitor(model, optimizer=opt)
    _train(model, opt, range(CUT), rank)
    state = monitor.state_dict()  # waits for the worker: the history is complete
    return model, opt, monitor, state, monitor.loop.detector.state_dict()


@pytest.mark.parametrize("how", ["stateful, loaded before set_monitor", "stateful", "plain state_dict"])
def test_dcp_in_one_process_brings_the_history_back(tmp_path, out_dir, how):
    config = _config(tmp_path / "c.json")
    expected = _uninterrupted(config, str(out_dir))
    assert any(r[0] == "AnomalySpike" for r in expected)  # the spike is one the rules see
    model, opt, first, state, saved = _first_part(config)
    ck = str(tmp_path / "ck")
    dcp.save({"monitor": state if how == "plain state_dict" else first}, checkpoint_id=ck, no_dist=True)
    first.close()
    second = TrainerMon(config)
    if how.endswith("before set_monitor"):
        dcp.load({"monitor": second}, checkpoint_id=ck, no_dist=True)
    second.set_monitor(model, optimizer=opt)
    if how == "stateful":
        dcp.load({"monitor": second}, checkpoint_id=ck, no_dist=True)
    elif how == "plain state_dict":
        loaded = {"monitor": second.state_dict()}
        dcp.load(loaded, checkpoint_id=ck, no_dist=True)
        second.load_state_dict(loaded["monitor"])
    assert second.current_step == CUT
    assert second.loop.detector.state_dict() == saved and saved["rolling"] and saved["avg"]
    _train(model, opt, [CUT], 0)
    second.close()
    assert _at_cut(str(out_dir), second, 0) == expected
    assert first.faults.total == 0 and second.faults.total == 0


def _ranks_dcp(rank: int, world_size: int, config: str, out_dir: str, ck: str) -> dict:
    expected = _uninterrupted(config, out_dir, rank, world_size)
    model, opt, first, state, saved = _first_part(config, rank, world_size)
    dcp.save({"model": model.state_dict(), "monitor": first}, checkpoint_id=ck)
    first.close()
    second = TrainerMon(config)
    second.set_monitor(model, optimizer=opt)
    dcp.load({"model": model.state_dict(), "monitor": second}, checkpoint_id=ck)
    restored = second.loop.detector.state_dict()
    _train(model, opt, [CUT], rank)
    second.close()
    return {
        "saved": repr(saved),
        "restored": repr(restored),
        "step": second.current_step,
        "expected": expected,
        "resumed": _at_cut(out_dir, second, rank),
        "faults": first.faults.total + second.faults.total,
    }


def test_dcp_on_two_fsdp2_ranks_gives_each_rank_its_own_history(tmp_path, out_dir):
    config = _config(tmp_path / "c.json")
    results = run_ranks(
        _ranks_dcp, world_size=2, config=config, out_dir=str(out_dir), ck=str(tmp_path / "ck"), timeout=500
    )
    assert results[0]["saved"] != results[1]["saved"]  # rank-different histories (inputs differ by rank)
    for rank, r in enumerate(results):
        assert r["restored"] == r["saved"], rank
        assert r["step"] == CUT + 1 and r["faults"] == 0
        assert any(x[0] == "AnomalySpike" for x in r["expected"]), rank
        assert r["resumed"] == r["expected"], rank


def test_a_version_1_state_still_loads_and_a_missing_history_is_said(tmp_path, out_dir, caplog):
    from trainermon.runtime.resume_state import decode_history

    config = _config(tmp_path / "c.json")
    model, opt, first, state, saved = _first_part(config)
    first.close()
    assert state["version"] == 2 and decode_history("detector_rank0", state["detector_rank0"]) == (CUT, saved)
    v1 = {k: v for k, v in state.items() if k != "detector_rank0"} | {"version": 1, "detector": saved}
    caplog.set_level(logging.WARNING, logger="trainermon")
    old = TrainerMon(config)
    old.load_state_dict(v1)
    old.set_monitor(model, optimizer=opt)
    assert old.loop.detector.state_dict() == saved and "no anomaly history" not in caplog.text
    old.close()
    # rank 1's state loaded on rank 0 (a rank the saving job did not have, Lightning's rank-0 state):
    # rank 1's history, as in version 1, said once; a state with no history at all: none, said once
    without = {k: v for k, v in state.items() if k != "detector_rank0"}
    for given, history, said in (
        (without | {"detector_rank1": state["detector_rank0"]}, saved, "go on from rank 1's"),
        (without, {"counts": {}, "avg": {}, "rolling": {}}, "start over at step 5"),
    ):
        third = TrainerMon(config)
        third.set_monitor(model, optimizer=opt)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            third.load_state_dict(given)
        told = [r.getMessage() for r in caplog.records if "no anomaly history for rank 0" in r.getMessage()]
        assert len(told) == 1 and said in told[0], told
        assert third.loop.detector.state_dict() == history and third.current_step == CUT
        third.close()


@pytest.mark.parametrize(
    "entry, named",
    [
        (b"\x80not json", "'detector_rank0' is"),
        (json.dumps({"step": -1, "counts": {}, "avg": [], "rolling": []}), "'detector_rank0' is"),
        (
            json.dumps({"step": 1, "counts": {}, "avg": [[["a"], "x", 1]], "rolling": []}),
            "'detector_rank0.avg'",
        ),
        (
            json.dumps({"step": 1, "counts": {}, "avg": [], "rolling": [[["a"], 0, [1.0]]]}),
            "detector_rank0.rolling",
        ),
    ],
)
def test_a_malformed_history_entry_is_refused_naming_it(tmp_path, out_dir, entry, named):
    monitor = TrainerMon(_config(tmp_path / "c.json"))
    with pytest.raises(ValueError, match="allowed") as info:
        monitor.load_state_dict({**monitor.state_dict(), "step": 1, "detector_rank0": entry})
    assert named in str(info.value), str(info.value)
    assert monitor.current_step == 0
    monitor.close()
