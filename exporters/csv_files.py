"""The CSV sink's files as the readers find them again: file and rank-directory names, the virtual
pipeline stage prefix of a name, and the `shape` cell.

Shared by `trainermon convert` and the analysis readers, so the layout that `exporters.csv` writes is
parsed in one place (`csv2tb` keeps msprobe's converter's own rules for run directories). No training
state here."""

from __future__ import annotations

import re

#: `{family}_{first}-{last}.csv`: one file per family and step bucket.
FILE = re.compile(r"^(?P<family>.+)_(?P<first>\d+)-(?P<last>\d+)\.csv$")
#: A run directory: `{time}-rank{R}-{run id}` (msprobe's layout), or `rank{R}` alone.
RANK_DIR = re.compile(r"rank(?P<rank>\d+)(?:-(?P<id>[^/\\]+))?$")
#: A name of a virtual pipeline stage other than 0: `{vpp_stage}:{name}`.
VPP_PREFIX = re.compile(r"^(?P<vpp>\d+):(?P<name>.*)$")
_INT = re.compile(r"-?\d+")


def shape_dims(text: str | None) -> list[int] | None:
    """The dimensions in a `shape` cell: "[4, 8]", "(4, 8)" and "torch.Size([4, 8])" alike; None when
    empty."""
    if text is None or text == "":
        return None
    return [int(v) for v in _INT.findall(text)]
