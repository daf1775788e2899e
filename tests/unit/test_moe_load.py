"""The `moe_load` family (moe_distribution) on a tiny Mixtral built from transformers' MixtralConfig (never
downloaded): tokens per expert against the router's own outputs (a hook of the test's own), the derived
columns against numpy on those counts, CSV / Parquet / Prometheus, `analyze` (layer x expert table of the
last step), the AnomalyExpertCollapse rule and config validation. Megatron-Core's TopKRouter under EP2
(and TP2 x EP2 with sequence parallelism, dropped tokens, aux loss): tests/adapters/test_megatron_layouts.py.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

from tests.helpers import keyed, read_family, write_config
from trainermon import ConfigError, TrainerMon, parse_config
from trainermon.collect.records import RowMeta, StatBatch
from trainermon.pipeline.anomaly import AnomalyDetector, load_anomalies
from trainermon.pipeline.rule_specs import parse_rules

pytest.importorskip("transformers")
EXPERTS, STEPS = 4, 3


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


def _train(tmp_path, monkeypatch, **keys):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "c.json", moe_distribution=True, ops=["norm", "mean", "min", "max", "zeros"], **keys
    )
    model = _mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt, grad_acc_steps=2)
    seen: dict[str, torch.Tensor] = {}

    def hook(module, inputs, output, name):  # the router's own output: top-k expert indices
        counts = torch.bincount(output[2].flatten(), minlength=EXPERTS)
        seen[name] = seen.get(name, 0) + counts

    routers = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "MixtralTopKRouter"]
    assert len(routers) == 2
    handles = [m.register_forward_hook(lambda m, i, o, n=n: hook(m, i, o, n)) for n, m in routers]
    refs = {}
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        seen.clear()
        for _micro in range(2):  # two micro-batches: the step's counts are their sum
            ids = torch.randint(0, 64, (2, 12), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        refs.update({(n, step): c.tolist() for n, c in seen.items()})
    for h in handles:
        h.remove()
    mon.close()
    return mon, refs


def test_expert_load_matches_the_routers_outputs(tmp_path, monkeypatch):
    mon, refs = _train(tmp_path, monkeypatch, format=["csv", "parquet"])
    assert mon.faults.total == 0
    rows = keyed(read_family(mon.run_dir, "moe_load"))
    assert set(rows) == {(n, s, None) for (n, s) in refs}
    for (name, step, _), row in rows.items():
        load = np.array(refs[(name, step)], dtype=float)
        assert json.loads(row["expert_load"]) == refs[(name, step)]
        assert load.sum() == 2 * 2 * 12 * 2  # micro-batches x batch x tokens x top-k
        assert float(row["mean"]) == pytest.approx(load.mean()) and float(row["max"]) == load.max()
        assert float(row["min"]) == load.min() and float(row["norm"]) == pytest.approx(np.linalg.norm(load))
        assert float(row["zeros"]) == pytest.approx((load == 0).mean())
        assert float(row["load_cv"]) == pytest.approx(load.std() / load.mean(), rel=1e-5)
        assert int(row["max_expert"]) == int(np.argmax(load)) and int(row["min_expert"]) == int(
            np.argmin(load)
        )
        assert row["dropped"] == "nan" and row["aux_loss"] == "nan"  # transformers' router reports neither
        assert json.loads(row["shape"]) == [EXPERTS]
    import trainermon

    table = trainermon.load(str(tmp_path / "out"), family="moe_load").to_pandas()
    assert len(table) == len(refs)
    for _, r in table.iterrows():
        assert list(r["expert_load"]) == refs[(r["name"], r["step"])]
        assert r["max_expert"] == int(np.argmax(refs[(r["name"], r["step"])]))
    assert table["dropped"].isna().all()


def test_analyze_shows_expert_load_of_the_last_step(tmp_path, monkeypatch):
    from trainermon.analysis import analyze

    mon, refs = _train(tmp_path, monkeypatch, format=["csv", "parquet"])
    for run in (str(tmp_path / "out"), mon.run_dir):
        if run == mon.run_dir:
            os.remove(os.path.join(mon.run_dir, "parquet.json"))  # then the run's CSV files
        result = analyze(run, progress=False)
        table = result.expert_load
        assert table.attrs["step"] == STEPS - 1 and list(table.columns) == list(range(EXPERTS))
        for name in table.index:
            assert table.loc[name].tolist() == refs[(name, STEPS - 1)]
        assert ("moe_load", "load_cv") in result.heatmaps
        assert result.findings()["expert_load"]["figure"] == "moe_expert_load"
    # trainermon convert: the CSV's expert_load and family columns become the same Parquet columns
    import trainermon
    from trainermon.cli import main as cli_main

    assert cli_main(["convert", mon.run_dir, str(tmp_path / "converted")]) == 0
    table = trainermon.load(str(tmp_path / "converted"), family="moe_load").to_pandas()
    assert {(r["name"], r["step"]): list(r["expert_load"]) for _, r in table.iterrows()} == refs


def test_prometheus_exports_the_per_layer_summary(tmp_path, monkeypatch):
    from tests.sinks.test_prometheus import scrape, url_of, value

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", moe_distribution=True, ops=["max", "min"], format=["prometheus"])
    model = _mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    router = model.model.layers[1].mlp.gate
    seen = []
    handle = router.register_forward_hook(
        lambda m, i, o: seen.append(torch.bincount(o[2].flatten(), minlength=4))
    )
    try:
        ids = torch.randint(0, 64, (2, 12))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        mon.flush()
        samples = scrape(url_of(mon))
        load = seen[0].double()
        lab = {"family": "moe_load", "layer": "model.layers.1"}
        assert value(samples, "trainermon_layer_stat", stat="max", **lab) == float(load.max())
        assert value(samples, "trainermon_layer_stat", stat="load_cv", **lab) == pytest.approx(
            float(load.std(unbiased=False) / load.mean()), rel=1e-6
        )
        assert not [k for k in samples if ("stat", "dropped") in k[1]]  # not reported: no series
    finally:
        handle.remove()
        mon.close()


def test_off_by_default_validated_and_warns_without_routers(tmp_path, monkeypatch, caplog):
    assert parse_config({}).moe_distribution is False
    with pytest.raises(ConfigError, match=r"'moe_distribution': got 1 \(int\); allowed: true or false"):
        parse_config({"moe_distribution": 1})
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", moe_distribution=True)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        mon = TrainerMon(cfg)
        mon.set_monitor(model, optimizer=opt)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        mon.close()
    assert (
        sum("moe_distribution is on but the model has no top-k router" in r.message for r in caplog.records)
        == 1
    )
    assert read_family(mon.run_dir, "moe_load") == []


def test_expert_collapse_rule(tmp_path):
    rules = parse_rules([{"rule_name": "AnomalyExpertCollapse", "args": {"cv": 0.5, "dead": 0.2}}])
    det = AnomalyDetector(rules, str(tmp_path), rank=0)
    metas = [RowMeta("moe_load", 0, "layers.0.mlp.router", None, (4,), torch.int64, 4)]
    metas.append(RowMeta("moe_load", 0, "layers.1.mlp.router", None, (4,), torch.int64, 4))
    det.check(StatBatch(0, metas, {"load_cv": np.array([0.1, 0.9]), "zeros": np.array([0.0, 0.25])}))
    det.close()
    got = {(r["name"], r["stat"], r["baseline"]) for r in load_anomalies(str(tmp_path))}
    assert got == {("layers.1.mlp.router", "load_cv", 0.5), ("layers.1.mlp.router", "zeros", 0.2)}


def _switch():
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    config = SwitchTransformersConfig(
        vocab_size=32,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        num_experts=EXPERTS,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        expert_capacity=64,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return SwitchTransformersForConditionalGeneration(config)


def test_switch_router_one_hot_output_is_a_routing_map(tmp_path, monkeypatch):
    """transformers' Switch router returns (one-hot expert index [batch, seq, experts] int64, probs,
    logits): the counts are the one-hot's column sums (they were read as indices: every count 0, and a
    fault), against the router's own output seen by a hook of the test's own."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = _switch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMon(write_config(tmp_path / "c.json", moe_distribution=True))
    mon.set_monitor(model, optimizer=opt)
    routers = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "SwitchTransformersTop1Router"]
    seen: dict[str, torch.Tensor] = {}

    def hook(module, inputs, output, name):
        seen[name] = output[0].reshape(-1, EXPERTS).sum(0)

    handles = [m.register_forward_hook(lambda m, i, o, n=n: hook(m, i, o, n)) for n, m in routers]
    refs = {}
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        ids = torch.randint(0, 32, (2, 8), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        refs.update({(n, step): c.tolist() for n, c in seen.items()})
    for h in handles:
        h.remove()
    mon.close()
    assert mon.loop.faults.total == 0
    rows = {(r["name"], int(r["step"])): r for r in read_family(mon.run_dir, "moe_load")}
    assert set(rows) == set(refs) and len(refs) == 2 * len(routers) == 8
    for key, want in refs.items():
        assert json.loads(rows[key]["expert_load"]) == want and sum(want) == 16, (key, rows[key])


class _Router(torch.nn.Module):
    """A custom top-2 router: `order` says what it returns (indices first, or floating values only)."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.num_experts, self.order = EXPERTS, order
        self.gate = torch.nn.Linear(8, EXPERTS)

    def forward(self, x: torch.Tensor) -> tuple:
        weights, indices = torch.softmax(self.gate(x), -1).topk(2, dim=-1)
        if self.order == "bad-indices":  # a faulty router: the monitor's count fails
            return weights, indices - EXPERTS
        return (indices, weights) if self.order == "indices-first" else (weights, weights.sum(-1))


class _Moe(torch.nn.Module):
    def __init__(self, order: str) -> None:
        super().__init__()
        self.routers = torch.nn.ModuleList([_Router(order), _Router(order)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(r(x)[1 if r.order == "indices-first" else 0].sum() for r in self.routers)  # weights


@pytest.mark.parametrize("order", ["indices-first", "floats", "bad-indices"])
def test_router_outputs_that_are_not_last_indices(tmp_path, monkeypatch, caplog, order):
    """Indices before the weights: counted from the indices (the float weights were truncated to expert
    0: [32, 0, 0, 0]). A router that returns floating values only: said once per router, no moe_load
    row (it was written as all zeros, a collapse that never happened), and no fault. A count that fails
    (indices out of range) is a counted fault, and that router's row is left out too (not zeros)."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = _Moe(order)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs = {}
    for i, router in enumerate(model.routers):
        if order == "indices-first":
            router.register_forward_hook(
                lambda m, inp, out, i=i: refs.__setitem__(
                    f"routers.{i}", torch.bincount(out[0].flatten(), minlength=EXPERTS).tolist()
                )
            )
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        mon = TrainerMon(write_config(tmp_path / "c.json", moe_distribution=True))
        mon.set_monitor(model, optimizer=opt)
        for _ in range(2):
            model(torch.randn(16, 8)).backward()
            opt.step()
            opt.zero_grad()
        mon.close()
    assert (mon.loop.faults.total > 0) == (order == "bad-indices")
    rows = {(r["name"], int(r["step"])): r for r in read_family(mon.run_dir, "moe_load")}
    said = [r.message for r in caplog.records if "returned no integer or bool tensor" in r.message]
    if order == "floats":
        assert rows == {} and len(said) == 2 and "routers.0" in said[0], said
    elif order == "bad-indices":
        assert rows == {} and not said
    else:
        assert not said and set(rows) == {(f"routers.{i}", s) for i in range(2) for s in range(2)}
        for (name, step), row in rows.items():
            if step == 1:  # the hooks above keep the last step's indices
                assert json.loads(row["expert_load"]) == refs[name] and sum(refs[name]) == 32


def test_rule_arguments_that_could_never_fire_or_always_would_are_refused():
    """`dead` is a fraction of the experts (the rule fires when more than it got no token): 1 or more can
    never fire. `growth` below 1 would fire on every layer's first step (a logit above a fraction of
    itself). Both refused, naming the key, the value and what is allowed; the bounds themselves pass."""
    for rule, args, match in (
        ("AnomalyExpertCollapse", {"dead": 2}, r"'alert.rules\[0\].args.dead': got 2; allowed: a fraction"),
        ("AnomalyExpertCollapse", {"dead": 1.0}, r"args.dead': got 1.0; allowed: .* below 1"),
        ("AnomalyLogitGrowth", {"growth": 0.5}, r"rules\[0\].args.growth': got 0.5; allowed: at least 1"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_config({"alert": {"rules": [{"rule_name": rule, "args": args}]}})
    for rule, args in (("AnomalyExpertCollapse", {"dead": 0}), ("AnomalyLogitGrowth", {"growth": 1})):
        assert parse_config({"alert": {"rules": [{"rule_name": rule, "args": args}]}})
