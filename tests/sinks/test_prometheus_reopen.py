"""Prometheus sink: reopening a run, counters, skipped/escalation steps, families leaving the page."""

from __future__ import annotations

import json
import math
import socket

import numpy as np
import pytest
import torch

from tests.helpers import read_family
from tests.sinks.prometheus_common import scrape, train_step, url_of, value
from trainermon import TrainerMon, parse_config


def _free_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


def _batch(step: int, rows: int = 1, anomalies: dict | None = None):
    from trainermon.collect.records import Derived, RowMeta, StatBatch

    metas = [RowMeta("grad_reduced", 0, f"layers.{i}.w", None, (2,), torch.float32, 2) for i in range(rows)]
    vals = {k: np.ones(rows) for k in ("norm", "mean", "min", "max", "zeros", "numel")}
    return StatBatch(step=step, rows=metas, values=vals, derived=Derived(anomalies_total=anomalies or {}))


def test_a_reopened_sink_of_the_same_run_keeps_its_discovery_file_and_may_change_host(tmp_path, monkeypatch):
    """A reload that changes an output key reopens the sinks of the same run (same run id and rank): the
    new sink opens before the old one closes. The old one's close must not delete the file_sd target the
    new one wrote (same path), and a new host on the same fixed port must get the port, not fail on it."""
    from trainermon.exporters import RunInfo
    from trainermon.exporters.prometheus import PrometheusExporter

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    port = _free_port()
    sd = tmp_path / "prometheus_sd" / "rank0-run1.json"
    for old_host, new_host in (("127.0.0.1", "127.0.0.1"), ("127.0.0.1", "localhost")):
        configs = [
            parse_config({"prometheus": {"port": port, "host": host, "max_series": m}})
            for host, m in ((old_host, 100), (new_host, 200))
        ]
        old, new = PrometheusExporter(), PrometheusExporter()
        old.open(RunInfo(str(tmp_path / "a"), str(tmp_path), 0, 1, "run1", configs[0]))
        new.open(RunInfo(str(tmp_path / "b"), str(tmp_path), 0, 1, "run1", configs[1]))
        try:
            old.close()
            with open(sd) as fh:
                assert json.load(fh)[0]["targets"] == [f"{new_host}:{port}"], (old_host, new_host)
            new.write(_batch(5))
            assert value(scrape(f"http://{new_host}:{port}/metrics"), "trainermon_last_step") == 5
        finally:
            new.close()
        assert not sd.exists()  # the last sink of the run removes its target


def test_an_anomaly_rule_first_seen_past_the_series_budget_is_still_exported(tmp_path, monkeypatch):
    from trainermon.exporters import RunInfo
    from trainermon.exporters.prometheus import PrometheusExporter

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg = parse_config({"format": ["prometheus"], "prometheus": {"port": 0, "max_series": 4}})
    sink = PrometheusExporter()
    sink.open(RunInfo(str(tmp_path / "a"), str(tmp_path), 0, 1, "run1", cfg))
    try:
        sink.write(_batch(0, rows=8))  # the layer series use up the budget
        sink.write(_batch(1, rows=8, anomalies={"AnomalyNan": 3}))  # a rule added by a reload
        s = scrape(f"http://127.0.0.1:{sink.port}/metrics")
        assert value(s, "trainermon_series_dropped_total") > 0
        assert value(s, "trainermon_anomalies_total", rule="AnomalyNan") == 3
    finally:
        sink.close()


def _sink(tmp_path, run_id: str, port: int, sub: str):
    from trainermon.exporters import RunInfo
    from trainermon.exporters.prometheus import PrometheusExporter

    cfg = parse_config({"format": ["prometheus"], "prometheus": {"port": port}})
    sink = PrometheusExporter()
    sink.open(RunInfo(str(tmp_path / sub), str(tmp_path), 0, 1, run_id, cfg))
    return sink


def _derived_batch(
    step: int, families=("grad_reduced",), norm=1.0, skipped=None, scheduled=True, own_skip=False, **derived
):
    from trainermon.collect.records import Derived, RowMeta, StatBatch, StepScalars

    rows = [RowMeta(f, 0, "layers.0.w", None, (2,), torch.float32, 2) for f in families]
    vals = {k: np.ones(len(rows)) for k in ("mean", "min", "max", "zeros", "numel")}
    vals["norm"] = np.full(len(rows), norm)
    return StatBatch(
        step=step,
        rows=rows,
        values=vals,
        scalars=StepScalars(update_skipped=skipped, scheduled=scheduled, own_skip=own_skip),
        derived=Derived(**derived),
    )


def test_a_reopened_sink_of_the_same_run_continues_its_counters(tmp_path, monkeypatch):
    """A reload that changes an output key reopens the sinks (new before old closes). Counters must
    neither drop to 0 (a reset) nor receive the run's totals again: `increase()` would see anomalies,
    drops and faults that did not happen, and TrainermonAnomaly / TrainermonRecordsDropped would fire."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    port = _free_port()
    totals = {"anomalies_total": {"AnomalyNan": 4}, "dropped_rows": 2, "monitor_faults": 1}
    old = _sink(tmp_path, "run1", port, "a")
    new = None
    try:
        old.write(_derived_batch(0, **totals))
        want = {
            "trainermon_anomalies_total": 4,
            "trainermon_dropped_records_total": 2,
            "trainermon_monitor_faults_total": 1,
            "trainermon_steps_collected_total": 1,
        }

        def page() -> dict:
            s = scrape(f"http://127.0.0.1:{port}/metrics")
            return {k: value(s, k, **({"rule": "AnomalyNan"} if "anomal" in k else {})) for k in want}

        assert page() == want
        new = _sink(tmp_path, "run1", port, "b")
        assert page() == want  # the new sink's page, before its first step
        old.write(_derived_batch(1, **totals))  # a step queued before the reload, written late
        new.write(_derived_batch(2, **totals))
        old.close()
        assert page() == {**want, "trainermon_steps_collected_total": 3}
        new.write(_derived_batch(3, **{**totals, "anomalies_total": {"AnomalyNan": 5}}))
        assert page() == {**want, "trainermon_anomalies_total": 5, "trainermon_steps_collected_total": 4}
    finally:
        for sink in (old, new):
            if sink is not None:
                sink.close()


def test_series_of_families_no_longer_collected_leave_the_page(tmp_path, monkeypatch):
    """A reload that turns the gradients off: their layer gauges and the global norm must not stay at
    an old step's value while trainermon_last_step moves on."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    sink = _sink(tmp_path, "run1", 0, "a")
    try:
        url = f"http://127.0.0.1:{sink.port}/metrics"
        sink.write(_derived_batch(3, families=("grad_reduced", "param"), global_grad_norm=2.0))
        s = scrape(url)
        assert value(s, "trainermon_global_grad_norm") == 2.0
        assert value(s, "trainermon_layer_stat", family="grad_reduced", layer="layers.0", stat="norm") == 1.0
        sink.write(_derived_batch(7, families=("param",)))
        s = scrape(url)
        assert value(s, "trainermon_last_step") == 7
        assert value(s, "trainermon_layer_stat", family="param", layer="layers.0", stat="norm") == 1.0
        names = {(name, dict(labels).get("family")) for name, labels in s}
        assert ("trainermon_layer_stat", "grad_reduced") not in names
        assert ("trainermon_global_grad_norm", None) not in names
        sink.write(_derived_batch(8, families=("grad_reduced", "param"), global_grad_norm=3.0))
        s = scrape(url)  # back on: the series come back
        assert value(s, "trainermon_global_grad_norm") == 3.0
        assert value(s, "trainermon_layer_stat", family="grad_reduced", layer="layers.0", stat="norm") == 1.0
    finally:
        sink.close()


def test_a_skipped_update_counts_as_skipped_not_as_a_nonfinite_step(tmp_path, monkeypatch):
    """fp16 loss scaling skips a step when its gradients overflow: the scaler at work, not the critical
    TrainermonNonFinite page (TrainermonUpdatesSkipped watches the skips). Every counter an alert reads
    is on the page at 0 before its first event."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    sink = _sink(tmp_path, "run1", 0, "a")
    try:
        url = f"http://127.0.0.1:{sink.port}/metrics"
        s = scrape(url)
        for counter in ("skipped_steps", "series_dropped", "nonfinite_steps", "steps_collected"):
            assert value(s, f"trainermon_{counter}_total") == 0, counter
        sink.write(_derived_batch(0, norm=math.inf, skipped=True))
        s = scrape(url)
        assert value(s, "trainermon_skipped_steps_total") == 1
        assert value(s, "trainermon_nonfinite_steps_total") == 0
        sink.write(_derived_batch(1, norm=math.inf, skipped=False))
        assert value(scrape(url), "trainermon_nonfinite_steps_total") == 1
        # a loop that skipped its own step on NaN gradients (no scaler's step): non-finite, and its norm
        sink.write(_derived_batch(2, norm=math.nan, skipped=True, own_skip=True, global_grad_norm=math.nan))
        s = scrape(url)
        assert value(s, "trainermon_skipped_steps_total") == 2
        assert value(s, "trainermon_nonfinite_steps_total") == 2
        assert math.isnan(value(s, "trainermon_global_grad_norm"))
    finally:
        sink.close()


def test_an_escalation_only_step_leaves_the_other_families_on_the_page(tmp_path, monkeypatch):
    """An anomaly's escalation collects every module's activations on steps the schedule skips
    (`step_interval` > 1): those steps carry activations alone, which is no reason to drop the gradient
    series or the global norm."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    sink = _sink(tmp_path, "run1", 0, "a")
    try:
        url = f"http://127.0.0.1:{sink.port}/metrics"
        sink.write(_derived_batch(4, families=("grad_reduced", "actv"), global_grad_norm=2.0))
        sink.write(_derived_batch(5, families=("actv",), scheduled=False))
        s = scrape(url)
        assert value(s, "trainermon_last_step") == 5
        assert value(s, "trainermon_global_grad_norm") == 2.0
        assert value(s, "trainermon_layer_stat", family="grad_reduced", layer="layers.0", stat="norm") == 1.0
    finally:
        sink.close()


def test_a_skipped_update_leaves_the_global_norm_as_it_was(tmp_path, monkeypatch):
    """The scaler skips a step because its gradients overflowed: the global norm of that step is inf
    by design, and exporting it fired TrainermonGradNormSpike on every fp16 overflow."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    sink = _sink(tmp_path, "run1", 0, "a")
    try:
        url = f"http://127.0.0.1:{sink.port}/metrics"
        sink.write(_derived_batch(0, global_grad_norm=2.0))
        sink.write(_derived_batch(1, norm=math.inf, skipped=True, global_grad_norm=math.inf))
        s = scrape(url)
        assert value(s, "trainermon_global_grad_norm") == 2.0
        assert value(s, "trainermon_skipped_steps_total") == 1
    finally:
        sink.close()


def test_a_reopened_sink_on_an_ephemeral_port_keeps_its_address(tmp_path, monkeypatch):
    """With `prometheus.port` 0 (the default) a reopened sink bound a new port: a new scrape target
    whose carried counters the alerts' first-scrape term took for new NaNs and anomalies."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    old = _sink(tmp_path, "run1", 0, "a")
    new = other = None
    try:
        old.write(_derived_batch(0, anomalies_total={"AnomalyNan": 1}))
        new = _sink(tmp_path, "run1", 0, "b")
        assert new.port == old.port
        old.close()
        new.write(_derived_batch(1, anomalies_total={"AnomalyNan": 1}))
        s = scrape(f"http://127.0.0.1:{new.port}/metrics")
        assert value(s, "trainermon_anomalies_total", rule="AnomalyNan") == 1
        assert value(s, "trainermon_last_step") == 1
        other = _sink(tmp_path, "run2", 0, "c")  # another monitor's sink: an address of its own
        assert other.port != new.port
    finally:
        for sink in (old, new, other):
            if sink is not None:
                sink.close()


def test_a_second_monitor_on_a_taken_fixed_port_is_refused(tmp_path, monkeypatch):
    """A fixed port already serving another monitor of this process (another run id): the second sink
    took the endpoint over without a word, and the first monitor's series left the page. Now the port is
    taken for it, as for any other process; the first keeps serving."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    port = _free_port()
    first = _sink(tmp_path, "run1", port, "a")
    try:
        first.write(_derived_batch(3))
        with pytest.raises(OSError, match="another monitor of this process"):
            _sink(tmp_path, "run2", port, "b")
        s = scrape(f"http://127.0.0.1:{port}/metrics")
        assert value(s, "trainermon_last_step") == 3
        assert value(s, "trainermon_info", run_id="run1", version="0.1.0") == 1
    finally:
        first.close()


def test_a_none_output_is_not_a_nonfinite_step(tmp_path, monkeypatch):
    """A module output with a None element (nn.MultiheadAttention(need_weights=False) returns
    (out, None)) gets msprobe's NaN placeholder row in the CSV. Prometheus took it for a NaN: every step
    counted as non-finite (the critical alert on a healthy run) and the layer's norm was NaN."""
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(6, 2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mha(x[:, None], x[:, None], x[:, None], need_weights=False)[0][:, 0]

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = {"xy_distribution": True, "ops": ["norm", "nans", "infs"], "format": ["csv", "prometheus"]}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = nn.Sequential(Attention(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = TrainerMon(str(tmp_path / "cfg.json"))
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    try:
        for _ in range(3):
            train_step(model, opt, gen)
        mon.flush()
        s = scrape(url_of(mon))
    finally:
        mon.close()
    rows = read_family(mon.run_dir, "actv")
    placeholders = [r for r in rows if r["name"] == "0.mha.output_1"]
    assert len(placeholders) == 3 and all(r["norm"] == "nan" for r in placeholders)  # the case at hand
    assert value(s, "trainermon_nonfinite_steps_total") == 0
    norms = [
        v for (name, labels), v in s.items() if name == "trainermon_layer_stat" and ("stat", "norm") in labels
    ]
    assert norms and all(math.isfinite(v) for v in norms), norms


def test_the_page_is_rendered_when_scraped_not_at_every_step(tmp_path, monkeypatch):
    """Rendering the page costs ~10 ms of the worker's interpreter time at a few thousand series: it is
    done when a scrape asks, at most once per step written, and the page is always the latest step's."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    sink = _sink(tmp_path, "run1", 0, "a")
    renders = []
    render = sink._render
    monkeypatch.setattr(sink, "_render", lambda: renders.append(1) or render())
    try:
        url = f"http://127.0.0.1:{sink.port}/metrics"
        for step in range(50):
            sink.write(_derived_batch(step, global_grad_norm=float(step)))
        assert renders == []  # 50 steps, no scrape: no render
        s = scrape(url)
        assert value(s, "trainermon_last_step") == 49 and value(s, "trainermon_global_grad_norm") == 49.0
        scrape(url)
        assert len(renders) == 1  # nothing written since: the same page
        sink.write(_derived_batch(50, global_grad_norm=50.0))
        assert value(scrape(url), "trainermon_last_step") == 50 and len(renders) == 2
    finally:
        sink.close()
