"""The `attn_logit` family downstream: config, growth rule, analyze/convert, Prometheus, failures."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

from tests.helpers import read_family, write_config
from tests.unit.attn_logit_common import STEPS, _mha_run, ref_max
from trainermon import ConfigError, TrainerMon, parse_config
from trainermon.collect.records import RowMeta, StatBatch
from trainermon.pipeline.anomaly import AnomalyDetector, load_anomalies
from trainermon.pipeline.rule_specs import parse_rules


def test_config_validation_and_warning_without_attention(tmp_path, monkeypatch, caplog):
    cfg = parse_config({})
    assert cfg.attn_logit_distribution.enable is False and cfg.attn_logit_distribution.sample == 256
    got = parse_config({"attn_logit_distribution": {"enable": True, "sample": 64}}).attn_logit_distribution
    assert got.enable and got.sample == 64
    assert parse_config({"attn_logit_distribution": {"sample": 8}}).attn_logit_distribution.enable
    for bad, match in (
        (1, r"'attn_logit_distribution': got 1 \(int\); allowed: true, false or"),
        ({"sample": 0}, r"'attn_logit_distribution.sample': got 0 \(int\); allowed: an integer in \[1, "),
        ({"enable": "yes"}, r"'attn_logit_distribution.enable': got 'yes' \(str\); allowed: true or false"),
        ({"stride": 2}, r"'attn_logit_distribution.stride': got 2 \(int\); allowed: only the keys"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_config({"attn_logit_distribution": bad})
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        mon = TrainerMon(write_config(tmp_path / "c.json", attn_logit_distribution=True))
        mon.set_monitor(model, optimizer=opt)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        mon.close()
    assert (
        sum(
            "attn_logit_distribution is on but the model has no attention" in r.message
            for r in caplog.records
        )
        == 1
    )
    assert read_family(mon.run_dir, "attn_logit") == []


def test_logit_growth_rule(tmp_path):
    rules = parse_rules([{"rule_name": "AnomalyLogitGrowth", "args": {"threshold": 30.0, "growth": 2.0}}])
    det = AnomalyDetector(rules, str(tmp_path), rank=0)
    metas = [RowMeta("attn_logit", 0, f"layers.{i}.attn", None, (4,), torch.float32, 4) for i in range(3)]
    det.check(StatBatch(0, metas, {"max": np.array([5.0, 8.0, 31.0])}))  # layer 2 above the threshold
    det.check(StatBatch(1, metas, {"max": np.array([11.0, 9.0, 12.0])}))  # layer 0 grew 2.2x its first
    det.close()
    got = {(r["step"], r["name"], r["stat"], r["baseline"]) for r in load_anomalies(str(tmp_path))}
    assert got == {(0, "layers.2.attn", "max", 30.0), (1, "layers.0.attn", "max", 10.0)}


def test_analyze_convert_and_parquet(tmp_path, monkeypatch):
    """analyze: a per-layer `max` heatmap over steps and the layer x head table of the last step, from
    Parquet and from CSV; trainermon convert carries head_max_logit / max_head to Parquet."""
    import trainermon
    from trainermon.analysis import analyze
    from trainermon.cli import main as cli_main

    mon, refs, bounds = _mha_run(tmp_path, monkeypatch, format=["csv", "parquet"])
    for run in (str(tmp_path / "out"), mon.run_dir):
        if run == mon.run_dir:
            os.remove(os.path.join(mon.run_dir, "parquet.json"))  # then the run's CSV files
        result = analyze(run, progress=False)
        table = result.head_logits
        assert table.attrs["step"] == STEPS - 1 and list(table.columns) == [0, 1, 2, 3]
        assert list(table.index) == ["first", "second"]
        for name in table.index:
            ref = refs[(name, STEPS - 1)]
            got = [v for v in table.loc[name].tolist() if v == v]  # the 2-head layer: NaN-padded
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * max(map(abs, ref)))
        heat = result.heatmaps[("attn_logit", "max")]
        for name in ("first", "second"):
            for step in range(STEPS):
                assert heat.loc[name, step] == pytest.approx(max(refs[(name, step)]), rel=1e-5)
        assert result.findings()["head_logits"]["figure"] == "attn_head_logits"
        assert "attn_head_logits" in dict(result.iter_figures())
    assert cli_main(["convert", mon.run_dir, str(tmp_path / "converted")]) == 0
    table = trainermon.load(str(tmp_path / "converted"), family="attn_logit").to_pandas()
    assert len(table) == len(refs)
    for _, r in table.iterrows():
        ref = refs[(r["name"], r["step"])]
        np.testing.assert_allclose(list(r["head_max_logit"]), ref, rtol=0, atol=1e-4 * max(map(abs, ref)))
        assert r["max_head"] == int(np.argmax(ref))


def test_prometheus_exports_the_per_layer_summary(tmp_path, monkeypatch):
    from tests.sinks.test_prometheus import scrape, url_of, value

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", attn_logit_distribution=True, ops=["max"], format=["prometheus"])
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"attn": torch.nn.MultiheadAttention(8, 2, batch_first=True)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    try:
        x = torch.randn(2, 5, 8)
        w, b = model["attn"].in_proj_weight.detach().double(), model["attn"].in_proj_bias.detach().double()
        q = (x.double() @ w[:8].T + b[:8]).view(2, 5, 2, 4).transpose(1, 2)
        k = (x.double() @ w[8:16].T + b[8:16]).view(2, 5, 2, 4).transpose(1, 2)
        top, bound = ref_max(q, k, 0.5, torch.ones(1, 1, 5, 5, dtype=torch.bool), 256)
        model["attn"](x, x, x)[0].sum().backward()
        opt.step()
        mon.flush()
        samples = scrape(url_of(mon))
        got = value(samples, "trainermon_layer_stat", stat="max", family="attn_logit", layer="attn")
        assert got == pytest.approx(float(top.max()), abs=8 * 12 * 2.0**-24 * bound)
        assert not [k for k in samples if ("family", "_attn") in k[1]]  # hidden rows never exported
    finally:
        mon.close()


def test_a_failing_computation_never_reaches_training(tmp_path, monkeypatch):
    from trainermon.runtime.probes import attn as attn_probe

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(attn_probe, "head_extremes", boom)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = torch.nn.ModuleDict({"attn": torch.nn.MultiheadAttention(8, 2, batch_first=True)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(tmp_path / "c.json", attn_logit_distribution=True, wg_distribution=True))
    mon.set_monitor(model, optimizer=opt)
    x = torch.randn(2, 5, 8)
    for _ in range(2):
        out = model["attn"](x, x, x)[0]  # the hook's failure stays inside the monitor
        out.sum().backward()
        opt.step()
    mon.close()
    assert mon.faults.counts.get("attention logit hook", 0) == 2
    assert read_family(mon.run_dir, "attn_logit") == [] and read_family(mon.run_dir, "grad_reduced")


def test_a_layer_not_run_is_warned_about(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = torch.nn.ModuleDict({n: torch.nn.MultiheadAttention(8, 2, batch_first=True) for n in ("a", "b")})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        mon = TrainerMon(write_config(tmp_path / "c.json", attn_logit_distribution=True, ops=["max"]))
        mon.set_monitor(model, optimizer=opt)
        x = torch.randn(2, 5, 8)
        model["a"](x, x, x)[0].sum().backward()  # "b" never runs
        opt.step()
        mon.close()
    assert [r["name"] for r in read_family(mon.run_dir, "attn_logit")] == ["a"]
    assert (
        sum(
            "no attention call was read at step 0 for ['b'] (of 2 layers)" in r.message
            for r in caplog.records
        )
        == 1
    )


def test_with_moe_load_in_the_same_step(tmp_path, monkeypatch):
    """Both worker-formed families in one step (a tiny Mixtral): each keeps its own columns."""
    pytest.importorskip("transformers")
    import trainermon
    from tests.unit.test_moe_load import _mixtral

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "c.json", attn_logit_distribution=True, moe_distribution=True, format=["csv", "parquet"]
    )
    model = _mixtral()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    ids = torch.randint(0, 64, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    mon.close()
    assert mon.faults.total == 0
    attn, moe = read_family(mon.run_dir, "attn_logit"), read_family(mon.run_dir, "moe_load")
    assert [r["name"] for r in attn] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(len(json.loads(r["head_max_logit"])) == 2 and "expert_load" not in r for r in attn)
    assert all(sum(json.loads(r["expert_load"])) == 2 * 12 * 2 and "head_max_logit" not in r for r in moe)
    table = trainermon.load(str(tmp_path / "out")).to_pandas()
    rows = table[table["family"].isin(["attn_logit", "moe_load"])]
    for _, r in rows.iterrows():
        mine, other = (
            ("head_max_logit", "expert_load")
            if r["family"] == "attn_logit"
            else ("expert_load", "head_max_logit")
        )
        assert r[mine] is not None and len(r[mine]) > 0 and r[other] is None, r
