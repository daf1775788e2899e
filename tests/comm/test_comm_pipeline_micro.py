"""cc_distribution's micro_step under a pipeline schedule: Megatron-Core PP 2 x TP 2 (1F1B, 4 micro-batches)
on 4 gloo ranks. A stage receives micro-batch k's input before forward k starts and runs backward k after
later forwards (stage 0: backward 0 after forward 1), so labelling a collective with the latest forward
filed stage 1's received activations and stage 0's received gradients one micro-step early or late, and
backward's tensor-parallel all-reduces under later micro-steps. Reference: the test's own hooks on stage
0's model chunk, the output of each forward (what it sends) and that output's gradient (what it receives),
numbered by forward call; each of the four p2p rows must match per micro-step: what stage 0 sends for k
is what stage 1 receives for k, and the other way round for gradients. Every micro-batch runs the same
layers: its tensor-parallel all-reduces (forward and backward) are as many."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.distributed import run_ranks
from tests.helpers import read_family

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

STEPS = 2


def _run(rank: int, world: int, out_root: str) -> dict:
    import torch

    from tests.megatron_gpt import Layout, micro_count, setup, train_step
    from trainermon import TrainerMon

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "pp")
    cfg = os.path.join(out_root, f"pp-{rank}.json")
    with open(cfg, "w") as fh:
        json.dump({"cc_distribution": {"enable": True}, "ops": ["norm"], "ndigits": 12}, fh)
    from megatron.core import parallel_state

    layout = Layout(pp=2, tp=2)
    model, optimizer = setup(layout)
    monitor = TrainerMon(cfg, params_have_main_grad=True)
    monitor.set_monitor(model, grad_acc_steps=micro_count(), optimizer=optimizer)
    acts: dict[tuple[int, int], float] = {}  # (step, forward call) -> norm of the output it made
    grads: dict[tuple[int, int], float] = {}  # (step, forward call) -> norm of that output's gradient
    step_now = [0]

    def forward_hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        key = (step_now[0], sum(1 for s, _ in acts if s == step_now[0]))
        acts[key] = float(output.detach().double().norm())

        def grad_hook(grad: torch.Tensor) -> None:
            grads[key] = float(grad.double().norm())

        output.register_hook(grad_hook)

    first_stage = parallel_state.is_pipeline_first_stage()
    if first_stage:
        model[0].register_forward_hook(forward_hook)
    for step in range(STEPS):
        step_now[0] = step
        train_step(model, optimizer, layout, step)
    monitor.close()
    tp_ranks = torch.distributed.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    tp_group = "ranks" + "-".join(str(r) for r in tp_ranks)
    rows: dict[tuple, tuple[float, int]] = {}
    tp_calls: dict[tuple[int, int], int] = {}  # (step, micro_step) -> tensor-parallel all-reduces
    for row in read_family(monitor.run_dir, "comm"):
        op, _, rest = row["name"].split("/", 2)
        if op in ("batch_isend", "batch_irecv"):
            key = (op, int(row["step"]), int(row["micro_step"]))
            rows[key] = (float(row["norm"]), int(row["calls"]))
        elif op == "all_reduce" and row["name"].startswith(f"all_reduce/{tp_group}/"):
            key = (int(row["step"]), int(row["micro_step"]))
            tp_calls[key] = tp_calls.get(key, 0) + int(row["calls"])
    return {
        "rows": rows,
        "acts": acts,
        "grads": grads,
        "micro": micro_count(),
        "tp": tp_calls,
        "first": first_stage,
    }


def test_pipeline_p2p_rows_carry_their_micro_batch(tmp_path):
    results = run_ranks(_run, world_size=4, out_root=str(tmp_path))
    assert [r["first"] for r in results] == [True, True, False, False]  # stage = rank // 2, tp = rank % 2
    for first, last in ((results[0], results[2]), (results[1], results[3])):
        _check_pair(first, last)
    for res in results:
        got = res["tp"]
        assert sorted(got) == [(s, m) for s in range(STEPS) for m in range(res["micro"])], sorted(got)
        assert len(set(got.values())) == 1 and min(got.values()) > 0, got


def _check_pair(first: dict, last: dict) -> None:
    micro = first["micro"]
    assert micro == 4 and len(first["acts"]) == len(first["grads"]) == STEPS * micro
    checks = (  # (rank's rows, op, reference)
        (first["rows"], "batch_isend", first["acts"]),  # stage 0 sends forward k's output
        (last["rows"], "batch_irecv", first["acts"]),  # stage 1 receives it as forward k's input
        (last["rows"], "batch_isend", first["grads"]),  # stage 1 sends its input's gradient after backward k
        (first["rows"], "batch_irecv", first["grads"]),  # stage 0 receives it for backward k
    )
    for rows, op, ref in checks:
        got = {(s, m): v for (o, s, m), v in rows.items() if o == op}
        assert sorted(got) == sorted(ref), (op, sorted(got))
        for key, want in ref.items():
            norm, calls = got[key]
            # the same tensor's norm: float32 data, the row summed in float64 (a few ulps)
            assert calls == 1 and abs(norm - want) <= 1e-6 * want, (op, key, norm, calls, want)
