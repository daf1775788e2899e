"""DeepSpeed 0.19.8 pipelines (PipelineModule + PipelineEngine.train_batch: 1 stage x 2 data-parallel ranks
with BF16_Optimizer, 2 stages with ZeRO-1 fp32, with and without monitor_mbs_grad) and MoE
(deepspeed.moe.layer.MoE, 2 experts, ep_size 2; ZeRO-2 and ZeRO-0) on 2 gloo ranks, in one launch, against
references taken in the test:
- grad_unreduced: each micro-batch's local gradient from a tensor hook of the test's own, summed over the
  step in float64 (per micro-batch with monitor_mbs_grad);
- grad_reduced: `safe_get_full_grad`, read inside the engine's optimizer step (pipelines) or after the
  boundary backward (MoE), before the update;
- the global gradient norm: `engine.get_global_grad_norm()` and the full model's norm from the reference
  gradients (each pipeline stage once; the dense parameters once and every rank's experts);
- writers: a pipeline stage's rows by its first data-parallel rank; dense MoE rows by rank 0, expert rows
  by every rank (expert-data-parallel groups of one rank) under the global expert number;
- coordinates: each rank's layout.json ("pp", "dp", "tp" with a pipeline; "pp", "dp", "ep" with MoE).
(`safe_get_full_optimizer_state` raises for MoE parameter groups after the first step: not used.)
Each problem is collected, so that one run names every broken family.
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
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import compare_rows, keyed, read_family, spy_reduced_grads

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (see the Makefile's install line)",
)

OPS = ("norm", "mean", "min", "max")
STEPS, GAS, MB = 2, 2, 4


def _config(path: str, mbs: bool) -> None:
    with open(path, "w") as fh:
        json.dump({"wg_distribution": True, "monitor_mbs_grad": mbs, "ops": list(OPS), "ndigits": 12}, fh)


def _ds_config(stage: int, bf16: bool, dp: int) -> dict[str, Any]:
    return {
        # bf16: DeepSpeed's BF16_Optimizer (float32 accumulation; .grad freed every micro-batch)
        **({"data_types": {"grad_accum_dtype": "fp32"}} if bf16 else {}),
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": MB * GAS * dp,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }


def _compare(tag: str, run_dir: str, family: str, expected: dict, writes: Any, problems: list[str]) -> None:
    """The rows of `family` are exactly the expected ones whose name `writes` accepts, with their values."""
    rows = keyed(read_family(run_dir, family))
    want = {k[1:]: v for k, v in expected.items() if k[0] == family and writes(k[1])}
    compare_rows(f"{tag} {family}", rows, want, problems, OPS)


def _norm_check(tag: str, step: int, batch: Any, ds_norm: Any, ref: float, problems: list[str]) -> None:
    """DeepSpeed's norm (None on ZeRO-0 fp32 only: the torch optimizer's business) equals the reference."""
    got = None if batch is None else batch.derived.global_grad_norm
    ds = ref if ds_norm is None else float(ds_norm)
    if (ds_norm is None) != tag.endswith("zero0") or not math.isclose(ds, ref, rel_tol=1e-5):
        problems.append(f"{tag} step {step}: the reference norm {ref} is not DeepSpeed's {ds_norm}")
    if got is None or not math.isclose(got, ref, rel_tol=1e-5):
        problems.append(f"{tag} step {step}: global grad norm {got}, want {ref}")


def _pipe_case(rank: int, world: int, out_root: str, tag: str, stages: int, bf16: bool, mbs: bool) -> list:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, tag)
    cfg = os.path.join(out_root, f"{tag}-{rank}.json")
    _config(cfg, mbs)
    torch.manual_seed(0)
    layers = [nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 1)]
    model = PipelineModule(
        layers=layers, num_stages=stages, loss_fn=lambda o, y: (o.float() - y).pow(2).mean()
    )
    dp = world // stages
    basic = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=basic, config=_ds_config(1, bf16, dp))
    assert type(engine.optimizer).__name__ == ("BF16_Optimizer" if bf16 else "DeepSpeedZeroOptimizer")
    writer = engine.grid.get_data_parallel_rank() == 0
    names = dict(engine.module.named_parameters())
    reduced = spy_reduced_grads(engine, names)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(engine, optimizer=engine.optimizer)
    micro: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [
        p.register_hook(lambda g, n=n: micro[n].append(g.detach().double().clone())) for n, p in names.items()
    ]
    expected: dict[tuple, torch.Tensor] = {}
    problems: list[str] = []
    gen = torch.Generator().manual_seed(100 + engine.grid.get_data_parallel_rank())
    for step in range(STEPS):
        data = [(torch.randn(MB, 5, generator=gen), torch.randn(MB, 1, generator=gen)) for _ in range(GAS)]
        if bf16:
            data = [(x.bfloat16(), y) for x, y in data]
        engine.train_batch(iter(data))
        for n, grads in micro.items():
            assert len(grads) == GAS, (tag, n, len(grads))
            if mbs:
                expected.update({("grad_unreduced", n, step, m): g for m, g in enumerate(grads)})
            else:
                expected[("grad_unreduced", n, step, None)] = torch.stack(grads).sum(0)
            expected[("grad_reduced", n, step, None)] = reduced[n]
            grads.clear()
        sq = torch.tensor([sum(float(t.pow(2).sum()) for t in reduced.values()) / dp], dtype=torch.float64)
        dist.all_reduce(sq)  # every stage once: the full model
        monitor.flush()
        if writer:
            norm = engine.get_global_grad_norm()
            _norm_check(tag, step, monitor.last_batch, norm, math.sqrt(float(sq)), problems)
    for h in handles:
        h.remove()
    monitor.close()
    if monitor.faults.total:
        problems.append(f"{tag}: faults {dict(monitor.faults.counts)}")
    _compare(tag, monitor.run_dir, "grad_unreduced", expected, lambda n: True, problems)
    _compare(tag, monitor.run_dir, "grad_reduced", expected, lambda n: writer, problems)
    # the grid's model dimension (size 1) is the tensor-parallel one; no experts
    want = {"pp": [engine.stage_id, stages], "dp": [engine.grid.get_data_parallel_rank(), dp], "tp": [0, 1]}
    _coordinates(tag, monitor.run_dir, want, problems)
    return problems


def _coordinates(tag: str, run_dir: str, want: dict, problems: list[str]) -> None:
    """The rank's layout.json states `want` as its coordinates, and no other parallel dimension."""
    path = os.path.join(run_dir, "layout.json")
    coords = json.load(open(path)) if os.path.isfile(path) else {}
    got = {k: coords[k] for k in ("pp", "dp", "tp", "ep", "cp", "etp") if k in coords}
    if got != want:
        problems.append(f"{tag}: layout.json coordinates {got}, want {want}")


class _MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        torch.manual_seed(0)
        self.inp = nn.Linear(5, 4)
        self.moe = MoE(
            hidden_size=4, expert=nn.Linear(4, 4), num_experts=2, ep_size=2, k=1,
            min_capacity=4, capacity_factor=4.0, drop_tokens=False,
        )  # fmt: skip
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(self.inp(x))
        return self.head(h) + 0 * l_aux


def _moe_case(rank: int, world: int, out_root: str, stage: int) -> list:
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import safe_get_full_grad

    from trainermon import TrainerMon

    tag = f"moe-zero{stage}"
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, tag)
    cfg = os.path.join(out_root, f"{tag}-{rank}.json")
    _config(cfg, False)
    model = _MoENet()
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense"}
    )
    basic = torch.optim.AdamW(groups, lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=basic, config=_ds_config(stage, False, world)
    )
    monitor = TrainerMon(cfg)
    monitor.set_monitor(engine, optimizer=engine.optimizer)
    problems: list[str] = []
    local = dict(engine.module.named_parameters())
    # the single-process name: this rank's one local expert is global expert `rank` (ep group = world)
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    names = {n.replace(f"{prefix}0.", f"{prefix}{rank}."): p for n, p in local.items()}
    module = monitor.loop.adapter.global_name(0, f"{prefix}0")  # activations' names too
    if module != f"{prefix}{rank}":
        problems.append(f"{tag}: rank {rank}'s expert module is named {module}")
    micro: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [
        p.register_hook(lambda g, n=n: micro[n].append(g.detach().double().clone())) for n, p in names.items()
    ]
    expected: dict[tuple, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        for m in range(GAS):
            engine.backward(engine(torch.randn(MB, 3, 5, generator=gen)).pow(2).mean())
            if m < GAS - 1:
                engine.step()
        reduced = {n: safe_get_full_grad(p).detach().double().clone() for n, p in names.items()}
        for n, grads in micro.items():
            expected[("grad_unreduced", n, step, None)] = torch.stack(grads).sum(0)
            expected[("grad_reduced", n, step, None)] = reduced[n]
            grads.clear()
        engine.step()
        dense = sum(float(t.pow(2).sum()) for n, t in reduced.items() if prefix not in n)
        experts = torch.tensor([sum(float(t.pow(2).sum()) for n, t in reduced.items() if prefix in n)])
        dist.all_reduce(experts)  # each rank's own experts
        monitor.flush()
        ref = math.sqrt(dense + float(experts))
        _norm_check(tag, step, monitor.last_batch, engine.get_global_grad_norm(), ref, problems)
    for h in handles:
        h.remove()
    monitor.close()
    if monitor.faults.total:
        problems.append(f"{tag}: faults {dict(monitor.faults.counts)}")
    _compare(tag, monitor.run_dir, "grad_unreduced", expected, lambda n: True, problems)
    # dense rows once (rank 0), expert rows by every rank: its experts, by their global number
    _compare(tag, monitor.run_dir, "grad_reduced", expected, lambda n: rank == 0 or prefix in n, problems)
    # no pipeline, no model-parallel unit: the stage, the data-parallel and the expert-parallel rank
    _coordinates(tag, monitor.run_dir, {"pp": [0, 1], "dp": [rank, world], "ep": [rank, world]}, problems)
    return problems


def _all_cases(rank: int, world: int, out_root: str) -> list[str]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    # MoE first: a pipeline's grid left in DeepSpeed's `groups.mpu` breaks the expert-parallel groups
    problems = _moe_case(rank, world, out_root, 2) + _moe_case(rank, world, out_root, 0)
    problems += _pipe_case(rank, world, out_root, "pipe1-bf16", 1, True, False)
    problems += _pipe_case(rank, world, out_root, "pipe2", 2, False, False)
    problems += _pipe_case(rank, world, out_root, "pipe2-mbs", 2, False, True)
    return problems


def test_deepspeed_pipeline_and_moe(tmp_path: Path) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"
    results = run_ranks(_all_cases, world_size=2, out_root=str(tmp_path))
    assert results == [[], []], "\n".join(f"rank {r}: {p}" for r, ps in enumerate(results) for p in ps)
