"""Copies of a monitored model: `copy.deepcopy` (a reference model), `torch.optim.swa_utils.AveragedModel`
(EMA/SWA: it deep-copies its module), `torch.save(model)` of the whole module, and a deep-copied
optimizer. Each used to fail or to feed the monitored run: a copy drew the monitor's threads into
`deepcopy` (TypeError: cannot pickle '_thread.lock'), `torch.save` failed on the monitor's closures, and a
copy's `zero_grad()` cleared the monitored model's gradients. A copy is not monitored: the monitored model
keeps its rows, exact and no more of them, while copies run forward, backward, zero_grad and step."""

from __future__ import annotations

import copy
import io
import json

import torch

from tests.helpers import keyed, read_family, write_config
from trainermon import TrainerMon

EXPERTS = 4


class _Router(torch.nn.Module):  # a top-2 router the moe probe recognises (class name, num_experts)
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.gate = torch.nn.Linear(8, EXPERTS)

    def forward(self, x: torch.Tensor) -> tuple:
        weights, indices = torch.softmax(self.gate(x), -1).topk(2, dim=-1)
        return indices, weights


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.router = _Router()
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.attn(h, h, h, need_weights=False)[0]
        _, weights = self.router(h)
        return self.out(h).sum() + weights.sum()


class _Outputs(list):
    """A module's outputs, call by call (a copy of the model gets a copy of this list, and its own calls)."""

    def __call__(self, module, args, out) -> None:
        self.append((out[0] if isinstance(out, tuple) else out).detach().clone())


def _step(model, opt, x) -> None:
    model(x).backward()
    opt.step()
    opt.zero_grad()


def test_copies_are_not_monitored(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = write_config(
        tmp_path / "c.json",
        xy_distribution=True,
        wg_distribution=True,
        mv_distribution=True,
        moe_distribution=True,
        attn_logit_distribution=True,
        stack_info=True,
        ops=["norm", "max"],
    )
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = TrainerMon(cfg)
    mon.set_monitor(model, optimizer=opt, grad_acc_steps=1)
    x = torch.randn(2, 5, 8)
    routed, outputs = _Outputs(), _Outputs()  # the monitored model's own calls (the copies' must not count)
    model.router.register_forward_hook(routed)
    model.out.register_forward_hook(outputs)
    _step(model, opt, x)

    ema = torch.optim.swa_utils.AveragedModel(model)  # deep-copies the monitored model
    ref = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ref_opt = copy.deepcopy(opt)  # its own parameters; stepping it is not the monitored step

    for _ in range(3):
        model(x).backward()  # the monitored model's gradients, then the copies run in between
        grads = [p.grad.clone() for p in model.parameters()]
        for other in (ref, loaded, ema):
            other(x).backward()
            other.zero_grad()  # clears the copy's gradients only
        ref_opt.step()
        ema.update_parameters(model)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        assert all(p.grad is None for p in ref.parameters())
        opt.step()
        opt.zero_grad()
    # a copy's hooks remove themselves at their first call: a module with any hook left is off torch's fast
    # call path for good (an EMA copy kept 8 inert hooks); the users' own hooks (`_Outputs`) stay
    for other in (ref, loaded, ema):
        for name, mod in other.named_modules():
            if name.endswith("attn.out_proj"):
                continue  # never called (attention reads its weight): its hooks never run, cost nothing
            for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
                left = [h for h in getattr(mod, attr).values() if not isinstance(h, _Outputs)]
                assert not left, (type(other).__name__, type(mod).__name__, attr, left)
    assert len(model.out._forward_hooks) > 1  # the monitored model keeps the monitor's hooks and the user's
    mon.close()

    assert mon.faults.total == 0, mon.faults.counts
    actv = keyed(read_family(mon.run_dir, "actv"))
    steps = sorted({step for _, step, _ in actv})
    assert steps == [0, 1, 2, 3]  # the copied optimizer's steps are not the monitor's
    names = sorted({name for name, _, _ in actv})
    for name in names:
        assert all((name, s, 0) in actv for s in steps), name
    assert len(actv) == len(names) * 4  # one row per tensor and step: no copy's forward in them
    assert len(outputs) == len(routed) == 4
    for step, out in enumerate(outputs):  # the monitored model's values (the copies' parameters differ)
        want = torch.linalg.vector_norm(out).item()
        assert abs(float(actv[("out.output", step, 0)]["norm"]) - want) <= 1e-5 * want
    loads = {int(r["step"]): json.loads(r["expert_load"]) for r in read_family(mon.run_dir, "moe_load")}
    assert loads == {
        s: torch.bincount(routed[s].flatten(), minlength=EXPERTS).tolist() for s in range(4)
    }  # only the monitored model's routing
    logits = read_family(mon.run_dir, "attn_logit")
    assert sorted(int(r["step"]) for r in logits) == [0, 1, 2, 3]
