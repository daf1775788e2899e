"""A closed monitor kept by the user (a notebook, a monitor made again for a replaced model) must not keep
the model and optimizer alive: after `close()`, once the user drops their own references, both are
garbage (`weakref.ref(...)()` is None after `gc.collect()`); no hook of the monitor stays on the model or
the optimizer; the read-only views and the in-memory metrics of the last step still answer. Plain PyTorch
in this process; DDP and FSDP2 on 2 gloo ranks in one launch."""

from __future__ import annotations

import gc
import json
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks

STEPS = 3
CONFIG = {
    "targets": {},
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ops": ["norm", "min"],
    "ndigits": 10,
}


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _ours(fn: Any) -> bool:
    fn = getattr(fn, "func", fn)  # functools.partial
    fn = getattr(fn, "__func__", fn)  # a bound method
    return (getattr(fn, "__module__", None) or type(fn).__module__ or "").startswith("trainermon")


def _hooks(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """The monitor's hooks in every hook registry of the modules, parameters and optimizer, and torch's
    global ones, by registry (the framework's own, e.g. FSDP2's, are not counted)."""
    import torch.nn.modules.module as mm
    import torch.optim.optimizer as om

    registries: dict[str, Any] = {}
    for name, module in model.named_modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_state_dict_hooks",
            "_load_state_dict_pre_hooks",
        ):
            registries[f"{name}.{attr}"] = getattr(module, attr, None)
    for name, param in model.named_parameters():
        for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            registries[f"{name}.{attr}"] = getattr(param, attr, None)
    for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        registries[f"opt.{attr}"] = getattr(opt, attr)
    registries["global_opt_pre"] = om._global_optimizer_pre_hooks
    registries["global_opt_post"] = om._global_optimizer_post_hooks
    registries["global_forward"] = mm._global_forward_hooks
    registries["global_forward_pre"] = mm._global_forward_pre_hooks
    return {key: sum(map(_ours, (reg or {}).values())) for key, reg in registries.items()}


def _grad_norm(grad: torch.Tensor) -> float:
    full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return float(full.detach().to(torch.float64).norm())


def _train_and_close(model: nn.Module, inner: nn.Module, cfg_path: str, rank: int) -> dict[str, Any]:
    """Monitor `model` (`inner`: its module with the parameters' names) for STEPS Adam steps, close, and
    return the monitor, weak references to the model and optimizer, hook counts before and after, and the
    reference norms of the last step's reduced gradients (plain float64 torch, gathered when sharded)."""
    from trainermon import TrainerMon
    from trainermon.names import clean_name

    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    monitor = TrainerMon(cfg_path)
    monitor.set_monitor(model, optimizer=opt)
    attached = _hooks(model, opt)  # the check sees the monitor's hooks: some while attached
    ref: dict[str, float] = {}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * step + rank)
        model(torch.randn(5, 4, generator=g)).square().sum().backward()
        ref = {clean_name(n): _grad_norm(p.grad) for n, p in inner.named_parameters()}
        opt.step()
        opt.zero_grad()
    monitor.close()
    monitor.close()  # idempotent
    return {
        "monitor": monitor,
        "model": weakref.ref(model),
        "inner": weakref.ref(inner),
        "opt": weakref.ref(opt),
        "hooks": (attached, _hooks(model, opt)),
        "ref": ref,
    }


def _check_released(got: dict[str, Any], rank: int) -> dict[str, Any]:
    """After the caller dropped its references: what the kept, closed monitor still holds and gives."""
    gc.collect()
    monitor = got["monitor"]
    reduced, unreduced = monitor.generate_wgrad_metrics()
    norms = {key.split("/")[0].split(":", 1)[1]: float(v["norm"]) for key, v in reduced.items()}
    return {
        "alive": [k for k in ("model", "inner", "opt") if got[k]() is not None],
        "hooks": got["hooks"],
        "ref": got["ref"],
        "norms": norms,
        "unreduced_tags": sorted(k.rsplit("/", 1)[1] for k in unreduced),
        "step": monitor.current_step,
        "last_step": None if monitor.last_batch is None else monitor.last_batch.step,
        "run_dir": os.path.isdir(monitor.run_dir),
        "faults": monitor.faults.total,
        "dropped": monitor.dropped_rows,
        "rank": rank,
    }


def _assert_released(res: dict[str, Any], unreduced: str = "acc_grad") -> None:
    """`unreduced`: msprobe's tag of the framework's unreduced gradients (FSDP's: `pre_grad`), kept by the
    closed monitor without its adapter."""
    assert res["alive"] == [], f"rank {res['rank']}: kept alive by the closed monitor: {res['alive']}"
    attached, after = res["hooks"]
    assert sum(attached.values()) > 0
    assert {k: n for k, n in after.items() if n} == {}, "hooks of the closed monitor left"
    assert res["step"] == STEPS and res["last_step"] == STEPS - 1
    assert res["run_dir"] and res["faults"] == 0 and res["dropped"] == 0
    if res["rank"] == 0:  # the reduced (replicated) gradients' rows are rank 0's to write
        assert sorted(res["norms"]) == sorted(res["ref"])
        for name, norm in res["ref"].items():
            assert res["norms"][name] == pytest.approx(norm, rel=1e-5, abs=1e-7), name
    assert res["unreduced_tags"] and set(res["unreduced_tags"]) == {unreduced}


def test_closed_monitor_releases_model_single_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    torch.manual_seed(0)
    model = _net()
    got = _train_and_close(model, model, str(cfg), 0)
    del model  # the user's last reference
    res = _check_released(got, 0)
    _assert_released(res)
    with pytest.raises(RuntimeError, match="already called"):  # a closed monitor is not attached again
        got["monitor"].set_monitor(_net(), optimizer=None)


def _ranks(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for case in ("ddp", "fsdp2"):
        cfg_path = os.path.join(out_dir, f"{case}.json")
        if rank == 0:
            Path(cfg_path).write_text(json.dumps({**CONFIG, "cc_distribution": {"enable": case == "ddp"}}))
        dist.barrier()
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_dir, case)
        torch.manual_seed(0)
        inner = _net()
        if case == "ddp":
            model = DDP(inner)
        else:
            model = fully_shard(inner, mesh=init_device_mesh("cpu", (world,)))
        got = _train_and_close(model, inner, cfg_path, rank)
        del model, inner
        out[case] = _check_released(got, rank)
        dist.barrier()
    return out


def test_closed_monitor_releases_model_ddp_and_fsdp2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    for res in run_ranks(_ranks, 2, timeout=300, out_dir=str(tmp_path)):
        _assert_released(res["ddp"], "acc_grad")
        _assert_released(res["fsdp2"], "pre_grad")
