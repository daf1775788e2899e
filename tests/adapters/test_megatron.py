"""Megatron-Core 0.16.1 on 2 gloo ranks (CPU, through the test-only CUDA shim in the workers).

One launch runs the whole matrix, then the example (a tiny GPTModel, local layer spec, bf16, distributed
optimizer, every family on). Each matrix case trains two model chunks (vpp stages 0 and 1) wrapped in
Megatron's DDP with a real Megatron optimizer, beside an independent reference on each rank:

- a plain copy of the chunks fed the same local data; its per-micro-batch gradients, accumulated in fp32
  by the test, are grad_unreduced;
- their average over the ranks (all-reduced by the test), with the loss scale divided out, is
  grad_reduced; its norm must equal the optimizer's returned grad norm and the monitor's global norm;
- a plain torch AdamW on full fp32 master copies, stepped with the same clipped gradients, gives
  exp_avg, exp_avg_sq and the parameters before and after the update.
The reference copy is re-synced from the model after every step (it follows the same trajectory).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, read_family, ref_stats

if importlib.util.find_spec("megatron") is None:  # the workers import it; this process does not
    pytest.skip("megatron-core is not installed", allow_module_level=True)

OPS = ("norm", "mean", "min", "max")
FAMILIES = ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "param_origin", "param_updated")
ROOT = Path(__file__).resolve().parents[2]
LR, CLIP, STEPS = 0.01, 0.05, 3
CASES = [
    # fp32 model, FP32Optimizer inside a ChainedOptimizer, no overlap.
    {"tag": "fp32", "bf16": False, "dist_opt": False, "overlap": False, "grad_acc": 1, "scale": 1.0},
    # bf16, Float16OptimizerWithFloat16Params handed in bare, a constant loss scale, grad accumulation.
    {"tag": "bf16-f16opt", "bf16": True, "dist_opt": False, "overlap": False, "grad_acc": 2, "scale": 4.0},
    # bf16, DistributedOptimizer (parameters split across the ranks' shards).
    {"tag": "bf16-distopt", "bf16": True, "dist_opt": True, "overlap": False, "grad_acc": 1, "scale": 1.0},
    # DistributedOptimizer with overlap_grad_reduce and small buckets: buckets reduce during backward.
    {"tag": "distopt-overlap", "bf16": True, "dist_opt": True, "overlap": True, "grad_acc": 2, "scale": 1.0},
    # monitor_mbs_grad: each micro-batch's own local gradient (fp32, overlap on).
    {"tag": "fp32-mbs", "bf16": False, "dist_opt": False, "overlap": True, "grad_acc": 2, "scale": 1.0},
]


def _setup_megatron() -> None:
    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def _chunks(config: Any) -> list[Any]:
    """Two model chunks (vpp stages 0 and 1) with parameters of many sizes, so that the distributed
    optimizer's shard boundaries cut through parameters."""
    import torch
    from megatron.core.transformer.module import MegatronModule
    from torch import nn

    class Front(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.embed = nn.Linear(6, 40)
            self.norm = nn.LayerNorm(40)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.norm(self.embed(x)))

    class Back(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.hidden = nn.Linear(40, 56)
            self.head = nn.Linear(56, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.hidden(x)))

    torch.manual_seed(0)
    return [Front(), Back()]


def _megatron_case(rank: int, world: int, out_root: str, case: dict) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trainermon import TrainerMon

    out = os.path.join(out_root, case["tag"])
    os.environ["MONITOR_OUTPUT_DIR"] = out
    cfg_path = os.path.join(out_root, f"{case['tag']}-rank{rank}.json")
    with open(cfg_path, "w") as fh:
        json.dump(
            {
                "wg_distribution": True,
                "mv_distribution": True,
                "param_distribution": True,
                "monitor_mbs_grad": case["tag"] == "fp32-mbs",
                "ops": list(OPS),
                "ndigits": 12,
            },
            fh,
        )

    bf16 = case["bf16"]
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, bf16=bf16, params_dtype=dtype
    )
    modules = _chunks(config)
    reference = [copy.deepcopy(m).to(dtype) for m in modules]
    wrapped = [Float16Module(config, m) if bf16 else m for m in modules]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=case["overlap"],
        use_distributed_optimizer=case["dist_opt"],
        bucket_size=200 if case["overlap"] else None,
    )
    ddps = [DistributedDataParallel(config, ddp_config, m) for m in wrapped]
    for ddp in ddps:
        ddp.broadcast_params()
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        weight_decay=0.0,
        bf16=bf16,
        loss_scale=case["scale"] if case["scale"] != 1.0 else None,
        use_distributed_optimizer=case["dist_opt"],
        clip_grad=CLIP,
    )
    chained = get_megatron_optimizer(opt_config, ddps)
    # The bf16 Float16Optimizer case hands in (and steps) the bare optimizer, not the chain.
    opt = chained.chained_optimizers[0] if case["tag"] == "bf16-f16opt" else chained
    n_buckets = sum(len(d.bucket_groups) for d in ddps)

    monitor = TrainerMon(cfg_path, params_have_main_grad=None)
    monitor.set_monitor(ddps, grad_acc_steps=case["grad_acc"], optimizer=opt)
    assert monitor.loop.adapter.name == "megatron"

    ref_named = [list(m.named_parameters()) for m in reference]
    masters = [[p.detach().float().clone().requires_grad_(True) for _, p in named] for named in ref_named]
    ref_opt = torch.optim.AdamW([p for ms in masters for p in ms], lr=LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    expected: dict[tuple, dict[str, float]] = {}
    norms: list[tuple[float, float, float | None]] = []
    scale = case["scale"]
    mbs = case["tag"] == "fp32-mbs"
    for step in range(STEPS):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        opt.zero_grad()
        local = [[torch.zeros_like(m) for m in ms] for ms in masters]
        for micro in range(case["grad_acc"]):
            x = torch.randn(4, 6, generator=gen)
            last = micro == case["grad_acc"] - 1
            with contextlib.ExitStack() as stack:
                if not last:
                    for ddp in ddps:
                        stack.enter_context(ddp.no_sync())
                loss = ddps[1](ddps[0](x.to(dtype))).float().pow(2).mean()
                (loss * scale).backward()
            ref_loss = reference[1](reference[0](x.to(dtype))).float().pow(2).mean() * scale
            flat = [p for named in ref_named for _, p in named]
            grads = iter(torch.autograd.grad(ref_loss, flat))
            for c, acc in enumerate(local):
                for j in range(len(acc)):
                    g = next(grads).float()
                    acc[j] += g  # fp32 accumulation, like grad_reduce_in_fp32
                    if mbs:
                        expected[("grad_unreduced", c, ref_named[c][j][0], step, micro)] = ref_stats(g)
        finalize_model_grads(ddps)
        ok, grad_norm, _ = opt.step()
        assert ok

        sq = 0.0
        reduced = []
        for c, named in enumerate(ref_named):
            for j, (name, _) in enumerate(named):
                if not mbs:
                    expected[("grad_unreduced", c, name, step, None)] = ref_stats(local[c][j])
                avg = local[c][j].clone()
                dist.all_reduce(avg)
                avg = avg / world / scale
                reduced.append(avg)
                sq += float(avg.double().pow(2).sum())
                expected[("grad_reduced", c, name, step, None)] = ref_stats(avg)
                expected[("param_origin", c, name, step, None)] = ref_stats(masters[c][j])
        ref_norm = math.sqrt(sq)
        coef = CLIP / (ref_norm + 1.0e-6)
        for m, g in zip((p for ms in masters for p in ms), reduced):
            m.grad = g * coef if coef < 1.0 else g
        ref_opt.step()
        for c, named in enumerate(ref_named):
            for j, (name, _) in enumerate(named):
                state = ref_opt.state[masters[c][j]]
                expected[("exp_avg", c, name, step, None)] = ref_stats(state["exp_avg"])
                expected[("exp_avg_sq", c, name, step, None)] = ref_stats(state["exp_avg_sq"])
                expected[("param_updated", c, name, step, None)] = ref_stats(masters[c][j])
        # Follow the model's trajectory exactly (its bf16 params are rounded from the masters).
        with torch.no_grad():
            for ref_m, m in zip(reference, modules):
                for q, p in zip(ref_m.parameters(), m.parameters()):
                    q.copy_(p)
        monitor.flush()
        batch = monitor.last_batch
        norms.append((ref_norm, float(grad_norm), batch.derived.global_grad_norm))
        assert batch.scalars.optimizer_grad_norm == pytest.approx(float(grad_norm), rel=1e-12), batch.scalars
        assert batch.derived.loss_scale == scale, batch.derived
        assert batch.scalars.update_skipped is False
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)

    for ref_n, opt_n, mon_n in norms:
        assert opt_n == pytest.approx(ref_n, rel=1e-5)
        if rank == 0:
            assert mon_n == pytest.approx(opt_n, rel=1e-5)
    names = {(c, n) for c, named in enumerate(ref_named) for n, _ in named}
    checked = 0
    for family in FAMILIES:
        rows = read_family(monitor.run_dir, family)
        got = {
            (
                int(r["vpp_stage"]),
                r["name"],
                int(r["step"]),
                int(r["micro_step"]) if "micro_step" in r else None,
            ): r
            for r in rows
        }
        assert len(got) == len(rows), f"{family}: duplicate rows"
        if family != "grad_unreduced" and rank != 0:
            assert rows == [], f"{family}: written by rank {rank} too"  # one writer per DP group
            continue
        want = {(c, n, s, m) for (f, c, n, s, m) in expected if f == family}
        assert set(got) == want, f"{family}: {sorted(set(got) ^ want)[:5]}"
        for (c, n, s, m), row in got.items():
            assert (c, n) in names
            assert_row_matches(row, expected[(family, c, n, s, m)], OPS)
            checked += 1
    return {"checked": checked, "buckets": n_buckets, "norms": norms}


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "megatron_pretrain", ROOT / "examples" / "megatron_pretrain.py"
    )
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _example_case(rank: int, world: int, out_root: str) -> dict:
    """The example: a tiny GPTModel trained a few steps with every family on."""
    example = _load_example()
    out = os.path.join(out_root, "gpt")
    result = example.pretrain(out_dir=out, steps=3, all_families=True)
    monitor = result["monitor"]
    assert monitor.loop.adapter.name == "megatron"
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    counts = {}
    for family in ("actv", "actv_grad", *FAMILIES):
        rows = read_family(monitor.run_dir, family)
        counts[family] = len(rows)
        for r in rows:
            if r["shape"] == "[]" and r["dtype"] == "None":
                # msprobe's NaN row for an output element that is not a tensor: Megatron's linear
                # layers return (output, None) without skip_bias_add
                assert family == "actv" and r["name"].endswith("output_1"), r
                assert all(math.isnan(float(r[op])) for op in ("norm", "min", "max", "mean")), r
                continue
            for op in ("norm", "min", "max", "mean"):
                assert math.isfinite(float(r[op])), (family, r["name"], op)
    names = {r["name"] for r in read_family(monitor.run_dir, "grad_unreduced")}
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names  # Megatron's names, wrappers removed
    assert "embedding.word_embeddings.weight" in names
    assert counts["actv"] > 0 and counts["actv_grad"] > 0 and counts["grad_unreduced"] > 0
    if rank == 0:
        for family in FAMILIES:
            assert counts[family] > 0, family
        for opt_norm, mon_norm in result["norms"]:
            assert mon_norm == pytest.approx(opt_norm, rel=1e-5)
    else:
        assert counts["grad_reduced"] == counts["exp_avg"] == 0
    return counts


def _all(rank: int, world: int, out_root: str) -> dict:
    _setup_megatron()
    results: dict[str, Any] = {}
    for case in CASES:
        results[case["tag"]] = _megatron_case(rank, world, out_root, case)
    results["gpt"] = _example_case(rank, world, out_root)
    return results


def test_megatron_matrix_and_gpt_example(tmp_path: Path) -> None:
    results = run_ranks(_all, world_size=2, out_root=str(tmp_path))
    n_params = 8
    for case in CASES:
        r0, r1 = results[0][case["tag"]], results[1][case["tag"]]
        # rank 0 checks every family; rank 1 only its own grad_unreduced
        unreduced_rows = n_params * STEPS * (case["grad_acc"] if case["tag"] == "fp32-mbs" else 1)
        assert r0["checked"] == n_params * STEPS * (len(FAMILIES) - 1) + unreduced_rows
        assert r1["checked"] == unreduced_rows
        assert [n[:2] for n in r0["norms"]] == [n[:2] for n in r1["norms"]]  # one optimizer norm for all
    assert results[0]["distopt-overlap"]["buckets"] > 2  # small buckets: several reductions per backward
    assert results[0]["gpt"]["grad_reduced"] > 0


def test_megatron_not_imported_by_core() -> None:
    """The core and its adapter registry work without importing Megatron (it is imported lazily)."""
    import subprocess
    import sys

    code = (
        "import sys, torch; from trainermon.adapters import select_adapter;"
        "a = select_adapter([torch.nn.Linear(2, 2)], None);"
        "assert a.name == 'torch', a.name; assert 'megatron' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
