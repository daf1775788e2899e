"""With `nans`/`infs` in ops, norm/mean/min/max cover the finite elements, and are NaN for a tensor with no
finite element (its norm was 0, a healthy-looking zero gradient): single tensors and FSDP2 shards on 2
gloo ranks, with the native kernel and on the eager path (TRAINERMON_FUSED=0's), and the accelerator's
masked path. References: the same values in float64 torch, computed here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family, write_config
from trainermon import TrainerMon
from trainermon.stats import EngineOptions, StatsEngine, finalize, fused

OPS = ["norm", "mean", "min", "max", "nans", "infs"]
KERNEL = [pytest.param(True, id="kernel"), pytest.param(False, id="eager")]


def _reference(t: torch.Tensor) -> dict[str, float]:
    """Finite-only statistics, NaN where no element is finite, norm 0 for an empty tensor."""
    x = t.detach().to(torch.float64).flatten()
    finite = x[torch.isfinite(x)]
    none = math.nan if x.numel() else 0.0
    return {
        "norm": float(torch.linalg.vector_norm(finite)) if finite.numel() else none,
        "mean": float(finite.mean()) if finite.numel() else math.nan,
        "min": float(finite.min()) if finite.numel() else math.nan,
        "max": float(finite.max()) if finite.numel() else math.nan,
        "nans": float(torch.isnan(x).sum()),
        "infs": float(torch.isinf(x).sum()),
    }


def _check(got: dict[str, float], want: dict[str, float], what: str) -> None:
    for stat, value in want.items():
        if math.isnan(value):
            assert math.isnan(got[stat]), f"{what} {stat}: got {got[stat]}, want nan"
        else:
            assert got[stat] == pytest.approx(value, rel=1e-6, abs=1e-9), f"{what} {stat}"


def _use_kernel(kernel: bool, monkeypatch=None) -> None:
    if kernel and not fused.AVAILABLE:
        pytest.skip(f"native kernel: {fused.KIND}")
    if not kernel:  # what TRAINERMON_FUSED=0 selects (read once, at import)
        if monkeypatch is not None:
            monkeypatch.setattr(fused, "AVAILABLE", False)
        else:
            fused.AVAILABLE = False


def _spoil(grads: dict[str, torch.Tensor]) -> None:
    """In place: an all-NaN, an all-Inf, a NaN-and-Inf, and a partly NaN gradient."""
    grads["0.weight"].fill_(math.nan)
    grads["0.bias"].fill_(math.inf)
    grads["2.bias"][0], grads["2.bias"][1:] = math.nan, -math.inf
    grads["2.weight"][0, :3] = math.nan


@pytest.mark.parametrize("kernel", KERNEL)
def test_a_tensor_with_no_finite_element_has_nan_statistics(tmp_path, monkeypatch, kernel):
    _use_kernel(kernel, monkeypatch)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = TrainerMon(write_config(tmp_path / "c.json", targets={}, wg_distribution=True, ops=OPS))
    monitor.set_monitor(model, optimizer=opt)
    try:
        model(torch.randn(5, 8)).square().sum().backward()
        _spoil({n: p.grad for n, p in model.named_parameters()})
        refs = {n: _reference(p.grad) for n, p in model.named_parameters()}
        clipped = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        opt.step()
        monitor.flush()
        batch = monitor.last_batch
        rows = {r.name: i for i, r in enumerate(batch.rows) if r.family == "grad_reduced"}
        assert set(rows) == set(refs)
        for name, ref in refs.items():
            _check({s: float(batch.values[s][rows[name]]) for s in ref}, ref, name)
        # the global norm is what clipping returns (NaN), not the finite rows' norm
        assert math.isnan(clipped) and math.isnan(batch.derived.global_grad_norm)
        assert monitor.faults.total == 0
    finally:
        monitor.close()
    written = {r["name"]: r for r in read_family(monitor.run_dir, "grad_reduced")}
    assert written["0.weight"]["norm"].lower() == "nan" and written["0.weight"]["nans"] == "128"


@pytest.mark.parametrize("options", [{}, {"fused": False}, {"force_masked": True}], ids=str)
def test_every_engine_path_finalizes_no_finite_element_as_nan(options):
    """The native kernel (where built), eager torch, and the branch-free masked path the accelerators
    take; an empty tensor keeps norm 0."""
    tensors = [torch.full((37,), math.nan), torch.full((5, 3), -math.inf), torch.tensor([1.0, math.nan])]
    tensors[1][0, 0] = math.nan
    tensors.append(torch.empty(0))
    rows = StatsEngine(EngineOptions(nonfinite=True, **options)).compute(tensors)
    numel = torch.tensor([t.numel() for t in tensors], dtype=torch.float64)
    got = finalize(rows.numpy(), numel.numpy())
    for i, t in enumerate(tensors):
        _check({s: float(got[s][i]) for s in OPS}, _reference(t), f"tensor {i}")


def _fsdp_rows(rank: int, world_size: int, out_dir: str) -> dict:
    """FSDP2 on 2 ranks, for the kernel and the eager path: rank 0's shard of `0.weight` all NaN (rank
    1's finite), `0.bias` all Inf on both; returns each run's grad_reduced statistics and the full
    (spoilt) gradients."""
    import os

    from torch.distributed.fsdp import fully_shard

    found = {}
    kernel_built = fused.AVAILABLE
    for kernel in (True, False):
        fused.AVAILABLE = kernel and kernel_built
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_dir, f"{kernel}{rank}")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        cfg = write_config(Path(out_dir) / f"c{kernel}{rank}.json", targets={}, wg_distribution=True, ops=OPS)
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, optimizer=opt)
        model(torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
        local = {n: p.grad.to_local() for n, p in model.named_parameters()}
        if rank == 0:  # dim-0 shards: rank 0 holds rows 0-7 of 0.weight and 0.bias[:8]
            local["0.weight"].fill_(math.nan)
        local["0.bias"].fill_(math.inf)
        # numpy: a tensor in the result queue would be shared through memory the rank frees when it exits
        full = {n: p.grad.full_tensor().to(torch.float64).numpy().copy() for n, p in model.named_parameters()}
        opt.step()
        monitor.flush()
        batch = monitor.last_batch
        stats = {
            r.name: {s: float(batch.values[s][i]) for s in OPS}
            for i, r in enumerate(batch.rows)
            if r.family == "grad_reduced"
        }
        found[kernel] = (stats, full, monitor.faults.total)
        monitor.close()
    fused.AVAILABLE = kernel_built
    return found


def test_fsdp_shards_without_finite_elements_merge_to_the_finite_shard_or_nan(tmp_path):
    results = run_ranks(_fsdp_rows, world_size=2, out_dir=str(tmp_path), timeout=300)
    for kernel in (True, False):
        stats = {}
        for found in results:
            rank_stats, full, faults = found[kernel]
            assert faults == 0
            stats.update(rank_stats)
        full = {name: torch.from_numpy(grad) for name, grad in full.items()}
        assert set(stats) == set(full)
        for name, grad in full.items():
            _check(stats[name], _reference(grad), f"kernel={kernel} {name}")
        # the cases meant: one shard all NaN and the other finite; every shard all Inf
        assert torch.isnan(full["0.weight"][:8]).all() and torch.isfinite(full["0.weight"][8:]).all()
        assert math.isfinite(stats["0.weight"]["norm"]) and math.isnan(stats["0.bias"]["norm"])


def test_layer_norm_covers_finite_rows_and_is_nan_without_any():
    """Prometheus' per-layer rows combine tensor rows: with NaN counting on, a tensor with no finite value
    (norm NaN since it has none) adds nothing to its layer's norm, and a layer with no finite value at all
    is NaN, not 0; without counts a NaN norm stays visible in its layer."""
    import numpy as np

    from trainermon.stats.table import combine

    groups = np.array([0, 0, 1, 1])
    values = {
        "numel": np.array([4.0, 3.0, 2.0, 5.0]),
        "nans": np.array([4.0, 0.0, 2.0, 1.0]),
        "infs": np.array([0.0, 0.0, 0.0, 4.0]),
        "norm": np.array([np.nan, 3.0, np.nan, np.nan]),
    }
    out = combine(groups, 2, values, ("norm",))
    assert out["norm"][0] == 3.0 and np.isnan(out["norm"][1]), out
    plain = combine(groups, 2, {"numel": values["numel"], "norm": values["norm"]}, ("norm",))
    assert np.isnan(plain["norm"][0]) and np.isnan(plain["norm"][1]), plain
