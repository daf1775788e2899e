"""ZeRO-3 and module outputs, run in test_deepspeed.py's launch (`_all_cases`): ZeRO-3's forward hooks
replace every output with a new tensor, so the activation hooks go before them."""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist
from torch import nn

from tests.helpers import keyed, read_family, ref_stats


class _Reuse(nn.Module):
    """Returns y and a function of y: y's whole gradient includes the use inside the module. And its own
    bias, as Megatron's `skip_bias_add` layers do: ZeRO-3 registers a returned parameter as the module's
    external parameter, and our hook (now before DeepSpeed's) hands on a view of it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(5, 6), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = torch.tanh(self.lin(x))
        return y, self.out(y), self.out.bias


class _ReuseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.block, self.head = _Reuse(), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, z, bias = self.block(x)
        return self.head(y) + z + bias


def zero3_outputs(rank: int, out_root: str) -> list[str]:
    """ZeRO-3's forward hooks hand on `PreBackwardFunctionForModule.apply(y)`, a new tensor whose gradient
    lacks the module's own use of y: `actv_grad` rows of `block.output_0` held only the head's part. The
    reference: y's gradient from a tensor hook on y itself (a forward hook registered before DeepSpeed's)."""
    import deepspeed

    from tests.adapters.test_deepspeed import GAS, MICRO_BATCH, OPS, _ds_config
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "zero3-outputs")
    cfg_path = os.path.join(out_root, f"zero3-outputs-{rank}.json")
    with open(cfg_path, "w") as fh:
        json.dump({"xy_distribution": True, "ops": list(OPS), "ndigits": 12}, fh)
    model = _ReuseNet()
    seen: dict[tuple[str, int], torch.Tensor] = {}
    micro = [0]

    def keep(module: nn.Module, args: tuple, out: tuple) -> None:
        seen[("actv", micro[0])] = out[0].detach().double().clone()
        out[0].register_hook(lambda g, m=micro[0]: seen.__setitem__(("actv_grad", m), g.double().clone()))

    model.block.register_forward_hook(keep)  # before deepspeed.initialize: runs before ZeRO-3's hooks
    basic = torch.optim.SGD(model.parameters(), lr=1e-2)
    config = {**_ds_config({"stage": 3, "bf16": False}, dist.get_world_size())}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=basic, config=config)
    monitor = TrainerMon(cfg_path)
    monitor.set_monitor(engine, grad_acc_steps=GAS, optimizer=engine.optimizer)
    gen = torch.Generator().manual_seed(7 + rank)
    for m in range(GAS):
        micro[0] = m
        engine.backward(engine(torch.randn(MICRO_BATCH, 5, generator=gen)).pow(2).mean())
        engine.step()
    monitor.close()
    assert not monitor.faults.counts, dict(monitor.faults.counts)
    assert model.block.out.bias.is_external_param  # DeepSpeed still sees the returned parameter
    wrong = []
    for family in ("actv", "actv_grad"):
        rows = keyed(read_family(monitor.run_dir, family))
        for m in range(GAS):
            row, ref = rows[("block.output_0", 0, m)], ref_stats(seen[(family, m)])
            for op in OPS:  # float32 statistics of the same float32 values: rtol 1e-5
                if not math.isclose(float(row[op]), ref[op], rel_tol=1e-5, abs_tol=1e-9):
                    wrong.append((family, m, op, row[op], ref[op]))
    assert not wrong, wrong
    return ["zero3-outputs"]
