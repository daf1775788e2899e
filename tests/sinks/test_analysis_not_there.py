"""Messages for a run id, family or rank that is not there: named, with what is there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainermon
from tests.helpers import write_config
from tests.sinks.analysis_engines_common import STEPS
from tests.sinks.analysis_engines_common import runs as runs
from trainermon import TrainerMon
from trainermon.analysis import compare, open_run
from trainermon.cli import main


# ---- messages for what is not there -----------------------------------------------------------------
def _run_id(out: Path) -> str:
    ids = set(trainermon.load(out, columns=["run_id"]).column("run_id").to_pylist())
    assert len(ids) == 1
    return ids.pop()


@pytest.mark.parametrize("fmt", ["auto", "parquet", "csv"])
def test_unknown_run_id_is_named_with_the_run_ids_there(runs, fmt, tmp_path, capsys):
    run = str(runs["run"])
    rid = _run_id(runs["run"])
    with pytest.raises(FileNotFoundError, match=rf"run id 'nosuch' is not in .*\['{rid}'\]"):
        open_run(run, prefer=fmt, run_id="nosuch")
    code = main(["analyze", "--run-id", "nosuch", "--format", fmt, run, "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 2 and "run id 'nosuch'" in err and rid in err and "no monitor output" not in err
    code = main(["compare", run, run, "--benchmark-run-id", "nosuch", "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert code == 2 and "run id 'nosuch'" in err and rid in err
    # the right id still reads
    assert open_run(run, prefer=fmt, run_id=rid).files


def test_unknown_family_in_compare_is_named_with_the_families_there(runs, tmp_path, capsys):
    run, bench = str(runs["run"]), str(runs["bench"])
    with pytest.raises(KeyError, match=r"families \['nosuch'\] are in neither run"):
        compare(run, bench, families=["nosuch"])
    code = main(["compare", "--family", "nosuch", run, bench, "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert code == 2 and "'nosuch'" in err and "'update'" in err and "grad_reduced" in err
    assert "(run: [], benchmark: [])" not in err


def test_unknown_rank_is_named_with_the_ranks_there(runs, tmp_path, capsys):
    run = runs["run"]
    with pytest.raises(ValueError, match=r"ranks \[5\] are not in .*\(it has ranks \[0\]\)"):
        trainermon.load(run, ranks=[5])
    with pytest.raises(ValueError, match=r"ranks \[5\] are not in .*'update'.*\[0\]"):
        trainermon.load(run, family="update", ranks=[0, 5])
    assert trainermon.load(run, family="update", ranks=[0]).num_rows == 6 * STEPS
    code = main(["analyze", str(run), "--ranks", "5", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 2 and "ranks [5]" in err and "[0]" in err


def test_unknown_run_id_in_load_is_named(runs):
    run = runs["run"]
    with pytest.raises(ValueError, match=r"run ids \['nosuch'\] are not in .*\(it has \['[0-9a-f]{8}'\]\)"):
        trainermon.load(run, run_id="nosuch")
    there = trainermon.load(run, family="update").column("run_id")[0].as_py()
    assert trainermon.load(run, family="update", run_id=there).num_rows == 6 * STEPS
    assert trainermon.load(run, family="update", run_id=there, steps=(10**6, 10**6 + 1)).num_rows == 0


def test_a_run_id_outside_the_step_range_reads_empty(tmp_path, monkeypatch):
    """Two runs in one dataset (steps 0-1 and 100-101): run A with B's steps is an empty table, not an
    error saying A is absent (the check looked only at the files the steps selected)."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", wg_distribution=True, format="parquet")
    ids = []
    for start in (0, 100):
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt, start_iteration=start)
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
        mon.close()
        ids.append(mon.loop.outputs.run_id)
    root = str(tmp_path / "out")
    assert trainermon.load(root, run_id=ids[0], steps=(100, 101)).num_rows == 0
    assert trainermon.load(root, run_id=ids[0]).num_rows == 8  # 2 params x 2 gradient families x 2 steps
    with pytest.raises(ValueError, match="not in"):
        trainermon.load(root, run_id="nosuch", steps=(100, 101))
