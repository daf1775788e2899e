"""The offline tools on a dynamic run whose reloads opened new run directories (same run id): a config edit
that changes the columns or the sinks renews the rank's directory, so one run's steps lie in several
directories, and a format switch (csv -> parquet -> csv) puts some in a Parquet dataset. Every tool reads
every step: `csv2tensorboard_by_step` (it kept only the last directory), `trainermon convert` (it refused
two directories of one run) and `trainermon analyze` (auto: it read the Parquet steps only). References:
the CSV rows read with pandas, the Parquet rows read with pyarrow."""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Callable

import pandas as pd
import pytest

from tests.unit.dynamic_common import BASE, _train, _wait_dirty
from trainermon import TrainerMon, csv2tensorboard_by_step
from trainermon.analysis import open_run
from trainermon.cli import main
from trainermon.convert import convert
from trainermon.runtime.control import update_config_file

STEPS = 10


def _edit(path: str, **changes) -> Callable[[TrainerMon], None]:
    def act(monitor: TrainerMon) -> None:
        update_config_file(path, **changes)
        _wait_dirty(monitor)

    return act


@pytest.fixture
def run(tmp_path, out_dir, dynamic_mode):
    """10 steps of one process: CSV (norm), then Parquet, then CSV with max added. Edits made before step
    i apply from i + 1: CSV 0-2, Parquet 3-5, CSV 6-9, in three directories of one run id."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**BASE, "dynamic_on": True, "format": "csv", "write_interval_s": 0}))
    edits = {2: _edit(str(cfg), format="parquet"), 5: _edit(str(cfg), format="csv", ops=["norm", "max"])}
    _train(str(cfg), STEPS, edits)
    dirs = sorted(glob.glob(os.path.join(str(out_dir), "*-rank0-*")))
    assert len(dirs) == 3 and len({d.rsplit("-", 1)[1] for d in dirs}) == 1, dirs  # one run id
    return str(out_dir), dirs


def _csv_rows(dirs: list[str], family: str = "grad_reduced") -> pd.DataFrame:
    files = [p for d in dirs for p in sorted(glob.glob(os.path.join(d, f"{family}_*.csv")))]
    return pd.concat([pd.read_csv(p) for p in files], ignore_index=True)


def _parquet_rows(root: str, family: str = "grad_reduced") -> pd.DataFrame:
    import pyarrow.dataset as ds

    table = ds.dataset(os.path.join(root, f"family={family}"), format="parquet", partitioning="hive")
    return table.to_table(columns=["name", "step", "norm"]).to_pandas()


def _by_key(df: pd.DataFrame, stat: str = "norm") -> dict[tuple[str, int], float]:
    assert not df.duplicated(["name", "step"]).any()
    return {(n, int(s)): float(v) for n, s, v in zip(df["name"], df["step"], df[stat])}


def test_csv2tensorboard_by_step_reads_every_directory_of_the_run(run, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, dirs = run
    want = _csv_rows(dirs)
    assert sorted(set(want["step"])) == [0, 1, 2, 6, 7, 8, 9]  # the Parquet phase's steps are not CSV
    out = csv2tensorboard_by_step(root, data_type_list=["grad_reduced"], output_dirpath=str(tmp_path / "tb"))
    acc = EventAccumulator(os.path.join(out, "rank0", "grad_reduced"), size_guidance={"scalars": 0})
    acc.Reload()
    for stat in ("norm", "max"):
        rows = want.dropna(subset=[stat])
        got = {
            (tag.split(":", 1)[1].rsplit("/", 1)[0], e.step): e.value
            for tag in acc.Tags()["scalars"]
            if tag.endswith(f"/{stat}")
            for e in acc.Scalars(tag)
        }
        ref = _by_key(rows, stat)
        assert sorted(got) == sorted(ref), stat
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-6), (stat, key)


def test_convert_joins_the_directories_of_one_run(run, tmp_path):
    root, dirs = run
    convert(root, str(tmp_path / "pq"))
    got = _by_key(_parquet_rows(str(tmp_path / "pq")))
    assert got == _by_key(_csv_rows(dirs))  # every CSV row, exact
    assert main(["convert", root, str(tmp_path / "pq2")]) == 0


def test_convert_refuses_one_step_in_two_directories_of_a_run(run, tmp_path):
    root, dirs = run
    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("parquet"))
    first, last = (os.path.join(copy, os.path.basename(d)) for d in (dirs[0], dirs[2]))
    shutil.copy(os.path.join(first, "grad_reduced_1-1.csv"), last)  # step 1 in two directories
    with pytest.raises(ValueError, match="both hold step 1 of grad_reduced") as err:
        convert(copy, str(tmp_path / "pq"))
    assert os.path.basename(first) in str(err.value) and os.path.basename(last) in str(err.value)


def test_analyze_reads_the_csv_steps_beside_the_parquet_ones(run, tmp_path, capsys):
    root, dirs = run
    ref = {**_by_key(_csv_rows(dirs)), **_by_key(_parquet_rows(os.path.join(root, "parquet")))}
    assert sorted({s for _n, s in ref}) == list(range(STEPS))
    source = open_run(root)
    assert source.kind == "parquet"
    got: dict[tuple[str, int], float] = {}
    for batch in source.iter_batches(families=["grad_reduced"], stats=["norm"]):
        values, _valid = batch.stats["norm"]
        for code, step, value in zip(batch.codes, batch.step, values):
            key = (batch.tensors[code][1], int(step))
            assert key not in got, key  # each (name, step) once
            got[key] = float(value)
    assert sorted(got) == sorted(ref)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
    assert main(["analyze", root, "--out", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert "earlier steps 0-2, later steps 6-9" in printed and "stopped" not in printed, printed
    with open(tmp_path / "a" / "findings.json", encoding="utf-8") as fh:
        assert json.load(fh)["steps"] == {"first": 0, "last": STEPS - 1, "count": STEPS}


def test_a_step_bucket_shared_by_two_directories_and_by_a_parquet_part(tmp_path, out_dir, dynamic_mode):
    """Buckets of 4 steps: an edit at step 2 renews the directory inside bucket 0-3 (both directories hold
    `grad_reduced_0-3.csv`, steps 0-1 and 2-3), and Parquet from step 6 on shares bucket 4-7 with CSV."""
    cfg = tmp_path / "cfg.json"
    keys = {**BASE, "dynamic_on": True, "format": "csv", "write_interval_s": 0, "step_count_per_record": 4}
    cfg.write_text(json.dumps(keys))
    edits = {1: _edit(str(cfg), ops=["norm", "max"]), 5: _edit(str(cfg), format="parquet")}
    _train(str(cfg), STEPS, edits)
    dirs = sorted(glob.glob(os.path.join(str(out_dir), "*-rank0-*")))
    assert [sorted(os.path.basename(p) for p in glob.glob(d + "/grad_reduced_*")) for d in dirs[:2]] == [
        ["grad_reduced_0-3.csv"],
        ["grad_reduced_0-3.csv", "grad_reduced_4-7.csv"],
    ]
    want = _by_key(_csv_rows(dirs))
    assert sorted({s for _n, s in want}) == list(range(6))
    convert(str(out_dir), str(tmp_path / "pq"))
    assert _by_key(_parquet_rows(str(tmp_path / "pq"))) == want
    ref = {**want, **_by_key(_parquet_rows(os.path.join(str(out_dir), "parquet")))}
    assert sorted({s for _n, s in ref}) == list(range(STEPS))
    got = {}
    for batch in open_run(str(out_dir)).iter_batches(families=["grad_reduced"], stats=["norm"]):
        for code, step, value in zip(batch.codes, batch.step, batch.stats["norm"][0]):
            assert (batch.tensors[code][1], int(step)) not in got
            got[(batch.tensors[code][1], int(step))] = float(value)
    assert got == ref


def _said_steps(steps: list[int]) -> str:
    """The steps as the note writes them: "3-5", "3", "3-4, 7" (reference, built here)."""
    runs: list[list[int]] = []
    for s in sorted(steps):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def test_convert_and_csv2tb_name_the_steps_only_the_parquet_dataset_holds(run, tmp_path, caplog):
    """The Parquet phase's steps (3-5) are not CSV: convert and csv2tensorboard_by_step leave them out,
    and say so in one line per run naming family, rank and steps (they said nothing)."""
    root, dirs = run
    pq_steps = set(_parquet_rows(os.path.join(root, "parquet"))["step"])  # pyarrow, the monitor's parts
    csv_steps = set(_csv_rows(dirs)["step"])
    left = sorted(pq_steps - csv_steps)
    assert left == [3, 4, 5], left
    want = f"grad_reduced rank 0 steps {_said_steps(left)}"
    caplog.set_level("WARNING", logger="trainermon")
    written = convert(root, str(tmp_path / "pq"))
    assert any(
        want in r.getMessage() for r in caplog.records if r.getMessage().startswith("trainermon convert")
    ), caplog.text  # said (it said nothing)
    assert len(written.notes) == 1 and want in written.notes[0], written.notes
    assert "trainermon analyze" in written.notes[0] and "trainermon.load" in written.notes[0]
    assert sorted(set(_parquet_rows(str(tmp_path / "pq"))["step"])) == sorted(csv_steps)  # rows: CSV only
    caplog.clear()
    assert main(["convert", root, str(tmp_path / "pq2")]) == 0
    assert [r for r in caplog.records if want in r.getMessage()], caplog.text
    # one rank directory alone: the dataset is found beside it (its parent's parquet/)
    assert convert(dirs[0], str(tmp_path / "pq3")).notes == written.notes
    pytest.importorskip("tensorboard")
    caplog.clear()
    csv2tensorboard_by_step(root, data_type_list=["grad_reduced"], output_dirpath=str(tmp_path / "tb"))
    said = [r.getMessage() for r in caplog.records if "csv2tensorboard_by_step: rank 0" in r.getMessage()]
    assert len(said) == 1 and want in said[0], caplog.text
    caplog.clear()
    assert main(["convert", root, str(tmp_path / "tb2"), "--to", "tensorboard"]) == 0
    said = [r.getMessage() for r in caplog.records if want in r.getMessage()]
    assert len(said) == 1 and "grad_unreduced rank 0 steps 3-5" in said[0], caplog.text


def test_convert_names_parquet_steps_inside_a_csv_step_bucket(tmp_path, out_dir, dynamic_mode):
    """Buckets of 4 steps, Parquet from step 6: CSV bucket 4-7 holds steps 4-5 and the Parquet part steps
    6-9, so file-name ranges alone would hide 6-7; the note names the steps the CSV rows lack."""
    cfg = tmp_path / "cfg.json"
    keys = {**BASE, "dynamic_on": True, "format": "csv", "write_interval_s": 0, "step_count_per_record": 4}
    cfg.write_text(json.dumps(keys))
    _train(str(cfg), STEPS, {5: _edit(str(cfg), format="parquet")})
    dirs = sorted(glob.glob(os.path.join(str(out_dir), "*-rank0-*")))
    left = sorted(
        set(_parquet_rows(os.path.join(str(out_dir), "parquet"))["step"]) - set(_csv_rows(dirs)["step"])
    )
    assert left == [6, 7, 8, 9], left
    notes = convert(str(out_dir), str(tmp_path / "pq")).notes
    assert len(notes) == 1 and f"grad_reduced rank 0 steps {_said_steps(left)}" in notes[0], notes


def test_the_note_finds_a_parquet_dir_of_its_own_and_survives_a_damaged_pointer(
    tmp_path, out_dir, dynamic_mode
):
    """With `parquet.dir` set, only the Parquet phase's directory points at the dataset (it holds no CSV):
    the note still names the steps (it said nothing); a damaged pointer (`{}`) beside it leaves the
    conversion whole (it raised KeyError after writing)."""
    cfg = tmp_path / "cfg.json"
    keys = {**BASE, "dynamic_on": True, "format": "csv", "write_interval_s": 0, "parquet": {"dir": "pq"}}
    cfg.write_text(json.dumps(keys))
    _train(str(cfg), STEPS, {2: _edit(str(cfg), format="parquet"), 5: _edit(str(cfg), format="csv")})
    dirs = sorted(glob.glob(os.path.join(str(out_dir), "*-rank0-*")))
    left = sorted(set(_parquet_rows(os.path.join(str(out_dir), "pq"))["step"]) - set(_csv_rows(dirs)["step"]))
    assert left == [3, 4, 5], left
    notes = convert(str(out_dir), str(tmp_path / "out")).notes
    assert len(notes) == 1 and f"grad_reduced rank 0 steps {_said_steps(left)}" in notes[0], notes
    for d in dirs:
        if not glob.glob(os.path.join(d, "*.csv")):
            continue
        with open(os.path.join(d, "parquet.json"), "w") as fh:
            fh.write("{}")
    written = convert(str(out_dir), str(tmp_path / "out2"))
    assert sorted(set(_parquet_rows(str(tmp_path / "out2"))["step"])) == sorted(set(_csv_rows(dirs)["step"]))
    assert len(written.notes) == 1  # the Parquet-only directory's pointer still names the dataset
