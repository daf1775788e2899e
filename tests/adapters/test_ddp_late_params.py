"""Parameters that reach the model after set_monitor, and parameters it replaces or ties then.

- Under DDP (2 gloo ranks), a module added after DDP was built is never all-reduced: each rank writes its
  own rows for it. The global gradient norm is the whole model's on the rank that writes the reduced
  rows (rank 0: its reduced gradients and its own late ones) and None on the other rank, never the norm
  of that rank's late parameters alone (it was, before the fix).
- A module added after set_monitor that no optimizer holds (DDP and plain) is monitored, with one
  warning naming it (before the fix: no rows and no word).
- A weight tied or a parameter replaced after set_monitor is not logged as "became trainable".

References: an undistributed copy of the model fed this rank's batch, its gradients of the parameters
DDP reduces averaged by the test itself (all_reduce), the late ones left local; float64 norms.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

OPS = ("norm", "mean", "min", "max")
STEPS, LATE = 4, 2
# The monitor's norm is within 5e-7 relative of the exact one (README, "Semantics worth knowing"), and the
# global norm, a root of a sum of those squares, no further; the float64 reference adds ~1e-15.
RTOL = 1e-6


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if hasattr(self, "extra"):  # added after set_monitor, given to the optimizer
            h = self.extra(h)
        if hasattr(self, "side"):  # added after set_monitor, in no optimizer
            h = h + self.side(h)
        return self.fc2(h)


class _Logs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _grow(model: nn.Module) -> None:
    torch.manual_seed(7)  # the same late weights on every rank and in the copy
    model.extra = nn.Linear(8, 8)
    model.side = nn.Linear(8, 8)


def _ddp_rank(rank: int, world: int, out_root: str) -> dict:
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "run")
    cfg = write_config(
        Path(out_root) / f"cfg{rank}.json",
        wg_distribution=True, ops=list(OPS), ndigits=12,
    )  # fmt: skip
    logs = _Logs()
    logging.getLogger("trainermon").addHandler(logs)
    torch.manual_seed(0)
    base = _Net()
    shadow = copy.deepcopy(base)
    model = DDP(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    gen = torch.Generator().manual_seed(11 + rank)
    norms, expected, totals = [], {}, []
    for step in range(STEPS):
        if step == LATE:
            _grow(base)
            _grow(shadow)
            opt.add_param_group({"params": list(base.extra.parameters())})
        x = torch.randn(8, 4, generator=gen)
        model(x).pow(2).mean().backward()
        shadow.load_state_dict(base.state_dict())
        shadow.zero_grad()
        shadow(x).pow(2).mean().backward()
        sumsq = 0.0
        for n, p in shadow.named_parameters():
            g = p.grad.detach().to(torch.float64)
            if n.startswith(("fc1.", "fc2.")):  # DDP reduces these: the average over the ranks
                dist.all_reduce(g)
                g = g / world
                if rank == 0:
                    expected[(n, step, None)] = ref_stats(g)
            else:  # never reduced: this rank's own, written by every rank
                expected[(n, step, None)] = ref_stats(g)
            sumsq += float(g.square().sum())
        totals.append(math.sqrt(sumsq))
        opt.step()
        opt.zero_grad()
        base.zero_grad()  # `side`, in no optimizer
        monitor.flush()
        norms.append(monitor.last_batch.derived.global_grad_norm)
    monitor.close()
    logging.getLogger("trainermon").removeHandler(logs)
    rows = keyed(read_family(monitor.run_dir, "grad_reduced"))
    problems = [f"fault {k}" for k in monitor.faults.counts]
    if set(rows) != set(expected):
        problems.append(f"rows {sorted(rows)} != expected {sorted(expected)}")
    for key in set(rows) & set(expected):
        try:
            assert_row_matches(rows[key], expected[key], OPS)
        except AssertionError as exc:
            problems.append(str(exc))
    return {"norms": norms, "totals": totals, "problems": problems, "logs": logs.lines}


def test_ddp_global_norm_and_late_modules(tmp_path):
    results = run_ranks(_ddp_rank, world_size=2, timeout=300, out_root=str(tmp_path))
    zero, one = results
    # rank 0 writes the reduced rows: its norm is its whole model's (reduced + its own late gradients)
    for step, (norm, total) in enumerate(zip(zero["norms"], zero["totals"])):
        assert norm is not None and abs(norm - total) <= RTOL * total, (step, norm, total)
    # rank 1 holds only its late rows: no norm (before the fix, theirs alone from step LATE on)
    assert one["norms"] == [None] * STEPS, one["norms"]
    assert one["totals"][LATE] != zero["totals"][LATE]  # the ranks' totals differ: a real distinction
    for rank, got in enumerate(results):
        assert got["problems"] == [], f"rank {rank}: {got['problems'][:6]}"
        outside = [line for line in got["logs"] if "found after set_monitor are not in the monitored" in line]
        assert len(outside) == 1 and "side.weight, side.bias" in outside[0], (rank, got["logs"])


def _single(tmp_path, monkeypatch, caplog, change) -> tuple[dict, dict, list[str]]:
    """A plain run of 3 steps; `change(model, opt)` at step 1, before its forward. Returns the written and
    the reference grad_reduced rows and the INFO/WARNING lines."""
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=list(OPS), ndigits=12)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 8), nn.Linear(8, 8), nn.Linear(8, 6, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    expected = {}
    with caplog.at_level(logging.INFO, logger="trainermon"):
        for step in range(3):
            if step == 1:
                change(model, opt)
            ids = torch.randint(0, 6, (4, 5), generator=torch.Generator().manual_seed(step))
            model(ids).logsumexp(-1).sum().backward()
            for n, p in model.named_parameters():
                expected[(n, step, None)] = ref_stats(p.grad)
            opt.step()
            model.zero_grad()
        monitor.close()
    rows = keyed(read_family(monitor.run_dir, "grad_reduced"))
    assert not monitor.faults.counts
    return rows, expected, [r.getMessage() for r in caplog.records]


def _check_rows(rows: dict, expected: dict) -> None:
    assert set(rows) == set(expected)
    for key, row in rows.items():
        assert_row_matches(row, expected[key], OPS)


def test_module_added_outside_any_optimizer_is_monitored(tmp_path, monkeypatch, caplog):
    def add(model: nn.Sequential, opt) -> None:
        model.append(nn.Linear(6, 6))  # `3`: in the model, in no optimizer

    rows, expected, lines = _single(tmp_path, monkeypatch, caplog, add)
    _check_rows(rows, expected)
    assert {("3.weight", 1, None), ("3.bias", 2, None)} <= set(rows)
    said = [line for line in lines if "found after set_monitor are not in the monitored optimizer" in line]
    assert len(said) == 1 and "3.weight, 3.bias" in said[0], lines


def test_prebuilt_module_inserted_is_monitored_from_its_first_step(tmp_path, monkeypatch, caplog):
    """A module built before set_monitor and inserted after the step's boundary: no parameter is
    registered then, and `Sequential.insert` writes `_modules` itself (no module registration either), so
    the first step wrote no rows of it and, under the shifted name, the old `2`'s rows held the new
    module's gradient (shape [8, 8] under `2.weight` read as the old [6, 8] one's)."""
    spare = nn.Linear(8, 8)  # built now, before set_monitor (in `_single`)

    def insert(model: nn.Sequential, opt) -> None:
        model.insert(2, spare)  # `2` is now spare, the old `2` is `3`; in no optimizer

    rows, expected, _ = _single(tmp_path, monkeypatch, caplog, insert)
    _check_rows(rows, expected)
    assert {("2.bias", 1, None), ("3.weight", 1, None)} <= set(rows)


def test_tie_after_set_monitor_is_not_called_newly_trainable(tmp_path, monkeypatch, caplog):
    def tie(model: nn.Sequential, opt) -> None:
        old = model[2].weight
        model[2].weight = model[0].weight  # (6, 8) both: tied from now on
        group = opt.param_groups[0]["params"]
        del group[[id(p) for p in group].index(id(old))]

    rows, expected, lines = _single(tmp_path, monkeypatch, caplog, tie)
    _check_rows(rows, expected)  # `2.weight` is gone from step 1 on, `0.weight` carries both gradients
    assert not [line for line in lines if "became trainable" in line], lines
    assert [line for line in lines if "dropped 2.weight" in line], lines


def test_replaced_parameter_is_not_called_newly_trainable(tmp_path, monkeypatch, caplog):
    def replace(model: nn.Sequential, opt) -> None:
        old = model[1].weight
        model[1].weight = nn.Parameter(old.detach() * 2)
        group = opt.param_groups[0]["params"]
        group[[id(p) for p in group].index(id(old))] = model[1].weight

    rows, expected, lines = _single(tmp_path, monkeypatch, caplog, replace)
    _check_rows(rows, expected)  # the new tensor's gradient from step 1 on
    assert not [line for line in lines if "became trainable" in line], lines
    assert [line for line in lines if "re-mapped 1.weight" in line], lines


def _freeze_rank(rank: int, world: int, out_root: str) -> dict:
    """DDP, every other step collected, one monitored parameter frozen at step 1 (a LoRA recipe freezes
    the base): the pre-reduce taps re-armed at step 2 stopped at it (torch refuses a hook on a tensor that
    needs no gradient), so the others' grad_unreduced rows were lost, with an error every collected step."""
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "freeze")
    cfg = write_config(
        Path(out_root) / f"freeze{rank}.json", wg_distribution=True, ops=list(OPS), step_interval=2
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = DDP(net, find_unused_parameters=True)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    expected = {}
    for step in range(5):
        if step == 1:
            net[0].bias.requires_grad_(False)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        local = copy.deepcopy(net)
        local(x).pow(2).mean().backward()
        if step % 2 == 0:
            for n, p in local.named_parameters():
                if p.grad is not None:
                    expected[(n, step, None)] = ref_stats(p.grad)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return {
        "rows": keyed(read_family(monitor.run_dir, "grad_unreduced")),
        "expected": expected,
        "faults": dict(monitor.faults.counts),
    }


def test_ddp_taps_skip_a_parameter_frozen_since_the_selection(tmp_path):
    for rank, res in enumerate(run_ranks(_freeze_rank, world_size=2, timeout=300, out_root=str(tmp_path))):
        assert res["faults"] == {}, (rank, res["faults"])
        assert ("2.weight", 4, None) in res["expected"] and ("0.bias", 2, None) not in res["expected"]
        _check_rows(res["rows"], res["expected"])


class _Wrap(nn.Module):
    """A wrapper put around a module (a LoRA layer's `base_layer`): the same tensors under longer names."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_layer = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x)


def test_a_parameter_moved_under_a_wrapper_is_renamed_not_dropped(tmp_path, monkeypatch, caplog):
    """The same tensors under new names: they were called dropped, then "became trainable" (trainable all
    along), and their indices shifted under DDP's taps; now kept, renamed, said at INFO."""

    def wrap(model: nn.Sequential, opt) -> None:
        model[1] = _Wrap(model[1])

    rows, expected, lines = _single(tmp_path, monkeypatch, caplog, wrap)
    _check_rows(rows, expected)
    assert {("1.base_layer.weight", 1, None), ("1.weight", 0, None)} <= set(rows)
    assert not [line for line in lines if "dropped" in line or "became trainable" in line], lines
    assert [
        line for line in lines if "moved in the model" in line and "1.weight -> 1.base_layer.weight" in line
    ]
