"""The adapter registry imports a framework's adapter only in a process that imported the framework: its
objects cannot exist otherwise, and each unused adapter module costs ~0.1 MB of the job's memory."""

import json
import subprocess
import sys
import types

from trainermon.adapters import ADAPTERS, _candidates

PLAIN_RUN = """
import json, sys
import torch
from trainermon.adapters import select_adapter
model = torch.nn.Linear(2, 2)
adapter = select_adapter([model], torch.optim.SGD(model.parameters(), lr=0.1))
print(json.dumps({"name": adapter.name, "loaded": sorted(m for m in sys.modules if m.startswith(
    ("trainermon.adapters.megatron", "trainermon.adapters.deepspeed", "megatron", "deepspeed")))}))
"""


def test_a_plain_model_imports_no_framework_adapter():
    proc = subprocess.run([sys.executable, "-c", PLAIN_RUN], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"name": "torch", "loaded": []}


def test_an_imported_framework_makes_its_adapter_a_candidate(monkeypatch):
    for framework in ("megatron.core", "deepspeed"):
        monkeypatch.delitem(sys.modules, framework, raising=False)
    without = _candidates()
    assert "trainermon.adapters.torch_ddp:TorchAdapter" in without
    assert not any(dict(ADAPTERS)[spec] in ("megatron.core", "deepspeed") for spec in without)
    monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    assert "trainermon.adapters.megatron:MegatronAdapter" in _candidates()
    assert "trainermon.adapters.deepspeed:DeepSpeedAdapter" in _candidates()
