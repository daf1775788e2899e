"""`analyze` / `compare` on partial inputs an audit found read silently: a step missing grad_reduced rows,
micro-steps in one run only, ranks missing from a run folder, `--ranks` beside anomaly records, CSV
holding later steps than Parquet; and findings.json / option-error details."""

from __future__ import annotations

import csv
import glob
import json
import os
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


def test_a_parameter_without_a_gradient_at_some_steps_keeps_every_step(tmp_path, capsys):
    """Review of the session's first fix, which left a step out when it had fewer grad_reduced tensors
    than its neighbours: a parameter used every other step (a conditional branch, an unused MoE expert)
    has no gradient and no row then, and every such step dropped off the curve with a false "missing"
    note. Such a step's norm is exact (the absent gradient adds nothing): every step stays, equal to the
    norm of the gradients there were."""
    import torch

    from tests.helpers import write_config
    from trainermon import TrainerMon

    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
            h = self.a(x)
            return self.b(h) if step % 2 == 0 else h

    monkey = pytest.MonkeyPatch()
    monkey.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    try:
        torch.manual_seed(0)
        model = Branchy()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TrainerMon(
            write_config(tmp_path / "c.json", wg_distribution=True, ops=["norm"], ndigits=12)
        )
        monitor.set_monitor(model, optimizer=opt)
        norms = []
        for step in range(5):
            model(torch.randn(2, 4), step).square().sum().backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        monitor.close()
    finally:
        monkey.undo()
    out = tmp_path / "a"
    assert main(["analyze", str(tmp_path / "out"), "--out", str(out)]) == 0
    found = _findings(out)["global_grad_norm"]
    assert found["steps"] == list(range(5)) and "missing" not in capsys.readouterr().out
    assert found["values"] == pytest.approx(norms, rel=1e-6)


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


def test_another_jobs_output_in_the_same_directory_makes_no_false_note(tmp_path, monkeypatch):
    """Review: job 1 (CSV, 6 steps, its layout.json edited to world_size 4) and job 2 (CSV + Parquet,
    3 steps) in one output directory: job 2's dataset was said to lack CSV's "later steps 3-5" and ranks
    [1, 2, 3], both job 1's. A rank directory given on purpose gets no missing-rank note either."""
    import torch

    from tests.helpers import LayeredNet, train_monitored, write_config

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    first = train_monitored(
        write_config(tmp_path / "c1.json", wg_distribution=True, ops=["norm"], format=["csv"]),
        LayeredNet(),
        lambda: torch.randn(4, 6),
        steps=6,
    )
    layout = Path(first.run_dir) / "layout.json"
    layout.write_text(json.dumps({**json.loads(layout.read_text()), "world_size": 4}))
    train_monitored(
        write_config(tmp_path / "c2.json", wg_distribution=True, ops=["norm"], format=["csv", "parquet"]),
        LayeredNet(),
        lambda: torch.randn(4, 6),
        steps=3,
    )
    for path in (tmp_path / "out", tmp_path / "out" / "parquet"):
        source = open_run(path)
        assert source.kind == "parquet" and not source.notes, source.notes
    assert not open_run(first.run_dir).notes  # job 1's rank 0 alone, given on purpose
    assert (
        "ranks [1, 2, 3] of world_size 4 are missing"
        in open_run(
            tmp_path / "out", prefer="csv", run_id=os.path.basename(first.run_dir).rsplit("-", 1)[1]
        ).notes[0]
    )
