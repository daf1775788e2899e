"""cc_distribution's micro_step under Megatron-Core's virtual pipeline (PP 2 x VPP 2, 4 micro-batches, 2 gloo
ranks): a collective made inside a chunk's forward belongs to that chunk's micro-batch. The last chunk
computes each micro-batch's loss with `vocab_parallel_cross_entropy`, whose first all-reduce (MAX over the
tensor-parallel group) takes the logits' maximum over the vocabulary: per micro_step k exactly one call,
whose input is the maximum of the logits the test's own hook saw in that chunk's k-th forward (numbered
by the hook's calls). Counting only the first chunk's forwards filed the four losses under one label."""

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

    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_root, "vpp")
    cfg = os.path.join(out_root, f"vpp-{rank}.json")
    with open(cfg, "w") as fh:
        json.dump(
            {"cc_distribution": {"enable": True, "cc_pre_hook": True}, "ops": ["norm"], "ndigits": 12}, fh
        )
    layout = Layout(pp=2, vpp=2)
    model, optimizer = setup(layout)
    monitor = TrainerMon(cfg, params_have_main_grad=True)
    monitor.set_monitor(model, grad_acc_steps=micro_count(), optimizer=optimizer)
    maxima: dict[tuple[int, int], float] = {}  # (step, forward call) -> norm of the logits' max over vocab
    step_now = [0]

    def logits_hook(module: torch.nn.Module, args: tuple, output: tuple) -> None:
        logits = output[0] if isinstance(output, tuple) else output
        key = (step_now[0], sum(1 for s, _ in maxima if s == step_now[0]))
        maxima[key] = float(logits.detach().double().max(dim=-1)[0].norm())

    hooked = 0
    for chunk in model:
        for name, module in chunk.named_modules():
            if name.endswith("output_layer"):
                module.register_forward_hook(logits_hook)
                hooked += 1
    for step in range(STEPS):
        step_now[0] = step
        train_step(model, optimizer, layout, step)
    monitor.close()
    rows: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for row in read_family(monitor.run_dir, "comm"):
        if (
            "cross_entropy.py" in row["name"]
            and row["name"].startswith("all_reduce/")
            and "/input@" in row["name"]
        ):
            rows.setdefault((int(row["step"]), int(row["micro_step"])), []).append(
                (int(row["calls"]), float(row["norm"]))
            )
    return {"maxima": maxima, "rows": rows, "hooked": hooked, "micro": micro_count()}


def test_virtual_pipeline_losses_under_their_micro_step(tmp_path):
    results = run_ranks(_run, world_size=2, out_root=str(tmp_path))
    last = [r for r in results if r["hooked"]]
    assert len(last) == 1 and last[0]["micro"] == 4
    res = last[0]
    assert sorted(res["maxima"]) == [(s, k) for s in range(STEPS) for k in range(4)]
    wanted = res["maxima"]
    # the maximum's all-reduce: the row among the site's rows whose norm is the logits' maximum
    assert sorted(res["rows"]) == sorted(wanted), sorted(res["rows"])
    for key, want in wanted.items():
        hits = [(calls, norm) for calls, norm in res["rows"][key] if abs(norm - want) <= 1e-6 * want]
        assert len(hits) == 1 and hits[0][0] == 1, (key, res["rows"][key], want)
