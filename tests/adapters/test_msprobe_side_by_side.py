"""Side by side with msprobe (mindstudio-probe 26.2.0): the same seeded model through msprobe's
documented usage with only the import line changed (tests/msprobe_gpt.py, `from msprobe.pytorch import
TrainerMon, seed_all` vs `from trainermon import ...`). Every (file, name, step, micro_step, statistic)
msprobe writes must be in trainermon's output with an equal value, except the README's deliberate
differences, listed here:

- the root module's rows (`.input`, `.output`: msprobe hooks the model itself; trainermon its modules);
- integer inputs (`emb.input`: token ids are not activations);
- gradients that do not exist: msprobe writes NaN actv_grad rows where its backward hook gets None (an
  input that takes no gradient, a None output); trainermon writes no row;
- moments: msprobe reads exp_avg / exp_avg_sq before the update, one step behind (its step s is
  trainermon's s - 1).

Each tool runs in its own process (msprobe patches torch's BackwardHook process-wide). Skipped with a
message when mindstudio-probe is not installed; `.ci/run` installs it.
"""

from __future__ import annotations

import csv
import glob
import importlib.util
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("msprobe") is None,
    reason="mindstudio-probe is not installed (pip install mindstudio-probe==26.2.0; .ci/run does)",
)

OPS = ("norm", "min", "max", "mean")


def _rows(out: str) -> dict[tuple, dict[str, str]]:
    """Every row a tool wrote into `out` (the `msprobe_gpt` fixture's folder), by (file, name, step,
    micro_step)."""
    rows = {}
    for path in glob.glob(os.path.join(out, "*", "*.csv")):
        family = os.path.basename(path).rsplit("_", 1)[0]
        with open(path, newline="") as fh:
            for r in csv.DictReader(fh):
                rows[(family, r["name"], int(r["step"]), r.get("micro_step"))] = r
    return rows


def _rms(row: dict[str, str]) -> float:
    numel = math.prod(int(v) for v in row["shape"].strip("[]()").split(",") if v.strip())
    return float(row["norm"]) / math.sqrt(max(numel, 1))


def _deliberate(key: tuple, row: dict[str, str]) -> bool:
    family, name, _step, _micro = key
    if name.startswith("."):
        return True
    if family == "actv_grad" and row["shape"] == "nan":  # msprobe's row for a None gradient
        return True
    return family == "actv" and name == "emb.input"


def test_everything_msprobe_writes_is_there_with_the_same_value(msprobe_gpt):
    theirs = _rows(msprobe_gpt("msprobe"))
    ours = _rows(msprobe_gpt("trainermon"))
    compared, missing, wrong = 0, [], []
    for key, row in theirs.items():
        if _deliberate(key, row):
            continue
        family, name, step, micro = key
        mine = ours.get((family, name, step - 1, micro) if family in ("exp_avg", "exp_avg_sq") else key)
        if mine is None:
            missing.append(key)
            continue
        for op in OPS:
            want, got = float(row[op]), float(mine[op])
            compared += 1
            if math.isnan(want) or math.isnan(got):
                if not (math.isnan(want) and math.isnan(got)):
                    wrong.append((key, op, got, want))
            # msprobe reduces in float32 (pairwise sums over at most 2^10 elements here: relative error
            # below 1e-6 of the sum of magnitudes) and rounds to 12 decimals; trainermon is exact
            elif abs(got - want) > 1e-5 * abs(want) + 1e-6 * _rms(row) + 1e-12:
                wrong.append((key, op, got, want))
    assert not missing, f"{len(missing)} of msprobe's rows are missing, e.g. {sorted(missing)[:8]}"
    assert not wrong, f"{len(wrong)} values differ, e.g. {wrong[:5]}"
    excluded = sum(1 for k, r in theirs.items() if _deliberate(k, r))
    assert compared >= 4 * (len(theirs) - excluded) - 4 * 80 and compared > 1500, (compared, len(theirs))


def test_csv2tensorboard_by_step_converts_msprobes_own_output_as_msprobe_does(tmp_path, msprobe_gpt):
    """`trainermon.csv2tensorboard_by_step` on msprobe's own CSV output writes the event files msprobe's
    converter of the same name writes from it: the same tags, steps and values."""
    pytest.importorskip("tensorboard", reason="the tensorboard package is in the test extras")
    from tests.sinks.test_csv2tb import _tree
    from trainermon import csv2tensorboard_by_step

    out = msprobe_gpt("msprobe")
    theirs, ours = str(tmp_path / "tb_msprobe"), str(tmp_path / "tb_ours")
    script = (
        "import sys; from msprobe.pytorch.monitor.csv2tb import csv2tensorboard_by_step as f; "
        "f(sys.argv[1], output_dirpath=sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", script, out, theirs], check=True, capture_output=True, timeout=300)
    csv2tensorboard_by_step(out, output_dirpath=ours)
    want, got = _tree(theirs), _tree(ours)
    assert len(want) >= 6 and sum(len(v) for v in want.values()) > 100, want.keys()
    assert got == want
