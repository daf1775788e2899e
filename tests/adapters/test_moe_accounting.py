"""moe_load's token accounting against each framework's own numbers:

- Megatron-Core on 4 gloo ranks, one launch: `aux_loss` under TP2 x EP2 + sequence parallelism (each rank's
  loss is a partial sum over its sequence slice) and with two load-balancing losses (`aux_loss` +
  `seq_aux_loss`) against Megatron's own tracker reduced by `reduce_aux_losses_tracker_across_ranks`;
  `expert_load` under full activation recompute against the routing maps of the first forwards (the
  recompute routes the same tokens again);
- transformers' Mixtral under gradient checkpointing (reentrant and not): `expert_load` against the
  router's own top-k of the training forward;
- routers whose output would give wrong counts (NLLB-MoE's top-2 router returns its top-1 mask only,
  DeepSpeed's TopKGate) are named as not supported and get no rows.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import read_family, write_config

EXPERTS, STEPS = 4, 2
TWO_AUX = {
    "moe_router_load_balancing_type": ["aux_loss", "seq_aux_loss"],
    "moe_aux_loss_coeff": [0.01, 0.001],
}
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
MEGATRON_LAYOUTS = [
    (
        "tp2-ep2-sp-aux",
        {"experts": EXPERTS, "ep": 2, "tp": 2, "sp": True, "extra": {"moe_aux_loss_coeff": 0.01}},
    ),
    ("ep2-two-aux", {"experts": EXPERTS, "ep": 2, "extra": TWO_AUX}),
    # Megatron attaches the loss only with grad on: under its reentrant recompute the recompute's is the one
    ("ep2-recompute", {"experts": EXPERTS, "ep": 2, "extra": {**RECOMPUTE, "moe_aux_loss_coeff": 0.01}}),
]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("trainermon").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def close(self) -> list[str]:
        logging.getLogger("trainermon").removeHandler(self)
        return self.messages


def _megatron_layout(rank: int, out_root: str, tag: str, keys: dict) -> dict:
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils

    from tests.megatron_gpt import Layout, micro_count, setup, single_process_name, train_step
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, tag)
    cfg = write_config(Path(out_root) / f"{tag}-{rank}.json", moe_distribution=True, ops=["norm"], ndigits=12)
    layout = Layout(clip=1e9, **keys)
    model, optimizer = setup(layout)
    moe_utils.get_moe_layer_wise_logging_tracker().clear()  # no groups of an earlier layout
    monitor = TrainerMon(cfg, params_have_main_grad=True)
    monitor.set_monitor(model, grad_acc_steps=micro_count(), optimizer=optimizer)
    recompute = "recompute_granularity" in keys.get("extra", {})
    routers, maps, calls = [], {}, {}

    def count(name: str, routing_map: torch.Tensor) -> None:
        calls[name] = calls.get(name, 0) + 1
        # Megatron's full recompute is reentrant: the first forward runs without grad, the recompute with
        if recompute and torch.is_grad_enabled():
            return
        maps.setdefault(name, []).append(routing_map.detach().sum(0).double())

    root = model[0].module.module if hasattr(model[0].module, "module") else model[0].module
    for name, module in root.named_modules():
        if type(module).__name__ == "TopKRouter":
            full = single_process_name(root, 0, f"{name}.weight")[: -len(".weight")]
            routers.append((full, module))
            module.register_forward_hook(lambda m, i, o, n=full: count(n, o[1]))
    refs = {}
    for step in range(STEPS):
        maps.clear()
        calls.clear()
        moe_utils.clear_aux_losses_tracker()
        train_step(model, optimizer, layout, step)
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        names = sorted(tracker)
        if names:  # Megatron's own reduction of what it logs: sum over tp x cp, mean over dp
            moe_utils.reduce_aux_losses_tracker_across_ranks(names)
        for full, module in routers:
            load = torch.stack(maps[full]).sum(0)
            dist.all_reduce(load)
            logged = {n: float(tracker[n]["values"][module.layer_number - 1]) / micro_count() for n in names}
            refs[(full, step)] = {"load": [int(v) for v in load.tolist()], "logged": logged}
            assert calls[full] == micro_count() * (2 if recompute else 1), (tag, calls)
    monitor.close()
    return {"run_dir": monitor.run_dir, "refs": refs, "faults": dict(monitor.faults.counts)}


def _megatron_ranks(rank: int, world: int, out_root: str) -> dict:
    return {tag: _megatron_layout(rank, out_root, tag, keys) for tag, keys in MEGATRON_LAYOUTS}


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_megatron_aux_loss_and_recompute_on_four_ranks(tmp_path: Path) -> None:
    results = run_ranks(_megatron_ranks, world_size=4, timeout=600, out_root=str(tmp_path))
    problems = []  # every layout checked, so that each one's failure shows
    for tag, keys in MEGATRON_LAYOUTS:
        refs = {}
        for res in results:
            assert res[tag]["faults"] == {}, (tag, res[tag]["faults"])
            refs.update(res[tag]["refs"])
        rows = [row for res in results for row in read_family(res[tag]["run_dir"], "moe_load")]
        assert sorted((r["name"], int(r["step"])) for r in rows) == sorted(refs), tag  # once each
        for row in rows:
            ref = refs[(row["name"], int(row["step"]))]
            where = (tag, row["name"], row["step"])
            if json.loads(row["expert_load"]) != ref["load"]:
                problems.append((*where, "expert_load", row["expert_load"], ref["load"]))
            logged = ref["logged"]
            if "aux_loss_coeff" in json.dumps(keys):
                # aux_loss is Megatron's `load_balancing_loss` (the first type), as its tracker logs it
                want = logged["load_balancing_loss"]
                if not abs(float(row["aux_loss"]) - want) <= 1e-6 * abs(want):
                    problems.append((*where, "aux_loss", row["aux_loss"], logged))
                if "seq_load_balancing_loss" in logged:  # the two differ: a mean of both would fail
                    assert abs(logged["seq_load_balancing_loss"] - want) > 1e-4 * want, logged
            else:
                assert row["aux_loss"] == "nan" and not logged, (tag, row, logged)
    assert problems == [], "\n".join(map(str, problems))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


@pytest.mark.parametrize("reentrant", [False, True])
def test_mixtral_checkpointing_counts_each_token_once(tmp_path, monkeypatch, reentrant):
    pytest.importorskip("transformers")
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", moe_distribution=True, ops=["norm"])
    model = _mixtral().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    phase = {"forward": False}
    seen: dict[str, torch.Tensor] = {}
    recomputed = []

    def hook(name, output):  # the router's own top-k expert indices, of the training forward only
        if not phase["forward"]:
            recomputed.append(name)
            return
        seen[name] = seen.get(name, 0) + torch.bincount(output[2].flatten(), minlength=EXPERTS)

    for n, m in model.named_modules():
        if type(m).__name__ == "MixtralTopKRouter":
            m.register_forward_hook(lambda m, i, o, n=n: hook(n, o))
    refs, gen = {}, torch.Generator().manual_seed(1)
    for step in range(STEPS):
        seen.clear()
        ids = torch.randint(0, 64, (2, 12), generator=gen)
        phase["forward"] = True
        loss = model(input_ids=ids, labels=ids).loss
        phase["forward"] = False
        loss.backward()
        opt.step()
        opt.zero_grad()
        refs.update({(n, step): c.tolist() for n, c in seen.items()})
    mon.close()
    assert recomputed, "checkpointing did not recompute the routers"
    rows = read_family(mon.run_dir, "moe_load")
    assert len(rows) == len(refs) == 2 * STEPS
    for row in rows:
        ref = refs.get((row["name"], int(row["step"])))
        assert ref is not None, (row["name"], sorted(refs))
        assert json.loads(row["expert_load"]) == ref, (row, ref)
        assert sum(ref) == 2 * 12 * 2  # tokens x top-2


def _nllb():
    from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration

    config = NllbMoeConfig(
        vocab_size=64,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_experts=EXPERTS,
        expert_capacity=64,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        max_position_embeddings=64,
        router_dtype="float32",
    )
    torch.manual_seed(0)
    return NllbMoeForConditionalGeneration(config).train()


def test_nllb_top2_router_is_named_unsupported_not_miscounted(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from trainermon import TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = _nllb()
    top1, dispatched = [], []

    def hook(output):  # (top-1 mask, combine weights of both experts, logits)
        top1.append(output[0].reshape(-1, EXPERTS).sum(0))
        dispatched.append((output[1] > 0).reshape(-1, EXPERTS).sum(0))

    for m in model.modules():
        if type(m).__name__ == "NllbMoeTop2Router":
            m.register_forward_hook(lambda m, i, o: hook(o))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warnings = _Warnings()
    mon = TrainerMon(write_config(tmp_path / "c.json", moe_distribution=True, ops=["norm"]))
    mon.set_monitor(model, optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(4, 64, (2, 8), generator=gen), torch.randint(4, 64, (2, 8), generator=gen)
    model(input_ids=ids, labels=labels).loss.backward()
    opt.step()
    mon.close()
    said = warnings.close()
    # what the router's output would give (its top-1 mask) is not its routing (both experts of a token)
    assert any(not torch.equal(a, b) for a, b in zip(top1, dispatched)) and top1
    assert read_family(mon.run_dir, "moe_load") == []
    assert any("NllbMoeTop2Router" in m and "not supported" in m for m in said), said


def test_deepspeed_topkgate_is_named_unsupported(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    from deepspeed.moe.sharded_moe import TopKGate

    from trainermon import TrainerMon

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(8, 8)
            self.gate = TopKGate(8, EXPERTS, k=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inp(x)

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warnings = _Warnings()
    mon = TrainerMon(write_config(tmp_path / "c.json", moe_distribution=True, ops=["norm"]))
    mon.set_monitor(model, optimizer=opt)
    model(torch.ones(2, 8)).square().sum().backward()
    opt.step()
    mon.close()
    said = warnings.close()
    assert any("TopKGate" in m and "not supported" in m and "gate" in m for m in said), said
    assert not any("no top-k router" in m for m in said), said
