"""accelerate's own loop with gradient accumulation, and Lightning's Trainer with its callback (real
frameworks, a tiny model built here). Gradients are checked against references taken from the model in the
test at the real optimizer steps, and against a recomputation from the step's micro-batches."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

from .common import OPS, Samples, TinyRegressor, grad_refs, moment_refs

GAS, BATCH, MICRO_BATCHES = 2, 4, 8  # 4 optimizer steps
MAX_NORM = 1e-3  # gradient clipping far below the gradients' norm: every step is clipped


def _check(run_dir: str, refs: dict, families: tuple[str, ...]) -> None:
    for family in families:
        rows = keyed(read_family(run_dir, family))
        want = {(n, s, None) for (f, n, s) in refs if f == family}
        assert set(rows) == want, (family, sorted(set(rows) ^ want))
        for (n, s, _), row in rows.items():
            assert_row_matches(row, refs[(family, n, s)], OPS)


def _head_actv(run_dir: str, name: str, actv: list[dict], steps: int) -> None:
    rows = {(s, m): row for (n, s, m), row in keyed(read_family(run_dir, "actv")).items() if n == name}
    assert set(rows) == {(s, m) for s in range(steps) for m in range(GAS)}
    for (s, m), row in rows.items():
        assert_row_matches(row, actv[s * GAS + m], OPS)


def test_accelerate_gradient_accumulation(tmp_path, out_dir, static_mode, caplog):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from trainermon import TrainerMon

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    cfg = write_config(
        tmp_path / "cfg.json", wg_distribution=True, mv_distribution=True, xy_distribution=True,
        targets={"head": {}, "body": {}}, ops=list(OPS), ndigits=12,
    )  # fmt: skip
    torch.manual_seed(0)
    model = TinyRegressor()
    shadow = copy.deepcopy(model)  # the independent recomputation
    actv: list[dict] = []
    model.head.register_forward_hook(lambda m, a, out: actv.append(ref_stats(out)))
    acc = accelerate.Accelerator(gradient_accumulation_steps=GAS, cpu=True)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    monitor = TrainerMon(cfg)
    with caplog.at_level(logging.INFO, logger="trainermon"):
        monitor.set_monitor(model, grad_acc_steps=GAS, optimizer=opt)
    assert any("AcceleratedOptimizer -> AdamW" in r.getMessage() for r in caplog.records)

    data = Samples(BATCH * MICRO_BATCHES)
    refs: dict = {}
    step, pending = 0, []
    for i in range(MICRO_BATCHES):
        batch = {k: v[i * BATCH : (i + 1) * BATCH] for k, v in (("x", data.x), ("labels", data.y))}
        with acc.accumulate(model):
            if not pending:
                shadow.load_state_dict(model.state_dict())
            pending.append(batch)
            acc.backward(model(**batch)["loss"])
            if acc.sync_gradients:
                grad_refs(model, step, refs)
                shadow.zero_grad()
                for b in pending:  # accelerate divides each micro-batch's loss by the step count
                    (shadow(**b)["loss"] / GAS).backward()
                for name, p in shadow.named_parameters():
                    refs[("grad_unreduced", name, step)] = ref_stats(p.grad)
                    assert torch.allclose(p.grad, model.get_parameter(name).grad, rtol=1e-6, atol=1e-9)
                # Clipped every step: the rows are the gradients before it (the references above)
                assert acc.clip_grad_norm_(model.parameters(), MAX_NORM) > 100 * MAX_NORM
            opt.step()
            opt.zero_grad()
            if acc.sync_gradients:
                moment_refs(model, opt.optimizer, step, refs)
                step, pending = step + 1, []
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    assert step == MICRO_BATCHES // GAS and monitor.current_step == step
    _check(monitor.run_dir, refs, ("grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq"))
    _head_actv(monitor.run_dir, "head.output", actv, step)


def test_lightning_callback_one_process(tmp_path, out_dir, static_mode, caplog):
    pl = pytest.importorskip("lightning.pytorch")

    from trainermon.integrations.lightning import TrainerMonCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyRegressor()

        def training_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    class References(pl.Callback):
        def __init__(self) -> None:
            self.refs: dict = {}
            self.actv: list[dict] = []
            self.steps = 0

        def on_train_start(self, trainer, module):
            module.net.head.register_forward_hook(lambda m, a, out: self.actv.append(ref_stats(out)))
            trainer.optimizers[0].register_step_post_hook(self._after_update)

        def on_before_optimizer_step(self, trainer, module, optimizer):
            grad_refs(module, self.steps, self.refs)

        def _after_update(self, optimizer, args, kwargs):
            moment_refs(self.module, optimizer, self.steps, self.refs)
            self.steps += 1

        def setup(self, trainer, module, stage):
            self.module = module

    cfg = write_config(
        tmp_path / "cfg.json", wg_distribution=True, mv_distribution=True, xy_distribution=True,
        targets={"net.head": {}, "net.body": {}}, ops=list(OPS), ndigits=12,
    )  # fmt: skip
    torch.manual_seed(0)
    callback, refs = TrainerMonCallback(cfg), References()
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, accumulate_grad_batches=GAS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback, refs], default_root_dir=str(tmp_path / "pl"), gradient_clip_val=MAX_NORM,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(Samples(BATCH * MICRO_BATCHES), batch_size=BATCH)
    with caplog.at_level(logging.INFO, logger="trainermon"):
        trainer.fit(Module(), loader)
    # on_before_optimizer_step comes before Lightning's clipping: the references are pre-clip, and
    # every step was clipped
    squares = [0.0] * refs.steps
    for (family, _, step), ref in refs.refs.items():
        if family == "grad_reduced":
            squares[step] += ref["norm"] ** 2
    assert min(squares) > (100 * MAX_NORM) ** 2, squares
    monitor = callback.monitor
    assert monitor.loop.closed and monitor.faults.total == 0, dict(monitor.faults.counts)
    attached = [r.getMessage() for r in caplog.records if "attached" in r.getMessage()]
    assert len(attached) == 1 and "optimizer AdamW" in attached[0], attached
    steps = MICRO_BATCHES // GAS
    assert refs.steps == trainer.global_step == steps
    for (f, n, s), ref in list(refs.refs.items()):  # one process: nothing reduces, the same gradients
        if f == "grad_reduced":
            refs.refs[("grad_unreduced", n, s)] = ref
    _check(monitor.run_dir, refs.refs, ("grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq"))
    _head_actv(monitor.run_dir, "net.head.output", refs.actv, steps)


def test_set_monitor_takes_lightning_optimizer(tmp_path, out_dir, static_mode, caplog):
    """Lightning's `LightningOptimizer` (what `self.optimizers()` returns) is unwrapped to its optimizer."""
    pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from trainermon import TrainerMon

    model = TinyRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(write_config(tmp_path / "cfg.json", wg_distribution=True, ops=list(OPS)))
    with caplog.at_level(logging.INFO, logger="trainermon"):
        monitor.set_monitor(model, optimizer=LightningOptimizer(opt))
    assert monitor.loop.adapter.optimizer is opt
    assert any("LightningSGD -> SGD" in r.getMessage() for r in caplog.records)
    monitor.close()


def test_importing_trainermon_imports_no_framework(tmp_path):
    """The integrations import their framework only when the user imports them."""
    code = (
        "import sys, trainermon, trainermon.integrations; from trainermon import TrainerMon; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning') "
        "if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _lightning_ddp_rank(rank: int, world: int, out_dir: str, cfg: str, root: str) -> dict:
    import lightning.pytorch as pl

    from trainermon.integrations.lightning import TrainerMonCallback

    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    seen: list = []  # (step, batch, weights) of each training forward, to recompute this rank's gradient

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyRegressor()

        def training_step(self, batch, batch_idx):
            weights = {k: v.detach().clone() for k, v in self.net.state_dict().items()}
            seen.append((self.trainer.global_step, {k: v.clone() for k, v in batch.items()}, weights))
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    refs: dict = {}

    class References(pl.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            grad_refs(module, trainer.global_step, refs)  # all-reduced by DDP: what the optimizer gets

    torch.manual_seed(0)
    callback = TrainerMonCallback(cfg)
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=world, strategy="ddp", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback, References()], default_root_dir=root,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(Samples(BATCH * MICRO_BATCHES), batch_size=BATCH)
    module = Module()
    trainer.fit(module, loader)
    shadow = TinyRegressor()
    for step, batch, weights in seen:
        shadow.load_state_dict(weights)
        shadow.zero_grad()
        shadow(**batch)["loss"].backward()
        for name, p in shadow.named_parameters():
            refs[("grad_unreduced", f"net.{name}", step)] = ref_stats(p.grad)
    monitor = callback.monitor
    return {
        "adapter": monitor.loop.adapter.name, "wrapped": monitor.loop.adapter.chunk_types[0],
        "faults": monitor.faults.total, "run_dir": monitor.run_dir, "refs": refs,
        "steps": trainer.global_step,
    }  # fmt: skip


def test_lightning_callback_ddp_two_ranks(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from tests.distributed import run_ranks

    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, ops=list(OPS), ndigits=12)
    results = run_ranks(
        _lightning_ddp_rank, world_size=2, out_dir=str(tmp_path / "out"), cfg=cfg, root=str(tmp_path / "pl")
    )
    for r in results:
        assert r["wrapped"] == "DistributedDataParallel" and r["adapter"] == "torch" and r["faults"] == 0
        assert r["steps"] == MICRO_BATCHES // 2
    _check(results[0]["run_dir"], results[0]["refs"], ("grad_reduced", "grad_unreduced"))
    _check(results[1]["run_dir"], results[1]["refs"], ("grad_unreduced",))
