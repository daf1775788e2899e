"""What `compare.json` writes for a family without divergence, and what docs/ANALYSIS.md says `--ranks`
applies to (found by an audit: "nan" for a missing name; `--ranks` claimed for `compare`, which has none)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from trainermon.analysis import compare
from trainermon.analysis.jsonutil import records
from trainermon.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "ANALYSIS.md"


def _write_csv(path: Path, rows: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(["vpp_stage,name,step,norm", *rows]) + "\n")


def test_a_family_without_divergence_has_a_null_first_tensor_in_compare_json(tmp_path, capsys):
    """pandas holds None as NaN in a text column: compare.json once wrote "nan" for it."""
    for side, norm in (("run", 2.0), ("bench", 1.0)):
        rank_dir = tmp_path / side / f"Jan01_00-00-00-rank0-{side}"
        _write_csv(rank_dir / "grad_reduced_0-1.csv", ["0,a.weight,0,1.0", f"0,a.weight,1,{norm}"])
        _write_csv(rank_dir / "exp_avg_0-1.csv", [f"0,a.weight,{s},1.0" for s in (0, 1)])
    code = main(["compare", str(tmp_path / "run"), str(tmp_path / "bench"), "--out", str(tmp_path / "o")])
    capsys.readouterr()
    assert code == 1  # diverged
    found = {r["family"]: r for r in json.loads((tmp_path / "o" / "compare.json").read_text())["per_family"]}
    assert found["grad_reduced"]["first_divergent_tensor"] == "a.weight"
    assert found["exp_avg"]["first_divergent_tensor"] is None, found["exp_avg"]
    assert found["exp_avg"]["first_divergent_step"] is None, found["exp_avg"]
    table = pd.DataFrame({"name": pd.Series(["x", None], dtype="str"), "ratio": [float("nan"), 1.0]})
    assert records(table) == [{"name": "x", "ratio": "nan"}, {"name": None, "ratio": 1.0}]


def test_ranks_is_said_of_analyze_only():
    """`compare` reads every rank: no `--ranks`, no `ranks=`; outside the `analyze` section the doc names
    `--ranks` / `ranks=` only together with `analyze`."""
    assert "ranks" not in inspect.signature(compare).parameters
    with pytest.raises(SystemExit) as exc:
        main(["compare", "a", "b", "--ranks", "0"])
    assert exc.value.code == 2
    for section in DOC.read_text().split("\n## ")[1:]:
        if section.startswith("`trainermon analyze"):
            continue
        for sentence in re.split(r"(?<=\.)\s+", " ".join(section.split())):
            if "`--ranks`" in sentence or "`ranks=`" in sentence:
                assert "analyze" in sentence, sentence
