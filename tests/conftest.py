"""Fixtures shared by the test folders: the monitor's two environment variables, set for one test.

A monitor reads MONITOR_OUTPUT_DIR (where it writes) and DYNAMIC_MONITOR (whether it watches its config
file) when it is constructed. Tests that build a monitor point the first at their own temporary directory
and, where the mode matters, pin the second, so that nothing the calling shell exports changes them.
Plain helpers (config files, reading rows back, reference statistics) are in tests/helpers.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


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


@pytest.fixture(scope="session")
def msprobe_gpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """`tests/msprobe_gpt.py` run once per tool ("msprobe" or "trainermon") for the whole session: tool ->
    the folder it wrote (tests only read it). Three tests compare the two tools' output of this one seeded
    run; msprobe's takes ~30 s on a 2-core host."""
    root = tmp_path_factory.mktemp("msprobe_gpt")
    done: dict[str, str] = {}

    def run(tool: str) -> str:
        if tool not in done:
            out = str(root / tool)
            proc = subprocess.run(
                [sys.executable, "-m", "tests.msprobe_gpt", tool, out],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[tool] = out
        return done[tool]

    return run


@pytest.fixture
def dynamic_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """DYNAMIC_MONITOR=true for this test: the monitor watches its config file and applies edits."""
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
