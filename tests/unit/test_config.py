"""Config validation: bad values are refused, naming the key, the value and what is allowed."""

from __future__ import annotations

import json
import logging

import pytest

from trainermon import ConfigError, TrainerMon, load_config, parse_config

BAD = [
    ("targets", ["layers.0"], "targets"),
    ("targets", {"layers.0": "input"}, "targets.layers.0"),
    ("module_ranks", [0, "1"], "module_ranks"),
    ("module_ranks", 3, "module_ranks"),
    ("start_step", -1, "start_step"),
    ("start_step", "5", "start_step"),
    ("step_interval", 0, "step_interval"),
    ("collect_times", 1.5, "collect_times"),
    ("collect_times", True, "collect_times"),
    ("print_struct", "yes", "print_struct"),
    ("xy_distribution", 1, "xy_distribution"),
    ("wg_distribution", None, "wg_distribution"),
    ("ops", "norm", "ops"),
    ("ops", ["norm", "median"], "ops"),
    ("eps", 0, "eps"),
    ("eps", "1e-8", "eps"),
    ("ndigits", -1, "ndigits"),
    ("ndigits", 21, "ndigits"),  # msprobe's range is [0, 20]
    ("ndigits", 99, "ndigits"),
    ("format", "xlsx", "format"),
    ("format", [], "format"),
    ("step_count_per_record", 0, "step_count_per_record"),
    ("dynamic_on", "true", "dynamic_on"),
    ("cc_distribution", {"enable": "yes"}, "cc_distribution.enable"),
    ("cc_distribution", {"cc_codeline": ["("]}, "cc_distribution.cc_codeline"),
    ("cc_distribution", {"ops": ["all_reduce", "gossip"]}, "cc_distribution.ops"),
    ("cc_distribution", {"sometimes": True}, "cc_distribution.sometimes"),
    ("alert", {"rules": "AnomalyTurbulence"}, "alert.rules"),
    ("mg_direction", True, "mg_direction"),
    ("queue_size", 0, "queue_size"),
    ("accelerator_hold_mib", -1, "accelerator_hold_mib"),
    ("accelerator_hold_mib", "256", "accelerator_hold_mib"),
    ("write_interval_s", -1, "write_interval_s"),
    ("write_interval_s", "0.5", "write_interval_s"),
    ("write_interval_s", 3600, "write_interval_s"),
]


@pytest.mark.parametrize("key,value,named", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_value_names_key_and_value(key, value, named):
    with pytest.raises(ConfigError) as err:
        parse_config({key: value})
    message = str(err.value)
    assert f"'{named}'" in message
    assert "allowed" in message
    shown = value if isinstance(value, str) else repr(value)
    if not isinstance(value, (list, dict)):
        assert str(shown) in message or repr(value) in message


def test_a_config_with_every_msprobe_key_parses_and_says_what_is_off(caplog):
    """msprobe's documented full config (every key it lists, `ur_distribution` on) runs: msprobe 26 itself
    turns the update/ratio heatmaps off for csv with a warning, and so does this, naming the key."""
    raw = {
        "targets": {"layers.0": {"input": "tuple[2]:0", "output": "tensor"}},
        "wg_distribution": True, "dynamic_on": False, "start_step": 0, "collect_times": 100,
        "step_interval": 1, "print_struct": False, "module_ranks": [0, 1], "ur_distribution": True,
        "xy_distribution": True, "all_xy": True, "forward_only": False, "backward_only": False,
        "mv_distribution": True, "param_distribution": True, "monitor_mbs_grad": True,
        "cc_distribution": {"enable": True, "cc_codeline": []},
        "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False},
        "format": "csv", "ops": ["min", "max", "norm", "zeros", "nans", "mean"], "eps": 1e-8, "ndigits": 12,
        "step_count_per_record": 1, "append_output": [], "squash_name": False,
    }  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        cfg = parse_config(raw)
    assert cfg.wg_distribution and cfg.mv_distribution and cfg.ndigits == 12
    off = [r.getMessage() for r in caplog.records if "ur_distribution" in r.getMessage()]
    assert len(off) == 1 and "switched off" in off[0], off


def test_forward_only_and_backward_only_conflict():
    with pytest.raises(ConfigError, match="forward_only.*backward_only"):
        parse_config({"forward_only": True, "backward_only": True})


def test_defaults_are_msprobes():
    cfg = parse_config({})
    assert cfg.ops == ("norm", "shape", "dtype")
    assert cfg.format == ("csv",) and cfg.start_step == 0 and cfg.step_interval == 1
    assert cfg.collect_times == 100_000_000 and cfg.eps == 1e-8 and cfg.step_count_per_record == 1


def test_ops_order_kept_and_missing_shape_dtype_appended():
    """msprobe's column order: the user's, shape and dtype included; the missing ones appended."""
    assert parse_config({"ops": ["dtype", "max", "norm", "max"]}).ops == ("dtype", "max", "norm", "shape")
    assert parse_config({"ops": ["id", "min"]}).ops == ("min", "shape", "dtype")  # msprobe's 'id' ignored


def test_format_string_or_list():
    assert parse_config({"format": "csv"}).format == ("csv",)
    assert parse_config({"format": ["csv"]}).format == ("csv",)


def test_integral_float_accepted_for_msprobe_configs():
    assert parse_config({"collect_times": 1e8}).collect_times == 100_000_000


def test_unknown_key_warns_not_fails(caplog):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        parse_config({"colect_times": 3})
    assert "colect_times" in caplog.text


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"wg_distribution": tru')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    top = tmp_path / "list.json"
    top.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level"):
        load_config(top)


def test_constructor_raises_config_error(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"step_interval": -3}))
    with pytest.raises(ConfigError, match="step_interval"):
        TrainerMon(str(path))


def test_example_config_at_repo_root_is_valid():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    cfg = load_config(root / "monitor_config.json")
    assert cfg.wg_distribution


def test_cc_distribution_keys():
    from trainermon.config.schema import CommConfig

    assert parse_config({}).cc_distribution == CommConfig()  # off by default
    cc = parse_config(
        {
            "cc_distribution": {
                "enable": True,
                "cc_codeline": [r"train\.py:\d+"],
                "cc_pre_hook": True,
                "cc_log_only": True,
                "ops": ["all_reduce", "funcol", "all_reduce"],
                "check": False,
            }
        }
    ).cc_distribution
    assert cc == CommConfig(True, (r"train\.py:\d+",), True, True, ("all_reduce", "funcol"), False)
    with pytest.raises(ConfigError, match=r"cc_distribution.ops.*'gossip'.*all_reduce"):
        parse_config({"cc_distribution": {"ops": ["gossip"]}})


def test_collect_times_zero_is_said(caplog):
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        assert parse_config({"wg_distribution": True, "collect_times": 0}).collect_times == 0
    assert any("'collect_times' is 0" in r.getMessage() for r in caplog.records)
