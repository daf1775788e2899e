"""Per-module hooks against one module-global hook pair (issue 23's first suggestion for the many-module
workloads): what PyTorch charges to call each, and what each costs to switch on and off.

    PYTHONPATH=. python benchmarks/hook_dispatch.py [--workloads b,c] [--blocks 12] [--steps 8]

Arms, interleaved in blocks in one process (the overhead benchmark's models and batches, one torch
thread, forward passes with autograd recording as in training, no backward):

- `none`: no hooks.
- `per-module`: what trainermon installs on a collected step: on every module a forward pre-hook and a
  forward hook, both `with_kwargs=True`, each testing one flag and returning.
- `global`: `register_module_forward_pre_hook` and `register_module_forward_hook(with_kwargs=True)`,
  each finding the module's state in a dict by `id(module)` (what a global design must do to tell the
  selected modules and their names apart) and returning.

Also timed, outside the blocks: switching the hooks on and off once (install then remove), which the
eager path pays on the first collected step after steps that collect nothing (`ModuleHooks.arm`).

What the global pair cannot do (not measured, a property of PyTorch): a global forward pre-hook receives
no keyword arguments (`with_kwargs` exists only for per-module pre-hooks), so it cannot hand a module a
view of a keyword tensor input, which the exact per-module input gradient (`actv_grad`) needs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead as ov  # noqa: E402

NEVER = "the dispatch arms time the call and the first test of a hook body; they never collect"


class Flags:
    """The state a hook body reads first (trainermon's reads `_actv or _actv_grad`); always False here."""

    collecting = False


def per_module(modules: list[nn.Module], flags: Flags) -> list[Any]:
    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if flags.collecting:
            raise RuntimeError(NEVER)

    def forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if flags.collecting:
            raise RuntimeError(NEVER)

    handles = []
    for module in modules:
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(forward, with_kwargs=True))
    return handles


def module_global(modules: list[nn.Module], flags: Flags) -> list[Any]:
    selected = {id(m): m for m in modules}

    def pre(module: nn.Module, args: tuple) -> None:
        if selected.get(id(module)) is not None and flags.collecting:
            raise RuntimeError(NEVER)

    def forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if selected.get(id(module)) is not None and flags.collecting:
            raise RuntimeError(NEVER)

    return [
        nn_module.register_module_forward_pre_hook(pre),
        nn_module.register_module_forward_hook(forward, with_kwargs=True),
    ]


ARMS: dict[str, Callable[[list[nn.Module], Flags], list[Any]] | None] = {
    "none": None,
    "per-module": per_module,
    "global": module_global,
}


def switch_us(install: Callable[[list[nn.Module], Flags], list[Any]], modules: list[nn.Module]) -> float:
    """Median time to install the hooks and remove them again, in microseconds."""
    times = []
    for _ in range(50):
        start = time.perf_counter()
        for handle in install(modules, Flags()):
            handle.remove()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def run_workload(key: str, blocks: int, steps: int) -> dict[str, Any]:
    work = ov._workloads(False)[key]
    torch.manual_seed(0)
    model = work.build()
    x, _ = work.batch()
    modules = list(model.modules())
    flags = Flags()
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for _ in range(blocks):
        for name, install in ARMS.items():
            handles = install(modules, flags) if install is not None else []
            for i in range(steps + 2):  # two settling passes after the switch, untimed
                start = time.perf_counter()
                model(x)
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
            for handle in handles:
                handle.remove()
    base = statistics.median(times["none"])
    q = statistics.quantiles(times["none"], n=4)
    result: dict[str, Any] = {
        "workload": key,
        "title": work.title,
        "modules": len(modules),
        "none_ms": base * 1e3,
        "none_band_ms": [q[0] * 1e3, q[2] * 1e3],
    }
    for name, install in ARMS.items():
        if install is None:
            continue
        median = statistics.median(times[name])
        result[name] = {
            "forward_ms": median * 1e3,
            "added_ms": (median - base) * 1e3,
            "added_us_per_module": (median - base) * 1e6 / len(modules),
            "switch_on_off_us": switch_us(install, modules),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="b,c")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8, help="timed forward passes per arm per block")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for key in args.workloads.split(","):
        res = run_workload(key, args.blocks, args.steps)
        results.append(res)
        low, high = res["none_band_ms"]
        print(
            f"({key}) {res['title']}, {res['modules']} modules: forward, no hooks {res['none_ms']:.2f} ms"
            f" (band {low:.2f}..{high:.2f})"
        )
        for name in ("per-module", "global"):
            r = res[name]
            print(
                f"  {name:10s} {r['forward_ms']:8.2f} ms  added {r['added_ms']:+6.2f} ms"
                f" ({r['added_us_per_module']:+5.2f} us per module)  on+off {r['switch_on_off_us']:8.1f} us"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            meta = {"cpu": ov._cpu_name(), "torch": torch.__version__, "threads": 1}
            json.dump({**meta, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
