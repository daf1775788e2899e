"""`analyze` / `compare` on partial inputs an audit found read silently: a step missing grad_reduced rows,
micro-steps in one run only, ranks missing from a run folder, `--ranks` beside anomaly records, CSV
holding later steps than Parquet; and findings.json / option-error details."""

from __future__ import annotations

import csv
import glob
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tests.sinks.test_analysis import train
from trainermon.analysis import analyze, compare, open_run
from trainermon.analysis.jsonutil import records
from trainermon.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("gaps") / "base", steps=6)


def _copy(run: dict, dest: Path) -> Path:
    shutil.copytree(run["out"], dest)
    return dest


def _rank_dir(root: Path) -> Path:
    (found,) = [Path(p) for p in glob.glob(str(root / "*-rank0-*"))]
    return found


def _rows(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as fh:
        table = list(csv.reader(fh))
    return table[0], table[1:]


def _write_rows(path: Path, header: list[str], rows: list[list[str]]) -> None:
    with open(path, "w", newline="") as fh:
        csv.writer(fh).writerows([header, *rows])


def _findings(out: Path) -> dict:
    return json.loads((out / "findings.json").read_text())


def test_a_step_missing_grad_reduced_rows_is_left_out_and_named(run, tmp_path, capsys):
    """D6: rows of 2 tensors lost at the last step: the sum over the rest understated that step's norm."""
    root = _copy(run, tmp_path / "short")
    (path,) = glob.glob(str(_rank_dir(root) / "grad_reduced_*.csv"))
    header, rows = _rows(Path(path))
    at = header.index("step")
    last = max(int(r[at]) for r in rows)
    kept = [r for r in rows if int(r[at]) != last] + [r for r in rows if int(r[at]) == last][:-2]
    _write_rows(Path(path), header, kept)
    out = tmp_path / "a"
    assert main(["analyze", str(root), "--format", "csv", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    found = _findings(out)["global_grad_norm"]
    assert found["steps"] == list(range(last)), found["steps"]
    for step, value in zip(found["steps"], found["values"]):
        assert value == pytest.approx(run["norms"][step], rel=1e-5), step
    assert f"step {last}: 2 missing" in printed, printed


def test_a_dip_is_left_out_and_a_lasting_change_of_tensors_is_not(run, tmp_path, capsys):
    """A step in the middle missing a row is left out; one tensor gone from step 2 on (a reload selecting
    other targets) is the run's new set, not missing rows: every step stays on the curve."""
    for case in ("dip", "lasting"):
        root = _copy(run, tmp_path / case)
        (path,) = glob.glob(str(_rank_dir(root) / "grad_reduced_*.csv"))
        header, rows = _rows(Path(path))
        at, name = header.index("step"), header.index("name")
        gone = sorted({r[name] for r in rows})[0]
        if case == "dip":
            kept = [r for r in rows if not (int(r[at]) == 2 and r[name] == gone)]
        else:
            kept = [r for r in rows if not (int(r[at]) >= 2 and r[name] == gone)]
        _write_rows(Path(path), header, kept)
        out = tmp_path / f"a-{case}"
        assert main(["analyze", str(root), "--format", "csv", "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        steps = _findings(out)["global_grad_norm"]["steps"]
        everything = sorted({int(r[at]) for r in rows})
        if case == "dip":
            assert steps == [s for s in everything if s != 2] and "step 2: 1 missing" in printed, printed
        else:
            assert steps == everything and "missing" not in printed, printed


def _write_csv(path: Path, header: str, rows: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + "\n" + "\n".join(rows) + "\n")


def test_micro_steps_in_one_run_only_are_counted_and_not_agreement(tmp_path, capsys):
    """D9: grad_unreduced per micro-step in the run, per step in the benchmark: 0 cells aligned, said."""
    steps, micros = 3, 2
    for side in ("run", "bench"):
        rank = tmp_path / side / f"Jan01_00-00-00-rank0-{side}"
        _write_csv(
            rank / "grad_reduced_0-2.csv", "vpp_stage,name,step,norm", [f"0,w,{s},1.0" for s in range(3)]
        )
        if side == "run":
            rows = [f"0,w,{s},{m},1.0" for s in range(steps) for m in range(micros)]
            _write_csv(rank / "grad_unreduced_0-2.csv", "vpp_stage,name,step,micro_step,norm", rows)
        else:
            rows = [f"0,w,{s},1.0" for s in range(steps)]
            _write_csv(rank / "grad_unreduced_0-2.csv", "vpp_stage,name,step,norm", rows)
    result = compare(tmp_path / "run", tmp_path / "bench", progress=False)
    row = result.per_family.set_index("family").loc["grad_unreduced"]
    assert row["cells_compared"] == 0
    keys = [n for n in result.notes if n.startswith("grad_unreduced: (step, micro_step) keys")]
    assert keys and f"only in the run: {steps * micros}" in keys[0], result.notes
    assert f"only in the benchmark: {steps}" in keys[0] and "(0, -)" in keys[0], keys
    assert any("grad_unreduced: 0 cells compared" in n and "NOT checked" in n for n in result.notes)
    out = tmp_path / "c"
    assert main(["compare", str(tmp_path / "run"), str(tmp_path / "bench"), "--out", str(out)]) == 0
    assert "(NOT checked): grad_unreduced" in (out / "compare.html").read_text()
    assert "no divergence in the cells compared; NOT checked (0 cells compared): grad_unreduced" in (
        capsys.readouterr().out
    )


def test_family_xrank_is_said_to_be_read_automatically(tmp_path):
    """`--family xrank` said "not in run" though xrank files were there."""
    rank = tmp_path / "x" / "Jan01_00-00-00-rank0-x"
    _write_csv(rank / "grad_reduced_0-0.csv", "vpp_stage,name,step,norm", ["0,w,0,1.0"])
    _write_csv(rank / "xrank_0-0.csv", "vpp_stage,name,step,norm", ["0,w,0,1.0"])
    assert "xrank" in open_run(tmp_path / "x").families()
    with pytest.raises(KeyError, match="read automatically"):
        analyze(tmp_path / "x", families=["xrank"], progress=False)


def _as_ranks(run: dict, dest: Path, ranks: list[int], world_size: int) -> Path:
    """A CSV run folder of `ranks`, each a copy of the single rank's folder, layout.json rewritten."""
    src = _rank_dir(Path(run["out"]))
    for rank in ranks:
        target = dest / src.name.replace("-rank0-", f"-rank{rank}-")
        shutil.copytree(src, target)
        layout = json.loads((target / "layout.json").read_text())
        (target / "layout.json").write_text(json.dumps({**layout, "rank": rank, "world_size": world_size}))
        (target / "parquet.json").unlink(missing_ok=True)  # CSV only: its pointer names the original dataset
    return dest


def test_missing_ranks_are_said_by_analyze_and_compare(run, tmp_path, capsys):
    """D3: layout.json says world_size 3; the folder has ranks 0 and 1 only."""
    part = _as_ranks(run, tmp_path / "part", [0, 1], 3)
    full = _as_ranks(run, tmp_path / "full", [0, 1, 2], 3)
    assert not [n for n in open_run(full).notes if "missing" in n]
    assert main(["analyze", str(part), "--out", str(tmp_path / "a")]) == 0
    assert "note: ranks [2] of world_size 3 are missing" in capsys.readouterr().out
    main(["compare", str(full), str(part), "--out", str(tmp_path / "c")])
    printed = capsys.readouterr().out
    assert "note (benchmark): ranks [2] of world_size 3 are missing" in printed, printed
    assert "different ranks: run [0, 1, 2], benchmark [0, 1]" in printed, printed
    # Parquet read from the output directory: the dataset has rank 0; layout.json now says 2 ranks
    root = _copy(run, tmp_path / "pq")
    layout = _rank_dir(root) / "layout.json"
    layout.write_text(json.dumps({**json.loads(layout.read_text()), "world_size": 2}))
    source = open_run(root)
    assert source.kind == "parquet"
    assert any("ranks [1] of world_size 2 are missing" in n for n in source.notes), source.notes


def test_ranks_option_restricts_anomalies_and_run_description(run, tmp_path):
    """D7: `--ranks 1` read rank 1's rows but reported every rank's anomaly records, ranks and families."""
    root = _as_ranks(run, tmp_path / "two", [0, 1], 2)
    rank1 = Path(glob.glob(str(root / "*-rank1-*"))[0])
    for path in rank1.glob("*.csv"):
        if not path.name.startswith("grad_unreduced_"):
            path.unlink()
    run_id = open_run(root).files[0].run_id
    anomalies = root / "anomaly_detected"
    anomalies.mkdir()
    written = {0: 3, 1: 2}
    for rank, count in written.items():
        lines = [
            json.dumps(
                {"rank": rank, "step": s, "family": "grad_unreduced", "name": "x", "rule": "AnomalyNan"}
                | {"run_id": run_id, "time": 0.0, "micro_step": 0, "call_order": 0}
            )
            for s in range(count)
        ]
        (anomalies / f"anomaly_rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "a"
    assert main(["analyze", str(root), "--ranks", "1", "--out", str(out)]) == 0
    found = _findings(out)
    families_rank1 = sorted({f.family for f in open_run(root).files if f.rank == 1})
    assert found["run"]["ranks"] == [1]
    assert sorted(found["run"]["families"]) == families_rank1, found["run"]["families"]
    assert found["anomalies"]["count"] == written[1]
    assert {a["rank"] for a in found["anomalies"]["first"]} == {1}
    assert len(analyze(root, progress=False).anomalies) == sum(written.values())


def test_csv_with_later_steps_than_parquet_is_said(run, tmp_path, capsys):
    """D11: CSV is written step by step, Parquet by part: a killed job has later steps in CSV only."""
    root = _copy(run, tmp_path / "killed")
    assert not [n for n in open_run(root).notes if "later steps" in n]  # both end at the same step
    last = None
    for path in _rank_dir(root).glob("*.csv"):
        header, rows = _rows(path)
        if "step" not in header:
            continue
        at = header.index("step")
        end = max(int(r[at]) for r in rows)
        extra = [
            [str(end + k) if i == at else c for i, c in enumerate(r)]
            for k in (1, 2)
            for r in rows
            if int(r[at]) == end
        ]
        _write_rows(path, header, rows + extra)
        last = end if last is None else max(last, end)
    pq_last = max(f.last_step for f in open_run(root).files)
    assert pq_last == last
    assert main(["analyze", str(root), "--out", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert f"later steps {last + 1}-{last + 2}" in printed and "--format csv" in printed, printed


def test_first_step_2x_is_an_integer_or_null(run, tmp_path):
    """D4: pandas makes a step column with a None float: findings.json wrote 8.0 and "nan"."""
    table = pd.DataFrame({"layer": ["a", "b"], "first_step_2x": [3, None]})
    assert records(table) == [{"layer": "a", "first_step_2x": 3}, {"layer": "b", "first_step_2x": None}]
    out = tmp_path / "a"
    assert main(["analyze", str(run["out"]), "--out", str(out)]) == 0
    result = analyze(run["out"], progress=False)
    for fam, entry in _findings(out)["growth"].items():
        want = result.growth[fam]["first_step_2x"].tolist()
        got = [r["first_step_2x"] for r in entry["top"]]
        assert got == [None if pd.isna(w) else int(w) for w in want], (fam, got)
        assert all(v is None or type(v) is int for v in got), got


def test_a_bad_option_error_names_only_that_option(run, capsys):
    """D5: one try parsed --steps and --ranks: an error blamed both."""
    assert main(["analyze", str(run["out"]), "--steps", "8-3"]) == 2
    err = capsys.readouterr().err
    assert "--steps '8-3'" in err and "--ranks" not in err, err
    assert main(["analyze", str(run["out"]), "--ranks", "abc"]) == 2
    err = capsys.readouterr().err
    assert "--ranks 'abc'" in err and "--steps" not in err, err


def test_restart_note_names_the_option_and_the_run_ids(run, tmp_path):
    """The note said "Pass run_id" (the CLI flag is --run-id) and listed no run ids."""
    root = _copy(run, tmp_path / "restart")
    src = _rank_dir(root)
    old_id = src.name.rsplit("-", 1)[1]
    shutil.copytree(src, root / src.name.replace(old_id, "second"))
    notes = [n for n in open_run(root, prefer="csv").notes if "more than one run id" in n]
    assert notes and "--run-id" in notes[0] and str(sorted([old_id, "second"])) in notes[0], notes


def test_a_reused_out_keeps_no_divergence_plot_of_an_earlier_compare(tmp_path):
    """compare into an --out that held an earlier divergent comparison: its diverge_*.png stayed beside a
    compare.html saying "no divergence". Files the earlier report did not list are left alone."""
    for side, value in (("run", 1.0), ("bench", 1.0), ("other", 5.0)):
        rank = tmp_path / side / f"Jan01_00-00-00-rank0-{side}"
        _write_csv(
            rank / "grad_reduced_0-2.csv", "vpp_stage,name,step,norm", [f"0,w,{s},{value}" for s in range(3)]
        )
    out = tmp_path / "c"
    assert main(["compare", str(tmp_path / "other"), str(tmp_path / "bench"), "--out", str(out)]) == 1
    plots = sorted(p.name for p in out.glob("*.png"))
    assert plots, "the divergent comparison drew no plot"
    (out / "mine.png").write_bytes(b"not the report's")
    assert main(["compare", str(tmp_path / "run"), str(tmp_path / "bench"), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["mine.png"]


def test_format_csv_on_a_parquet_only_folder_says_what_is_there(run, tmp_path, capsys):
    """Before: "expected a Parquet dataset ... or CSV files", though the folder held a Parquet dataset."""
    dataset = tmp_path / "pq"
    assert main(["convert", str(run["out"]), str(dataset)]) == 0
    assert main(["analyze", str(dataset), "--format", "csv", "--out", str(tmp_path / "a")]) == 2
    said = capsys.readouterr().err
    assert "no CSV files" in said and "holds a Parquet dataset: leave out --format csv" in said, said
    assert main(["analyze", str(dataset), "--out", str(tmp_path / "b")]) == 0  # as it says


def test_unreadable_anomaly_lines_are_counted_and_said(tmp_path, caplog):
    """Lines of an anomaly file that are not JSON (one cut by a crash, one damaged in the middle) were
    skipped silently: the readable records are kept and the skipped ones said, with the file."""
    import logging

    from trainermon.pipeline.anomaly_files import load_anomalies

    good = [
        json.dumps({"rank": 0, "step": s, "family": "actv", "name": "x", "rule": "AnomalyNan"})
        for s in (0, 1)
    ]
    path = tmp_path / "anomaly_rank0.jsonl"
    path.write_text("\n".join([good[0], "{damaged", good[1], '{"rank": 0, "st']) + "\n")
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        records = load_anomalies(str(tmp_path))
    assert [r["step"] for r in records] == [0, 1]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "anomaly_rank0.jsonl: 2 unreadable line(s) skipped" in said[0], said
