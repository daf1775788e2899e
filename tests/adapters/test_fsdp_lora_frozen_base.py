"""FSDP1 and FSDP2 with a frozen base and LoRA-style adapters on 2 gloo ranks: rows agree across ranks.

FSDP1 (use_orig_params, one unit per block, FULL_SHARD) puts each block's adapters inside the block's flat
parameter, all of them in rank 0's shard: rank 1 holds no element of them, so neither their gradient nor
their optimizer state. Every rank must still add the same sharded rows (an empty piece where it holds
none), else the packed reduction gets different sizes per rank (gloo aborts, NCCL would hang or mix rows).
FSDP1 also drops a unit's flat gradient on a rank whose original parameters all lack one, as
`summon_full_params` does: the test reads its references that way, before the monitor reads the step.

FSDP2: one adapter is unused at step 0 (no gradient, no optimizer state on any rank): no row for it
there, where the others have theirs; and a one-element parameter some rank holds no element of.

References: `summon_full_params(with_grads=True)` / `full_tensor()`, and the optimizer state gathered
from the ranks in the test (the monitor never gathers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats

OPS = ("norm", "mean", "min", "max")
STEPS = 3
FAMILIES = ("grad_reduced", "param_origin", "exp_avg", "exp_avg_sq", "param_updated")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        # Registered first: the adapters lead the block's flat parameter, all in rank 0's shard.
        self.lora_a = nn.Linear(dim, 2, bias=False)
        self.lora_b = nn.Linear(2, dim, bias=False)
        self.fc = nn.Linear(dim, dim)
        self.use_lora = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.tanh(h + self.lora_b(self.lora_a(x)) if self.use_lora else h)


class LoraNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.scale = nn.Parameter(torch.full((1,), 0.9))  # trainable, one element: one rank holds none
        self.blocks = nn.ModuleList([Block(16), Block(16)])
        self.head = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _trainable(name: str) -> bool:
    return "lora_" in name or name == "scale"


def _wrap(fsdp: int, model: LoraNet) -> nn.Module:
    if fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(fsdp: int, model: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """Full parameters (or their gradients) of the trainable parameters: test references only."""
    from trainermon.names import clean_name

    def pick(p: torch.Tensor) -> torch.Tensor | None:
        t = p.grad if grads else p
        if t is None:
            return None
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    if fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, with_grads=grads):
            found = {clean_name(n): pick(p) for n, p in model.named_parameters() if p.requires_grad}
    else:
        found = {clean_name(n): pick(p) for n, p in model.named_parameters() if p.requires_grad}
    return {n: t for n, t in found.items() if t is not None}


def _full_state(fsdp: int, model: nn.Module, opt: torch.optim.Optimizer, key: str) -> dict[str, torch.Tensor]:
    """Optimizer state `key` of each trainable parameter, gathered from the ranks: FSDP1's local state is
    this rank's contiguous slice of the flattened parameter (none where it holds no element), FSDP2's a
    DTensor."""
    from trainermon.names import clean_name

    out = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        st = opt.state.get(p, {}).get(key)
        if fsdp == 2:
            if st is not None:
                out[clean_name(n)] = st.full_tensor().detach().clone()
            continue
        pieces: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, None if st is None else st.detach().flatten().clone())
        pieces = [t for t in pieces if t is not None]
        if pieces:
            out[clean_name(n)] = torch.cat(pieces)
    return out


def _run(rank: int, world: int, fsdp: int, mv: bool, out_dir: str, twice: bool = False) -> dict[str, Any]:
    from trainermon import TrainerMon

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LoraNet()
    for name, p in model.named_parameters():
        p.requires_grad_(_trainable(name) and not (twice and name == "scale"))
    wrapped = _wrap(fsdp, model)
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    cfg_path = os.path.join(out_dir, "config.json")
    if rank == 0:
        keys = {"wg_distribution": True, "mv_distribution": mv, "param_distribution": True}
        Path(cfg_path).write_text(json.dumps({"targets": {}, "ops": list(OPS), "ndigits": 10, **keys}))
    dist.barrier()
    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    monitor = TrainerMon(cfg_path)
    monitor.set_monitor(wrapped, optimizer=opt)
    local_lora = [p.numel() for n, p in wrapped.named_parameters() if "lora_" in n]

    refs: dict = {}
    for step in range(STEPS):
        model.blocks[1].use_lora = step > 0  # an adapter without a gradient on any rank at step 0
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        ((wrapped(x) - y) ** 2).mean().backward()
        if twice:  # clipped, then a second backward: rank 0 reads the gradients again, rank 1 not
            wrapped.clip_grad_norm_(1e-3)
            ((wrapped(y @ torch.ones(4, 8)) - y) ** 2).mean().backward()
        # Read like the audit's reference code: FSDP1 drops rank 1's flat gradients here.
        for family, full in (
            ("grad_reduced", _full(fsdp, wrapped, True)),
            ("param_origin", _full(fsdp, wrapped, False)),
        ):
            for name, t in full.items():
                refs[(family, name, step)] = ref_stats(t)
        if twice:
            wrapped.clip_grad_norm_(1e-3)
        opt.step()
        for name, t in _full(fsdp, wrapped, False).items():
            refs[("param_updated", name, step)] = ref_stats(t)
        for key in ("exp_avg", "exp_avg_sq"):
            for name, t in _full_state(fsdp, wrapped, opt, key).items():
                refs[(key, name, step)] = ref_stats(t)
        opt.zero_grad()
    faults = monitor.faults.total
    monitor.close()
    return {"run_dir": monitor.run_dir, "refs": refs, "faults": faults, "local_lora": local_lora}


CASES = [
    {"id": "fsdp1-mv", "fsdp": 1, "mv": True},
    {"id": "fsdp1-grads", "fsdp": 1, "mv": False},  # the gradient rows alone (no optimizer state read)
    {"id": "fsdp2-mv", "fsdp": 2, "mv": True},
    # rank 1 holds no trainable element at all (`scale` frozen too): its gradients never change
    {"id": "fsdp1-clip-twice", "fsdp": 1, "mv": True, "twice": True},
]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_frozen_base_lora_rows_match_full_references(tmp_path: Path, case: dict[str, Any]) -> None:
    twice = case.get("twice", False)
    r0, r1 = run_ranks(_run, 2, fsdp=case["fsdp"], mv=case["mv"], out_dir=str(tmp_path), twice=twice)
    assert r0["faults"] == 0 and r1["faults"] == 0
    if case["fsdp"] == 1:  # the layout under test: rank 1 holds no element of any adapter
        assert min(r0["local_lora"]) > 0 and max(r1["local_lora"]) == 0
    refs = r0["refs"]
    families = FAMILIES if case["mv"] else ("grad_reduced", "param_origin", "param_updated")
    trainable = set() if twice else {"scale"}
    trainable |= {f"blocks.{b}.lora_{w}.weight" for b in (0, 1) for w in "ab"}
    for family in families:
        rows = keyed(read_family(r0["run_dir"], family))
        assert read_family(r1["run_dir"], family) == [], f"rank 1 wrote {family}"
        want = {(name, step, None) for (f, name, step) in refs if f == family}
        assert set(rows) == want, f"{family}: {sorted(set(rows) ^ want)}"
        for (name, step, _), row in rows.items():
            assert_row_matches(row, refs[(family, name, step)], OPS, rtol=1e-5)
        per_step = {step: {n for (n, s, _) in rows if s == step} for step in range(STEPS)}
        assert per_step[STEPS - 1] == trainable, family  # frozen parameters: no rows
    if case["fsdp"] == 2 and case["mv"]:
        # The adapter unused at step 0 has no gradient and no state anywhere: no row (not an empty one).
        unused = {"blocks.1.lora_a.weight", "blocks.1.lora_b.weight"}
        for family in ("grad_reduced", "exp_avg", "exp_avg_sq"):
            names = {r["name"] for r in read_family(r0["run_dir"], family) if int(r["step"]) == 0}
            assert names == trainable - unused, family
