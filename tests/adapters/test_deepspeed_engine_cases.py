"""DeepSpeed 0.19.8 on 2 gloo ranks (DS_ACCELERATOR=cpu): engine cases an audit found wrong, in one launch.

- fp16 at ZeRO-0 (FP16_UnfusedOptimizer): DeepSpeed's engine.backward scales the loss only for its ZeRO
  optimizers, so `p.grad` is the unscaled gradient; the monitor once divided it by the loss scale anyway.
- ZeRO-0 with the user's torch optimizer: a layer frozen at `set_monitor` and unfrozen later is trained
  (all-reduced and stepped) by DeepSpeed; the monitor once never wrote it and left it out of the norm.
- msprobe's targets name the engine's parameters (`module.0`): they select what `0` selects, rows named
  without the engine's path.
References per step: `safe_get_full_grad` after the boundary backward (the all-reduced `p.grad` on
ZeRO-0), the full parameters and optimizer state read from the engine, per-micro-batch tensor hooks of
the test's own for grad_unreduced, and `engine.get_global_grad_norm()` (None on ZeRO-0 fp32, where
DeepSpeed leaves the norm to the torch optimizer: there the norm of the full reference gradients).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import keyed, read_family, ref_stats

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (see the Makefile's install line)",
)

OPS = ("norm", "mean", "min", "max")
STEPS = 4
GAS = 2
MICRO = 4
CASES = [
    {"tag": "fp16-zero0", "stage": 0, "fp16": True},
    {"tag": "unfreeze-zero0", "stage": 0, "unfreeze_step": 2},
    {"tag": "module-prefix-zero2", "stage": 2, "targets": ["module.0", "module.2"]},
]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _ds_config(case: dict[str, Any], world: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": MICRO * GAS * world,
        "zero_optimization": {"stage": case["stage"]},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    if case.get("fp16"):
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}  # loss scale 256
    return cfg


def _close(row: dict[str, str], ref: dict[str, float], rtol: float, what: str) -> None:
    numel = math.prod(json.loads(row["shape"]))
    rms = ref["norm"] / max(numel, 1) ** 0.5
    for op in OPS:
        got, want = float(row[op]), ref[op]
        tol = rtol * abs(want) + 1e-9 + (rtol * rms if op == "mean" else 0.0)
        assert abs(got - want) <= tol, f"{what} {row['name']} step {row['step']} {op}: got {got}, want {want}"


def _updated(engine: Any, basic: Any, names: dict[str, nn.Parameter]) -> dict[str, tuple]:
    """name -> (the float32 parameter after the step, its exp_avg), read from DeepSpeed's own tensors."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    if opt is basic:  # ZeRO-0 fp32: DeepSpeed steps the torch optimizer on the parameters themselves
        return {
            n: (p.detach().clone(), basic.state[p]["exp_avg"].clone())
            for n, p in names.items()
            if p in basic.state
        }
    if hasattr(opt, "fp16_groups"):  # FP16_UnfusedOptimizer: float32 masters, stepped by the torch optimizer
        master = {
            id(lp): hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lps, hps)
        }
        return {
            n: (master[id(p)].clone(), basic.state[master[id(p)]]["exp_avg"].clone())
            for n, p in names.items()
        }
    return {  # ZeRO-1-3: gathered over the ranks (collectives: every rank, same order)
        n: (safe_get_full_fp32_param(p).clone(), safe_get_full_optimizer_state(p, "exp_avg").clone())
        for n, p in names.items()
    }


def _run_case(rank: int, world: int, out_root: str, case: dict[str, Any]) -> str:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from trainermon import TrainerMon

    tag = case["tag"]
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, tag)
    cfg_path = os.path.join(out_root, f"{tag}-rank{rank}.json")
    config: dict[str, Any] = {
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": True,
        "ops": [*OPS, "nans"],
        "ndigits": 12,
    }
    if case.get("targets"):
        config["targets"] = {t: {} for t in case["targets"]}
        config["xy_distribution"] = True
    with open(cfg_path, "w") as fh:
        json.dump(config, fh)
    model = _net()
    unfreeze = case.get("unfreeze_step")
    if unfreeze is not None:
        model[0].requires_grad_(False)  # frozen at set_monitor, held by the torch optimizer all along
    basic = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=basic, config=_ds_config(case, world))
    monitor = TrainerMon(cfg_path)
    monitor.set_monitor(engine, optimizer=engine.optimizer)  # msprobe's insertion: the engine itself

    names = dict(engine.module.named_parameters())
    micro: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    hooked: set[str] = set()
    expected: dict[tuple, torch.Tensor] = {}
    norms: list[float] = []
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    dtype = torch.float16 if case.get("fp16") else torch.float32
    for step in range(STEPS):
        if step == unfreeze:
            engine.module[0].requires_grad_(True)
        for n, p in names.items():  # the test's own per-micro-batch taps, on the trainable ones
            if p.requires_grad and n not in hooked:
                hooked.add(n)
                p.register_hook(lambda g, n=n: micro[n].append(g.detach().to(torch.float64).clone()))
        for m in range(GAS):
            engine.backward(engine(torch.randn(MICRO, 5, generator=gen).to(dtype)).float().pow(2).mean())
            if m < GAS - 1:
                engine.step()
        for n, grads in micro.items():
            if grads:
                # the local sum autograd delivered (found-later parameters: tapped from the next step)
                if unfreeze is None or not n.startswith("0.") or step > unfreeze:
                    expected[("grad_unreduced", n, step)] = torch.stack(grads).sum(0)
                grads.clear()
        reduced = {n: safe_get_full_grad(p) for n, p in names.items()}  # collectives on ZeRO-2: all ranks
        reduced = {n: g.detach().clone() for n, g in reduced.items() if g is not None}
        for n, g in reduced.items():
            expected[("grad_reduced", n, step)] = g
        engine.step()
        for n, (param, exp_avg) in _updated(engine, basic, names).items():
            if n in reduced:
                expected[("param_updated", n, step)] = param
                expected[("exp_avg", n, step)] = exp_avg
        ds_norm = engine.get_global_grad_norm()
        ref_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in reduced.values()))
        if ds_norm is not None:
            assert math.isclose(float(ds_norm), ref_norm, rel_tol=1e-3), (tag, step, ds_norm, ref_norm)
        else:
            assert case["stage"] == 0 and not case.get("fp16")
        norms.append(float(ds_norm) if ds_norm is not None else ref_norm)
        monitor.flush()
        batch = monitor.last_batch
        assert batch is not None and batch.step == step and not batch.scalars.update_skipped, (tag, step)
        if case.get("fp16"):
            assert batch.derived.loss_scale == 256.0  # DeepSpeed's scaler, recorded as it is
        if rank == 0:  # the writer of the reduced rows knows the norm
            got = batch.derived.global_grad_norm
            assert math.isclose(got, norms[-1], rel_tol=1e-5), (tag, step, got, norms[-1])
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)

    for family in ("grad_unreduced", "grad_reduced", "param_updated", "exp_avg"):
        rows = keyed(read_family(monitor.run_dir, family))
        want = {k[1:] for k in expected if k[0] == family}
        if family != "grad_unreduced" and rank != 0:
            assert rows == {}, (tag, family)
            continue
        assert {(n, s) for n, s, _ in rows} == want, (tag, family, sorted(want ^ {k[:2] for k in rows}))
        for (n, s, _), row in rows.items():
            # fp16: autograd sums the micro-batches in fp16 (11 significant bits); the rest: same values
            loose = family == "grad_unreduced" and case.get("fp16")
            _close(row, ref_stats(expected[(family, n, s)]), 2e-3 if loose else 1e-5, f"{tag} {family}")
    if case.get("targets"):  # the activations of the two Linear layers, named as without the engine
        actv = {k[0].split(".")[0] for k in keyed(read_family(monitor.run_dir, "actv"))}
        assert actv == {"0", "2"}, (tag, actv)
    return tag


def _all_cases(rank: int, world: int, out_root: str) -> list[str]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo needs no shm op
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # Stands in for a GPU: DeepSpeed refuses fp16 on the CPU accelerator, whose fp16 math runs all the same.
    type(get_accelerator()).is_fp16_supported = lambda self: True
    deepspeed.init_distributed(dist_backend="gloo")
    return [_run_case(rank, world, out_root, case) for case in CASES]


def test_deepspeed_engine_cases(tmp_path: Path) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"  # inherited by the spawned ranks before they import deepspeed
    results = run_ranks(_all_cases, world_size=2, out_root=str(tmp_path))
    assert results == [[c["tag"] for c in CASES]] * 2
