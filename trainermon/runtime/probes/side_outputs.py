"""Outputs besides the statistics, in msprobe's layouts: `stack_info` (each module's call stack, once, to
stack_info.csv) and `print_struct` (the module structure with its gradients after the first step, then the
run stops, as msprobe does). Both use hooks of their own on every module, installed only when the key is on;
the stack hooks are removed once the file is written."""

from __future__ import annotations

import csv
import json
import linecache
import logging
import os
import sys
import warnings
from typing import Any

import torch
from torch.utils.hooks import BackwardHook

import trainermon
from trainermon.config import MonitorConfig
from trainermon.copies import CopySafe
from trainermon.names import squash_name

from ..plan import StepPlan
from ..selection import named_modules
from .base import Probe
from .module_hooks import in_backward

logger = logging.getLogger("trainermon")

#: trainermon's own frames (the hook, its wrappers) head the stack of a hook call: not the user's stack
_OWN_DIR = os.path.dirname(os.path.abspath(trainermon.__file__)) + os.sep
_NO_STACK = "The call stack retrieval failed."  # msprobe's text when there is no frame to show


class PrintStructDone(SystemExit):
    """Raised after the first step when `print_struct` is on: the structure is written, the run stops.
    `str()` is the message; the exit status is 1, and Python prints nothing more at exit (the message is
    logged once already)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 1  # a str code would be printed to stderr again by the interpreter at exit


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"size={tuple(value.shape)}, dtype={value.dtype}"
    return str(type(value))


def param_struct(value: Any) -> dict[str, str]:
    """msprobe's description of a module's inputs, outputs or gradients: `config` (`tensor`, `tuple[2]`, or
    the type of anything else) and, for a tuple/list, one entry per element (`"0"`: `size=(2, 3), dtype=...`;
    a non-tensor element, nested containers included, as its type)."""
    if isinstance(value, (tuple, list)):
        out = {"config": f"{type(value).__name__}[{len(value)}]"}
        out.update({str(i): _describe(x) for i, x in enumerate(value)})
        return out
    if isinstance(value, torch.Tensor):
        return {"config": "tensor", "tensor": _describe(value)}
    return {"config": str(type(value))}


def call_stack() -> str:
    """The caller's stack as msprobe writes it: innermost frame first, `File P, line N, in F, \\n CODE \\n`
    each, frames without source left out, trainermon's own leading frames dropped. Reads one source line
    per frame (linecache): meant to run once per module."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIR):
        frame = frame.f_back
    parts = []
    while frame is not None:
        code, line = frame.f_code, frame.f_lineno
        text = linecache.getline(code.co_filename, line) if line else ""
        if text:
            parts.append(f"File {code.co_filename}, line {line}, in {code.co_name}, \n {text.strip()} \n")
        frame = frame.f_back
    return "".join(parts) or _NO_STACK


def module_names(adapter: Any, squash: bool) -> list[tuple[str, torch.nn.Module]]:
    """(`{vpp_stage}:{name}`, module) of every module msprobe names, each chunk's root (`0:`) included."""
    out, seen = [], set()
    for vpp_stage, root in enumerate(adapter.roots()):
        if not adapter.is_wrapper_module(root):
            seen.add(id(root))
            out.append((f"{vpp_stage}:", root))
    for vpp_stage, names, module in named_modules(adapter):
        if id(module) in seen or type(module).__name__ == "FullyShardedDataParallel":
            continue
        seen.add(id(module))
        out.append((f"{vpp_stage}:{squash_name(names[0]) if squash else names[0]}", module))
    return out


def _clone(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value.clone() if isinstance(value, torch.Tensor) else value


def _cloning(setup: Any) -> Any:
    def setup_and_clone(*args: Any, **kwargs: Any) -> Any:
        return _clone(setup(*args, **kwargs))  # with autograd on: the gradients pass through the clone

    setup_and_clone.trainermon_original = setup  # type: ignore[attr-defined]
    return setup_and_clone


def clone_backward_hook_tensors(on: bool) -> None:
    """A full backward hook hands on its module's inputs and outputs as views of a custom Function, which an
    in-place op after it (`nn.ReLU(inplace=True)`, `h += x`) may not modify: as msprobe does, they are cloned
    while print_struct's hooks are on (one step: the run stops after it), and `on=False` puts torch's back."""
    for attr in ("setup_input_hook", "setup_output_hook"):
        current = getattr(BackwardHook, attr)
        original = getattr(current, "trainermon_original", None)
        if on and original is None:
            setattr(BackwardHook, attr, _cloning(current))
        elif not on and original is not None:
            setattr(BackwardHook, attr, original)


_FULL_HOOK_WARNING = "Full backward hook is firing when gradients are"
_ADDED: Any = None  # the filter entry quiet_full_hook_warning added (removed at close)


def quiet_full_hook_warning(on: bool) -> None:
    """torch warns when a full backward hook fires on a module whose inputs need no gradient (the first
    layer): about a hook the user never registered, and under `-W error` inside their backward(). Ignored
    while print_struct's hooks are on; the filter goes at close(), so the user's own hooks warn again."""
    global _ADDED
    ours = [f for f in warnings.filters if getattr(f[1], "pattern", None) == _FULL_HOOK_WARNING]
    if on and not ours:  # a user's identical filter stays the user's: neither added nor removed
        warnings.filterwarnings("ignore", message=_FULL_HOOK_WARNING)
        _ADDED = warnings.filters[0]
    elif not on and _ADDED is not None:
        if _ADDED in warnings.filters:
            warnings.filters.remove(_ADDED)
            getattr(warnings, "_filters_mutated", lambda: None)()  # the module's cache of filter decisions
        _ADDED = None


class SideOutputsProbe(Probe):
    def __init__(self, loop: Any) -> None:
        super().__init__(loop)
        self._handles: list[Any] = []
        self._stack_handles: list[Any] = []
        self.struct: dict[str, dict] = {}  # msprobe's key order: forward (input, output), then the gradients
        self._classes: dict[str, str] = {}
        self._stacks: dict[str, str] = {}  # recorded, not yet written
        self._stacks_done = False  # written once (msprobe writes the file once, then unhooks)
        self._flagged: list[torch.nn.Module] = []  # modules our full backward hook marked as such

    def configure(self, config: MonitorConfig) -> None:
        self.close()
        if not (config.print_struct or config.stack_info):
            return
        if config.module_ranks and self.loop.rank not in config.module_ranks:
            return
        stacks = config.stack_info and not self._stacks_done
        for name, module in module_names(self.loop.adapter, config.squash_name):
            try:  # a module that refuses a hook loses its entry, never the set-up
                self._hook(name, module, config.print_struct, stacks)
            except Exception as exc:  # noqa: BLE001
                self.loop.faults.record(f"print_struct/stack_info hooks of {name}", exc)
        if config.print_struct and self._handles:
            clone_backward_hook_tensors(True)
            quiet_full_hook_warning(True)

    def _hook(self, name: str, module: torch.nn.Module, struct: bool, stacks: bool) -> None:
        if struct:
            self._handles.append(
                module.register_forward_hook(CopySafe(self._struct_hook(name)), with_kwargs=True)
            )
            # msprobe leaves out modules with old-style backward hooks: torch refuses both kinds on a module
            # that ever had one (the flag outlives the hook)
            if module._is_full_backward_hook is not False:
                if module._is_full_backward_hook is None:
                    self._flagged.append(module)  # put back at close(): the user's old-style hooks work again
                self._handles.append(module.register_full_backward_hook(CopySafe(self._grad_hook(name))))
        if stacks:
            self._stack_handles.append(
                module.register_forward_hook(CopySafe(self._stack_hook(name)), with_kwargs=True)
            )

    def _struct_hook(self, name: str):
        loop = self.loop

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            try:
                if name in self.struct or not module.training or in_backward() or not loop.plan.collecting:
                    return
                inputs = [a for a in args if isinstance(a, torch.Tensor)]
                inputs += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
                self.struct[name] = {"input": param_struct(inputs), "output": param_struct(output)}
                self._classes[name] = type(module).__name__
            except Exception as exc:  # noqa: BLE001
                loop.faults.record("forward hook", exc)

        return hook

    def _grad_hook(self, name: str):
        loop = self.loop

        def hook(module: torch.nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            try:
                if not loop.plan.collecting:  # before the entry: the collected step's forward fills it
                    return
                entry = self.struct.setdefault(name, {})
                if "input_grad" in entry:
                    return
                entry["input_grad"] = param_struct(grad_input)
                entry["output_grad"] = param_struct(grad_output)
                self._classes.setdefault(name, type(module).__name__)
            except Exception as exc:  # noqa: BLE001
                loop.faults.record("backward hook", exc)

        return hook

    def _stack_hook(self, name: str):
        loop = self.loop

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            try:
                if name not in self._stacks and loop.plan.collecting:
                    self._stacks[name] = call_stack()
            except Exception as exc:  # noqa: BLE001
                loop.faults.record("forward hook", exc)

        return hook

    def post_optim(self, plan: StepPlan) -> None:
        # Stop here, before the loop hands the step's rows to the writer: the user asked for the structure
        # only, and a rank directory with part of a step (grad and optimizer rows, no actv) would mislead
        if self.loop.config.print_struct and plan.collecting:
            self.end(plan)

    def end(self, plan: StepPlan) -> None:
        # Also reached by a collected step without post_optim (escalated only): the rows are written then
        config = self.loop.config
        if self._stacks and config.stack_info and not self._stacks_done:
            self._write_stacks()
        if config.print_struct:
            self._write_struct_and_stop()

    def close(self) -> None:
        if self._handles:
            clone_backward_hook_tensors(False)
            quiet_full_hook_warning(False)
        for handle in self._handles + self._stack_handles:
            handle.remove()
        for module in self._flagged:
            if not module._backward_hooks:
                module._is_full_backward_hook = None
        self._flagged.clear()
        self._handles.clear()
        self._stack_handles.clear()

    def _write_stacks(self) -> None:
        """msprobe's stack_info.csv: header `module_name,stack_info`, one row per module run by the first
        collected step, written once (an existing file is kept); the stack hooks go then."""
        try:
            run_dir = self.loop.outputs.run_dir
            os.makedirs(run_dir, exist_ok=True)
            path = os.path.join(run_dir, "stack_info.csv")
            if not os.path.exists(path):
                with open(path, "w", encoding="utf-8", newline="") as fh:
                    writer = csv.writer(fh, lineterminator="\n")  # pandas' line ends, as msprobe's file
                    writer.writerow(["module_name", "stack_info"])
                    writer.writerows(self._stacks.items())
        except Exception as exc:  # noqa: BLE001
            self.loop.faults.record("stack_info", exc)
        self._stacks = {}
        self._stacks_done = True
        for handle in self._stack_handles:
            handle.remove()
        self._stack_handles.clear()

    def _write_struct_and_stop(self) -> None:
        loop = self.loop
        out_dir = os.path.join(loop.outputs.root, "module_struct", f"rank{loop.rank}")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "module_struct.json")
        # `class` is trainermon's extra key, last: msprobe's own keys keep their places
        classes = self._classes
        struct = {name: {**entry, "class": classes.get(name, "")} for name, entry in self.struct.items()}
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(struct, fh, indent=2)
        loop.close()
        message = f"trainermon: print_struct is on: module structure written to {path}; stopping the run"
        logger.warning(message)
        raise PrintStructDone(message)
