"""The `attn_logit` family (attn_logit_distribution): per attention layer and head, the largest
pre-softmax logit of the step, against an explicit float64 q.k^T the test computes itself on the sampled
query positions (its own hooks capture the inputs; q and k recomputed from the module's weights, rotary
embedding applied by transformers' own function), masked logits excluded:

- torch.nn.MultiheadAttention: batch-first with a boolean causal mask and key padding; sequence-first
  with separate q/k projections (kdim != embed_dim) and an additive float mask;
- a tiny Llama (grouped-query attention, rotary) from a transformers config, eager and sdpa, right padding;
- a tiny GPT-2 (sdpa, no mask: causal from the module), long-sequence sampling and small chunks.

Also: CSV / Parquet / convert, analyze (layer x head table), Prometheus, AnomalyLogitGrowth, config
validation, the warning without attention modules. Megatron-Core TP2 (global head indices):
tests/adapters/test_megatron_attn_logit.py.
"""

from __future__ import annotations

import json
import logging
import math
import os

import numpy as np
import pytest
import torch

from tests.helpers import keyed, read_family, write_config
from trainermon import ConfigError, TrainerMon, parse_config
from trainermon.collect.records import RowMeta, StatBatch
from trainermon.pipeline.anomaly import AnomalyDetector, load_anomalies
from trainermon.pipeline.rule_specs import parse_rules
from trainermon.runtime import attn_math

STEPS = 2


def positions(length: int, sample: int) -> list[int]:
    """The documented sampling rule, written independently: all, or `sample` evenly spaced positions
    from the first to the last."""
    if length <= sample:
        return list(range(length))
    return [(i * (length - 1)) // (sample - 1) for i in range(sample)]


def ref_max(q: torch.Tensor, k: torch.Tensor, scale: float, visible: torch.Tensor, sample: int):
    """q [B,H,S,D], k [B,H,S,D] float64 (kv heads already repeated), visible [B,H|1,S,S] bool: per head
    the max of q.k^T * scale over the sampled queries and visible keys, and the tolerance: float32
    rounding of the model's projections (E terms) and the monitor's dot products (D terms), each at most
    (E + D) * 2^-24 relative to sum |q_i k_i| * scale, taken with a margin of 8."""
    pos = positions(q.shape[2], sample)
    logits = (q[:, :, pos] @ k.transpose(-1, -2)) * scale
    vis = visible.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])[:, :, pos]
    top = logits.masked_fill(~vis, -math.inf).amax(dim=(0, 2, 3))
    bound = float(((q[:, :, pos].abs() @ k.abs().transpose(-1, -2)) * scale).max())
    return top, bound


def _mha_run(tmp_path, monkeypatch, sample=256, steps=STEPS, **keys):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "c.json",
        attn_logit_distribution={"enable": True, "sample": sample},
        ops=["norm", "mean", "min", "max"],
        **keys,
    )
    torch.manual_seed(0)
    first = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    second = torch.nn.MultiheadAttention(16, 2, kdim=12, vdim=12)  # separate q/k projections
    model = torch.nn.ModuleDict({"first": first, "second": second, "mem": torch.nn.Linear(16, 12)})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt, grad_acc_steps=2)
    refs, bounds, seen = {}, {}, {}

    def capture(name, module, args, kwargs):  # the test's own hook: inputs and weights of this call
        got = dict(zip(("query", "key", "value"), args)) | kwargs
        seen.setdefault(name, []).append(
            {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in got.items()}
            | {"w": {n: p.detach().double().clone() for n, p in module.named_parameters()}}
        )

    first.register_forward_pre_hook(lambda m, a, kw: capture("first", m, a, kw), with_kwargs=True)
    second.register_forward_pre_hook(lambda m, a, kw: capture("second", m, a, kw), with_kwargs=True)
    gen = torch.Generator().manual_seed(1)
    seq = 10
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)  # True = masked (PyTorch)
    for step in range(steps):
        seen.clear()
        for _ in range(2):
            x = torch.randn(3, seq, 16, generator=gen)
            pad = torch.zeros(3, seq, dtype=torch.bool)
            pad[1, 7:] = True  # the second sequence has 3 padding keys
            y, _ = first(x, x, x, attn_mask=causal, key_padding_mask=pad, need_weights=False)
            mem = model["mem"](torch.randn(seq + 2, 3, 16, generator=gen))  # [S, B, 12]
            bias = torch.randn(seq, seq + 2, generator=gen)
            bias[:, -1] = -math.inf  # the last memory slot hidden
            z, _ = second(y.transpose(0, 1), mem, mem, attn_mask=bias)
            z.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        for name in ("first", "second"):
            tops = []
            for call in seen[name]:
                w = call["w"]
                if name == "first":
                    q_in, k_in = call["query"].double(), call["key"].double()
                    wq, wk = w["in_proj_weight"][:16], w["in_proj_weight"][16:32]
                    heads = 4
                    visible = ~causal[None, None] & ~call["key_padding_mask"][:, None, None, :]
                else:
                    q_in, k_in = call["query"].double().transpose(0, 1), call["key"].double().transpose(0, 1)
                    wq, wk, heads = w["q_proj_weight"], w["k_proj_weight"], 2
                    visible = (call["attn_mask"] != -math.inf)[None, None]
                bq, bk = w["in_proj_bias"][:16], w["in_proj_bias"][16:32]
                b, d = q_in.shape[0], 16 // heads
                q = (q_in @ wq.T + bq).view(b, -1, heads, d).transpose(1, 2)
                k = (k_in @ wk.T + bk).view(b, -1, heads, d).transpose(1, 2)
                top, bound = ref_max(q, k, 1 / math.sqrt(d), visible, sample)
                tops.append(top)
                bounds[(name, step)] = max(bounds.get((name, step), 0.0), bound)
            refs[(name, step)] = torch.stack(tops).amax(0).tolist()
    mon.close()
    return mon, refs, bounds


def _check(mon, refs, bounds, margin=8 * (16 + 8) * 2.0**-24):
    assert mon.faults.total == 0, dict(mon.faults.counts)
    rows = keyed(read_family(mon.run_dir, "attn_logit"))
    assert set(rows) == {(n, s, None) for (n, s) in refs}
    for (name, step, _), row in rows.items():
        ref = np.array(refs[(name, step)])
        got = np.array(json.loads(row["head_max_logit"]))
        tol = margin * bounds[(name, step)]
        np.testing.assert_allclose(got, ref, rtol=0, atol=tol)
        assert float(row["max"]) == pytest.approx(ref.max(), abs=tol)
        if "mean" in row:  # the configured ops only
            assert float(row["mean"]) == pytest.approx(ref.mean(), abs=tol)
        assert int(row["max_head"]) == int(np.argmax(got))
        assert json.loads(row["shape"]) == [len(ref)]
    return rows


def test_multihead_attention_against_explicit_logits(tmp_path, monkeypatch):
    mon, refs, bounds = _mha_run(tmp_path, monkeypatch, format=["csv", "parquet"])
    _check(mon, refs, bounds)
    import trainermon

    table = trainermon.load(str(tmp_path / "out"), family="attn_logit").to_pandas()
    assert len(table) == len(refs)
    for _, r in table.iterrows():
        ref = refs[(r["name"], r["step"])]
        np.testing.assert_allclose(list(r["head_max_logit"]), ref, rtol=0, atol=1e-4 * max(map(abs, ref)))


def test_sampled_and_chunked_queries(tmp_path, monkeypatch):
    """A sample smaller than the sequence (strided positions) and chunks of a few logits give the
    reference on exactly the sampled positions."""
    monkeypatch.setattr(attn_math, "CHUNK_ELEMENTS", 50)  # a few query positions per chunk
    mon, refs, bounds = _mha_run(tmp_path, monkeypatch, sample=4, steps=1)
    _check(mon, refs, bounds)


def _llama(impl: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config._attn_implementation = impl
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_tiny_llama_after_rotary(tmp_path, monkeypatch, impl):
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", attn_logit_distribution=True, ops=["max", "mean"])
    model = _llama(impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    calls: dict[str, list] = {}
    layers = {f"model.layers.{i}.self_attn": layer.self_attn for i, layer in enumerate(model.model.layers)}
    for name, attn in layers.items():
        attn.register_forward_pre_hook(
            lambda m, a, kw, n=name: calls.setdefault(n, []).append(
                (
                    kw["hidden_states"].detach().double(),
                    [t.detach().double() for t in kw["position_embeddings"]],
                )
            ),
            with_kwargs=True,
        )
    refs, bounds = {}, {}
    gen = torch.Generator().manual_seed(2)
    for step in range(STEPS):
        calls.clear()
        ids = torch.randint(0, 64, (2, 12), generator=gen)
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[0, 9:] = 0  # right padding: keys 9.. of the first sequence are never visible
        weights = {
            n: (a.q_proj.weight.detach().double(), a.k_proj.weight.detach().double())
            for n, a in layers.items()
        }
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        for name, ((h, (cos, sin)),) in calls.items():
            wq, wk = weights[name]
            q = (h @ wq.T).view(2, 12, 4, 8).transpose(1, 2)
            k = (h @ wk.T).view(2, 12, 2, 8).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k = k.repeat_interleave(2, dim=1)  # head h reads kv head h // 2
            causal = torch.tril(torch.ones(12, 12, dtype=torch.bool))
            visible = causal[None, None] & mask.bool()[:, None, None, :]
            refs[(name, step)], bounds[(name, step)] = ref_max(q, k, 8**-0.5, visible, 256)
            refs[(name, step)] = refs[(name, step)].tolist()
    mon.close()
    _check(mon, refs, bounds, margin=8 * (32 + 8) * 2.0**-24)
    from transformers.modeling_utils import AttentionInterface

    # closing the monitor gives transformers its own lookup back
    assert AttentionInterface.get_interface.__qualname__ == "AttentionInterface.get_interface"


def test_tiny_gpt2_long_sequence_sampled(tmp_path, monkeypatch):
    """GPT-2 (sdpa, no mask handed to the attention function: causal from the module), a sequence longer
    than the sample, in small chunks."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    monkeypatch.setattr(attn_math, "CHUNK_ELEMENTS", 300)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", attn_logit_distribution={"sample": 7}, ops=["max"])
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=16, n_layer=2, n_head=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    calls = {}
    for i, block in enumerate(model.transformer.h):
        block.attn.register_forward_pre_hook(
            lambda m, a, kw, n=f"transformer.h.{i}.attn": calls.__setitem__(
                n,
                (
                    (a[0] if a else kw["hidden_states"]).detach().double(),
                    m.c_attn.weight.detach().double(),
                    m.c_attn.bias.detach().double(),
                ),
            ),
            with_kwargs=True,
        )
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    mon.close()
    refs, bounds = {}, {}
    for name, (h, w, b) in calls.items():
        qkv = h @ w + b  # GPT-2's Conv1D: x @ W + b, then split into q, k, v
        q = qkv[..., :16].view(2, 40, 2, 8).transpose(1, 2)
        k = qkv[..., 16:32].view(2, 40, 2, 8).transpose(1, 2)
        visible = torch.tril(torch.ones(40, 40, dtype=torch.bool))[None, None]
        top, bounds[(name, 0)] = ref_max(q, k, 8**-0.5, visible, 7)
        refs[(name, 0)] = top.tolist()
    _check(mon, refs, bounds, margin=8 * (16 + 8) * 2.0**-24)


def test_config_validation_and_warning_without_attention(tmp_path, monkeypatch, caplog):
    cfg = parse_config({})
    assert cfg.attn_logit_distribution.enable is False and cfg.attn_logit_distribution.sample == 256
    got = parse_config({"attn_logit_distribution": {"enable": True, "sample": 64}}).attn_logit_distribution
    assert got.enable and got.sample == 64
    assert parse_config({"attn_logit_distribution": {"sample": 8}}).attn_logit_distribution.enable
    for bad, match in (
        (1, r"'attn_logit_distribution': got 1 \(int\); allowed: true, false or"),
        ({"sample": 0}, r"'attn_logit_distribution.sample': got 0 \(int\); allowed: an integer in \[1, "),
        ({"enable": "yes"}, r"'attn_logit_distribution.enable': got 'yes' \(str\); allowed: true or false"),
        ({"stride": 2}, r"'attn_logit_distribution.stride': got 2 \(int\); allowed: only the keys"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_config({"attn_logit_distribution": bad})
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        mon = TrainerMon(write_config(tmp_path / "c.json", attn_logit_distribution=True))
        mon.set_monitor(model, optimizer=opt)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        mon.close()
    assert (
        sum(
            "attn_logit_distribution is on but the model has no attention" in r.message
            for r in caplog.records
        )
        == 1
    )
    assert read_family(mon.run_dir, "attn_logit") == []


def test_logit_growth_rule(tmp_path):
    rules = parse_rules([{"rule_name": "AnomalyLogitGrowth", "args": {"threshold": 30.0, "growth": 2.0}}])
    det = AnomalyDetector(rules, str(tmp_path), rank=0)
    metas = [RowMeta("attn_logit", 0, f"layers.{i}.attn", None, (4,), torch.float32, 4) for i in range(3)]
    det.check(StatBatch(0, metas, {"max": np.array([5.0, 8.0, 31.0])}))  # layer 2 above the threshold
    det.check(StatBatch(1, metas, {"max": np.array([11.0, 9.0, 12.0])}))  # layer 0 grew 2.2x its first
    det.close()
    got = {(r["step"], r["name"], r["stat"], r["baseline"]) for r in load_anomalies(str(tmp_path))}
    assert got == {(0, "layers.2.attn", "max", 30.0), (1, "layers.0.attn", "max", 10.0)}


def test_analyze_convert_and_parquet(tmp_path, monkeypatch):
    """analyze: a per-layer `max` heatmap over steps and the layer x head table of the last step, from
    Parquet and from CSV; trainermon convert carries head_max_logit / max_head to Parquet."""
    import trainermon
    from trainermon.analysis import analyze
    from trainermon.cli import main as cli_main

    mon, refs, bounds = _mha_run(tmp_path, monkeypatch, format=["csv", "parquet"])
    for run in (str(tmp_path / "out"), mon.run_dir):
        if run == mon.run_dir:
            os.remove(os.path.join(mon.run_dir, "parquet.json"))  # then the run's CSV files
        result = analyze(run, progress=False)
        table = result.head_logits
        assert table.attrs["step"] == STEPS - 1 and list(table.columns) == [0, 1, 2, 3]
        assert list(table.index) == ["first", "second"]
        for name in table.index:
            ref = refs[(name, STEPS - 1)]
            got = [v for v in table.loc[name].tolist() if v == v]  # the 2-head layer: NaN-padded
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * max(map(abs, ref)))
        heat = result.heatmaps[("attn_logit", "max")]
        for name in ("first", "second"):
            for step in range(STEPS):
                assert heat.loc[name, step] == pytest.approx(max(refs[(name, step)]), rel=1e-5)
        assert result.findings()["head_logits"]["figure"] == "attn_head_logits"
        assert "attn_head_logits" in dict(result.iter_figures())
    assert cli_main(["convert", mon.run_dir, str(tmp_path / "converted")]) == 0
    table = trainermon.load(str(tmp_path / "converted"), family="attn_logit").to_pandas()
    assert len(table) == len(refs)
    for _, r in table.iterrows():
        ref = refs[(r["name"], r["step"])]
        np.testing.assert_allclose(list(r["head_max_logit"]), ref, rtol=0, atol=1e-4 * max(map(abs, ref)))
        assert r["max_head"] == int(np.argmax(ref))


def test_prometheus_exports_the_per_layer_summary(tmp_path, monkeypatch):
    from tests.sinks.test_prometheus import scrape, url_of, value

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", attn_logit_distribution=True, ops=["max"], format=["prometheus"])
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"attn": torch.nn.MultiheadAttention(8, 2, batch_first=True)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    try:
        x = torch.randn(2, 5, 8)
        w, b = model["attn"].in_proj_weight.detach().double(), model["attn"].in_proj_bias.detach().double()
        q = (x.double() @ w[:8].T + b[:8]).view(2, 5, 2, 4).transpose(1, 2)
        k = (x.double() @ w[8:16].T + b[8:16]).view(2, 5, 2, 4).transpose(1, 2)
        top, bound = ref_max(q, k, 0.5, torch.ones(1, 1, 5, 5, dtype=torch.bool), 256)
        model["attn"](x, x, x)[0].sum().backward()
        opt.step()
        mon.flush()
        samples = scrape(url_of(mon))
        got = value(samples, "trainermon_layer_stat", stat="max", family="attn_logit", layer="attn")
        assert got == pytest.approx(float(top.max()), abs=8 * 12 * 2.0**-24 * bound)
        assert not [k for k in samples if ("family", "_attn") in k[1]]  # hidden rows never exported
    finally:
        mon.close()


def test_a_failing_computation_never_reaches_training(tmp_path, monkeypatch):
    from trainermon.runtime.probes import attn as attn_probe

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(attn_probe, "head_extremes", boom)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = torch.nn.ModuleDict({"attn": torch.nn.MultiheadAttention(8, 2, batch_first=True)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(tmp_path / "c.json", attn_logit_distribution=True, wg_distribution=True))
    mon.set_monitor(model, optimizer=opt)
    x = torch.randn(2, 5, 8)
    for _ in range(2):
        out = model["attn"](x, x, x)[0]  # the hook's failure stays inside the monitor
        out.sum().backward()
        opt.step()
    mon.close()
    assert mon.faults.counts.get("attention logit hook", 0) == 2
    assert read_family(mon.run_dir, "attn_logit") == [] and read_family(mon.run_dir, "grad_reduced")


def test_a_layer_not_run_is_warned_about(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    model = torch.nn.ModuleDict({n: torch.nn.MultiheadAttention(8, 2, batch_first=True) for n in ("a", "b")})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        mon = TrainerMon(write_config(tmp_path / "c.json", attn_logit_distribution=True, ops=["max"]))
        mon.set_monitor(model, optimizer=opt)
        x = torch.randn(2, 5, 8)
        model["a"](x, x, x)[0].sum().backward()  # "b" never runs
        opt.step()
        mon.close()
    assert [r["name"] for r in read_family(mon.run_dir, "attn_logit")] == ["a"]
    assert (
        sum(
            "no attention call was read at step 0 for ['b'] (of 2 layers)" in r.message
            for r in caplog.records
        )
        == 1
    )


def test_with_moe_load_in_the_same_step(tmp_path, monkeypatch):
    """Both worker-formed families in one step (a tiny Mixtral): each keeps its own columns."""
    pytest.importorskip("transformers")
    import trainermon
    from tests.unit.test_moe_load import _mixtral

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "c.json", attn_logit_distribution=True, moe_distribution=True, format=["csv", "parquet"]
    )
    model = _mixtral()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt)
    ids = torch.randint(0, 64, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    mon.close()
    assert mon.faults.total == 0
    attn, moe = read_family(mon.run_dir, "attn_logit"), read_family(mon.run_dir, "moe_load")
    assert [r["name"] for r in attn] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(len(json.loads(r["head_max_logit"])) == 2 and "expert_load" not in r for r in attn)
    assert all(sum(json.loads(r["expert_load"])) == 2 * 12 * 2 and "head_max_logit" not in r for r in moe)
    table = trainermon.load(str(tmp_path / "out")).to_pandas()
    rows = table[table["family"].isin(["attn_logit", "moe_load"])]
    for _, r in rows.iterrows():
        mine, other = (
            ("head_max_logit", "expert_load")
            if r["family"] == "attn_logit"
            else ("expert_load", "head_max_logit")
        )
        assert r[mine] is not None and len(r[mine]) > 0 and r[other] is None, r
