"""msprobe 26.2 configs and calls that trainermon runs as msprobe does: `ndigits` 0..20, `targets: {"": {}}`,
the `alert` section's bool-like `dump`, `rules: null` and informational rule keys, `squash_name`'s row names,
the user's `ops` order, `all_xy` without `xy_distribution`, `generate_wgrad_metrics(post_grad_dict)` and
`reload_xy(flag)`."""

from __future__ import annotations

import csv
import glob
import logging
import os
import re

import pytest
import torch
from torch import nn

from tests.helpers import read_family, write_config
from trainermon import ConfigError, TrainerMon, parse_config
from trainermon.names import squash_name, unique_names


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


# ---- ndigits ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("given,used", [(0, 1), (1, 1), (6, 6), (17, 17), (18, 17), (20, 17), (20.0, 17)])
def test_ndigits_takes_msprobes_range_and_clamps_what_cannot_be_written(caplog, given, used):
    """msprobe accepts 0..20 (decimal places there); trainermon writes significant digits, 1 to 17 (17
    write every float64 exactly): 0 and 18..20 are written as 1 and 17, with one warning naming both."""
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        assert parse_config({"ndigits": given}).ndigits == used
    said = _warnings(caplog, "'ndigits'")
    if used == given:
        assert said == []
    else:
        assert len(said) == 1 and f"{int(given)} is written as {used}" in said[0], said


@pytest.mark.parametrize("bad", [21, -1, True, "6", 2.5])
def test_ndigits_outside_msprobes_range_is_refused(bad):
    with pytest.raises(ConfigError, match=r"'ndigits'.*allowed: an integer in \[0, 20\]"):
        parse_config({"ndigits": bad})


def test_ndigits_20_runs_and_writes_every_digit(tmp_path, out_dir):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    monitor = TrainerMon(write_config(tmp_path / "c.json", wg_distribution=True, ndigits=20))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.set_monitor(model, optimizer=opt)
    model(torch.randn(4, 3)).square().sum().backward()
    expected = model.weight.grad.double().norm().item()
    opt.step()
    monitor.close()
    (row,) = [r for r in read_family(monitor.run_dir, "grad_reduced") if r["name"] == "weight"]
    assert float(row["norm"]) == pytest.approx(expected, rel=1e-6)
    assert len(row["norm"].replace(".", "").replace("-", "").split("e")[0].lstrip("0")) >= 15, row["norm"]


# ---- targets {"": {}} --------------------------------------------------------------------------------
def test_empty_name_target_is_msprobes_everything(tmp_path, out_dir):
    """msprobe's validate_config writes `"targets": {"": {}}` for "every name": no targets here."""
    assert parse_config({"targets": {"": {}}}).targets == {}
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    cfg = write_config(tmp_path / "c.json", targets={"": {}}, wg_distribution=True, xy_distribution=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    monitor.close()
    grads = {r["name"] for r in read_family(monitor.run_dir, "grad_reduced")}
    assert grads == {"0.weight", "0.bias", "2.weight", "2.bias"}
    actv = {r["name"] for r in read_family(monitor.run_dir, "actv")}
    assert {"0.output", "1.output", "2.output"} <= actv


@pytest.mark.parametrize("targets", [{"": {}, "layers.0": {}}, {"": {"input": "tensor"}}, {" ": {}}])
def test_empty_name_target_with_more_is_refused(targets):
    with pytest.raises(ConfigError, match="'targets'"):
        parse_config({"targets": targets})


# ---- alert ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dump,expected", [(0, False), (1, True), (False, False), (True, True), (None, False)]
)
def test_alert_dump_takes_bool_like_ints(dump, expected):
    assert parse_config({"alert": {"rules": [], "dump": dump}}).alert.dump is expected


@pytest.mark.parametrize("dump", [2, -1, "yes", 1.0])
def test_alert_dump_other_values_are_refused(dump):
    with pytest.raises(ConfigError, match="'alert.dump'"):
        parse_config({"alert": {"dump": dump}})


def test_alert_rules_null_is_no_rules():
    assert parse_config({"alert": {"rules": None}}).alert.rules == ()


def test_alert_rule_informational_key_is_warned_once_and_dropped(caplog):
    rules = [
        {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}, "desc": "x", "owner": "me"},
        {"rule_name": "AnomalyNan", "args": {"threshold": 1e10}},
    ]
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        alert = parse_config({"alert": {"rules": rules}}).alert
    assert alert.rules == (
        {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}},
        {"rule_name": "AnomalyNan", "args": {"threshold": 1e10}},
    )
    said = _warnings(caplog, "alert.rules[0]")
    assert len(said) == 1 and "alert.rules[0].desc" in said[0] and "alert.rules[0].owner" in said[0], said


@pytest.mark.parametrize(
    "alert,named",
    [
        (
            {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"thresh": 0.5}}]},
            "alert.rules[0].args.thresh",
        ),
        ({"rules": [], "dumps": True}, "alert.dumps"),
        ({"rules": [{"rule_name": "AnomalyNan", "arg": {"threshold": 1.0}}]}, "alert.rules[0].arg"),  # typo
        ({"rules": [{"ruleName": "AnomalyNan"}]}, "alert.rules[0].ruleName"),
        ({"rules": [{"rule_name": "AnomalyBogus"}]}, "alert.rules[0].rule_name"),
        ({"rules": ["AnomalyNan"]}, "alert.rules"),
    ],
)
def test_alert_what_readme_refuses_stays_refused(alert, named):
    with pytest.raises(ConfigError, match=re.escape(f"'{named}'")):
        parse_config({"alert": alert})


# ---- squash_name -------------------------------------------------------------------------------------
SQUASHED = {
    "layers.0.norm.weight": "norm.weight",  # no dot before `layers.`: the norm rule applies
    "model.layers.3.mlp.weight": "layers.3.mlp.weight",
    "a.layers.1.b.layers.2.c": "layers.2.c",  # the last occurrence
    "decoder.layer.0.fc.bias": "layer.0.fc.bias",
    "x.embeddings.y.final_ln.w": "embeddings.y.final_ln.w",  # the first rule that matches wins
    "lm.final_norm.w": "final_norm.w",
    "model.output_layer.weight": "output_layer.weight",
    "a.norm.b.norm.c": "norm.c",
    "norm.weight": "norm.weight",
    "layers.1": "layers.1",
    "head.weight": "head.weight",
}


def test_squash_name_is_msprobes():
    assert {n: squash_name(n) for n in SQUASHED} == SQUASHED
    metric = pytest.importorskip("msprobe.pytorch.monitor.module_metric")
    assert {n: metric.squash_param_name(n) for n in SQUASHED} == SQUASHED


def test_unique_names_keep_the_first_squashed_name():
    """msprobe: a squashed name already taken gives the full name; never two rows under one name."""
    assert unique_names(["a", "a", "b"], ["x.a", "y.a", "b"]) == ["a", "y.a", "b"]
    assert unique_names(["n.w", "n.w", "n.w"], ["l.0.n.w", "l.1.n.w", "l.2.n.w"]) == [
        "n.w",
        "l.1.n.w",
        "l.2.n.w",
    ]
    assert unique_names(["a", "a"], ["a", "a"]) == ["a", "a#1"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + self.fc(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_squashed_rows_are_named_as_msprobe_names_them(tmp_path, out_dir):
    torch.manual_seed(0)
    model = Net()
    cfg = write_config(
        tmp_path / "c.json", squash_name=True, wg_distribution=True, xy_distribution=True, forward_only=True
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    monitor.close()
    grads = [r["name"] for r in read_family(monitor.run_dir, "grad_reduced")]
    assert grads == [
        "layers.0.fc.weight", "layers.0.fc.bias", "norm.weight", "norm.bias",
        "layers.1.fc.weight", "layers.1.fc.bias", "layers.1.norm.weight", "layers.1.norm.bias",
        "head.weight", "head.bias",
    ]  # fmt: skip
    actv = [r["name"] for r in read_family(monitor.run_dir, "actv")]
    assert actv.count("norm.output") == 2 and "layers.0.norm.output" not in actv, actv  # as msprobe's
    assert {"layers.0.fc.output", "layers.1.output", "head.output"} <= set(actv)


# ---- ops order ---------------------------------------------------------------------------------------
def test_ops_keep_the_users_order_with_shape_and_dtype(tmp_path, out_dir):
    assert parse_config({"ops": ["shape", "max", "dtype", "norm"]}).ops == ("shape", "max", "dtype", "norm")
    assert parse_config({"ops": ["dtype", "max"]}).ops == ("dtype", "max", "shape")
    cfg = write_config(tmp_path / "c.json", wg_distribution=True, ops=["shape", "max", "dtype", "norm"])
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    monitor.close()
    (path,) = glob.glob(os.path.join(monitor.run_dir, "grad_reduced_*.csv"))
    with open(path, newline="") as fh:
        header = next(csv.reader(fh))
    assert header[:7] == ["vpp_stage", "name", "step", "shape", "max", "dtype", "norm"]
    (row,) = [r for r in read_family(monitor.run_dir, "grad_reduced") if r["name"] == "weight"]
    assert row["shape"] == "[2, 2]" and row["dtype"] == "torch.float32" and float(row["max"]) == 1.0


# ---- all_xy ------------------------------------------------------------------------------------------
def test_all_xy_without_xy_distribution_selects_nothing(tmp_path, out_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        cfg = parse_config({"all_xy": True, "wg_distribution": True})
    assert not cfg.collects_actv and not cfg.collects_actv_grad
    said = _warnings(caplog, "'all_xy'")
    assert len(said) == 1 and "xy_distribution" in said[0], said
    assert parse_config({"all_xy": True, "xy_distribution": True}).collects_actv
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "c.json", all_xy=True, wg_distribution=True))
    monitor.set_monitor(model, optimizer=opt)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    monitor.close()
    assert read_family(monitor.run_dir, "actv") == [] and read_family(monitor.run_dir, "actv_grad") == []
    assert read_family(monitor.run_dir, "grad_reduced")


# ---- generate_wgrad_metrics(post_grad_dict), reload_xy ---------------------------------------------
def _one_step(model, opt):
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_generate_wgrad_metrics_takes_msprobes_argument(tmp_path, out_dir, caplog):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "c.json", wg_distribution=True, format="api"))
    monitor.set_monitor(model, optimizer=opt)
    _one_step(model, opt)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        plain = monitor.generate_wgrad_metrics()
        empty = monitor.generate_wgrad_metrics({})
        given = monitor.generate_wgrad_metrics({"0:weight": torch.ones(2, 2)})
        monitor.generate_wgrad_metrics(post_grad_dict={"0:bias": torch.ones(2)})
    for got in (empty, given):
        assert {k: {s: float(v) for s, v in d.items() if s == "norm"} for k, d in got[0].items()} == {
            k: {s: float(v) for s, v in d.items() if s == "norm"} for k, d in plain[0].items()
        }
    assert float(plain[0]["0:weight/rank0/post_grad"]["norm"]) == pytest.approx(2.0)
    said = _warnings(caplog, "post_grad_dict")
    assert len(said) == 1 and "ignored" in said[0], said
    with pytest.raises(TypeError, match="dict"):
        monitor.generate_wgrad_metrics([1])
    monitor.close()


def test_reload_xy_switches_activations_from_the_next_step(tmp_path, out_dir, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "c.json", wg_distribution=True))
    monitor.set_monitor(model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        _one_step(model, opt)  # step 0: xy off
        monitor.reload_xy(True)
        _one_step(model, opt)  # step 1: on
        _one_step(model, opt)  # step 2: on
        monitor.reload_xy(False)
        _one_step(model, opt)  # step 3: off
        monitor.reload_xy(False)
    monitor.close()
    assert monitor.config.xy_distribution is False
    for family in ("actv", "actv_grad"):
        steps = sorted({int(r["step"]) for r in read_family(monitor.run_dir, family)})
        assert steps == [1, 2], (family, steps)
    names = {r["name"] for r in read_family(monitor.run_dir, "actv")}
    assert names == {"0.input", "0.output", "1.input", "1.output"}, names
    assert sorted({int(r["step"]) for r in read_family(monitor.run_dir, "grad_reduced")}) == [0, 1, 2, 3]
    said = _warnings(caplog, "reload_xy")
    assert len(said) == 1 and "deprecated" in said[0] and "'xy_distribution'" in said[0], said
    with pytest.raises(TypeError):
        monitor.reload_xy("yes")
    assert monitor.faults.total == 0


def test_msprobe_keys_without_effect_are_said_when_set(caplog):
    """`sa_order`, `heatmap_visualizer` and `csv` are accepted for msprobe's configs; set, they said nothing
    although nothing reads them."""
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        parse_config({"sa_order": "s,b", "heatmap_visualizer": True, "csv": {"a": 1}}, source="cfg.json")
        parse_config({"heatmap_visualizer": False}, source="off.json")
    said = _warnings(caplog, "has no effect")
    assert [s.split("'")[1] for s in said] == ["sa_order", "heatmap_visualizer", "csv"], said
    assert all("cfg.json" in s for s in said)
