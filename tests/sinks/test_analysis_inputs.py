"""`trainermon analyze` / `compare` on the inputs a long job leaves behind (found by a review at scale):
damaged files, a report directory that cannot be made, a restart in one output directory, a format
switched between restarts, and a run whose tensors turned NaN. Errors are one line naming what is wrong,
exit 2 (for `compare`, 1 means "diverged": a traceback's 1 read as a divergence)."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from tests.sinks.test_analysis import train
from trainermon.analysis import analyze, open_run
from trainermon.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("inputs") / "base", steps=6)


def _copy(run: dict, dest) -> str:
    shutil.copytree(run["out"], dest)
    return str(dest)


def _one_line_error(capsys, *names: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err and len(err.splitlines()) == 1, err
    for name in names:
        assert name in err, (name, err)
    return err


@pytest.mark.parametrize("engine", ["pyarrow", "duckdb"])
def test_a_damaged_parquet_part_is_an_error_naming_it(run, tmp_path, capsys, engine):
    root = _copy(run, tmp_path / "damaged")
    part = sorted(glob.glob(os.path.join(root, "**", "part-*.parquet"), recursive=True))[0]
    with open(part, "r+b") as fh:
        fh.truncate(300)
    assert main(["analyze", root, "--engine", engine, "--out", str(tmp_path / "a")]) == 2
    _one_line_error(capsys)
    assert main(["compare", root, str(run["out"]), "--engine", engine, "--out", str(tmp_path / "c")]) == 2
    _one_line_error(capsys)


def test_a_truncated_csv_line_names_its_file(run, tmp_path, capsys):
    root = _copy(run, tmp_path / "cut")
    path = sorted(glob.glob(os.path.join(root, "*", "grad_reduced_*.csv")))[0]
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size - 17)  # the last row loses its last columns
    assert main(["analyze", root, "--format", "csv", "--out", str(tmp_path / "a")]) == 2
    _one_line_error(capsys, os.path.basename(path))


def test_an_empty_csv_file_is_skipped_and_said(run, tmp_path, capsys):
    """A 0-byte file (an older writer killed between creating a file and writing its header) no longer
    stops the analysis of everything else; the writer itself now creates a file with its first rows."""
    root = _copy(run, tmp_path / "empty")
    rank_dir = os.path.dirname(sorted(glob.glob(os.path.join(root, "*", "grad_reduced_*.csv")))[0])
    open(os.path.join(rank_dir, "grad_reduced_99-99.csv"), "w").close()
    source = open_run(root, prefer="csv")
    assert any("1 empty CSV files" in note for note in source.notes), source.notes
    assert main(["analyze", root, "--format", "csv", "--out", str(tmp_path / "a")]) == 0
    assert "grad_reduced_99-99.csv" in capsys.readouterr().out


def test_a_new_csv_file_appears_with_its_header_and_rows():
    """The exporter's file is made by the write that carries the header and the first rows: a kill at
    any point leaves no file without its header."""
    import tempfile

    from exporters.row_file import RowFile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "actv_0-0.csv")
        handle = RowFile(path, "vpp_stage,name,step\n")
        assert not os.path.exists(path) and not handle.gone()  # nothing on disk before rows
        handle.write("0,fc.output,0\n")
        handle.write(b"0,fc.output,1\n")
        handle.close()
        with open(path) as fh:
            assert fh.read() == "vpp_stage,name,step\n0,fc.output,0\n0,fc.output,1\n"


def test_a_report_directory_that_cannot_be_made(run, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = str(run["out"])
    assert main(["compare", out, out, "--out", str(blocker / "report")]) == 2
    _one_line_error(capsys, "--out", "report")
    assert main(["analyze", out, "--out", str(blocker / "report")]) == 2
    _one_line_error(capsys, "--out")


def test_a_restart_in_one_directory_can_be_compared_by_run_id(run, tmp_path, capsys):
    """Two runs of the job in one output directory (a restart): compare says so and, with --run-id,
    compares one run (before: a divergence at step 0 from rows combined across the runs, exit 1)."""
    second = train(tmp_path / "second", steps=6)
    both = _copy(run, tmp_path / "both")
    for entry in os.listdir(second["out"]):
        src = os.path.join(second["out"], entry)
        if os.path.isdir(src) and entry != "parquet" and not entry.startswith("."):
            shutil.copytree(src, os.path.join(both, entry))
    first_id = open_run(str(run["out"]), prefer="csv").files[0].run_id
    args = ["compare", both, str(run["out"]), "--format", "csv", "--out", str(tmp_path / "c")]
    code = main(args)
    printed = capsys.readouterr().out
    assert "note (run): ranks [0] hold rows of more than one run id" in printed, printed
    assert code in (0, 1)
    assert main([*args, "--run-id", first_id]) == 0
    assert "no divergence" in capsys.readouterr().out


def test_csv_files_the_parquet_dataset_lacks_are_said(run, tmp_path, capsys):
    """A format switched between restarts: the Parquet dataset lacks a family the CSV files hold. Auto
    mode reads the dataset and says what it leaves out (it dropped them without a word)."""
    root = _copy(run, tmp_path / "mixed")
    for part in glob.glob(os.path.join(root, "**", "family=exp_avg", "**", "*.parquet"), recursive=True):
        os.unlink(part)
    source = open_run(root)
    assert source.kind == "parquet"
    assert any("CSV files hold" in note and "--format csv" in note for note in source.notes), source.notes
    assert main(["analyze", root, "--out", str(tmp_path / "a")]) == 0
    assert "note: CSV files hold" in capsys.readouterr().out


def test_growth_leaves_out_cells_of_nan_tensors(tmp_path):
    """From a NaN input on, every parameter is NaN: its norm covers no element (0). Growth counted those
    cells as values (end 0, growth x0 for every layer); they are left out."""

    def nan_input(step, model):
        if step == 3:
            with torch.no_grad():
                for p in model.parameters():
                    p.grad[...] = float("nan")

    nan_run = train(tmp_path / "nan", steps=8, perturb=nan_input)
    result = analyze(open_run(str(nan_run["out"]), prefer="csv"), families=["param_origin"], progress=False)
    table = result.growth["param_origin"]
    assert len(table) and (table["end"] > 0).all() and (table["growth"] > 0).all(), table
