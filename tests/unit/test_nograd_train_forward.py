"""A forward without grad in train mode (targets, pseudo-labels, an EMA teacher run through the same model)
is not a micro-batch: no actv rows, no micro-step, and the real micro-batches keep their numbers.

Before the fix such a call was taken for the first pass of reentrant checkpointing: with grad_acc_steps=3
and a `torch.no_grad()` pass after micro-batch 1, `2.output` had micro-steps 0..3, micro-step 2 the no_grad
pass (its [5, 1] shape), the third real micro-batch at 3 in actv and actv_grad. Reentrant checkpointing
inside the model (its first pass runs without grad, inside a forward begun with grad) keeps its rows.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.helpers import assert_row_matches, keyed, read_family, ref_stats, write_config
from trainermon import TrainerMon

OPS = ("norm", "min", "max", "mean")
ACC = 3


class Net(nn.Module):
    """inp -> block (Linear, Tanh; checkpointed with use_reentrant=True when `reentrant`) -> head."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = checkpoint(self.block, h, use_reentrant=True) if self.reentrant else self.block(h)
        return self.head(h)


def _reference(model: Net, batches: list[torch.Tensor]) -> tuple[dict, dict]:
    """Per (name, micro_step): float64 stats of each module's input and output and of their gradients,
    from a plain copy of the model (no monitor, no checkpointing) with grad kept on every tensor."""
    ref = copy.deepcopy(model)
    ref.reentrant = False
    actv, grad = {}, {}
    for micro, x in enumerate(batches):
        x = x.clone().requires_grad_(True)
        h0 = ref.inp(x)
        h1 = ref.block[0](h0)
        h2 = ref.block[1](h1)
        out = ref.head(h2)
        named = {
            "inp.input": x, "inp.output": h0,
            "block.input": h0, "block.output": h2,
            "block.0.input": h0, "block.0.output": h1,
            "block.1.input": h1, "block.1.output": h2,
            "head.input": h2, "head.output": out,
        }  # fmt: skip
        grads = torch.autograd.grad(out.square().mean(), list(named.values()))
        for (name, t), g in zip(named.items(), grads):
            actv[(name, micro)] = {**ref_stats(t), "shape": list(t.shape)}
            grad[(name, micro)] = {**ref_stats(g), "shape": list(g.shape)}
    return actv, grad


def _run(
    tmp_path, reentrant: bool, nograd_after: tuple[int, ...], outside: bool = False
) -> tuple[dict, dict, list]:
    """Two steps of grad_acc_steps=3; a no_grad forward of 5 rows in train mode after each micro-batch
    index in `nograd_after` (-1: before the first); `outside`: each training forward is the whole model
    checkpointed from outside, reentrant. Returns rows and the references of each step."""
    cfg = write_config(
        tmp_path / f"c{reentrant}{outside}.json", xy_distribution=True, all_xy=True, ops=list(OPS)
    )
    torch.manual_seed(0)
    model = Net(reentrant).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, grad_acc_steps=ACC, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    refs = []
    for _ in range(2):
        batches = [torch.randn(8, 4, generator=gen) for _ in range(ACC)]
        refs.append(_reference(model, batches))
        for micro, x in enumerate([None, *batches]):
            if x is not None:
                # reentrant checkpointing needs an input that requires grad (else no gradient flows)
                out = checkpoint(model, x.requires_grad_(True), use_reentrant=True) if outside else model(x)
                out.square().mean().backward()
            if micro - 1 in nograd_after:
                with torch.no_grad():
                    model(torch.randn(5, 4, generator=gen))  # a teacher / pseudo-label pass, train mode
        opt.step()
        opt.zero_grad()
    monitor.close()
    return keyed(read_family(monitor.run_dir, "actv")), keyed(read_family(monitor.run_dir, "actv_grad")), refs


# the no_grad pass through a reentrant checkpoint: torch warns that no input requires grad
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")


@pytest.mark.parametrize("reentrant,outside", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("nograd_after", [(1,), (-1, 0, 2)])
def test_nograd_train_forward_is_not_a_micro_batch(tmp_path, out_dir, reentrant, outside, nograd_after):
    """`outside`: the whole model checkpointed from outside runs its first pass without grad, as a no_grad
    pass does; backward's recompute tells them apart, and the recompute writes the micro-batch's rows."""
    actv, grad, refs = _run(tmp_path, reentrant, nograd_after, outside)
    for got, family in ((actv, 0), (grad, 1)):
        want_keys = {(name, step, micro) for step, ref in enumerate(refs) for name, micro in ref[family]}
        if family == 1 and not outside:  # the model's input takes no gradient: no row
            want_keys = {k for k in want_keys if k[0] != "inp.input"}
        assert set(got) == want_keys, sorted(set(got) ^ want_keys)
        for name, step, micro in want_keys:
            row = got[(name, step, micro)]
            want = refs[step][family][(name, micro)]
            assert json.loads(row["shape"]) == want["shape"], (name, step, micro)  # a real micro-batch's
            assert_row_matches(row, refs[step][family][(name, micro)], OPS)


def test_reentrant_checkpointing_numbers_as_a_plain_run(tmp_path, out_dir):
    """With a no_grad pass in the middle, the checkpointed model's rows equal the plain model's, key for
    key (the first pass inside the forward begun with grad keeps its micro-step)."""
    plain = _run(tmp_path, False, (1,))
    ckpt = _run(tmp_path, True, (1,))
    for got, want in zip(ckpt[:2], plain[:2]):
        assert set(got) == set(want)
        assert {k[2] for k in got} == {0, 1, 2}
        for key, row in want.items():
            for op in OPS:
                assert float(got[key][op]) == pytest.approx(float(row[op]), rel=1e-6, abs=1e-7), (key, op)
