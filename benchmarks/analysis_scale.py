"""Scale benchmark of `trainermon analyze`: a synthetic Parquet dataset of 64 ranks x 2000 steps x 200
tensors (25.6 M rows, the Parquet exporter's layout and schema), analysed in a subprocess per engine
(`--engines pyarrow,duckdb,spark`, the same dataset for each).

Reports: the dataset (rows, files, bytes on disk, uncompressed bytes from the Parquet footers: what
reading it whole would cost), the analysis subprocess's peak RSS (VmHWM from /proc/self/status) and its
RSS after the imports, wall times, and checks of the report (PNGs exist, are valid, non-trivial) and of
the planted findings (spike step, first NaN, growing layers).

    .venv/bin/python benchmarks/analysis_scale.py                  # full scale
    .venv/bin/python benchmarks/analysis_scale.py --ranks 8 --steps 500 --tensors 100   # quick
    .venv/bin/python benchmarks/analysis_scale.py --ranks 256 --steps 977 --tensors 400 \
        --engines pyarrow,duckdb,spark --report-engines pyarrow          # 1.0e8 rows, every engine

Peak memory: the analysis process's VmHWM plus that of every process it started (Spark's JVM in local
mode); a sum of per-process peaks, so an upper bound of the peak of the whole.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
t_start = time.perf_counter()
import trainermon.analysis as A
from trainermon.analysis.report import write_analysis_report
# Everything the analysis imports lazily, imported before the baseline is taken:
import matplotlib.figure, matplotlib.backends.backend_agg, pandas, pyarrow.compute, pyarrow.csv
import pyarrow.dataset, pyarrow.parquet

def kb(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key + ":"))

def children_hwm_kb():
    # VmHWM summed over the processes this one started (the JVM of Spark), recursively
    import os
    total, todo, seen = 0, [os.getpid()], set()
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as fh:
                kids = [int(k) for k in fh.read().split()]
        except OSError:
            kids = []
        for k in kids:
            if k in seen:
                continue
            seen.add(k)
            todo.append(k)
            try:
                with open(f"/proc/{k}/status") as fh:
                    total += next(int(l.split()[1]) for l in fh if l.startswith("VmHWM:"))
            except (OSError, StopIteration):
                pass
    return total

root, out, batch_size, engine, report = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
if engine == "duckdb":
    import duckdb
elif engine == "spark":
    import pyspark.sql
rss_after_imports = kb("VmRSS")
t0 = time.perf_counter()
result = A.analyze(root, batch_size=batch_size, progress=engine == "pyarrow", engine=engine)
t1 = time.perf_counter()
peak_after_analysis = kb("VmHWM")
children_peak = children_hwm_kb()
paths = write_analysis_report(result, out) if report == "1" else {"png": {}, "html": None}
t2 = time.perf_counter()
first = result.first_nonfinite.iloc[0] if len(result.first_nonfinite) else None
print("RESULT " + json.dumps({
    "rows_read": result.summary.rows_read,
    "files_read": result.summary.files_read,
    "import_s": t0 - t_start,
    "analyze_s": t1 - t0,
    "report_s": t2 - t1,
    "rss_after_imports_kb": rss_after_imports,
    "peak_rss_after_analysis_kb": peak_after_analysis,
    "peak_rss_kb": kb("VmHWM"),
    "children_peak_rss_kb": children_peak,
    "engine": engine,
    "spikes": result.spikes["step"].tolist(),
    "first_nonfinite": None if first is None else [int(first["step"]), int(first["rank"]), first["name"]],
    "top_growth": result.growth["grad_reduced"]["layer"].head(3).tolist(),
    "heatmaps": {f"{f}/{s}": list(df.shape) for (f, s), df in result.heatmaps.items()},
    "png": paths["png"],
    "html": paths["html"],
}))
"""


def uncompressed_bytes(root: str) -> int:
    import pyarrow.parquet as pq

    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(".parquet"):
                meta = pq.ParquetFile(os.path.join(directory, name)).metadata
                total += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    return total


def in_memory_bytes(root: str) -> tuple[int, int]:
    """(Arrow in-memory bytes of one part file read whole, extrapolated to every part by row count;
    bytes of that one file). What materialising the dataset as one table would take, at least."""
    import pyarrow.parquet as pq

    parts = sorted(
        os.path.join(d, n) for d, _dirs, files in os.walk(root) for n in files if n.endswith(".parquet")
    )
    table = pq.read_table(parts[0])
    per_row = table.nbytes / max(table.num_rows, 1)
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in parts)
    return int(per_row * rows), table.nbytes


def check_png(path: str) -> dict:
    from matplotlib import image

    data = open(path, "rb").read()
    pixels = image.imread(path)
    return {
        "bytes": len(data),
        "valid_png": data[:8] == b"\x89PNG\r\n\x1a\n",
        "shape": list(pixels.shape),
        "pixel_std": round(float(pixels[..., :3].std()), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--steps-per-part", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=65_536)
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the dataset and the report")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--engines", default="pyarrow", help="comma-separated: pyarrow, duckdb, spark")
    parser.add_argument(
        "--report-engines", default="pyarrow", help="engines whose run also writes the report (PNGs)"
    )
    args = parser.parse_args()

    sys.path.insert(0, REPO)
    from trainermon.analysis.synthetic import write_synthetic_dataset

    work = args.dir or tempfile.mkdtemp(prefix="trainermon_analysis_scale_")
    root, out = os.path.join(work, "dataset"), os.path.join(work, "report")
    spike = args.steps * 3 // 5
    nan = (args.steps * 4 // 5, args.ranks // 2, args.tensors // 3)
    try:
        t0 = time.perf_counter()
        truth = write_synthetic_dataset(
            root,
            args.ranks,
            args.steps,
            args.tensors,
            steps_per_part=args.steps_per_part,
            spike_step=spike,
            nan=nan,
        )
        gen_s = time.perf_counter() - t0
        print(
            f"dataset: {truth.rows:,} rows in {truth.files} files, "
            f"{truth.bytes / 2**20:.0f} MiB, {gen_s:.1f} s"
        )
        runs, checks = {}, {}
        engines = [e for e in args.engines.split(",") if e]
        reporting = set(args.report_engines.split(","))
        for engine in engines:
            report = engine in reporting
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, root, out + "_" + engine, str(args.batch_size), engine,
                 "1" if report else "0"],
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO,
                check=True,
            )  # fmt: skip
            wall = time.perf_counter() - t0
            marked = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            child = json.loads(marked[-1][len("RESULT ") :])
            pngs = {stem: check_png(path) for stem, path in child.pop("png").items()}
            peak_kb = child["peak_rss_kb"] + child["children_peak_rss_kb"]
            runs[engine] = {
                **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in child.items()},
                "subprocess_wall_s": round(wall, 1),
                "rss_after_imports_mib": round(child["rss_after_imports_kb"] / 1024, 1),
                "peak_rss_after_analysis_mib": round(child["peak_rss_after_analysis_kb"] / 1024, 1),
                "peak_rss_mib": round(child["peak_rss_kb"] / 1024, 1),
                "peak_rss_with_children_mib": round(peak_kb / 1024, 1),
                "analysis_increase_mib": round(
                    (child["peak_rss_after_analysis_kb"] - child["rss_after_imports_kb"]) / 1024, 1
                ),
                "batch_size": args.batch_size,
                "pngs": pngs,
            }
            checks[engine] = {
                "rows_all_read": child["rows_read"] == truth.rows,
                "spike_found": child["spikes"] == [spike],
                "first_nan_found": child["first_nonfinite"] == [nan[0], nan[1], truth.nan[2]],
                "growing_layers_found": sorted(child["top_growth"]) == sorted(truth.growing),
                "pngs_ok": not report
                or bool(pngs)
                and all(
                    p["valid_png"] and p["bytes"] > 8000 and p["pixel_std"] > 0.05 for p in pngs.values()
                ),
            }
            print(f"{engine}: analyze {child['analyze_s']:.1f} s, peak {peak_kb / 1024:.0f} MiB", flush=True)
        result = {
            "machine": {
                "cpu": _cpu(),
                "cores": os.cpu_count(),
                "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "dataset": {
                "ranks": args.ranks,
                "steps": args.steps,
                "tensors": args.tensors,
                "rows": truth.rows,
                "files": truth.files,
                "bytes_on_disk": truth.bytes,
                "parquet_uncompressed_bytes": uncompressed_bytes(root),
                "arrow_in_memory_bytes_extrapolated": in_memory_bytes(root)[0],
                "generate_s": round(gen_s, 1),
            },
            "analysis": runs,
            "checks": checks,
        }
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(result, fh, indent=1)
        return 0 if all(all(c.values()) for c in checks.values()) else 1
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
