"""The `attn_logit` family: per layer and head maxima against explicit logits (MHA, Llama, GPT-2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers import keyed, read_family, write_config
from tests.unit.attn_logit_common import STEPS, _mha_run, ref_max
from trainermon import TrainerMon
from trainermon.runtime import attn_math

# The `attn_logit` family (attn_logit_distribution): per attention layer and head, the largest
# pre-softmax logit of the step, against an explicit float64 q.k^T the test computes itself on the sampled
# query positions (its own hooks capture the inputs; q and k recomputed from the module's weights, rotary
# embedding applied by transformers' own function), masked logits excluded:
#
# - torch.nn.MultiheadAttention: batch-first with a boolean causal mask and key padding; sequence-first
#   with separate q/k projections (kdim != embed_dim) and an additive float mask;
# - a tiny Llama (grouped-query attention, rotary) from a transformers config, eager and sdpa, right padding;
# - a tiny GPT-2 (sdpa, no mask: causal from the module), long-sequence sampling and small chunks.
#
# Also: CSV / Parquet / convert, analyze (layer x head table), Prometheus, AnomalyLogitGrowth, config
# validation, the warning without attention modules. Megatron-Core TP2 (global head indices):
# tests/adapters/test_megatron_attn_logit.py.


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
