"""msprobe's targets under DDP: msprobe names the modules of the object it is given, so a config written for
it under DDP says `module.model.layers.0`. trainermon's rows name the unwrapped model (`model.layers.0`);
such a target selects what it names without the wrapper's `module.` (README `targets`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from tests.helpers import keyed, read_family, ref_stats, write_config

OPS = ("norm", "mean", "min", "max")
FAMILIES = ("actv", "actv_grad", "grad_unreduced", "grad_reduced")


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.layers[1](torch.tanh(self.model.layers[0](x)))


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + rank))


def _run(tmp: str, rank: int, target: str) -> tuple[dict, list[str]]:
    """One monitored DDP step with `targets: {target: {}}`: this rank's rows by family, and the INFO lines."""
    from torch.nn.parallel import DistributedDataParallel

    from trainermon import TrainerMon

    out = os.path.join(tmp, target.replace(":", "_"))
    os.environ["MONITOR_OUTPUT_DIR"] = out
    os.makedirs(out, exist_ok=True)
    cfg = write_config(
        Path(out) / f"cfg{rank}.json",
        targets={target: {}},
        xy_distribution=True,
        wg_distribution=True,
        ops=list(OPS),
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(Inner())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("trainermon")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, optimizer=opt)
        model(_inputs(rank)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        monitor.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return {f: keyed(read_family(monitor.run_dir, f)) for f in FAMILIES}, said


def _reference(rank: int, world_size: int) -> dict:
    """float64 reference of the step's rows of model.layers.0 (initial weights, as every rank has them)."""
    torch.manual_seed(0)
    inner = Inner().double()
    lin = inner.model.layers[0]
    grads = []
    out = {}
    for r in range(world_size):
        inner.zero_grad()
        x = _inputs(r).double().requires_grad_()
        z = lin(x)
        z.retain_grad()
        inner.model.layers[1](torch.tanh(z)).square().sum().backward()
        grads.append((lin.weight.grad.clone(), lin.bias.grad.clone()))
        if r == rank:
            out["actv", "model.layers.0.output"] = ref_stats(z)
            out["actv", "model.layers.0.input"] = ref_stats(x)
            out["actv_grad", "model.layers.0.output"] = ref_stats(z.grad)
            out["grad_unreduced", "model.layers.0.weight"] = ref_stats(lin.weight.grad)
            out["grad_unreduced", "model.layers.0.bias"] = ref_stats(lin.bias.grad)
    out["grad_reduced", "model.layers.0.weight"] = ref_stats(sum(g[0] for g in grads) / world_size)
    out["grad_reduced", "model.layers.0.bias"] = ref_stats(sum(g[1] for g in grads) / world_size)
    return out


def _on_rank(rank: int, world_size: int, out: str) -> dict:
    runs = {
        t: _run(out, rank, t) for t in ("model.layers.0", "module.model.layers.0", "0:module.model.layers.0")
    }
    return {"runs": runs, "ref": _reference(rank, world_size)}


def test_msprobe_module_prefixed_targets_select_under_ddp(tmp_path):
    """On 2 gloo DDP ranks, `module.model.layers.0` and `0:module.model.layers.0` (msprobe's names under
    DDP) select the same rows as `model.layers.0`, under the unwrapped names, with the values of a float64
    reference (rtol 1e-5); said once at INFO. Old code: 0 rows in every family."""
    from tests.distributed import run_ranks

    for rank, found in enumerate(run_ranks(_on_rank, world_size=2, out=str(tmp_path))):
        plain, _ = found["runs"]["model.layers.0"]
        for target in ("module.model.layers.0", "0:module.model.layers.0"):
            rows, said = found["runs"][target]
            for family in FAMILIES:
                assert set(rows[family]) == set(plain[family]), (rank, target, family)
                for key, row in rows[family].items():
                    assert all(row[op] == plain[family][key][op] for op in OPS), (rank, target, key)
            meant = repr(target.replace("module.", ""))  # "0:model.layers.0" for the vpp form
            hits = [line for line in said if repr(target) in line and f"selects {meant}" in line]
            assert len(hits) == 1, said
        checked = 0
        for (family, name), ref in found["ref"].items():
            if family == "grad_reduced" and rank != 0:
                continue  # the job's one writer
            row = plain[family][name, 0, None] if (name, 0, None) in plain[family] else None
            row = row or next(r for (n, s, _m), r in plain[family].items() if n == name and s == 0)
            for op in OPS:
                want = ref[op]
                assert abs(float(row[op]) - want) <= 1e-5 * abs(want) + 1e-6, (rank, family, name, op)
            checked += 1
        assert checked >= 5
        assert all(n.startswith("model.layers.0") for f in FAMILIES for n, _s, _m in plain[f])


def test_a_real_module_named_module_is_not_stripped(tmp_path, out_dir, static_mode):
    """Without a wrapper nothing is stripped: `module.model.layers.0` of a plain model selects nothing
    (one warning), and a model whose own child is named `module` keeps that segment."""
    from trainermon.runtime.selection import wrapper_paths

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = Inner()

    from trainermon import TrainerMon

    for model, target, selected in (
        (Inner(), "module.model.layers.0", set()),
        (Outer(), "module.model.layers.0", {"module.model.layers.0.weight", "module.model.layers.0.bias"}),
    ):
        cfg = write_config(tmp_path / "c.json", targets={target: {}}, wg_distribution=True, ops=["norm"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, optimizer=opt)
        assert wrapper_paths(monitor.loop.adapter) == {}
        assert set(monitor.loop.selection.names) == selected
        monitor.close()
