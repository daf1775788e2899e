"""The alert rules a config may name, the arguments each takes, and their validation (`parse_rules`).

Every key is checked: a misspelt argument or rule key would otherwise leave a rule on its defaults (or off)
without a word. The rules themselves are in `anomaly.py` and `health_rules.py`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

#: Rule name -> the arguments it reads (msprobe's two rules take `threshold` only).
RULE_ARGS: dict[str, tuple[str, ...]] = {
    "AnomalyTurbulence": ("threshold",),
    "AnomalyNan": ("threshold",),
    "AnomalySpike": ("window", "warmup", "z", "min_rel"),
    "AnomalyUpdateRatio": ("threshold", "window", "warmup", "z", "min_rel"),
    "AnomalyExpertCollapse": ("cv", "dead"),
    "AnomalyLogitGrowth": ("threshold", "growth"),
}
RULE_NAMES = tuple(RULE_ARGS)
#: Rule name -> the statistics of the config's `ops` it reads (it can fire on one of them only). The other
#: rules read columns the engine computes whatever `ops` holds (norm, nans/infs, ratio, load_cv, max).
RULE_OPS: dict[str, tuple[str, ...]] = {"AnomalyTurbulence": ("norm", "mean")}
#: The rolling windows' defaults (`AnomalySpike`, `AnomalyUpdateRatio`); a warmup is at least 2.
WINDOW, WARMUP = 50, 10


@dataclass(frozen=True)
class RuleSpec:
    name: str
    args: dict


def parse_rules(rules: Iterable[dict]) -> list[RuleSpec]:
    """Validate alert rules; raises ValueError naming the rule, the key, the value and what is allowed."""
    out = []
    for i, rule in enumerate(rules):
        where = f"alert.rules[{i}]"
        name = rule.get("rule_name")
        if not isinstance(name, str) or name not in RULE_ARGS:  # a list or object: unhashable
            raise ValueError(
                f"config key '{where}.rule_name': got {name!r}; allowed: one of {list(RULE_NAMES)}"
            )
        for key in rule:
            if key not in ("rule_name", "args"):
                raise ValueError(f"config key '{where}.{key}': unknown; allowed: 'rule_name' and 'args'")
        args = rule.get("args", {}) or {}
        if not isinstance(args, dict):
            raise ValueError(f"config key '{where}.args': got {args!r}; allowed: an object")
        for key, value in args.items():
            if key not in RULE_ARGS[name]:
                raise ValueError(
                    f"config key '{where}.args.{key}': got {value!r}; {name} takes no such argument; "
                    f"allowed: {list(RULE_ARGS[name])}"
                )
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(
                    f"config key '{where}.args.{key}': got {value!r}; allowed: a non-negative number"
                )
        if "window" in RULE_ARGS[name]:
            _check_window(where, args)
        _check_range(where, args)
        out.append(RuleSpec(name, dict(args)))
    return out


def _check_range(where: str, args: dict) -> None:
    """Arguments whose values past a bound make the rule useless: it could never fire (`dead` >= 1: the
    fraction of experts without a token is at most 1 and must exceed it), or would fire on every layer at
    its first step (`growth` < 1: a logit is above a fraction of itself)."""
    dead = args.get("dead")
    if dead is not None and dead >= 1:
        raise ValueError(
            f"config key '{where}.args.dead': got {dead!r}; allowed: a fraction of the experts, at least 0 "
            "and below 1 (the rule fires when more than that fraction got no token)"
        )
    z = args.get("z")
    if z is not None and z <= 0:
        raise ValueError(
            f"config key '{where}.args.z': got {z!r}; allowed: a positive number of robust deviations "
            "(default 6; 0 would fire on every value above the window's median)"
        )
    warmup = args.get("warmup")
    if warmup is not None and warmup < 2:
        raise ValueError(
            f"config key '{where}.args.warmup': got {warmup!r}; allowed: a whole number of at least 2 "
            "(default 10; a median and its spread need two values)"
        )
    growth = args.get("growth")
    if growth is not None and growth < 1:
        raise ValueError(
            f"config key '{where}.args.growth': got {growth!r}; allowed: at least 1 (a factor over the "
            "layer's first collected max logit; below 1 the first step itself would fire)"
        )


def _check_window(where: str, args: dict) -> None:
    """A rolling window shorter than the warmup never fills enough to judge: the rule could never fire."""
    for key in ("window", "warmup"):
        if key in args and args[key] != int(args[key]):
            raise ValueError(f"config key '{where}.args.{key}': got {args[key]!r}; allowed: a whole number")
    window, warmup = int(args.get("window", WINDOW)), max(2, int(args.get("warmup", WARMUP)))
    if window < warmup:
        raise ValueError(
            f"config key '{where}.args.window': got {window}; allowed: at least the warmup ({warmup}), "
            "else the window never holds enough values and the rule never fires"
        )
