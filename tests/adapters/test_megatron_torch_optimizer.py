"""Megatron's tensor-parallel layers trained with a plain torch optimizer (no Megatron DDP, no
MegatronOptimizer): the parameters are still pieces of larger ones. The plain-torch adapter once took
them for whole parameters: each rank wrote its own piece under the full name, twice, with the piece's
shape. On 2 gloo ranks (TP=2, DP=1), against full tensors all-gathered in the test."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

OPS = ("norm", "min", "max", "mean")
FAMILIES = ("grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")
CLIP_VALUE = 1e-4  # below most gradient entries: clipping changes them


def _run(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from tests import megatron_cpu_shim

    megatron_cpu_shim.install()
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import MegatronModule

    from trainermon import TrainerMon

    torch.set_num_threads(1)
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(root, "out")
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1)
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=world, use_cpu_initialization=True, gradient_accumulation_fusion=False
    )

    def init(w: torch.Tensor) -> None:
        torch.nn.init.normal_(w, std=0.1)

    class Net(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=cfg)
            self.fc1 = ColumnParallelLinear(
                8, 16, config=cfg, init_method=init, bias=True, gather_output=False
            )
            self.fc2 = RowParallelLinear(
                16, 8, config=cfg, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.fc1(x)
            y, _ = self.fc2(torch.relu(h))
            return y

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    families = dict(wg_distribution=True, mv_distribution=True, param_distribution=True)
    monitor = TrainerMon(write_config(Path(root) / f"cfg{rank}.json", ops=list(OPS), ndigits=12, **families))
    monitor.set_monitor(net, optimizer=opt)

    def full(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            t = torch.cat(parts, dim=p.partition_dim)
        return t

    refs: dict = {}
    for step in range(2):
        net(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        for name, p in net.named_parameters():
            refs[("grad_reduced", name, step)] = ref_stats(full(p.grad, p))
            refs[("param_origin", name, step)] = ref_stats(full(p.data, p))
        # The user's clipping, by value (the same on every rank): the rows are read before it
        torch.nn.utils.clip_grad_value_(net.parameters(), CLIP_VALUE)
        opt.step()
        for name, p in net.named_parameters():
            refs[("param_updated", name, step)] = ref_stats(full(p.data, p))
            for kind in ("exp_avg", "exp_avg_sq"):
                refs[(kind, name, step)] = ref_stats(full(opt.state[p][kind], p))
        opt.zero_grad()
    monitor.close()
    shapes = {name: list(full(p.data, p).shape) for name, p in net.named_parameters()}
    rows = {family: keyed(read_family(monitor.run_dir, family)) for family in FAMILIES}
    ps.destroy_model_parallel()
    return {"adapter": monitor.loop.adapter.name, "rows": rows, "refs": refs, "shapes": shapes,
            "faults": dict(monitor.faults.counts)}  # fmt: skip


def test_tensor_parallel_pieces_under_a_torch_optimizer_are_merged_and_written_once(tmp_path: Path) -> None:
    results = run_ranks(_run, world_size=2, timeout=300, root=str(tmp_path))
    assert [r["adapter"] for r in results] == ["megatron", "megatron"]
    assert results[0]["faults"] == results[1]["faults"] == {}
    refs, shapes = results[0]["refs"], results[0]["shapes"]
    biggest = max(max(-ref["min"], ref["max"]) for (f, _, _), ref in refs.items() if f == "grad_reduced")
    assert biggest > 10 * CLIP_VALUE  # the clipping changed the gradients
    for family in FAMILIES:
        assert not results[1]["rows"][family], family  # written once: by the first rank of every group
        rows = results[0]["rows"][family]
        assert set(rows) == {(name, step, None) for name in shapes for step in range(2)}, family
        for (name, step, _), row in rows.items():
            assert row["shape"].replace(" ", "") == str(shapes[name]).replace(" ", ""), (family, name)
            assert row["shard"] == "", (family, name)
            assert_row_matches(row, refs[(family, name, step)], OPS)
