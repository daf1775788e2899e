"""Outputs besides the statistics: `stack_info` (each module's call stack, once, to stack_info.csv) and
`print_struct` (the module structure after the first step, then the run stops, as msprobe does). Both use
forward hooks of their own, installed only when the key is on."""

from __future__ import annotations

import csv
import json
import logging
import os
import traceback
from typing import Any

import torch

from trainermon.config import MonitorConfig
from trainermon.copies import CopySafe

from ..plan import StepPlan
from ..selection import select_modules
from .base import Probe
from .module_hooks import in_backward
from .slots import activations_in

logger = logging.getLogger("trainermon")


class PrintStructDone(SystemExit):
    """Raised after the first step when `print_struct` is on: the structure is written, the run stops."""


def _shapes(tensors: list[torch.Tensor]) -> list[dict[str, Any]]:
    return [{"shape": list(t.shape), "dtype": str(t.dtype)} for t in tensors]


class SideOutputsProbe(Probe):
    def __init__(self, loop: Any) -> None:
        super().__init__(loop)
        self._handles: list[Any] = []
        self.struct: dict[str, dict] = {}
        self._stacks: dict[str, str] = {}  # recorded, not yet written
        self._written: set[str] = set()

    def configure(self, config: MonitorConfig) -> None:
        self.close()
        if not (config.print_struct or config.stack_info):
            return
        if config.module_ranks and self.loop.rank not in config.module_ranks:
            return
        every = config.print_struct or config.all_xy or not config.targets
        for _vpp, name, module in select_modules(self.loop.adapter, config, every=every):
            self._handles.append(module.register_forward_hook(CopySafe(self._hook(name))))

    def _hook(self, name: str):
        loop = self.loop

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            try:
                if in_backward() or not loop.plan.collecting:
                    return
                config = loop.config
                if config.print_struct and name not in self.struct:
                    self.struct[name] = {
                        "class": type(module).__name__,
                        "input": _shapes(activations_in(args)),
                        "output": _shapes(activations_in(output)),
                    }
                if config.stack_info and name not in self._stacks and name not in self._written:
                    self._stacks[name] = "".join(traceback.format_stack(limit=32)[:-2])
            except Exception as exc:  # noqa: BLE001
                loop.faults.record("forward hook", exc)

        return hook

    def end(self, plan: StepPlan) -> None:
        config = self.loop.config
        if self._stacks and config.stack_info:
            self._write_stacks()
        if config.print_struct:
            self._write_struct_and_stop()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _write_stacks(self) -> None:
        try:
            run_dir = self.loop.outputs.run_dir
            os.makedirs(run_dir, exist_ok=True)
            path = os.path.join(run_dir, "stack_info.csv")
            new = not os.path.exists(path)
            with open(path, "a", encoding="utf-8", newline="") as fh:
                writer = csv.writer(fh)
                if new:
                    writer.writerow(["name", "stack"])
                for name, stack in self._stacks.items():
                    writer.writerow([name, stack])
            self._written.update(self._stacks)
            self._stacks = {}
        except Exception as exc:  # noqa: BLE001
            self.loop.faults.record("stack_info", exc)

    def _write_struct_and_stop(self) -> None:
        loop = self.loop
        out_dir = os.path.join(loop.outputs.root, "module_struct", f"rank{loop.rank}")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "module_struct.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.struct, fh, indent=2)
        loop.close()
        message = f"trainermon: print_struct is on: module structure written to {path}; stopping the run"
        logger.warning(message)
        raise PrintStructDone(message)
