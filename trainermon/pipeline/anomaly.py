"""Anomaly rules, run on the background worker for every finalised step, and the per-rank record file.

Rules (msprobe's config: `"alert": {"rules": [{"rule_name": ..., "args": {...}}], "dump": true}`):

- `AnomalyTurbulence` (msprobe's rule): |norm| or |mean| (those in `ops`) above (1 + threshold) x the
  average of its earlier |values| that weights the past by 0.99 and is seeded by the first. Non-finite
  values are `AnomalyNan`'s: they neither fire nor enter the average (in msprobe a NaN poisons it for good).
- `AnomalyNan` (msprobe, fixed): NaN or Inf anywhere in the tensor (from the `nans`/`infs` counts when
  they are collected, else from a non-finite statistic), or |value| above `threshold` when one is given.
  Counts are never compared with the magnitude threshold.
- `AnomalyComm` (trainermon, with `cc_distribution`, no rule to configure): a collective's output broke
  what the collective promises (see `trainermon.comm.checks`).
- `AnomalySpike` (trainermon): log(norm) more than `z` robust deviations above the trend of the last
  `window` values (see `SpikeWindow`), after `warmup` values; per (family, name) and for the global
  gradient norm.
- `AnomalyUpdateRatio`, `AnomalyExpertCollapse`, `AnomalyLogitGrowth` (trainermon, training health): see
  `health_rules.py`.

Every statistic of every row is checked on its own, so anomalies on two statistics of one tensor are
two records. Records go to `{MONITOR_OUTPUT_DIR}/anomaly_detected/anomaly_rank{R}.jsonl`, appended one
line at a time and flushed (never rewritten), each with the job's `run_id`: runs that share an output
directory (restarts) share the file. `anomaly_files` reads them back in the order they happened: run by
run (the order their first records were written), then `sort_key` within a run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from trainermon.collect.records import StatBatch

from . import health_rules
from .anomaly_files import in_order, load_anomalies, sort_key  # noqa: F401 - where callers looked first
from .rule_specs import WARMUP, WINDOW, RuleSpec, parse_rules
from .spike_window import SpikeWindow

logger = logging.getLogger("trainermon")

STAGES = {"actv": "forward", "actv_grad": "backward", "grad_unreduced": "backward"}
GLOBAL_NORM = "global_grad_norm"
#: Families whose Inf/NaN a loss-scale overflow explains (the step is flagged `update_skipped`, not
#: `own_skip`: a loop that skips its own step on NaN gradients is told of them like any other step).
SCALED_GRAD_FAMILIES = ("actv_grad", "grad_unreduced", "grad_reduced")


def stage_of(family: str) -> str:
    return STAGES.get(family, "optimizer")


@dataclass(frozen=True)
class Anomaly:
    rank: int
    pp_stage: int
    vpp_stage: int
    step: int
    micro_step: int | None
    stage: str
    call_order: int
    family: str
    name: str
    stat: str
    value: float
    baseline: float | None
    rule: str
    time: float
    ranks: tuple[int, ...] = ()  # AnomalyComm: the ranks whose collective output broke its invariant


class AnomalyDetector:
    """Applies the configured rules to each StatBatch. Runs on the worker thread only."""

    def __init__(
        self,
        rules: list[RuleSpec],
        out_dir: str,
        rank: int,
        pp_stage: int = 0,
        dump: bool = True,
        log_limit_per_step: int = 3,
        run_id: str = "",
    ) -> None:
        self.rules = rules
        self.rank = rank
        self.run_id = run_id  # the job's (every rank's the same), written in each record
        self.pp_stage = pp_stage
        self.dump = dump  # msprobe's alert.dump: write each anomaly to the record file
        self.path = os.path.join(out_dir, "anomaly_detected", f"anomaly_rank{rank}.jsonl")
        self.counts: Counter[str] = Counter()
        self.log_limit = log_limit_per_step
        self._avg: dict[tuple, tuple[float, int]] = {}  # Turbulence: (average of |values|, count)
        #: The statistics the user's `ops` holds: Turbulence checks those of norm and mean (None: both).
        self.ops: tuple[str, ...] | None = None
        self._rolling: dict[tuple, SpikeWindow] = {}
        self._repeat = 0  # the rule being applied is the n-th of that name (its history is its own)
        self._fh: Any = None
        self.on_anomaly: list = []  # callbacks(step, anomalies) — escalation hooks in
        #: Records found elsewhere (AnomalyComm, on the training thread), reported with the next check.
        self.external: deque[Anomaly] = deque()

    @classmethod
    def for_job(
        cls,
        alert: Any,
        out_dir: str,
        rank: int,
        process_group: Any = None,
        run_id: str = "",
        ops: Iterable[str] | None = None,
    ) -> AnomalyDetector:
        """The detector of a monitor with the config's `alert` section and `ops`. `process_group`:
        msprobe's pipeline group, whose rank numbers this rank's stage in the records (one local query, no
        collective). Built even without rules (it finds nothing): a reload may add them."""
        stage = 0
        if process_group is not None:
            import torch.distributed as dist

            stage = dist.get_group_rank(process_group, rank)
        detector = cls(parse_rules(alert.rules), out_dir, rank, stage, alert.dump, run_id=run_id)
        detector.ops = None if ops is None else tuple(ops)
        return detector

    # ---- per step ------------------------------------------------------------------------------
    def totals(self) -> dict[str, int]:
        """Anomalies found so far, by rule (every configured rule, 0 included)."""
        return {rule.name: self.counts[rule.name] for rule in self.rules} | dict(self.counts)

    def check(self, batch: StatBatch) -> list[Anomaly]:
        """Apply the rules to one step; record, log and report what they find."""
        found: list[Anomaly] = []
        now = time.time()
        seen: Counter[str] = Counter()
        for rule in self.rules:
            self._repeat = seen[rule.name]
            seen[rule.name] += 1
            found += getattr(self, f"_{rule.name}")(batch, rule.args, now)
        while self.external:
            found.append(self.external.popleft())
        for name, count in Counter(a.rule for a in found).items():
            self.counts[name] += count
        if not found:
            return found
        if self.dump:
            self._write(found)
        for a in found[: self.log_limit]:
            logger.warning(
                "trainermon: %s at step %d: %s %s %s=%g (baseline %s) on rank %d",
                a.rule,
                a.step,
                a.family,
                a.name,
                a.stat,
                a.value,
                "n/a" if a.baseline is None else f"{a.baseline:g}",
                a.rank,
            )
        if len(found) > self.log_limit:
            logger.warning(
                "trainermon: ... and %d more anomalies at step %d on rank %d",
                len(found) - self.log_limit,
                batch.step,
                found[0].rank,
            )
        for callback in self.on_anomaly:
            callback(batch.step, found)
        return found

    # ---- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The history the rules compare against, so that a resumed job keeps its baselines."""
        return {
            "counts": dict(self.counts),
            "avg": dict(self._avg),
            "rolling": {k: (r.values.maxlen, list(r.values)) for k, r in self._rolling.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.counts = Counter(state.get("counts", {}))
        # abs: a state saved before the average was of |values| (then a plain mean) may hold a negative one
        self._avg = {key: (abs(avg), n) for key, (avg, n) in state.get("avg", {}).items()}
        self._rolling = {}
        for key, (maxlen, values) in state.get("rolling", {}).items():
            roll = self._rolling[key] = SpikeWindow(maxlen)
            roll.values.extend(values)

    def key(self, *key: Any) -> tuple:
        """A history's key: a second rule of the same name (another threshold) keeps its own history."""
        return (*key, self._repeat) if self._repeat else key

    def roll(self, window: int, *key: Any) -> SpikeWindow:
        """The rolling history at `key`, with the rule's current `window` (a reload or a restored state
        may have changed it: the newest values are kept)."""
        key = self.key(*key)
        roll = self._rolling.get(key)
        if roll is None:
            roll = self._rolling[key] = SpikeWindow(window)
        elif roll.values.maxlen != window:
            roll.values = deque(roll.values, maxlen=window)
        return roll

    def _make(
        self, batch: StatBatch, i: int, stat: str, value: float, baseline: float | None, rule: str, now: float
    ) -> Anomaly:
        row = batch.rows[i]
        return Anomaly(
            self.rank,
            self.pp_stage,
            row.vpp_stage,
            batch.step,
            row.micro_step,
            stage_of(row.family),
            i,
            row.family,
            row.name,
            stat,
            float(value),
            baseline,
            rule,
            now,
        )

    def _global(
        self, batch: StatBatch, value: float, baseline: float | None, rule: str, now: float
    ) -> Anomaly:
        return Anomaly(
            self.rank,
            self.pp_stage,
            0,
            batch.step,
            None,
            "optimizer",
            len(batch.rows),
            "grad_reduced",
            GLOBAL_NORM,
            "norm",
            value,
            baseline,
            rule,
            now,
        )

    # ---- rules -----------------------------------------------------------------------------------
    def _AnomalyTurbulence(self, batch: StatBatch, args: dict, now: float) -> list[Anomaly]:
        """msprobe's rule (`BaseWriterWithAD._update_tag2scalars`, beta 0.99): |value| against the average
        before it. O(1) per row and statistic, on the worker."""
        threshold = float(args.get("threshold", 0.5))
        out = []
        for stat in ("norm", "mean"):
            column = batch.values.get(stat)
            if column is None or (self.ops is not None and stat not in self.ops):
                continue
            for i, value in enumerate(column):
                value = float(value)
                if not math.isfinite(value):
                    continue
                row = batch.rows[i]
                key = self.key(row.family, row.vpp_stage, row.name, row.micro_step, stat)
                size = abs(value)
                avg, n = self._avg.get(key, (size, 0))  # seeded by the first: it never fires
                if size > avg * (1 + threshold):
                    out.append(self._make(batch, i, stat, value, avg, "AnomalyTurbulence", now))
                self._avg[key] = (0.99 * avg + 0.01 * size, n + 1)
        return out

    def _AnomalyNan(self, batch: StatBatch, args: dict, now: float) -> list[Anomaly]:
        threshold = args.get("threshold")
        out = []
        nans, infs = batch.values.get("nans"), batch.values.get("infs")
        # A step whose update the loss scaler skipped has Inf/NaN gradients by design (the scaler at work,
        # flagged `skipped`, as Prometheus' non-finite count treats it): its gradients (SCALED_GRAD_FAMILIES)
        # and global norm are no anomaly. Exempt: a torch GradScaler's skip, and Megatron's and DeepSpeed's
        # overflow skips. Not exempt: a skip the loop made itself (`own_skip`: no scaler's step was called,
        # e.g. it found NaN gradients and did not step), whose NaN is the very one to report.
        scaler_skip = batch.scalars.scaler_skip
        for i in range(len(batch.rows)):
            if scaler_skip and batch.rows[i].family in SCALED_GRAD_FAMILIES:
                continue
            counted = False
            for stat, column in (("nans", nans), ("infs", infs)):
                if column is not None and column[i] > 0:
                    out.append(self._make(batch, i, stat, float(column[i]), None, "AnomalyNan", now))
                    counted = True
            for stat in ("norm", "mean", "min", "max"):
                column = batch.values.get(stat)
                if column is None:
                    continue
                value = float(column[i])
                if not math.isfinite(value):
                    # NaN statistics of an empty/all-non-finite tensor were already reported by count.
                    if not counted and batch.rows[i].numel > 0:
                        out.append(self._make(batch, i, stat, value, None, "AnomalyNan", now))
                elif threshold is not None and abs(value) > float(threshold):
                    out.append(self._make(batch, i, stat, value, float(threshold), "AnomalyNan", now))
        norm = batch.derived.global_grad_norm
        if norm is not None and not math.isfinite(norm) and not scaler_skip:
            out.append(self._global(batch, norm, None, "AnomalyNan", now))
        return out

    def _AnomalySpike(self, batch: StatBatch, args: dict, now: float) -> list[Anomaly]:
        window = int(args.get("window", WINDOW))
        warmup = max(2, int(args.get("warmup", WARMUP)))
        z = float(args.get("z", 6.0))
        min_rel = float(args.get("min_rel", 0.1))
        out = []
        norm = batch.derived.global_grad_norm
        if norm is not None:
            roll = self.roll(window, "global")
            baseline = roll.check_then_add(norm, warmup, z, min_rel)
            if baseline is not None:
                out.append(self._global(batch, norm, baseline, "AnomalySpike", now))
        column = batch.values.get("norm")
        if column is not None:
            for i, value in enumerate(column):
                row = batch.rows[i]
                if row.numel == 0:
                    continue  # no values (a None output's row)
                roll = self.roll(window, row.family, row.vpp_stage, row.name, row.micro_step)
                baseline = roll.check_then_add(float(value), warmup, z, min_rel)
                if baseline is not None:
                    out.append(self._make(batch, i, "norm", float(value), baseline, "AnomalySpike", now))
        return out

    def _AnomalyUpdateRatio(self, batch: StatBatch, args: dict, now: float) -> list[Anomaly]:
        return health_rules.update_ratio(self, batch, args, now)

    def _AnomalyExpertCollapse(self, batch: StatBatch, args: dict, now: float) -> list[Anomaly]:
        return health_rules.expert_collapse(self, batch, args, now)

    def _AnomalyLogitGrowth(self, batch: StatBatch, args: dict, now: float) -> list[Anomaly]:
        return health_rules.logit_growth(self, batch, args, now)

    # ---- output ----------------------------------------------------------------------------------
    def _write(self, found: list[Anomaly]) -> None:
        if self._fh is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open, append-only
        run = {"run_id": self.run_id}
        lines = "".join(json.dumps(asdict(a) | run, allow_nan=True) + "\n" for a in found)
        self._fh.write(lines)
        self._fh.flush()

    def close(self) -> None:
        if self.external and self.dump:
            self._write(list(self.external))
            self.external.clear()
        if self._fh is not None:
            self._fh.close()
            self._fh = None
