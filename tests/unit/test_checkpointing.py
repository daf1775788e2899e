"""actv and actv_grad under activation checkpointing: the same rows and values as without it.

Reentrant checkpointing runs the first forward without grad and recomputes it in backward; the rows of
modules inside the region must come out complete (actv_grad from the recomputed tensors) and once (no
second actv row from the recompute). The recompute repeats the same float32 operations on the same
inputs on CPU, so values agree to float32 rounding of the reduction (rel 1e-6 is far above it).

Which first forward a recomputed call repeats (`runtime/probes/recompute.py`): a module called twice in
one region, and one module called in several regions, nested or not. Matched last in, first out, the two
calls of a region swapped their actv_grad rows (the values differed by up to 2.5x).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.helpers import keyed, read_family, train_monitored, write_config
from trainermon import TrainerMon

OPS = ("norm", "min", "max", "mean")


class Block(nn.Module):
    """Calls its own `act` twice and the model's `shared` once: inside one checkpointed region a module
    may run several times (recomputed in forward order), and one module may run in several regions
    (recomputed last region first)."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.act = nn.Tanh()
        object.__setattr__(self, "shared", shared)  # not a submodule: named once, as the model's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        return self.act(self.fc2(h)) + self.shared(h * 2) + x


class Net(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(4, 8)
        self.shared = nn.Sigmoid()
        self.blocks = nn.ModuleList([Block(self.shared), Block(self.shared)])
        self.head = nn.Linear(8, 2)

    def _blocks(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.mode == "none":
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.mode != "non_reentrant")
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.mode == "nested":  # one reentrant region around the blocks' own
            h = checkpoint(self._blocks, h, use_reentrant=True)
        else:
            h = self._blocks(h)
        return self.head(h)


def _rows(tmp_path, mode: str, training: bool = True) -> tuple[dict, dict]:
    cfg = write_config(tmp_path / f"{mode}.json", xy_distribution=True, all_xy=True, ops=list(OPS))
    torch.manual_seed(0)
    model = Net(mode).train(training)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(cfg)
    monitor.set_monitor(model, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for _ in range(2):  # two micro-steps: each recompute belongs to its own micro-step
            model(torch.randn(3, 4, generator=gen)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return keyed(read_family(monitor.run_dir, "actv")), keyed(read_family(monitor.run_dir, "actv_grad"))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "nested"])
def test_checkpointed_rows_equal_the_plain_run(tmp_path, out_dir, mode, training):
    """Also a model trained in eval mode (dropout off): a reentrant region's first pass runs without grad,
    which the hooks took for an evaluation pass (no rows of any module inside it)."""
    want_actv, want_grad = _rows(tmp_path, "none", training)
    got_actv, got_grad = _rows(tmp_path, mode, training)
    assert any(name.startswith("blocks.0.fc") for name, _, _ in want_grad)
    for got, want in ((got_actv, want_actv), (got_grad, want_grad)):
        assert set(got) == set(want)
        for key, row in want.items():
            for op in OPS:
                assert float(got[key][op]) == pytest.approx(float(row[op]), rel=1e-6, abs=1e-7), (key, op)


@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gpt2_gradient_checkpointing(tmp_path, out_dir, reentrant):
    """transformers 5.24 defaults to non-reentrant; older releases (and many users) pass reentrant."""
    transformers = pytest.importorskip("transformers")

    def run(checkpointing: bool) -> tuple[dict, dict]:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
        )
        config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
        model = transformers.GPT2LMHeadModel(config)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = write_config(
            tmp_path / f"g{checkpointing}.json", xy_distribution=True, all_xy=True, ops=list(OPS)
        )
        monitor = TrainerMon(cfg)
        monitor.set_monitor(model, optimizer=opt)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        monitor.close()
        return keyed(read_family(monitor.run_dir, "actv")), keyed(read_family(monitor.run_dir, "actv_grad"))

    want_actv, want_grad = run(False)
    got_actv, got_grad = run(True)
    assert any(".h.0." in name for name, _, _ in want_grad)
    for got, want in ((got_actv, want_actv), (got_grad, want_grad)):
        assert set(got) == set(want)
        for key, row in want.items():
            for op in OPS:
                # the recompute repeats the same kernels on the same inputs; rel 1e-5 covers float32
                # reduction-order differences between the two grad modes' kernels
                # (a None output is a NaN row in both runs)
                assert float(got[key][op]) == pytest.approx(
                    float(row[op]), rel=1e-5, abs=1e-6, nan_ok=True
                ), (key, op)


def test_a_recompute_that_runs_a_module_more_often_is_counted(tmp_path, out_dir):
    """A region whose recompute calls a module more often than its first pass did (here: a forward that
    depends on grad mode) has calls with no micro-step to repeat: their rows are not written, and that
    is logged once and counted; training goes on."""

    class GradModeDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act = nn.Linear(8, 8), nn.Tanh()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.act(self.fc(x))
            return self.act(h) if torch.is_grad_enabled() else h

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = GradModeDependent()

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, h, use_reentrant=True)

    model = nn.Sequential(nn.Linear(4, 8), Checkpointed(), nn.Linear(8, 2))
    cfg = write_config(tmp_path / "c.json", xy_distribution=True, ops=list(OPS))
    monitor = train_monitored(cfg, model, lambda: torch.randn(3, 4))
    assert monitor.loop.faults.counts == {"checkpoint recompute": 2}
    rows = keyed(read_family(monitor.run_dir, "actv_grad"))
    assert {key for key in rows if key[0] == "1.inner.act.output"} == {
        ("1.inner.act.output", s, 0) for s in (0, 1)
    }
