"""`ops` with `nans` but not `infs` (msprobe has no `infs` op): NaN elements are left out and counted, and
infinities are values: norm inf, max +inf / min -inf, mean +-inf (NaN with both signs), on every engine
path and through every shard merge; an all-NaN tensor has NaN statistics. Before, an Inf gradient vanished
from the rows (norm and max of the finite half only, nans 0). With `infs` in ops nothing changes. The
references are float64 torch statistics of the tensor with its NaN (and, with `infs`, Inf) removed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family, write_config
from trainermon import TrainerMon
from trainermon.pipeline.anomaly import load_anomalies
from trainermon.stats import CHUNK, GROUP_MAX, EngineOptions, StatsEngine, finalize, fused, grad_sumsq, merge
from trainermon.stats.table import combine

NAN_ONLY = ["norm", "min", "max", "mean", "nans"]  # what msprobe users configure
BOTH = ["norm", "min", "max", "mean", "nans", "infs"]
PATHS = {"native": {}, "cpu-eager": {"fused": False}, "accelerator-path": {"force_masked": True}}
INF, NAN = math.inf, math.nan


def _reference(t: torch.Tensor, infs_counted: bool) -> dict[str, float]:
    x = t.detach().to(torch.float64).flatten()
    kept = x[torch.isfinite(x)] if infs_counted else x[~torch.isnan(x)]
    some = kept.numel() > 0
    ref = {
        "norm": float(torch.linalg.vector_norm(kept)) if some else NAN,
        "mean": float(kept.mean()) if some else NAN,
        "min": float(kept.amin()) if some else NAN,
        "max": float(kept.amax()) if some else NAN,
        "nans": float(torch.isnan(x).sum()),
    }
    if infs_counted:
        ref["infs"] = float(torch.isinf(x).sum())
    return ref


def _check(got: dict[str, float], want: dict[str, float], what: str) -> None:
    for stat, value in want.items():
        if math.isnan(value) or math.isinf(value):
            assert got[stat] == value or (math.isnan(value) and math.isnan(got[stat])), (
                f"{what} {stat}: got {got[stat]}, want {value}"
            )
        else:
            assert got[stat] == pytest.approx(value, rel=1e-6, abs=1e-9), f"{what} {stat}"


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    half = torch.randn(64, generator=g)
    half[:32] = INF
    mixed = torch.randn(40, generator=g)
    mixed[3], mixed[7] = INF, -INF
    neg = torch.randn(30, generator=g)
    neg[5] = -INF
    both = torch.randn(50, generator=g)
    both[1], both[2], both[9] = NAN, INF, NAN
    big = torch.randn(GROUP_MAX + 100, generator=g)  # a tensor of its own, not stacked with others
    big[-1] = INF
    chunks = torch.randn(CHUNK + 300, generator=g)  # two chunks: the Inf and a NaN in the second
    chunks[CHUNK + 7], chunks[CHUNK + 9] = INF, NAN
    gaps = torch.randn(12, 10, generator=g)[:, ::2]  # a view with gaps: the eager path
    gaps[4, 1] = -INF
    return {
        "half +inf": half,
        "+inf and -inf": mixed,
        "-inf only": neg,
        "all NaN": torch.full((37,), NAN),
        "all +inf": torch.full((5, 3), INF),
        "NaN and +inf": both,
        "bf16 +inf": half.to(torch.bfloat16),
        "large": big,
        "two chunks": chunks,
        "with gaps": gaps,
        "finite": torch.randn(9, generator=g),
    }


def _options(path: str, ops: list[str]) -> EngineOptions:
    nan_only = {"nan_only": True} if "infs" not in ops else {}  # the default: the old code's options too
    return EngineOptions(nonfinite=True, **nan_only, **PATHS[path])


@pytest.mark.parametrize("ops", [NAN_ONLY, BOTH], ids=["nans", "nans+infs"])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_engine_path_keeps_infinities_as_values_without_the_infs_op(path, ops):
    if path == "native" and not fused.AVAILABLE:
        pytest.skip(f"native kernel: {fused.KIND}")
    cases = _cases()
    tensors = list(cases.values())
    rows = StatsEngine(_options(path, ops)).compute(tensors).numpy()
    got = finalize(rows, np.array([t.numel() for t in tensors], dtype=np.float64))
    for i, (name, t) in enumerate(cases.items()):
        want = _reference(t, "infs" in ops)
        _check({s: float(got[s][i]) for s in want}, want, f"{path} {name}")
        # the global norm as clip_grad_norm_ forms it: NaN with any NaN, else inf with any Inf
        total = float(torch.linalg.vector_norm(t.to(torch.float64)))
        mine = math.sqrt(grad_sumsq(rows[i : i + 1]))
        assert mine == total or (math.isnan(mine) and math.isnan(total)), f"{path} {name} grad norm"


@pytest.mark.parametrize("ops", [NAN_ONLY, BOTH], ids=["nans", "nans+infs"])
@pytest.mark.parametrize("path", list(PATHS))
def test_merged_shards_equal_the_whole_tensor(path, ops):
    """ZeRO / FSDP / TP pieces: the partials of the pieces, merged, finalise to the whole tensor's."""
    if path == "native" and not fused.AVAILABLE:
        pytest.skip(f"native kernel: {fused.KIND}")
    engine = StatsEngine(_options(path, ops))
    for name, t in _cases().items():
        flat = t.reshape(-1)
        for cut in (flat.numel() // 2, 1):
            a, b = engine.compute([flat[:cut].contiguous()]), engine.compute([flat[cut:].contiguous()])
            got = finalize(merge(a, b).numpy(), np.array([float(t.numel())]))
            want = _reference(t, "infs" in ops)
            _check({s: float(got[s][0]) for s in want}, want, f"{path} {name} cut {cut}")
    # one piece all NaN, the other all Inf: the Inf piece's values are the tensor's
    pieces = [torch.full((4,), NAN), torch.full((3,), -INF)]
    merged = merge(engine.compute(pieces[:1]), engine.compute(pieces[1:])).numpy()
    want = _reference(torch.cat(pieces), "infs" in ops)
    _check({s: float(finalize(merged, np.array([7.0]))[s][0]) for s in want}, want, f"{path} NaN|Inf")


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "eager"])
def test_half_inf_gradient_is_written_as_inf_with_msprobe_ops(tmp_path, monkeypatch, kernel):
    """The audit's repro: half of fc.weight's gradient +inf, ops without `infs`; AnomalyNan fires."""
    if kernel and not fused.AVAILABLE:
        pytest.skip(f"native kernel: {fused.KIND}")
    monkeypatch.setattr(fused, "AVAILABLE", kernel)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    alert = {"rules": [{"rule_name": "AnomalyNan", "args": {}}], "dump": True}
    cfg = write_config(tmp_path / "c.json", wg_distribution=True, ops=NAN_ONLY, ndigits=12, alert=alert)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    spoil = torch.cat([torch.full((32,), INF), torch.zeros(32)])
    model[0].weight.register_hook(lambda g: (g.reshape(-1) + spoil).view_as(g))
    model(torch.randn(4, 8)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    total = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    opt.step()
    opt.zero_grad()
    monitor.flush()
    global_norm = monitor.last_batch.derived.global_grad_norm
    monitor.close()
    written = {r["name"]: r for r in read_family(monitor.run_dir, "grad_reduced")}
    assert set(written) == set(grads)
    for name, g in grads.items():
        _check({s: float(written[name][s]) for s in NAN_ONLY}, _reference(g, False), name)
    assert written["0.weight"]["norm"] == "inf" and written["0.weight"]["max"] == "inf"
    assert math.isinf(total) and global_norm == total
    fired = {
        (r["name"], r["stat"]) for r in load_anomalies(str(tmp_path / "out")) if r["rule"] == "AnomalyNan"
    }
    assert ("0.weight", "norm") in fired, fired


def test_layer_mean_keeps_an_infinite_row_mean():
    """Prometheus' per-layer rows: a row whose mean is +inf (Inf not counted) makes its layer's mean +inf,
    both signs NaN; a NaN row (no kept element) still adds nothing."""
    groups = np.array([0, 0, 1, 1, 2, 2])
    values = {
        "numel": np.array([4.0, 4.0, 4.0, 4.0, 4.0, 4.0]),
        "nans": np.array([0.0, 0.0, 0.0, 0.0, 4.0, 0.0]),
        "mean": np.array([INF, 1.0, INF, -INF, NAN, 2.0]),
    }
    out = combine(groups, 3, values, ("mean",))["mean"]
    assert out[0] == INF and math.isnan(out[1]) and out[2] == 2.0, out


def _fsdp_rows(rank: int, world_size: int, out_dir: str) -> dict:
    """FSDP2 on 2 ranks, ops without `infs`: rank 0's shard of `0.weight` all NaN, rank 1's with one +inf;
    `0.bias` +inf on rank 0 and -inf on rank 1. Returns the grad_reduced statistics and the full gradients."""
    import os

    from torch.distributed.fsdp import fully_shard

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_dir, str(rank))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = TrainerMon(write_config(Path(out_dir) / f"c{rank}.json", wg_distribution=True, ops=NAN_ONLY))
    monitor.set_monitor(model, optimizer=opt)
    model(torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
    local = {n: p.grad.to_local() for n, p in model.named_parameters()}
    if rank == 0:
        local["0.weight"].fill_(NAN)
    else:
        local["0.weight"][0, 0] = INF
    local["0.bias"][0] = INF if rank == 0 else -INF
    full = {n: p.grad.full_tensor().to(torch.float64).numpy().copy() for n, p in model.named_parameters()}
    opt.step()
    monitor.flush()
    batch = monitor.last_batch
    stats = {
        r.name: {s: float(batch.values[s][i]) for s in NAN_ONLY}
        for i, r in enumerate(batch.rows)
        if r.family == "grad_reduced"
    }
    faults = monitor.faults.total
    monitor.close()
    return {"stats": stats, "full": full, "faults": faults}


def test_fsdp_shards_keep_infinities_without_the_infs_op(tmp_path):
    results = run_ranks(_fsdp_rows, world_size=2, out_dir=str(tmp_path), timeout=300)
    stats = {}
    for found in results:
        assert found["faults"] == 0
        stats.update(found["stats"])
    assert set(stats) == set(results[0]["full"])
    for name, grad in results[0]["full"].items():
        _check(stats[name], _reference(torch.from_numpy(grad), False), name)
    assert stats["0.weight"]["max"] == INF and math.isnan(stats["0.bias"]["mean"])
