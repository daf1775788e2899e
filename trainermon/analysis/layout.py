"""Ranks a run should have: each trainermon rank directory holds a `layout.json` with its `rank` and
`world_size`. A run directory missing some ranks (not copied, a rank that never wrote) would otherwise be
analysed or compared as if it were the whole job."""

from __future__ import annotations

import json
import os
from typing import Any

from trainermon.exporters.csv_files import RANK_DIR
from trainermon.exporters.parquet_files import has_partitions


def _layout_dirs(path: str) -> list[str]:
    """Directories that may hold a `layout.json`: under `path`, and beside a dataset root given as RUN."""
    found = []
    for directory, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(("family=", "."))]
        if "layout.json" in names:
            found.append(directory)
    if has_partitions(path):  # RUN is `{out}/parquet`: the rank directories are in `{out}`
        parent = os.path.dirname(os.path.abspath(path))
        for entry in os.scandir(parent):
            if entry.is_dir() and os.path.isfile(os.path.join(entry.path, "layout.json")):
                found.append(entry.path)
    return found


def world_size(path: str, run_ids: set[str] | None = None) -> tuple[int | None, list[str]]:
    """(the largest world_size any rank's layout.json states, the directories read); None without one.
    run_ids: only rank directories of those runs (another job's in a reused output directory is not
    this run's)."""
    sizes, read = [], []
    for directory in _layout_dirs(path):
        match = RANK_DIR.search(os.path.basename(os.path.normpath(directory)))
        if run_ids is not None and match is not None and match.group("id") not in (None, *run_ids):
            continue
        try:
            with open(os.path.join(directory, "layout.json"), encoding="utf-8") as fh:
                size = json.load(fh).get("world_size")
        except (OSError, ValueError, AttributeError):
            continue  # unreadable or not ours: no claim about the ranks
        if isinstance(size, int) and size > 0:
            sizes.append(size)
            read.append(directory)
    return (max(sizes) if sizes else None), read


def missing_ranks_note(source: Any) -> str | None:
    """A note naming the ranks of world_size that `source` has no rows of, or None."""
    if "://" in str(source.path):  # object storage: no layout.json to read
        return None
    if RANK_DIR.search(os.path.basename(os.path.normpath(source.path))):
        return None  # one rank's directory, given on purpose
    runs = {f.run_id for f in source.files}
    size, _ = world_size(source.path, None if None in runs else runs)
    if size is None:
        return None
    missing = sorted(set(range(size)) - set(source.ranks()))
    if not missing:
        return None
    shown = f"{missing[:20]}" + (f" (and {len(missing) - 20} more)" if len(missing) > 20 else "")
    return (
        f"ranks {shown} of world_size {size} are missing (layout.json says world_size {size}; "
        f"{source.path!r} has rows of ranks {source.ranks()[:20]}): findings cover the ranks present only"
    )
