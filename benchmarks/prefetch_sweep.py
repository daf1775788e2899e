"""How far ahead the native kernel should prefetch on this host: the kernel built with several distances,
each timed against torch's one-pass floor (`torch._foreach_norm`) over the same tensors.

    python benchmarks/prefetch_sweep.py [--distances 0,256,384,512,2048] [--mib 1024,64] [--reps 7]

Method. `trainermon/stats/_fused.c` is compiled once per distance (`-DPREFETCH=N`, the flags of setup.py)
into a temporary folder and loaded side by side in this process; each repetition times every build and
the floor on each tensor size, interleaved, so that host noise hits all alike. One torch thread, a
float32 tensor of normal values per size, medians of the repetitions; the figure is the kernel's time
over the floor's. 0 asks for the line being read (no read-ahead). Needs a C compiler; x86-64 with AVX2
(the only path that prefetches).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sysconfig
import tempfile
import time
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(REPO, "trainermon", "stats", "_fused.c")
CODE_F32 = 0


def build(distance: int, folder: str) -> Any:
    """The kernel module compiled with this prefetch distance (elements)."""
    out = os.path.join(folder, f"p{distance}")
    os.makedirs(out)
    path = os.path.join(out, "_fused" + sysconfig.get_config_var("EXT_SUFFIX"))
    cc = os.environ.get("CC", "cc")
    include = sysconfig.get_paths()["include"]
    cmd = [cc, "-O3", "-std=c11", "-shared", "-fPIC", f"-I{include}", f"-DPREFETCH={distance}", SOURCE]
    subprocess.run([*cmd, "-o", path], check=True)
    spec = importlib.util.spec_from_file_location("_fused", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.SIMD != "avx2":
        raise SystemExit(f"the kernel's path here is {module.SIMD!r}: only the AVX2 path prefetches")
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distances", default="0,256,384,512,768,2048")
    parser.add_argument("--mib", default="1024,64", help="tensor sizes in MiB, float32")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    distances = [int(d) for d in args.distances.split(",")]
    out = torch.zeros(1, 7, dtype=torch.float64)
    with tempfile.TemporaryDirectory() as folder:
        kernels = {d: build(d, folder) for d in distances}
        for mib in (int(m) for m in args.mib.split(",")):
            t = torch.randn(mib * 2**18)
            ptr, n, address = t.data_ptr(), t.numel(), out.data_ptr()
            times: dict[Any, list[float]] = {d: [] for d in distances}
            times["floor"] = []
            for _ in range(args.reps + 1):  # the first repetition warms up and is dropped
                for d, module in kernels.items():
                    start = time.perf_counter()
                    module.stats_one(ptr, n, CODE_F32, address)
                    times[d].append(time.perf_counter() - start)
                start = time.perf_counter()
                torch._foreach_norm([t])
                times["floor"].append(time.perf_counter() - start)
            floor = statistics.median(times["floor"][1:])
            print(f"{mib} MiB: floor {floor * 1e3:.2f} ms ({mib / 1024 / floor:.1f} GiB/s)")
            for d in distances:
                median = statistics.median(times[d][1:])
                ratio = median / floor
                print(f"  {d:>5} ahead ({d * 4:>5} B): {median * 1e3:8.2f} ms = {ratio:.3f}x the floor")


if __name__ == "__main__":
    main()
