"""Megatron-Core PP2 on 2 gloo ranks: a target selects the same layers in every family.

Every stage's block names its layers `decoder.layers.0..1` (local ModuleList indices); rows carry global
numbers (stage 1 holds global layers 2 and 3). A target names a global layer, for activations as for
parameters: `decoder.layers.1` is stage 0's local layer 1 only, never stage 1's local layer 1 (global
layer 3), and on stage 1 it selects nothing, which is said in a warning. `0:decoder.layers.2` (the `vpp:`
form) is stage 1's local layer 0, and selects nothing on stage 0. The selected modules' actv/actv_grad
rows are checked, names and values, against the test's own hooks (`Recorder`, float64 statistics taken
while each tensor was live).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import pytest

from tests.distributed import run_ranks
from tests.helpers import read_family

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.adapters.test_megatron_pipeline import NAN_ROW, OPS, Recorder  # noqa: E402

TARGETS = ("decoder.layers.1", "0:decoder.layers.2")
#: The module each rank's targets select, by its single-process name (stage 0: global layers 0-1).
SELECTED = {0: "decoder.layers.1", 1: "decoder.layers.2"}


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _rank(rank: int, world: int, out_root: str) -> dict:
    from tests.megatron_gpt import Layout, micro_count, setup, single_process_name, train_step
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = out_root
    cfg = os.path.join(out_root, f"cfg{rank}.json")
    with open(cfg, "w") as fh:
        json.dump(
            {
                "targets": {t: {} for t in TARGETS},
                "xy_distribution": True,
                "wg_distribution": True,
                "ops": list(OPS),
                "ndigits": 12,
            },
            fh,
        )
    said = _Said()
    logging.getLogger("trainermon").addHandler(said)
    layout = Layout(pp=2)
    model, optimizer = setup(layout)
    # the reference's hooks first: a pre-hook that replaces an input registered after the monitor's leaves
    # out that module's first input-gradient rows (README, hook order)
    recorder = Recorder()
    recorder.attach(model)
    monitor = TrainerMon(cfg, params_have_main_grad=True)
    monitor.set_monitor(model, grad_acc_steps=micro_count(), optimizer=optimizer)
    for step in range(2):
        recorder.step, recorder.calls = step, {}
        train_step(model, optimizer, layout, step)
    monitor.close()
    root = model[0].module
    params = [single_process_name(root, 0, n) for n, p in root.named_parameters() if p.requires_grad]
    return {"run_dir": monitor.run_dir, "ref": recorder.rows, "said": said.messages, "params": params}


def test_targets_select_global_layers_in_every_family(tmp_path: Path) -> None:
    results = run_ranks(_rank, world_size=2, out_root=str(tmp_path))
    for rank, res in enumerate(results):
        module = SELECTED[rank]
        # the reference rows of the selected module itself (`{module}.input...`, `{module}.output_1`)
        want = {k: v for k, v in res["ref"].items() if k[2].rsplit(".", 1)[0] == module}
        assert want, f"rank {rank}: the reference saw no tensor of {module}"
        got = {}
        for family in ("actv", "actv_grad"):
            for row in read_family(res["run_dir"], family):
                key = (family, int(row["vpp_stage"]), row["name"], int(row["step"]), int(row["micro_step"]))
                got[key] = row
        assert {k[2] for k in got} == {k[2] for k in want}, (rank, sorted({k[2] for k in got}))
        assert set(got) == set(want), (
            f"rank {rank}: rows without a tensor or a row {sorted(set(got) ^ set(want))}"
        )
        for key, row in got.items():
            ref = want[key]
            if ref is NAN_ROW or ref == NAN_ROW:
                assert all(row[op] == "nan" for op in OPS), (key, row)
                continue
            for op in OPS:
                value, expected = float(row[op]), ref[op]
                tol = 1e-5 * abs(expected) + 1e-7 * ref["norm"] + 1e-12
                assert abs(value - expected) <= tol, (rank, key, op, value, expected)
        # the parameters: the same layer, by the same targets
        grads = {row["name"] for row in read_family(res["run_dir"], "grad_reduced")}
        assert grads == {n for n in res["params"] if n.startswith(module + ".")}, (rank, sorted(grads))
    # a stage without the target's layer: the target selects nothing there, and that is said (there only)
    for rank, absent in ((0, TARGETS[1]), (1, TARGETS[0])):
        nothing = [m for m in results[rank]["said"] if "selects nothing" in m]
        assert len(nothing) == 1 and f"{absent!r} selects nothing on this rank" in nothing[0], (rank, nothing)
        assert "may name another stage's" in nothing[0]  # not worded as a typo
