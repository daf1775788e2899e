"""Evaluation passes (eval() + no_grad forwards between steps: evaluate(), generate()) are not micro-batches
of the step: `moe_load` and `attn_logit` leave them out, as the actv rows do. References: the test's own
hooks on the training calls (router top-k indices; explicit q.k logits). A model trained in eval mode under
a reentrant checkpoint (first pass without grad) is still counted."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.helpers import keyed, read_family, write_config
from tests.unit.attn_logit_common import ref_max
from trainermon import TrainerMon

EXPERTS = 4


def _moe_rows(mon) -> dict[tuple[str, int], list[float]]:
    assert mon.faults.total == 0, dict(mon.faults.counts)
    rows = keyed(read_family(mon.run_dir, "moe_load"))
    return {(n, s): json.loads(r["expert_load"]) for (n, s, _), r in rows.items()}


def test_moe_load_leaves_out_evaluation_and_generate(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from transformers import MixtralConfig, MixtralForCausalLM

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", moe_distribution=True, ops=["norm"])
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    model = MixtralForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt, grad_acc_steps=1)
    refs: dict[int, torch.Tensor] = {}
    step = [0]

    def own(module, args, output):  # training calls only: grad on, train mode
        if torch.is_grad_enabled() and module.training:
            counts = torch.bincount(output[2].flatten(), minlength=EXPERTS)
            refs[step[0]] = refs.get(step[0], 0) + counts

    routers = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "MixtralTopKRouter"]
    routers[0][1].register_forward_hook(own)
    gen = torch.Generator().manual_seed(1)
    for s in range(3):
        step[0] = s
        ids = torch.randint(0, 64, (2, 8), generator=gen)
        if s == 1:  # an evaluation and a generate() between steps, as HF Trainer's evaluate() + a callback
            model.eval()
            with torch.no_grad():
                model(input_ids=torch.randint(0, 64, (4, 8), generator=gen))
                model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
            model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    got = _moe_rows(mon)
    assert {s for _, s in got} == {0, 1, 2}
    for (_, s), load in got.items():
        assert load == refs[s].tolist(), (s, load, refs[s].tolist())
        assert sum(load) == 2 * 8 * 2  # tokens x top-k of the training forward alone


class TinyRouter(torch.nn.Module):
    """A top-2 router returning (probabilities, expert indices), as transformers' routers do."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = EXPERTS, 2
        self.gate = torch.nn.Linear(8, EXPERTS)

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        return probs, probs.topk(2, dim=-1).indices


class TinyMoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.router = TinyRouter()

    def block(self, h):
        probs, _ = self.router(h)
        return h * probs.sum(-1, keepdim=True)

    def forward(self, x):
        return checkpoint(self.block, self.inp(x), use_reentrant=True)


def test_moe_load_counts_eval_mode_training_under_reentrant_checkpoint(tmp_path, monkeypatch):
    """Training in eval mode (dropout off) with a reentrant checkpoint: the router's first pass runs in
    eval mode without grad, inside a forward that began with grad on: a micro-batch, counted once."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", moe_distribution=True, ops=["norm"])
    torch.manual_seed(0)
    model = TinyMoE().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt, grad_acc_steps=1)
    refs: dict[int, list[int]] = {}
    gen = torch.Generator().manual_seed(2)
    for s in range(2):
        x = torch.randn(6, 8, generator=gen)
        with torch.no_grad():  # the reference: the first pass's routing, by the test's own arithmetic
            refs[s] = torch.bincount(model.router(model.inp(x))[1].flatten(), minlength=EXPERTS).tolist()
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    got = _moe_rows(mon)
    assert got == {("router", s): [float(c) for c in refs[s]] for s in range(2)}


def test_attn_logit_leaves_out_evaluation_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", attn_logit_distribution={"enable": True}, ops=["max"])
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    opt = torch.optim.SGD(mha.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(mha, optimizer=opt, grad_acc_steps=1)
    refs, bounds = {}, {}
    gen = torch.Generator().manual_seed(1)
    for s in range(3):
        x = torch.randn(2, 6, 16, generator=gen)
        if s == 1:  # an evaluation pass on large inputs: far larger logits than the training call's
            mha.eval()
            with torch.no_grad():
                mha(10 * x, 10 * x, 10 * x, need_weights=False)
            mha.train()
        w, b = mha.in_proj_weight.detach().double(), mha.in_proj_bias.detach().double()
        q = (x.double() @ w[:16].T + b[:16]).view(2, 6, 4, 4).transpose(1, 2)
        k = (x.double() @ w[16:32].T + b[16:32]).view(2, 6, 4, 4).transpose(1, 2)
        visible = torch.ones(1, 1, 6, 6, dtype=torch.bool)
        top, bounds[s] = ref_max(q, k, 1 / math.sqrt(4), visible, 256)
        refs[s] = top.tolist()
        y, _ = mha(x, x, x, need_weights=False)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    assert mon.faults.total == 0, dict(mon.faults.counts)
    rows = keyed(read_family(mon.run_dir, "attn_logit"))
    assert {s for _, s, _ in rows} == {0, 1, 2}
    for (_, s, _), row in rows.items():
        got = np.array(json.loads(row["head_max_logit"]))
        np.testing.assert_allclose(got, refs[s], rtol=0, atol=8 * 24 * 2.0**-24 * bounds[s])


def test_attn_logit_eval_pass_does_no_site_work(tmp_path, monkeypatch):
    """The MHA site asks first: an evaluation pass computes no q/k projections (no positions sampled)."""
    import trainermon.adapters.attention as sites

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    calls = []
    real = sites.sample_positions
    monkeypatch.setattr(sites, "sample_positions", lambda *a: calls.append(a) or real(*a))
    cfg = write_config(tmp_path / "c.json", attn_logit_distribution={"enable": True}, ops=["max"])
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    opt = torch.optim.SGD(mha.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(mha, optimizer=opt, grad_acc_steps=1)
    x = torch.randn(2, 3, 8)
    for _ in range(2):
        mha.eval()
        with torch.no_grad():
            mha(x, x, x, need_weights=False)
        mha.train()
        mha(x, x, x, need_weights=False)[0].square().mean().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    assert mon.faults.total == 0, dict(mon.faults.counts)
    assert len(calls) == 2  # the training calls only
    assert {s for _, s, _ in keyed(read_family(mon.run_dir, "attn_logit"))} == {0, 1}


class AttnModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h = self.inp(x)
        return self.attn(h, h, h, need_weights=False)[0]


def _copysafe_entries(tmp_path, monkeypatch, arm: bool) -> tuple[int, int]:
    import torch._dynamo
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    from trainermon.copies import CopySafe
    from trainermon.runtime.probes import eval_pass

    if not arm:
        monkeypatch.setattr(eval_pass.GradForward, "arm", lambda self, roots, wanted: None)
    torch._dynamo.reset()
    counters.clear()
    cfg = write_config(tmp_path / "c.json", attn_logit_distribution={"enable": True}, ops=["max"])
    torch.manual_seed(0)
    model = AttnModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt, grad_acc_steps=1)
    fn = torch.compile(model, backend="eager")
    x = torch.randn(2, 3, 8)
    for _ in range(2):
        fn(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    entries = len(_debug_get_cache_entry_list(CopySafe.__call__.__code__))
    return entries, counters["stats"]["unique_graphs"]


def test_root_hooks_leave_copysafe_cache_alone(tmp_path, monkeypatch):
    """GradForward's root hooks have a code object of their own: they add no dynamo cache entries to the
    one every CopySafe-wrapped hook shares (which hit `recompile_limit`), and no graphs."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    with monkeypatch.context() as m:
        want = _copysafe_entries(tmp_path, m, arm=False)
    assert _copysafe_entries(tmp_path, monkeypatch, arm=True) == want


def test_compiled_fullgraph_eval_pass_with_attn_logit(tmp_path, monkeypatch):
    """An evaluation pass through a model compiled with fullgraph=True on a collected step: the eval-pass
    notice was logged inside dynamo's trace, which fullgraph refuses (Unsupported: logging.Logger)."""
    import torch._dynamo

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(tmp_path / "c.json", attn_logit_distribution=True, ops=["norm"])

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.att = torch.nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.att(x, x, x, need_weights=False)[0]

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    torch._dynamo.reset()
    try:
        run = torch.compile(model, backend="eager", fullgraph=True)
        for _ in range(2):
            run(torch.randn(2, 5, 8)).sum().backward()
            model.eval()
            with torch.no_grad():
                run(torch.randn(2, 5, 8))
            model.train()
            opt.step()
            opt.zero_grad()
    finally:
        torch._dynamo.reset()
    monitor.close()
    assert monitor.faults.total == 0, dict(monitor.faults.counts)
    rows = keyed(read_family(monitor.run_dir, "attn_logit"))
    assert sorted(step for (_, step, _) in rows) == [0, 1]
