"""`trainermon convert` run again into the same OUT, OUT that is a file, `--rows-per-part`, and the
TensorBoard conversion's step order."""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

import pytest
import torch

import trainermon
from tests.helpers import LayeredNet, read_family, train_monitored, write_config
from trainermon.cli import main


def _rank_dir(root: Path, run_id: str = "abc123", rank: int = 0) -> Path:
    path = root / f"Dec01_10-00-00-rank{rank}-{run_id}"
    path.mkdir(parents=True)
    return path


def _write_csv(path: Path, steps: range, names: list[str], scale: float = 1.0) -> None:
    """A `grad_reduced` file: one row per name and step, norm = scale * (step + index of the name)."""
    lines = ["name,step,norm"] + [f"{n},{s},{scale * (s + i)}" for s in steps for i, n in enumerate(names)]
    path.write_text("\n".join(lines) + "\n")


def _part_rows(root: Path) -> list[tuple[str, list[int]]]:
    """(part file name, the steps of its rows) for every part under `root`."""
    import pyarrow.parquet as pq

    found = sorted(glob.glob(str(root / "family=*" / "rank=*" / "*.parquet")))
    return [(os.path.basename(f), pq.read_table(f, columns=["step"])["step"].to_pylist()) for f in found]


def test_reconvert_of_a_run_that_went_on_replaces_its_parts(tmp_path, monkeypatch, capsys):
    """Convert, training goes on, convert again: the first parts were kept beside the new ones, so every
    row of the first conversion was there twice. Another run's parts in the same OUT stay."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    config = write_config(
        tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], format="csv", step_count_per_record=2
    )
    torch.manual_seed(0)
    run_dir = train_monitored(config, LayeredNet(), lambda: torch.randn(4, 6), steps=6).run_dir
    partial = tmp_path / "partial" / os.path.basename(run_dir)
    shutil.copytree(run_dir, partial)
    for path in glob.glob(str(partial / "*_4-5.csv")):  # as the run was after 4 steps
        os.unlink(path)
    other = _rank_dir(tmp_path / "other", run_id="otherrun")
    _write_csv(other / "grad_reduced_0-1.csv", range(2), ["w"])
    out = tmp_path / "ds"
    assert main(["convert", str(other.parent), str(out)]) == 0
    assert main(["convert", str(partial.parent), str(out)]) == 0
    first = capsys.readouterr().out
    earlier = [f for f in glob.glob(str(out / "family=*" / "rank=0" / "*.parquet")) if "otherrun" not in f]
    assert main(["convert", str(tmp_path / "out"), str(out)]) == 0
    again = capsys.readouterr().out

    want = read_family(run_dir, "grad_reduced")
    got = trainermon.load(out, family="grad_reduced").to_pylist()
    mine = sorted((r["name"], r["step"], r["norm"]) for r in got if r["run_id"] != "otherrun")
    assert mine == sorted((r["name"], int(r["step"]), float(r["norm"])) for r in want)
    assert [(r["step"], r["norm"]) for r in got if r["run_id"] == "otherrun"] == [(0, 0.0), (1, 1.0)]
    assert earlier and "replaced" not in first and f"(replaced {len(earlier)} earlier part files)" in again


def test_a_crash_before_the_new_parts_are_complete_keeps_the_earlier_ones(tmp_path, monkeypatch):
    rank_dir = _rank_dir(tmp_path / "csv")
    _write_csv(rank_dir / "grad_reduced_0-4.csv", range(5), ["a", "b"])
    out = tmp_path / "ds"
    assert main(["convert", str(tmp_path / "csv"), str(out)]) == 0
    _write_csv(rank_dir / "grad_reduced_5-9.csv", range(5, 10), ["a", "b"])
    (rank_dir / "grad_reduced_10-14.csv").write_text("name,step,norm\na,10,not-a-number\n")
    assert main(["convert", str(tmp_path / "csv"), str(out), "--rows-per-part", "4"]) == 2
    assert trainermon.load(out).num_rows == 10  # the earlier conversion's rows, once each (and no more)


@pytest.mark.parametrize("to", ["parquet", "tensorboard"])
@pytest.mark.parametrize("below", ["", "sub"])
def test_an_out_that_is_a_file_is_an_argument_error(tmp_path, capsys, to, below):
    _write_csv(_rank_dir(tmp_path / "csv") / "grad_reduced_0-1.csv", range(2), ["w"])
    (tmp_path / "a_file").write_text("keep me\n")
    out = str(tmp_path / "a_file" / below) if below else str(tmp_path / "a_file")
    assert main(["convert", str(tmp_path / "csv"), out, "--to", to]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: OUT {out!r}") and "allowed: a directory (created if missing)" in err
    assert (tmp_path / "a_file").read_text() == "keep me\n"


def test_rows_per_part_bounds_parts_and_keeps_steps_whole(tmp_path, capsys):
    """A whole CSV file went into one part: 15 rows with `--rows-per-part 7`."""
    rank_dir = _rank_dir(tmp_path / "csv")
    _write_csv(rank_dir / "grad_reduced_0-4.csv", range(5), ["a", "b", "c"])
    _write_csv(rank_dir / "grad_reduced_5-9.csv", range(5, 10), ["a", "b", "c"])
    _write_csv(rank_dir / "actv_0-1.csv", range(2), [f"x{i}" for i in range(9)])  # a step of 9 rows
    assert main(["convert", str(tmp_path / "csv"), str(tmp_path / "ds"), "--rows-per-part", "7"]) == 0
    parts = _part_rows(tmp_path / "ds")
    grad = [steps for name, steps in parts if name in os.listdir(tmp_path / "ds/family=grad_reduced/rank=0")]
    assert grad == [[s for s in (a, a + 1) for _ in range(3)] for a in range(0, 10, 2)]  # 2 steps: 6 rows
    actv = [steps for steps in (s for _, s in parts) if steps not in grad]
    assert actv == [[0] * 9, [1] * 9]  # one step over the limit: alone in its part, not split
    assert [name.split("-")[1:3] for name, _ in parts][:1] == [["000000000000", "000000000000"]]
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    assert "whole steps" in " ".join(capsys.readouterr().out.split())


def _scalars(directory: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(directory, size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_to_tensorboard_writes_steps_in_order_and_replaces_its_own_events(tmp_path, capsys):
    """Files came in text order (`_10-14` before `_5-9`), and a second conversion added a second event
    file beside the first: every point twice."""
    pytest.importorskip("tensorboard", reason="the tensorboard package is in the test extras")
    rank_dir = _rank_dir(tmp_path / "csv")
    for first in (0, 5, 10):
        _write_csv(rank_dir / f"grad_reduced_{first}-{first + 4}.csv", range(first, first + 5), ["w"], 0.5)
    out = tmp_path / "tb"
    target, tag, want = (
        str(out / rank_dir.name),
        "0:w/rank0/post_grad_norm",
        [(s, 0.5 * s) for s in range(15)],
    )
    assert main(["convert", str(tmp_path / "csv"), str(out), "--to", "tensorboard"]) == 0
    assert "replaced" not in capsys.readouterr().out
    assert _scalars(target, tag) == want
    assert main(["convert", str(tmp_path / "csv"), str(out), "--to", "tensorboard"]) == 0
    assert "(replaced 1 earlier event files)" in capsys.readouterr().out
    assert _scalars(target, tag) == want and len(os.listdir(target)) == 1


def test_to_tensorboard_refuses_a_directory_with_other_event_files(tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="the tensorboard package is in the test extras")
    from torch.utils.tensorboard import SummaryWriter

    rank_dir = _rank_dir(tmp_path / "csv")
    _write_csv(rank_dir / "grad_reduced_0-1.csv", range(2), ["w"])
    with SummaryWriter(str(tmp_path / "tb" / rank_dir.name)) as sink:  # as the TensorBoard sink writes
        sink.add_scalar("0:w/rank0/post_grad_norm", 7.0, 0)
    assert main(["convert", str(tmp_path / "csv"), str(tmp_path / "tb"), "--to", "tensorboard"]) == 2
    err = capsys.readouterr().err
    assert f"error: OUT {str(tmp_path / 'tb')!r}" in err and "trainermon convert did not write" in err
    assert _scalars(str(tmp_path / "tb" / rank_dir.name), "0:w/rank0/post_grad_norm") == [(0, 7.0)]


def test_the_exporters_own_parts_and_two_directories_of_one_run_are_refused(tmp_path, monkeypatch, capsys):
    """Review of the re-conversion: converting a run's CSV into its own Parquet dataset removed the
    exporter's parts of that run (steps 2-3 lost), and two bare `rank0` directories (one run id) removed
    each other's parts. Both are refused now, before anything is written; nothing is lost."""
    import trainermon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    config = write_config(
        tmp_path / "cfg.json",
        wg_distribution=True,
        ops=["norm"],
        format=["csv", "parquet"],
        step_count_per_record=2,
    )
    torch.manual_seed(0)
    run_dir = train_monitored(config, LayeredNet(), lambda: torch.randn(4, 6), steps=4).run_dir
    dataset = tmp_path / "out" / "parquet"
    before = trainermon.load(dataset, family="grad_reduced")
    assert sorted(set(before["step"].to_pylist())) == [0, 1, 2, 3]
    assert main(["convert", os.path.dirname(run_dir), str(dataset)]) == 2
    assert "convert did not write (the Parquet exporter's" in capsys.readouterr().err
    assert trainermon.load(dataset, family="grad_reduced").equals(before)
    for run in ("runA", "runB"):
        (tmp_path / "csv" / run / "rank0").mkdir(parents=True)
    _write_csv(tmp_path / "csv" / "runA" / "rank0" / "grad_reduced_0-1.csv", range(2), ["w"])
    _write_csv(tmp_path / "csv" / "runB" / "rank0" / "grad_reduced_5-6.csv", range(5, 7), ["w"])
    for to in ("parquet", "tensorboard"):
        assert main(["convert", str(tmp_path / "csv"), str(tmp_path / f"two-{to}"), "--to", to]) == 2
        assert "rank0" in capsys.readouterr().err
    assert not glob.glob(str(tmp_path / "two-parquet" / "family=*"))


def test_a_failed_tensorboard_reconversion_leaves_the_earlier_events_alone(tmp_path, capsys):
    """A bad CSV file met on the second conversion left a partial event file beside the earlier one:
    every point read twice."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rank = _rank_dir(tmp_path / "csv")
    _write_csv(rank / "grad_reduced_0-1.csv", range(2), ["w"])
    out = tmp_path / "tb"
    assert main(["convert", str(rank.parent), str(out), "--to", "tensorboard"]) == 0
    (rank / "grad_reduced_2-3.csv").write_text("name,step,norm\nw,2,1.0\nw,3\n")  # cut by a crash
    assert main(["convert", str(rank.parent), str(out), "--to", "tensorboard"]) == 2
    acc = EventAccumulator(str(out / rank.name))
    acc.Reload()
    (tag,) = [t for t in acc.Tags()["scalars"] if t.endswith("_norm")]
    assert [(e.step, e.value) for e in acc.Scalars(tag)] == [(0, 0.0), (1, 1.0)]
