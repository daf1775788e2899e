"""Shared by the test_attn_logit*.py modules: explicit-logit references and a monitored MHA run."""

from __future__ import annotations

import math

import torch

from tests.helpers import write_config
from trainermon import TrainerMon

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
