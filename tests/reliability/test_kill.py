"""Reliability under faults (issue 11), crash safety: SIGKILL at random points of a monitored job, and
writes cut short by a file-size limit, leave only complete CSV rows and complete Parquet parts.

docs/RELIABILITY.md lists every test, its measured result, and the defects these tests found.
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import read_family, write_config
from tests.reliability.faults import REPO, csv_problems
from trainermon.collect.records import FAMILIES

ZYGOTE = textwrap.dedent(
    """
    import json, os, random, resource, signal, sys, time
    import torch
    from torch import nn
    import pandas  # noqa: F401 - pyarrow imports it on its first table: once here, for every trial
    import pyarrow.parquet  # noqa: F401 - imported once here, inherited by every forked trial
    from trainermon import TrainerMon
    from trainermon.adapters import ADAPTERS, _load
    import trainermon.exporters.csv, trainermon.exporters.parquet  # noqa: F401

    for spec, _ in ADAPTERS:
        _load(spec)
    torch.set_num_threads(1)
    warm = nn.Linear(2, 2)  # the first optimizer step imports more of torch: pay it once, before forking
    warm(torch.ones(1, 2)).sum().backward()
    torch.optim.SGD(warm.parameters(), lr=0.1).step()
    cfg, fsize_cfg, root, trials, budget, seed = sys.argv[1:7]
    rng = random.Random(int(seed))

    def train(out, config, limit=None, steps=None):
        os.environ["MONITOR_OUTPUT_DIR"] = out
        if limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # writes past it: short, then EFBIG
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        mon = TrainerMon(config)
        mon.set_monitor(model, optimizer=opt)
        step = 0
        while steps is None or step < steps:
            model(torch.randn(4, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            step += 1
            time.sleep(0.003)  # the rest of a training step: the worker keeps up, as in a real job
        mon.close()
        print(json.dumps({"faults": dict(mon.faults.counts)}), flush=True)

    def run(fn):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fn()
                code = 0
            finally:
                os._exit(code)
        return pid

    results, end = [], time.monotonic() + float(budget)
    for i in range(int(trials)):
        if time.monotonic() > end:
            break
        out = os.path.join(root, f"kill{i:03d}")
        delay = rng.uniform(0.0, 0.6)
        t0 = time.monotonic()
        pid = run(lambda: train(out, cfg))
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        signaled = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        results.append({"out": out, "delay": delay, "signal": signaled})
    out = os.path.join(root, "fsize")
    pid = run(lambda: train(out, fsize_cfg, limit=6000, steps=30))
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"kills": results, "fsize": {"out": out, "exit": os.WEXITSTATUS(status)}}), flush=True)
    """
)
CRASH_OPS = ["norm", "min", "max", "mean", "nans", "numel"]


@pytest.fixture(scope="module")
def crash_trials(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("crash")
    base = {"xy_distribution": True, "wg_distribution": True, "param_distribution": True, "ndigits": 17}
    cfg = write_config(
        root / "cfg.json",
        **base,
        ops=CRASH_OPS,
        format=["csv", "parquet"],
        parquet={"steps_per_part": 3},
        queue_size=100_000,  # nothing is dropped: a hole in the steps would be a lost write
        write_interval_s=0,  # a write after every step: the kills land between and inside many writes
    )
    fsize = write_config(root / "fsize.json", **base, ops=CRASH_OPS, step_count_per_record=1000)
    (root / "zygote.py").write_text(ZYGOTE)
    args = [str(root / "zygote.py"), cfg, fsize, str(root), "24", "25", "11"]
    env = {k: v for k, v in os.environ.items() if k != "DYNAMIC_MONITOR"}
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    result = lines[-1]
    result["fsize"]["faults"] = lines[0]["faults"] if len(lines) > 1 else None
    result["fsize"]["stderr"] = done.stderr
    return result


def test_sigkill_at_random_points_leaves_only_complete_rows_and_parts(crash_trials):
    import pyarrow.parquet as pq

    import trainermon as tm

    kills = crash_trials["kills"]
    assert len(kills) >= 20 and all(k["signal"] == 9 for k in kills)
    per_step_rows: dict[str, set[int]] = {}
    totals = {"csv_rows": 0, "parts": 0, "trials_with_parts": 0}
    for trial in kills:
        out = trial["out"]
        assert csv_problems(out) == [], trial
        csv_rows: dict[tuple, str] = {}
        for run_dir in glob.glob(os.path.join(out, "*-rank0-*")):
            for family in FAMILIES:
                rows = read_family(run_dir, family)
                totals["csv_rows"] += len(rows)
                steps: dict[int, int] = {}
                for r in rows:
                    steps[int(r["step"])] = steps.get(int(r["step"]), 0) + 1
                    csv_rows[(family, r["name"], int(r["step"]), int(r.get("micro_step") or 0))] = r["norm"]
                # No hole (nothing was dropped), and every step of a family has all of its rows.
                assert sorted(steps) == list(range(len(steps))), (trial, family, sorted(steps))
                per_step_rows.setdefault(family, set()).update(steps.values())
        parts = glob.glob(os.path.join(out, "parquet", "family=*", "rank=*", "*"))
        assert all(os.path.basename(p).startswith("part-") for p in parts), parts  # .tmp: hidden
        totals["parts"] += len(parts)
        totals["trials_with_parts"] += bool(parts)
        for part in parts:
            table = pq.read_table(part)  # a valid footer, every row readable
            first, last = (int(v) for v in os.path.basename(part).split("-")[1:3])
            assert set(table.column("step").to_pylist()) == set(range(first, last + 1))
        if parts:
            # Every Parquet row was written to CSV first, with the very same value.
            for r in tm.load(out).to_pylist():
                key = (r["family"], r["name"], r["step"], r["micro_step"] or 0)
                assert float(csv_rows[key]) == r["norm"] or math.isnan(r["norm"]), key
    # The same number of rows at every step of every trial (4 Linear layers: 8 inputs/outputs, 7 of
    # them with a gradient, 8 weights and biases); SGD has no moments.
    assert per_step_rows == {
        "actv": {8}, "actv_grad": {7}, "grad_unreduced": {8}, "grad_reduced": {8}, "param_origin": {8},
        "exp_avg": set(), "exp_avg_sq": set(), "param_updated": {8}, "comm": set(), "update": set(),
        "moe_load": set(), "attn_logit": set(),
    }, str(per_step_rows)  # fmt: skip
    assert totals["csv_rows"] > 1000 and totals["trials_with_parts"] >= len(kills) // 2, totals
    delays = sorted(k["delay"] for k in kills)
    print(f"\n{len(kills)} SIGKILL trials, delays {delays[0]:.3f}-{delays[-1]:.3f} s: {totals}")
    # The file-size limit trial (a short write, then EFBIG) still trained to the end.
    assert crash_trials["fsize"]["exit"] == 0, crash_trials["fsize"]["stderr"][-2000:]
    assert crash_trials["fsize"]["faults"] == {"exporter CsvExporter": 1}


def test_short_write_leaves_no_partial_row(crash_trials):
    assert csv_problems(crash_trials["fsize"]["out"]) == []
