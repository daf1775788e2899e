"""The first Parquet part must not hold back the CSV rows beyond `write_interval_s` (what a kill loses).

pyarrow imports pandas on its first table (about 1 s idle, >2.5 s on a busy host). The CSV sink writes on
the same worker thread, after the Parquet sink: when that import happened inside the worker's first part,
a job killed then lost every CSV row of those seconds. The sink now imports it when it opens, on the
caller's thread. A fresh interpreter (pandas and pyarrow not yet imported, as in a training script) makes
any import on a thread other than the main one take 20 s, as a very busy host might; the rows of every
step must still be in the CSV within a few seconds, read without close() and the process then ended with
os._exit (as a kill would).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent(
    """
    import csv, glob, json, os, sys, threading, time
    repo, cfg = sys.argv[1:3]
    sys.path.insert(0, repo)
    main, imported = threading.main_thread(), []

    class SlowOffMain:  # an import on another thread (the worker) is as slow as on a very busy host
        def find_spec(self, name, path=None, target=None):
            if threading.current_thread() is not main and "." not in name and name not in sys.modules:
                imported.append(name)
                time.sleep(20)
            return None

    import torch
    from torch import nn
    from trainermon import TrainerMon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    began = time.monotonic()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    attach_s = time.monotonic() - began
    sys.meta_path.insert(0, SlowOffMain())
    expected = {}
    for step in range(3):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        for name, p in model.named_parameters():
            expected[f"{name}|{step}"] = float(torch.linalg.vector_norm(p.grad.double()))
        opt.step()
        opt.zero_grad()
    last = time.monotonic()
    got = {}
    while time.monotonic() - last < 6 and len(got) < len(expected):
        time.sleep(0.05)
        got = {}
        for path in glob.glob(os.path.join(mon.run_dir, "grad_reduced_*.csv")):  # a file per step
            with open(path, newline="") as fh:
                got.update({f"{r['name']}|{r['step']}": float(r["norm"]) for r in csv.DictReader(fh)})
    print(json.dumps({"expected": expected, "got": got, "imported": imported,
                      "waited": time.monotonic() - last, "attach_s": attach_s}), flush=True)
    os._exit(0)  # no close(), no exit flush: only what the worker wrote so far counts, as after a kill
    """
)


def test_first_parquet_part_does_not_hold_back_csv(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(
        json.dumps(
            {
                "wg_distribution": True,
                "ops": ["norm", "min", "max", "mean"],
                "ndigits": 12,
                "format": ["csv", "parquet"],
                "parquet": {"steps_per_part": 1},  # a part at every step, the first at step 0
            }
        )
    )
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "out")}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, REPO, str(cfg)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected, got = result["expected"], result["got"]
    assert set(got) == set(expected), f"CSV rows after {result['waited']:.1f} s: {sorted(got)}"
    assert result["imported"] == [], f"the worker imported {result['imported']} while writing"
    for key, norm in expected.items():
        assert abs(got[key] - norm) <= 1e-6 * max(1.0, norm), (key, got[key], norm)
    print(
        f"set_monitor took {result['attach_s']:.2f} s; CSV complete {result['waited']:.2f} s after the step"
    )
