"""Config checks from the config audit: prometheus.stats outside ops, parquet.compression_level per codec,
DYNAMIC_MONITOR and TRAINERMON_FUSED spellings, near-miss and msprobe-only top-level keys."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch

from tests.helpers import LayeredNet as Net
from tests.sinks.prometheus_common import scrape, train_step, url_of, value
from trainermon import ConfigError, TrainerMon, parse_config
from trainermon.cli import main as cli_main
from trainermon.config import read_env


def _write(tmp_path, cfg: dict) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


# ---- prometheus.stats must be computed by ops --------------------------------------------------------


@pytest.mark.parametrize(
    ("ops", "stats", "bad"),
    [(["norm"], ["zeros", "max"], "['zeros', 'max']"), (["norm"], ["nans", "norm"], "'nans'")],
)
def test_prometheus_stats_outside_ops_is_refused(tmp_path, monkeypatch, capsys, ops, stats, bad):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = {"wg_distribution": True, "ops": ops, "format": "prometheus", "prometheus": {"stats": stats}}
    path = _write(tmp_path, cfg)
    with pytest.raises(ConfigError) as err:
        TrainerMon(path)
    msg = str(err.value)
    assert "'prometheus.stats'" in msg and bad in msg and "ops ['norm']" in msg
    assert cli_main(["check-config", path]) == 2
    assert "prometheus.stats" in capsys.readouterr().err


def test_prometheus_stats_outside_ops_is_accepted_with_the_format_off(tmp_path, monkeypatch):
    """A shared config's unused prometheus section: nothing is served, so nothing is refused."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = {"wg_distribution": True, "ops": ["min", "max"], "format": "csv", "prometheus": {"stats": ["norm"]}}
    assert cli_main(["check-config", _write(tmp_path, cfg)]) == 0
    parsed = parse_config(cfg)
    assert parsed.format == ("csv",) and tuple(parsed.prometheus.stats) == ("norm",)


def test_prometheus_stats_in_ops_serves_the_true_count(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = {
        "wg_distribution": True,
        "ops": ["norm", "nans"],
        "format": "prometheus",
        "prometheus": {"stats": ["nans", "norm"]},
    }
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = TrainerMon(_write(tmp_path, cfg))
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    gen = torch.Generator().manual_seed(3)
    try:
        w = dict(model.named_parameters())["layers.0.weight"]
        w.register_hook(
            lambda g: g.index_put((torch.tensor([0]), torch.tensor([1])), torch.tensor(float("nan")))
        )
        grads = train_step(model, opt, gen)
        mon.flush()
        s = scrape(url_of(mon))
        layer0 = [g for n, g in grads.items() if n.startswith("layers.0.")]
        truth = sum(int(torch.isnan(g).sum()) for g in layer0)
        assert truth == 1
        got = value(s, "trainermon_layer_stat", family="grad_reduced", layer="layers.0", stat="nans")
        assert got == truth
    finally:
        mon.close()


# ---- parquet.compression_level ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("codec", "level", "allowed"),
    [("snappy", 3, "takes no compression level"), ("none", 1, "takes no compression level"),
     ("gzip", 99, "[1, 9] for 'gzip'"), ("zstd", 99, "for 'zstd'")],
)  # fmt: skip
def test_compression_level_the_codec_refuses(tmp_path, monkeypatch, codec, level, allowed):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = {"wg_distribution": True, "format": "parquet", "parquet": {"compression": codec}}
    cfg["parquet"]["compression_level"] = level
    with pytest.raises(ConfigError) as err:
        TrainerMon(_write(tmp_path, cfg))
    assert f"'parquet.compression_level': got {level}" in str(err.value) and allowed in str(err.value)
    # the core does not judge it (nor import pyarrow) when the parquet format is off
    assert parse_config({**cfg, "format": "csv"}).parquet.compression_level == level


def test_a_level_in_range_writes_every_row(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = {
        "wg_distribution": True,
        "format": "parquet",
        "parquet": {"compression": "gzip", "compression_level": 3},
    }
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = TrainerMon(_write(tmp_path, cfg))
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    expected = {}
    for step in range(3):
        for n, g in train_step(model, opt, gen).items():
            expected[(n, step)] = g.double().norm().item()
    mon.close()
    files = list((tmp_path / "out").rglob("family=grad_reduced/**/*.parquet"))
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    assert pq.ParquetFile(files[0]).metadata.row_group(0).column(0).compression == "GZIP"
    got = {(r["name"], r["step"]): r["norm"] for r in rows}
    assert got.keys() == expected.keys()  # every row written (the old code wrote none with gzip 99)
    for key, norm in expected.items():
        assert got[key] == pytest.approx(norm, rel=1e-5)


# ---- DYNAMIC_MONITOR ----------------------------------------------------------------------------------


def test_dynamic_monitor_other_spellings_are_said_once(monkeypatch, caplog):
    from trainermon.config import env

    monkeypatch.setattr(env, "_dynamic_warned", set())  # once per process: start from none said
    for raw in ("1", "yes"):
        monkeypatch.setenv("DYNAMIC_MONITOR", raw)
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            caplog.clear()
            assert read_env().dynamic is False and read_env().dynamic is False
        said = [r.getMessage() for r in caplog.records if "DYNAMIC_MONITOR" in r.getMessage()]
        assert len(said) == 1, said
        assert f"DYNAMIC_MONITOR={raw!r}" in said[0] and "'true'" in said[0] and "'false'" in said[0]
    for raw, dynamic in (("TRUE", True), ("false", False), ("", False)):
        monkeypatch.setenv("DYNAMIC_MONITOR", raw)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            assert read_env().dynamic is dynamic
        assert not [r for r in caplog.records if "DYNAMIC_MONITOR" in r.getMessage()]


# ---- TRAINERMON_FUSED ----------------------------------------------------------------------------------

_PROBE = (
    "import os, trainermon, trainermon.stats.fused as f\n"
    "from trainermon.config import read_env\n"
    "os.environ['TRAINERMON_FUSED'] = '0'\n"  # after import: changes nothing (read once, at import)
    "print('RESULT', f.KIND.startswith('disabled'), read_env().fused)\n"
)


@pytest.mark.parametrize(
    ("raw", "off", "warned"),
    [("", False, False), ("maybe", False, True), ("Off", True, False), ("1", False, False)],
)
def test_trainermon_fused_has_one_reader_and_one_meaning(raw, off, warned):
    env = {**os.environ, "TRAINERMON_FUSED": raw}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    assert line == f"RESULT {off} {not off}"  # the kernel and Env.fused agree
    said = [x for x in done.stderr.splitlines() if "TRAINERMON_FUSED" in x]
    assert len(said) == int(warned), done.stderr
    if warned:
        assert repr(raw) in said[0]


# ---- top-level keys ------------------------------------------------------------------------------------


def test_near_miss_keys_name_the_key_meant(caplog):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        parse_config({"wg_distributon": True, "targes": {"0.": {}}, "zzz_other": 1})
    said = [r.getMessage() for r in caplog.records]
    assert any("'wg_distributon'" in m and "did you mean 'wg_distribution'?" in m for m in said), said
    assert any("'targes'" in m and "did you mean 'targets'?" in m for m in said), said
    assert any("'zzz_other'" in m and "did you mean" not in m for m in said), said


def test_mg_distribution_is_a_msprobe_key_not_implemented(caplog):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        parse_config({"mg_distribution": True, "wg_distribution": True})
    said = [r.getMessage() for r in caplog.records if "mg_distribution" in r.getMessage()]
    assert len(said) == 1 and "msprobe key trainermon does not implement" in said[0]
    assert "unknown" not in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        parse_config({"mg_distribution": False})
    assert not [r for r in caplog.records if "mg_distribution" in r.getMessage()]
    with pytest.raises(ConfigError, match=r"'mg_distribution': got 'yes'.*true or false"):
        parse_config({"mg_distribution": "yes"})
