"""How a `StepLoop` changes its config: rank 0's config on every rank at attach, and in dynamic mode the
watched file's new versions, applied on every rank at the same step (`DynamicControl`). A base of
`StepLoop` (the attributes it uses are the loop's)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from trainermon.config import ConfigError, MonitorConfig, parse_config
from trainermon.pipeline.rule_specs import parse_rules
from trainermon.stats.engine import EngineOptions

from .control import agree_config
from .plan import Schedule

logger = logging.getLogger("trainermon")
#: Keys read when the monitor starts (the worker's queue, the file watcher): an edit in dynamic mode waits.
FIXED_AT_START = ("queue_size", "dynamic_watch")


def engine_options(config: MonitorConfig) -> EngineOptions:
    return EngineOptions(
        nonfinite=config.wants_nonfinite,
        zeros_eps=config.eps if config.wants_zeros else None,
        nan_only=config.wants_nan_only,
    )


class ConfigChanges:
    """`StepLoop`'s config changes (the loop's `config`, `control`, `engine`, `schedule`, sinks, ...)."""

    config: MonitorConfig
    control: Any
    xy_override: bool | None  # `reload_xy` called before set_monitor
    off_by_file: bool = False  # the watched file's last reload switched collection off

    def _agree_config(self) -> None:
        """At attach, before the sinks open: rank 0's config on every rank (collective over the job)."""
        if self.control is not None:
            # Collective over the whole job, never `process_group` (msprobe's Megatron insertion passes the
            # pipeline group, a single rank with PP=1): ranks that switch at different steps meet in
            # different collectives and the job hangs. The first poll hands rank 0's config to every rank
            # before a restored count (else: a hang) and before the sinks open (else a rank whose copy
            # of the file differs would renew its run directory at once).
            self.control.attach(None)
            self._poll_control(applied=False)
        elif self.xrank.cpu_group is not None and self._raw is not None:
            # a rank whose file differs would meet the others in collectives of other sizes: a crash
            agreed = agree_config(self._raw, self.xrank.cpu_group)
            if self.rank != 0 and agreed != self._raw:
                try:
                    self._adopt(parse_config(agreed, source=self._config_path))
                except ConfigError as exc:
                    self.faults.record("rank 0's config", exc, "this rank keeps its own")

    def _poll_control(self, applied: bool = True) -> None:
        """`applied`: the current config is published (probes, sinks); else a new one only replaces it."""
        raw = self.control._raw  # noqa: SLF001 - the mapping running now, restored if a reload fails
        try:
            new = self.control.poll()
        except Exception as exc:  # noqa: BLE001
            self.faults.record("dynamic control", exc)
            new = None
        if new is not None and applied:
            self._reload_everywhere(new, raw)
        elif new is not None:
            self._adopt(new)

    def _reload_everywhere(self, config: MonitorConfig, raw: Any) -> None:
        """`_reload(config)` on every rank, or where it fails on any rank, every rank back on the config it
        ran (its count toward collect_times kept): ranks with different probes would meet in different
        collectives (a hang). Collective, at a new version only: one all-reduce of one int64 (twice after a
        failure)."""
        old, schedule, off = self.config, self.schedule, self.off_by_file
        if self._all_ok(self._try_reload(config)):
            return
        control = self.control
        control._raw, control.config = raw, old  # noqa: SLF001 - saving the file again is news (a retry)
        if self._all_ok(self._try_reload(old)):
            self.schedule, self.off_by_file = schedule, off
            logger.warning(
                "trainermon: a rank could not apply the config file's new version; every rank keeps the "
                "previous config (save the file again to retry)"
            )
        else:  # not even that everywhere: no rank collects until the next version
            self.config, self.off_by_file = dataclasses.replace(self.config, dynamic_on=False), True
            logger.warning("trainermon: a config reload failed on a rank; collection is off on every rank")

    def _try_reload(self, config: MonitorConfig) -> bool:
        try:
            self._reload(config)
        except Exception as exc:  # noqa: BLE001 - agreed with the other ranks (`_reload_everywhere`)
            self.faults.record("config reload", exc, "every rank keeps the previous config")
            return False
        return True

    def _all_ok(self, ok: bool) -> bool:
        """`ok` on every rank of the dynamic-control group (one all-reduce; none with one rank)."""
        group = getattr(self.control, "_group", None)
        if group is None:
            return ok
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(ok)], dtype=torch.int64)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        except Exception as exc:  # noqa: BLE001 - a peer gone: never into the training loop
            self.faults.record("config reload", exc, "no agreement: taken as failed")
            return False
        return bool(flag.item())

    def _adopt(self, config: MonitorConfig) -> None:
        """Before anything is published (probes, sinks): rank 0's config (or on rank 0, the file edited
        since `TrainerMon()` read it) replaces this rank's own; a `reload_xy` made before stays."""
        if self.xy_override is not None:
            config = dataclasses.replace(config, xy_distribution=self.xy_override)
        if self.control is not None:  # the watcher exists already (the worker, with its queue, not yet)
            config = self._keep_running(config, ("dynamic_watch",))
        if config == self.config:
            return
        if self.rank == 0:
            logger.info("trainermon: the config file changed since TrainerMon() read it; the new one applies")
        elif getattr(self, "_raw", True) is not None:  # None: this rank had no file of its own (told then)
            differ = [
                f.name
                for f in dataclasses.fields(config)
                if getattr(config, f.name) != getattr(self.config, f.name)
            ]
            logger.warning(
                "trainermon: rank %d's config file differs from rank 0's (keys %s); rank 0's config applies",
                self.rank,
                ", ".join(differ),
            )
        self.config, self.engine.options = config, engine_options(config)
        self.schedule = Schedule(config, anchored=self.control is not None and config.dynamic_on)

    def _keep_running(self, config: MonitorConfig, keys: tuple[str, ...]) -> MonitorConfig:
        """`config` with the running values of `keys` (read when the monitor started); said when the file
        itself sets another value (a key it omits reads as the default: nothing to say)."""
        fixed = {k: getattr(self.config, k) for k in keys if getattr(config, k) != getattr(self.config, k)}
        raw = getattr(self.control, "_raw", None)
        said = {k: v for k, v in fixed.items() if not isinstance(raw, dict) or k in raw}
        if said:
            logger.warning(
                "trainermon: the watched config file sets %s, read at start only: it applies at the next "
                "start; this run keeps %s",
                ", ".join(f"{k}={getattr(config, k)!r}" for k in said),
                ", ".join(f"{k}={v!r}" for k, v in said.items()),
            )
        return dataclasses.replace(config, **fixed) if fixed else config

    def _reload(self, config: MonitorConfig) -> None:
        """Dynamic mode: a new config from the watched file, applied on every rank at this same step."""
        old = self.config
        config = self._keep_running(config, FIXED_AT_START)
        self.engine.options = engine_options(config)
        self.schedule = Schedule(config, anchored=config.dynamic_on)  # restarts the count, from this step
        self.detector.rules = parse_rules(config.alert.rules)
        self.detector.dump = config.alert.dump
        self.detector.ops = config.ops
        # switched off in the file: no escalation either (one in progress ends; requests the worker makes
        # meanwhile wait, and the next reload drops them), as `dynamic_on: false` stops a collection
        self.escalation.clear()
        self.off_by_file = not config.dynamic_on
        self._publish(config)
        if self.worker is not None:
            self.worker.set_interval(config.write_interval_s)
            if any(getattr(old, k) != getattr(config, k) for k in MonitorConfig.OUTPUT_KEYS):
                stamp = self.control.stamp if self.control is not None else None  # rank 0's clock
                self.worker.replace_exporters(self.outputs.renew(config, stamp))  # new columns or sinks
            if not config.dynamic_on:  # (after a swap: the new sinks hear it)
                self.worker.collection_stopped()
        logger.info(
            "trainermon: config reloaded at step %d: dynamic_on=%s, collect_times=%d",
            self.step,
            config.dynamic_on,
            config.collect_times,
        )
