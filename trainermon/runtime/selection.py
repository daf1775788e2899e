"""Which parameters and modules the config selects, and the names they are written under."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainermon.config import MonitorConfig
from trainermon.names import clean_name, squash_name, unique_names


@dataclass
class ParamSelection:
    """The monitored parameters (adapter order) and their output names."""

    params: list = field(default_factory=list)  # adapter MonitoredParams
    names: list[str] = field(default_factory=list)
    position: dict[int, int] = field(default_factory=dict)  # adapter index -> position in `params`

    def entries(self, pieces: list, micro_step: int | None = None) -> list[tuple]:
        """(vpp_stage, name, micro_step, piece) for every parameter with a piece."""
        return [
            (mp.vpp_stage, name, micro_step, piece)
            for mp, name, piece in zip(self.params, self.names, pieces)
            if piece is not None
        ]


def select_params(adapter, config: MonitorConfig) -> ParamSelection:
    """Parameters whose name starts with a target (plain, `vpp:`-prefixed or squashed); all without
    targets. Names are squashed with `squash_name`, falling back to full names where they would collide."""
    targets = config.targets
    chosen = []
    for mp in adapter.parameters():
        prefixed = f"{mp.vpp_stage}:{mp.name}"
        if not targets or any(
            mp.name.startswith(t) or prefixed.startswith(t) or squash_name(mp.name).startswith(t)
            for t in targets
        ):
            chosen.append(mp)
    names = [mp.name for mp in chosen]
    if config.squash_name:
        names = unique_names([squash_name(n) for n in names], names)
    return ParamSelection(chosen, names, {mp.index: i for i, mp in enumerate(chosen)})


def select_modules(adapter, config: MonitorConfig, every: bool) -> list[tuple[int, str, torch.nn.Module]]:
    """(vpp_stage, output name, module) of the modules whose activations are collected: every module
    (`every`), or those named in `targets` (plainly or as `vpp:name`). Wrapper modules are skipped."""
    out = []
    seen: set[int] = set()
    for vpp_stage, root in enumerate(adapter.roots()):
        for name, module in root.named_modules():
            if not name or id(module) in seen or adapter.is_wrapper_module(module):
                continue
            local = clean_name(name)
            name = adapter.global_name(vpp_stage, local)
            named = (name, local, f"{vpp_stage}:{name}", f"{vpp_stage}:{local}")
            if every or any(n in config.targets for n in named):
                seen.add(id(module))
                out.append((vpp_stage, squash_name(name) if config.squash_name else name, module))
    return out
