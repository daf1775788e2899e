"""torch's ZeroRedundancyOptimizer under DDP on 2 gloo ranks: each parameter's optimizer state lives whole on
its owning rank (in the local optimizer `.optim`); mv_distribution must write every monitored parameter's
state rows once per step, exact, whoever owns it, and the grad/param rows stay right.

Parameters of uneven sizes (the ranks own different counts: rank 1 owns the parameters rank 0, the writer,
does not hold state for) and one frozen parameter; Adam, and AdamW with amsgrad (max_exp_avg_sq) and
`parameters_as_bucket_view`, one launch. The reference is a plain float64 Adam/AdamW replica stepped on
the same reduced gradients; the owners' states, gathered, are checked against it too."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import keyed, read_family, ref_stats

OPS = ("norm", "mean", "min", "max")
CASES = {
    "adam": (torch.optim.Adam, {"lr": 0.01}, ("exp_avg", "exp_avg_sq")),
    "adamw": (
        torch.optim.AdamW,
        {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True},
        ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    ),
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    # sizes 96, 16, 64, 4, 12 (frozen), 3: ZeRO's greedy split gives rank 0 two, rank 1 four parameters
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4), nn.Tanh(), nn.Linear(4, 3))
    net[4].weight.requires_grad_(False)
    return net


def _close(got: float, want: float, scale: float, op: str) -> bool:
    tol = 1e-5 * abs(want) + 1e-9 + (1e-6 * scale if op == "mean" else 0.0)
    return abs(got - want) <= tol


def _compare(tag: str, rows: list[dict], want: dict, problems: list[str]) -> None:
    keyed_rows = keyed(rows)  # raises on a row written twice
    if set(keyed_rows) != set(want):
        problems.append(f"{tag}: rows differ {sorted(set(keyed_rows) ^ set(want))[:6]}")
    for key in sorted(set(keyed_rows) & set(want)):
        ref = ref_stats(want[key])
        scale = ref["norm"] / max(want[key].numel(), 1) ** 0.5
        for op in OPS:
            if not _close(float(keyed_rows[key][op]), ref[op], scale, op):
                problems.append(f"{tag} {key} {op}: got {keyed_rows[key][op]}, want {ref[op]}")
                break


def _case(rank: int, world: int, out_root: str, case: str) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon

    opt_class, hyper, keys = CASES[case]
    out = os.path.join(out_root, case)
    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg = os.path.join(out_root, f"{case}-rank{rank}.json")
    with open(cfg, "w") as fh:
        json.dump(
            {
                "wg_distribution": True,
                "mv_distribution": True,
                "param_distribution": True,
                "ops": list(OPS),
                "ndigits": 12,
            },
            fh,
        )
    model = _net()
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    replica = {n: p.detach().double().clone().requires_grad_(True) for n, p in trainable}
    ref_opt = opt_class(list(replica.values()), **hyper)
    ddp = DDP(model)
    # AdamW also with ZeRO's parameters as views of one flat bucket (its state stays keyed by parameter)
    zro = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=opt_class, parameters_as_bucket_view=case == "adamw", **hyper
    )
    owned = [names[id(p)] for p, r in zro._param_to_rank.items() if r == rank]
    monitor = TrainerMon(cfg)
    monitor.set_monitor(ddp, optimizer=zro)

    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    want: dict[str, dict] = {k: {} for k in (*keys, "grad_reduced", "param_updated")}
    problems: list[str] = []
    for step in range(3):
        ddp(torch.randn(5, 6, generator=gen)).pow(2).mean().backward()
        for n, p in trainable:  # DDP's average: what every rank's optimizer uses
            want["grad_reduced"][(n, step, None)] = p.grad.double().clone()
            replica[n].grad = p.grad.double().clone()
        zro.step()
        ref_opt.step()
        for n, q in replica.items():
            want["param_updated"][(n, step, None)] = q.detach().clone()
            for k in keys:
                want[k][(n, step, None)] = ref_opt.state[q][k].clone()
        # the owners' own state, gathered: the replica is a faithful reference
        mine = {names[id(p)]: {k: s[k].double() for k in keys} for p, s in zro.optim.state.items()}
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        seen = {n: s for part in gathered for n, s in part.items()}
        if set(seen) != set(replica):
            problems.append(f"{case} step {step}: owners' states {sorted(seen)}")
        for n, states in seen.items():
            for k, t in states.items():
                if not torch.allclose(t, want[k][(n, step, None)], rtol=1e-5, atol=1e-9):
                    problems.append(f"{case} step {step}: {n} {k} differs from the replica")
        zro.zero_grad()
    monitor.close()
    if monitor.faults.total:
        problems.append(f"{case} faults {dict(monitor.faults.counts)}")
    for family, tensors in want.items():
        rows = read_family(monitor.run_dir, family)
        if rank == 0:
            _compare(f"{case} {family}", rows, tensors, problems)
        elif rows:
            problems.append(f"{case} {family}: rank {rank} wrote {len(rows)} rows (written once, by rank 0)")
    return {"owned": owned, "problems": problems}


def _ranks(rank: int, world: int, out_dir: str) -> dict:
    return {case: _case(rank, world, out_dir, case) for case in CASES}


def test_zero_redundancy_state_rows_exact(tmp_path):
    results = run_ranks(_ranks, world_size=2, out_dir=str(tmp_path))
    for case in CASES:
        owned = [set(r[case]["owned"]) for r in results]
        # uneven: the writer (rank 0) does not own every parameter, and the frozen one is owned too
        assert owned[0] and owned[1] and len(owned[0]) != len(owned[1]) and "4.weight" in owned[0] | owned[1]
        problems = [p for r in results for p in r[case]["problems"]]
        assert problems == [], problems[:10]


class _Plain(torch.optim.Optimizer):
    """A local optimizer class whose state keys trainermon does not document."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        return None


def test_zero_redundancy_unread_cases_are_said(caplog):
    """What is not read is said once, by name: overlap_with_ddp=True (its local optimizer steps from DDP's
    communication hook; the hook refuses gloo, so only the message is checked here) and a local optimizer
    class with undocumented keys (found from state, they would differ by rank: only owners hold state).
    A documented class says nothing."""
    import logging

    from torch.distributed.optim import ZeroRedundancyOptimizer

    from tests.distributed import free_port
    from trainermon.runtime.moments import MomentKeys

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        params = list(_net().parameters())
        made = {
            "overlap": ZeroRedundancyOptimizer(
                params, optimizer_class=torch.optim.Adam, overlap_with_ddp=True, lr=0.01
            ),
            "plain": ZeroRedundancyOptimizer(params, optimizer_class=_Plain, lr=0.01),
            "adam": ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=0.01),
        }
        said, keys = {}, {}
        for name, zro in made.items():
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="trainermon"):
                moments = MomentKeys(zro)
                moments.warn_if_none()
                keys[name] = moments.for_step()
            said[name] = [r.getMessage() for r in caplog.records]
    finally:
        dist.destroy_process_group()
    assert keys == {"overlap": (), "plain": (), "adam": ("exp_avg", "exp_avg_sq")}
    assert len(said["overlap"]) == 1 and "overlap_with_ddp=True" in said["overlap"][0], said
    assert len(said["plain"]) == 1 and "ZeroRedundancyOptimizer(_Plain)" in said["plain"][0], said
    assert said["adam"] == []
