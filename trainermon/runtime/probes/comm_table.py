"""The comm probe's cross-rank invariant checks (`cc_distribution.check`): the step's check table goes
through one all-reduce at the collected step's end; on an accelerator its small copy to the host is read at
the next step boundary. Violations become `AnomalyComm` records. A mixin of `comm.CommProbe`, which
provides `loop`, `violations`, `unchecked`, `_pending` and `_warn_once`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from trainermon.comm.checks import MAX_CHECKS, evaluate, pack
from trainermon.comm.sites import short


class CheckTable:
    """Mixin: `_check` (the step's one reduction), `_settle_pending`, `_evaluate`."""

    loop: Any
    violations: list
    unchecked: int
    _pending: Any
    _warn_once: Callable[..., None]  # (what, message, *args): said once per `what`

    def _check(self, step: int, entries: list) -> None:
        import torch.distributed as dist

        device = next((e.out_row.device for _, e in entries if e.out_row is not None), torch.device("cpu"))
        if dist.get_backend() == "nccl" and device.type == "cpu":  # NCCL reduces device tensors only
            device = torch.device("cuda", torch.cuda.current_device())
        if len(entries) > 64:
            self._warn_once(
                "cap", "trainermon: %d collective keys in a step; the first 64 are checked", len(entries)
            )
        try:
            table = pack(entries, self.loop.rank, self.loop.world_size, device)
        except Exception as exc:  # noqa: BLE001 - an empty block still joins the reduction
            self.loop.faults.record("comm check", exc, "this step's checks are skipped on this rank")
            entries = []
            table = pack(entries, self.loop.rank, self.loop.world_size, device)
        dist.all_reduce(table)  # the step's one extra reduction (the wrappers are idle: loop.clock.busy)
        if device.type == "cpu":
            self._evaluate(step, table.numpy(), entries)
        else:  # the check's own small copy (counted): read at the next step boundary, never waited for
            from trainermon.collect.transfer import transfer_to_host

            host, event = transfer_to_host(table, self.loop.transfers)
            self._pending = (step, host, event, entries)

    def _settle_pending(self, wait: bool = False) -> None:
        if self._pending is None:
            return
        step, host, event, entries = self._pending
        if event is not None and not event.query():
            if not wait:
                return
            event.synchronize()
        self._pending = None
        self._evaluate(step, host.numpy(), entries)

    def _evaluate(self, step: int, table: Any, entries: list) -> None:
        found, unchecked = evaluate(table, entries, self.loop.rank)
        self.unchecked += unchecked
        beyond = max(0, len(entries) - MAX_CHECKS)
        if unchecked or beyond:  # counted always, said once: a check that did not run is not a pass
            self._warn_once(
                "unchecked",
                "trainermon: cc_distribution checks at step %d: %d keys not checked (no line from some rank "
                "of their group, or a NaN/Inf in an input), %d beyond the first %d keys of the step",
                step,
                unchecked,
                beyond,
                MAX_CHECKS,
            )
        if not found:
            return
        from trainermon.pipeline.anomaly import Anomaly

        detector = self.loop.detector
        now = time.time()
        for v in found:
            self.violations.append((step, v))
            name = f"{v.key.op}/{v.key.group}@{short(v.key.site)}"
            record = Anomaly(
                self.loop.rank,
                detector.pp_stage if detector else 0,
                0,
                step,
                None,
                "comm",
                0,
                "comm",
                name,
                v.stat,
                v.got,
                v.expected,
                "AnomalyComm",
                now,
                v.ranks,
            )
            if detector is not None:
                detector.external.append(record)
