"""Lightning's GAN pattern under manual optimization with `monitor_mbs_grad` (real Lightning, one process):
`toggle_optimizer(opt_g)` freezes the discriminator around the generator's backward and step (so across
the monitored optimizer's step boundary), `untoggle_optimizer` unfreezes it before the discriminator's
own backward. Every generator step is written under its own number, each parameter's micro-batch rows
are the gradients of the backwards that reached it, nothing is counted as a fault."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.helpers import read_family, write_config

BATCHES, ACCUMULATE = 8, 2


def test_toggle_optimizer_gan_with_microbatch_gradients(tmp_path, out_dir, static_mode):
    pl = pytest.importorskip("lightning.pytorch")
    from trainermon.integrations.lightning import TrainerMonCallback

    micro: dict = {}  # (step, micro_step, name) -> that backward's own gradient (float64)
    reduced: dict = {}  # (step, name) -> the gradient the generator's optimizer steps with
    counts: dict = {}  # (step, name) -> backwards that reached the parameter so far

    class GAN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.gen = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6))
            self.disc = nn.Sequential(nn.Linear(6, 1))
            self.gsteps = 0

        def _backward(self, loss: torch.Tensor, part: nn.Module, prefix: str) -> None:
            before = {n: p.grad.double().clone() for n, p in part.named_parameters() if p.grad is not None}
            self.manual_backward(loss)
            for n, p in part.named_parameters():
                key = (self.gsteps, f"{prefix}.{n}")
                counts[key] = counts.get(key, 0) + 1
                micro[(self.gsteps, counts[key] - 1, key[1])] = p.grad.double() - before.get(n, 0.0)

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt_g, opt_d = self.optimizers()
            self.toggle_optimizer(opt_g)
            self._backward(self.disc(self.gen(x)).pow(2).mean() / ACCUMULATE, self.gen, "gen")
            if (batch_idx + 1) % ACCUMULATE == 0:
                for n, p in self.gen.named_parameters():
                    reduced[(self.gsteps, f"gen.{n}")] = p.grad.double().clone()
                opt_g.step()
                opt_g.zero_grad()
                self.gsteps += 1
            self.untoggle_optimizer(opt_g)
            loss_d = (self.disc(self.gen(x).detach()) - 1).pow(2).mean() + self.disc(y).pow(2).mean()
            self._backward(loss_d, self.disc, "disc")
            opt_d.step()
            opt_d.zero_grad()

        def configure_optimizers(self):
            return [
                torch.optim.Adam(self.gen.parameters(), lr=0.05),
                torch.optim.Adam(self.disc.parameters()),
            ]

    cfg = write_config(
        tmp_path / "cfg.json", wg_distribution=True, monitor_mbs_grad=True, ops=["norm", "max"], ndigits=12
    )
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(BATCHES * 2, 4, generator=g), torch.randn(BATCHES * 2, 6, generator=g)
    )
    torch.manual_seed(0)
    callback = TrainerMonCallback(cfg)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[callback], default_root_dir=str(tmp_path / "pl"), max_epochs=1,
    )  # fmt: skip
    trainer.fit(GAN(), torch.utils.data.DataLoader(data, batch_size=2))
    monitor = callback.monitor
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    steps = BATCHES // ACCUMULATE
    assert monitor.current_step == steps

    rows = {}
    for r in read_family(monitor.run_dir, "grad_unreduced"):
        key = (int(r["step"]), int(r["micro_step"]), r["name"])
        assert key not in rows, key
        rows[key] = r
    want = {k: v for k, v in micro.items() if k[0] < steps}  # the last discriminator backward: no step
    assert sorted(rows) == sorted(want)
    for key, grad in want.items():
        assert math.isclose(float(rows[key]["norm"]), float(grad.norm()), rel_tol=1e-5), key
        assert math.isclose(float(rows[key]["max"]), float(grad.max()), rel_tol=1e-5, abs_tol=1e-9), key
    # Every generator micro-step is there: ACCUMULATE per step, numbered as the optimizer's steps
    assert {(s, m) for s, m, n in rows if n.startswith("gen.")} == {
        (s, m) for s in range(steps) for m in range(ACCUMULATE)
    }

    red = {
        (int(r["step"]), r["name"]): float(r["norm"]) for r in read_family(monitor.run_dir, "grad_reduced")
    }
    # The discriminator holds no gradient at the generator's step (opt_d.zero_grad): no row
    assert sorted(red) == sorted(reduced)
    for key, grad in reduced.items():
        assert math.isclose(red[key], float(grad.norm()), rel_tol=1e-5), key
