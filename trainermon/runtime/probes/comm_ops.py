"""`cc_distribution.ops` that name no collective the job calls: `OpsSpy` counts, at the first collected
step after a (re)configure, the calls of the collectives `ops` leaves out, so that a warning can name
what the job does call. Also the comm probe's other one-time reports (`warn_unmatched`, `write_sites`)."""

from __future__ import annotations

import csv
import logging
import os
from collections import Counter
from typing import Any

from trainermon.comm.spec import BATCH_P2P

logger = logging.getLogger("trainermon")


class OpsSpy:
    """A `comm.patch.Recorder` in front of the comm recorder when `ops` is set, for the first collected
    step after a (re)configure only: a call of a watched collective goes on to it; one of another is
    counted by name and not recorded. Costs one Python call and a dict update per collective, on that
    step only (its end unwraps the collectives outside `ops`)."""

    def __init__(self, recorder: Any, wanted: set[str]) -> None:
        self.recorder, self.wanted = recorder, wanted
        self.seen: Counter[str] = Counter()  # collectives outside `ops` called while counting
        self.watched = 0  # calls of collectives in `ops`
        self.counting = True

    def active(self) -> bool:
        return self.recorder.active()

    def before(self, spec: Any, args: tuple, kwargs: dict) -> Any:
        if spec.config not in self.wanted:
            if self.counting:
                self.seen[spec.config] += 1
            return None
        self.watched += 1
        return self.recorder.before(spec, args, kwargs)

    def after(self, ctx: Any, result: Any) -> None:
        self.recorder.after(ctx, result)

    def before_batch(self, ops: list) -> Any:
        if BATCH_P2P not in self.wanted:
            if self.counting:
                self.seen[BATCH_P2P] += 1
            return None
        self.watched += 1
        return self.recorder.before_batch(ops)

    def after_batch(self, ctx: Any, works: Any) -> None:
        self.recorder.after_batch(ctx, works)

    def fault(self, where: str, exc: BaseException) -> None:
        self.recorder.fault(where, exc)

    def coalesced_done(self, cm: Any, async_ops: bool) -> None:
        self.recorder.coalesced_done(cm, async_ops)

    def verdict(self, step: int) -> str | None:
        """After the first collected step: the warning when no watched collective was called (else None);
        counting stops either way."""
        self.counting = False
        if self.watched:
            return None
        seen = ", ".join(f"{name} x{n}" for name, n in sorted(self.seen.items())) or "none"
        if "funcol" not in self.wanted:
            seen += " (functional collectives, DTensor's included, are counted only with 'funcol' in ops)"
        return (
            f"trainermon: cc_distribution.ops {sorted(self.wanted)} saw no call at step {step} (the first "
            f"collected step), so no comm rows; collectives the job called there: {seen}"
        )


def warn_unmatched(probe: Any) -> None:
    """A `cc_codeline` that matched no call site, with the sites seen (once)."""
    recorder = probe.recorder
    if recorder.unmatched and not any(recorder._matches.values()):  # noqa: SLF001
        probe._warn_once(  # noqa: SLF001
            "codeline",
            "trainermon: cc_distribution.cc_codeline %s matched no call site; sites seen: %s",
            list(recorder.config.cc_codeline),
            sorted(recorder.unmatched)[:20],
        )


def write_sites(probe: Any) -> None:
    """`cc_log_only`: the call sites seen, to comm_call_sites.csv in the run directory."""
    path = os.path.join(probe.loop.outputs.run_dir, "comm_call_sites.csv")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["op", "group", "site", "calls"])
            for (op, group, site), calls in sorted(probe.recorder.sites.items()):
                writer.writerow([op, group, site, calls])
    except OSError as exc:
        probe.loop.faults.record("cc_log_only", exc)
