"""Nothing silent (config audit h49): settings that could never act were accepted without a word.

- a process group argument that is not a ProcessGroup (`dp_group="dp"`, `process_group=5`) is refused,
  naming the argument, the value's type and what is allowed;
- an alert rule that reads statistics `ops` does not hold (AnomalyTurbulence with ops [max]);
- `cc_distribution` keys with `enable` false, CSV keys without CSV, `eps` without 'zeros';
- a dynamic reload of a file that omits `dynamic_watch` says nothing of it (it did at every reload).
The collectives, activations and optimizer cases: `test_silent_collection_audit.py`.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import free_port
from tests.helpers import read_family, write_config
from tests.unit.dynamic_common import BASE, _train, _wait_dirty
from trainermon import TrainerMon


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_group_arguments_must_be_process_groups(tmp_path, out_dir, static_mode, caplog):
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"])
    with pytest.raises(
        TypeError, match=r"TrainerMon\(process_group=\.\.\.\) got 5 \(type int\).*ProcessGroup"
    ):
        TrainerMon(cfg, process_group=5)
    for key in ("dp_group", "tp_group"):
        monitor = TrainerMon(cfg)
        with pytest.raises(
            TypeError, match=rf"set_monitor\({key}=\.\.\.\) got 'dp' \(type str\).*ProcessGroup"
        ):
            monitor.set_monitor(nn.Linear(2, 2), optimizer=None, **{key: "dp"})
        monitor.close()
    # process_group has no such mark (its ranks must all be in it: set_monitor raised deep inside)
    with pytest.raises(TypeError, match=r"process_group=\.\.\.\) got -100.*ProcessGroup holding this rank"):
        TrainerMon(cfg, process_group=dist.GroupMember.NON_GROUP_MEMBER)
    # torch's mark for a rank outside a group that `new_group` made on every rank: taken (as before)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(nn.Linear(2, 2), optimizer=None, tp_group=dist.GroupMember.NON_GROUP_MEMBER)
    monitor.close()
    # a real group is taken, and its rows are the gradients' (one gloo rank: reduced == local)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TrainerMon(cfg, process_group=group)
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            monitor.set_monitor(model, optimizer=opt, dp_group=group, tp_group=group)
            model(torch.ones(4, 3)).sum().backward()
            want = {n: float(p.grad.double().norm()) for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            monitor.close()
        got = {r["name"]: float(r["norm"]) for r in read_family(monitor.run_dir, "grad_reduced")}
        assert got.keys() == want.keys() and all(got[n] == pytest.approx(want[n], rel=1e-5) for n in want)
        assert not [m for m in _warnings(caplog) if "not registered" in m]
    finally:
        dist.destroy_process_group()


def _turbulence(tmp_path, ops: list[str]) -> tuple[int, list[float]]:
    cfg = write_config(
        tmp_path / f"cfg_{'_'.join(ops)}.json",
        wg_distribution=True,
        ops=ops,
        alert={"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True},
    )
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    norms = []
    for step in range(5):
        scale = 1000.0 if step == 3 else 1.0
        (scale * model(torch.ones(3, 4)).sum()).backward()
        norms.append(float(model.weight.grad.norm()))
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor.loop.detector.totals().get("AnomalyTurbulence", 0), norms


def test_rule_whose_statistics_ops_lacks_is_said(tmp_path, out_dir, static_mode, caplog):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        fired, norms = _turbulence(tmp_path, ["max"])
    # Reference: the gradient norm jumps 1000x at step 3 (far past 1.5x its average) ...
    assert norms[3] > 1.5 * norms[2]
    said = [m for m in _warnings(caplog) if "can never fire" in m]
    assert fired == 0 and len(said) == 1, said
    assert "AnomalyTurbulence" in said[0] and "neither 'norm' nor 'mean'" in said[0] and "'max'" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        fired, _ = _turbulence(tmp_path, ["norm", "max"])
    # ... which the rule catches once ops holds norm, and then nothing is said
    assert fired > 0 and not [m for m in _warnings(caplog) if "can never fire" in m]


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (
            {"cc_distribution": {"enable": False, "cc_pre_hook": True, "cc_codeline": ["train"]}},
            ["cc_distribution keys ['cc_codeline', 'cc_pre_hook'] have no effect: cc_distribution.enable"],
        ),
        (
            {"format": ["parquet"], "ndigits": 3, "step_count_per_record": 5},
            ["ndigits 3 has no effect", "step_count_per_record 5 has no effect"],
        ),
        ({"eps": 0.5}, ["eps 0.5 has no effect: it is the threshold of the 'zeros' statistic"]),
        # the same keys where they act: nothing said
        ({"cc_distribution": {"enable": True, "cc_pre_hook": True}}, []),
        ({"ndigits": 3, "step_count_per_record": 5}, []),
        ({"eps": 0.5, "ops": ["norm", "zeros"]}, []),
    ],
)
def test_keys_without_effect_are_said_once(tmp_path, out_dir, static_mode, caplog, keys, expected):
    cfg = write_config(tmp_path / "cfg.json", **{"wg_distribution": True, **keys})
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, optimizer=opt)
        for _ in range(3):
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        monitor.close()
    said = [m for m in _warnings(caplog) if "has no effect" in m or "have no effect" in m]
    assert len(said) == len(expected), said
    for text in expected:
        assert sum(text in m for m in said) == 1, (text, said)


def test_reload_of_a_file_omitting_dynamic_watch_says_nothing_of_it(tmp_path, out_dir, dynamic_mode, caplog):
    path = str(tmp_path / "cfg.json")
    first = {**BASE, "dynamic_watch": "polling", "dynamic_on": True}
    with open(path, "w") as fh:
        json.dump(first, fh)

    def edit(**keys):
        def run(monitor):
            with open(path, "w") as fh:
                json.dump(keys, fh)
            _wait_dirty(monitor)

        return run

    omitted = {k: v for k, v in first.items() if k != "dynamic_watch"}
    actions = {
        2: edit(**{**omitted, "collect_times": 50}),
        4: edit(**{**omitted, "collect_times": 60}),
        6: edit(**{**first, "dynamic_watch": "inotify", "collect_times": 70}),  # sets another value: said
    }
    with caplog.at_level(logging.INFO, logger="trainermon"):
        monitor = _train(path, 8, actions)
    reloads = [m for m in (r.getMessage() for r in caplog.records) if "config reloaded" in m]
    said = [m for m in _warnings(caplog) if "dynamic_watch" in m]
    assert len(reloads) == 3, reloads
    assert (
        len(said) == 1 and "dynamic_watch='inotify'" in said[0] and "keeps dynamic_watch='polling'" in said[0]
    )
    assert monitor.config.dynamic_watch == "polling" and monitor.config.collect_times == 70
    assert os.path.isdir(monitor.run_dir)
