"""Config keys set to a value that can have no effect with the rest of the config, one sentence each
(`inert_keys`; said by `targets.idle_switches` at `set_monitor` and at each reload): a key left silent
here would look applied while nothing reads it.

- an alert rule that reads statistics of `ops` that `ops` does not hold (`rule_specs.RULE_OPS`);
- `cc_distribution` keys besides `enable` while `enable` is false;
- `ndigits` and `step_count_per_record` (CSV's own) without 'csv' in `format`;
- `eps` (the `zeros` threshold) without 'zeros' in `ops`.
"""

from __future__ import annotations

import dataclasses

from trainermon.config import MonitorConfig
from trainermon.config.schema import CommConfig
from trainermon.pipeline.rule_specs import RULE_OPS

_DEFAULTS = MonitorConfig()


def inert_keys(config: MonitorConfig) -> list[str]:
    """What in `config` can never act, one sentence each. A few comparisons, at attach and reloads only."""
    out = []
    for i, rule in enumerate(config.alert.rules):
        name = rule.get("rule_name")
        needs = RULE_OPS.get(name, ())
        if needs and not set(needs) & set(config.ops):
            held = " nor ".join(repr(s) for s in needs)
            out.append(
                f"alert.rules[{i}] {name} can never fire: ops {list(config.ops)} hold neither {held}; "
                f"add one of them to ops"
            )
    cc = config.cc_distribution
    if not cc.enable:
        default = CommConfig()
        keys = [
            f.name
            for f in dataclasses.fields(cc)
            if f.name != "enable" and getattr(cc, f.name) != getattr(default, f.name)
        ]
        if keys:
            out.append(
                f"cc_distribution keys {keys} have no effect: cc_distribution.enable is false, so no "
                "collective is watched"
            )
    if "csv" not in config.format:
        for key in ("ndigits", "step_count_per_record"):
            value = getattr(config, key)
            if value != getattr(_DEFAULTS, key):
                out.append(
                    f"{key} {value!r} has no effect: it sets the CSV files, and format {list(config.format)} "
                    "does not include 'csv'"
                )
    if "zeros" not in config.ops and config.eps != _DEFAULTS.eps:
        out.append(
            f"eps {config.eps!r} has no effect: it is the threshold of the 'zeros' statistic, and ops "
            f"{list(config.ops)} does not hold 'zeros'"
        )
    return out
