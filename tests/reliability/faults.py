"""Shared by the fault tests in this folder (issue 11; they were one file, test_reliability_faults.py):
the test's own float64 reference statistics and row check, the listening sockets of this process, a small
model with its training steps, an exporter lookup and a Prometheus scrape, and the CSV well-formedness
check. docs/RELIABILITY.md lists every test, its measured result, and the defects these tests found.
"""

from __future__ import annotations

import csv
import glob
import io
import math
import os
import socket
import urllib.request
from pathlib import Path

import pytest
import torch
from torch import nn

from trainermon import TrainerMon

REPO = Path(__file__).resolve().parents[2]  # the repository root (this file is in tests/reliability/)
FULL_OPS = ("norm", "min", "max", "mean", "zeros", "nans", "infs", "numel")
PLAIN_OPS = ("norm", "min", "max", "mean", "zeros", "numel")
EPS = 1e-3


def ref(t: torch.Tensor, nonfinite: bool) -> dict[str, float]:
    """Float64 reference. With NaN/Inf counting on, norm/mean/min/max cover finite values only; without
    it, a NaN or Inf shows in them (the README's documented semantics)."""
    x = t.detach().reshape(-1).to(torch.float64)
    n = x.numel()
    nan = float("nan")
    if n == 0:
        return {"norm": 0.0, "mean": nan, "min": nan, "max": nan, "zeros": nan, "nans": 0.0, "infs": 0.0,
                "numel": 0.0}  # fmt: skip
    finite = torch.isfinite(x)
    nans = float(torch.isnan(x).sum())
    n_finite = float(finite.sum())
    infs = n - n_finite - nans
    zeros = float(((x.abs() < EPS) & finite).sum()) / n
    if nonfinite:
        if not n_finite:
            return {"norm": 0.0, "mean": nan, "min": nan, "max": nan, "zeros": zeros, "nans": nans,
                    "infs": infs, "numel": float(n)}  # fmt: skip
        v = torch.where(finite, x, 0.0)
        mn, mx = torch.where(finite, x, math.inf).min(), torch.where(finite, x, -math.inf).max()
        count = n_finite
    else:
        v, mn, mx, count = x, x.min(), x.max(), n
    return {
        "norm": float(torch.dot(v, v).sqrt()),
        "mean": float(v.sum()) / count,
        "min": float(mn),
        "max": float(mx),
        "zeros": zeros,
        "nans": nans,
        "infs": infs,
        "numel": float(n),
    }


def check_row(row: dict[str, str], want: dict[str, float], ops: tuple[str, ...], where: str) -> None:
    scale = want["norm"] / max(want["numel"], 1.0) ** 0.5 if math.isfinite(want["norm"]) else 0.0
    for op in ops:
        got, exp = float(row[op]), want[op]
        if math.isnan(exp) or math.isinf(exp):
            assert (math.isnan(got) and math.isnan(exp)) or got == exp, f"{where} {op}: {got} != {exp}"
        elif op in ("min", "max", "nans", "infs", "numel", "zeros"):
            # Exact: min/max are values of the tensor, counts are integers (17 significant digits in CSV).
            assert got == pytest.approx(exp, rel=1e-12, abs=0.0), f"{where} {op}: {got} != {exp}"
        else:  # float32 accumulation on the device
            tol = 1e-5 * abs(exp) + (1e-6 * scale if op == "mean" else 1e-12)
            assert abs(got - exp) <= tol, f"{where} {op}: {got} != {exp}"


def _listening() -> list[tuple[str, int]]:
    """(address, port) of this process's listening TCP sockets, from /proc (Linux)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, size in (("/proc/self/net/tcp", 4), ("/proc/self/net/tcp6", 16)):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                addr_hex, port_hex = fields[1].split(":")
                raw = bytes.fromhex(addr_hex)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
                found.append(
                    (
                        socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6, raw),
                        int(port_hex, 16),
                    )
                )
    return sorted(found)


def _small_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _steps(model, opt, n: int, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _exporter(mon: TrainerMon, cls: str):
    found = [e for e in mon.loop.worker.exporters if type(e).__name__ == cls]
    return found[0] if found else None


def _scrape(port: int) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "rank"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def csv_problems(root: str) -> list[str]:
    """Every CSV file under root must parse: header first, complete rows only (newline-terminated, full
    column count), steps non-decreasing within a file and inside the file's step bucket."""
    problems = []
    for path in glob.glob(os.path.join(root, "**", "*.csv"), recursive=True):
        if os.path.basename(path) == "stack_info.csv":
            continue
        with open(path, "rb") as fh:
            data = fh.read()
        name = os.path.relpath(path, root)
        if not data:
            continue  # created, nothing written yet: nothing to misread
        if not data.endswith(b"\n"):
            problems.append(f"{name}: partial last line {data.splitlines()[-1][-60:]!r}")
            continue
        rows = list(csv.reader(io.StringIO(data.decode("utf-8"))))
        header, body = rows[0], rows[1:]
        if header[:3] != ["vpp_stage", "name", "step"]:
            problems.append(f"{name}: bad header {header}")
            continue
        first, last = (int(v) for v in os.path.basename(path)[:-4].rsplit("_", 1)[1].split("-"))
        previous = first
        for i, row in enumerate(body):
            if len(row) != len(header):
                problems.append(f"{name}:{i + 2}: {len(row)} columns, header has {len(header)}")
                continue
            step = int(row[2])
            if not (previous <= step <= last):
                problems.append(f"{name}:{i + 2}: step {step} out of order or outside [{first}, {last}]")
            previous = step
            numeric = [
                i
                for i, col in enumerate(header)
                if col not in ("vpp_stage", "name", "shape", "dtype", "shard")
            ]
            for i in numeric:
                if header[i] == "skipped" and row[i] == "":
                    continue  # "not known": a step whose optimizer ran reports no flag (see README)
                float(row[i])  # every statistic parses as a number (nan/inf included)
    return problems
