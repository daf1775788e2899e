"""The FSDP1/FSDP2 configurations of test_fsdp.py, run on each rank, with references computed there."""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.helpers import ref_stats

OPS = ("norm", "mean", "min", "max")
STEPS = 3
MAX_NORM = 1e-3  # below every step's gradient norm: the clipping scales the gradients in place
CASES: list[dict[str, Any]] = [
    {"id": "fsdp1-orig-full", "fsdp": 1, "orig": True, "strategy": "FULL_SHARD", "ckpt": True},
    {"id": "fsdp1-flat-full", "fsdp": 1, "orig": False, "strategy": "FULL_SHARD", "ckpt": False},
    {"id": "fsdp1-orig-grad_op", "fsdp": 1, "orig": True, "strategy": "SHARD_GRAD_OP", "ckpt": False},
    {"id": "fsdp1-flat-grad_op", "fsdp": 1, "orig": False, "strategy": "SHARD_GRAD_OP", "ckpt": True},
    {"id": "fsdp2", "fsdp": 2, "mp": False, "ckpt": True},
    {"id": "fsdp2-bf16", "fsdp": 2, "mp": True, "ckpt": False},
    # Gradient accumulation over 2 micro-batches (no_sync / set_requires_gradient_sync(False)): the
    # pre-reduce gradient is the step's sum; with monitor_mbs_grad, each micro-batch's own gradient.
    {"id": "fsdp1-flat-acc", "fsdp": 1, "orig": False, "strategy": "FULL_SHARD", "ckpt": False, "acc": 2},
    {
        "id": "fsdp1-orig-mbs",
        "fsdp": 1,
        "orig": True,
        "strategy": "FULL_SHARD",
        "ckpt": False,
        "acc": 2,
        "mbs": True,
    },
    {"id": "fsdp2-bf16-acc", "fsdp": 2, "mp": True, "ckpt": False, "acc": 2},
    {"id": "fsdp2-mbs", "fsdp": 2, "mp": False, "ckpt": False, "acc": 2, "mbs": True},
    # Fine-tuning: a whole FSDP unit frozen (its FlatParameter needs no gradient) and, where
    # use_orig_params allows mixing, one frozen weight inside a trained unit. Frozen: no rows.
    {
        "id": "fsdp1-flat-frozen",
        "fsdp": 1,
        "orig": False,
        "strategy": "FULL_SHARD",
        "ckpt": False,
        "frozen": ("blocks.0.",),
    },
    {
        "id": "fsdp1-orig-frozen",
        "fsdp": 1,
        "orig": True,
        "strategy": "FULL_SHARD",
        "ckpt": False,
        "frozen": ("blocks.0.", "blocks.1.fc1.weight"),
    },
]


ACTV_MODULES = ("inp", "blocks.0", "blocks.1.fc2", "head")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # A one-element parameter: some rank holds no elements of it in every configuration.
        self.scale = nn.Parameter(torch.full((1,), 0.9))
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(16), Block(16)])
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def _wrap(case: dict[str, Any], model: Net) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    if case["fsdp"] == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapped = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=getattr(ShardingStrategy, case["strategy"]),
            use_orig_params=case["orig"],
            device_id=torch.device("cpu"),
        )
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        kw: dict[str, Any] = {"mesh": mesh}
        if case["mp"]:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, **kw)
        wrapped = fully_shard(model, **kw)
    if case["ckpt"]:
        apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block))
    return wrapped


def _full_params(case: dict[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    """The gathered parameters (a test reference; the monitor never does this)."""
    from trainermon.names import clean_name

    if case["fsdp"] == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            return {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}
    return {clean_name(n): p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _record(refs: dict, family: str, name: str, step: int, t: torch.Tensor, micro: int | None = None) -> None:
    refs[(family, name, step, micro)] = ref_stats(t)


def _replica_micro_grads(
    replica: Net, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, refs: dict, step: int, micro: int
) -> dict[str, torch.Tensor]:
    """The replica's gradients for one micro-batch in the compute dtype; records its activations."""
    local = copy.deepcopy(replica).to(dtype)
    outputs: dict[str, torch.Tensor] = {}
    hooks = [
        local.get_submodule(n).register_forward_hook(
            lambda _m, _i, o, n=n: outputs.__setitem__(n, o.detach().clone())
        )
        for n in ACTV_MODULES
    ]
    _loss(local(x.to(dtype)), y).backward()
    for h in hooks:
        h.remove()
    for n, t in outputs.items():
        _record(refs, "actv", f"{n}.output", step, t, micro=micro)
    return {name: p.grad for name, p in local.named_parameters()}


def _run_case(case: dict[str, Any], rank: int, world: int, out_dir: str) -> dict[str, Any]:
    from trainermon import TrainerMon

    torch.manual_seed(0)
    model = Net()
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(case.get("frozen", ())))
    replica = copy.deepcopy(model)
    trained = [(name, p) for name, p in replica.named_parameters() if p.requires_grad]
    compute_dtype = torch.bfloat16 if case.get("mp") else torch.float32
    acc, mbs = case.get("acc", 1), case.get("mbs", False)
    fsdp_model = _wrap(case, model)
    opt = torch.optim.Adam([p for p in fsdp_model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.Adam([p for _, p in trained], lr=1e-2)

    cfg_path = os.path.join(out_dir, "config.json")
    if rank == 0:
        config = {
            "targets": {},
            "xy_distribution": True,
            "forward_only": True,
            "wg_distribution": True,
            "monitor_mbs_grad": mbs,
            "mv_distribution": True,
            "param_distribution": True,
            "update_distribution": True,
            "ops": list(OPS),
            "ndigits": 10,
        }
        Path(cfg_path).write_text(json.dumps(config))
    dist.barrier()
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    monitor = TrainerMon(cfg_path)
    monitor.set_monitor(fsdp_model, grad_acc_steps=acc, optimizer=opt)
    # Parameters of which this rank holds no elements (the adapter's empty-piece path: a 0-element tensor
    # on the flat parameter's device).
    pieces = monitor.loop.adapter.read("param", monitor.loop.adapter.parameters())
    empty_here = sum(1 for p in pieces if p is not None and (p.tensor is None or p.tensor.numel() == 0))

    refs: dict = {}
    clip_norms: list[float] = []
    for step in range(STEPS):
        batches = [_batch(step, rank, micro) for micro in range(acc)]
        # Reference: the replica in the compute dtype on this rank's micro-batches; the pre-reduce
        # gradient is their sum, accumulated in float32 as FSDP does.
        micro_grads = [
            _replica_micro_grads(replica, x, y, compute_dtype, refs, step, micro)
            for micro, (x, y) in enumerate(batches)
        ]
        for name, p in trained:
            if mbs:
                for micro, grads in enumerate(micro_grads):
                    _record(refs, "grad_unreduced", name, step, grads[name], micro=micro)
            local_sum = micro_grads[0][name] if acc == 1 else sum(g[name].float() for g in micro_grads)
            if not mbs:
                _record(refs, "grad_unreduced", name, step, local_sum)
            reduced = local_sum.float().clone()
            dist.all_reduce(reduced)
            p.grad = reduced / world
            _record(refs, "grad_reduced", name, step, p.grad)
            _record(refs, "param_origin", name, step, p)
        torch.nn.utils.clip_grad_norm_(replica.parameters(), MAX_NORM)  # not the monitored model's
        before = {name: p.detach().clone() for name, p in trained}
        ref_opt.step()
        for name, p in trained:
            delta = p.detach() - before[name]  # the update, from the copy the test keeps
            _record(refs, "update", name, step, delta)
            refs[("update", name, step, None)]["ratio"] = float(
                delta.double().norm() / before[name].double().norm()
            )
            _record(refs, "exp_avg", name, step, ref_opt.state[p]["exp_avg"])
            _record(refs, "exp_avg_sq", name, step, ref_opt.state[p]["exp_avg_sq"])
            _record(refs, "param_updated", name, step, p)
        ref_opt.zero_grad()

        for micro, (x, y) in enumerate(batches):
            last = micro == acc - 1
            if case["fsdp"] == 1:
                with contextlib.nullcontext() if last else fsdp_model.no_sync():
                    _loss(fsdp_model(x), y).backward()
            else:
                fsdp_model.set_requires_gradient_sync(last)
                _loss(fsdp_model(x), y).backward()
        if case["fsdp"] == 1:
            total = fsdp_model.clip_grad_norm_(MAX_NORM)
        else:
            total = torch.nn.utils.clip_grad_norm_(fsdp_model.parameters(), MAX_NORM)
            total = total.full_tensor() if hasattr(total, "full_tensor") else total
        clip_norms.append(float(total))
        opt.step()
        opt.zero_grad()

    monitor.flush()
    global_norm = monitor.last_batch.derived.global_grad_norm if monitor.last_batch is not None else None
    _, unreduced = monitor.generate_wgrad_metrics()  # msprobe's in-memory form of the last step
    adapter = monitor.loop.adapter.name
    faults = monitor.faults.total
    monitor.close()

    # The lockstep replica really is FSDP's model (a check on the reference itself).
    full = _full_params(case, fsdp_model)
    drift = {n: float((full[n].float() - p.detach()).abs().max()) for n, p in replica.named_parameters()}
    return {
        "run_dir": monitor.run_dir,
        "refs": refs,
        "clip_norms": clip_norms,
        "global_norm": global_norm,
        "adapter": adapter,
        "unreduced_tags": sorted({tag.split("/", 1)[1] for tag in unreduced}),
        "faults": faults,
        "drift": drift,
        "empty_here": empty_here,
        "names": [n for n, _ in trained],
    }


def _matrix(rank: int, world: int, out_root: str) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    out = {}
    for case in CASES:
        out_dir = os.path.join(out_root, case["id"])
        os.makedirs(out_dir, exist_ok=True)
        out[case["id"]] = _run_case(case, rank, world, out_dir)
    return out
