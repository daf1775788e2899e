"""Optimizer steps the monitor must read right or not count.

- A fused optimizer (`fused=True`) stepped by `torch.amp.GradScaler` without `unscale_`: the scaler leaves
  `.grad` scaled and sets `optimizer.grad_scale`, which the kernel divides out. The gradient rows are the
  unscaled gradients all the same (checked against `autograd.grad` of the unscaled loss), and not divided
  twice after `scaler.unscale_` + clipping.
- DCP resume: `get_state_dict` / `set_state_dict` on a fresh optimizer run torch's `_init_optim_state`, an
  `optimizer.step()` on zero gradients with lr 0: no training step (no rows, no step advance), whether the
  DCP module was imported before `set_monitor` or after it.
- Another optimizer in the process, holding no monitored parameter: its `step()` costs one call into
  trainermon per global step hook (counted with sys.setprofile).
"""

from __future__ import annotations

import collections
import copy
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import keyed, read_family, write_config

CONFIG = dict(wg_distribution=True, mv_distribution=True, ops=["norm", "max"], ndigits=15, format="csv")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(7, 6, generator=gen), torch.randn(7, 3, generator=gen)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return (model(x) - y).pow(2).mean()


def _stats(t: torch.Tensor) -> dict[str, float]:
    t = t.double()
    return {"norm": t.norm().item(), "max": t.max().item()}


def _check(rows: dict, family: str, name: str, step: int, ref: torch.Tensor | dict) -> None:
    row = rows[(name, step, None)]
    want = ref if isinstance(ref, dict) else _stats(ref)
    for op in ("norm", "max"):
        assert float(row[op]) == pytest.approx(want[op], rel=1e-6, abs=1e-12), (family, name, step, op)


@pytest.mark.parametrize(
    "make,unscale",
    [
        (lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True), False),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), False),
        (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True), False),
        (lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True), True),  # unscale_ + clipping: once only
    ],
    ids=["adam", "adamw", "sgd", "adam-unscale-clip"],
)
def test_fused_optimizer_under_grad_scaler_writes_unscaled_gradients(tmp_path, monkeypatch, make, unscale):
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "cfg.json", **CONFIG)
    model = _net()
    opt = make(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    true: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(3):
        opt.zero_grad()
        loss = _loss(model, step)
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        true[step] = {n: g.detach().clone() for (n, _), g in zip(model.named_parameters(), grads)}
        scaler.scale(loss).backward()
        if unscale:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)  # reads the gradients there
        scaler.step(opt)
        scaler.update()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert scaler.get_scale() == 2.0**10  # no overflow: every step updated
    for family in ("grad_reduced", "grad_unreduced"):
        rows = keyed(read_family(monitor.run_dir, family))
        assert {s for _, s, _ in rows} == {0, 1, 2}, family
        for step, named in true.items():
            for name, ref in named.items():
                _check(rows, family, name, step, ref)


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("late_import", [False, True], ids=["dcp-imported", "dcp-imported-late"])
@pytest.mark.parametrize("make", [_adam, _sgd], ids=["adam", "sgd"])
def test_dcp_state_dict_resume_is_no_step(tmp_path, monkeypatch, make, late_import):
    import torch.distributed.checkpoint.state_dict as dcp_sd
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from trainermon import TrainerMon

    original = dcp_sd._init_optim_state
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "cfg.json", **CONFIG)
    # the checkpoint: 2 steps
    model0 = _net()
    opt0 = make(model0)
    for step in range(2):
        opt0.zero_grad()
        _loss(model0, step).backward()
        opt0.step()
    ck_model, ck_opt = copy.deepcopy(get_state_dict(model0, opt0))

    model = _net()
    opt = make(model)
    monitor = TrainerMon(cfg)
    if late_import:  # the module is imported only after set_monitor
        monkeypatch.delitem(sys.modules, dcp_sd.__name__)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt, start_iteration=2)
    if late_import:
        sys.modules[dcp_sd.__name__] = dcp_sd
    get_state_dict(model, opt)  # the resume: torch's _init_optim_state steps the fresh optimizer
    set_state_dict(model, opt, model_state_dict=ck_model, optim_state_dict=ck_opt)
    grads, params, moments = {}, {}, {}
    for step in range(2, 5):
        opt.zero_grad()
        _loss(model, step).backward()
        grads[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
        params[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        if isinstance(opt, torch.optim.Adam):
            moments[step] = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    monitor.close()
    assert dcp_sd._init_optim_state is original  # close() took the wrapper off
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    reduced = keyed(read_family(monitor.run_dir, "grad_reduced"))
    assert {s for _, s, _ in reduced} == {2, 3, 4}
    for step in range(2, 5):
        for name, ref in grads[step].items():
            _check(reduced, "grad_reduced", name, step, ref)
    if moments:
        exp_avg = keyed(read_family(monitor.run_dir, "exp_avg"))
        assert {s for _, s, _ in exp_avg} == {2, 3, 4}
        for step in range(2, 5):
            for name, ref in moments[step].items():
                _check(exp_avg, "exp_avg", name, step, ref)


def test_unmonitored_optimizer_step_costs_one_call_per_hook(tmp_path, monkeypatch):
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "cfg.json", **CONFIG)
    model, other = _net(), nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for step in range(2):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        other_opt.zero_grad()
        other(torch.ones(2, 4)).sum().backward()
        other_opt.step()
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if (
            event == "call"
            and ("/trainermon/" in name or "/adapters/" in name)
            and "/site-packages/" not in name
        ):
            calls[f"{name.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        for _ in range(10):
            other_opt.step()
    finally:
        sys.setprofile(None)
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert sum(calls.values()) <= 2 * 10, dict(calls)  # the global pre- and post-hook, one call each


def _fsdp2_resume(rank: int, world: int, out_dir: str, fused_scaler: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainermon import TrainerMon
    from trainermon.names import clean_name

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _net()
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused_scaler or None)

    def loss(model: nn.Module, step: int) -> torch.Tensor:
        x, y = _batch(10 * step + rank)
        return (model(x) - y).pow(2).mean()

    model0, opt0 = build()
    for step in range(2):
        opt0.zero_grad()
        loss(model0, step).backward()
        opt0.step()
    ck_model, ck_opt = copy.deepcopy(get_state_dict(model0, opt0))
    cfg = os.path.join(out_dir, "cfg.json")
    if rank == 0:
        write_config(Path(cfg), **CONFIG)
    dist.barrier()
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    model, opt = build()
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt, start_iteration=2)
    get_state_dict(model, opt)  # DCP resume: runs _init_optim_state's step on the fresh optimizer
    set_state_dict(model, opt, model_state_dict=ck_model, optim_state_dict=ck_opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=fused_scaler)
    refs: dict = {}
    for step in range(2, 5):
        opt.zero_grad()
        scaler.scale(loss(model, step)).backward()
        for n, p in model.named_parameters():  # the reduced gradient, its loss scale taken out here
            refs[("grad_reduced", clean_name(n), step)] = _stats(
                p.grad.full_tensor().double() / scaler.get_scale()
            )
        scaler.step(opt)
        scaler.update()
        for n, p in model.named_parameters():
            refs[("exp_avg", clean_name(n), step)] = _stats(opt.state[p]["exp_avg"].full_tensor())
    faults = monitor.faults.total
    monitor.close()
    return {"run_dir": monitor.run_dir, "refs": refs, "faults": faults}


@pytest.mark.parametrize("fused_scaler", [False, True], ids=["adam", "fused-adam-grad-scaler"])
def test_fsdp2_dcp_resume_on_two_ranks(tmp_path, fused_scaler):
    from tests.distributed import run_ranks

    r0, r1 = run_ranks(_fsdp2_resume, 2, out_dir=str(tmp_path), fused_scaler=fused_scaler)
    assert r0["faults"] == 0 and r1["faults"] == 0
    refs = r0["refs"]
    for family in ("grad_reduced", "exp_avg"):
        rows = keyed(read_family(r0["run_dir"], family))
        assert read_family(r1["run_dir"], family) == [], f"rank 1 wrote {family}"
        assert {s for _, s, _ in rows} == {2, 3, 4}, family
        for (fam, name, step), ref in refs.items():
            if fam == family:
                _check(rows, family, name, step, ref)


class _Said(logging.Handler):
    """The trainermon logger's messages, kept."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _ddp_closure_or_double(rank: int, world: int, out_dir: str, variant: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon

    torch.set_num_threads(1)
    cfg = os.path.join(out_dir, "cfg.json")
    if rank == 0:
        write_config(Path(cfg), **CONFIG)
    torch.distributed.barrier()
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_dir, "out")
    said = _Said()
    logging.getLogger("trainermon").addHandler(said)
    net = _net()
    model = DDP(net)
    lbfgs = variant == "lbfgs"
    opt = (
        torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
        if lbfgs
        else torch.optim.SGD(model.parameters(), lr=1e-2)
    )
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    refs: dict = {}
    for step in range(2):
        x, y = _batch(10 * step + rank)
        # this rank's gradient before DDP's all-reduce, on a copy (the first closure call's, under LBFGS)
        plain = copy.deepcopy(net)
        local = torch.autograd.grad((plain(x) - y).pow(2).mean(), list(plain.parameters()))
        refs[step] = {n: _stats(g) for (n, _), g in zip(net.named_parameters(), local)}
        if lbfgs:

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = (model(x) - y).pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)
        else:  # two backwards, both reduced by DDP (no no_sync), before one step: a real double reduce
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
    faults = monitor.faults.total
    monitor.close()
    logging.getLogger("trainermon").removeHandler(said)
    return {"run_dir": monitor.run_dir, "refs": refs, "faults": faults, "said": said.messages}


@pytest.mark.parametrize("variant", ["lbfgs", "double-reduce"])
def test_ddp_closure_reruns_are_no_double_reduce(tmp_path, variant):
    """LBFGS under DDP reduces once per closure call: no "reduced more than once" warning, and the
    grad_unreduced rows are each rank's first closure's gradient. Two backwards before one step still warn."""
    from tests.distributed import run_ranks

    results = run_ranks(_ddp_closure_or_double, 2, out_dir=str(tmp_path), variant=variant)
    for result in results:
        assert result["faults"] == 0
        double = [m for m in result["said"] if "more than once in one step" in m]
        assert len(double) == (0 if variant == "lbfgs" else 1), result["said"]
        rows = keyed(read_family(result["run_dir"], "grad_unreduced"))
        assert {s for _, s, _ in rows} == {0, 1}
        for step, named in result["refs"].items():
            for name, ref in named.items():
                _check(rows, "grad_unreduced", name, step, ref)


def _fsdp1_fused_scaler(rank: int, world: int, out_dir: str, use_orig_params: bool) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from trainermon import TrainerMon

    torch.set_num_threads(1)
    cfg = os.path.join(out_dir, "cfg.json")
    if rank == 0:
        write_config(Path(cfg), **CONFIG)
    torch.distributed.barrier()
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_dir, "out")
    model = FSDP(_net(), use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    refs: dict = {}
    plain = _net()
    for step in range(3):
        with FSDP.summon_full_params(model):  # the full parameters, into a plain copy
            plain.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
        # the reduced gradient: the mean over the ranks of each rank's unscaled gradient
        grads = [
            torch.autograd.grad(_plain_loss(plain, 10 * step + r), list(plain.parameters()))
            for r in range(world)
        ]
        refs[step] = {
            n: _stats(sum(g[i] for g in grads) / world) for i, (n, _) in enumerate(plain.named_parameters())
        }
        opt.zero_grad()
        scaler.scale(_plain_loss(model, 10 * step + rank)).backward()
        scaler.step(opt)
        scaler.update()
    scale = scaler.get_scale()
    faults = monitor.faults.total
    monitor.close()
    return {"run_dir": monitor.run_dir, "refs": refs, "faults": faults, "scale": scale}


def _plain_loss(model: nn.Module, seed: int) -> torch.Tensor:
    x, y = _batch(seed)
    return (model(x) - y).pow(2).mean()


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig-params"])
def test_fsdp1_fused_adam_sharded_grad_scaler_writes_unscaled_gradients(tmp_path, use_orig_params):
    from tests.distributed import run_ranks

    r0, r1 = run_ranks(_fsdp1_fused_scaler, 2, out_dir=str(tmp_path), use_orig_params=use_orig_params)
    assert r0["faults"] == 0 and r1["faults"] == 0
    assert r0["scale"] == 2.0**10  # no overflow: every step updated with the scale in the gradients
    rows = keyed(read_family(r0["run_dir"], "grad_reduced"))
    assert {s for _, s, _ in rows} == {0, 1, 2}
    for step, named in r0["refs"].items():
        for name, ref in named.items():
            _check(rows, "grad_reduced", name, step, ref)


def _zero_added_group(rank: int, world: int, out_dir: str) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon

    torch.set_num_threads(1)
    cfg = os.path.join(out_dir, "cfg.json")
    if rank == 0:
        write_config(Path(cfg), **CONFIG)
    torch.distributed.barrier()
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_dir, "out")
    said = _Said()
    logging.getLogger("trainermon").addHandler(said)
    net = _net()
    model = DDP(net)
    first = [p for n, p in net.named_parameters() if n.startswith("0.")]
    opt = ZeroRedundancyOptimizer(first, optimizer_class=torch.optim.Adam, lr=1e-2)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    added_at = 4  # after the rows' agreement schedule has backed off (reads 0, 1, 3, then 7)
    moments: dict[str, torch.Tensor] = {}  # Adam's exp_avg, kept here from the reduced gradients
    refs: dict = {}
    for step in range(6):
        if step == added_at:
            opt.add_param_group({"params": [p for n, p in net.named_parameters() if n.startswith("2.")]})
        opt.zero_grad()
        x, y = _batch(10 * step + rank)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        for n, p in net.named_parameters():
            if n.startswith("0.") or step >= added_at:
                moments[n] = 0.9 * moments.get(n, torch.zeros_like(p)) + 0.1 * p.grad
                refs[(n, step)] = _stats(moments[n])
    faults = monitor.faults.total
    monitor.close()
    logging.getLogger("trainermon").removeHandler(said)
    return {"run_dir": monitor.run_dir, "refs": refs, "faults": faults, "said": said.messages}


def test_zero_redundancy_add_param_group_rows_from_the_first_state_on(tmp_path):
    """Parameters given to a ZeroRedundancyOptimizer by add_param_group after the rows' agreement backed
    off have exp_avg rows from their first update on (values: Adam's exp_avg from the reduced gradients)."""
    from tests.distributed import run_ranks

    r0, r1 = run_ranks(_zero_added_group, 2, out_dir=str(tmp_path))
    assert r0["faults"] == 0 and r1["faults"] == 0
    rows = keyed(read_family(r0["run_dir"], "exp_avg"))
    assert read_family(r1["run_dir"], "exp_avg") == []
    assert {(n, s) for n, s, _ in rows} == set(r0["refs"])
    for (name, step), ref in r0["refs"].items():
        _check(rows, "exp_avg", name, step, ref)
    said = [m for m in r0["said"] if "not in the ZeroRedundancyOptimizer" in m]
    assert len(said) == 1 and "add_param_group" in said[0], r0["said"]
