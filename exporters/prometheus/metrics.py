"""The Prometheus series of one rank (every one labelled with `rank`), in their own registry."""

from __future__ import annotations

from typing import Any


def layer_of(name: str, vpp_stage: int = 0) -> str:
    """The layer a parameter or module name belongs to, for bounded-cardinality aggregates.

    The prefix up to the first numeric path component (`decoder.layers.12.mlp.fc1.weight` ->
    `decoder.layers.12`); without one, the name less its last component (`final_norm.weight` ->
    `final_norm`; `embedding.output` -> `embedding`), or the name itself. Virtual-pipeline chunks other
    than 0 are prefixed with `{vpp_stage}:` (msprobe's target syntax), since chunks number layers locally.
    """
    parts = name.split(".")
    layer = name
    for i, part in enumerate(parts):
        if part.isdigit():
            layer = ".".join(parts[: i + 1])
            break
    else:
        if len(parts) > 1:
            layer = ".".join(parts[:-1])
    return f"{vpp_stage}:{layer}" if vpp_stage else layer


class Metrics:
    """Gauges and counters of one rank; series that alerts and dashboards rely on exist from the start
    (at 0), rather than appearing with their first event."""

    def __init__(
        self,
        pc: Any,
        rank: str,
        run_id: str,
        per_parameter: bool,
        rules: list[str],
        formats: list[str],
        carry: Metrics | None = None,
    ) -> None:
        from trainermon import __version__

        reg = self.registry = pc.CollectorRegistry(auto_describe=False)
        r = ("rank",)

        def counter(attr: str, name: str, doc: str, labels: tuple[str, ...]) -> Any:
            # A sink reopened by a config reload (`carry`: the previous sink's metrics) keeps counting in
            # the same counters: Prometheus sees neither a reset nor the old totals arriving again.
            if carry is None:
                return pc.Counter(name, doc, labels, registry=reg)
            reg.register(getattr(carry, attr))
            return getattr(carry, attr)

        self.info = pc.Gauge(
            "trainermon_info", "trainermon run information", r + ("run_id", "version"), registry=reg
        )
        self.global_norm = pc.Gauge(
            "trainermon_global_grad_norm",
            "L2 norm of all reduced gradients of the last collected step (before clipping)",
            r,
            registry=reg,
        )
        self.collecting = pc.Gauge(
            "trainermon_collecting",
            "1 while steps are collected, 0 once collection stopped (dynamic_on off, collect_times reached)",
            r,
            registry=reg,
        )
        self.step = pc.Gauge("trainermon_last_step", "Last collected optimizer step", r, registry=reg)
        self.step_ts = pc.Gauge(
            "trainermon_last_step_timestamp_seconds",
            "Unix time at which the last collected step was exported",
            r,
            registry=reg,
        )
        self.steps = counter("steps", "trainermon_steps_collected", "Collected steps exported", r)
        self.skipped = counter(
            "skipped",
            "trainermon_skipped_steps",
            "Collected steps whose optimizer update was skipped (loss-scale overflow)",
            r,
        )
        self.time = pc.Gauge(
            "trainermon_monitor_step_seconds",
            "Time the monitor spent on the training thread in the last collected step",
            r,
            registry=reg,
        )
        self.time_total = counter(
            "time_total",
            "trainermon_monitor_time_seconds",
            "Time the monitor spent on the training thread, summed over collected steps",
            r,
        )
        self.layer = pc.Gauge(
            "trainermon_layer_stat",
            "Statistic of a layer's tensors in the last collected step (norm: L2 of all of them)",
            r + ("family", "layer", "stat"),
            registry=reg,
        )
        self.param = (
            pc.Gauge(
                "trainermon_param_stat",
                "Statistic of one parameter or module tensor in the last collected step",
                r + ("family", "layer", "name", "stat"),
                registry=reg,
            )
            if per_parameter
            else None
        )
        self.nonfinite = counter(
            "nonfinite",
            "trainermon_nonfinite_steps",
            "Collected steps in which any statistic saw NaN or Inf",
            r,
        )
        self.anomalies = counter(
            "anomalies", "trainermon_anomalies", "Anomalies detected, by rule", r + ("rule",)
        )
        self.dropped = counter(
            "dropped",
            "trainermon_dropped_records",
            "Statistics rows dropped because the output queue was full",
            r,
        )
        self.faults = counter(
            "faults",
            "trainermon_monitor_faults",
            "Monitor-internal errors (caught; training unaffected)",
            r,
        )
        self.exporter_errors = counter(
            "exporter_errors",
            "trainermon_exporter_errors",
            "Failures of output sinks, by sink",
            r + ("exporter",),
        )
        self.series_dropped = counter(
            "series_dropped",
            "trainermon_series_dropped",
            "Series not exported because prometheus.max_series was reached",
            r,
        )
        self.xrank = pc.Gauge(
            "trainermon_xrank_stat",
            "Cross-rank summary of a layer in the last collected step: max/min over ranks and their rank",
            r + ("family", "layer", "stat", "agg"),
            registry=reg,
        )
        self.xrank_nonfinite = pc.Gauge(
            "trainermon_xrank_nonfinite",
            "NaN and Inf elements of a layer over all ranks (count), and the lowest rank with any",
            r + ("family", "layer", "agg"),
            registry=reg,
        )
        self.info.labels(rank, run_id, __version__).set(1)
        self.collecting.labels(rank).set(1)
        counters = (self.steps, self.skipped, self.time_total, self.nonfinite, self.dropped, self.faults)
        for metric in (*counters, self.series_dropped):
            metric.labels(rank)
        for rule in rules:
            self.anomalies.labels(rank, rule)
        for fmt in formats:
            self.exporter_errors.labels(rank, fmt)


class Exposed:
    """A registry as the page shows it: without the counters' `{name}_created` samples, a series per
    counter and rank that Prometheus would store and nothing here reads (part of the series budget)."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def collect(self) -> Any:
        for metric in self.registry.collect():  # fresh objects on every call: safe to trim
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric
