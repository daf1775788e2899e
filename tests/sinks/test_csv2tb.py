"""`trainermon.csv2tensorboard_by_step`, msprobe's converter by the same name: side by side with msprobe's
own (mindstudio-probe 26.2.0, run in a subprocess) on the same CSV output, every event file holds the
same tags, steps and values; the time range selects run directories and, for a rank with two runs in
it, the latest (with a warning); bad arguments are refused naming the argument."""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from tests.helpers import write_config
from trainermon import TrainerMon, csv2tensorboard_by_step
from trainermon.csv2tb import FAMILIES

pytest.importorskip("tensorboard", reason="the tensorboard package is in the test extras; CI installs it")

OPS = ["norm", "min", "max", "mean", "zeros", "nans"]
#: The families of these Adam runs: all but SGD's momentum_buffer.
ADAM = [f for f in FAMILIES if f != "momentum_buffer"]


def _events(directory: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(directory, size_guidance={"scalars": 0})
    acc.Reload()
    # NaN as a string: a NaN value compares unequal to itself, an equal tree must still compare equal
    return {
        tag: {e.step: "nan" if math.isnan(e.value) else e.value for e in acc.Scalars(tag)}
        for tag in acc.Tags()["scalars"]
    }


def _tree(out: str) -> dict[tuple[str, str], dict]:
    """{(rank directory, family): scalars} of a converter's output."""
    return {
        (rank, family): _events(os.path.join(out, rank, family))
        for rank in sorted(os.listdir(out))
        for family in sorted(os.listdir(os.path.join(out, rank)))
    }


def _run(cfg: str) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt, grad_acc_steps=2)
    for _step in range(3):
        for _micro in range(2):
            model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor.run_dir


@pytest.fixture
def runs(tmp_path, out_dir):
    """Two runs of rank 0 a few seconds apart (run directories are named to the second), and a copy of
    the second as rank 1's."""
    cfg = write_config(
        tmp_path / "c.json",
        xy_distribution=True,
        all_xy=True,
        wg_distribution=True,
        mv_distribution=True,
        param_distribution=True,
        ops=OPS,
        ndigits=12,
    )
    first = _run(cfg)
    time.sleep(1.1)
    second = _run(cfg)
    assert os.path.basename(first)[:14] < os.path.basename(second)[:14]
    rank1 = os.path.join(str(out_dir), os.path.basename(second).replace("-rank0-", "-rank1-"))
    shutil.copytree(second, rank1)
    return str(out_dir), first, second


@pytest.mark.skipif(
    subprocess.run(
        [sys.executable, "-c", "import msprobe.pytorch.monitor.csv2tb"], capture_output=True
    ).returncode,
    reason="msprobe (the msprobe extra) is not installed",
)
def test_same_event_files_as_msprobes_converter(runs, tmp_path, caplog):
    root, first, second = runs
    start = os.path.basename(second)[:14]  # the second run only: msprobe would pick either run of rank 0
    theirs, ours = str(tmp_path / "msprobe"), str(tmp_path / "ours")
    script = (
        "import sys; from msprobe.pytorch.monitor.csv2tb import csv2tensorboard_by_step as f; "
        "f(sys.argv[1], time_start=sys.argv[2], output_dirpath=sys.argv[3])"
    )
    subprocess.run([sys.executable, "-c", script, root, start, theirs], check=True, capture_output=True)
    assert csv2tensorboard_by_step(root, time_start=start, output_dirpath=ours) == ours
    want, got = _tree(theirs), _tree(ours)
    assert sorted(want) == sorted((r, f) for r in ("rank0", "rank1") for f in ADAM)
    assert got == want  # the same tags, steps and values
    assert "vp0:0.output:micro1/norm" in want[("rank0", "actv")]


def test_time_range_and_the_latest_run_of_a_rank(runs, tmp_path, caplog):
    root, first, second = runs
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        out = csv2tensorboard_by_step(
            root, output_dirpath=str(tmp_path / "all"), data_type_list=["grad_reduced"]
        )
    said = [r.getMessage() for r in caplog.records if "rank 0 has 2 runs" in r.getMessage()]
    assert len(said) == 1 and os.path.basename(first) in said[0]
    assert sorted(os.listdir(out)) == ["rank0", "rank1"]
    assert os.listdir(os.path.join(out, "rank0")) == ["grad_reduced"]
    only_first = csv2tensorboard_by_step(
        root,
        time_end=os.path.basename(first)[:14],
        output_dirpath=str(tmp_path / "first"),
        data_type_list=["grad_reduced"],
    )
    assert os.listdir(only_first) == ["rank0"]  # rank 1's copy is of the second run
    with pytest.raises(FileNotFoundError, match="monitor_path: no"):
        csv2tensorboard_by_step(root, time_start="Jan01_00-00-00", time_end="Jan01_00-00-01")


def test_several_processes_write_what_one_writes(runs, tmp_path, caplog):
    """process_num > 1 forks workers (msprobe forks too; spawning would run the caller's script again in
    each); in a process running threads, where a fork may deadlock, it converts in this process."""
    root, _, second = runs
    start = os.path.basename(second)[:14]
    one = csv2tensorboard_by_step(root, time_start=start, output_dirpath=str(tmp_path / "one"))
    # a script without a main guard, in a fresh interpreter (one thread: the workers are forked)
    two = str(tmp_path / "two")
    script = (
        "import sys; from trainermon import csv2tensorboard_by_step as f; "
        "f(sys.argv[1], time_start=sys.argv[2], process_num=2, output_dirpath=sys.argv[3])"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, root, start, two], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "converting in this process" not in done.stderr, done.stderr[-2000:]
    assert _tree(two) == _tree(one) and len(_tree(one)) == 2 * len(ADAM)
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait)
    busy.start()
    try:
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            here = csv2tensorboard_by_step(
                root, time_start=start, process_num=2, output_dirpath=str(tmp_path / "here")
            )
    finally:
        stop.set()
        busy.join()
    assert _tree(here) == _tree(one)
    assert any("converting in this process" in r.getMessage() for r in caplog.records)


def test_february_29_and_an_empty_family_list(runs, tmp_path):
    """A run started on February 29 is a run (its name has no year); `data_type_list=[]` is every family,
    as in msprobe."""
    root, _, second = runs
    leap = tmp_path / "leap"
    leap.mkdir()
    shutil.copytree(second, leap / ("Feb29_12-00-00" + os.path.basename(second)[14:]))
    out = csv2tensorboard_by_step(
        str(leap), time_start="Feb29_00-00-00", data_type_list=[], output_dirpath=str(tmp_path / "o")
    )
    assert sorted(os.listdir(os.path.join(out, "rank0"))) == sorted(ADAM)


def test_a_family_asked_for_with_no_rows_is_said(tmp_path, out_dir, caplog):
    _run(write_config(tmp_path / "c.json", wg_distribution=True, ops=OPS))
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        out = csv2tensorboard_by_step(str(out_dir), data_type_list=["grad_reduced", "actv"])
    assert os.listdir(os.path.join(out, "rank0")) == ["grad_reduced"]
    said = [r.getMessage() for r in caplog.records if "no rows of ['actv']" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_a_graph_run_backward_twice_is_converted(tmp_path, out_dir, caplog):
    """`backward(retain_graph=True)` then `backward()` gives two actv_grad rows of one name, micro-step and
    step (README). The converter stopped at them ("has step 0 twice") and wrote nothing, not even actv."""
    cfg = write_config(tmp_path / "c.json", xy_distribution=True, ops=["norm"], ndigits=12)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    grads = []
    for _ in range(2):
        out = model(torch.randn(3, 4))
        out.retain_grad()
        loss = out.pow(2).mean()
        loss.backward(retain_graph=True)
        first = float(out.grad.norm())
        (2 * loss).backward()  # a second row of twice the first's values
        grads.append(first)
        opt.step()
        opt.zero_grad()
    monitor.close()
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        out = csv2tensorboard_by_step(str(out_dir))
    assert sorted(os.listdir(os.path.join(out, "rank0"))) == ["actv", "actv_grad"]
    said = [r.getMessage() for r in caplog.records if "repeat a name, micro-step and step" in r.getMessage()]
    assert len(said) == 2, said  # once per file (one per step here), not per row
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(out, "rank0", "actv_grad"), size_guidance={"scalars": 0})
    acc.Reload()
    points = [(e.step, e.value) for e in acc.Scalars("vp0:2.output:micro0/norm")]
    assert sorted(step for step, _ in points) == [0, 0, 1, 1]  # both rows of each step written
    for step, want in enumerate(grads):  # float32 norms of 3 values, stored as float32: ~1e-7 apart
        got = sorted(value for s, value in points if s == step)
        assert math.isclose(got[0], want, rel_tol=1e-6) and math.isclose(got[1], 2 * want, rel_tol=1e-6), got


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"process_num": 0}, "process_num"),
        ({"process_num": True}, "process_num"),
        ({"data_type_list": ["update"]}, "data_type_list"),
        ({"data_type_list": "actv"}, "data_type_list"),
        ({"time_start": "2026-11-27"}, "time_start"),
        ({"time_start": "Nov27_10-00-00", "time_end": "Nov27_09-00-00"}, "time_start"),
    ],
)
def test_bad_arguments_name_the_argument(tmp_path, kwargs, key):
    with pytest.raises(ValueError, match=f"^{key}: "):
        csv2tensorboard_by_step(str(tmp_path), **kwargs)
