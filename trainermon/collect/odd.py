"""Rows for tensors the engine refuses but whose gradient statistics still have a meaning: complex gradients.

A complex gradient's norm is that of its moduli |z| (what `clip_grad_norm_` and `get_total_norm` use), so
its grad rows are the statistics of |z| (norm, mean, min, max, nans, infs, zeros of the moduli: min and
max are not defined on complex numbers, and NaN there would read as a non-finite gradient to the anomaly
rules). The global gradient norm then counts it exactly. Other refused tensors keep no row (the caller
counts and tells them).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("trainermon")

#: Families whose complex tensors get rows of their moduli (the rows the global gradient norm sums).
GRAD_FAMILIES = frozenset(("grad_reduced", "grad_unreduced"))
_MAX_TOLD = 1000  # names told of; past that, complex rows are still written, without a line


def complex_rows(
    engine: Any,
    partials: torch.Tensor,
    skipped: dict[int, Any],
    rows: list[tuple[Any, int]],
    tensors: list[torch.Tensor],
    told: set[str],
) -> None:
    """In place: for each complex tensor in `skipped` (row index -> why), write the row of its moduli
    into `partials` and take it out of `skipped`. Told once per tensor name (`told`). Cost: one real copy
    of each complex gradient (|z|) and one engine call each, on collected steps that have one."""
    for i in [i for i, why in skipped.items() if why.kind == "complex tensor"]:
        t = tensors[i]
        try:
            with torch.no_grad():
                moduli = t.abs()
            row, bad = engine.compute_rows([moduli])
        except Exception:  # noqa: BLE001 - the row stays refused: counted and told by the caller
            continue
        if bad:
            continue
        partials[i] = row[0].to(partials.device)
        del skipped[i]
        name = rows[i][0].name
        if name not in told and len(told) < _MAX_TOLD:
            told.add(name)
            logger.warning(
                "trainermon: complex gradient %s (%s): its grad rows are the statistics of its moduli |z| "
                "(the global gradient norm counts it, as clip_grad_norm_ does) (told once per tensor)",
                name,
                t.dtype,
            )
