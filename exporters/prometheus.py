"""Prometheus exporter: one HTTP endpoint per rank, updated only from the background worker.

The worker updates the metrics and renders the exposition text once per collected step; the HTTP
threads only hand out that pre-rendered page (one reference read, no lock shared with the worker), so
a scrape costs microseconds of interpreter time and never waits for, or on behalf of, training.

Endpoint: `http://{host}:{port}/metrics`, host 127.0.0.1 by default. Port: `prometheus.port` plus
LOCAL_RANK when the port is set, or a free port chosen by the OS when it is 0 (the default). The
address is logged and written to `{run_dir}/prometheus.json`, and a file_sd target file is written to
`{MONITOR_OUTPUT_DIR}/{sd_dir}/rank{R}-{run_id}.json` (removed again on close).

Series (every one labelled with `rank`):

    trainermon_info{run_id, version}                                    1
    trainermon_global_grad_norm                                         L2 norm of all reduced gradients
    trainermon_last_step, trainermon_last_step_timestamp_seconds         last collected step, when written
    trainermon_steps_collected_total
    trainermon_monitor_step_seconds                                     monitor time on the training thread
    trainermon_monitor_time_seconds_total                               the same, summed
    trainermon_layer_stat{family, layer, stat}                          per-layer aggregate of the last step
    trainermon_param_stat{family, layer, name, stat}                    per tensor (prometheus.per_parameter)
    trainermon_nonfinite_steps_total                                    collected steps with any NaN/Inf
    trainermon_anomalies_total{rule}                                    anomalies by rule
    trainermon_dropped_records_total, trainermon_monitor_faults_total
    trainermon_exporter_errors_total{exporter}, trainermon_series_dropped_total

Per-layer aggregation of the rows of one layer (all of its tensors and micro-batches): norm is the L2
norm of their concatenation, sqrt(sum norm^2); mean and zeros are element-weighted; min and max are
the extremes; nans and infs are sums.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from trainermon.records import StatBatch

from .base import Exporter, RunInfo

logger = logging.getLogger("trainermon")

NUMERIC_STATS = ("norm", "mean", "min", "max", "zeros", "nans", "infs")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Extras keys `anomalies_total.<rule>` carry the run's cumulative anomaly count of each rule.
ANOMALY_PREFIX = "anomalies_total."
#: Servers of this process by (host, port). A sink reopened with a fixed port while the old one is still
#: open (a dynamic config change opens the new sinks before closing the old ones) takes the server over.
_LIVE: dict[tuple[str, int], _MetricsServer] = {}
_LIVE_LOCK = threading.Lock()


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


def aggregate(
    groups: np.ndarray, count: int, values: dict[str, np.ndarray], stats: tuple[str, ...]
) -> dict[str, np.ndarray]:
    """Combine rows into `count` groups (row i belongs to group groups[i]) as the module doc says."""
    numel = np.asarray(values["numel"], dtype=np.float64)
    nans = np.asarray(values.get("nans", np.zeros_like(numel)), dtype=np.float64)
    infs = np.asarray(values.get("infs", np.zeros_like(numel)), dtype=np.float64)
    finite = np.maximum(numel - nans - infs, 0.0)
    out: dict[str, np.ndarray] = {}
    with np.errstate(invalid="ignore", divide="ignore"):
        for stat in stats:
            v = np.asarray(values[stat], dtype=np.float64)
            if stat == "norm":
                out[stat] = np.sqrt(np.bincount(groups, v * v, minlength=count))
            elif stat in ("mean", "zeros"):
                weight = finite if stat == "mean" else numel
                ok = np.isfinite(v) & (weight > 0)
                num = np.bincount(groups, np.where(ok, v * weight, 0.0), minlength=count)
                den = np.bincount(groups, np.where(ok, weight, 0.0), minlength=count)
                out[stat] = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
            elif stat in ("min", "max"):
                fill = np.inf if stat == "min" else -np.inf
                acc = np.full(count, fill)
                (np.fmin if stat == "min" else np.fmax).at(acc, groups, v)
                seen = np.bincount(groups, ~np.isnan(v), minlength=count) > 0
                out[stat] = np.where(seen, acc, np.nan)
            else:  # nans, infs
                out[stat] = np.bincount(groups, v, minlength=count)
    return out


class _Handler(BaseHTTPRequestHandler):
    server: _MetricsServer
    timeout = 10  # a stuck client cannot hold a server thread forever

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = self.server.page  # one atomic reference read; the worker swaps whole pages
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence per-request logs
        pass


class _MetricsServer(ThreadingHTTPServer):
    """One thread per connection (daemon: never holds up interpreter exit), each one tracked, so that
    `close_connections` can end them all, even one waiting on a client that never sends its request."""

    daemon_threads = True
    request_queue_size = 256  # dozens of concurrent scrapers must not overflow the listen backlog
    page: bytes = b""
    owner: object = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._active: dict[threading.Thread, socket.socket] = {}
        self._active_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self._serve_one, args=(request, client_address), name="trainermon-prometheus-request"
        )
        thread.daemon = True
        with self._active_lock:
            self._active[thread] = request
        thread.start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._active_lock:
                self._active.pop(threading.current_thread(), None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper that disconnects mid-response (or a connection ended by close) is not an error
        # worth a traceback on the job's stderr.
        logger.debug("trainermon: Prometheus request from %s failed", client_address, exc_info=True)

    def close_connections(self, timeout: float = 2.0) -> None:
        """End every open connection and join its thread (after `shutdown()`: no new ones come)."""
        with self._active_lock:
            active = dict(self._active)
        for request in active.values():
            try:
                request.shutdown(socket.SHUT_RDWR)  # a handler blocked reading its request returns now
            except OSError:
                pass
        end = time.monotonic() + timeout
        for thread in active:
            thread.join(max(0.0, end - time.monotonic()))


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
        self.per_parameter = bool(section.get("per_parameter", False))
        numeric_ops = tuple(s for s in NUMERIC_STATS if s in run.config.ops)
        self.stats = tuple(section.get("stats") or numeric_ops or ("norm",))
        families = section.get("families")
        self.families = set(families) if families else None
        self.max_series = int(section.get("max_series", 10_000))
        self.series = 0
        self._errors = None
        self._error_formats: list[str] = []
        self._last_dropped = 0.0
        self._last_faults = 0.0
        self._group_cache: dict[tuple[str, int, str], tuple[str, str]] = {}
        self._children: dict[tuple, Any] = {}
        self._over_budget_logged = False
        self._build_metrics(pc, run)

        host = section.get("host", "127.0.0.1")
        base = int(section.get("port", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        port = base + local_rank if base > 0 else 0
        self.sd_path: str | None = None
        with _LIVE_LOCK:
            server = _LIVE.get((host, port)) if port else None
            if server is None:
                # Binding fails here (port taken, bad address): the sink is disabled with one error and
                # training goes on.
                server = _MetricsServer((host, port), _Handler)
                thread = threading.Thread(
                    target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="trainermon-prometheus"
                )
                thread.daemon = True
                thread.start()
                _LIVE[(host, server.server_address[1])] = server
            server.owner = self
            server.page = self._render()
        self.server = server
        self.host = host
        self.port = server.server_address[1]
        self.discovery_error: OSError | None = None
        try:
            self._write_discovery(run, section, host)
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
        logger.info(
            "trainermon: Prometheus metrics of rank %d at http://%s:%d/metrics", run.rank, host, self.port
        )

    # ---- setup --------------------------------------------------------------------------------
    def _build_metrics(self, pc: Any, run: RunInfo) -> None:
        reg = self.registry = pc.CollectorRegistry(auto_describe=False)
        r = ("rank",)
        self.m_info = pc.Gauge(
            "trainermon_info", "trainermon run information", r + ("run_id", "version"), registry=reg
        )
        self.m_norm = pc.Gauge(
            "trainermon_global_grad_norm",
            "L2 norm of all reduced gradients of the last collected step (before clipping)",
            r,
            registry=reg,
        )
        self.m_step = pc.Gauge("trainermon_last_step", "Last collected optimizer step", r, registry=reg)
        self.m_step_ts = pc.Gauge(
            "trainermon_last_step_timestamp_seconds",
            "Unix time at which the last collected step was exported",
            r,
            registry=reg,
        )
        self.m_steps = pc.Counter("trainermon_steps_collected", "Collected steps exported", r, registry=reg)
        self.m_time = pc.Gauge(
            "trainermon_monitor_step_seconds",
            "Time the monitor spent on the training thread in the last collected step",
            r,
            registry=reg,
        )
        self.m_time_total = pc.Counter(
            "trainermon_monitor_time_seconds",
            "Time the monitor spent on the training thread, summed over collected steps",
            r,
            registry=reg,
        )
        self.m_layer = pc.Gauge(
            "trainermon_layer_stat",
            "Statistic of a layer's tensors in the last collected step (norm: L2 of all of them)",
            r + ("family", "layer", "stat"),
            registry=reg,
        )
        self.m_param = (
            pc.Gauge(
                "trainermon_param_stat",
                "Statistic of one parameter or module tensor in the last collected step",
                r + ("family", "layer", "name", "stat"),
                registry=reg,
            )
            if self.per_parameter
            else None
        )
        self.m_nonfinite = pc.Counter(
            "trainermon_nonfinite_steps",
            "Collected steps in which any statistic saw NaN or Inf",
            r,
            registry=reg,
        )
        self.m_anomalies = pc.Counter(
            "trainermon_anomalies", "Anomalies detected, by rule", r + ("rule",), registry=reg
        )
        self.m_dropped = pc.Counter(
            "trainermon_dropped_records",
            "Statistics rows dropped because the output queue was full",
            r,
            registry=reg,
        )
        self.m_faults = pc.Counter(
            "trainermon_monitor_faults",
            "Monitor-internal errors (caught; training unaffected)",
            r,
            registry=reg,
        )
        self.m_exporter_errors = pc.Counter(
            "trainermon_exporter_errors", "Failures of output sinks, by sink", r + ("exporter",), registry=reg
        )
        self.m_series_dropped = pc.Counter(
            "trainermon_series_dropped",
            "Series not exported because prometheus.max_series was reached",
            r,
            registry=reg,
        )
        from trainermon import __version__

        self.m_info.labels(self.rank, run.run_id, __version__).set(1)
        # Series that exist from the start, so that alerts and dashboards see 0 rather than nothing.
        for metric in (self.m_steps, self.m_time_total, self.m_nonfinite, self.m_dropped, self.m_faults):
            metric.labels(self.rank)
        for rule in run.config.alert.rules:
            name = rule.get("rule_name")
            if isinstance(name, str):
                self.m_anomalies.labels(self.rank, name)
        for fmt in run.config.format:
            self.m_exporter_errors.labels(self.rank, fmt)

    def _write_discovery(self, run: RunInfo, section: dict, host: str) -> None:
        advertise = section.get("advertise_host") or (
            socket.getfqdn() if host in ("0.0.0.0", "::", "") else host
        )
        target = f"{advertise}:{self.port}"
        os.makedirs(run.run_dir, exist_ok=True)
        info = {
            "url": f"http://{target}/metrics",
            "host": host,
            "port": self.port,
            "rank": run.rank,
            "run_id": run.run_id,
        }
        _atomic_json(os.path.join(run.run_dir, "prometheus.json"), info)
        sd_dir = section.get("sd_dir", "prometheus_sd")
        if sd_dir:
            directory = os.path.normpath(os.path.join(run.output_root, sd_dir))
            top = os.path.normpath(run.output_root)
            if os.path.commonpath([directory, top]) != top:  # the config refuses these; checked again
                raise ValueError(f"prometheus.sd_dir {sd_dir!r} is outside MONITOR_OUTPUT_DIR {top!r}")
            os.makedirs(directory, exist_ok=True)
            self.sd_path = os.path.join(directory, f"rank{run.rank}-{run.run_id}.json")
            _atomic_json(self.sd_path, [{"targets": [target], "labels": {"run_id": run.run_id}}])

    def attach_error_counts(self, errors: Any, formats: list[str]) -> None:
        """Called by build_exporters: the shared per-sink failure counts to export."""
        self._errors = errors
        if self.discovery_error is not None:
            errors.add(getattr(self, "format_name", "prometheus"))
        self._sync_errors()
        self._publish()

    # ---- worker thread ------------------------------------------------------------------------
    def write(self, batch: StatBatch) -> None:
        extras = batch.extras
        self.m_step.labels(self.rank).set(batch.step)
        self.m_step_ts.labels(self.rank).set(time.time())
        self.m_steps.labels(self.rank).inc()
        if "global_grad_norm" in extras:
            self.m_norm.labels(self.rank).set(extras["global_grad_norm"])
        if "monitor_time_ms" in extras:
            seconds = extras["monitor_time_ms"] / 1e3
            self.m_time.labels(self.rank).set(seconds)
            self.m_time_total.labels(self.rank).inc(max(seconds, 0.0))
        self._counter_to(self.m_dropped, extras.get("dropped_rows"), "_last_dropped")
        self._counter_to(self.m_faults, extras.get("monitor_faults"), "_last_faults")
        for key, value in extras.items():
            if key.startswith(ANOMALY_PREFIX):
                child = self._child(self.m_anomalies, (self.rank, key[len(ANOMALY_PREFIX) :]))
                if child is not None and value > child._value.get():
                    child.inc(value - child._value.get())
        if batch.rows:
            self._update_stats(batch)
        self._sync_errors()
        self._publish()

    def _publish(self) -> None:
        server = self.server
        if server is not None and server.owner is self:  # a successor may own the endpoint now
            server.page = self._render()

    def _counter_to(self, counter: Any, total: float | None, attr: str) -> None:
        """Advance a counter to a cumulative total reported by the core."""
        if total is None:
            return
        delta = float(total) - getattr(self, attr)
        if delta > 0:
            counter.labels(self.rank).inc(delta)
            setattr(self, attr, float(total))

    def _sync_errors(self) -> None:
        if self._errors is None:
            return
        for fmt, count in self._errors.snapshot().items():
            child = self.m_exporter_errors.labels(self.rank, fmt)
            delta = count - child._value.get()
            if delta > 0:
                child.inc(delta)

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

    def _update_stats(self, batch: StatBatch) -> None:
        rows = batch.rows
        keep = [i for i, r in enumerate(rows) if self.families is None or r.family in self.families]
        values = batch.values
        nonfinite = False
        for stat in ("nans", "infs"):
            if stat in values and np.any(values[stat] > 0):
                nonfinite = True
        if "norm" in values and not np.all(np.isfinite(values["norm"])):
            nonfinite = True
        if nonfinite:
            self.m_nonfinite.labels(self.rank).inc()
        if not keep:
            return
        idx = np.asarray(keep, dtype=np.int64)
        sub = {k: np.asarray(v)[idx] for k, v in values.items()}
        sub_rows = [rows[i] for i in keep]
        self._export_groups(self.m_layer, sub_rows, sub, per_parameter=False)
        if self.m_param is not None:
            self._export_groups(self.m_param, sub_rows, sub, per_parameter=True)

    def _export_groups(self, metric: Any, rows: list, values: dict, per_parameter: bool) -> None:
        index: dict[tuple, int] = {}
        labels: list[tuple] = []
        groups = np.empty(len(rows), dtype=np.int64)
        cache = self._group_cache
        for i, r in enumerate(rows):
            ck = (r.family, r.vpp_stage, r.name)
            hit = cache.get(ck)
            if hit is None:
                shown = f"{r.vpp_stage}:{r.name}" if r.vpp_stage else r.name
                hit = cache[ck] = (layer_of(r.name, r.vpp_stage), shown)
            layer, shown = hit
            key = (r.family, layer, shown) if per_parameter else (r.family, layer)
            g = index.get(key)
            if g is None:
                g = index[key] = len(labels)
                labels.append(key)
            groups[i] = g
        stats = tuple(s for s in self.stats if s in values)
        combined = aggregate(groups, len(labels), values, stats)
        dropped = 0
        for stat in stats:
            column = combined[stat]
            for g, key in enumerate(labels):
                child = self._child(metric, (self.rank, *key, stat))
                if child is None:
                    dropped += 1
                    continue
                child.set(float(column[g]))
        if dropped:
            self.m_series_dropped.labels(self.rank).inc(dropped)
            if not self._over_budget_logged:
                self._over_budget_logged = True
                logger.warning(
                    "trainermon: prometheus.max_series=%d reached on rank %s; further series are not "
                    "exported (counted in trainermon_series_dropped_total)",
                    self.max_series,
                    self.rank,
                )

    def _render(self) -> bytes:
        return self._pc.generate_latest(self.registry)

    # ---- shutdown -----------------------------------------------------------------------------
    def _stop_server(self) -> None:
        server = getattr(self, "server", None)
        if server is None:
            return
        self.server = None
        with _LIVE_LOCK:
            if server.owner is not self:
                return  # handed over to a newer sink of this process
            _LIVE.pop((self.host, self.port), None)
        server.shutdown()
        server.server_close()
        server.close_connections()

    def close(self) -> None:
        self._stop_server()
        if self.sd_path is not None:
            try:
                os.unlink(self.sd_path)  # the target is gone: Prometheus stops scraping it
            except FileNotFoundError:
                pass
            self.sd_path = None


def _atomic_json(path: str, body: Any) -> None:
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")  # not matched by a *.json file_sd glob
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(body, fh)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)  # a failed write (disk full) leaves no temporary file behind
        except OSError:
            pass
        raise
