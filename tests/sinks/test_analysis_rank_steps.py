"""A rank whose `grad_reduced` rows stop before the other ranks' (a tensor-parallel peer killed before
its writer wrote its last steps): the global norm of those steps covers the other ranks' shards only and
reads low. It used to say nothing; every engine now names the rank and the steps."""

from __future__ import annotations

import os

import numpy as np
import pytest

from trainermon.analysis import analyze, scan
from trainermon.analysis.rank_steps import missing_steps_note
from trainermon.analysis.synthetic import write_synthetic_dataset


def _dataset(root, drop_last_part_of_rank: int | None):
    write_synthetic_dataset(root, ranks=2, steps=20, tensors=8, steps_per_part=5)
    if drop_last_part_of_rank is not None:
        folder = os.path.join(root, "family=grad_reduced", f"rank={drop_last_part_of_rank}")
        (last,) = [p for p in os.listdir(folder) if p.startswith("part-000000000015-")]
        os.remove(os.path.join(folder, last))  # a killed writer: its last part was never closed
    return root


def _engines() -> list[str]:
    engines = ["pyarrow"]
    try:
        import duckdb  # noqa: F401

        engines.append("duckdb")
    except ImportError:
        pass
    return engines


@pytest.mark.parametrize("engine", _engines())
def test_a_rank_stopping_early_is_named_with_its_missing_steps(tmp_path, engine):
    cut = analyze(_dataset(tmp_path / "cut", 1), engine=engine)
    (note,) = [n for n in cut.summary.notes if "grad_reduced rows missing" in n]
    assert "rank 1 has none at 5 of 20 steps, after its last step 14 (steps 15, 16, 17, 18, 19)" in note
    assert "rank 0" not in note
    whole = analyze(_dataset(tmp_path / "whole", None), engine=engine)
    assert not [n for n in whole.summary.notes if "grad_reduced rows missing" in n]
    # what the note warns of: from step 15 the norm is rank 0's shards alone, lower than the whole
    rank0 = analyze(str(tmp_path / "whole"), engine=engine, ranks=[0]).global_norm
    assert np.allclose(cut.global_norm.loc[15:], rank0.loc[15:], rtol=1e-12)
    assert (cut.global_norm.loc[15:] < whole.global_norm.loc[15:]).all()
    assert np.allclose(cut.global_norm.loc[:14], whole.global_norm.loc[:14], rtol=1e-12)


def test_steps_missing_in_the_middle_and_the_scan_alone(tmp_path):
    root = _dataset(tmp_path / "mid", None)
    folder = os.path.join(root, "family=grad_reduced", "rank=0")
    (middle,) = [p for p in os.listdir(folder) if p.startswith("part-000000000005-")]
    os.remove(os.path.join(folder, middle))
    notes = scan(root).notes
    (note,) = [n for n in notes if "grad_reduced rows missing" in n]
    assert "rank 0 has none at 5 of 20 steps (steps 5, 6, 7, 8, 9)" in note, note


def test_the_note_names_at_most_a_few_steps_and_needs_two_ranks():
    many = missing_steps_note({0: list(range(100)), 1: list(range(10))})
    assert many is not None
    expected = "rank 1 has none at 90 of 100 steps, after its last step 9 (steps 10, 11, 12, 13, 14, 15, ...)"
    assert expected in many
    assert missing_steps_note({0: [1, 2, 3]}) is None
    assert missing_steps_note({0: [1, 2], 1: [1, 2]}) is None
