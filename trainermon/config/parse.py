"""Validation: `parse_config` is the only function that turns user input into a `MonitorConfig`
(`schema`); the checks live here, with the shared value checks in `values` and the sinks' sections in
`sinks`, and every error names the key, the bad value and what is allowed. Defaults come from the
schema's dataclasses only."""

from __future__ import annotations

import difflib
import json
import logging
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from trainermon.stats.table import OPS, TRAILING_OPS

from .health import attn_logit
from .schema import COMM_OPS, AlertConfig, CommConfig, MonitorConfig
from .sinks import _parquet, _prometheus
from .values import ConfigError, _bool, _choice, _choices, _dict, _fail, _int, _seconds, _section, _type_name

logger = logging.getLogger("trainermon")

#: msprobe ops that trainermon accepts but does not compute (warned and dropped).
IGNORED_MSPROBE_OPS = ("id",)
#: "api" (msprobe's name): no sink; the statistics are read in memory (`TrainerMon.generate_*_metrics`).
SUPPORTED_FORMATS = ("csv", "parquet", "prometheus", "tensorboard", "api")
#: msprobe keys for features trainermon does not have. Accepted when falsy, refused when switched on.
UNSUPPORTED_WHEN_ON = {
    "mg_direction": "momentum/gradient direction tracking is not supported yet",
    "l2_targets": "msprobe's L2 feature hooks are not supported",
    "recording_l2_features": "msprobe's L2 feature hooks are not supported",
    "append_output": "appending to an earlier msprobe output directory is not supported",
}
#: msprobe keys that msprobe validates (a bool) but trainermon does not implement: a bool is accepted, true
#: is warned about as such (not as an unknown key).
NOT_IMPLEMENTED = {
    "mg_distribution": "msprobe validates it as a bool; msprobe 26's PyTorch monitor reads it nowhere",
}
#: Keys that are accepted and ignored with no effect on trainermon (kept for drop-in compatibility).
INERT_KEYS = ("sa_order", "heatmap_visualizer", "csv")
#: msprobe keys that msprobe itself switches off, with a warning, for every output format trainermon has
#: (its heatmaps need its TensorBoard writer, which msprobe 26 lacks): the same here, so that msprobe's own
#: example config runs.
OFF_WITH_A_WARNING = {
    "ur_distribution": "msprobe's update/ratio heatmaps are not written (msprobe 26 turns them off for csv "
    "too); update_distribution gives the update/weight ratio",
}
#: The most significant digits the CSV writer writes: 17 give every float64 exactly.
MAX_NDIGITS = 17
#: msprobe's range of `ndigits` (decimal places there, 0 and 18..20 included): accepted, clamped to
#: [1, MAX_NDIGITS] with a warning.
MSPROBE_MAX_NDIGITS = 20
_DEFAULT = MonitorConfig()


def _ops(raw: dict) -> tuple[str, ...]:
    value = raw.get("ops", [])
    if not isinstance(value, list) or not all(isinstance(op, str) for op in value):
        raise _fail("ops", value, f"a list of strings from {list(OPS)}")
    ops: list[str] = []  # the user's order, shape and dtype included (msprobe's CSV columns)
    for op in value:
        if op in IGNORED_MSPROBE_OPS:
            logger.warning("trainermon: op '%s' (msprobe call id) is not computed and is ignored", op)
            continue
        if op not in OPS:
            raise _fail("ops", op, f"each op one of {list(OPS)}")
        if op not in ops:
            ops.append(op)
    if not [op for op in ops if op not in TRAILING_OPS]:
        ops.insert(0, "norm")  # msprobe's default when no statistic is given
    for tail in TRAILING_OPS:  # msprobe appends these two columns when the user did not name them
        if tail not in ops:
            ops.append(tail)
    return tuple(ops)


def _formats(raw: dict) -> tuple[str, ...]:
    value = raw.get("format", "csv")
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(f, str) for f in items):
        raise _fail(
            "format", value, f"a string or a non-empty list of strings from {list(SUPPORTED_FORMATS)}"
        )
    out: list[str] = []
    for fmt in items:
        if fmt not in SUPPORTED_FORMATS:
            raise _fail("format", fmt, f"one of {list(SUPPORTED_FORMATS)}")
        if fmt not in out:
            out.append(fmt)
    return tuple(out)


def _targets(raw: dict) -> dict[str, dict]:
    value = raw.get("targets", {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(
            "targets", value, 'an object mapping module or parameter names to objects, e.g. {"layers.0": {}}'
        )
    if "" in value:
        # msprobe's own spelling of "no targets" (its validate_config writes {"": {}}): every one
        if len(value) > 1 or value[""]:
            raise _fail(
                "targets",
                value,
                '{"": {}} alone (msprobe\'s "every name") or names without the empty one',
            )
        return {}
    for name, spec in value.items():
        if not name.strip():
            raise _fail("targets", name, "module or parameter names, none empty (no targets: every one)")
        if not isinstance(spec, dict):
            raise _fail(f"targets.{name}", spec, "an object (msprobe uses {} or {'input': 'tensor'})")
    return dict(value)


def _module_ranks(raw: dict) -> tuple[int, ...]:
    value = raw.get("module_ranks", [])
    if not isinstance(value, list):
        raise _fail("module_ranks", value, "a list of non-negative integer ranks")
    for rank in value:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise _fail("module_ranks", rank, "each rank a non-negative integer")
    return tuple(value)


ALERT_KEYS = ("rules", "dump", "escalate_steps")
#: The keys of one alert rule that trainermon reads; others (msprobe ignores them: "desc", ...) are warned
#: about and dropped, except near-misses of these ("arg"), which are refused.
RULE_KEYS = ("rule_name", "args")


def _alert(raw: dict) -> AlertConfig:
    from trainermon.pipeline.rule_specs import parse_rules

    value = _dict(raw, "alert")
    for sub in value:
        if sub not in ALERT_KEYS:
            raise _fail(f"alert.{sub}", value[sub], f"a key of the 'alert' section: {list(ALERT_KEYS)}")
    rules = value.get("rules", [])
    if rules is None:  # msprobe: no rules
        rules = []
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise _fail(
            "alert.rules", rules, 'a list of objects like {"rule_name": "AnomalyTurbulence", "args": {}}'
        )
    ignored = []
    for i, rule in enumerate(rules):
        for key in rule:
            if key in RULE_KEYS:
                continue
            close = difflib.get_close_matches(str(key), RULE_KEYS, n=1, cutoff=0.75)
            if close:  # a misspelt 'args' would silently drop the rule's arguments: refused
                raise _fail(
                    f"alert.rules[{i}].{key}", rule[key], f"'{close[0]}' (a rule's keys: {list(RULE_KEYS)})"
                )
            ignored.append(f"alert.rules[{i}].{key}")
    if ignored:
        logger.warning(
            "trainermon: config keys %s are ignored (a rule reads only %s)",
            ", ".join(ignored),
            list(RULE_KEYS),
        )
        rules = [{k: v for k, v in r.items() if k in RULE_KEYS} for r in rules]
    try:
        parse_rules(rules)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    defaults = _DEFAULT.alert
    dump = value.get("dump", defaults.dump)
    if dump is None:
        dump = defaults.dump
    if not isinstance(dump, bool) and isinstance(dump, int) and dump in (0, 1):
        dump = bool(dump)  # msprobe's configs write 0 for false
    if not isinstance(dump, bool):
        raise _fail("alert.dump", dump, "true or false (or 0, 1)")
    escalate = _int(
        {"alert.escalate_steps": value.get("escalate_steps", defaults.escalate_steps)},
        "alert.escalate_steps",
        0,
        10**6,
    )
    return AlertConfig(rules=tuple(rules), dump=dump, escalate_steps=escalate)


def _cc(raw: dict) -> CommConfig:
    import re

    values = _section(raw, "cc_distribution", _DEFAULT.cc_distribution)
    for key in ("enable", "cc_pre_hook", "cc_log_only", "check"):
        if not isinstance(values[key], bool):
            raise _fail(f"cc_distribution.{key}", values[key], "true or false")
    lines = values["cc_codeline"]
    if not isinstance(lines, (list, tuple)) or not all(isinstance(v, str) and v for v in lines):
        raise _fail("cc_distribution.cc_codeline", lines, "a list of regular expressions (strings)")
    for pattern in lines:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise _fail(
                "cc_distribution.cc_codeline", pattern, f"a valid regular expression ({exc})"
            ) from None
    values["cc_codeline"] = tuple(lines)
    _choices("cc_distribution", values, "ops", COMM_OPS)
    return CommConfig(**values)


def _ndigits(raw: dict) -> int:
    """msprobe's `ndigits` range [0, 20]; trainermon writes significant digits, 1 to 17 (msprobe: decimal
    places), so 0 and 18..20 are clamped with a warning naming the key and the value."""
    value = raw.get("ndigits") if raw.get("ndigits") is not None else _DEFAULT.ndigits
    value = _int({"ndigits": value}, "ndigits", 0, MSPROBE_MAX_NDIGITS)
    clamped = min(max(value, 1), MAX_NDIGITS)
    if clamped != value:
        why = (
            "more than a float64 holds: 17 significant digits write every value exactly"
            if value > MAX_NDIGITS
            else "trainermon writes significant digits (msprobe's 0 rounds to whole numbers)"
        )
        logger.warning("trainermon: config key 'ndigits': %d is written as %d (%s)", value, clamped, why)
    return clamped


def parse_config(raw: Any, source: str = "<dict>") -> MonitorConfig:
    """Validate a config mapping (as loaded from JSON) and return a `MonitorConfig`.

    Raises `ConfigError` naming the key, the bad value and what is allowed. Unknown keys are warned
    about, not refused, so that configs written for newer versions still load.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"config {source}: the top level must be a JSON object, got {_type_name(raw)}")
    names = {f.name for f in fields(MonitorConfig)}
    known = names | {*UNSUPPORTED_WHEN_ON, *INERT_KEYS, *OFF_WITH_A_WARNING, *NOT_IMPLEMENTED}
    for key in raw:
        if not isinstance(key, str) or key not in known:
            # a near-miss ('wg_distributon') leaves its family off: name the key it was probably meant to be
            close = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            logger.warning("trainermon: unknown config key %r in %s is ignored%s", key, source, hint)
    for key, why in NOT_IMPLEMENTED.items():
        if key in raw and not isinstance(raw[key], bool):
            raise _fail(key, raw[key], f"true or false ({why})")
        if raw.get(key):
            logger.warning(
                "trainermon: config key %r in %s is a msprobe key trainermon does not implement; "
                "ignored (%s)",
                key,
                source,
                why,
            )
    for key, why in UNSUPPORTED_WHEN_ON.items():
        if raw.get(key):
            raise _fail(key, raw[key], f"false or absent ({why})")
    for key, why in OFF_WITH_A_WARNING.items():
        if raw.get(key):
            logger.warning("trainermon: config key %r in %s is switched off: %s", key, source, why)
    for key in INERT_KEYS:
        if raw.get(key):
            logger.warning(
                "trainermon: config key %r in %s has no effect (msprobe's; ignored here)", key, source
            )

    forward_only = _bool(raw, "forward_only")
    backward_only = _bool(raw, "backward_only")
    if forward_only and backward_only:
        raise ConfigError(
            "config keys 'forward_only' and 'backward_only' are both true; allowed: at most one"
        )
    eps = raw.get("eps", _DEFAULT.eps)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1):
        raise _fail("eps", eps, "a number in (0, 1)")
    if raw.get("all_xy") is True and raw.get("xy_distribution") is not True:
        logger.warning(
            "trainermon: config key 'all_xy' in %s selects nothing without xy_distribution: all_xy only "
            "widens the activation targets to every module (msprobe's meaning); set xy_distribution: true",
            source,
        )
    ndigits = _ndigits(raw)
    ops, formats = _ops(raw), _formats(raw)  # the sinks' sections are checked against them
    if raw.get("collect_times") == 0:
        logger.warning("trainermon: config key 'collect_times' is 0 in %s: no step is collected", source)

    return MonitorConfig(
        targets=_targets(raw),
        module_ranks=_module_ranks(raw),
        start_step=_int(raw, "start_step", 0, 2**62),
        step_interval=_int(raw, "step_interval", 1, 2**62),
        collect_times=_int(raw, "collect_times", 0, 2**62),
        print_struct=_bool(raw, "print_struct"),
        xy_distribution=_bool(raw, "xy_distribution"),
        all_xy=_bool(raw, "all_xy"),
        forward_only=forward_only,
        backward_only=backward_only,
        wg_distribution=_bool(raw, "wg_distribution"),
        monitor_mbs_grad=_bool(raw, "monitor_mbs_grad"),
        mv_distribution=_bool(raw, "mv_distribution"),
        param_distribution=_bool(raw, "param_distribution"),
        cc_distribution=_cc(raw),
        alert=_alert(raw),
        ops=ops,
        eps=float(eps),
        ndigits=ndigits,
        format=formats,
        step_count_per_record=_int(raw, "step_count_per_record", 1, 1_000_000),
        dynamic_on=_bool(raw, "dynamic_on"),
        stack_info=_bool(raw, "stack_info"),
        squash_name=_bool(raw, "squash_name"),
        queue_size=_int(raw, "queue_size", 1, 100_000),
        accelerator_hold_mib=_int(raw, "accelerator_hold_mib", 0, 1 << 20),
        write_interval_s=_seconds(raw, "write_interval_s", 60.0),
        dynamic_watch=_choice(raw, "dynamic_watch", ("inotify", "polling")),
        parquet=_parquet(raw, formats),
        prometheus=_prometheus(raw, ops, formats),
        xrank_summary=_bool(raw, "xrank_summary"),
        update_distribution=_bool(raw, "update_distribution"),
        moe_distribution=_bool(raw, "moe_distribution"),
        attn_logit_distribution=attn_logit(raw.get("attn_logit_distribution", False), _fail),
    )


def load_config(path: str | os.PathLike) -> MonitorConfig:
    """Read and validate a JSON config file. Raises `ConfigError` (also for unreadable or invalid JSON)."""
    return parse_config(read_config_json(path), source=str(path))


def read_config_json(path: str | os.PathLike) -> Any:
    """The JSON value of a config file, not validated. Raises `ConfigError` (unreadable, invalid JSON)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc.strerror or exc}") from exc
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config file {str(p)!r} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from exc
    return raw
