"""os.fork() children inherit the parent's monitor, its sinks and its buffered rows, but not its threads:
their close() and exit handler touch nothing (the parent writes those rows; the child once wrote the
parent's buffered Parquet rows a second time, and waited 30 s at exit for a Prometheus server thread
it did not have)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("pyarrow")
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SCRIPT = """
import json, os, sys, time, torch
from trainermon import TrainerMon
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
monitor = TrainerMon({cfg!r})
monitor.set_monitor(model, optimizer=opt)
ref = {{}}
def train(steps):
    for _ in range(steps):
        step = monitor.current_step
        model(torch.randn(4, 8)).square().sum().backward()
        for name, p in model.named_parameters():
            ref[name + "/" + str(step)] = float(p.grad.double().norm())
        opt.step()
        opt.zero_grad()
train(5)
monitor.loop.worker.reached(30)  # the rows sit in the sink's buffer, not yet on disk
start = time.monotonic()
if os.fork() == 0:
    if {child_close!r}:
        monitor.close()
    sys.exit(0)  # a normal exit: the exit handlers run in the child
os.wait()
child_s = time.monotonic() - start
train(5)
monitor.close()
print(json.dumps({{"run_dir": monitor.run_dir, "ref": ref, "child_s": child_s}}))
"""


def _run(tmp_path, config: dict, child_close: bool) -> dict:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(config))
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    env.pop("DYNAMIC_MONITOR", None)
    script = textwrap.dedent(SCRIPT.format(cfg=str(cfg), child_close=child_close))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("child_close", [False, True], ids=["child-exits", "child-closes"])
def test_forked_child_does_not_rewrite_parquet_rows(tmp_path, child_close):
    import pyarrow.dataset as ds

    out = _run(tmp_path, {"wg_distribution": True, "ops": ["norm"], "format": "parquet"}, child_close)
    table = ds.dataset(str(tmp_path / "out" / "parquet"), format="parquet", partitioning="hive").to_table()
    table = table.filter(ds.field("family") == "grad_reduced")
    keys = [f"{n}/{s}" for n, s in zip(table["name"].to_pylist(), table["step"].to_pylist())]
    dup = [k for k, n in collections.Counter(keys).items() if n > 1]
    assert not dup  # the old child wrote steps 0-4 a second time
    got = dict(zip(keys, table["norm"].to_pylist()))
    assert got.keys() == out["ref"].keys()  # steps 0-9, 2 parameters each
    for key, value in out["ref"].items():
        assert got[key] == pytest.approx(value, rel=1e-5), key


def test_forked_child_exits_promptly_with_prometheus(tmp_path):
    pytest.importorskip("prometheus_client")
    config = {"wg_distribution": True, "ops": ["norm"], "format": "prometheus", "prometheus": {"port": 0}}
    out = _run(tmp_path, config, child_close=False)
    assert out["child_s"] < 15  # the old child waited 30 s for a server thread it does not have
