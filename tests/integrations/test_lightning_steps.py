"""Lightning's step counting under manual optimization (real Lightning, a tiny model built here, one process):
the monitor's step is the monitored optimizer's step, with validation in the middle of an accumulation and
when a run with two optimizers resumes from a checkpoint. Gradients are checked against a float64
recomputation from the batches each step really used."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

from .common import OPS, Samples, TinyRegressor

BATCH = 4


def _trainer(pl, root, callbacks, **kwargs):
    return pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, default_root_dir=str(root), **kwargs,
    )  # fmt: skip


def _float64_refs(seen: list, groups: list[list[int]], first_step: int, loss_scale: float = 1.0) -> dict:
    """("grad_reduced", "net.<name>", step) -> statistics of the gradient that the batches of each group
    give, recomputed in float64 from the weights and batches recorded at their forwards."""
    refs: dict = {}
    for i, group in enumerate(groups):
        shadow = TinyRegressor().double()
        shadow.load_state_dict({k: v.double() for k, v in seen[group[0]][1].items()})
        for b in group:
            batch = seen[b][0]
            (shadow(batch["x"].double(), batch["labels"].double())["loss"] * loss_scale).backward()
        for name, p in shadow.named_parameters():
            refs[("grad_reduced", f"net.{name}", first_step + i)] = ref_stats(p.grad)
    return refs


def _check_grads(run_dir: str, refs: dict) -> None:
    """The `net` rows equal `refs`, step for step; no row is flagged skipped."""
    rows = keyed(read_family(run_dir, "grad_reduced"))
    assert {row["skipped"] for row in rows.values()} == {""}
    rows = {k: row for k, row in rows.items() if k[0].startswith("net.")}
    want = {(n, s, None) for (_, n, s) in refs}
    assert set(rows) == want, sorted(set(rows) ^ want)
    for (n, s, _), row in rows.items():
        assert_row_matches(row, refs[("grad_reduced", n, s)], OPS)


def test_manual_accumulation_with_validation_in_between(tmp_path, out_dir, static_mode):
    """Manual optimization stepping every 2 batches, validation every 3: Lightning's
    `on_validation_model_zero_grad` clears the gradients in the middle of an accumulation (after batches
    2 and 8). That is no skipped step: monitor steps == trainer.global_step, none flagged."""
    pl = pytest.importorskip("lightning.pytorch")
    from trainermon.integrations.lightning import TrainerMonCallback

    seen: list = []  # (batch, weights) of every training forward
    at_step: dict = {}  # the model's gradients when the optimizer steps, by global_step

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyRegressor()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            seen.append(({k: v.clone() for k, v in batch.items()}, copy_weights(self.net)))
            opt = self.optimizers()
            self.manual_backward(self.net(**batch)["loss"] / 2)
            if (batch_idx + 1) % 2 == 0:
                grads = {n: p.grad.clone() for n, p in self.net.named_parameters()}
                at_step[self.trainer.global_step] = grads
                opt.step()
                opt.zero_grad()

        def validation_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=list(OPS), ndigits=12)
    torch.manual_seed(0)
    callback = TrainerMonCallback(cfg)
    trainer = _trainer(pl, tmp_path / "pl", [callback], max_epochs=1, val_check_interval=3)
    loader = torch.utils.data.DataLoader(Samples(10 * BATCH), batch_size=BATCH)  # 10 batches, 5 steps
    trainer.fit(Module(), loader, torch.utils.data.DataLoader(Samples(2 * BATCH, 1), batch_size=BATCH))

    groups, pending = [], []  # the batches each step's gradient comes from
    for i in range(10):
        pending.append(i)
        if (i + 1) % 2 == 0:
            groups.append(pending)
            pending = []
        if (i + 1) % 3 == 0:  # validation: Lightning clears the gradients, also mid-accumulation
            pending = []
    assert groups == [[0, 1], [3], [4, 5], [6, 7], [9]]
    refs = _float64_refs(seen, groups, 0, loss_scale=0.5)
    for step, grads in at_step.items():  # the grouping is what the optimizer really received
        for name, g in grads.items():
            ref = refs[("grad_reduced", f"net.{name}", step)]["norm"]
            torch.testing.assert_close(g.double().norm().item(), ref)
    monitor = callback.monitor
    assert monitor.loop.closed and monitor.faults.total == 0, dict(monitor.faults.counts)
    assert trainer.global_step == len(groups) == monitor.current_step
    _check_grads(monitor.run_dir, refs)


def copy_weights(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_two_optimizers_resume_from_checkpoint(tmp_path, out_dir, static_mode, caplog):
    """Two optimizers (the first monitored) stepping once each per batch: trainer.global_step counts both,
    so a resumed run starts the monitor at the first optimizer's own step count (3), not at 6."""
    pl = pytest.importorskip("lightning.pytorch")
    from trainermon.integrations.lightning import TrainerMonCallback

    seen: list = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyRegressor()
            self.other = nn.Linear(6, 2)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            seen.append(({k: v.clone() for k, v in batch.items()}, copy_weights(self.net)))
            first, second = self.optimizers()
            first.zero_grad()
            self.manual_backward(self.net(**batch)["loss"])
            first.step()
            second.zero_grad()
            self.manual_backward((self.other(batch["x"]) - batch["labels"]).pow(2).mean())
            second.step()

        def configure_optimizers(self):
            first = torch.optim.Adam(self.net.parameters(), lr=0.05)
            return [first, torch.optim.Adam(self.other.parameters())]

    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=list(OPS), ndigits=12)
    loader = torch.utils.data.DataLoader(Samples(3 * BATCH), batch_size=BATCH)  # 3 batches an epoch
    ckpt = str(tmp_path / "epoch0.ckpt")
    runs = []
    for epochs, resume in ((1, None), (2, ckpt)):
        seen.clear()
        torch.manual_seed(0)
        callback = TrainerMonCallback(cfg)
        trainer = _trainer(pl, tmp_path / "pl", [callback], max_epochs=epochs)
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            trainer.fit(Module(), loader, ckpt_path=resume)
        if resume is None:
            trainer.save_checkpoint(ckpt)
        monitor = callback.monitor
        assert monitor.loop.closed and monitor.faults.total == 0, dict(monitor.faults.counts)
        runs.append((trainer.global_step, monitor.current_step))
        first = trainer.global_step // 2 - len(seen)  # the monitored optimizer's steps before this run
        _check_grads(monitor.run_dir, _float64_refs(seen, [[i] for i in range(len(seen))], first))
    assert runs == [(6, 3), (12, 6)]
    warnings = [r.getMessage() for r in caplog.records if "optimizers" in r.getMessage()]
    assert len(warnings) == 2 and "from step 3 (its restored state's largest `step`)" in warnings[1], warnings


def test_manual_gradscaler_skip_is_still_its_own_step(tmp_path, out_dir, static_mode):
    """The same loop under Lightning's fp16 AMP, batch 3's loss Inf: GradScaler skips step 1, which is
    closed at the user's `opt.zero_grad()` (through the LightningOptimizer) as its own flagged step; the
    validation `zero_grad()` after batch 2, mid-accumulation, closes nothing."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from trainermon.integrations.lightning import TrainerMonCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyRegressor()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            self.manual_backward(self.net(**batch)["loss"] * (float("inf") if batch_idx == 3 else 0.5))
            if (batch_idx + 1) % 2 == 0:
                opt.step()
                opt.zero_grad()

        def validation_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=["norm"])
    torch.manual_seed(0)
    callback = TrainerMonCallback(cfg)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer = _trainer(
        pl, tmp_path / "pl", [callback], max_epochs=1, val_check_interval=3,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(Samples(10 * BATCH), batch_size=BATCH)
    trainer.fit(Module(), loader, torch.utils.data.DataLoader(Samples(2 * BATCH, 1), batch_size=BATCH))
    assert scaler.get_scale() < 2.0**10  # the overflow happened
    monitor = callback.monitor
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert trainer.global_step == monitor.current_step == 5
    rows = keyed(read_family(monitor.run_dir, "grad_reduced"))
    flags = {(s, row["skipped"]) for (_, s, _), row in rows.items()}
    assert flags == {(0, ""), (1, "1"), (2, ""), (3, ""), (4, "")}


def test_resume_from_checkpoint_continues_the_monitors_count(tmp_path, out_dir, static_mode):
    """The callback's state rides in Lightning's checkpoint: `fit(ckpt_path=...)` goes on counting toward
    collect_times (the resumed run used to collect collect_times more steps)."""
    pl = pytest.importorskip("lightning.pytorch")
    from trainermon.integrations.lightning import TrainerMonCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyRegressor()

        def training_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def validation_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.05)

    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, collect_times=2, ops=list(OPS))
    loader = torch.utils.data.DataLoader(Samples(BATCH), batch_size=BATCH)  # 1 batch, 1 step an epoch
    ckpt = str(tmp_path / "epoch0.ckpt")
    written = []
    for epochs, resume in ((1, None), (4, ckpt)):
        torch.manual_seed(0)
        callback = TrainerMonCallback(cfg)
        trainer = _trainer(pl, tmp_path / "pl", [callback], max_epochs=epochs)
        trainer.fit(Module(), loader, ckpt_path=resume)
        if resume is None:
            trainer.save_checkpoint(ckpt)
        assert callback.monitor.faults.total == 0, dict(callback.monitor.faults.counts)
        written.append(
            sorted({int(r["step"]) for r in read_family(callback.monitor.run_dir, "grad_reduced")})
        )
    assert written == [[0], [1]], written  # one collection saved, one left: step 1 (without it: 1 and 2)
    # A checkpoint restored for validate() is not carried into a later fit() of a fresh model
    callback = TrainerMonCallback(cfg)
    trainer = _trainer(pl, tmp_path / "pl", [callback], max_epochs=3)
    trainer.validate(Module(), loader, ckpt_path=ckpt)
    trainer.fit(Module(), loader)
    assert sorted({int(r["step"]) for r in read_family(callback.monitor.run_dir, "grad_reduced")}) == [0, 1]
