"""Megatron-Core pipeline schedules on 2 gloo ranks: every activation row against the test's own hooks.

Megatron-LM's training loop sets `deallocate_pipeline_outputs=True`: after a stage sends an output it
replaces the tensor's memory (`out.data = torch.empty(1)`), and the next micro-batch's tensors of the same
shape reuse that memory. A reduction cache keyed on addresses then hands one tensor's statistics to another
(13 actv and 11 actv_grad rows were wrong on PP2 x DP2, 33 and 14 with VPP 2). Here a tiny GPTModel runs
PP 2 with 2 virtual stages and deallocation on, with Megatron's interleaved schedule, and every actv and
actv_grad row must equal what the test's own hooks measured at the moment each tensor was live.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_ranks
from tests.helpers import read_family, ref_stats

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

OPS = ("norm", "mean", "min", "max")
STEPS = 2


def _is_act(t: Any) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _outputs(obj: Any) -> list:
    """msprobe's numbering of outputs: a tuple's elements by position, None included."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return list(obj)
    return []


def _inputs(args: tuple, kwargs: dict) -> list:
    import torch

    return [a for a in args if isinstance(a, torch.Tensor)] + [
        v for v in kwargs.values() if isinstance(v, torch.Tensor)
    ]


NAN_ROW = {"missing": True}  # msprobe's NaN row for an output element that is not a tensor


def _labels(base: str, n: int) -> list[str]:
    return [base] if n == 1 else [f"{base}_{i}" for i in range(n)]


class Recorder:
    """The test's own activation hooks: statistics taken inside the hook, while the tensor is live."""

    def __init__(self) -> None:
        self.rows: dict[tuple, dict[str, float]] = {}
        self.step = 0
        self.calls: dict[int, int] = {}
        self.bases: dict[int, list] = {}  # module id -> (tensor, version, row key) of its hooked inputs
        self.written: set[tuple] = set()  # row keys of inputs their module wrote in place

    def attach(self, chunks: list[Any]) -> None:
        import torch

        from tests.megatron_gpt import single_process_name

        for vpp, chunk in enumerate(chunks):
            root = chunk.module  # the GPTModel inside Megatron's DDP
            for name, module in root.named_modules():
                if not name:
                    continue
                name = single_process_name(root, vpp, name + ".")[:-1]  # global layer numbers
                module.register_forward_pre_hook(self._pre(vpp, name), with_kwargs=True)
                module.register_forward_hook(self._fwd(vpp, name), with_kwargs=True)
        self._torch = torch

    def _key(self, module: Any) -> int:
        return self.calls.get(id(module), 0)

    def _pre(self, vpp: int, name: str):
        def hook(module, args, kwargs):
            torch = self._torch
            if torch._C._current_graph_task_id() != -1 or not torch.is_grad_enabled():
                return None
            micro = self._key(module)
            positional = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            numbered = dict(zip(positional, _labels(f"{name}.input", len(positional))))
            keys = [i for i in positional if _is_act(args[i])] + [k for k, v in kwargs.items() if _is_act(v)]
            labels = [numbered[k] if isinstance(k, int) else f"{name}.input_{k}" for k in keys]
            new_args, new_kwargs = list(args), dict(kwargs)
            for key, label in zip(keys, labels):
                holder = new_args if isinstance(key, int) else new_kwargs
                t = holder[key]
                if t.requires_grad:
                    view = t.view_as(t)
                    view.register_hook(self._grad(vpp, label, micro))
                    holder[key] = view
                    # A module that writes its input in place (Megatron's softmax masks the scores with
                    # masked_fill_) rebases the view, whose hook then never fires. A hook on the memory's
                    # own tensor (the base of the monitor's view: baddbmm's output, which the scores view
                    # whole) sees the gradient of its value before the write, over all its readers: that
                    # is the module's row where the module is its only reader (as the softmax is). The
                    # statistics do not depend on the shape.
                    row_key = ("actv_grad", vpp, label, self.step, micro)
                    whole = t._base is not None and t._base.numel() == t.numel()
                    base = t._base if whole else t
                    base.register_hook(self._grad(vpp, label, micro, only_if_written=row_key))
                    self.bases.setdefault(id(module), []).append((t, t._version, row_key))
            return tuple(new_args), new_kwargs

        return hook

    def _fwd(self, vpp: int, name: str):
        def hook(module, args, kwargs, output):
            torch = self._torch
            if torch._C._current_graph_task_id() != -1:
                return
            micro = self._key(module)
            self.calls[id(module)] = micro + 1
            for t, version, row_key in self.bases.pop(id(module), ()):
                if t._version != version:
                    self.written.add(row_key)
            inputs, outputs = _inputs(args, kwargs), _outputs(output)
            labels = _labels(f"{name}.input", len(inputs)) + _labels(f"{name}.output", len(outputs))
            for label, t in zip(labels, inputs + outputs):
                if _is_act(t):
                    self.rows[("actv", vpp, label, self.step, micro)] = ref_stats(t)
                elif not isinstance(t, torch.Tensor):
                    self.rows[("actv", vpp, label, self.step, micro)] = NAN_ROW
            if not torch.is_grad_enabled():
                return None
            views = {}
            for label, t in zip(_labels(f"{name}.output", len(outputs)), outputs):
                if _is_act(t) and t.requires_grad:
                    if t.is_leaf:  # a parameter as an output (skip_bias_add): this call's use of it only
                        views[id(t)] = t.view_as(t)
                        t = views[id(t)]
                    t.register_hook(self._grad(vpp, label, micro))
            if views and isinstance(output, tuple):
                return tuple(views.get(id(o), o) for o in output)
            return None

        return hook

    def _grad(self, vpp: int, label: str, micro: int, only_if_written: tuple | None = None):
        step = self.step

        def hook(grad):
            if only_if_written is None or only_if_written in self.written:
                self.rows[("actv_grad", vpp, label, step, micro)] = ref_stats(grad)

        return hook


def _pipeline_rank(rank: int, world: int, out_root: str, vpp: int | None) -> dict:
    from tests.megatron_gpt import Layout, setup, train_step
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out_root
    cfg = os.path.join(out_root, f"cfg{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"xy_distribution": True, "all_xy": True, "ops": list(OPS), "ndigits": 12}, fh)
    layout = Layout(pp=2, vpp=vpp, deallocate=True)
    model, optimizer = setup(layout)
    # The reference's pre-hooks replace the inputs (views, to hook their gradients): registered before
    # the monitor's, as a pre-hook replacing inputs after them costs the monitor that call's input rows
    recorder = Recorder()
    recorder.attach(model)
    monitor = TrainerMon(cfg, params_have_main_grad=True)
    monitor.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
    for step in range(STEPS):
        recorder.step, recorder.calls = step, {}
        train_step(model, optimizer, layout, step)
    monitor.close()
    return {"run_dir": monitor.run_dir, "ref": recorder.rows, "faults": dict(monitor.faults.counts)}


@pytest.mark.parametrize("vpp", [2], ids=lambda v: f"vpp{v}")
def test_every_activation_row_is_its_own_tensors(tmp_path: Path, vpp: int) -> None:
    results = run_ranks(_pipeline_rank, world_size=2, out_root=str(tmp_path), vpp=vpp)
    for rank, res in enumerate(results):
        assert res["faults"] == {}, res["faults"]
        wrong, seen = [], set()
        for family in ("actv", "actv_grad"):
            for row in read_family(res["run_dir"], family):
                key = (family, int(row["vpp_stage"]), row["name"], int(row["step"]), int(row["micro_step"]))
                seen.add(key)
                ref = res["ref"].get(key)
                assert ref is not None, f"rank {rank}: row {key} has no reference"
                if ref is NAN_ROW or ref == NAN_ROW:
                    assert all(row[op] == "nan" for op in OPS), (key, row)
                    continue
                for op in OPS:
                    got, want = float(row[op]), ref[op]
                    if abs(got - want) > 1e-5 * abs(want) + 1e-7 * ref["norm"] + 1e-12:
                        wrong.append((key, op, got, want))
        assert not wrong, f"rank {rank}: {len(wrong)} wrong values, e.g. {wrong[:5]}"
        missing = set(res["ref"]) - seen
        assert not missing, f"rank {rank}: {len(missing)} tensors without a row, e.g. {sorted(missing)[:5]}"
        assert len(seen) > 100, len(seen)
