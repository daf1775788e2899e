"""Single-process names of Megatron expert parameters (`adapters/megatron/layout.py::global_renames`).

Transformer Engine's grouped experts (`TEGroupedMLP`: `experts.linear_fc1.weight{i}`, one parameter per
local expert, numbered locally) need TE, which does not install on this CPU host: the module below is a
STAND-IN that has only what the renaming reads, the attribute Megatron's `MoELayer` carries
(`local_expert_indices`) and TE's parameter names. The real GroupedMLP and SequentialMLP layouts run under
expert parallelism in tests/adapters/test_megatron_layouts.py.
"""

from __future__ import annotations

import torch
from torch import nn

from adapters.megatron.layout import global_renames, rename


class _GroupedLinear(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        for i in range(experts):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.zeros(2, 2)))
            self.register_parameter(f"bias{i}", nn.Parameter(torch.zeros(2)))


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1, self.linear_fc2 = _GroupedLinear(2), _GroupedLinear(2)


class _MoELayer(nn.Module):
    def __init__(self, first: int) -> None:
        super().__init__()
        self.local_expert_indices = [first, first + 1]  # this rank's experts: 2 of 4, EP rank first // 2
        self.experts = _Experts()


def test_transformer_engine_grouped_experts_get_their_global_index():
    for ep_rank in (0, 1):
        root = nn.Module()
        root.mlp = _MoELayer(2 * ep_rank)
        renames = global_renames(root)
        names = sorted(rename(n, renames) for n, _ in root.named_parameters())
        experts = (2 * ep_rank, 2 * ep_rank + 1)
        kinds = ("weight", "bias")
        want = sorted(f"mlp.experts.linear_fc{k}.{w}{e}" for k in (1, 2) for w in kinds for e in experts)
        assert names == want, (ep_rank, names)
