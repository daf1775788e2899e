"""The CSV exporter's lines built natively (`exporters/_csvtext.c`, GIL released) are byte for byte the lines
its Python twin builds, and a monitored run writes the same files either way.

The numbers: Python's "%.{n}g" and the C library's both round the exact binary value correctly (to nearest,
ties to even), so the comparison is exact; the values cover ties at 6 digits (1234565, 123456.5), zeros of
both signs, subnormals, the largest double, NaN of both signs, infinities, and a million values spread over
60 decades, at every precision the config allows (1 to 17 digits).
"""

from __future__ import annotations

import filecmp
import os

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import train_monitored, write_config
from trainermon.exporters import csv as csv_exporter

pytestmark = pytest.mark.skipif(
    csv_exporter._native is None, reason="the native CSV lines were not compiled (no C compiler at install)"
)

EDGES = [
    0.0,
    -0.0,
    1.0,
    0.5,
    1234565.0,
    123456.5,
    9.9999995,
    0.1,
    2.5e-7,
    1e16,
    1e-5,
    5e-324,
    2.2250738585072014e-308,
    1.7976931348623157e308,
    float("nan"),
    -float("nan"),
    float("inf"),
    -float("inf"),
]


def _both(columns: list, n: int, ndigits: int) -> bytes:
    native = csv_exporter._native.lines(columns, n, ndigits)
    assert native == csv_exporter.lines_in_python(columns, n, ndigits)
    return native


def test_edge_values_at_every_precision():
    values = np.array(EDGES)
    texts = [f"layer.{i},é" for i in range(len(values))]  # non-ASCII text passes through as UTF-8
    for ndigits in range(1, 18):
        out = _both([texts, "7", values, "", values[::-1].copy()], len(values), ndigits)
        assert out.count(b"\n") == len(values)
    assert _both([np.array([1.5]), ["é"]], 1, 6) == "1.5,é\n".encode()
    assert _both([np.array(EDGES[-4:])], 4, 6) == b"nan\nnan\ninf\n-inf\n"


def test_a_million_values_over_sixty_decades():
    rng = np.random.default_rng(0)
    n = 1_000_000
    spread = rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)
    halves = rng.integers(-(10**7), 10**7, n) / 2.0  # many exact ties at the last digit
    singles = rng.random(n).astype(np.float32).astype(np.float64)  # what float32 statistics give
    for ndigits in (4, 6, 17):
        _both([spread, halves, singles], n, ndigits)


def test_bad_columns_are_refused_with_what_was_wrong():
    with pytest.raises(ValueError, match="column 0 has 1 texts, expected 2"):
        csv_exporter._native.lines([["a"]], 2, 6)
    with pytest.raises(TypeError, match="column 1, line 0: expected str"):
        csv_exporter._native.lines([["a"], [3]], 1, 6)
    with pytest.raises(TypeError, match="column 0 is not 2 contiguous float64 values"):
        csv_exporter._native.lines([np.zeros(2, dtype=np.float32)], 2, 6)
    with pytest.raises(ValueError, match="1 <= ndigits <= 17"):
        csv_exporter._native.lines(["a"], 1, 18)
    assert csv_exporter._native.lines([], 3, 6) == b"" and csv_exporter._native.lines(["a"], 0, 6) == b""


def test_a_monitored_run_writes_the_same_files_either_way(tmp_path, monkeypatch):
    """Every family and op a small run writes (actv, actv_grad, the weight families, moments), with the
    native lines and with the Python twin: the same bytes in every file."""
    runs = []
    for native in (csv_exporter._native, None):
        monkeypatch.setattr(csv_exporter, "_native", native)
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / f"out{native is None}"))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        config = write_config(
            tmp_path / f"cfg{native is None}.json",
            xy_distribution=True,
            wg_distribution=True,
            mv_distribution=True,
            param_distribution=True,
            ops=["norm", "min", "max", "mean", "nans", "shape", "dtype"],
        )
        gen = torch.Generator().manual_seed(1)
        monitor = train_monitored(config, model, lambda g=gen: torch.randn(4, 8, generator=g), steps=3)
        runs.append(monitor.run_dir)
    files = sorted(os.listdir(runs[0]))
    assert len([f for f in files if f.endswith(".csv")]) >= 6
    assert files == sorted(os.listdir(runs[1]))
    match, mismatch, errors = filecmp.cmpfiles(runs[0], runs[1], files, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
