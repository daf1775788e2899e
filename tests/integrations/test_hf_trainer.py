"""The HF Trainer with `TrainerMonCallback` (real transformers and accelerate, a tiny model built here):
one process with gradient accumulation, and two gloo ranks under DDP. Rows are checked against
references taken from the model in the test at the Trainer's own optimizer steps."""

from __future__ import annotations

import copy
import logging
import math
import os

import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

from .common import OPS, Samples, TinyRegressor, grad_refs, moment_refs

transformers = pytest.importorskip("transformers")

BATCH, GAS, SAMPLES = 4, 2, 24  # 3 optimizer steps per epoch in one process


def _args(out: str, **extra) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(**{
        "output_dir": out, "per_device_train_batch_size": BATCH, "num_train_epochs": 1, "learning_rate": 0.05,
        "use_cpu": True, "report_to": [], "save_strategy": "no", "logging_strategy": "no",
        "remove_unused_columns": False, "dataloader_num_workers": 0, "seed": 0, "disable_tqdm": True, **extra,
    })  # fmt: skip


class _References(transformers.TrainerCallback):
    """Reference statistics at the Trainer's optimizer steps: gradients as the optimizer gets them, taken
    before the Trainer's clipping where it clips (`watch_clipping`), moments right after the update, and
    the head's outputs at every forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.refs: dict = {}
        self.actv: list[dict] = []
        self.clip_norms: dict[int, float] = {}  # step -> the norm the Trainer's clipping returned
        model.head.register_forward_hook(lambda m, a, out: self.actv.append(ref_stats(out)))

    def watch_clipping(self, trainer: transformers.Trainer) -> None:
        """The Trainer clips through its accelerator: the gradients are taken just before that."""
        accelerator, model = trainer.accelerator, trainer.model
        original = accelerator.clip_grad_norm_

        def clip(parameters, *args, **kwargs):
            step = trainer.state.global_step
            grad_refs(model, step, self.refs)
            norm = original(list(parameters), *args, **kwargs)
            self.clip_norms[step] = float(norm)
            return norm

        accelerator.clip_grad_norm_ = clip

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step not in self.clip_norms:
            grad_refs(model, state.global_step, self.refs)

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        moment_refs(model, optimizer, state.global_step, self.refs)


def _check(run_dir: str, refs: dict, families: tuple[str, ...]) -> None:
    for family in families:
        rows = keyed(read_family(run_dir, family))
        want = {(n, s, None) for (f, n, s) in refs if f == family}
        assert set(rows) == want, (family, sorted(set(rows) ^ want))
        for (n, s, _), row in rows.items():
            assert_row_matches(row, refs[(family, n, s)], OPS)


def test_trainer_one_process_with_gradient_accumulation(tmp_path, out_dir, static_mode, caplog):
    from trainermon.integrations.hf import TrainerMonCallback

    cfg = write_config(
        tmp_path / "cfg.json", wg_distribution=True, mv_distribution=True, xy_distribution=True,
        targets={"head": {}, "body": {}}, ops=list(OPS), ndigits=12,
    )  # fmt: skip
    torch.manual_seed(0)
    model = TinyRegressor()
    callback, refs = TrainerMonCallback(cfg), _References(model)
    trainer = transformers.Trainer(
        model=model, args=_args(str(tmp_path / "hf"), gradient_accumulation_steps=GAS, max_grad_norm=1e-3),
        train_dataset=Samples(SAMPLES), callbacks=[callback, refs],
    )  # fmt: skip
    refs.watch_clipping(trainer)
    with caplog.at_level(logging.INFO, logger="trainermon"):
        trainer.train()
    monitor = callback.monitor
    assert monitor.loop.closed and monitor.faults.total == 0, dict(monitor.faults.counts)
    attached = [r.getMessage() for r in caplog.records if "attached" in r.getMessage()]
    assert len(attached) == 1 and "AcceleratedOptimizer -> AdamW" in attached[0], attached

    steps = SAMPLES // (BATCH * GAS)
    assert trainer.state.global_step == steps
    assert {s for (_, _, s) in refs.refs} == set(range(steps))
    for (f, n, s), ref in list(refs.refs.items()):  # one process: nothing reduces, the same gradients
        if f == "grad_reduced":
            refs.refs[("grad_unreduced", n, s)] = ref
    _check(monitor.run_dir, refs.refs, ("grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq"))
    # The Trainer clipped every step (max_grad_norm far below the norm); the grad_reduced rows are the
    # gradients before it, so their global norm is the one the Trainer's clipping returned (and logs).
    assert sorted(refs.clip_norms) == list(range(steps))
    reduced = read_family(monitor.run_dir, "grad_reduced")
    for step, norm in refs.clip_norms.items():
        assert norm > 100 * 1e-3
        total = math.sqrt(sum(float(r["norm"]) ** 2 for r in reduced if int(r["step"]) == step))
        assert total == pytest.approx(norm, rel=1e-5), step
    head = {(s, m): row for (n, s, m), row in keyed(read_family(monitor.run_dir, "actv")).items()
            if n == "head.output"}  # fmt: skip
    assert set(head) == {(s, m) for s in range(steps) for m in range(GAS)}
    for (s, m), row in head.items():
        assert_row_matches(row, refs.actv[s * GAS + m], OPS)


class _Inputs(transformers.TrainerCallback):
    """Each forward's inputs and the parameters it ran with, to recompute this rank's own gradient."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: list[tuple[dict, dict]] = []
        self.step = 0
        model.register_forward_pre_hook(self._remember, with_kwargs=True)

    def _remember(self, module, args, kwargs) -> None:
        if module.training:
            weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
            self.seen.append((self.step, {k: v.clone() for k, v in kwargs.items()}, weights))

    def on_step_end(self, args, state, control, **kw):
        self.step = state.global_step


def _ddp_rank(rank: int, world_size: int, out_dir: str, cfg: str, hf_dir: str) -> dict:
    from trainermon.integrations.hf import TrainerMonCallback

    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    os.environ.pop("DYNAMIC_MONITOR", None)
    torch.manual_seed(0)
    model = TinyRegressor()
    pristine = copy.deepcopy(model)
    callback, refs, inputs = TrainerMonCallback(cfg), _References(model), _Inputs(model)
    trainer = transformers.Trainer(
        model=model, args=_args(hf_dir, max_grad_norm=0.0, ddp_backend="gloo"),
        train_dataset=Samples(SAMPLES), callbacks=[callback, refs, inputs],
    )  # fmt: skip
    trainer.train()
    wrapped = type(trainer.model_wrapped).__name__
    for step, kwargs, weights in inputs.seen:  # this rank's own gradient, recomputed from scratch
        pristine.load_state_dict(weights)
        pristine.zero_grad()
        pristine(**kwargs)["loss"].backward()
        for name, p in pristine.named_parameters():
            refs.refs[("grad_unreduced", name, step)] = ref_stats(p.grad)
    monitor = callback.monitor
    return {
        "wrapped": wrapped, "adapter": monitor.loop.adapter.name, "faults": monitor.faults.total,
        "run_dir": monitor.run_dir, "refs": refs.refs, "steps": trainer.state.global_step,
    }  # fmt: skip


def test_trainer_ddp_two_ranks(tmp_path):
    cfg = write_config(
        tmp_path / "cfg.json", wg_distribution=True, mv_distribution=True, ops=list(OPS), ndigits=12
    )
    results = run_ranks(
        _ddp_rank, world_size=2, out_dir=str(tmp_path / "out"), cfg=cfg, hf_dir=str(tmp_path / "hf")
    )
    steps = SAMPLES // (BATCH * 2)
    unreduced = []
    for r in results:
        assert r["wrapped"] == "DistributedDataParallel" and r["adapter"] == "torch" and r["faults"] == 0
        assert r["steps"] == steps and {s for (_, _, s) in r["refs"]} == set(range(steps))
    # replicated tensors are written once (rank 0); each rank writes its own pre-reduce gradient
    _check(
        results[0]["run_dir"], results[0]["refs"], ("grad_reduced", "grad_unreduced", "exp_avg", "exp_avg_sq")
    )
    _check(results[1]["run_dir"], results[1]["refs"], ("grad_unreduced",))
    assert not read_family(results[1]["run_dir"], "grad_reduced")
    for r in results:
        unreduced.append({k: v for k, v in r["refs"].items() if k[0] == "grad_unreduced"})
    # the ranks saw different samples: their own gradients differ, the reduced ones agree
    assert all(unreduced[0][k]["norm"] != unreduced[1][k]["norm"] for k in unreduced[0])
    reduced = [{k: v for k, v in r["refs"].items() if k[0] == "grad_reduced"} for r in results]
    assert reduced[0] == reduced[1]  # the all-reduced gradients are bitwise the same


def test_gpt2_lm_head_target_selects_the_tied_embedding(tmp_path, out_dir, static_mode, caplog):
    """issue 20 item 8 on HF's own GPT-2 (tiny config): `lm_head` is `transformer.wte`'s weight."""
    from trainermon import TrainerMon

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=23, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    cfg = write_config(tmp_path / "cfg.json", targets={"lm_head": {}}, wg_distribution=True, ops=list(OPS))
    monitor = TrainerMon(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        monitor.set_monitor(model, optimizer=opt)
    ids = torch.randint(0, 23, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    want = ref_stats(model.transformer.wte.weight.grad)
    opt.step()
    monitor.close()
    rows = keyed(read_family(monitor.run_dir, "grad_reduced"))
    assert set(rows) == {("transformer.wte.weight", 0, None)}
    assert_row_matches(rows[("transformer.wte.weight", 0, None)], want, OPS)
    assert not [r for r in caplog.records if "select" in r.getMessage()]


def test_resume_from_checkpoint_continues_the_monitors_count(tmp_path, out_dir, static_mode, caplog):
    """`resume_from_checkpoint`: the callback saved the monitor's state beside each checkpoint and loads
    it, so `collect_times` counts over both lives (the resumed run used to collect once more). A checkpoint
    moved out of `output_dir` (a third life) is read where the Trainer resumed from: the callback used to
    look in `output_dir/checkpoint-N` only, said "afresh" and collected steps 1 and 2."""
    import shutil

    from trainermon.integrations.hf import TrainerMonCallback

    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, collect_times=2, ops=list(OPS))
    hf = str(tmp_path / "hf")
    moved = str(tmp_path / "elsewhere" / "checkpoint-1")
    steps_written = []
    for resume in (None, os.path.join(hf, "checkpoint-1"), moved):
        if resume == moved:  # the state file left in output_dir must not be the one read
            os.remove(os.path.join(hf, "checkpoint-1", "trainermon_state_rank0.pt"))
        torch.manual_seed(0)
        callback = TrainerMonCallback(cfg)
        trainer = transformers.Trainer(
            model=TinyRegressor(),
            args=_args(hf, gradient_accumulation_steps=GAS, save_strategy="steps", save_steps=1),
            train_dataset=Samples(SAMPLES), callbacks=[callback],
        )  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="trainermon"):
            trainer.train(resume_from_checkpoint=resume)
        assert callback.monitor.faults.total == 0, dict(callback.monitor.faults.counts)
        rows = read_family(callback.monitor.run_dir, "grad_reduced")
        steps_written.append(sorted({int(r["step"]) for r in rows}))
        if resume is None:
            assert os.path.exists(os.path.join(hf, "checkpoint-1", "trainermon_state_rank0.pt"))
            shutil.copytree(os.path.join(hf, "checkpoint-1"), moved)
    # first life: steps 0, 1 (collect_times 2). checkpoint-1 holds one collection (step 0): the resumed
    # run collects step 1 only (without the state: steps 1 and 2)
    assert steps_written == [[0, 1], [1], [1]], steps_written
    assert not [r for r in caplog.records if "afresh" in r.getMessage()]


def test_a_rank_the_saving_job_lacked_loads_rank_0s_state(tmp_path, out_dir, static_mode):
    """Restarted on more ranks: a rank with no state file of its own takes rank 0's, so that every rank
    counts toward collect_times alike (ranks that differ wait for each other in a collective). Rank 1 is
    played by one process whose loop says rank 1 (no Trainer needed to reach `_restore`)."""
    from types import SimpleNamespace

    from trainermon import TrainerMon
    from trainermon.integrations.hf import TrainerMonCallback

    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True, collect_times=5)
    saved = TrainerMon(cfg)
    saved.set_monitor(torch.nn.Linear(2, 2))
    for _ in range(3):
        saved.step()
    saved.close()
    args, state = SimpleNamespace(output_dir=str(tmp_path / "hf")), SimpleNamespace(global_step=3)
    os.makedirs(os.path.join(args.output_dir, "checkpoint-3"))
    torch.save(saved.state_dict(), os.path.join(args.output_dir, "checkpoint-3", "trainermon_state_rank0.pt"))
    callback = TrainerMonCallback(cfg)
    callback.monitor = TrainerMon(cfg)
    callback.monitor.set_monitor(torch.nn.Linear(2, 2), start_iteration=3)
    callback.monitor.loop.rank = 1
    callback._restore(args, state)
    assert callback.monitor.loop.schedule.collected == 3 and callback.monitor.faults.total == 0
    callback.monitor.close()


def test_state_is_saved_only_into_the_trainers_own_checkpoint_folder(tmp_path, out_dir, static_mode, caplog):
    """A hyperparameter-search trial saves under run-<id>/, and a node may lack the folder: the callback
    makes no checkpoint-N folder of its own (a stray one would be taken for the last checkpoint)."""
    from types import SimpleNamespace

    from trainermon import TrainerMon
    from trainermon.integrations.hf import TrainerMonCallback

    cfg = write_config(tmp_path / "cfg.json", wg_distribution=True)
    callback = TrainerMonCallback(cfg)
    callback.monitor = TrainerMon(cfg)
    callback.monitor.set_monitor(torch.nn.Linear(2, 2))
    args = SimpleNamespace(output_dir=str(tmp_path / "hf"))
    os.makedirs(os.path.join(args.output_dir, "checkpoint-1"))
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        callback.on_save(args, SimpleNamespace(global_step=1, trial_params={"lr": 0.1}), None)
        callback.on_save(args, SimpleNamespace(global_step=2, trial_params=None), None)
        callback.on_save(args, SimpleNamespace(global_step=1, trial_params=None), None)
    callback.monitor.close()
    assert sorted(os.listdir(args.output_dir)) == ["checkpoint-1"]
    assert os.listdir(os.path.join(args.output_dir, "checkpoint-1")) == ["trainermon_state_rank0.pt"]
    assert sum("not this run's checkpoint folder" in r.getMessage() for r in caplog.records) == 1


def test_attach_failure_never_stops_training(tmp_path, out_dir, static_mode, caplog):
    """An optimizer the monitor cannot hook: the callback logs the error and training goes on."""
    from types import SimpleNamespace

    from trainermon.integrations.hf import TrainerMonCallback

    callback = TrainerMonCallback(write_config(tmp_path / "cfg.json", wg_distribution=True))
    args, state = SimpleNamespace(gradient_accumulation_steps=1), SimpleNamespace(global_step=0)
    with caplog.at_level(logging.ERROR, logger="trainermon"):
        callback.on_train_begin(args, state, None, model=torch.nn.Linear(2, 2), optimizer=object())
    assert callback.monitor is None
    assert any("not attached" in r.getMessage() and r.exc_info for r in caplog.records)
    callback.on_train_end(args, state, None)


def test_bad_config_fails_at_construction(tmp_path):
    from trainermon.config import ConfigError
    from trainermon.integrations.hf import TrainerMonCallback

    with pytest.raises(ConfigError, match="step_interval"):
        TrainerMonCallback(write_config(tmp_path / "cfg.json", step_interval=0))
