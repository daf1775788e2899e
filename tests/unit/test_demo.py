"""The demo's closing summary reads each family's own CSV files back."""

from __future__ import annotations

from trainermon.demo import summarize


def _write(path, rows: list[tuple[int, str, float]]) -> None:
    lines = ["vpp_stage,name,step,norm"] + [f"0,{name},{step},{norm}" for step, name, norm in rows]
    path.write_text("\n".join(lines) + "\n")


def test_summary_takes_each_familys_rows_not_a_longer_namesakes(tmp_path):
    """`exp_avg` and `exp_avg_sq`, `actv` and `actv_grad` share a prefix; each heading shows its own."""
    _write(tmp_path / "exp_avg_0-0.csv", [(0, "w", 0.5)])
    _write(tmp_path / "exp_avg_sq_0-0.csv", [(0, "w", 2.5e-5)])
    _write(tmp_path / "actv_0-0.csv", [(0, "fc.output", 162.0)])
    _write(tmp_path / "actv_grad_0-0.csv", [(0, "fc.output", 0.02)])
    _write(tmp_path / "grad_reduced_0-1.csv", [(0, "w", 1.0), (1, "w", 3.0), (1, "b", 4.0)])
    lines = summarize(str(tmp_path))
    text = "\n".join(lines)
    assert "0.5  w" in text and "2.5e-05" not in text, text
    assert "162  fc.output" in text and "0.02" not in text, text
    # the last step's rows, largest norm first
    heading = lines.index("  grad_reduced (step 1), largest norms:")
    assert lines[heading + 1 : heading + 3] == [f"    {4.0:12.6g}  b", f"    {3.0:12.6g}  w"], lines
