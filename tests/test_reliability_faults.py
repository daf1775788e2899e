"""Reliability under faults (issue 11): hostile tensors through a running monitor, failing and slow sinks,
SIGKILL at random points, scrape load, security properties, and thread hygiene.

Statistics are checked against the test's own float64 references, never computed through the monitor's
code. docs/RELIABILITY.md lists every test, its measured result, and the defects these tests found.
"""

from __future__ import annotations

import ast
import builtins
import csv
import errno
import glob
import http.client
import io
import json
import logging
import math
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from torch import nn

import trainermon.exporters.csv as csv_mod
from tests.distributed import run_ranks
from tests.helpers import keyed, read_family, write_config
from trainermon import ConfigError, TrainerMon, parse_config
from trainermon.collect.records import FAMILIES

REPO = Path(__file__).resolve().parents[1]
FULL_OPS = ("norm", "min", "max", "mean", "zeros", "nans", "infs", "numel")
PLAIN_OPS = ("norm", "min", "max", "mean", "zeros", "numel")
EPS = 1e-3


# ==== 1. hostile tensors through a running monitor ==============================================
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


class Transpose(nn.Module):
    def forward(self, x):
        return x.t()  # a non-contiguous activation


class Labels(nn.Module):
    def forward(self, x):
        return x.argmax(-1), x > 0  # integer and bool outputs: not activations (documented skip)


class Poison(nn.Module):
    def forward(self, x):
        dirty = x.detach().clone()
        dirty[0, 0], dirty[0, 1], dirty[1, 2] = float("nan"), float("inf"), float("-inf")
        return x, dirty  # the second output carries NaN and +-Inf and is not used by the loss


class EmptyOut(nn.Module):
    def forward(self, x):
        return x[:0]  # a zero-element activation


def _poison_grad(g: torch.Tensor, at: tuple[int, int, int] = (0, 1, 2)) -> torch.Tensor:
    g = g.contiguous().clone()
    flat = g.view(-1)
    flat[at[0]], flat[at[1]], flat[at[2]] = float("nan"), float("inf"), float("-inf")
    return g


class Zoo(nn.Module):
    """Parameters and activations of every awkward kind (see the comment on each)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8)  # integer input (token ids): skipped as an activation
        self.fc = nn.Linear(8, 8)
        self.tview = Transpose()
        self.wt = nn.Parameter(torch.randn(8, 8).t())  # a non-contiguous parameter (and gradient, moments)
        self.fp16 = nn.Linear(8, 8).half()
        self.bf = nn.Linear(8, 8).to(torch.bfloat16)
        self.labels = Labels()
        self.poison = Poison()
        self.empty = nn.Parameter(torch.empty(0))  # numel 0
        self.empty_out = EmptyOut()
        # 1.1 M elements (chunked by the engine), non-contiguous, and NaN/Inf in its gradient's second chunk
        self.big = nn.Parameter((torch.randn(1000, 1100) * 0.5 + 0.25).t())
        self.big.register_hook(lambda g: _poison_grad(g, (5, 1_050_000, 1_099_999)))
        bad = torch.randn(16)
        bad[3], bad[4], bad[5] = float("nan"), float("inf"), float("-inf")
        self.bad = nn.Parameter(bad)  # NaN/Inf in the values; its gradient gets NaN/Inf injected too
        self.bad.register_hook(_poison_grad)
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)  # not monitored (no gradient)
        self.register_buffer("mask", torch.tensor([True, False] * 4))  # bool buffer
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))  # integer buffer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(self.emb(ids)))
        h = self.tview(h).t() @ self.wt
        h = self.fp16(h.half()).float()
        h = self.bf(h.bfloat16()).float()
        self.labels(h)
        h = h * self.mask.float()
        self.count += 1
        clean, _dirty = self.poison(h)
        self.empty_out(clean)
        tame = torch.nan_to_num(self.bad, nan=0.0, posinf=0.0, neginf=0.0)
        big = torch.nan_to_num(self.big, nan=0.0, posinf=0.0, neginf=0.0)
        return clean.pow(2).mean() + self.empty.sum() + 1e-6 * big.pow(2).sum() + 1e-3 * tame.pow(2).sum()


class Reference:
    """The test's own instrumentation: clones of every tensor the monitor should describe."""

    def __init__(self, model: Zoo, opt: torch.optim.Optimizer) -> None:
        self.tensors: dict[tuple, torch.Tensor] = {}
        self.step = 0
        for name, module in model.named_modules():
            if name:
                module.register_forward_pre_hook(self._pre(name))
                module.register_forward_hook(self._fwd(name))
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        opt.register_step_pre_hook(self._opt_pre)
        opt.register_step_post_hook(self._opt_post)
        self.opt = opt

    def _keep(self, family: str, name: str, t: torch.Tensor, micro: int | None = 0) -> None:
        self.tensors[(family, name, self.step, micro)] = t.detach().clone()

    def _pre(self, name):
        def hook(module, args):
            floats = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
            args = list(args)
            labels = [f"{name}.input_grad"]
            if len(floats) > 1:
                labels = [f"{name}.input_grad_{j}" for j in range(len(floats))]
            for i, label in zip(floats, labels):
                if args[i].requires_grad:
                    args[i] = args[i].view_as(args[i])
                    args[i].register_hook(lambda g, label=label: self._keep("actv_grad", label, g))
            return tuple(args)

        return hook

    def _fwd(self, name):
        def hook(module, args, out):
            ins = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.is_floating_point()]
            for base, group in ((f"{name}.input", ins), (f"{name}.output", outs)):
                for i, t in enumerate(group):
                    label = base if len(group) == 1 else f"{base}_{i}"
                    self._keep("actv", label, t)
                    if base.endswith("output") and t.requires_grad:
                        grad_label = label.replace(".output", ".output_grad")
                        t.register_hook(lambda g, gl=grad_label: self._keep("actv_grad", gl, g))

        return hook

    def _opt_pre(self, *_):
        for n, p in self.params:
            self._keep("grad_reduced", n, p.grad, None)
            # No reduction in plain PyTorch: the pre-reduce gradient is the same tensor.
            self.tensors[("grad_unreduced", n, self.step, None)] = self.tensors[
                ("grad_reduced", n, self.step, None)
            ]
            self._keep("param_origin", n, p, None)

    def _opt_post(self, *_):
        for n, p in self.params:
            self._keep("param_updated", n, p, None)
            for key in ("exp_avg", "exp_avg_sq"):
                self._keep(key, n, self.opt.state[p][key], None)
        self.step += 1


@pytest.mark.parametrize("ops", [FULL_OPS, PLAIN_OPS], ids=["nan-counting", "nan-propagating"])
def test_hostile_tensors_through_a_running_monitor(tmp_path, monkeypatch, ops):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = write_config(
        tmp_path / "cfg.json",
        all_xy=True,
        wg_distribution=True,
        mv_distribution=True,
        param_distribution=True,
        ops=list(ops),
        eps=EPS,
        ndigits=17,
    )
    model = Zoo()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)  # fp16-safe eps
    reference = Reference(model, opt)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):  # step 0: NaN/Inf in gradients and moments; step 1: also in parameters
        loss = model(torch.randint(0, 10, (4,), generator=gen))
        loss.backward()  # never raises, whatever the tensors hold
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    monitor.close()
    assert all(math.isfinite(v) for v in losses)
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert monitor.dropped_rows == 0

    nonfinite = "nans" in ops
    checked = 0
    refs: dict[int, dict[str, float]] = {}
    for family in FAMILIES:
        rows = keyed(read_family(monitor.run_dir, family))
        want = {(n, s, m) for (f, n, s, m) in reference.tensors if f == family}
        assert set(rows) == want, (family, sorted(set(rows) ^ want))
        for (name, step, micro), row in rows.items():
            t = reference.tensors[(family, name, step, micro)]
            if id(t) not in refs:
                refs[id(t)] = ref(t, nonfinite)
            check_row(row, refs[id(t)], ops, f"{family} {name} step {step}")
            assert row["dtype"] == str(t.dtype) and json.loads(row["shape"]) == list(t.shape)
            checked += 1
    assert checked > 100
    print(f"\nhostile tensors ({'counting' if nonfinite else 'propagating'}): {checked} rows checked")
    # The awkward cases are all there and say what they should.
    actv = keyed(read_family(monitor.run_dir, "actv"))
    names = {n for (n, _s, _m) in actv}
    assert {"tview.output", "poison.output_1", "empty_out.output", "labels.input"} <= names
    assert not {n for n in names if n.startswith("labels.output") or n == "emb.input"}  # documented skip
    assert "frozen" not in {r["name"] for r in read_family(monitor.run_dir, "param_origin")}
    dirty = actv[("poison.output_1", 0, 0)]
    empty = actv[("empty_out.output", 0, 0)]
    assert float(empty["norm"]) == 0 and math.isnan(float(empty["mean"])) and int(empty["numel"]) == 0
    grads = keyed(read_family(monitor.run_dir, "grad_reduced"))
    big = grads[("big", 0, None)]
    assert int(big["numel"]) == 1_100_000 and json.loads(big["shape"]) == [1100, 1000]
    assert not model.big.is_contiguous()
    if nonfinite:
        assert (int(big["nans"]), int(big["infs"])) == (1, 2) and math.isfinite(float(big["norm"]))
        assert (int(dirty["nans"]), int(dirty["infs"])) == (1, 2) and math.isfinite(float(dirty["norm"]))
        assert (int(grads[("bad", 1, None)]["nans"]), int(grads[("bad", 1, None)]["infs"])) == (1, 2)
    else:
        assert math.isnan(float(dirty["norm"])) and math.isnan(float(dirty["max"]))
    assert {r["dtype"] for r in grads.values()} >= {"torch.float16", "torch.bfloat16", "torch.float32"}


# ---- zero-size shards and non-finite shards on 2 gloo ranks, and the control channel ---------------
def _shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """FSDP-style flat sharding: ceil(n / world) elements per rank, so the last ranks may hold none."""
    per = -(-full.numel() // world)
    return full.reshape(-1)[per * rank : per * (rank + 1)]


def _shard_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    split_bad = torch.randn(10, generator=g)
    split_bad[1], split_bad[7], split_bad[8] = float("nan"), float("inf"), float("-inf")  # one on each rank
    all_bad_on_rank0 = torch.randn(6, generator=g)
    all_bad_on_rank0[:3] = float("nan")
    return {
        "one_element": torch.tensor([0.75]),  # rank 1 holds no elements
        "no_elements": torch.empty(0),  # nobody holds any
        "split_nonfinite": split_bad,
        "all_nan_on_rank0": all_bad_on_rank0,
        "bf16_odd": torch.randn(7, generator=g).to(torch.bfloat16),
        "zeros_and_values": torch.tensor([0.0, 0.0, 1e-9, 3.0, -2.0]),
    }


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


def _two_rank_edges(rank: int, world: int, root: str) -> dict:
    import pickle

    import numpy as np
    import torch.distributed as dist

    from trainermon.collect.collector import StepCollector, TransferCounter
    from trainermon.collect.placement import Sharded, TensorPiece
    from trainermon.collect.records import StepScalars
    from trainermon.config import parse_config
    from trainermon.runtime.control import DynamicControl, update_config_file
    from trainermon.stats import EngineOptions, StatsEngine, finalize

    out: dict = {"stats": {}}
    for mode, options in {
        "counting": EngineOptions(nonfinite=True, zeros_eps=EPS),
        "accelerator-path": EngineOptions(nonfinite=True, zeros_eps=EPS, force_masked=True),
        "propagating": EngineOptions(nonfinite=False, zeros_eps=EPS),
    }.items():
        collector = StepCollector(StatsEngine(options), TransferCounter())
        entries = []
        for name, full in _shard_cases().items():
            local = _shard(full, rank, world)
            # The adapters' two ways of saying "no elements here": tensor=None and a zero-size tensor.
            for variant, tensor in (("none", None if local.numel() == 0 else local), ("empty", local)):
                piece = TensorPiece(tensor, Sharded(None), tuple(full.shape), full.dtype)
                entries.append((0, f"{name}/{variant}", None, piece))
        collector.add("param_origin", entries)
        payload = collector.finish(0, StepScalars())
        numel = np.array([r.numel for r in payload.rows], dtype=np.float64)
        values = finalize(payload.partials.numpy(), numel)
        out["stats"][mode] = {
            r.name: {k: float(v[i]) for k, v in values.items()} for i, r in enumerate(payload.rows)
        }
        out["stats"][mode]["_held"] = {n: _shard(f, rank, world).numel() for n, f in _shard_cases().items()}

    # Control: rank 0 alone reads its file; rank 1's own copy is garbage and is never read. The config
    # travels as JSON over a gloo group of the same ranks, never pickled.
    path = os.path.join(root, f"cfg{rank}.json")
    with open(path, "w") as fh:
        fh.write('{"dynamic_on": false}' if rank == 0 else "{ not json, never read")
    listening_before = _listening()
    control = DynamicControl(path, parse_config({"dynamic_on": False}))
    control.attach(None)
    listening_attached = _listening()

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used by the control channel")

    saved = pickle.loads, dist.broadcast_object_list
    pickle.loads, dist.broadcast_object_list = refuse, refuse
    try:
        if rank == 0:
            update_config_file(path, dynamic_on=True, collect_times=7)
            deadline = time.monotonic() + 10
            while not control.watcher.dirty and time.monotonic() < deadline:
                time.sleep(0.01)
        dist.barrier()
        applied = [control.poll() for _ in range(3)]
    finally:
        pickle.loads, dist.broadcast_object_list = saved
    out["control"] = {
        "watcher": control.watcher is not None,
        "group_ranks": dist.get_process_group_ranks(control._group),
        "world_ranks": dist.get_process_group_ranks(dist.group.WORLD),
        "applied": [None if c is None else (c.dynamic_on, c.collect_times) for c in applied],
        "new_listening": sorted(set(listening_attached) - set(listening_before)),
        "after_polls": sorted(set(_listening()) - set(listening_attached)),
    }
    control.close()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_two_rank_edges, world_size=2, timeout=180, root=str(tmp_path_factory.mktemp("edges")))


#: A NaN in some shards only: with NaN counting off, the merged min/max should be NaN (as for a local
#: tensor), but the cross-rank MAX all-reduce drops it (see test_sharded_nan_reaches_min_max).
NAN_IN_ONE_SHARD = ("all_nan_on_rank0",)


@pytest.mark.parametrize("mode", ["counting", "accelerator-path", "propagating"])
def test_zero_size_and_nonfinite_shards_merge_exactly(two_ranks, mode):
    r0, r1 = two_ranks[0]["stats"][mode], two_ranks[1]["stats"][mode]
    assert r1 == {"_held": r1["_held"]}  # sharded rows are written once, by the group's first rank
    assert r1["_held"]["one_element"] == 0 and r1["_held"]["split_nonfinite"] == 5  # the edge is real
    ops = FULL_OPS if mode != "propagating" else PLAIN_OPS
    for name, full in _shard_cases().items():
        want = ref(full, nonfinite=mode != "propagating")
        checked = tuple(op for op in ops if not (mode == "propagating" and name in NAN_IN_ONE_SHARD))
        checked = checked or ("norm", "mean", "zeros", "numel")
        for variant in ("none", "empty"):
            got = {op: str(v) for op, v in r0[f"{name}/{variant}"].items()}
            check_row(got, want, checked, f"{mode} {name}/{variant}")


def test_sharded_nan_reaches_min_max(two_ranks):
    got = two_ranks[0]["stats"]["propagating"]["all_nan_on_rank0/none"]
    assert math.isnan(got["norm"])  # the NaN does show in norm ...
    assert math.isnan(got["min"]) and math.isnan(got["max"])  # ... and, like a local tensor, in min/max


def test_control_channel_is_rank0_file_over_the_job_group(two_ranks):
    c0, c1 = two_ranks[0]["control"], two_ranks[1]["control"]
    assert c0["watcher"] and not c1["watcher"]  # only rank 0 watches (and reads) a file
    assert c0["group_ranks"] == c1["group_ranks"] == c0["world_ranks"] == [0, 1]
    # Both ranks applied rank 0's file at the same poll; rank 1's unreadable copy played no part.
    assert c0["applied"] == c1["applied"] == [(True, 7), None, None]
    for c in (c0, c1):
        # The gloo group's own pair listener (loopback, as MASTER_ADDR), and nothing new after polling.
        assert len(c["new_listening"]) <= 1 and all(ip == "127.0.0.1" for ip, _ in c["new_listening"])
        assert c["after_polls"] == []


# ==== 2. sink faults ===========================================================================
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
            for value in (row[i] for i in numeric):
                float(value)  # every statistic parses as a number (nan/inf included)
    return problems


class _FullDisk:
    """A filesystem whose free space can run out: writes beyond `free` bytes are cut short, then fail
    with ENOSPC, as a real full disk does (a short write, then an error)."""

    def __init__(self) -> None:
        self.free = float("inf")
        self.failures = 0

    def open(self, path, mode="r", buffering=-1, encoding=None, newline=None, **kwargs):
        disk = self

        class Raw(io.RawIOBase):
            def __init__(self) -> None:
                self.f = io.FileIO(path, mode.replace("b", "").replace("t", ""))

            def writable(self) -> bool:
                return True

            def fileno(self) -> int:
                return self.f.fileno()

            def write(self, b) -> int:
                if disk.free <= 0:
                    disk.failures += 1
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                n = int(min(len(b), disk.free))
                written = self.f.write(bytes(b[:n]))
                disk.free -= written
                return written

            def close(self) -> None:
                self.f.close()
                super().close()

        if "b" in mode:
            return Raw() if buffering == 0 else io.BufferedWriter(Raw())
        return io.TextIOWrapper(io.BufferedWriter(Raw()), encoding=encoding or "utf-8", newline=newline)


def _enospc_run(tmp_path, monkeypatch, caplog, healthy_steps: int = 3, steps: int = 8):
    """CSV on a disk that fills up after `healthy_steps` steps; Parquet and Prometheus elsewhere."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "cfg.json",
        xy_distribution=True,
        wg_distribution=True,
        param_distribution=True,
        ops=["norm", "min", "max", "mean", "nans"],
        ndigits=17,
        format=["csv", "parquet", "prometheus"],
        parquet={"steps_per_part": 2},
    )
    disk = _FullDisk()
    monkeypatch.setattr(csv_mod, "open", disk.open, raising=False)  # the CSV writer's own open()
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    port = _exporter(mon, "PrometheusExporter").port
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        losses = _steps(model, opt, healthy_steps)
        mon.flush()
        disk.free = 150  # the next write gets 150 bytes onto the disk, then ENOSPC: a row cut short
        losses += _steps(model, opt, steps - healthy_steps, seed=1)
        mon.flush()
        scraped = _scrape(port)
        mon.close()
    return mon, disk, losses, scraped


def test_disk_full_mid_run(tmp_path, monkeypatch, caplog):
    import trainermon as tm

    mon, disk, losses, scraped = _enospc_run(tmp_path, monkeypatch, caplog)
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)  # training went on
    # One error line for the failing sink, one fault counted, the sink disabled after its first failure.
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "CsvExporter" in errors[0].getMessage(), [r.getMessage() for r in errors]
    assert "No space left on device" in errors[0].getMessage() and "disabled" in errors[0].getMessage()
    assert dict(mon.faults.counts) == {"exporter CsvExporter": 1}
    assert disk.failures == 1
    assert scraped[("trainermon_exporter_errors_total", (("exporter", "csv"),))] == 1
    assert scraped[("trainermon_exporter_errors_total", (("exporter", "parquet"),))] == 0
    assert scraped[("trainermon_monitor_faults_total", ())] == 1
    assert scraped[("trainermon_last_step", ())] == 7  # the other sinks saw every step
    # Parquet has every step; the CSV rows written before the disk filled are intact and equal to it.
    table = tm.load(tmp_path / "out")
    assert sorted(set(table.column("step").to_pylist())) == list(range(8))
    parquet = {
        (r["family"], r["name"], r["step"], r["micro_step"] or 0): r["norm"] for r in table.to_pylist()
    }
    healthy = 0
    for family in FAMILIES:
        for row in read_family(mon.run_dir, family):
            if not row["name"] or row.get("dtype") is None:
                continue  # the row cut short by the full disk (see the next test)
            key = (family, row["name"], int(row["step"]), int(row.get("micro_step") or 0))
            if int(row["step"]) < 3:
                assert float(row["norm"]) == parquet[key], key
                healthy += 1
    per_step = len([k for k in parquet if k[2] == 0])
    assert healthy == 3 * per_step  # every row of every step before the fault
    print(f"\ndisk full: {healthy} CSV rows before the fault intact, Parquet has all 8 steps")


def test_disk_full_leaves_no_partial_row(tmp_path, monkeypatch, caplog):
    mon, *_ = _enospc_run(tmp_path, monkeypatch, caplog)
    assert csv_problems(mon.run_dir) == []


def _deny_writes_under(monkeypatch, root: Path) -> None:
    """Make `root` unwritable. The permission bits do it for a normal user; root ignores them, so for
    root the same EACCES is raised by the calls the sinks use to create directories and files."""
    root.chmod(0o555)
    if os.geteuid() != 0:
        return
    import builtins

    prefix = str(root) + os.sep
    real_makedirs, real_open, real_replace = os.makedirs, builtins.open, os.replace

    def denied(path) -> bool:
        return os.path.abspath(os.fspath(path)).startswith(prefix)

    def makedirs(path, *args, **kwargs):
        if denied(path) and not os.path.isdir(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_makedirs(path, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and denied(file) and any(c in mode for c in "wax+"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        if denied(dst):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", makedirs)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "replace", replace)


def test_existing_unwritable_output_dir(tmp_path, monkeypatch, caplog):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    cfg = write_config(
        tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], format=["csv", "parquet", "prometheus"]
    )
    model, opt = _small_model()
    reference = _steps(*_small_model(), 5)
    _deny_writes_under(monkeypatch, out)
    try:
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            mon = TrainerMon(cfg)
            mon.set_monitor(model, optimizer=opt)
            losses = _steps(model, opt, 5)
            mon.flush()
            scraped = _scrape(_exporter(mon, "PrometheusExporter").port)
            mon.close()
    finally:
        monkeypatch.undo()
        out.chmod(0o755)
    assert losses == reference  # training is bit-identical to the unmonitored run
    assert list(out.iterdir()) == []  # nothing was written there
    # Each file sink: one error naming the problem, counted; the endpoint still serves every step.
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(messages) == 3 and all("Permission denied" in m for m in messages), messages
    assert sum("csv" in m for m in messages) == 1 and sum("parquet" in m for m in messages) == 1
    assert set(mon.faults.counts) == {"exporter csv open", "exporter parquet open"}
    assert [type(e).__name__ for e in mon.loop.worker.exporters] == ["PrometheusExporter"]
    assert scraped[("trainermon_last_step", ())] == 4
    assert scraped[("trainermon_exporter_errors_total", (("exporter", "csv"),))] == 1
    assert scraped[("trainermon_exporter_errors_total", (("exporter", "parquet"),))] == 1


def test_slow_filesystem_never_blocks_training(tmp_path, monkeypatch, caplog):
    """Every CSV write takes 50 ms; the loop must not wait for it: rows are dropped and counted."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm", "max"], queue_size=2)
    slow_write = csv_mod.CsvExporter.write

    def write(self, batch):
        time.sleep(0.05)
        slow_write(self, batch)

    monkeypatch.setattr(csv_mod.CsvExporter, "write", write)
    steps = 60

    def timed(model, opt) -> list[float]:
        gen = torch.Generator().manual_seed(0)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        return times

    bare = timed(*_small_model())
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        t0 = time.perf_counter()
        monitored = timed(model, opt)
        loop = time.perf_counter() - t0
        mon.close()
    rows_per_step = 8  # 2 Linear layers x (weight, bias) x (grad_unreduced, grad_reduced)
    written = sum(len(read_family(mon.run_dir, f)) for f in ("grad_unreduced", "grad_reduced"))
    # Nothing is lost silently: every row was either written or counted as dropped.
    assert written + mon.dropped_rows == steps * rows_per_step
    assert mon.dropped_rows > steps * rows_per_step // 2
    assert sum("queue is full" in r.getMessage() for r in caplog.records) == 1  # warned once
    # The loop never waited for the writer: 60 writes take 3 s, the loop a small fraction of that.
    assert loop < steps * 0.05 / 3, (loop, statistics.median(bare))
    assert statistics.median(monitored) < 1.5 * statistics.median(bare) + 0.005
    print(
        f"\nslow sink: {steps} steps in {loop:.3f} s, "
        f"median step {statistics.median(monitored) * 1e3:.2f} ms "
        f"(unmonitored {statistics.median(bare) * 1e3:.2f} ms); {written} rows written, "
        f"{mon.dropped_rows} dropped and counted"
    )


# ==== 3. crash safety: SIGKILL at random points ===================================================
ZYGOTE = textwrap.dedent(
    """
    import json, os, random, resource, signal, sys, time
    import torch
    from torch import nn
    import pandas  # noqa: F401 - pyarrow imports it on its first table: once here, for every trial
    import pyarrow.parquet  # noqa: F401 - imported once here, inherited by every forked trial
    from trainermon import TrainerMon
    from trainermon.adapters import ADAPTERS, _load
    import trainermon.exporters.csv, trainermon.exporters.parquet  # noqa: F401

    for spec in ADAPTERS:
        _load(spec)
    torch.set_num_threads(1)
    warm = nn.Linear(2, 2)  # the first optimizer step imports more of torch: pay it once, before forking
    warm(torch.ones(1, 2)).sum().backward()
    torch.optim.SGD(warm.parameters(), lr=0.1).step()
    cfg, fsize_cfg, root, trials, budget, seed = sys.argv[1:7]
    rng = random.Random(int(seed))

    def train(out, config, limit=None, steps=None):
        os.environ["MONITOR_OUTPUT_DIR"] = out
        if limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # writes past it: short, then EFBIG
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        mon = TrainerMon(config)
        mon.set_monitor(model, optimizer=opt)
        step = 0
        while steps is None or step < steps:
            model(torch.randn(4, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            step += 1
            time.sleep(0.003)  # the rest of a training step: the worker keeps up, as in a real job
        mon.close()
        print(json.dumps({"faults": dict(mon.faults.counts)}), flush=True)

    def run(fn):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fn()
                code = 0
            finally:
                os._exit(code)
        return pid

    results, end = [], time.monotonic() + float(budget)
    for i in range(int(trials)):
        if time.monotonic() > end:
            break
        out = os.path.join(root, f"kill{i:03d}")
        delay = rng.uniform(0.0, 0.6)
        t0 = time.monotonic()
        pid = run(lambda: train(out, cfg))
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        signaled = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        results.append({"out": out, "delay": delay, "signal": signaled})
    out = os.path.join(root, "fsize")
    pid = run(lambda: train(out, fsize_cfg, limit=6000, steps=30))
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"kills": results, "fsize": {"out": out, "exit": os.WEXITSTATUS(status)}}), flush=True)
    """
)
CRASH_OPS = ["norm", "min", "max", "mean", "nans", "numel"]


@pytest.fixture(scope="module")
def crash_trials(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("crash")
    base = {"xy_distribution": True, "wg_distribution": True, "param_distribution": True, "ndigits": 17}
    cfg = write_config(
        root / "cfg.json",
        **base,
        ops=CRASH_OPS,
        format=["csv", "parquet"],
        parquet={"steps_per_part": 3},
        queue_size=100_000,  # nothing is dropped: a hole in the steps would be a lost write
        write_interval_s=0,  # a write after every step: the kills land between and inside many writes
    )
    fsize = write_config(root / "fsize.json", **base, ops=CRASH_OPS, step_count_per_record=1000)
    (root / "zygote.py").write_text(ZYGOTE)
    args = [str(root / "zygote.py"), cfg, fsize, str(root), "24", "25", "11"]
    env = {k: v for k, v in os.environ.items() if k != "DYNAMIC_MONITOR"}
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    result = lines[-1]
    result["fsize"]["faults"] = lines[0]["faults"] if len(lines) > 1 else None
    result["fsize"]["stderr"] = done.stderr
    return result


def test_sigkill_at_random_points_leaves_only_complete_rows_and_parts(crash_trials):
    import pyarrow.parquet as pq

    import trainermon as tm

    kills = crash_trials["kills"]
    assert len(kills) >= 20 and all(k["signal"] == 9 for k in kills)
    per_step_rows: dict[str, set[int]] = {}
    totals = {"csv_rows": 0, "parts": 0, "trials_with_parts": 0}
    for trial in kills:
        out = trial["out"]
        assert csv_problems(out) == [], trial
        csv_rows: dict[tuple, str] = {}
        for run_dir in glob.glob(os.path.join(out, "*-rank0-*")):
            for family in FAMILIES:
                rows = read_family(run_dir, family)
                totals["csv_rows"] += len(rows)
                steps: dict[int, int] = {}
                for r in rows:
                    steps[int(r["step"])] = steps.get(int(r["step"]), 0) + 1
                    csv_rows[(family, r["name"], int(r["step"]), int(r.get("micro_step") or 0))] = r["norm"]
                # No hole (nothing was dropped), and every step of a family has all of its rows.
                assert sorted(steps) == list(range(len(steps))), (trial, family, sorted(steps))
                per_step_rows.setdefault(family, set()).update(steps.values())
        parts = glob.glob(os.path.join(out, "parquet", "family=*", "rank=*", "*"))
        assert all(os.path.basename(p).startswith("part-") for p in parts), parts  # .tmp: hidden
        totals["parts"] += len(parts)
        totals["trials_with_parts"] += bool(parts)
        for part in parts:
            table = pq.read_table(part)  # a valid footer, every row readable
            first, last = (int(v) for v in os.path.basename(part).split("-")[1:3])
            assert set(table.column("step").to_pylist()) == set(range(first, last + 1))
        if parts:
            # Every Parquet row was written to CSV first, with the very same value.
            for r in tm.load(out).to_pylist():
                key = (r["family"], r["name"], r["step"], r["micro_step"] or 0)
                assert float(csv_rows[key]) == r["norm"] or math.isnan(r["norm"]), key
    # The same number of rows at every step of every trial (4 Linear layers: 8 inputs/outputs, 7 of
    # them with a gradient, 8 weights and biases); SGD has no moments.
    assert per_step_rows == {
        "actv": {8}, "actv_grad": {7}, "grad_unreduced": {8}, "grad_reduced": {8}, "param_origin": {8},
        "exp_avg": set(), "exp_avg_sq": set(), "param_updated": {8},
    }, str(per_step_rows)  # fmt: skip
    assert totals["csv_rows"] > 1000 and totals["trials_with_parts"] >= len(kills) // 2, totals
    delays = sorted(k["delay"] for k in kills)
    print(f"\n{len(kills)} SIGKILL trials, delays {delays[0]:.3f}-{delays[-1]:.3f} s: {totals}")
    # The file-size limit trial (a short write, then EFBIG) still trained to the end.
    assert crash_trials["fsize"]["exit"] == 0, crash_trials["fsize"]["stderr"][-2000:]
    assert crash_trials["fsize"]["faults"] == {"exporter CsvExporter": 1}


def test_short_write_leaves_no_partial_row(crash_trials):
    assert csv_problems(crash_trials["fsize"]["out"]) == []


# ==== 4. load: concurrent scrapes while training ==================================================
def test_scrape_load_every_scrape_succeeds_and_is_well_formed():
    """The short version of benchmarks/prometheus_load.py: 8 clients, at most 1.5 s and 800 scrapes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "prometheus_load", REPO / "benchmarks" / "prometheus_load.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.run_load(
        clients=8, seconds=1.5, max_scrapes=800, quiet_seconds=0.3, width=64, layers=4, parse=True
    )
    s = r["scrape"]
    assert s["failed"] == 0 and s["malformed"] == 0, s["errors"]
    assert s["ok"] == s["started"] and 100 <= s["ok"] <= 800, s  # every scrape answered, and bounded
    assert s["wall_s"] < 1.5 + 10  # bounded in time (a scrape times out after 10 s at worst)
    assert s["regressions"] == 0  # no client ever saw trainermon_last_step go back
    first, last = s["training_steps_during"]
    assert last - first >= 10 and s["last_step_seen"] > s["first_step_seen"]  # training went on
    assert r["faults"] == 0 and r["dropped_rows"] == 0
    t = r["step_ms"]
    assert t["monitored_scraped"] < 5 * t["monitored_quiet"] + 20, t  # loose: 2 shared cores
    print("\n" + bench._report(r))


# ==== 5. security ================================================================================
def _listeners(port: int | None = None) -> list[tuple[str, int]]:
    found = _listening()
    return found if port is None else [a for a in found if a[1] == port]


def test_prometheus_binds_loopback_by_default_and_only_the_configured_host(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    for host, other in ((None, "127.0.0.2"), ("127.0.0.2", "127.0.0.1")):
        section = {} if host is None else {"host": host}
        cfg = write_config(
            tmp_path / "cfg.json", wg_distribution=True, format=["prometheus"], prometheus=section
        )
        model, opt = _small_model()
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt)
        try:
            exporter = _exporter(mon, "PrometheusExporter")
            bound = host or "127.0.0.1"
            assert exporter.server.socket.getsockname() == (bound, exporter.port)
            assert _listeners(exporter.port) == [(bound, exporter.port)]  # no 0.0.0.0 or :: listener
            urllib.request.urlopen(f"http://{bound}:{exporter.port}/metrics", timeout=5).read()
            with pytest.raises(OSError):  # the same port on another loopback address: nobody listens
                socket.create_connection((other, exporter.port), timeout=2).close()
        finally:
            mon.close()


#: Calls that deserialize or evaluate data: (module, attribute) after alias resolution, "*" = any.
UNSAFE_CALLS = {
    ("builtins", "eval"): "evaluates a string",
    ("builtins", "exec"): "executes a string",
    ("builtins", "compile"): "compiles a string",
    ("builtins", "__import__"): "imports a name from data",
    ("importlib", "import_module"): "imports a name from data",
    ("pickle", "*"): "unpickling runs arbitrary code",
    ("_pickle", "*"): "unpickling runs arbitrary code",
    ("cPickle", "*"): "unpickling runs arbitrary code",
    ("dill", "*"): "unpickling runs arbitrary code",
    ("cloudpickle", "*"): "unpickling runs arbitrary code",
    ("marshal", "*"): "unmarshalling code objects",
    ("shelve", "*"): "shelve is pickle",
    ("yaml", "load"): "yaml.load can build arbitrary objects (use safe_load)",
    ("yaml", "unsafe_load"): "builds arbitrary objects",
    ("yaml", "full_load"): "builds arbitrary objects",
    ("pandas", "read_pickle"): "unpickling",
    ("os", "system"): "a shell",
    ("os", "popen"): "a shell",
    ("torch.distributed", "broadcast_object_list"): "pickles over the wire",
    ("torch.distributed", "all_gather_object"): "pickles over the wire",
    ("torch.distributed", "gather_object"): "pickles over the wire",
    ("torch.distributed", "scatter_object_list"): "pickles over the wire",
    ("torch.distributed", "recv_object_list"): "pickles over the wire",
    ("torch.distributed", "send_object_list"): "pickles over the wire",
}
#: Reviewed exceptions: (file relative to the repository, call) -> why it is safe.
ALLOWED_UNSAFE = {
    ("adapters/__init__.py", "importlib.import_module"): "adapter modules from the constant ADAPTERS table",
}


def unsafe_calls(source: str, filename: str) -> list[str]:
    """Calls in `source` that evaluate or deserialize data (see UNSAFE_CALLS), with alias resolution;
    torch.load without weights_only=True, numpy.load with allow_pickle=True and any subprocess call with
    shell=True count too."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            if expr.id in aliases:
                return aliases[expr.id]
            return f"builtins.{expr.id}" if hasattr(builtins, expr.id) else expr.id
        if isinstance(expr, ast.Attribute):
            base = dotted(expr.value)
            return None if base is None else f"{base}.{expr.attr}"
        return None

    def kw(call: ast.Call, name: str):
        for k in call.keywords:
            if k.arg == name and isinstance(k.value, ast.Constant):
                return k.value.value
        return None

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        if name is None:
            continue
        name = name.replace("torch.distributed.distributed_c10d", "torch.distributed")
        module, _, attr = name.rpartition(".")
        why = UNSAFE_CALLS.get((module, attr)) or UNSAFE_CALLS.get((module, "*"))
        if why is None and module.split(".")[0] in ("pickle", "_pickle", "cPickle", "dill", "cloudpickle"):
            why = "unpickling runs arbitrary code"
        if name == "torch.load" and kw(node, "weights_only") is not True:
            why = "torch.load without weights_only=True unpickles"
        if name in ("numpy.load", "np.load") and kw(node, "allow_pickle") is True:
            why = "numpy.load with allow_pickle=True unpickles"
        if module == "subprocess" and kw(node, "shell") is True:
            why = "a shell"
        if why:
            found.append(f"{filename}:{node.lineno}: {name} ({why})")
    return found


def test_unsafe_call_scanner_finds_what_it_should():
    bad = textwrap.dedent(
        """
        import pickle, yaml, marshal, numpy as np, torch, subprocess
        import torch.distributed as dist
        from pickle import loads as l
        from torch.distributed import all_gather_object
        pickle.loads(b""); l(b""); yaml.load(s); marshal.loads(b""); eval("1"); exec("x")
        torch.load(p); torch.load(p, weights_only=False); np.load(p, allow_pickle=True)
        dist.broadcast_object_list([x]); all_gather_object([], x); subprocess.run(c, shell=True)
        """
    )
    safe = textwrap.dedent(
        """
        import json, re, yaml, numpy as np, torch, subprocess
        json.loads(s); re.compile(p); yaml.safe_load(s); np.load(p); torch.load(p, weights_only=True)
        subprocess.run(["ls"]); getattr(o, "x")
        """
    )
    assert [hit.split(" ")[1] for hit in unsafe_calls(bad, "bad.py")] == [
        "pickle.loads", "pickle.loads", "yaml.load", "marshal.loads", "builtins.eval", "builtins.exec",
        "torch.load", "torch.load", "numpy.load",
        "torch.distributed.broadcast_object_list", "torch.distributed.all_gather_object", "subprocess.run",
    ]  # fmt: skip
    assert unsafe_calls(safe, "safe.py") == []


def test_package_never_evaluates_or_unpickles_config_or_data():
    found = []
    files = 0
    for top in ("trainermon", "adapters", "exporters"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            files += 1
            for hit in unsafe_calls(path.read_text(encoding="utf-8"), rel):
                call = hit.split(": ", 1)[1].split(" ", 1)[0]
                if (rel, call) not in ALLOWED_UNSAFE:
                    found.append(hit)
    assert files > 30
    assert found == []


@pytest.mark.parametrize("key", ["parquet.dir", "prometheus.sd_dir"])
@pytest.mark.parametrize(
    "value", ["/etc/cron.d", "..", "../outside", "a/../../outside", "a/..", "..\\\\outside", "x\x00y"]
)
def test_output_paths_cannot_escape_the_output_dir(key, value):
    section, sub = key.split(".")
    with pytest.raises(ConfigError) as exc:
        parse_config({section: {sub: value}})
    message = str(exc.value)
    assert f"'{key}'" in message and repr(value)[:20] in message
    assert "relative to MONITOR_OUTPUT_DIR without '..'" in message


def test_output_goes_only_under_monitor_output_dir(tmp_path, monkeypatch, caplog):
    """Every sink, stack_info, anomaly dumps, discovery files, a dynamic reload: files appear only under
    MONITOR_OUTPUT_DIR (the config file itself aside), wherever it points; an escaping edit is refused."""
    assert parse_config({"parquet": {"dir": "./data/ds"}, "prometheus": {"sd_dir": "sd"}}).parquet.dir
    monkeypatch.chdir(tmp_path / "cwd" if (tmp_path / "cwd").mkdir() is None else tmp_path)
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    cfg = write_config(
        tmp_path / "cfg.json",
        dynamic_on=True,
        all_xy=True,
        wg_distribution=True,
        mv_distribution=True,
        param_distribution=True,
        stack_info=True,
        ops=["norm", "nans"],
        format=["csv", "parquet", "prometheus"],
        parquet={"dir": "data/ds", "steps_per_part": 1},
        prometheus={"sd_dir": "sd"},
        alert={"rules": [{"rule_name": "AnomalyNan", "args": {}}], "dump": True},
    )
    for out in (tmp_path / "out", tmp_path / "elsewhere" / "deep"):
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
        model, opt = _small_model()
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt)
        _steps(model, opt, 2)
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")  # an anomaly: the detector dumps it
        _steps(model, opt, 1)
        good = json.loads(Path(cfg).read_text())
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            Path(cfg).write_text(json.dumps({**good, "parquet": {"dir": "../escaped"}}))
            mon.loop.control.watcher.dirty = True
            _steps(model, opt, 1)
        assert mon.config.parquet.dir == "data/ds"  # the escaping edit was refused ...
        assert "parquet.dir" in caplog.text and "relative to MONITOR_OUTPUT_DIR" in caplog.text  # ... loudly
        Path(cfg).write_text(json.dumps(good))
        mon.close()
        assert glob.glob(str(out / "data" / "ds" / "family=*" / "rank=0" / "part-*.parquet"))
        assert glob.glob(str(out / "anomaly_detected" / "*.jsonl"))
        assert glob.glob(str(out / "*-rank0-*" / "stack_info.csv"))
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    outside = {p for p in written if not p.startswith(("out/", "elsewhere/deep/"))}
    assert outside == {"cfg.json"}, sorted(outside)
    assert any(p.startswith("elsewhere/deep/data/ds/") for p in written)


def test_control_file_is_the_only_control_channel(tmp_path, monkeypatch):
    """A dynamic monitor listens on nothing; with the Prometheus sink, on exactly its one (read-only) port."""
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    for formats, expected in ((["csv"], 0), (["csv", "prometheus"], 1)):
        cfg = write_config(tmp_path / "cfg.json", dynamic_on=True, wg_distribution=True, format=formats)
        before = set(_listening())
        model, opt = _small_model()
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt)
        _steps(model, opt, 2)
        new = set(_listening()) - before
        try:
            assert mon.loop.control is not None and mon.loop.control.watcher is not None
            assert len(new) == expected, new
            if expected:
                exporter = _exporter(mon, "PrometheusExporter")
                assert new == {("127.0.0.1", exporter.port)}
                # The endpoint only serves the metrics page: no method changes anything.
                for method in ("POST", "PUT", "DELETE"):
                    conn = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=5)
                    conn.request(method, "/metrics", body=b'{"dynamic_on": false}')
                    assert conn.getresponse().status == 501
                    conn.close()
                assert mon.config.dynamic_on and mon.loop.plan.collecting
        finally:
            mon.close()
        assert set(_listening()) - before == set()  # closed: nothing left listening


# ==== 6. threads: close() and interpreter exit ======================================================
def _foreign_threads(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t not in before and t.is_alive())


def test_close_is_idempotent_flushes_everything_and_joins_every_thread(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "cfg.json",
        dynamic_on=True,
        wg_distribution=True,
        ops=["norm"],
        format=["csv", "parquet", "prometheus"],
        parquet={"steps_per_part": 1000, "seconds_per_part": None},  # only close() completes the part
    )
    before = set(threading.enumerate())
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    port = _exporter(mon, "PrometheusExporter").port
    _steps(model, opt, 5)
    _scrape(port)
    idle = socket.create_connection(("127.0.0.1", port), timeout=5)  # a scraper that never sends
    time.sleep(0.2)  # the server has accepted it: a handler thread waits for its request
    started = _foreign_threads(before)
    assert {"trainermon-worker", "trainermon-prometheus"} <= set(started), started
    assert len(started) >= 4, started  # + the config watcher's observer and emitter, + the idle handler
    try:
        t0 = time.monotonic()
        mon.close()
        took = time.monotonic() - t0
        mon.close()  # idempotent: nothing to do, nothing raised
        left = _foreign_threads(before)
    finally:
        idle.close()
    assert left == [], f"threads still running after close(): {left}"
    assert took < 5, took
    print(f"\nclose(): {len(started)} monitor threads {started} joined in {took:.3f} s")
    # Everything was flushed: the last step is in the CSV and in the Parquet part that close() completed.
    assert {int(r["step"]) for r in read_family(mon.run_dir, "grad_reduced")} == set(range(5))
    import trainermon as tm

    assert sorted(set(tm.load(tmp_path / "out").column("step").to_pylist())) == list(range(5))
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


EXIT_SCRIPT = textwrap.dedent(
    """
    import os, socket, sys, time, urllib.request
    import torch
    from torch import nn
    from trainermon import TrainerMon
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(sys.argv[1])
    monitor.set_monitor(model, optimizer=opt)
    for _ in range(6):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    port = monitor.loop.worker.exporters[-1].port
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    idle = socket.create_connection(("127.0.0.1", port))  # still connected at exit, never sends
    print(monitor.run_dir, flush=True)
    print(time.monotonic(), flush=True)
    # no close(): the interpreter exits with the worker, watcher and HTTP threads running
    """
)


def test_interpreter_exit_without_close_with_every_thread_running(tmp_path):
    cfg = write_config(
        tmp_path / "cfg.json",
        dynamic_on=True,
        wg_distribution=True,
        ops=["norm"],
        format=["csv", "parquet", "prometheus"],
        parquet={"steps_per_part": 1000, "seconds_per_part": None},
    )
    (tmp_path / "exit.py").write_text(EXIT_SCRIPT)
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path / "out"), "DYNAMIC_MONITOR": "true"}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "exit.py"), cfg], env=env, cwd=REPO, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    ended = time.monotonic()
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir, last_line = done.stdout.split()[-2:]
    exit_took = ended - float(last_line)  # from the script's last line to the process being reaped
    assert exit_took < 10, exit_took
    print(f"\nexit without close(): process gone {exit_took:.3f} s after its last line")
    assert {int(r["step"]) for r in read_family(run_dir, "grad_reduced")} == set(range(6))
    import trainermon as tm

    assert sorted(set(tm.load(tmp_path / "out").column("step").to_pylist())) == list(range(6))
    assert not glob.glob(str(tmp_path / "out" / "prometheus_sd" / "*.json"))  # target withdrawn at exit
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


class _HungSink:
    """CSV writes that hang (a dead NFS server) until released."""

    def __init__(self, monkeypatch) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        monkeypatch.setattr(csv_mod.CsvExporter, "write", self.write)

    def write(self, *args) -> None:
        self.entered.set()
        self.release.wait(60)


def _hung_monitor(tmp_path, monkeypatch) -> tuple[TrainerMon, _HungSink]:
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"], queue_size=1)
    sink = _HungSink(monkeypatch)
    model, opt = _small_model()
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    _steps(model, opt, 1)
    assert sink.entered.wait(10)  # step 0 hangs in the sink ...
    _steps(model, opt, 3)  # ... step 1 waits in the full queue, steps 2 and 3 are dropped
    assert mon.dropped_rows == 2 * 8
    return mon, sink


def _returns_within(fn, seconds: float) -> tuple[bool, list[BaseException], threading.Thread]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), errors, thread


def test_flush_with_a_hung_sink_returns_without_raising(tmp_path, monkeypatch):
    mon, sink = _hung_monitor(tmp_path, monkeypatch)
    try:
        returned, errors, _ = _returns_within(lambda: mon.flush(timeout=0.5), 3.0)
    finally:
        sink.release.set()
        mon.close()
    assert returned and errors == [], errors


def test_close_with_a_hung_sink_is_bounded(tmp_path, monkeypatch):
    mon, sink = _hung_monitor(tmp_path, monkeypatch)
    try:
        returned, errors, thread = _returns_within(lambda: mon.loop.worker.close(timeout=0.5), 3.0)
    finally:
        sink.release.set()
        mon.close()
        thread.join(10)
    assert returned and errors == [], errors
