"""Fixtures shared by the test folders: the monitor's two environment variables, set for one test.

A monitor reads MONITOR_OUTPUT_DIR (where it writes) and DYNAMIC_MONITOR (whether it watches its config
file) when it is constructed. Tests that build a monitor point the first at their own temporary directory
and, where the mode matters, pin the second, so that nothing the calling shell exports changes them.
Plain helpers (config files, reading rows back, reference statistics) are in tests/helpers.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def out_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """MONITOR_OUTPUT_DIR set to `tmp_path / "out"` for this test (the directory is not created)."""
    out = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    return out


@pytest.fixture
def static_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """DYNAMIC_MONITOR unset for this test: the monitor reads its config once and never watches it."""
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)


@pytest.fixture
def dynamic_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """DYNAMIC_MONITOR=true for this test: the monitor watches its config file and applies edits."""
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
