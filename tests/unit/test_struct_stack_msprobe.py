"""print_struct's module_struct.json and stack_info's stack_info.csv as msprobe 26.2 writes them: both tools
run the same tiny model (this file as a script, one process each) and the files are compared."""

from __future__ import annotations

import csv
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {
    "struct": {"print_struct": True, "xy_distribution": True, "ops": ["norm"]},
    "stack": {"stack_info": True, "xy_distribution": True, "targets": {"head": {}}, "ops": ["norm"]},
}


class Pair(nn.Module):
    """A non-tensor positional argument, a keyword tensor, and a tuple output with a nested tuple, None
    and an int in it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: int, bias: torch.Tensor | None = None) -> tuple:
        y = self.fc(x) * scale + bias
        return y, (y, y), None, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.pair = Pair()
        self.act = nn.ReLU(inplace=True)  # in place on pair's output: a full backward hook's view
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        y, _, _, _ = self.pair(h, 2, bias=h)
        out = self.head(self.act(y))
        out += 1  # in place on head's output, as residual code does
        return out


def main(tool: str, out: str, mode: str) -> None:
    os.environ["MONITOR_OUTPUT_DIR"] = out
    if tool == "msprobe":
        from msprobe.pytorch import TrainerMon
    else:
        from trainermon import TrainerMon
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    os.makedirs(out, exist_ok=True)
    cfg = os.path.join(out, "cfg.json")
    with open(cfg, "w") as fh:
        json.dump(CONFIGS[mode], fh)
    monitor = TrainerMon(cfg, params_have_main_grad=False)
    monitor.set_monitor(model, opt, grad_acc_steps=2)
    try:
        for _ in range(2):
            for _ in range(2):
                ids = torch.randint(0, 16, (2, 6))
                nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
            opt.step()
            opt.zero_grad()
    except (Exception, SystemExit) as exc:  # both stop the print_struct run after the first step
        print("stopped:", type(exc).__name__)
    if tool != "msprobe":
        monitor.close()


def _run(tmp_path, mode: str) -> dict[str, str]:
    pytest.importorskip("msprobe", reason="msprobe is the reference these files are compared with")
    outs = {}
    for tool in ("msprobe", "trainermon"):
        out = str(tmp_path / tool)
        cmd = [sys.executable, "-m", "tests.unit.test_struct_stack_msprobe", tool, out, mode]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
        outs[tool] = out
    return outs


def test_module_struct_json_is_msprobes(tmp_path):
    outs = _run(tmp_path, "struct")
    files = {
        t: glob.glob(os.path.join(o, "module_struct", "rank0", "module_struct.json")) for t, o in outs.items()
    }
    theirs = json.loads(Path(files["msprobe"][0]).read_text())
    ours = json.loads(Path(files["trainermon"][0]).read_text())
    assert list(ours) == list(theirs)  # every module, root `0:` too, in msprobe's order
    for name, entry in theirs.items():
        mine = dict(ours[name])
        assert mine.pop("class")  # trainermon's extra key, last
        assert list(mine.items()) == list(entry.items()), name
    # the gradients of the first backward are in (written after it), and the layout by hand:
    f32 = "size=(2, 6, 8), dtype=torch.float32"
    assert ours["0:pair"]["input"] == {"config": "list[2]", "0": f32, "1": f32}
    assert ours["0:pair"]["output"] == {
        "config": "tuple[4]",
        "0": f32,
        "1": "<class 'tuple'>",
        "2": "<class 'NoneType'>",
        "3": "<class 'int'>",
    }
    assert ours["0:head"]["output_grad"] == {
        "config": "tuple[1]",
        "0": "size=(2, 6, 16), dtype=torch.float32",
    }
    assert ours["0:emb"]["input"] == {"config": "list[1]", "0": "size=(2, 6), dtype=torch.int64"}
    assert list(ours["0:head"]) == ["input", "output", "input_grad", "output_grad", "class"]
    assert ours["0:head"]["class"] == "Linear"


def _user_frames(stack: str) -> list[str]:
    frames = [f for f in stack.split(" \nFile ") if f]
    return [f.removeprefix("File ") for f in frames if os.path.abspath(__file__) in f]


def test_stack_info_csv_is_msprobes(tmp_path):
    outs = _run(tmp_path, "stack")
    rows = {}
    for tool, out in outs.items():
        (path,) = glob.glob(os.path.join(out, "*", "stack_info.csv"))
        with open(path, encoding="utf-8", newline="") as fh:
            rows[tool] = list(csv.reader(fh))
    theirs, ours = rows["msprobe"], rows["trainermon"]
    assert ours[0] == theirs[0] == ["module_name", "stack_info"]
    # every module (not only the target `head`), msprobe's names, in forward order
    assert [r[0] for r in ours[1:]] == [r[0] for r in theirs[1:]]
    assert {r[0] for r in ours[1:]} == {"0:emb", "0:pair.fc", "0:pair", "0:act", "0:head", "0:"}
    for mine, ref in zip(ours[1:], theirs[1:]):
        assert _user_frames(mine[1]) and _user_frames(mine[1]) == _user_frames(ref[1]), mine[0]
        # innermost first: the frame that calls the module, then the frames around it
        assert mine[1].startswith("File ") and mine[1].endswith(" \n")
    head = dict(ours[1:])["0:head"]
    assert "in forward, \n out = self.head(self.act(y)) \n" in head


def test_print_struct_step_keeps_gradients_with_in_place_ops(tmp_path, monkeypatch):
    """Full backward hooks on every module, with in-place ops after them: the step runs, its gradients are
    those of an unmonitored copy, and torch's BackwardHook is itself again once the run stops."""
    import copy

    from torch.utils.hooks import BackwardHook

    from trainermon import PrintStructDone, TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    setups = (BackwardHook.setup_input_hook, BackwardHook.setup_output_hook)
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"print_struct": True}))
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 16, (2, 6))
    (ref(ids) ** 2).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    TrainerMon(str(cfg)).set_monitor(model, opt)
    (model(ids) ** 2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    with pytest.raises(PrintStructDone):
        opt.step()
    assert (BackwardHook.setup_input_hook, BackwardHook.setup_output_hook) == setups
    struct = json.loads((tmp_path / "out" / "module_struct" / "rank0" / "module_struct.json").read_text())
    assert struct["0:act"]["output_grad"] == {
        "config": "tuple[1]",
        "0": "size=(2, 6, 8), dtype=torch.float32",
    }


if __name__ == "__main__":
    main(*sys.argv[1:4])
