"""FSDP2 on 2 gloo ranks with a trainable Linear that no step uses until `LATE`: it has no optimizer state
on any rank, so whether its rows exist is agreed over the ranks (an int32 MAX all-reduce per state key).
The agreement must not run on every collected step while it stays without state (README: after 1, 2, 4,
... reads, at most every 64), and once it has state its rows must follow within that back-off, the same
on every rank, with the values of the full (gathered) optimizer state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import tests.adapters.test_fsdp_lora_frozen_base as lora
from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats

OPS = ("norm", "mean", "min", "max")
STEPS = 24
LATE = 5  # the first step that uses `late`: its state exists after this step's update
KEYS = ("exp_avg", "exp_avg_sq")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.late = nn.Linear(16, 16)  # trainable, unused before step LATE (a head, an unrouted expert)
        self.b = nn.Linear(16, 4)
        self.use_late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.use_late:
            h = h + self.late(h)
        return self.b(h)


def _run(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainermon import TrainerMon
    from trainermon.names import clean_name

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg_path = os.path.join(out_dir, "config.json")
    if rank == 0:
        cfg = {"targets": {}, "ops": list(OPS), "ndigits": 10, "mv_distribution": True}
        Path(cfg_path).write_text(json.dumps(cfg))
    dist.barrier()

    agreements = [0]  # the rows' agreement: an int32 MAX all-reduce (the monitor's only one here)
    original = dist.all_reduce

    def counting(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, *args: Any, **kwargs: Any) -> Any:
        if op == dist.ReduceOp.MAX and tensor.dtype == torch.int32:
            agreements[0] += 1
        return original(tensor, op, *args, **kwargs)

    dist.all_reduce = counting
    try:
        os.environ["MONITOR_OUTPUT_DIR"] = out_dir
        monitor = TrainerMon(cfg_path)
        monitor.set_monitor(model, optimizer=opt)
        refs: dict = {}
        per_step = []
        for step in range(STEPS):
            model.use_late = step >= LATE
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            before = agreements[0]
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            per_step.append(agreements[0] - before)
            for key in KEYS:  # the test's reference: the state gathered from the ranks (the monitor's not)
                for n, p in model.named_parameters():
                    st = opt.state.get(p, {}).get(key)
                    if st is not None:
                        refs[(key, clean_name(n), step)] = ref_stats(st.full_tensor())
            opt.zero_grad()
        faults = monitor.faults.total
        monitor.close()
    finally:
        dist.all_reduce = original
    return {"run_dir": monitor.run_dir, "refs": refs, "faults": faults, "per_step": per_step}


def test_unused_parameter_agreed_on_backoff_and_rows_follow_its_state(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_run, 2, out_dir=str(tmp_path))
    assert r0["faults"] == 0 and r1["faults"] == 0
    # Reads of each key (one per collected step) that agree: 0, then 1, 3, 7 (gaps 1, 2, 4); `late` has
    # state from step LATE=5 on, found at read 7; then every parameter has state: no more agreement.
    # One all-reduce per key (one shard group). Every step asking would be reads 0..5: 12 in all.
    want = [len(KEYS) if step in (0, 1, 3, 7) else 0 for step in range(STEPS)]
    assert r0["per_step"] == want and r1["per_step"] == want
    refs = r0["refs"]
    late = {"late.weight", "late.bias"}
    assert {(n, s) for (k, n, s) in refs if k == "exp_avg" and n in late} == {
        (n, s) for n in late for s in range(LATE, STEPS)
    }
    for key in KEYS:
        rows = keyed(read_family(r0["run_dir"], key))
        assert read_family(r1["run_dir"], key) == [], f"rank 1 wrote {key}"
        # FSDP2's state is a DTensor on every rank (an empty piece where a rank holds no element): the rows
        # of `late` follow its state at once, on every rank alike, before the agreement at read 7 finds it.
        want_rows = {(n, s, None) for (k, n, s) in refs if k == key}
        assert set(rows) == want_rows, f"{key}: {sorted(set(rows) ^ want_rows)}"
        for (name, step, _), row in rows.items():
            assert_row_matches(row, refs[(key, name, step)], OPS, rtol=1e-5)


def test_agreement_schedule_backs_off_to_every_64_reads(monkeypatch: Any) -> None:
    """The schedule alone, without ranks: which reads of a key agree while a parameter never has state,
    and at once for a parameter never asked about (one added after `add_param_group`)."""
    import trainermon.adapters.common as common

    asked: list[int] = []
    read = [0]
    monkeypatch.setattr(
        common, "any_over_ranks", lambda flags, groups, device: (asked.append(read[0]), flags)[1]
    )
    rows = common.AgreedRows()
    for read[0] in range(300):
        indices = [0, 1] if read[0] < 250 else [0, 1, 2]
        assert (
            rows.state("exp_avg", indices, [True, False, False][: len(indices)], [], None)
            == [
                True,
                False,
                False,
            ][: len(indices)]
        )
    # 0: agrees (0 found), 1: nothing new, then gaps 2, 4, ..., 64, 64; 250: parameter 2 is new, and the
    # back-off starts over.
    assert asked == [0, 1, 3, 7, 15, 31, 63, 127, 191, 250, 251, 253, 257, 265, 281]


class SkipNet(lora.LoraNet):
    """LoRA blocks over a frozen base; block 1 is skipped while `skip` (no gradient in its FSDP1 unit)."""

    skip = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.inp(x) * self.scale)
        return self.head(h if self.skip else self.blocks[1](h))


def _run_fsdp1(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """FSDP1 (use_orig_params) LoRA, block 1 skipped before step 2: its adapters gain state at step 2 on
    rank 0 only (rank 1 holds no element of them), between two agreements (reads 1 and 3)."""
    from trainermon import TrainerMon

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = SkipNet()
    for n, p in model.named_parameters():
        p.requires_grad_(lora._trainable(n))
    wrapped = lora._wrap(1, model)
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    cfg_path = os.path.join(out_dir, "config.json")
    if rank == 0:
        cfg = {"targets": {}, "ops": list(OPS), "ndigits": 10, "mv_distribution": True}
        Path(cfg_path).write_text(json.dumps(cfg))
    dist.barrier()
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    monitor = TrainerMon(cfg_path)
    monitor.set_monitor(wrapped, optimizer=opt)
    refs: dict = {}
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        model.skip = step < 2
        wrapped(torch.randn(6, 8, generator=g)).square().mean().backward()
        opt.step()
        for key in KEYS:
            for name, t in lora._full_state(1, wrapped, opt, key).items():
                refs[(key, name, step)] = ref_stats(t)
        opt.zero_grad()
    faults = monitor.faults.total
    monitor.close()
    return {"run_dir": monitor.run_dir, "refs": refs, "faults": faults}


def test_fsdp1_state_gained_on_one_rank_between_agreements(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_run_fsdp1, 2, out_dir=str(tmp_path))
    assert r0["faults"] == 0 and r1["faults"] == 0
    late = {"blocks.1.lora_a.weight", "blocks.1.lora_b.weight"}
    refs = r0["refs"]
    assert {s for (k, n, s) in refs if n in late} == {2, 3, 4, 5}
    for key in KEYS:
        rows = keyed(read_family(r0["run_dir"], key))
        # Not at step 2 (rank 0 alone holds that state, not agreed yet): from the agreement at read 3 on.
        want = {(n, s, None) for (k, n, s) in refs if k == key and (n not in late or s >= 3)}
        assert set(rows) == want, f"{key}: {sorted(set(rows) ^ want)}"
        for (name, step, _), row in rows.items():
            assert_row_matches(row, refs[(key, name, step)], OPS, rtol=1e-5)
