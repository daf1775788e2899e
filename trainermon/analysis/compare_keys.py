"""What `compare` could not line up within a family present in both runs: (step, micro_step) keys of
one run only (micro-steps recorded in one run, not the other), families with no cell compared, and why
nothing at all was compared."""

from __future__ import annotations

from typing import Any

import numpy as np

from .grid import split_key


def _label(keys: np.ndarray, limit: int = 5) -> str:
    """The first `limit` keys as (step, micro_step) pairs; "-" where a row has no micro-step."""
    steps, micros = split_key(keys[:limit])
    shown = ", ".join(f"({s}, {'-' if m < 0 else m})" for s, m in zip(steps.tolist(), micros.tolist()))
    return shown + (", ..." if len(keys) > limit else "")


def key_notes(family: str, keys_run: np.ndarray, keys_bench: np.ndarray, cells: int) -> list[str]:
    """Notes for `family`: its (step, micro_step) keys found in one run only (counted, the first few
    named), and, when no cell lined up, that the family was not compared at all (it must not read as
    agreeing)."""
    only_run = np.setdiff1d(keys_run, keys_bench)
    only_bench = np.setdiff1d(keys_bench, keys_run)
    notes = []
    if len(only_run) or len(only_bench):
        notes.append(
            f"{family}: (step, micro_step) keys only in the run: {len(only_run)} [{_label(only_run)}], "
            f"only in the benchmark: {len(only_bench)} [{_label(only_bench)}]; their cells are not "
            "compared (micro-steps recorded in one run only?)"
        )
    if cells == 0:
        notes.append(
            f"{family}: 0 cells compared (no tensor has a (step, micro_step) and statistic in both runs): "
            "this family is NOT checked for divergence"
        )
    return notes


def rank_notes(run: Any, benchmark: Any) -> list[str]:
    """A note when the two runs hold rows of different ranks: cells combine every rank's rows, so a rank
    missing from one side (not copied, never written) makes its values partial, not a layout change."""
    ra, rb = run.ranks(), benchmark.ranks()
    if ra == rb:
        return []
    return [
        f"the runs hold rows of different ranks: run {ra[:20]}, benchmark {rb[:20]} (only in the run: "
        f"{sorted(set(ra) - set(rb))[:20]}, only in the benchmark: {sorted(set(rb) - set(ra))[:20]}); "
        "expected only when their parallel layouts differ"
    ]


class NothingCompared(ValueError):
    """The two runs share no (family, name, step) cell: a comparison would prove nothing."""


def nothing_compared(
    sum_a: Any,
    sum_b: Any,
    fam_a: list[str],
    fam_b: list[str],
    common: list[str],
    notes: list[str],
    wanted: list[str] | None = None,
    steps: tuple[int, int] | None = None,
) -> str:
    """fam_a, fam_b: every family of each run (before `wanted`, the families asked for, chose)."""
    empty = [label for label, s in (("run", sum_a), ("benchmark", sum_b)) if not s.rows_read]
    if steps is not None and common and empty:  # the step range, not a statistic, left nothing
        return f"no cell compared: steps {steps[0]}-{steps[1]} select no row of the {' or the '.join(empty)}"
    if not common:
        asked = "" if wanted is None else f" of those asked for ({wanted})"
        return f"no cell compared: the runs share no family{asked} (run: {fam_a}, benchmark: {fam_b})"
    unrecorded = [n for n in notes if n.endswith("not in both runs, not compared")]
    if unrecorded:  # the statistics asked for, not the names, are what is missing
        return "no cell compared: " + "; ".join(unrecorded)
    lines = ["no cell compared: the runs share no (family, name, step) with the statistics asked for"]
    for label, summary in (("run", sum_a), ("benchmark", sum_b)):
        grid = summary.grids[common[0]]
        names = [name for _, name in (grid.tensors.keys[i] for i in grid.finalize("cell").order)][:5]
        lines.append(f"  {label} {common[0]} names, e.g.: {names}")
    return "\n".join(lines)
