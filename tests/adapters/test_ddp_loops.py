"""DDP loops that do more than backward + step, on 2 gloo ranks (one launch, every case):

- an extra backward cleared with zero_grad() without a step (a GAN's generator loss through D, FGSM):
  grad_unreduced is the step's own local gradient, not the cleared one;
- a GAN with one shared GradScaler whose generator loss overflows into D's gradients: no phantom step;
- the monitored optimizer replaced mid-run: one warning naming start_iteration;
- a WGAN whose critic steps n_critic=5 times per generator step (the monitored optimizer): no warning;
- a layer frozen when DDP was built and unfrozen later, or before set_monitor: DDP does not reduce it,
  so its rows are each rank's own (written by every rank), with a warning;
- a layer frozen after DDP was built (before set_monitor) and unfrozen later: DDP reduces it, so its
  rows are written once (rank 0), with no warning.

References: an undistributed copy of the model fed this rank's batch (its .grad is the local gradient),
the average all-reduced by the test itself, and the tensors the optimizer holds.
"""

from __future__ import annotations

import copy
import json
import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats

OPS = ("norm", "mean", "min", "max")


class _Logs(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _monitor(out_root: str, tag: str, rank: int, model: nn.Module, opt, **keys):
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, tag)
    cfg = os.path.join(out_root, f"{tag}-{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"wg_distribution": True, "ops": list(OPS), "ndigits": 12, **keys}, fh)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    return monitor


def _check(rows: dict, expected: dict, problems: list[str], what: str) -> None:
    if set(rows) != set(expected):
        problems.append(f"{what}: rows {sorted(rows)} != expected {sorted(expected)}")
        return
    for key, row in rows.items():
        try:
            assert_row_matches(row, expected[key], OPS)
        except AssertionError as exc:
            problems.append(f"{what}: {exc}")


def _mean(t: torch.Tensor, world: int) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t / world


def _stale_case(rank: int, world: int, out_root: str, logs: _Logs) -> list[str]:
    """An extra backward whose gradients the loop clears without a step, then the step's own."""
    torch.manual_seed(0)
    base = nn.Linear(4, 2)
    shadow = copy.deepcopy(base)
    model = DDP(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = _monitor(out_root, "stale", rank, model, opt)
    gen = torch.Generator().manual_seed(10 + rank)
    unreduced, reduced = {}, {}
    for step in range(3):
        x_extra, x = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
        model(x_extra).pow(2).sum().backward()  # an attack's / a generator's gradient ...
        opt.zero_grad()  # ... cleared: no optimizer step uses it
        model(x).pow(2).mean().backward()
        shadow.load_state_dict(base.state_dict())
        shadow.zero_grad()
        shadow(x).pow(2).mean().backward()
        for n, p in shadow.named_parameters():
            unreduced[(n, step, None)] = ref_stats(p.grad)
            reduced[(n, step, None)] = ref_stats(_mean(p.grad, world))
        opt.step()
        opt.zero_grad()
    monitor.close()
    problems = [f"fault {k}" for k in monitor.faults.counts]
    _check(keyed(read_family(monitor.run_dir, "grad_unreduced")), unreduced, problems, "stale grad_unreduced")
    got = keyed(read_family(monitor.run_dir, "grad_reduced"))
    _check(got, reduced if rank == 0 else {}, problems, "stale grad_reduced")
    problems += [f"stale warning: {w}" for w in logs.lines if "more than once" in w]
    return problems


def _gan_case(rank: int, world: int, out_root: str, logs: _Logs) -> list[str]:
    """One GradScaler for G and D (torch's multi-optimizer AMP recipe); G's loss overflows at it 2."""
    torch.manual_seed(0)
    gen_net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    disc = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    gopt = torch.optim.Adam(gen_net.parameters(), lr=1e-2)
    dopt = torch.optim.Adam(disc.parameters(), lr=1e-2)
    monitor = _monitor(out_root, "gan", rank, disc, dopt)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    bce = nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(20 + rank)
    expected = {}
    for it in range(4):
        real, z = torch.randn(8, 4, generator=gen) + 2, torch.randn(8, 4, generator=gen)
        dopt.zero_grad()
        ld = bce(
            disc(torch.cat([real, gen_net(z).detach()])), torch.cat([torch.ones(8, 1), torch.zeros(8, 1)])
        )
        scaler.scale(ld).backward()
        scaler.unscale_(dopt)
        for n, p in disc.module.named_parameters():  # what D's update uses (reduced, unscaled)
            expected[(n, it, None)] = ref_stats(p.grad)
        scaler.step(dopt)
        gopt.zero_grad()
        lg = bce(disc(gen_net(z)), torch.ones(8, 1)) * (float("inf") if it == 2 else 1.0)  # an fp16 overflow
        scaler.scale(lg).backward()
        scaler.step(gopt)
        scaler.update()
    monitor.close()
    problems = [f"fault {k}" for k in monitor.faults.counts]
    updates = int(dopt.state[disc.module[2].weight]["step"])
    if updates != 4:
        problems.append(f"gan: D made {updates} updates, the test expects 4")
    rows = read_family(monitor.run_dir, "grad_reduced")
    problems += [f"gan: step {r['step']} {r['name']} skipped={r['skipped']}" for r in rows if r["skipped"]]
    _check(keyed(rows), expected if rank == 0 else {}, problems, "gan grad_reduced")
    steps = {int(r["step"]) for r in read_family(monitor.run_dir, "grad_unreduced")}
    if steps != {0, 1, 2, 3}:
        problems.append(f"gan: grad_unreduced steps {sorted(steps)}")
    problems += [f"gan warning: {w}" for w in logs.lines if "not the one given to set_monitor" in w]
    return problems


def _replaced_case(rank: int, world: int, out_root: str, logs: _Logs) -> list[str]:
    """The optimizer replaced at iteration 3 (set_monitor not called again); a second optimizer over one
    shared parameter steps every iteration after the monitored one (an actor-critic's trunk): no warning
    for it while the monitored optimizer steps."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    aux = torch.optim.SGD([model.module.bias], lr=0.0)
    monitor = _monitor(out_root, "replaced", rank, model, opt)
    gen = torch.Generator().manual_seed(30 + rank)
    expected = {}
    for step in range(12):  # 8 iterations (16 steps of other optimizers) with none of ours: replaced
        if step == 3:
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # "reset the optimizer after a spike"
        model(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
        for n, p in model.module.named_parameters():
            expected[(n, step, None)] = ref_stats(p.grad)
        opt.step()
        aux.step()
        opt.zero_grad()
    monitor.close()
    problems = [f"fault {k}" for k in monitor.faults.counts]
    said = [w for w in logs.lines if "not the one given to set_monitor" in w]
    if len(said) != 1 or "start_iteration=3" not in said[0]:
        problems.append(f"replaced: warnings {said}")
    if monitor.current_step != 3:
        problems.append(f"replaced: the monitor is at step {monitor.current_step}, expected 3")
    want = {k: v for k, v in expected.items() if k[1] < 3} if rank == 0 else {}
    _check(keyed(read_family(monitor.run_dir, "grad_reduced")), want, problems, "replaced grad_reduced")
    return problems


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.extra, self.b = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.extra(torch.tanh(self.a(x)))))


def _unfreeze_case(rank: int, world: int, out_root: str, logs: _Logs) -> list[str]:
    """`extra` frozen when DDP is built, unfrozen at the top of iteration 2 (in the optimizer from the
    start: Adam skips a parameter without a gradient)."""
    torch.manual_seed(0)
    net = _Net()
    net.extra.requires_grad_(False)
    shadow = copy.deepcopy(net)
    model = DDP(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    monitor = _monitor(out_root, "unfreeze", rank, model, opt, mv_distribution=True, param_distribution=True)
    gen = torch.Generator().manual_seed(40 + rank)
    exp: dict[str, dict] = {f: {} for f in ("grad_unreduced", "grad_reduced", "param_origin", "exp_avg")}
    for step in range(5):
        if step == 2:
            net.extra.requires_grad_(True)
            shadow.extra.requires_grad_(True)
        x = torch.randn(4, 6, generator=gen)
        model(x).pow(2).mean().backward()
        shadow.load_state_dict(net.state_dict())
        shadow.zero_grad()
        shadow(x).pow(2).mean().backward()
        for n, q in shadow.named_parameters():
            if q.grad is None:
                continue
            mine = n.startswith("extra.")
            p = net.get_parameter(n)
            averaged = _mean(q.grad, world)  # on every rank: a collective
            if not mine or step >= 3:  # a tap on `extra` from the step after it was found (step 2)
                exp["grad_unreduced"][(n, step, None)] = ref_stats(q.grad)
            if mine or rank == 0:  # DDP's: one writer; `extra`: this rank's own, every rank writes
                exp["grad_reduced"][(n, step, None)] = ref_stats(q.grad if mine else averaged)
                exp["param_origin"][(n, step, None)] = ref_stats(p)
        opt.step()
        for n, p in net.named_parameters():
            if p in opt.state and (n.startswith("extra.") or rank == 0):
                exp["exp_avg"][(n, step, None)] = ref_stats(opt.state[p]["exp_avg"])
        opt.zero_grad()
    gathered = [torch.zeros_like(net.extra.weight) for _ in range(world)]
    dist.all_gather(gathered, net.extra.weight.detach().contiguous())
    monitor.close()
    problems = [f"fault {k}" for k in monitor.faults.counts]
    if torch.equal(gathered[0], gathered[1]):
        problems.append("unfreeze: the replicas of extra.weight did not diverge: the test shows nothing")
    for family, expected in exp.items():
        _check(keyed(read_family(monitor.run_dir, family)), expected, problems, f"unfreeze {family}")
    said = [w for w in logs.lines if "DDP does not all-reduce" in w]
    if len(said) != 1 or "extra.weight" not in said[0]:
        problems.append(f"unfreeze: warnings {said}")
    return problems


def _wgan_case(rank: int, world: int, out_root: str, logs: _Logs) -> list[str]:
    """WGAN: the critic D steps n_critic=5 times per generator step (first too); the monitored model
    holds G and D, the monitored optimizer is G's, which steps every iteration: not replaced."""
    torch.manual_seed(0)
    gan = nn.ModuleDict({"G": nn.Linear(4, 4), "D": nn.Linear(4, 1)})
    g_opt = torch.optim.Adam(gan["G"].parameters(), lr=1e-3)
    d_opt = torch.optim.Adam(gan["D"].parameters(), lr=1e-3)
    monitor = _monitor(out_root, "wgan", rank, gan, g_opt)
    gen = torch.Generator().manual_seed(50 + rank)
    expected = {}
    for step in range(8):
        for _ in range(5):
            d_opt.zero_grad()
            fake = gan["G"](torch.randn(8, 4, generator=gen)).detach()
            (gan["D"](fake).mean() - gan["D"](torch.randn(8, 4, generator=gen)).mean()).backward()
            d_opt.step()
        g_opt.zero_grad()
        (-gan["D"](gan["G"](torch.randn(8, 4, generator=gen))).mean()).backward()
        for n, p in gan["G"].named_parameters():
            expected[(f"G.{n}", step, None)] = ref_stats(p.grad)
        g_opt.step()
    monitor.close()
    problems = [f"fault {k}" for k in monitor.faults.counts]
    got = {k: v for k, v in keyed(read_family(monitor.run_dir, "grad_reduced")).items() if k[0][0] == "G"}
    _check(got, expected, problems, "wgan grad_reduced")
    return problems + [f"wgan warning: {w}" for w in logs.lines if "not the one given to set_monitor" in w]


def _early_case(rank: int, world: int, out_root: str, logs: _Logs) -> list[str]:
    """`extra` frozen when DDP is built, unfrozen before set_monitor: DDP never reduces it."""
    torch.manual_seed(0)
    net = _Net()
    net.extra.requires_grad_(False)
    model = DDP(net)
    net.extra.requires_grad_(True)
    shadow = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    monitor = _monitor(out_root, "early", rank, model, opt)
    gen = torch.Generator().manual_seed(60 + rank)
    exp: dict[str, dict] = {"grad_unreduced": {}, "grad_reduced": {}}
    for step in range(3):
        x = torch.randn(4, 6, generator=gen)
        model(x).pow(2).mean().backward()
        shadow.load_state_dict(net.state_dict())
        shadow.zero_grad()
        shadow(x).pow(2).mean().backward()
        for n, q in shadow.named_parameters():
            mine = n.startswith("extra.")
            averaged = _mean(q.grad, world)  # on every rank: a collective
            exp["grad_unreduced"][(n, step, None)] = ref_stats(q.grad)
            if mine or rank == 0:
                exp["grad_reduced"][(n, step, None)] = ref_stats(q.grad if mine else averaged)
        opt.step()
        opt.zero_grad()
    monitor.close()
    problems = [f"fault {k}" for k in monitor.faults.counts]
    for family, expected in exp.items():
        _check(keyed(read_family(monitor.run_dir, family)), expected, problems, f"early {family}")
    said = [w for w in logs.lines if "DDP does not all-reduce" in w]
    if len(said) != 1 or "trainermon: extra.weight, extra.bias became" not in said[0]:
        problems.append(f"early: warnings {said}")
    return problems


def _refrozen_case(rank: int, world: int, out_root: str, logs: _Logs) -> list[str]:
    """`extra` trainable when DDP is built, frozen before set_monitor, unfrozen at iteration 2: DDP's
    reducer holds it (it reduces it again once it has a gradient)."""
    torch.manual_seed(0)
    net = _Net()
    model = DDP(net, find_unused_parameters=True)
    net.extra.requires_grad_(False)
    shadow = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    monitor = _monitor(out_root, "refrozen", rank, model, opt)
    gen = torch.Generator().manual_seed(70 + rank)
    exp: dict[str, dict] = {"grad_unreduced": {}, "grad_reduced": {}}
    for step in range(5):
        if step == 2:
            net.extra.requires_grad_(True)
            shadow.extra.requires_grad_(True)
        x = torch.randn(4, 6, generator=gen)
        model(x).pow(2).mean().backward()
        shadow.load_state_dict(net.state_dict())
        shadow.zero_grad()
        shadow(x).pow(2).mean().backward()
        for n, q in shadow.named_parameters():
            if q.grad is None:
                continue
            averaged = _mean(q.grad, world)  # on every rank: a collective
            if not n.startswith("extra.") or step >= 3:  # a tap on `extra` from the step after it was found
                exp["grad_unreduced"][(n, step, None)] = ref_stats(q.grad)
            if rank == 0:  # all DDP's: one writer
                exp["grad_reduced"][(n, step, None)] = ref_stats(averaged)
        opt.step()
        opt.zero_grad()
    monitor.close()
    problems = [f"fault {k}" for k in monitor.faults.counts]
    for family, expected in exp.items():
        _check(keyed(read_family(monitor.run_dir, family)), expected, problems, f"refrozen {family}")
    problems += [f"refrozen warning: {w}" for w in logs.lines if "DDP does not all-reduce" in w]
    return problems


CASES = {
    "stale": _stale_case,
    "gan": _gan_case,
    "replaced": _replaced_case,
    "wgan": _wgan_case,
    "unfreeze": _unfreeze_case,
    "early": _early_case,
    "refrozen": _refrozen_case,
}


def _all_cases(rank: int, world: int, out_root: str) -> dict[str, list[str]]:
    out = {}
    for name, case in CASES.items():
        logs = _Logs()
        logger = logging.getLogger("trainermon")
        logger.addHandler(logs)
        try:
            out[name] = case(rank, world, out_root, logs)
        except Exception as exc:  # noqa: BLE001 - reported per case, the other cases still run
            out[name] = [f"raised {type(exc).__name__}: {exc}"]
        finally:
            logger.removeHandler(logs)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, list[str]]]:
    return run_ranks(
        _all_cases, world_size=2, timeout=300, out_root=str(tmp_path_factory.mktemp("ddp_loops"))
    )


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_loop(results, case):
    for rank, by_case in enumerate(results):
        assert by_case[case] == [], f"rank {rank}: {by_case[case][:6]}"
