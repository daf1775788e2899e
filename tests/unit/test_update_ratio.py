"""The `update` family (update_distribution): statistics of this step's update dw = w_after - w_before and
the ratio ||dw|| / ||w_before||, on plain PyTorch, against parameter copies the test keeps; every sink,
`analyze`, the AnomalyUpdateRatio rule and config validation. Sharded layouts: tests/adapters/test_fsdp.py
(FSDP1, FSDP2) and tests/adapters/test_megatron_layouts.py (TP2, distributed optimizer, EP2)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config
from trainermon import ConfigError, TrainerMon, parse_config
from trainermon.collect.records import RowMeta, StatBatch
from trainermon.pipeline.anomaly import AnomalyDetector, load_anomalies
from trainermon.pipeline.rule_specs import parse_rules

OPS = ("norm", "mean", "min", "max")


def _train(tmp_path, monkeypatch, dtype=torch.float32, steps=3, **keys):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "c.json",
        update_distribution=True,
        ops=list(OPS),
        ndigits=12,
        format=["csv", "parquet"],
        **keys,
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    refs = {}
    for step in range(steps):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(torch.randn(5, 6, dtype=dtype)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        for n, p in model.named_parameters():
            delta = p.detach().double() - before[n].double()
            refs[(n, step)] = {**ref_stats(delta), "ratio": float(delta.norm() / before[n].double().norm())}
        assert mon.loop.probes and all(getattr(pr, "_before", None) is None for pr in mon.loop.probes)
    mon.close()
    return mon, refs, [n for n, _ in model.named_parameters()]


def test_a_complex_parameter_update_is_refused_not_cast_to_real(tmp_path, monkeypatch):
    """dw of a complex parameter was formed in float32, which keeps the real part only (a warning, and a
    row 20% low here); it is refused and counted now, as every other family refuses complex tensors."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.real = nn.Parameter(torch.tensor([1.0, -2.0]))
            self.cw = nn.Parameter(torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64))

        def forward(self, x):
            return (x * self.cw).abs().sum() + (self.real * x.real).sum()

    model = Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mon = TrainerMon(write_config(tmp_path / "c.json", update_distribution=True, ops=list(OPS), ndigits=12))
    mon.set_monitor(model, optimizer=opt)
    before = model.real.detach().clone()
    model(torch.ones(2, dtype=torch.complex64)).backward()
    opt.step()
    mon.close()
    rows = keyed(read_family(mon.run_dir, "update"))
    assert set(rows) == {("real", 0, None)}
    assert_row_matches(
        rows[("real", 0, None)], ref_stats(model.real.detach().double() - before.double()), OPS
    )
    assert mon.faults.counts["unreadable tensor (complex tensor)"] >= 1, dict(mon.faults.counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_update_rows_match_the_parameter_copies(tmp_path, monkeypatch, dtype):
    mon, refs, names = _train(tmp_path, monkeypatch, dtype)
    rows = keyed(read_family(mon.run_dir, "update"))
    assert set(rows) == {(n, s, None) for n in names for s in range(3)}
    for (name, step, _), row in rows.items():
        # fp32: dw formed exactly in the copy; bf16: both values exact in float32, so dw is exact too
        assert_row_matches(row, refs[(name, step)], OPS, rtol=1e-6)
        assert float(row["ratio"]) == pytest.approx(refs[(name, step)]["ratio"], rel=1e-6)
        assert row["dtype"] == str(dtype)
    # CSV: msprobe's columns, shard, skipped, then ratio at the end; no hidden family leaks into any output
    first = sorted(f for f in os.listdir(mon.run_dir) if f.startswith("update_"))[0]
    with open(os.path.join(mon.run_dir, first)) as fh:
        assert fh.readline().strip().split(",")[-3:] == ["shard", "skipped", "ratio"]
    assert not [f for f in os.listdir(mon.run_dir) if f.startswith("_update")]
    import trainermon

    table = trainermon.load(str(tmp_path / "out")).to_pandas()
    assert set(table["family"]) == {"update"}
    columns = list(table.columns)
    assert columns.index("ratio") == columns.index("ranks") + 1  # the first family column, after xrank's
    for _, r in table.iterrows():
        assert r["ratio"] == pytest.approx(refs[(r["name"], r["step"])]["ratio"], rel=1e-6)


def test_other_families_unchanged_and_ratio_only_on_update(tmp_path, monkeypatch):
    mon, refs, names = _train(tmp_path, monkeypatch, param_distribution=True, step_interval=2)
    # collected steps only (0 and 2): nothing computed or copied on step 1
    assert {int(r["step"]) for r in read_family(mon.run_dir, "update")} == {0, 2}
    origin = read_family(mon.run_dir, "param_origin")
    assert origin and "ratio" not in origin[0]
    import trainermon

    table = trainermon.load(str(tmp_path / "out")).to_pandas()
    assert table[table.family != "update"]["ratio"].isna().all()
    assert table[table.family == "update"]["ratio"].notna().all()


def test_off_by_default_and_validated():
    assert parse_config({}).update_distribution is False
    with pytest.raises(
        ConfigError, match=r"'update_distribution': got 'yes' \(str\); allowed: true or false"
    ):
        parse_config({"update_distribution": "yes"})


def test_analyze_draws_a_ratio_heatmap(tmp_path, monkeypatch):
    from trainermon.analysis import analyze

    mon, refs, names = _train(tmp_path, monkeypatch)
    for run in (str(tmp_path / "out"), mon.run_dir + "/"):  # Parquet, then the CSV run directory
        if run.endswith("/"):
            os.remove(os.path.join(mon.run_dir, "parquet.json"))  # read the CSV files of the run
        result = analyze(run, progress=False)
        heat = result.heatmaps[("update", "ratio")]
        assert list(heat.index) == names and list(heat.columns) == [0, 1, 2]
        for name in names:
            for step in range(3):
                assert heat.loc[name, step] == pytest.approx(refs[(name, step)]["ratio"], rel=1e-5)
        assert "heatmap_update_ratio" in {h["figure"] for h in result.findings()["heatmaps"]}


def test_update_ratio_rule(tmp_path):
    rules = parse_rules([{"rule_name": "AnomalyUpdateRatio", "args": {"threshold": 0.05, "warmup": 3}}])
    det = AnomalyDetector(rules, str(tmp_path), rank=0)
    metas = [
        RowMeta("update", 0, "w", None, (4,), torch.float32, 4),
        RowMeta("param_updated", 0, "w", None, (4,), torch.float32, 4),
    ]
    for step, ratio in enumerate([0.01, 0.011, 0.0105, 0.0102, 0.04, 0.06]):
        det.check(StatBatch(step, metas, {"norm": np.ones(2), "ratio": np.array([ratio, math.nan])}))
    det.close()
    got = [(r["step"], r["family"], r["stat"], r["baseline"]) for r in load_anomalies(str(tmp_path))]
    # step 4: a spike of log(ratio) over the steady median (x4); step 5: above the absolute threshold
    assert [g[:3] for g in got] == [(4, "update", "ratio"), (5, "update", "ratio")]
    assert got[1][3] == 0.05


def test_a_zero_initialised_parameter_is_no_update_ratio_anomaly(tmp_path, monkeypatch):
    """A bias initialised to zeros has ||w_before|| = 0 at its first update: its ratio is inf in the
    output, and `threshold` fired on it at step 0 for every such bias (helper-80). A parameter whose
    update really is larger than itself still fires."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    rules = [{"rule_name": "AnomalyUpdateRatio", "args": {"threshold": 1.0}}]
    cfg = write_config(
        tmp_path / "c.json", update_distribution=True, ops=["norm"], alert={"rules": rules, "dump": True}
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].bias.zero_()
        model[2].weight.mul_(1e-4)  # its first update is far larger than the weight itself
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    for _ in range(2):
        model(torch.randn(5, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    ratio = {(r["name"], int(r["step"])): float(r["ratio"]) for r in read_family(mon.run_dir, "update")}
    assert ratio[("0.bias", 0)] == math.inf and math.isfinite(ratio[("0.bias", 1)])
    assert ratio[("2.weight", 0)] > 1.0
    fired = {(a["name"], a["step"]) for a in load_anomalies(str(tmp_path / "out"))}
    assert ("2.weight", 0) in fired and ("0.bias", 0) not in fired, fired


def test_prometheus_and_tensorboard_export_the_ratio(tmp_path, monkeypatch):
    from tests.sinks.test_prometheus import scrape, url_of, value
    from trainermon.exporters.prometheus import layer_of

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    formats = ["prometheus", "tensorboard"]
    cfg = write_config(tmp_path / "c.json", update_distribution=True, ops=list(OPS), format=formats)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    try:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(torch.randn(5, 6)).pow(2).mean().backward()
        opt.step()
        mon.flush()
        samples = scrape(url_of(mon))
        for layer in ("0", "2"):  # a layer shows the largest ratio of its parameters
            want = max(
                float((p.detach() - before[n]).norm() / before[n].norm())
                for n, p in model.named_parameters()
                if layer_of(n) == layer
            )
            got = value(samples, "trainermon_layer_stat", family="update", layer=layer, stat="ratio")
            assert got == pytest.approx(want, rel=1e-5)
        assert not [k for k in samples if ("stat", "ratio") in k[1] and ("family", "update") not in k[1]]
    finally:
        mon.close()
    from tests.sinks.test_tensorboard import _events

    events = _events(mon.run_dir)
    for n, p in model.named_parameters():  # float32 scalars in TensorBoard
        want = float((p.detach() - before[n]).norm() / before[n].norm())
        assert events[f"0:{n}/rank0/update_ratio"][0] == pytest.approx(want, rel=1e-6)
        assert events[f"0:{n}/rank0/update_norm"][0] == pytest.approx(
            float((p.detach() - before[n]).norm()), rel=1e-6
        )
