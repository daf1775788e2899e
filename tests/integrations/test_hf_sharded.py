"""`TrainerMonCallback` on 2 gloo ranks (CPU): the HF Trainer over DeepSpeed ZeRO-2, and the objects the
Trainer hands its callbacks under FSDP2 (accelerate enables its FSDP plugin only on GPU ranks: on CPU the
Trainer falls back to DDP). References: DeepSpeed's full-tensor getters and global norm, DTensor
`full_tensor()`, taken in the test."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config

from .common import OPS, Samples, TinyRegressor

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)
BATCH, GAS, SAMPLES = 4, 2, 32  # 2 optimizer steps on 2 ranks


def _args(out: str, **extra):
    import transformers

    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH, num_train_epochs=1, learning_rate=0.05,
        use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", remove_unused_columns=False,
        dataloader_num_workers=0, seed=0, disable_tqdm=True, gradient_accumulation_steps=GAS,
        ddp_backend="gloo", **extra,
    )  # fmt: skip


def _deepspeed_rank(rank: int, world: int, out_dir: str, cfg: str, hf_dir: str) -> dict:
    # DeepSpeed's first init_distributed on CPU compiles a shared-memory op (~30 s); gloo does not use it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import transformers
    from deepspeed.utils import safe_get_full_fp32_param

    from trainermon.integrations.hf import TrainerMonCallback

    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    refs: dict = {}
    norms: list = []

    class References(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, model=None, **kw):
            engine, step = trainer.model_wrapped, state.global_step
            norms.append(float(engine.get_global_grad_norm()))
            for name, p in model.named_parameters():  # a collective: every rank calls it
                refs[("param_updated", name, step)] = ref_stats(safe_get_full_fp32_param(p))
            # the moments over the whole model: this rank's flat ZeRO partitions (zero padding included),
            # summed over the ranks
            inner = engine.optimizer.optimizer
            for key in ("exp_avg", "exp_avg_sq"):
                sumsq = torch.zeros((), dtype=torch.float64)
                for st in inner.state.values():
                    sumsq += st[key].double().pow(2).sum()
                torch.distributed.all_reduce(sumsq)
                refs[(key, "*", step)] = math.sqrt(float(sumsq))

    torch.manual_seed(0)
    ds = {
        "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
    }  # fmt: skip
    callback = TrainerMonCallback(cfg)
    trainer = transformers.Trainer(
        model=TinyRegressor(), args=_args(hf_dir, deepspeed=ds), train_dataset=Samples(SAMPLES),
        callbacks=[callback, References()],
    )  # fmt: skip
    trainer.train()
    monitor = callback.monitor
    return {
        "adapter": monitor.loop.adapter.name, "faults": monitor.faults.total, "run_dir": monitor.run_dir,
        "refs": refs, "norms": norms, "steps": trainer.state.global_step,
    }  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_trainer_deepspeed_zero2(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # inherited by the spawned ranks
    cfg = write_config(
        tmp_path / "cfg.json", wg_distribution=True, mv_distribution=True, param_distribution=True,
        ops=list(OPS), ndigits=12,
    )  # fmt: skip
    results = run_ranks(
        _deepspeed_rank, world_size=2, out_dir=str(tmp_path / "out"), cfg=cfg, hf_dir=str(tmp_path / "hf")
    )
    steps = SAMPLES // (BATCH * GAS * 2)
    r0 = results[0]
    for r in results:
        assert r["adapter"] == "deepspeed" and r["faults"] == 0 and r["steps"] == steps
    refs = r0["refs"]  # on_optimizer_step sees global_step before it counts this step: from 0 here
    rows = keyed(read_family(r0["run_dir"], "param_updated"))
    assert set(rows) == {(n, s, None) for (f, n, s) in refs if f == "param_updated"}
    for (n, s, _), row in rows.items():
        assert_row_matches(row, refs[("param_updated", n, s)], OPS)
    for family in ("grad_reduced", "exp_avg", "exp_avg_sq"):
        got = keyed(read_family(r0["run_dir"], family))
        assert {s for (_, s, _) in got} == set(range(steps)) and not read_family(
            results[1]["run_dir"], family
        )
        for s in range(steps):
            norm = math.sqrt(sum(float(row["norm"]) ** 2 for (n, st, _), row in got.items() if st == s))
            # grad_reduced: DeepSpeed's own global norm (taken before its clipping)
            want = r0["norms"][s] if family == "grad_reduced" else refs[(family, "*", s)]
            assert norm == pytest.approx(want, rel=1e-5), (family, s)


def _fsdp_rank(rank: int, world: int, out_dir: str, cfg: str, hf_dir: str) -> dict:
    """What the Trainer hands its callbacks under FSDP2 (accelerate enables its FSDP plugin only on GPU
    ranks, so on CPU the Trainer's own FSDP path cannot run): the `fully_shard`ed model and accelerate's
    `AcceleratedOptimizer`; the callback is driven with the Trainer's arguments."""
    import accelerate
    import transformers
    from accelerate.optimizer import AcceleratedOptimizer
    from torch.distributed.fsdp import fully_shard

    from trainermon.integrations.hf import TrainerMonCallback

    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    args = transformers.TrainingArguments(output_dir=hf_dir, gradient_accumulation_steps=GAS, use_cpu=True)
    acc = accelerate.Accelerator(cpu=True)  # the state AcceleratedOptimizer reads (kept alive)
    torch.manual_seed(0)
    model = TinyRegressor()
    for layer in (model.body[0], model.body[2], model.head):
        fully_shard(layer)
    fully_shard(model)
    opt = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05), device_placement=False)
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    callback = TrainerMonCallback(cfg)
    callback.on_train_begin(args, state, control, model=model, optimizer=opt)

    def full(t):  # a DTensor's full value (a collective: every rank calls it)
        return t.full_tensor()

    data, refs = Samples(SAMPLES, seed=rank), {}
    for i in range(SAMPLES // BATCH):
        last = i % GAS == GAS - 1
        model.set_requires_gradient_sync(last)  # FSDP2's no_sync, as accelerate's accumulate sets it
        batch = {"x": data.x[i * BATCH : (i + 1) * BATCH], "labels": data.y[i * BATCH : (i + 1) * BATCH]}
        (model(**batch)["loss"] / GAS).backward()
        if not last:
            continue
        for name, p in model.named_parameters():
            refs[("grad_reduced", name, state.global_step)] = ref_stats(full(p.grad))
        opt.step()
        opt.zero_grad()
        for name, p in model.named_parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                refs[(key, name, state.global_step)] = ref_stats(full(opt.state[p][key]))
        state.global_step += 1
    callback.on_train_end(args, state, control, model=model, optimizer=opt)
    del acc
    monitor = callback.monitor
    return {
        "adapter": monitor.loop.adapter.name, "faults": monitor.faults.total, "run_dir": monitor.run_dir,
        "refs": refs, "steps": state.global_step,
    }  # fmt: skip


def test_trainer_fsdp2_objects(tmp_path):
    cfg = write_config(
        tmp_path / "cfg.json", wg_distribution=True, mv_distribution=True, ops=list(OPS), ndigits=12
    )
    results = run_ranks(
        _fsdp_rank, world_size=2, out_dir=str(tmp_path / "out"), cfg=cfg, hf_dir=str(tmp_path / "hf")
    )
    steps = SAMPLES // (BATCH * GAS)
    for r in results:
        assert r["adapter"] == "fsdp2" and r["faults"] == 0 and r["steps"] == steps
    refs = results[0]["refs"]
    for family in ("grad_reduced", "exp_avg", "exp_avg_sq"):
        rows = keyed(read_family(results[0]["run_dir"], family))
        assert set(rows) == {(n, s, None) for (f, n, s) in refs if f == family}, family
        for (n, s, _), row in rows.items():
            assert_row_matches(row, refs[(family, n, s)], OPS)


ATTN, MLP = "model.layers.0.self_attn", "model.layers.0.mlp"
# transformers' tp_plan for Llama: q/k/v, gate/up colwise (output Shard(-1)), o/down rowwise (input Shard(-1))
PIECES = {
    f"{ATTN}.q_proj.output": True, f"{ATTN}.q_proj.input": False, f"{ATTN}.o_proj.input": True,
    f"{ATTN}.o_proj.output": False, f"{MLP}.up_proj.output": True, f"{MLP}.down_proj.input": True,
    f"{MLP}.down_proj.output": False,
}  # fmt: skip


def _tp_plan_rank(rank: int, world: int, out_dir: str, cfg: str, hf_dir: str) -> dict:
    """`from_pretrained(tp_plan="auto")`: transformers' styles convert inside `module.forward` (no hooks),
    so the monitor's hooks see this rank's pieces of q_proj's output and o_proj's input."""
    import transformers

    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out_dir
    if rank == 0:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16,
        )  # fmt: skip
        transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    torch.distributed.barrier()
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, tp_plan="auto")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=optimizer)
    seen: dict = {}

    def keep(name: str, t: torch.Tensor) -> None:  # returns None: a hook's result replaces the output
        seen[("actv", name)] = ref_stats(t)
        t.register_hook(lambda g: seen.__setitem__(("actv_grad", name), ref_stats(g)))

    for name in PIECES:
        module, _, io = name.rpartition(".")
        if io == "output":
            model.get_submodule(module).register_forward_hook(lambda m, a, out, n=name: keep(n, out))
        else:
            model.get_submodule(module).register_forward_pre_hook(lambda m, a, n=name: keep(n, a[0]))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    monitor.close()
    return {"faults": monitor.faults.total, "run_dir": monitor.run_dir, "seen": seen}


def test_tp_plan_pieces_are_labelled(tmp_path):
    cfg = write_config(tmp_path / "cfg.json", xy_distribution=True, ops=list(OPS), ndigits=12)
    results = run_ranks(
        _tp_plan_rank, world_size=2, out_dir=str(tmp_path / "out"), cfg=cfg, hf_dir=str(tmp_path / "hf")
    )
    for rank, r in enumerate(results):
        assert r["faults"] == 0
        for family in ("actv", "actv_grad"):
            rows = {row["name"]: row for row in read_family(r["run_dir"], family)}
            for name, piece in PIECES.items():
                if (family, name) not in r["seen"]:
                    continue  # q_proj's input: the embedding output, which takes no gradient here
                row = rows[name]
                assert row["shard"] == (f"Shard(-1)[tp={rank}/2]" if piece else ""), (rank, family, name)
                assert_row_matches(row, r["seen"][(family, name)], OPS)
