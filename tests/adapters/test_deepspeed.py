"""DeepSpeed 0.19.8 on 2 gloo ranks (DS_ACCELERATOR=cpu): every family against DeepSpeed's own references.

One 2-rank launch runs the whole matrix, ZeRO 0, 1, 2, 3 x fp32, bf16 with gradient_accumulation_steps 2,
plus three extra cases: per-micro-batch gradients (monitor_mbs_grad), ZeRO-1 bf16 with float32 gradient
accumulation (DeepSpeed's BF16_Optimizer) and a step skipped on overflow. References, per step:
- grad_unreduced: each micro-batch's local gradient as autograd delivers it to the parameter (a tensor
  hook of the test's own), summed over the step in float64;
- grad_reduced: `safe_get_full_grad` after the boundary backward, before `engine.step()`;
- param_origin / param_updated: `safe_get_full_fp32_param` before / after the step;
- exp_avg / exp_avg_sq: `safe_get_full_optimizer_state` after the step;
- stage 0 (no partitioning, where those return None or the low-precision tensor) reads the full tensors:
  the optimizer's state and, with bf16, its float32 masters (`fp32_groups`);
- the global gradient norm: `engine.get_global_grad_norm()` (None on stage 0 fp32, where DeepSpeed leaves
  it to the basic torch optimizer: there the norm of the reference gradients).
The `safe_get_full_*` functions all-reduce per parameter: test references only, never in the monitor.

Tolerances: rtol 1e-5 for every family and dtype, since the monitor and the reference read the same stored
values, except grad_unreduced with bf16. There DeepSpeed (autograd) accumulates the micro-batch gradients
in bf16 on stages 0 and 1, rounding the sum to 8 significant bits (relative error up to 2**-9 per
element), while the reference sums them exactly: rtol 5e-3, and the mean within 5e-3 of the tensor's rms.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.adapters.deepspeed_outputs import zero3_outputs
from tests.distributed import run_ranks
from tests.helpers import keyed, read_family, ref_stats

# Checked without importing it: DeepSpeed is imported only inside the spawned ranks, so that other tests
# in this process do not run with it loaded.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (see the Makefile's install line)",
)

OPS = ("norm", "mean", "min", "max")
FAMILIES = (
    "grad_unreduced",
    "grad_reduced",
    "param_origin",
    "exp_avg",
    "exp_avg_sq",
    "param_updated",
    "update",
)
STEPS = 3
GAS = 2
MICRO_BATCH = 4
CASES: list[dict[str, Any]] = [
    {"stage": stage, "bf16": bf16, "mbs": False} for stage in (0, 1, 2, 3) for bf16 in (False, True)
] + [
    {"stage": 2, "bf16": False, "mbs": True},
    {"stage": 1, "bf16": True, "mbs": False, "fp32_accum": True},  # BF16_Optimizer
    {"stage": 2, "bf16": True, "mbs": False, "overflow_step": 1},
    # offload_optimizer: the reduced gradients live in the CPU partition (once written nowhere, silently)
    {"stage": 2, "bf16": False, "mbs": False, "offload": True},
    {"stage": 1, "bf16": False, "mbs": False, "offload": True},
]


def _case_id(case: dict[str, Any]) -> str:
    return "-".join(f"{k}{v}" for k, v in case.items())


def _net() -> nn.Module:
    # 70 parameters: ZeRO-1/2 partitions cut through a weight; ZeRO-3 leaves rank 1 nothing of the last bias.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 1))


def _ds_config(case: dict[str, Any], world: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": MICRO_BATCH * GAS * world,
        "zero_optimization": {"stage": case["stage"]},
        "bf16": {"enabled": case["bf16"]},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    if case.get("fp32_accum"):
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if case.get("offload"):  # the user's torch AdamW on the CPU partition (no DeepSpeed CPU Adam build)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def _close(row: dict[str, str], ref: dict[str, float], rtol: float, mean_rms_tol: float) -> None:
    numel = math.prod(json.loads(row["shape"]))
    rms = ref["norm"] / max(numel, 1) ** 0.5
    for op in OPS:
        got, want = float(row[op]), ref[op]
        tol = rtol * abs(want) + 1e-9 + (mean_rms_tol * rms if op == "mean" else 0.0)
        assert abs(got - want) <= tol, f"{row['name']} step {row['step']} {op}: got {got}, want {want}"


class _AcceleratedLike:
    """What Accelerate / the HF Trainer hand out: a wrapper holding the engine's optimizer as `.optimizer`."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def step(self) -> None:  # the engine steps; the wrapper's step does nothing
        pass


def _full_refs(engine: Any, names: dict[str, nn.Parameter], stage: int, what: str) -> dict[str, torch.Tensor]:
    """Full-parameter references (collectives on stages 1-3; every rank calls them in the same order)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    out = {}
    opt = engine.optimizer
    for n, p in names.items():
        if what == "grad":
            out[n] = safe_get_full_grad(p).detach().clone()
        elif stage == 0:
            master = p
            if hasattr(opt, "fp32_groups"):  # FP16_UnfusedOptimizer: float32 masters beside bf16 params
                master = next(
                    hp
                    for lps, hps in zip(opt.fp16_groups, opt.fp32_groups)
                    for lp, hp in zip(lps, hps)
                    if lp is p
                )
            inner = opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer
            out[n] = (master if what == "param" else inner.state[master][what]).detach().clone()
        elif what == "param":
            out[n] = safe_get_full_fp32_param(p).detach().clone()
        else:
            out[n] = safe_get_full_optimizer_state(p, what).detach().clone()
    return out


def _set_monitor_args(case_index: int, engine: Any, basic: torch.optim.Optimizer) -> tuple[Any, Any]:
    # Rotate through what users pass: the engine, engine.module, engine.optimizer, an Accelerate wrapper.
    variants = [
        (engine, engine),
        (engine.module, engine.optimizer),
        (engine, _AcceleratedLike(engine.optimizer)),
        (engine.module, None),
    ]
    return variants[case_index % len(variants)]


def _run_case(rank: int, world: int, out_root: str, case_index: int, case: dict[str, Any]) -> None:
    import deepspeed

    from trainermon import TrainerMon
    from trainermon.adapters import select_adapter
    from trainermon.adapters.deepspeed import find_engine

    tag = _case_id(case)
    out = os.path.join(out_root, tag)
    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg_path = os.path.join(out_root, f"{tag}-rank{rank}.json")
    with open(cfg_path, "w") as fh:
        json.dump(
            {
                "wg_distribution": True,
                "monitor_mbs_grad": case["mbs"],
                "mv_distribution": True,
                "param_distribution": True,
                "update_distribution": True,
                "ops": [*OPS, "nans"],
                "ndigits": 12,
            },
            fh,
        )
    stage, bf16 = case["stage"], case["bf16"]
    model = _net()
    basic = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=basic, config=_ds_config(case, world))

    # Every way of handing over the engine finds it (and so the same ZeRO optimizer).
    for chunk, opt in [
        (engine, None),
        (engine.module, engine),
        (engine.module, engine.optimizer),
        (engine.module, _AcceleratedLike(engine.optimizer)),
        (engine.module, basic),
    ]:
        assert find_engine([chunk], opt) is engine
        adapter = select_adapter([chunk], opt)
        assert adapter.name == "deepspeed" and adapter.optimizer is engine.optimizer
        adapter.close()
    assert find_engine([_net()], torch.optim.SGD(_net().parameters(), lr=0.1)) is None

    monitor = TrainerMon(cfg_path)
    model_arg, opt_arg = _set_monitor_args(case_index, engine, basic)
    monitor.set_monitor(model_arg, grad_acc_steps=1, optimizer=opt_arg)
    assert monitor.loop.adapter.name == "deepspeed" and monitor.grad_acc_steps == GAS

    names = dict(engine.module.named_parameters())
    micro_grads: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [
        p.register_hook(lambda g, n=n: micro_grads[n].append(g.detach().to(torch.float64).clone()))
        for n, p in names.items()
    ]
    expected: dict[tuple, torch.Tensor] = {}
    norms: list[tuple[int, float | None, float]] = []  # step, DeepSpeed's norm, reference norm
    batches: list[Any] = []
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    overflow_step = case.get("overflow_step")
    for step in range(STEPS):
        for micro in range(GAS):
            x = torch.randn(MICRO_BATCH, 5, generator=gen)
            if step == overflow_step and micro == GAS - 1:
                x[0, 0] = float("inf")
            if bf16:
                x = x.bfloat16()
            engine.backward(engine(x).float().pow(2).mean())
            if micro < GAS - 1:
                engine.step()  # not a boundary: DeepSpeed only counts the micro-batch
        for n in names:
            grads = micro_grads[n]
            assert len(grads) == GAS
            if case["mbs"]:
                for micro, g in enumerate(grads):
                    expected[("grad_unreduced", n, step, micro)] = g
            else:
                expected[("grad_unreduced", n, step, None)] = torch.stack(grads).sum(0)
            grads.clear()
        reduced = _full_refs(engine, names, stage, "grad")
        for n, t in reduced.items():
            expected[("grad_reduced", n, step, None)] = t
        for n, t in _full_refs(engine, names, stage, "param").items():
            expected[("param_origin", n, step, None)] = t
        engine.step()
        for key in ("exp_avg", "exp_avg_sq"):
            if step == overflow_step == 0:
                continue
            for n, t in _full_refs(engine, names, stage, key).items():
                expected[(key, n, step, None)] = t
        for n, t in _full_refs(engine, names, stage, "param").items():
            expected[("param_updated", n, step, None)] = t
            # the update: the full fp32 parameters after and before, from DeepSpeed's own gather
            expected[("update", n, step, None)] = (
                t.double() - expected[("param_origin", n, step, None)].double()
            )
        ref_norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in reduced.values()))
        norms.append((step, engine.get_global_grad_norm(), ref_norm))
        monitor.flush()
        batches.append(monitor.last_batch)
    for h in handles:
        h.remove()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    # msprobe's tag kind for the unreduced gradients: pre_grad where msprobe patches the reduction of
    # DeepSpeedZeroOptimizer (ZeRO-1/2), acc_grad where it hooks the gradient accumulation (the rest)
    zero12 = type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer"
    kind = "pre_grad" if zero12 and not case["mbs"] else "acc_grad"
    _, unreduced = monitor.generate_wgrad_metrics()
    assert unreduced and {tag.rsplit("/", 1)[1] for tag in unreduced} == {kind}, (case, sorted(unreduced)[:2])
    with open(os.path.join(monitor.run_dir, "layout.json")) as fh:
        assert json.load(fh)["grad_unreduced_kind"] == kind  # what the TensorBoard sink and convert use
    # The step counter follows the engine's optimizer steps, skipped ones included.
    assert monitor.current_step == engine.global_steps == STEPS
    assert engine.skipped_steps == (1 if overflow_step is not None else 0)

    # ---- the CSV output against the references -------------------------------------------------
    writer = rank == 0  # reduced, state and parameter rows: written once per data-parallel group
    shapes = {n: list(p.ds_shape if hasattr(p, "ds_shape") else p.shape) for n, p in names.items()}
    for family in FAMILIES:
        rows = keyed(read_family(monitor.run_dir, family))
        want = {k[1:] for k in expected if k[0] == family}
        if family != "grad_unreduced" and not writer:
            assert rows == {}, family
            continue
        assert set(rows) == want, (family, sorted(set(rows) ^ want)[:4])
        for key, row in rows.items():
            assert json.loads(row["shape"]) == shapes[key[0]], (family, key)
            ref = ref_stats(expected[(family, *key)])
            if key[1] == overflow_step and family in ("grad_unreduced", "grad_reduced"):
                # Non-finite gradients: the monitor counts NaNs instead of letting them poison the stats.
                assert float(row["nans"]) == ref["nans"], (family, key)
                continue
            loose = family == "grad_unreduced" and bf16 and not case["mbs"]
            _close(row, ref, 5e-3 if loose else 1e-5, 5e-3 if loose else 1e-6)
            if family == "update":  # ||dw|| / ||w_before|| (0 at the skipped step)
                before = expected[("param_origin", *key)].double().norm()
                assert math.isclose(float(row["ratio"]), float(ref["norm"] / before), rel_tol=1e-5), key

    # ---- per-step extras: global grad norm, loss scale, skipped steps -------------------------
    for (step, ds_norm, ref_norm), batch in zip(norms, batches):
        assert batch is not None and batch.step == step
        skipped = step == overflow_step
        assert batch.scalars.update_skipped is skipped
        if stage > 0 or bf16:
            assert batch.derived.loss_scale == 1.0
        if not writer or skipped:
            continue
        want = ds_norm if ds_norm is not None else ref_norm
        assert ds_norm is not None or (stage == 0 and not bf16)
        norm = batch.derived.global_grad_norm
        assert math.isclose(norm, want, rel_tol=1e-5), (step, batch.derived, want)
        assert math.isclose(norm, ref_norm, rel_tol=1e-5)
    # Each rank saw its own data: the local gradients differ.
    first = keyed(read_family(monitor.run_dir, "grad_unreduced"))
    norm = torch.tensor([float(next(iter(first.values()))["norm"])])
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, norm)
    assert gathered[0] != gathered[1]


def _all_cases(rank: int, world: int, out_root: str) -> list[str]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    # The first init_distributed compiles a shared-memory op for a minute; gloo does not need it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    done = []
    for index, case in enumerate(CASES):
        _run_case(rank, world, out_root, index, case)
        done.append(_case_id(case))
    return done + zero3_outputs(rank, out_root)


def test_deepspeed_matrix(tmp_path: Path) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"  # inherited by the spawned ranks before they import deepspeed
    results = run_ranks(_all_cases, world_size=2, out_root=str(tmp_path))
    assert results == [[*(_case_id(c) for c in CASES), "zero3-outputs"]] * 2


def test_deepspeed_example_runs(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "out"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "deepspeed_train.py"), "--steps", "2", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dirs = sorted(out.glob("*-rank*-*"))
    assert len(run_dirs) == 2, run_dirs
    rank0 = next(d for d in run_dirs if "-rank0-" in d.name)
    for family in ("grad_unreduced", "grad_reduced", "exp_avg", "param_updated"):
        rows = read_family(str(rank0), family)
        assert {int(r["step"]) for r in rows} == {0, 1}, family
        assert all(math.isfinite(float(r["norm"])) and float(r["norm"]) > 0 for r in rows), family
