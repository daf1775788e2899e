"""Reliability under faults (issue 11), failing and slow sinks: a disk that fills up mid-run, an output
directory that cannot be written, a filesystem too slow to keep up. Training goes on unchanged; each
failure is logged once and counted, and nothing is lost silently.

docs/RELIABILITY.md lists every test, its measured result, and the defects these tests found.
"""

from __future__ import annotations

import builtins
import errno
import io
import logging
import math
import os
import statistics
import threading
import time
from pathlib import Path

import pytest
import torch

import trainermon.exporters.csv as csv_mod
import trainermon.exporters.row_file as row_file_mod
from tests.helpers import read_family, write_config
from tests.reliability.faults import _exporter, _scrape, _small_model, _steps, csv_problems
from trainermon import TrainerMon
from trainermon.collect.records import FAMILIES


class _FullDisk:
    """A filesystem whose free space can run out: writes beyond `free` bytes are cut short, then fail
    with ENOSPC, as a real full disk does (a short write, then an error)."""

    def __init__(self) -> None:
        self.free = float("inf")
        self.failures = 0

    def open(self, path, mode="r", buffering=-1, encoding=None, newline=None, **kwargs):
        disk = self

        class Raw(io.RawIOBase):
            def __init__(self) -> None:
                self.f = io.FileIO(path, mode.replace("b", "").replace("t", ""))

            def writable(self) -> bool:
                return True

            def fileno(self) -> int:
                return self.f.fileno()

            def write(self, b) -> int:
                if disk.free <= 0:
                    disk.failures += 1
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                n = int(min(len(b), disk.free))
                written = self.f.write(bytes(b[:n]))
                disk.free -= written
                return written

            def close(self) -> None:
                self.f.close()
                super().close()

        if "b" in mode:
            return Raw() if buffering == 0 else io.BufferedWriter(Raw())
        return io.TextIOWrapper(io.BufferedWriter(Raw()), encoding=encoding or "utf-8", newline=newline)


def _enospc_run(tmp_path, monkeypatch, caplog, healthy_steps: int = 3, steps: int = 8):
    """CSV on a disk that fills up after `healthy_steps` steps; Parquet and Prometheus elsewhere."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "cfg.json",
        xy_distribution=True,
        wg_distribution=True,
        param_distribution=True,
        ops=["norm", "min", "max", "mean", "nans"],
        ndigits=17,
        format=["csv", "parquet", "prometheus"],
        parquet={"steps_per_part": 2},
    )
    disk = _FullDisk()
    monkeypatch.setattr(row_file_mod, "open", disk.open, raising=False)  # the CSV files' own open()
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    port = _exporter(mon, "PrometheusExporter").port
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        losses = _steps(model, opt, healthy_steps)
        mon.flush()
        disk.free = 150  # the next write gets 150 bytes onto the disk, then ENOSPC: a row cut short
        losses += _steps(model, opt, steps - healthy_steps, seed=1)
        mon.flush()
        scraped = _scrape(port)
        mon.close()
    return mon, disk, losses, scraped


def test_disk_full_mid_run(tmp_path, monkeypatch, caplog):
    import trainermon as tm

    mon, disk, losses, scraped = _enospc_run(tmp_path, monkeypatch, caplog)
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)  # training went on
    # One error line for the failing sink, one fault counted, the sink disabled after its first failure.
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "CsvExporter" in errors[0].getMessage(), [r.getMessage() for r in errors]
    assert "No space left on device" in errors[0].getMessage() and "disabled" in errors[0].getMessage()
    assert dict(mon.faults.counts) == {"exporter CsvExporter": 1}
    assert disk.failures == 1
    assert scraped[("trainermon_exporter_errors_total", (("exporter", "csv"),))] == 1
    assert scraped[("trainermon_exporter_errors_total", (("exporter", "parquet"),))] == 0
    assert scraped[("trainermon_monitor_faults_total", ())] == 1
    assert scraped[("trainermon_last_step", ())] == 7  # the other sinks saw every step
    # Parquet has every step; the CSV rows written before the disk filled are intact and equal to it.
    table = tm.load(tmp_path / "out")
    assert sorted(set(table.column("step").to_pylist())) == list(range(8))
    parquet = {
        (r["family"], r["name"], r["step"], r["micro_step"] or 0): r["norm"] for r in table.to_pylist()
    }
    healthy = 0
    for family in FAMILIES:
        for row in read_family(mon.run_dir, family):
            if not row["name"] or row.get("dtype") is None:
                continue  # the row cut short by the full disk (see the next test)
            key = (family, row["name"], int(row["step"]), int(row.get("micro_step") or 0))
            if int(row["step"]) < 3:
                assert float(row["norm"]) == parquet[key], key
                healthy += 1
    per_step = len([k for k in parquet if k[2] == 0])
    assert healthy == 3 * per_step  # every row of every step before the fault
    print(f"\ndisk full: {healthy} CSV rows before the fault intact, Parquet has all 8 steps")


def test_disk_full_leaves_no_partial_row(tmp_path, monkeypatch, caplog):
    mon, *_ = _enospc_run(tmp_path, monkeypatch, caplog)
    assert csv_problems(mon.run_dir) == []


def _deny_writes_under(monkeypatch, root: Path) -> None:
    """Make `root` unwritable. The permission bits do it for a normal user; root ignores them, so for
    root the same EACCES is raised by the calls the sinks use to create directories and files."""
    root.chmod(0o555)
    if os.geteuid() != 0:
        return

    prefix = str(root) + os.sep
    real_makedirs, real_open, real_replace = os.makedirs, builtins.open, os.replace

    def denied(path) -> bool:
        return os.path.abspath(os.fspath(path)).startswith(prefix)

    def makedirs(path, *args, **kwargs):
        if denied(path) and not os.path.isdir(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_makedirs(path, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and denied(file) and any(c in mode for c in "wax+"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        if denied(dst):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", makedirs)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "replace", replace)


def test_existing_unwritable_output_dir(tmp_path, out_dir, monkeypatch, caplog):
    out = out_dir
    out.mkdir()
    cfg = write_config(
        tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], format=["csv", "parquet", "prometheus"]
    )
    model, opt = _small_model()
    reference = _steps(*_small_model(), 5)
    _deny_writes_under(monkeypatch, out)
    try:
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            mon = TrainerMon(cfg)
            mon.set_monitor(model, optimizer=opt)
            losses = _steps(model, opt, 5)
            mon.flush()
            scraped = _scrape(_exporter(mon, "PrometheusExporter").port)
            mon.close()
    finally:
        monkeypatch.undo()
        out.chmod(0o755)
    assert losses == reference  # training is bit-identical to the unmonitored run
    assert list(out.iterdir()) == []  # nothing was written there
    # Each file sink: one error naming the problem, counted; the endpoint still serves every step.
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(messages) == 3 and all("Permission denied" in m for m in messages), messages
    assert sum("csv" in m for m in messages) == 1 and sum("parquet" in m for m in messages) == 1
    assert set(mon.faults.counts) == {"exporter csv open", "exporter parquet open"}
    assert [type(e).__name__ for e in mon.loop.worker.exporters] == ["PrometheusExporter"]
    assert scraped[("trainermon_last_step", ())] == 4
    assert scraped[("trainermon_exporter_errors_total", (("exporter", "csv"),))] == 1
    assert scraped[("trainermon_exporter_errors_total", (("exporter", "parquet"),))] == 1


def test_slow_filesystem_never_blocks_training(tmp_path, out_dir, monkeypatch, caplog):
    """Every CSV write blocks until the loop has finished: rows are dropped and counted, and the loop
    never waits for the writer. A timer opens the gate after 120 s for good, so a loop that did wait
    ends (and fails) instead of hanging; a fixed sleep per write would make this a race with the host."""
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm", "max"], queue_size=2)
    slow_write = csv_mod.CsvExporter.write
    gate = threading.Event()

    def write(self, batch):
        gate.wait()
        slow_write(self, batch)

    monkeypatch.setattr(csv_mod.CsvExporter, "write", write)
    steps = 60

    def timed(model, opt) -> list[float]:
        gen = torch.Generator().manual_seed(0)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        return times

    bare = timed(*_small_model())
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    release = threading.Timer(120, gate.set)
    release.daemon = True
    release.start()
    try:
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            t0 = time.perf_counter()
            monitored = timed(model, opt)
            loop = time.perf_counter() - t0
            # The loop ended while the writer was still held: it never waited for a write to finish.
            loop_outran_the_writer = not gate.is_set()
            gate.set()
            mon.close()
    finally:
        gate.set()
        release.cancel()
    assert loop_outran_the_writer, loop
    rows_per_step = 8  # 2 Linear layers x (weight, bias) x (grad_unreduced, grad_reduced)
    written = sum(len(read_family(mon.run_dir, f)) for f in ("grad_unreduced", "grad_reduced"))
    # Nothing is lost silently: every row was either written or counted as dropped.
    assert written + mon.dropped_rows == steps * rows_per_step
    assert mon.dropped_rows > steps * rows_per_step // 2
    assert sum("queue is full" in r.getMessage() for r in caplog.records) == 1  # warned once
    print(
        f"\nblocked sink: {steps} steps in {loop:.3f} s, "
        f"median step {statistics.median(monitored) * 1e3:.2f} ms "
        f"(unmonitored {statistics.median(bare) * 1e3:.2f} ms); {written} rows written, "
        f"{mon.dropped_rows} dropped and counted"
    )


@pytest.mark.parametrize("per_record", [100, 1])
def test_run_directory_deleted_mid_run_is_said_and_later_rows_are_kept(tmp_path, out_dir, caplog, per_record):
    """`rm -r` of the run directory while CSV files are open (one file per 100 steps): the rows written
    after it went into the deleted files, lost without a word. Now one warning per file, and the files
    are made again, with their header, from the next step on. With one file per step (the default), the
    next step's first file could not be made: CSV was off for the rest of the run; now the directory is
    made again, said once."""
    import shutil

    cfg = write_config(
        tmp_path / "cfg.json",
        wg_distribution=True,
        ops=["norm"],
        write_interval_s=0,
        step_count_per_record=per_record,
    )
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    _steps(model, opt, 2)
    mon.flush()
    shutil.rmtree(mon.run_dir)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        _steps(model, opt, 3)
        mon.close()
    assert mon.faults.total == 0, dict(mon.faults.counts)
    said = [r.getMessage() for r in caplog.records if "was deleted while open" in r.getMessage()]
    files = sorted(line.split("/")[-1].split(" ")[0] for line in said)
    if per_record == 1:
        assert files == [os.path.basename(mon.run_dir)], said
    else:
        assert files == ["grad_reduced_0-99.csv", "grad_unreduced_0-99.csv"], said
    assert all("from step 2 on" in line for line in said), said
    assert sorted({int(r["step"]) for r in read_family(mon.run_dir, "grad_reduced")}) == [2, 3, 4]
    assert not csv_problems(mon.run_dir)


def test_run_directory_replaced_by_a_file_promises_no_new_file(tmp_path, out_dir, caplog):
    """The run directory replaced by a regular file mid-run: CSV cannot make it again. It said first that
    the later rows "go to a new file there", then switched itself off: the promise was false. Now only
    the sink's one error is said, and training goes on."""
    import shutil

    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], write_interval_s=0)
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    _steps(model, opt, 2)
    mon.flush()
    shutil.rmtree(mon.run_dir)
    with open(mon.run_dir, "w") as fh:
        fh.write("x")
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        _steps(model, opt, 3)
        mon.close()
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "go to a new file" in m], said
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "csv" in r.getMessage().lower()]
    assert len(errors) == 1, said


def test_a_module_name_utf8_cannot_hold_reaches_every_sink(tmp_path, out_dir):
    """A module named from undecodable bytes (`os.fsdecode(b"l\\xff")` is 'l\\udcff', a lone surrogate)
    once made every sink fail on its first write (UnicodeEncodeError): CSV, Parquet, TensorBoard and
    Prometheus all off for the whole run. Its rows are written under the escaped name."""
    import pyarrow.dataset as ds

    cfg = write_config(
        tmp_path / "cfg.json",
        xy_distribution=True,
        forward_only=True,
        wg_distribution=True,
        ops=["norm"],
        format=["csv", "parquet", "tensorboard", "prometheus"],
        prometheus={"port": 0},
    )
    torch.manual_seed(0)
    odd = os.fsdecode(b"l\xff")
    model = torch.nn.Sequential()
    model.add_module("ok", torch.nn.Linear(4, 4))
    model.add_module(odd, torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    x = torch.randn(2, 4)
    out = model(x)
    out.sum().backward()
    want = float(out.detach().double().norm())
    opt.step()
    opt.zero_grad()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    shown = "l\\udcff"
    rows = {r["name"]: r for r in read_family(monitor.run_dir, "actv")}
    assert float(rows[f"{shown}.output"]["norm"]) == pytest.approx(want, rel=1e-6)
    assert {r["name"] for r in read_family(monitor.run_dir, "grad_reduced")} == {
        "ok.weight",
        "ok.bias",
        f"{shown}.weight",
        f"{shown}.bias",
    }
    table = ds.dataset(str(out_dir / "parquet"), partitioning="hive").to_table()
    assert f"{shown}.output" in set(table.column("name").to_pylist())
    assert list(Path(monitor.run_dir).glob("events.out.tfevents*"))


def test_one_sink_failure_counts_one_exporter_error(tmp_path, out_dir, monkeypatch, caplog):
    """A Parquet part write that fails (ENOSPC) at a flush: the worker then closes the sink, whose close
    flushes again. Each of the three calls counted the same failure (trainermon_exporter_errors_total 3
    for one fault and one error line)."""
    import trainermon.exporters.parquet as parquet_mod

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    cfg = write_config(
        tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], format=["csv", "parquet", "prometheus"]
    )
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    monkeypatch.setattr(parquet_mod, "write_part", full_disk)
    with caplog.at_level(logging.ERROR, logger="trainermon"):
        _steps(model, opt, 3)
        mon.flush()  # the failure
        _steps(model, opt, 1, seed=1)
        mon.flush()  # a step the page shows the counters after
        scraped = _scrape(_exporter(mon, "PrometheusExporter").port)
        mon.close()
    assert dict(mon.faults.counts) == {"exporter ParquetExporter.flush": 1}
    assert len([r for r in caplog.records if "ParquetExporter" in r.getMessage()]) == 1
    assert scraped[("trainermon_exporter_errors_total", (("exporter", "parquet"),))] == 1
    assert scraped[("trainermon_monitor_faults_total", ())] == 1
    assert sorted({int(r["step"]) for r in read_family(mon.run_dir, "grad_reduced")}) == [0, 1, 2, 3]
