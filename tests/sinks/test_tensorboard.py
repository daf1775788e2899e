"""The TensorBoard sink: every scalar read back with tensorboard's own EventAccumulator equals the CSV row
written in the same run, under msprobe's tag for it; it fails open without the package."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.helpers import read_family, write_config
from trainermon import TrainerMon

pytest.importorskip("tensorboard", reason="the tensorboard package is in the test extras; CI installs it")

KIND = {
    "grad_unreduced": "acc_grad",  # msprobe's name where it hooks gradient accumulation (plain torch)
    "grad_reduced": "post_grad",
    "param_origin": "param_origin",
    "param_updated": "param_updated",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "actv": "actv",
    "actv_grad": "actv_grad",
}
OPS = ["norm", "min", "max", "mean", "zeros", "nans"]


def _events(run_dir: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_every_scalar_equals_the_csv_row(tmp_path, out_dir):
    cfg = write_config(
        tmp_path / "c.json",
        format=["csv", "tensorboard"],
        xy_distribution=True,
        all_xy=True,
        wg_distribution=True,
        mv_distribution=True,
        param_distribution=True,
        ops=OPS,
        ndigits=12,
    )
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
    events = _events(monitor.run_dir)
    checked = 0
    for family, kind in KIND.items():
        for row in read_family(monitor.run_dir, family):
            key = f"{row['vpp_stage']}:{row['name']}"
            if "micro_step" in row:
                key += f":{row['micro_step']}"
            for op in OPS:
                series = events[f"{key}/rank0/{kind}_{op}"]
                got, want = series[int(row["step"])], float(row[op])
                # TensorBoard stores float32 scalars; the CSV has 12 significant digits
                assert got == pytest.approx(want, rel=1e-6, abs=1e-30) or (
                    math.isnan(got) and math.isnan(want)
                )
                checked += 1
    assert checked > 400, checked
    assert set(events["trainermon/global_grad_norm"]) == {0, 1, 2}


def test_without_the_package_the_other_sinks_go_on(tmp_path, out_dir, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    cfg = write_config(tmp_path / "c.json", format=["tensorboard", "csv"], wg_distribution=True)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    monitor.close()
    assert read_family(monitor.run_dir, "grad_reduced")
    assert any("tensorboard" in str(k) or "exporter" in str(k) for k in monitor.faults.counts), (
        monitor.faults.counts
    )


def test_convert_to_tensorboard_writes_what_the_sink_writes(tmp_path, out_dir):
    import os
    import subprocess
    import sys

    # numel and the update family's ratio: columns besides the statistics, which convert left out
    cfg = write_config(
        tmp_path / "c.json",
        format=["csv", "tensorboard"],
        wg_distribution=True,
        update_distribution=True,
        ops=[*OPS, "numel"],
        ndigits=12,
    )
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    out = tmp_path / "tb"
    done = subprocess.run(
        [sys.executable, "-m", "trainermon", "convert", str(out_dir), str(out), "--to", "tensorboard"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    sink, converted = _events(monitor.run_dir), _events(str(out / os.path.basename(monitor.run_dir)))
    per_row = {t: v for t, v in sink.items() if not t.startswith("trainermon/")}
    assert per_row and converted.keys() == per_row.keys()
    assert any(t.endswith("_ratio") for t in per_row) and any(t.endswith("_numel") for t in per_row)
    for tag, series in per_row.items():
        for step, value in series.items():
            assert converted[tag][step] == pytest.approx(value, rel=1e-6) or math.isnan(value)
