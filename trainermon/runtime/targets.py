"""Nothing silent: configured targets and families that select nothing are named in a warning, once, with
the closest names that exist (difflib), at `set_monitor` and at each config reload.

- a target that no parameter name starts with and no module is named (any of their names: tied
  parameters and modules registered twice count under each); one that selects only frozen parameters
  (`requires_grad=False`, which have no rows) says so instead;
- a target that names only parameters while activations are collected (no module has that name), and
  one that names only modules without parameters while activations are off and a weight family is on;
- a family switched on (activations; gradients, optimizer state or parameters) that the targets leave
  with nothing at all;
- (at INFO) a msprobe-style target written with the wrapper path msprobe saw (`module.` of DDP), which
  selects nothing as written and is read without it (`selection.resolve_targets`);
- a target that selects parameters by a prefix ending inside a dotted part of their name (`layers.1`
  selects `layers.10.weight` too: prefixes are plain string prefixes, as in msprobe);
- switches that select nothing (`idle_switches`): no family on at all, `forward_only`/`backward_only`
  without activations, `monitor_mbs_grad` without gradients, `module_ranks` naming no rank of the job,
  `dynamic_on` without `DYNAMIC_MONITOR=true`, an alert rule whose family is off, `alert.escalate_steps`
  without rules, a `parquet`/`prometheus` section whose format is not on,
  `prometheus.families` naming only families that are off, and keys that cannot act (`inert_keys`: a rule
  whose statistics `ops` lacks, cc_distribution keys with `enable` false, CSV keys without CSV, `eps`
  without 'zeros').
"""

from __future__ import annotations

import difflib
import logging

from trainermon.collect.records import FAMILY_SWITCH
from trainermon.config import MonitorConfig

from .inert_keys import inert_keys
from .selection import (
    cuts_a_name,
    module_matches,
    named_modules,
    param_aliases,
    param_matches,
    resolve_targets,
)

logger = logging.getLogger("trainermon")
#: With the model split over ranks (pipeline stages, experts), a target may name another rank's part
_ELSEWHERE = " here (the model is split over ranks: it may name another stage's or rank's modules)"


def closest(word: str, names: list[str], n: int = 3) -> list[str]:
    """The names most like `word`; at least one when any exists (difflib's cutoff would give none)."""
    return difflib.get_close_matches(word, names, n=n, cutoff=0.6) or difflib.get_close_matches(
        word, names, n=n, cutoff=0.0
    )


def frozen_matching(adapter, target: str, squash: bool = False) -> list[str]:
    """Names of the frozen parameters of the model that `target` selects (the adapter lists trainable
    parameters only)."""
    from trainermon.names import clean_name

    out = []
    for vpp, root in enumerate(adapter.roots()):
        for name, p in root.named_parameters():
            if not p.requires_grad:
                full = adapter.global_name(vpp, clean_name(name))
                if param_matches(vpp, [full], target, squash):
                    out.append(full)
    return out


class TargetCheck:
    def __init__(self) -> None:
        self.said: set[str] = set()

    def check(self, adapter, config: MonitorConfig) -> None:
        if not config.targets:
            return  # no targets: every parameter and every module
        aliases = param_aliases(adapter)
        params = [(mp.vpp_stage, [mp.name, *aliases.get(id(mp.param), ())]) for mp in adapter.parameters()]
        modules = [(vpp, names) for vpp, names, _ in named_modules(adapter)]
        param_names = list(dict.fromkeys(n for _, names in params for n in names))
        module_names = list(dict.fromkeys(n for _, names in modules for n in names))
        collects_actv = config.collects_actv or config.collects_actv_grad
        # all_xy collects every module's activations whatever the targets say
        activations = collects_actv and not config.all_xy
        weights = config.collects_optimizer_side
        any_param = any_module = False
        unmatched = 0
        resolved = resolve_targets(adapter, config)
        for written in config.targets:
            target = resolved[written]
            if target != written:
                self._say(
                    f"target {written!r} names the model as msprobe sees it inside its wrappers; it selects "
                    f"{target!r} (trainermon's rows leave the wrapper path out)",
                    logging.INFO,
                )
            by_param = any(param_matches(vpp, names, target, config.squash_name) for vpp, names in params)
            by_module = any(module_matches(vpp, names, (target,)) for vpp, names in modules)
            any_param, any_module = any_param or by_param, any_module or by_module
            # a module name selects only activations: with them off and a weight family on, a module
            # without (trainable) parameters (nn.ReLU, nn.Dropout) gives the target no row at all
            idle_module = by_module and not by_param and weights and not collects_actv
            if (not by_param and not by_module) or idle_module:
                unmatched += 1
                frozen = frozen_matching(adapter, target, config.squash_name)
                if frozen:
                    self._say(
                        f"target {target!r} selects only frozen parameters (requires_grad=False), which "
                        f"have no rows: {frozen[:3]}{' ...' if len(frozen) > 3 else ''}"
                    )
                    continue
                if idle_module:
                    why = "print_struct is on" if config.xy_distribution else "xy_distribution is false"
                    self._say(
                        f"target {target!r} selects nothing: it names only modules without parameters, and "
                        f"activations are off ({why}), so no family writes a row for it"
                    )
                    continue
                here = " on this rank" if getattr(adapter, "splits_model", False) else ""
                self._say(
                    f"target {target!r} selects nothing{here}: no parameter name starts with it and no "
                    f"module has that name{_ELSEWHERE if here else ''}; closest: "
                    f"{closest(target, module_names + param_names)}"
                )
            if by_param and weights and (cut := cuts_a_name(params, target, config.squash_name)) is not None:
                alone, split = target + ".", getattr(adapter, "splits_model", False)
                prefix = f"target {target!r} selects parameters by name prefix (as msprobe does)"
                advice = f"{prefix}, so it also selects {cut!r}; end it with '.' ({alone!r}) to select"
                if any(param_matches(vpp, names, alone, config.squash_name) for vpp, names in params):
                    self._say(f"{advice} that module alone")
                elif by_module:  # '.' would select nothing: the module has no trainable parameter
                    self._say(
                        f"{prefix}: only other modules' ({cut!r}); module {target!r} has no trainable one"
                    )
                elif split:  # perhaps another stage's module
                    self._say(f"{advice} that module alone (no module {target!r} here{_ELSEWHERE})")
                else:
                    self._say(f"{prefix}, so it selects {cut!r}; no module is named {target!r}")
            if by_param and not by_module and activations:
                self._say(
                    f"target {target!r} names parameters but no module, so it has no actv/actv_grad rows "
                    f"(activations are selected by module name); closest modules: "
                    f"{closest(target, module_names)}"
                )
        if unmatched == len(config.targets):
            return  # every target is already named above
        wanted = sorted(config.targets)
        if activations and not any_module:
            self._say(
                f"actv/actv_grad: the targets {wanted} select no module; modules are named like "
                f"{module_names[:3]}"
            )
        if weights and not any_param:
            self._say(
                f"gradients/optimizer state/parameters: the targets {wanted} select no parameter; "
                f"parameters are named like {param_names[:3]}"
            )

    def check_switches(self, config: MonitorConfig, world_size: int, dynamic: bool) -> None:
        for message in idle_switches(config, world_size, dynamic):
            self._say(message)

    def _say(self, message: str, level: int = logging.WARNING) -> None:
        if message not in self.said:
            self.said.add(message)
            logger.log(level, "trainermon: %s", message)


#: The switches of output families (besides the statistics: `print_struct`, `stack_info`).
#: (`all_xy` is no family: it widens xy_distribution's targets to every module, and alone selects nothing.)
OUTPUT_SWITCHES = (
    "xy_distribution",
    "wg_distribution",
    "mv_distribution",
    "param_distribution",
    "update_distribution",
    "moe_distribution",
    "print_struct",
    "stack_info",
)


#: Alert rules that read the rows of one family only.
RULE_FAMILIES = {
    "AnomalyUpdateRatio": "update",
    "AnomalyExpertCollapse": "moe_load",
    "AnomalyLogitGrowth": "attn_logit",
}


def switch_is_on(config: MonitorConfig, switch: str) -> bool:
    """Whether a `FAMILY_SWITCH` value is on: a boolean key, or a section's `enable`."""
    value = getattr(config, switch)
    return value if isinstance(value, bool) else value.enable


def family_may_have_rows(config: MonitorConfig, family: str) -> bool:
    """Whether the config switches `family` on (activations also when an escalation may collect them)."""
    if family in ("actv", "actv_grad") and config.alert.escalate_steps > 0:
        return True
    return switch_is_on(config, FAMILY_SWITCH.get(family, "mv_distribution"))


def idle_switches(config: MonitorConfig, world_size: int, dynamic: bool) -> list[str]:
    """What the config switches on that can select nothing, one sentence each."""
    out = []
    activations = config.xy_distribution  # all_xy alone collects nothing (config.parse says so)
    on = [k for k in OUTPUT_SWITCHES if getattr(config, k)]
    if not on and not config.cc_distribution.enable and not config.attn_logit_distribution.enable:
        out.append(
            f"the config switches on no family, so nothing is collected: set one of {list(OUTPUT_SWITCHES)}, "
            "cc_distribution.enable or attn_logit_distribution.enable"  # all_xy alone: config.parse says why
        )
    for key in ("forward_only", "backward_only"):
        if getattr(config, key) and not activations:
            out.append(f"{key} has no effect: activations are off (xy_distribution is false)")
    if config.monitor_mbs_grad and not config.wg_distribution:
        out.append("monitor_mbs_grad has no effect: wg_distribution is false")
    missing = [r for r in config.module_ranks if r >= world_size]
    if missing and (activations or config.wg_distribution):
        alone = len(missing) == len(config.module_ranks)
        out.append(
            f"module_ranks {missing}: no such rank in this job of {world_size}"
            + (", so no rank collects actv/actv_grad/grad_unreduced" if alone else "")
        )
    for i, rule in enumerate(config.alert.rules):
        family = RULE_FAMILIES.get(rule.get("rule_name"))
        if family is not None and not family_may_have_rows(config, family):
            switch = FAMILY_SWITCH[family]
            switch += "" if isinstance(getattr(config, switch), bool) else ".enable"
            out.append(
                f"alert.rules[{i}] {rule['rule_name']} can never fire: it reads the {family} rows, "
                f"and {switch} is off"
            )
    if config.alert.escalate_steps and not config.alert.rules and not config.cc_distribution.enable:
        out.append(
            f"alert.escalate_steps {config.alert.escalate_steps} has no effect: no alert rule is "
            "configured (alert.rules is empty), so no anomaly ever starts an escalation"
        )
    for section in ("parquet", "prometheus"):
        if section not in config.format and getattr(config, section) != type(getattr(config, section))():
            out.append(
                f"the {section} section has no effect: format {list(config.format)} does not include "
                f"'{section}'"
            )
    out.extend(inert_keys(config))
    chosen = config.prometheus.families
    if "prometheus" in config.format and chosen and not any(family_may_have_rows(config, f) for f in chosen):
        out.append(
            f"prometheus.families {list(chosen)} selects no family the config switches on, so the endpoint "
            "has no per-tensor series"
        )
    if config.dynamic_on and not dynamic:
        out.append(
            "dynamic_on is set but DYNAMIC_MONITOR is not 'true': the config file is not watched and "
            "monitoring runs as configured from the start (msprobe's rule); export DYNAMIC_MONITOR=true "
            "to switch it from the file"
        )
    return out
