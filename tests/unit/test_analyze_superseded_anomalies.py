"""`analyze` of an output directory a restart wrote into twice: the anomaly records of steps the later run
re-did are not counted (the rows of those steps are the later run's), but listed apart."""

from __future__ import annotations

import json
from pathlib import Path

from trainermon.analysis import analyze
from trainermon.analysis.source import open_run
from trainermon.analysis.superseded import split_anomalies
from trainermon.cli import main

CRASHED, RESUMED = "aaaa1111", "bbbb2222"
# The crashed run wrote steps 0-5 (ranks 0 and 1), the resumed one steps 4-9 on rank 0 only, into a
# CSV file named by its step bucket 0-9: the bucket covers step 2, which the resumed run never wrote.
WRITTEN = {(CRASHED, 0): range(0, 6), (CRASHED, 1): range(0, 6), (RESUMED, 0): range(4, 10)}
RECORDS = [  # (run, rank, step); time grows with the run
    (CRASHED, 0, 2),
    (CRASHED, 0, 4),
    (CRASHED, 0, 5),  # the NaN of the crash: the resumed run re-did step 5 without an anomaly
    (CRASHED, 1, 5),  # no later run wrote rank 1: kept
    (RESUMED, 0, 4),
    (RESUMED, 0, 7),
]


def _write(root: Path) -> None:
    stamps = {CRASHED: "Jan01_00-00-00", RESUMED: "Jan01_00-10-00"}
    for (run, rank), steps in WRITTEN.items():
        d = root / f"{stamps[run]}-rank{rank}-{run}"
        d.mkdir(parents=True)
        first, last = (0, 5) if run == CRASHED else (0, 9)
        rows = [f"0,w,{s},{1.0 + s}" for s in steps]
        (d / f"grad_reduced_{first}-{last}.csv").write_text(
            "vpp_stage,name,step,norm\n" + "\n".join(rows) + "\n"
        )
    anomalies = root / "anomaly_detected"
    anomalies.mkdir()
    for rank in (0, 1):
        lines = [
            json.dumps(
                {
                    "rank": rank,
                    "step": step,
                    "family": "grad_reduced",
                    "name": "w",
                    "stat": "norm",
                    "rule": "AnomalyNan",
                    "run_id": run,
                    "time": (1000.0 if run == CRASHED else 2000.0) + step,
                }
            )  # fmt: skip
            for run, r, step in RECORDS
            if r == rank
        ]
        (anomalies / f"anomaly_rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


def _key(rec: dict) -> tuple:
    return rec["run_id"], rec["rank"], rec["step"]


def test_records_of_redone_steps_are_superseded(tmp_path):
    _write(tmp_path)
    # Reference: a record is superseded when a later run wrote its (rank, step) (WRITTEN, by hand).
    superseded = {(CRASHED, 0, 4), (CRASHED, 0, 5)}
    kept = set(RECORDS) - superseded
    got_kept, got_gone = split_anomalies(open_run(tmp_path))
    assert {_key(r) for r in got_kept} == kept and len(got_kept) == len(kept)
    assert {_key(r) for r in got_gone} == superseded and len(got_gone) == len(superseded)
    result = analyze(tmp_path, progress=False)
    assert {_key(r) for r in result.anomalies} == kept
    found = result.findings()["anomalies"]
    assert found["count"] == len(kept) == 4
    assert found["superseded"]["count"] == 2 and found["superseded"]["by_run"] == {CRASHED: 2}
    assert any("2 anomaly records of steps a restart re-did" in n for n in result.summary.notes)


def test_cli_count_matches_the_rows_used(tmp_path, capsys):
    _write(tmp_path)
    out = tmp_path / "rep"
    assert main(["analyze", str(tmp_path), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "4 anomalies recorded" in printed
    assert f"2 of run {CRASHED} (steps 4-5)" in printed
    found = json.loads((out / "findings.json").read_text())["anomalies"]
    assert found["count"] == 4 and found["superseded"]["count"] == 2


def test_one_run_or_run_id_keeps_every_record(tmp_path):
    _write(tmp_path)
    crashed = analyze(open_run(tmp_path, run_id=CRASHED), progress=False)
    assert sorted(_key(r) for r in crashed.anomalies) == sorted(r for r in RECORDS if r[0] == CRASHED)
    assert crashed.superseded_anomalies == []
