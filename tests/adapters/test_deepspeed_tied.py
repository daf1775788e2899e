"""DeepSpeed 0.19.8 pipelines with a layer tied across stages (`TiedLayerSpec`: a Linear(5, 5) used as the
first layer and, through `forward_fn`, as the head) on 4 gloo ranks (2 stages x 2 data-parallel ranks), in
one launch: ZeRO-1 fp32 (DeepSpeedZeroOptimizer: `.grad` keeps the step's sum), BF16_Optimizer (tensor-hook
sums) and ZeRO-0 fp32 (the torch optimizer). The tied layer's bias is not tied (`tied_weight_attr` is the
weight only): each stage trains its own copy, and DeepSpeed counts the first stage's.

Against references taken in the test:
- grad_reduced: `safe_get_full_grad` inside the engine's optimizer step; each row written once per job,
  the tied layer's by the first stage's first data-parallel rank (before: by both stages);
- grad_unreduced: each rank's own local sum of its micro-batch gradients (a tensor hook of the test's,
  float64), the tied weight's taken before `ReduceTiedGrads` sums it over the stages (before: after);
- the global gradient norm: `engine.get_global_grad_norm()` (DeepSpeed's optimizer computes it in float32
  from the same gradients, skipping `ds_pipe_replicated` copies: relative error below (25 + 10) * 2**-24
  for tensors of at most 25 elements and 10 tensors, so 1e-5 bounds it) and a float64 recompute of it;
- coordinates: each rank's layout.json says {"pp": [stage, 2], "dp": [dp rank, 2], "tp": [0, 1]};
- the warning naming the untied parameter of the tied layer.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import os
from pathlib import Path

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
STEPS, GAS, MB, STAGES = 2, 2, 4, 2


def _head(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight + module.bias  # the tied layer again, as the output head


def _compare(tag: str, rows: dict, want: dict, problems: list[str]) -> None:
    compare_rows(tag, rows, want, problems, OPS)


def _case(rank: int, out_root: str, tag: str, stage: int, bf16: bool) -> list[str]:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, tag)
    cfg = os.path.join(out_root, f"{tag}-{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"wg_distribution": True, "ops": list(OPS), "ndigits": 12}, fh)
    torch.manual_seed(0)
    layers = [
        TiedLayerSpec("emb", nn.Linear, 5, 5),
        nn.Tanh(),
        LayerSpec(nn.Linear, 5, 5),
        nn.Tanh(),
        LayerSpec(nn.Linear, 5, 5),
        TiedLayerSpec("emb", nn.Linear, 5, 5, forward_fn=_head),
    ]
    model = PipelineModule(
        layers=layers,
        num_stages=STAGES,
        partition_method="uniform",
        loss_fn=lambda o, y: (o.float() - y).pow(2).mean(),
    )
    dp = dist.get_world_size() // STAGES
    config = {
        **({"data_types": {"grad_accum_dtype": "fp32"}} if bf16 else {}),
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": MB * GAS * dp,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    basic = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=basic, config=config)
    stage_id, dp_rank = engine.stage_id, engine.grid.get_data_parallel_rank()
    names = dict(engine.module.named_parameters())
    # DeepSpeed's own choice of the copy it counts: the tied layer's parameters on the first stage
    counted = {n for n, p in names.items() if not getattr(p, "ds_pipe_replicated", False)}
    if stage_id == STAGES - 1 and counted & {"tied_modules.emb.weight", "tied_modules.emb.bias"}:
        return [f"{tag}: the last stage counts the tied layer"]
    reduced = spy_reduced_grads(engine, names)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainermon").addHandler(handler)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(engine, optimizer=engine.optimizer)
    logging.getLogger("trainermon").removeHandler(handler)
    problems: list[str] = []
    untied = [w for w in warnings if "tied_modules.emb.bias" in w and "not tied" in w]
    if len(untied) != 1 or "tied_modules.emb.weight" in untied[0]:
        problems.append(f"{tag}: warnings {warnings}")
    micro: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [
        p.register_hook(lambda g, n=n: micro[n].append(g.detach().double().clone())) for n, p in names.items()
    ]
    unreduced: dict[tuple, torch.Tensor] = {}
    grads: dict[tuple, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(100 + dp_rank)
    for step in range(STEPS):
        data = [(torch.randn(MB, 5, generator=gen), torch.randn(MB, 5, generator=gen)) for _ in range(GAS)]
        if bf16:
            data = [(x.bfloat16(), y) for x, y in data]
        engine.train_batch(iter(data))
        for n, got in micro.items():
            unreduced[(n, step, None)] = torch.stack(got).sum(0)
            got.clear()
            if dp_rank == 0 and n in counted:
                grads[(n, step, None)] = reduced[n]
        sq = torch.tensor([sum(float(reduced[n].pow(2).sum()) for n in counted) / dp], dtype=torch.float64)
        dist.all_reduce(sq)  # each stage's counted parameters, once
        monitor.flush()
        ref = math.sqrt(float(sq))
        ds = engine.get_global_grad_norm()
        ours = None if monitor.last_batch is None else monitor.last_batch.derived.global_grad_norm
        if ds is not None and not math.isclose(float(ds), ref, rel_tol=1e-5):
            problems.append(f"{tag} step {step}: DeepSpeed's norm {ds}, float64 recompute {ref}")
        if ours is None or not math.isclose(ours, ref, rel_tol=1e-5):
            problems.append(f"{tag} step {step}: global grad norm {ours}, want {ref} (DeepSpeed's {ds})")
    for h in handles:
        h.remove()
    monitor.close()
    if monitor.faults.total:
        problems.append(f"{tag}: faults {dict(monitor.faults.counts)}")
    for family, want_rows in (("grad_unreduced", unreduced), ("grad_reduced", grads)):
        _compare(f"{tag} {family}", keyed(read_family(monitor.run_dir, family)), want_rows, problems)
    path = os.path.join(monitor.run_dir, "layout.json")
    coords = json.load(open(path)) if os.path.isfile(path) else {}
    want = {"pp": [stage_id, STAGES], "dp": [dp_rank, dp], "tp": [0, 1]}
    if {k: coords.get(k) for k in ("pp", "dp", "tp", "ep")} != {**want, "ep": None}:
        problems.append(f"{tag}: layout.json {coords}, want {want}")
    return problems


def _all_cases(rank: int, world: int, out_root: str) -> list[str]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    problems = _case(rank, out_root, "zero1", 1, False)
    problems += _case(rank, out_root, "bf16", 1, True)
    problems += _case(rank, out_root, "zero0", 0, False)
    return problems


def test_deepspeed_pipeline_tied_layers(tmp_path: Path) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"
    results = run_ranks(_all_cases, world_size=4, out_root=str(tmp_path))
    assert results == [[]] * 4, "\n".join(f"rank {r}: {p}" for r, ps in enumerate(results) for p in ps)
