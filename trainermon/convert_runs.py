"""`trainermon convert`: the directories of one rank and run id (a dynamic-mode reload that changes the
columns or the sinks opens a new one) joined into one run."""

from __future__ import annotations

import os

from trainermon.exporters.csv_files import FILE, RANK_DIR


def has_run_id(directory: str) -> bool:
    """The rank directory's name carries a run id (`{time}-rank{R}-{id}`), not `rank{R}` alone."""
    match = RANK_DIR.search(os.path.basename(os.path.normpath(directory)))
    return match is not None and bool(match.group("id"))


def step_order(family: str, rank: int, found: list[tuple[str, str]]) -> list[str]:
    """One family's files from several directories of one run, in step order. Files are named by step
    bucket, so two directories share a name when a reload fell inside a bucket: only those files are read
    (their steps), and a step in both is refused, naming both directories."""
    from .convert import _read_csv  # (convert imports this module)

    matches = [(FILE.match(os.path.basename(p)), d, p) for d, p in found]  # all match (find_csv_files)
    entries = [(int(m.group("first")), int(m.group("last")), d, p) for m, d, p in matches if m is not None]
    first_step: dict[str, int] = {}
    for i, (lo, hi, directory, path) in enumerate(entries):
        for lo2, hi2, directory2, path2 in entries[i + 1 :]:
            if directory2 == directory or lo2 > hi or hi2 < lo:
                continue
            steps, steps2 = ({int(r["step"]) for r in _read_csv(p)} for p in (path, path2))
            both = steps & steps2
            if both:
                raise ValueError(
                    f"trainermon convert: {directory!r} and {directory2!r} both hold step {min(both)} of "
                    f"{family} for rank {rank} of one run; allowed: each step of a rank and run in one "
                    "directory (convert them into separate OUTs)"
                )
            for p, s in ((path, steps), (path2, steps2)):
                first_step[p] = min(s, default=lo)
    entries.sort(key=lambda e: (e[0], first_step.get(e[3], e[0]), e[1]))
    return [path for _lo, _hi, _directory, path in entries]
