"""The background worker's CPU time per collected step: deriving a step's values and writing its CSV rows.

    PYTHONPATH=. python benchmarks/worker_cpu.py [--workloads b,c] [--config all] [--steps 20]
    PYTHONPATH=. python benchmarks/worker_cpu.py --format csv,prometheus --prometheus-ab

Why it matters on the training thread: the worker's work is Python, so it holds the GIL while it runs,
and the training thread takes the GIL back at every torch call. Its CPU time therefore comes back as
step time, on the steps during which it writes (one in several: it wakes every `write_interval_s`); the
overhead benchmark's mean step holds it, the median mostly not.

Method: the overhead benchmark's model and `config` run `--steps` + 5 steps with the payloads kept
instead of handed to the worker; then the worker's own `_handle` processes the last `--steps` payloads
on this thread, timed with `time.thread_time` (CPU time: sleeping and waiting do not count), files
written to a temporary directory, CSV by default (`--format`: the sinks to open). One torch thread.
`--prometheus-ab` measures each repeat twice, side by side: as shipped (the page rendered when scraped,
not scraped here) and with the page rendered at every step written, as before session 40.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

import torch

# trainermon first, from PYTHONPATH (another checkout, to compare): overhead.py puts this repository first
# on sys.path, so importing it first would time this checkout's worker whatever PYTHONPATH says
import trainermon  # noqa: I001

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead as ov  # noqa: E402

from benchmarks import arms  # noqa: E402 - the module overhead.py builds its arms from


def worker_cpu_ms(key: str, config: str, steps: int, render_per_step: bool = False) -> tuple[int, float]:
    """(rows per step, worker CPU ms per step) for one workload and config; `render_per_step`: the
    Prometheus page rendered at every step written (the cost a scrape per step would have)."""
    from trainermon.exporters.prometheus import PrometheusExporter

    shipped = PrometheusExporter._publish
    if render_per_step:
        PrometheusExporter._publish = lambda self: setattr(self, "_rendered", self._render())
    try:
        return _measure(key, config, steps)
    finally:
        PrometheusExporter._publish = shipped


def _measure(key: str, config: str, steps: int) -> tuple[int, float]:
    work = ov._workloads(False)[key]
    arm = ov.build_arm(work, "trainermon", config, tempfile.mkdtemp())
    worker = arm.monitor.loop.worker
    kept: list = []
    worker.submit = lambda payload: kept.append(payload) or True
    for _ in range(steps + 5):
        ov.run_step(arm)
    kept = kept[-steps:]
    start = time.thread_time()
    for payload in kept:
        worker._handle(payload, worker._generation)
    worker._each(worker._generation, "flush", None, 0, None)  # the exporters flushed, as the worker does
    cpu_ms = (time.thread_time() - start) / len(kept) * 1e3
    ov.close_arm(arm)
    return len(kept[0].rows), cpu_ms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="b,c")
    parser.add_argument("--config", default="all")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="fresh measurements per workload")
    parser.add_argument("--format", default="csv", help="the sinks, comma-separated (config `format`)")
    parser.add_argument("--prometheus-ab", action="store_true", help="also with a render per step")
    args = parser.parse_args()
    arms.CONFIGS[args.config] = {**arms.CONFIGS[args.config], "format": args.format.split(",")}
    torch.set_num_threads(1)
    logging.getLogger("trainermon").setLevel(logging.ERROR)
    print(f"trainermon from {os.path.dirname(os.path.dirname(os.path.abspath(trainermon.__file__)))}")
    arms_ab = (False, True) if args.prometheus_ab else (False,)
    for key in args.workloads.split(","):
        figures: dict[bool, list] = {arm: [] for arm in arms_ab}
        for _ in range(args.repeats):  # the arms side by side, alternating
            for arm in arms_ab:
                figures[arm].append(worker_cpu_ms(key, args.config, args.steps, render_per_step=arm))
        for arm in arms_ab:
            rows = figures[arm][0][0]
            cpu = sorted(ms for _, ms in figures[arm])
            label = " (page rendered per step)" if arm else ""
            print(
                f"({key}) {args.config} {args.format}{label}: {rows} rows per step, worker CPU "
                f"{cpu[len(cpu) // 2]:.2f} ms per step (range {cpu[0]:.2f}..{cpu[-1]:.2f}; "
                f"{1e3 * cpu[len(cpu) // 2] / rows:.2f} us per row)"
            )


if __name__ == "__main__":
    main()
