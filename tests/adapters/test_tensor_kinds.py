"""Every kind of tensor through a running monitor: the process survives, and each row is exact or skipped
with one counted fault and one log line.

The kinds reach the monitor as a module's second output (the actv family) while every family is on, and,
for the tensor-parallel case, as the parameters, gradients and optimizer state themselves. The cases run in
spawned processes (`run_ranks`), so a crash (the SIGSEGV the native kernel gave a DTensor, or eager torch
gives a tensor whose storage was released) fails the test with its exit code instead of killing pytest.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import keyed, read_family, ref_stats, write_config

OPS = ["norm", "mean", "min", "max", "nans", "infs", "numel"]
STEPS = 2


class WrapperTensor(torch.Tensor):
    """A `__torch_dispatch__` wrapper subclass: it holds no memory of its own (like DTensor, FP8 and NF4
    tensors), so reading its address would read garbage."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.inner if isinstance(x, WrapperTensor) else x

        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class PlainSubclass(torch.Tensor):
    """A subclass over ordinary memory (no __torch_dispatch__)."""


class TaggedParameter(nn.Parameter):
    """A Parameter subclass, as libraries use to tag parameters."""


def _released(y: torch.Tensor) -> torch.Tensor:
    t = y.detach().clone()
    t.untyped_storage().resize_(0)  # what FSDP does to unsharded parameters after use
    return t


def _fake(y: torch.Tensor) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(2, 4)


#: kind -> (make the odd tensor from the layer output y, dense reference or None when it must be skipped)
KINDS = {
    "requires grad": (lambda y: y * 2, lambda t: t),
    "parameter subclass": (lambda y: TaggedParameter(y.detach() + 1), lambda t: t.detach()),
    "plain subclass": (
        lambda y: (y.detach() - 1).as_subclass(PlainSubclass),
        lambda t: t.as_subclass(torch.Tensor),
    ),
    "dispatch wrapper": (lambda y: WrapperTensor(y.detach()), None),
    "meta": (lambda y: torch.empty(2, 4, device="meta"), None),
    "fake": (_fake, None),
    "sparse coo": (lambda y: torch.relu(y.detach()).to_sparse(), lambda t: t.to_dense()),
    "sparse csr": (lambda y: torch.relu(y.detach()).to_sparse_csr(), lambda t: t.to_dense()),
    "quantized": (
        lambda y: torch.quantize_per_tensor(y.detach(), 0.05, 0, torch.qint8),
        lambda t: t.dequantize(),
    ),
    "nested": (lambda y: torch.nested.nested_tensor([y.detach()[0], y.detach()[1, :3]]), None),
    "neg view": (lambda y: torch._neg_view(y.detach()), lambda t: t.resolve_neg()),
    "conj view (complex)": (lambda y: y.detach().to(torch.complex64).conj(), None),
    "complex": (lambda y: torch.complex(y.detach(), y.detach()), None),
    "zero-size": (lambda y: y[:0], lambda t: t),
    "0-dim": (lambda y: y.sum(), lambda t: t),
    "expanded (stride 0)": (lambda y: y.detach()[:1].expand(6, 4), lambda t: t.contiguous()),
    "released storage": (_released, None),
    "float8": (lambda y: y.detach().to(torch.float8_e4m3fn), lambda t: t.float()),
    # floating point, yet no cast exists: reaching the engine, it cost every later step's rows
    "packed float4": (lambda y: torch.zeros(2, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2), None),
}
#: Integer and bool outputs are not activations (token ids, masks): skipped by design, with no fault.
NOT_ACTIVATIONS = {"int": lambda y: (y * 10).long(), "bool": lambda y: y > 0}


class Emit(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.make = make
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor):
        y = self.lin(x)
        odd = self.make(y)
        self.seen.append(odd)
        return y, odd


class Net(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.emit = Emit(make)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.emit(x)
        return self.head(y)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)  # refusals by design are warnings
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _run_kinds(rank: int, world_size: int, out_dir: str, kinds: list[str]) -> dict:
    from trainermon import TrainerMon

    results = {}
    for kind in kinds:
        make = KINDS[kind][0] if kind in KINDS else NOT_ACTIVATIONS[kind]
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_dir, kind.replace(" ", "_"))
        cfg = _every_family(os.path.join(out_dir, "cfg.json"))
        torch.manual_seed(0)
        model = Net(make)
        model.emit.lin.weight = TaggedParameter(model.emit.lin.weight.detach().clone())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        lines = _Lines()
        logging.getLogger("trainermon").addHandler(lines)
        try:
            monitor = TrainerMon(cfg)
            monitor.set_monitor(model, optimizer=opt)
            for step in range(STEPS):
                model(torch.full((2, 4), float(step + 1)) * torch.arange(1.0, 5.0)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            monitor.close()
        finally:
            logging.getLogger("trainermon").removeHandler(lines)
        ref = KINDS[kind][1] if kind in KINDS else None
        results[kind] = {
            "run_dir": monitor.run_dir,
            "faults": dict(monitor.faults.counts),
            "lines": lines.messages,
            "refs": [ref_stats(ref(t)) for t in model.emit.seen] if ref is not None else None,
            "shape": list(model.emit.seen[0].shape) if kind not in ("nested",) else None,
            "weight_ref": ref_stats(model.emit.lin.weight),
        }
    return results


def _every_family(path: str) -> str:
    keys = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "mv_distribution": True}
    return write_config(Path(path), **keys, param_distribution=True, ops=OPS, ndigits=15, write_interval_s=0)


@pytest.fixture(scope="module")
def kind_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("kinds")
    [results] = run_ranks(
        _run_kinds, world_size=1, out_dir=str(out), kinds=list(KINDS) + list(NOT_ACTIVATIONS)
    )
    return results


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_is_exact_or_skipped_and_counted(kind_results, kind):
    res = kind_results[kind]
    rows = keyed(read_family(res["run_dir"], "actv"))
    unreadable = {k: v for k, v in res["faults"].items() if k.startswith("unreadable tensor")}
    other = {k: v for k, v in res["faults"].items() if not k.startswith("unreadable tensor")}
    assert other == {}, f"{kind}: unexpected faults {other}"
    # The ordinary rows around the odd tensor are all there, every step.
    for step in range(STEPS):
        assert ("emit.output_0", step, 0) in rows and ("head.output", step, 0) in rows, kind
    if KINDS[kind][1] is None:
        assert all(("emit.output_1", s, 0) not in rows for s in range(STEPS)), f"{kind}: a row was written"
        assert sum(unreadable.values()) == STEPS, f"{kind}: faults {unreadable}"  # one per skipped row
        logged = [m for m in res["lines"] if "unreadable tensor" in m]
        assert len(logged) == 1, f"{kind}: log lines {logged}"
        return
    assert unreadable == {}, f"{kind}: {unreadable}"
    for step in range(STEPS):
        row = rows[("emit.output_1", step, 0)]
        ref = res["refs"][step]
        assert json_shape(row) == res["shape"], kind
        if math.isnan(ref["mean"]):  # zero-size
            assert float(row["norm"]) == 0 and row["mean"] == "nan" and int(row["numel"]) == 0
            continue
        for op in ("norm", "mean", "min", "max"):
            got, want = float(row[op]), ref[op]
            assert got == pytest.approx(want, rel=2e-6, abs=1e-6 * ref["norm"]), (
                f"{kind} {op}: {got} vs {want}"
            )
        assert float(row["nans"]) == ref["nans"] and float(row["infs"]) == ref["infs"]


def json_shape(row: dict) -> list[int]:
    import json

    return json.loads(row["shape"])


@pytest.mark.parametrize("kind", list(NOT_ACTIVATIONS))
def test_integer_outputs_are_not_activations(kind_results, kind):
    res = kind_results[kind]
    rows = keyed(read_family(res["run_dir"], "actv"))
    # msprobe numbers the tuple (float, integer) as output_0, output_1; the integer one gets no row.
    assert ("emit.output_0", 0, 0) in rows and ("emit.output_1", 0, 0) not in rows
    assert ("emit.output", 0, 0) not in rows
    assert res["faults"] == {}


def test_parameter_subclass_is_read_in_every_family(kind_results):
    res = kind_results["requires grad"]
    for family in ("param_updated", "grad_reduced", "exp_avg"):
        rows = keyed(read_family(res["run_dir"], family))
        assert ("emit.lin.weight", STEPS - 1, None) in rows, family
    last = keyed(read_family(res["run_dir"], "param_updated"))[("emit.lin.weight", STEPS - 1, None)]
    assert float(last["norm"]) == pytest.approx(res["weight_ref"]["norm"], rel=1e-6)


# ==== tensor parallelism without FSDP: DTensor parameters through the plain torch adapter ==============
class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(4, 8)
        self.w2 = nn.Linear(8, 4)
        self.emit = DTensorEmit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w2(torch.relu(self.w1(x)))
        self.emit(h)
        return h


class DTensorEmit(nn.Module):
    """Outputs DTensors with each kind of placement (Shard, Replicate, Partial) as activations."""

    def forward(self, h: torch.Tensor):
        from torch.distributed.device_mesh import _mesh_resources  # noqa: F401 - torch 2.13 layout
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        mesh = self.mesh
        local = h.detach()
        return (
            DTensor.from_local(local, mesh, [Shard(0)], run_check=False),
            DTensor.from_local(local, mesh, [Replicate()], run_check=False),
            DTensor.from_local(local, mesh, [Partial()], run_check=False),
        )


def _tp_rank(rank: int, world_size: int, out_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    cfg = _every_family(os.path.join(out_dir, f"cfg{rank}.json"))
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = TPNet()
    model.emit.mesh = mesh
    parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    grads = {}
    for step in range(STEPS):
        x = torch.full((2, 4), float(step + 1)) * torch.arange(1.0, 5.0)
        model(x).pow(2).mean().backward()
        grads[step] = {
            n: (ref_stats(p.grad.to_local()), ref_stats(p.grad.full_tensor()))
            for n, p in model.named_parameters()
        }
        opt.step()
        opt.zero_grad()
    monitor.close()
    full = {n: (ref_stats(p.full_tensor()), list(p.shape)) for n, p in model.named_parameters()}
    return {
        "run_dir": monitor.run_dir,
        "faults": dict(monitor.faults.counts),
        "grads": grads,
        "params": full,
    }


def test_tensor_parallel_without_fsdp_survives_and_labels_local_rows(tmp_path):
    """The ColwiseParallel case that killed the process with SIGSEGV: every family on, two ranks. Each
    rank's own gradient piece is its grad_unreduced row, labelled; the optimizer-side rows are the full
    parameters' statistics with their full shapes, written once (by rank 0)."""
    results = run_ranks(_tp_rank, world_size=2, out_dir=str(tmp_path))
    for rank, res in enumerate(results):
        assert res["faults"] == {}, res["faults"]
        own = keyed(read_family(res["run_dir"], "grad_unreduced"))
        grads = keyed(read_family(res["run_dir"], "grad_reduced"))
        params = keyed(read_family(res["run_dir"], "param_updated"))
        for name, label in (("w1.weight", "Shard(0)"), ("w2.weight", "Shard(1)"), ("w1.bias", "Shard(0)")):
            for step in range(STEPS):
                local_ref, full_ref = res["grads"][step][name]
                row = own[(name, step, None)]
                assert row["shard"] == f"{label}[tp={rank}/2]", row
                assert float(row["norm"]) == pytest.approx(local_ref["norm"], rel=1e-6)
                if rank == 0:
                    row = grads[(name, step, None)]
                    assert row["shard"] == "" and float(row["norm"]) == pytest.approx(
                        full_ref["norm"], rel=1e-6
                    )
                else:
                    assert (name, step, None) not in grads
            if rank == 0:
                ref, shape = res["params"][name]
                row = params[(name, STEPS - 1, None)]
                assert json_shape(row) == shape and float(row["max"]) == pytest.approx(ref["max"], rel=1e-6)
        # w2's bias is replicated (Replicate): the whole tensor, written once, no label.
        assert ((("w2.bias", 0, None) in grads) == (rank == 0)) and own[("w2.bias", 0, None)]["shard"] == ""
        actv = keyed(read_family(res["run_dir"], "actv"))
        labels = [actv[(f"emit.output_{i}", 0, 0)]["shard"] for i in range(3)]
        assert labels == [f"Shard(0)[tp={rank}/2]", "", f"Partial(sum)[tp={rank}/2]"], labels
