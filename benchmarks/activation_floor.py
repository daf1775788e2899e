"""What any exact per-module monitor pays for `all` on the many-module workloads (issue 23), next to what
trainermon pays: the floor under the `all` target.

    PYTHONPATH=. python benchmarks/activation_floor.py [--workloads b,c] [--blocks 8] [--json FILE]

Arms, interleaved in blocks in one process (the overhead benchmark's models, steps, AdamW and one torch
thread):

- `none`: no monitor.
- `hooks`: the least PyTorch machinery that msprobe's per-module activation gradients need: on every
  module a forward pre-hook that gives the module a view of each input that requires grad and a forward
  hook, and one autograd-node pre-hook per view and per output (the cheapest hook PyTorch has), all
  doing nothing.
- `floor`: `hooks`, plus one read of every value an exact `all` must read, with as little Python as
  possible: each hooked activation and gradient read at its hook by the native kernel into a
  preallocated table (a tensor already read, same memory and version, is not read again while it
  lives: a dead tensor's memory may hold a new one), and after the update the parameters (twice:
  before and after), gradients, exp_avg and exp_avg_sq read in one kernel call per family. No names,
  no rows, no output: a lower bound, not a monitor.
- `trainermon[all]`: the product, config `all` of benchmarks/overhead.py.
- `floor[wg+mv+param]`: the update-side reads of `floor` alone (no hooks), next to
  `trainermon[wg+mv+param]`.

Printed per arm: median step, added ms against `none`, the noise band of `none` (its 25th..75th
percentile), and the median own time (time inside the hooks and the update-side reads, as trainermon's
own-time clock counts it; the floor's hooks are timed the same way). `floor - none` is what this CPU
charges any monitor that hooks every module and reads every value once; `trainermon - floor` is what
trainermon could still remove.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import weakref
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead as ov  # noqa: E402

from trainermon.stats import fused  # noqa: E402

ROW = 7


def _own_time(method: Any) -> Any:
    """Count the method's time in `own_s`, as trainermon's clock counts its hooks and step events."""

    def timed(self: FloorMonitor, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            self.own_s += time.perf_counter() - start

    return timed


class FloorMonitor:
    """Hooks (and, with `read`, kernel reads) with no bookkeeping: see the module docstring."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, read: bool, hooks: bool = True
    ) -> None:
        self.model, self.optimizer, self.read = model, optimizer, read
        self.table = torch.empty((1 << 16, ROW), dtype=torch.float64)
        self.address = self.table.data_ptr()
        self.used = 0
        self.own_s = 0.0  # time inside the hooks and update-side reads, as trainermon's own time
        #: (address, elements, version) -> the tensor read there this step (weakly)
        self.done: dict[tuple[int, int, int], weakref.ref] = {}
        self.handles = []
        for module in model.modules() if hooks else ():
            if type(module) is nn.ModuleList:
                continue  # never called
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._fwd, with_kwargs=True))

    def _kernel(self, t: torch.Tensor) -> None:
        plan = fused.plan(t)
        if plan is None or not plan[1]:
            return
        seen = (plan[0], plan[1], t._version)
        read = self.done.get(seen)
        if read is not None and read() is not None:
            return  # the tensor read lives on, so this one at its address is a view of the same values
        # A dead tensor's memory may hold another tensor now (the backward pass frees and reuses
        # gradient buffers of one size): such a tensor is new and is read.
        self.done[seen] = weakref.ref(t)
        fused.run_one(plan, self.address + (self.used % len(self.table)) * ROW * 8)
        self.used += 1

    @_own_time
    def _grad(self, grads: tuple) -> None:
        if self.read and grads[0] is not None:
            self._kernel(grads[0])

    @_own_time
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled():
            return None
        new = []
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                a = a.view_as(a)
                a.grad_fn.register_prehook(self._grad)
            new.append(a)
        return tuple(new), kwargs

    @_own_time
    def _fwd(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        if self.read:
            for t in (*args, *outputs):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self._kernel(t)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                t.grad_fn.register_prehook(self._grad)

    def _read_family(self, tensors: list[torch.Tensor]) -> None:
        plans = [p for p in map(fused.plan, tensors) if p is not None and p[1]]
        if plans:
            fused.run_at(plans, self.address)

    @_own_time
    def before_update(self) -> None:
        if self.read:
            params = [p for p in self.model.parameters() if p.grad is not None]
            self._read_family([p.grad for p in params])
            self._read_family([p.detach() for p in params])

    @_own_time
    def after_update(self) -> None:
        if self.read:
            params = [p for p in self.model.parameters() if p in self.optimizer.state]
            for key in ("exp_avg", "exp_avg_sq"):
                self._read_family([self.optimizer.state[p][key] for p in params])
            self._read_family([p.detach() for p in params])
        self.done.clear()
        self.used = 0


def floor_step(arm: ov.Arm, monitor: FloorMonitor) -> None:
    x, y = arm.batch
    t0 = time.perf_counter()
    arm.optimizer.zero_grad(set_to_none=True)
    arm.loss(arm.model(x), y).backward()
    monitor.before_update()
    arm.optimizer.step()
    monitor.after_update()
    arm.times.append(time.perf_counter() - t0)
    arm.own.append(monitor.own_s)
    monitor.own_s = 0.0


def run_workload(key: str, blocks: int, steps: int) -> dict[str, Any]:
    work = ov._workloads(False)[key]
    out = tempfile.mkdtemp()
    arms = {
        "none": (ov.build_arm(work, "none", "-", out), None),
        "hooks": (ov.build_arm(work, "none", "-", out), "hooks"),
        "floor": (ov.build_arm(work, "none", "-", out), "floor"),
        "trainermon[all]": (ov.build_arm(work, "trainermon", "all", out), None),
        "floor[wg+mv+param]": (ov.build_arm(work, "none", "-", out), "reads"),
        "trainermon[wg+mv+param]": (ov.build_arm(work, "trainermon", "wg+mv+param", out), None),
    }
    floors = {
        name: FloorMonitor(arm.model, arm.optimizer, read=kind != "hooks", hooks=kind != "reads")
        for name, (arm, kind) in arms.items()
        if kind is not None
    }

    def step(name: str) -> None:
        arm = arms[name][0]
        if name in floors:
            floor_step(arm, floors[name])
        else:
            ov.run_step(arm)

    for name in arms:
        for _ in range(5):
            step(name)
        arms[name][0].times.clear()
        arms[name][0].own.clear()
    for _ in range(blocks):
        for name in arms:
            for _ in range(2):  # settle after the switch, untimed
                step(name)
            del arms[name][0].times[-2:]
            del arms[name][0].own[-2:]  # empty for the arms with no own time
            for _ in range(steps):
                step(name)
    base = arms["none"][0].times
    q = statistics.quantiles(base, n=4)
    base_ms = statistics.median(base) * 1e3
    result = {"workload": key, "title": work.title, "none_ms": base_ms}
    result["none_band_ms"] = [q[0] * 1e3, q[2] * 1e3]
    for name, (arm, _) in arms.items():
        median = statistics.median(arm.times) * 1e3
        added = median - base_ms
        result[name] = {"median_ms": median, "added_ms": added, "added_pct": 100 * added / base_ms}
        if arm.own:
            own = statistics.median(arm.own) * 1e3
            result[name].update(own_ms=own, own_pct=100 * own / base_ms)
    for arm, _ in arms.values():
        ov.close_arm(arm)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="b,c", help="a subset of a,b,c ((a): ~3 s per step)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per arm per block")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (overhead.py's default: 1)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not fused.AVAILABLE:
        raise SystemExit(f"the floor reads with the native kernel, which is not available: {fused.KIND}")
    torch.set_num_threads(args.threads)
    logging.getLogger("trainermon").setLevel(logging.ERROR)
    results = []
    for key in args.workloads.split(","):
        res = run_workload(key, args.blocks, args.steps)
        results.append(res)
        low, high = res["none_band_ms"]
        print(f"({key}) {res['title']}: none {res['none_ms']:.2f} ms (band {low:.2f}..{high:.2f})")
        for name in [k for k in res if isinstance(res[k], dict) and k != "none"]:
            r = res[name]
            added = f"{r['added_ms']:+7.2f} ms ({r['added_pct']:+6.1f}%)"
            own = f"  own {r['own_ms']:7.2f} ms ({r['own_pct']:5.2f}%)" if "own_ms" in r else ""
            print(f"  {name:24s} {r['median_ms']:8.2f} ms  added {added}{own}")
    if args.json:
        with open(args.json, "w") as f:
            meta = {"cpu": ov._cpu_name(), "torch": torch.__version__, "threads": args.threads}
            json.dump({**meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
