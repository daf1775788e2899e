"""Prometheus exporter: one HTTP endpoint per rank (`server`), updated only from the background worker.

Endpoint: `http://{host}:{port}/metrics`, host 127.0.0.1 by default. Port: `prometheus.port` plus
LOCAL_RANK when the port is set, or a free port chosen by the OS when it is 0 (the default). The
address is written to `{run_dir}/prometheus.json` and said on stderr by local rank 0 (`discovery.announce`),
and a file_sd target file is written to `{MONITOR_OUTPUT_DIR}/{sd_dir}/rank{R}-{run_id}.json` with the
writer's pid and host; it is removed on close (and at interpreter exit), and a dead run's file of the
same rank (SIGKILL, SIGTERM: no handler is installed) when the next sink of that rank opens (`discovery`).

Series (every one labelled with `rank`):

    trainermon_info{run_id, version}                                    1
    trainermon_global_grad_norm                                         L2 norm of all reduced gradients
    trainermon_global_grad_norm_max        its largest over the collected steps of the last
                                       prometheus.max_window_s seconds, taken at render (`window.py`)
    trainermon_collecting                                               1, or 0 once collection stopped
    trainermon_last_step, trainermon_last_step_timestamp_seconds         last collected step, when written
    trainermon_steps_collected_total
    trainermon_monitor_step_seconds                                     monitor time on the training thread
    trainermon_monitor_time_seconds_total                               the same, summed
    trainermon_layer_stat{family, layer, stat}                          per-layer aggregate of the last step
                                       (per-rank families: only with per_rank, for targets, or one rank)
    trainermon_xrank_stat{family, layer, stat, agg}, trainermon_xrank_nonfinite{family, layer, agg}
                                       cross-rank summaries, on rank 0 only (`xrank.py`)
    trainermon_param_stat{family, layer, name, stat}                    per tensor (prometheus.per_parameter)
    (family `comm`: layer is "{op}/{group}/{input|output|calls}", the call sites of the op summed)
    trainermon_nonfinite_steps_total                                    collected steps with any NaN/Inf
    trainermon_anomalies_total{rule}                                    anomalies by rule
    trainermon_dropped_records_total, trainermon_monitor_faults_total
    trainermon_skipped_steps_total                                      collected steps with a skipped update
    trainermon_exporter_errors_total{exporter}, trainermon_series_dropped_total

Per-layer aggregation of the rows of one layer (all of its tensors and micro-batches) follows each
statistic's rule in the statistics table (`stats.table.combine`): norm is the L2 norm of their
concatenation, sqrt(sum norm^2); mean and zeros are element-weighted; min and max are the extremes;
nans and infs are sums.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from operator import attrgetter
from typing import Any

from trainermon.collect.records import StatBatch
from trainermon.stats.table import VALUE_STATS

from ..base import Exporter, RunInfo
from . import discovery, layers, xrank
from . import server as http
from .address import advertised_host
from .layers import aggregate
from .metrics import Exposed, Metrics, layer_of
from .window import WindowMax, WindowMaxGauge

__all__ = ["PrometheusExporter", "aggregate", "layer_of"]

logger = logging.getLogger("trainermon")


class PrometheusExporter(Exporter):
    def open(self, run: RunInfo) -> None:
        try:
            import prometheus_client as pc
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the prometheus format needs prometheus_client: pip install 'trainermon[prometheus]'"
            ) from exc
        self._pc = pc
        section = run.config.prometheus
        self.run = run
        self.rank = str(run.rank)
        self.per_parameter = section.per_parameter
        numeric_ops = tuple(s for s in VALUE_STATS if s in run.config.ops)
        self.stats = tuple(section.stats or numeric_ops or ("norm",))
        self.families = set(section.families) if section.families else None
        # The series budget: each rank's own rows (per-rank families) only on request, for `targets`, or
        # with one rank; otherwise rank 0's cross-rank summaries (trainermon_xrank_*) stand for them.
        self.all_per_rank = section.per_rank or run.world_size == 1
        self.targets = tuple(run.config.targets)
        self._targeted: dict[str, bool] = {}
        self.max_series = section.max_series
        self.series = 0
        self._errors = None
        self._errors_seen: dict[str, int] = {}
        self._families: set[str] = set()
        self._group_cache: dict[tuple[str, int, str], tuple[str, str]] = {}
        self._children: dict[tuple, Any] = {}
        self._over_budget_logged = False
        rules = [r["rule_name"] for r in run.config.alert.rules if isinstance(r.get("rule_name"), str)]
        # this monitor's sinks (run and rank): a reopened one takes the port and the counters over
        self.group = (run.run_id, run.rank)
        previous = NEWEST.get(self.group)
        self.m = Metrics(
            pc, self.rank, run.run_id, self.per_parameter, rules, list(run.config.format), previous
        )
        NEWEST[self.group] = self.m
        self.exposed = Exposed(self.m.registry)
        self._lock = threading.Lock()  # a step's gauge updates, or a render of the page: never both
        self._rendered: bytes | None = None  # the page as of the last step written (None: stale)
        # trainermon_global_grad_norm_max: fed on the worker, its value taken when a scrape renders
        self.norm_max = WindowMax(section.max_window_s)
        self._shown_max: float | None = None  # its value on the page rendered last
        self._stopped = False  # collection stopped (`collection_stopped`) and no collected step since
        self.m.registry.register(WindowMaxGauge(NORM_MAX, NORM_MAX_DOC, self.rank, self.norm_max))

        host = section.host
        port = section.port + run.local_rank if section.port > 0 else 0
        self.sd_path: str | None = None
        # Binding fails here (port taken, bad address): the sink is disabled with one error and training
        # goes on.
        try:
            self.server: http.MetricsServer | None = http.start(host, port, self, self._page, self.group)
        except OSError as exc:  # say which address, and where the port came from
            raise OSError(
                exc.errno,
                f"cannot serve rank {run.rank}'s metrics at {host}:{port} (prometheus.port "
                f"{section.port} + {run.local_rank_from or 'local rank'} {run.local_rank}): "
                f"{exc.strerror or exc}",
            ) from exc
        self.host = host
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}/metrics"  # the advertised one once the files are written
        self.discovery_error: OSError | None = None
        try:
            self._write_discovery(run, host)
        except OSError as exc:
            # The endpoint does not need its discovery files (an unwritable or full output directory):
            # it keeps serving; the failure is logged once and counted as an error of this sink.
            self.discovery_error = exc
            logger.error(
                "trainermon: could not write the Prometheus discovery files of rank %d (%s: %s); the "
                "endpoint is still served at http://%s:%d/metrics",
                run.rank,
                type(exc).__name__,
                exc,
                host,
                self.port,
            )
        except Exception:
            self._stop_server()
            raise
        if run.local_rank == 0:  # one line per node: the others are in prometheus.json
            sd_dir = os.path.dirname(self.sd_path) if self.sd_path else None
            discovery.announce(self.url, run.rank, sd_dir, run.run_dir)
        else:
            logger.info("trainermon: Prometheus metrics of rank %d at %s", run.rank, self.url)

    def _write_discovery(self, run: RunInfo, host: str) -> None:
        section = run.config.prometheus
        advertise = advertised_host(host, section.advertise_host, run.advertise_host)
        target = f"{advertise}:{self.port}"
        self.url = f"http://{target}/metrics"
        os.makedirs(run.run_dir, exist_ok=True)
        writer = discovery.writer_labels()
        info = {
            "url": self.url,
            "host": host,
            "port": self.port,
            "rank": run.rank,
            "run_id": run.run_id,
            "pid": os.getpid(),
            "node": writer[discovery.HOST_LABEL],
        }
        http.atomic_json(os.path.join(run.run_dir, "prometheus.json"), info)
        if section.sd_dir:
            directory = os.path.normpath(os.path.join(run.output_root, section.sd_dir))
            top = os.path.normpath(run.output_root)
            if os.path.commonpath([directory, top]) != top:  # the config refuses these; checked again
                raise ValueError(
                    f"prometheus.sd_dir {section.sd_dir!r} is outside MONITOR_OUTPUT_DIR {top!r}"
                )
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"rank{run.rank}-{run.run_id}.json")
            # an earlier run's file of this rank (its process killed) would keep a dead or reused address
            discovery.remove_stale(directory, run.rank, path, target, run.world_size, run.local_rank)
            self.sd_path = path
            # The writer (pid, host) in a second group without targets: Prometheus makes no target of it,
            # and the rank's group keeps the one label every series gets.
            groups = [
                {"targets": [target], "labels": {"run_id": run.run_id}},
                {"targets": [], "labels": writer},
            ]
            http.write_target(path, groups, self)

    def attach_error_counts(self, errors: Any, formats: list[str]) -> None:
        """Called by build_exporters: the shared per-sink failure counts to export."""
        with self._lock:
            self._errors = errors
            if self.discovery_error is not None:
                errors.add(getattr(self, "format_name", "prometheus"))
            self._sync_errors()
            self._publish()

    # ---- worker thread ------------------------------------------------------------------------
    def write(self, batch: StatBatch) -> None:
        with self._lock:  # a scrape renders between steps, never in the middle of one
            self._write(batch)

    def _write(self, batch: StatBatch) -> None:
        m, rank, derived = self.m, self.rank, batch.derived
        m.step.labels(rank).set(batch.step)
        m.step_ts.labels(rank).set(time.time())
        m.steps.labels(rank).inc()
        if batch.scalars.update_skipped:
            m.skipped.labels(rank).inc()
        # A job-wide value: from rank 0 only (every rank of a split model has it: one series is enough).
        # Not on a step the loss scaler skipped (its norm is inf or NaN by design: TrainermonUpdatesSkipped
        # watches those, and GradNormSpike would fire on each); a loop's own skip (`own_skip`) is set.
        if (self.run.rank == 0 or self.run.world_size == 1) and not batch.scalars.scaler_skip:
            if derived.global_grad_norm is not None:
                m.global_norm.labels(rank).set(derived.global_grad_norm)
                self.norm_max.add(float(derived.global_grad_norm))
            elif batch.scalars.scheduled and (rank,) in m.global_norm._metrics:  # no longer collected
                m.global_norm.remove(rank)
                self.norm_max.clear()
        if batch.scalars.scheduled:
            m.collecting.labels(rank).set(1)
            self._stopped = False
        # After collection stopped, an escalation step (activations after an anomaly) is counted but
        # puts no step values back on the page: no later collected step would take them off again.
        gauges = not self._stopped
        seconds = batch.scalars.monitor_time_ms / 1e3
        if gauges:
            m.time.labels(rank).set(seconds)
        m.time_total.labels(rank).inc(max(seconds, 0.0))
        self._counter_to(m.dropped, derived.dropped_rows)
        self._counter_to(m.faults, derived.monitor_faults)
        for rule, total in derived.anomalies_total.items():
            # Outside the series budget: a handful of rules, and the one series an alert waits for
            child = m.anomalies.labels(rank, rule)
            if total > child._value.get():
                child.inc(total - child._value.get())
        families = set(map(_FAMILY, batch.rows))
        if batch.rows:
            layers.update_stats(self, batch, gauges)
        if gauges and batch.xrank is not None and batch.xrank.rows:
            families.update(row[0] for row in batch.xrank.rows)
            self._count_dropped(xrank.export(self, batch.xrank))
        if batch.scalars.scheduled:  # an escalation-only step collects activations alone: keep the rest
            self._retire(self._families - families)
            self._families = families
        self._sync_errors()
        self._publish()

    def _publish(self) -> None:
        self._rendered = None  # rendered at the next scrape (`_page`)

    def collection_stopped(self) -> None:
        """The worker's signal that collection stopped (dynamic_on switched off, collect_times reached):
        the gauges of a step's values leave the page rather than keep the last collected step's values
        (a flat, healthy-looking line), and trainermon_collecting goes to 0 until the next collected step.
        The last step, its timestamp and the counters stay."""
        with self._lock:
            m, rank = self.m, self.rank
            self._stopped = True
            m.collecting.labels(rank).set(0)
            for gauge in (m.global_norm, m.time):
                if (rank,) in gauge._metrics:
                    gauge.remove(rank)
            self.norm_max.clear()
            self._retire({labels[1] for _, labels in self._children})  # every family's
            self._families = set()
            self._publish()

    def _page(self) -> bytes:
        """The page a scrape gets (on an HTTP thread): rendered at most once per step written, and again
        when the window of trainermon_global_grad_norm_max moved past its largest value."""
        with self._lock:
            top = self.norm_max.current()
            if top != self._shown_max:  # a new step's norm, or the window moved past the largest
                self._shown_max = top
                self._rendered = None
            page = self._rendered
            if page is None:
                page = self._rendered = self._render()
            return page

    def _counter_to(self, counter: Any, total: int) -> None:
        """Advance a counter to a cumulative total of the monitor's (the counter may be a predecessor's)."""
        child = counter.labels(self.rank)
        delta = total - child._value.get()
        if delta > 0:
            child.inc(delta)

    def _sync_errors(self) -> None:
        # The counts are this set of sinks' own (a reload builds new sinks): add what is new since the
        # last look, to counters that may hold a predecessor's counts too.
        if self._errors is None:
            return
        for fmt, count in self._errors.snapshot().items():
            delta = count - self._errors_seen.get(fmt, 0)
            if delta > 0:
                self.m.exporter_errors.labels(self.rank, fmt).inc(delta)
                self._errors_seen[fmt] = count

    def _retire(self, families: set[str]) -> None:
        """Remove the series of families the last collected step no longer produced (a reload turned
        them off): a gauge left at an old step's value would read as current."""
        if not families:
            return
        for key in [k for k in self._children if k[1][1] in families]:
            metric, labels = key
            metric.remove(*labels)
            del self._children[key]
            self.series -= 1

    def _child(self, metric: Any, labels: tuple) -> Any:
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            if self.series >= self.max_series:
                return None
            child = metric.labels(*labels)
            self._children[key] = child
            self.series += 1
        return child

    def _is_target(self, name: str) -> bool:
        hit = self._targeted.get(name)
        if hit is None:
            hit = self._targeted[name] = any(name == t or name.startswith(t + ".") for t in self.targets)
        return hit

    def _count_dropped(self, dropped: int) -> None:
        if dropped:
            self.m.series_dropped.labels(self.rank).inc(dropped)
            if not self._over_budget_logged:
                self._over_budget_logged = True
                logger.warning(
                    "trainermon: prometheus.max_series=%d reached on rank %s; further series are not "
                    "exported (counted in trainermon_series_dropped_total)",
                    self.max_series,
                    self.rank,
                )

    def _render(self) -> bytes:
        return self._pc.generate_latest(self.exposed)

    # ---- shutdown -----------------------------------------------------------------------------
    def _stop_server(self) -> None:
        server = getattr(self, "server", None)
        if server is None:
            return
        self.server = None
        http.stop(server, self, self.host, self.port)

    def close(self) -> None:
        if NEWEST.get(self.group) is self.m:
            del NEWEST[self.group]
        self._stop_server()
        if self.sd_path is not None:
            http.remove_target(self.sd_path, self)
            self.sd_path = None


_FAMILY = attrgetter("family")
NORM_MAX = "trainermon_global_grad_norm_max"
NORM_MAX_DOC = (
    "Largest global gradient norm of the collected steps of the last prometheus.max_window_s seconds "
    "(a spike of one step stays on the page that long)"
)

#: The metrics of the newest sink of each monitor (run id, rank): the counters a reopened sink continues.
NEWEST: dict[tuple, Metrics] = {}
