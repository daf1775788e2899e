"""Reading the anomaly record files (`anomaly_detected/anomaly_rank{R}.jsonl`) back: every rank and run
merged, in the order the anomalies happened. Used by `trainermon anomalies` and `analyze`; no torch."""

from __future__ import annotations

import json
import logging
import math
import os

_STAGE_ORDER = {"forward": 0, "backward": 1, "optimizer": 2}


def sort_key(rec: dict) -> tuple:
    """Order in which anomalies happened: step, micro-batch, forward < backward < optimizer, pipeline order
    (forward runs stage 0 first, backward the last stage first), then the order of calls in the step."""
    stage = rec.get("stage", "optimizer")
    pp = int(rec.get("pp_stage", 0))
    micro = rec.get("micro_step")
    # Rows with no micro_step (step-level gradients, optimizer state) happen after every micro-batch.
    return (
        int(rec["step"]),
        math.inf if micro is None else int(micro),
        _STAGE_ORDER.get(stage, 3),
        -pp if stage == "backward" else pp,
        int(rec.get("vpp_stage", 0)),
        int(rec.get("call_order", 0)),
        int(rec.get("rank", 0)),
    )


def in_order(records: list[dict]) -> list[dict]:
    """Records in the order they happened: run by run (restarts that share an output directory, in the
    order their first records were written), then `sort_key` within a run."""
    first: dict[str, float] = {}
    for rec in records:
        run = rec.get("run_id", "")
        first[run] = min(first.get(run, math.inf), float(rec.get("time", math.inf)))
    return sorted(
        records, key=lambda rec: (first[rec.get("run_id", "")], rec.get("run_id", ""), *sort_key(rec))
    )


def load_anomalies(
    directory: str, steps: tuple[int, int] | None = None, run_ids: set[str] | None = None
) -> list[dict]:
    """All anomaly records under `directory` (any depth), every rank merged, in the order they happened
    (`in_order`); `run_ids`: only these runs' records."""
    records = []
    for root, _dirs, files in os.walk(directory):
        for name in files:
            if not (name.startswith("anomaly_rank") and name.endswith(".jsonl")):
                continue
            path, unreadable = os.path.join(root, name), 0
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        unreadable += 1  # a line cut by a crash: skip it, keep the rest (said below)
                        continue
                    run = rec.get("run_id")  # None: a record of a version that did not write it (kept)
                    if run_ids is not None and run is not None and run not in run_ids:
                        continue
                    if steps is None or steps[0] <= int(rec["step"]) <= steps[1]:
                        records.append(rec)
            if unreadable:
                logging.getLogger("trainermon").warning(
                    "trainermon: %s: %d unreadable line(s) skipped (cut by a crash, or damaged)",
                    path,
                    unreadable,
                )
    return in_order(records)
