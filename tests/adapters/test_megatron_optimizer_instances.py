"""Megatron-Core's partial distributed optimizer (`num_distributed_optimizer_instances=2`) on 4 gloo ranks.

Data parallel 4 split into two optimizer instances of 2 ranks: each instance shards the optimizer over
its own 2 ranks, and Megatron all-reduces each gradient shard over the instances, which then step the
same state. The tiny GPTModel of tests/megatron_gpt.py (dense, and MoE with expert parallelism 2) trains
2 steps with Megatron's own schedule. The output must hold every optimizer-side row (grad_reduced,
exp_avg, exp_avg_sq, param_updated) once over all ranks, with the full tensor's statistics against full
tensors the test gathers itself (each instance's shards placed by their ranges:
tests/megatron_gpt_reference.py), and the gradient norm counted once: the rows' sum of squares and the
monitor's own global norm equal the norm `optimizer.step()` returns. The same when set_monitor gets the
plain modules inside Megatron's DDP wrappers (the inter-instance group from parallel_state), and a warning
when neither names it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections import Counter

import pytest

from tests.distributed import run_ranks
from tests.helpers import read_family

if importlib.util.find_spec("megatron") is None:  # the workers import it; this process does not
    pytest.skip("megatron-core is not installed", allow_module_level=True)

OPS = ("norm", "mean", "min", "max")
STEPS = 2
FAMILIES = {
    "grad_reduced": "grad",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "param_updated": "param",
}


def _stub_cuda_streams() -> None:
    """With more than one instance Megatron's DDP opens a CUDA stream for the inter-instance all-reduce
    and runs it inside `torch.cuda.stream(...)`; on this CPU host there is none. The collectives run
    synchronously on gloo, so a stream that does nothing keeps Megatron's own code path."""
    import contextlib
    import types

    import torch

    stream = types.SimpleNamespace(wait_stream=lambda *a, **k: None, synchronize=lambda: None)
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.default_stream = lambda *a, **k: stream
    torch.cuda.current_stream = lambda *a, **k: stream


def _warnings_without_inter_group(optimizer) -> tuple[list[str], int]:
    """instance_copies with no DDP wrapper and parallel_state's inter-instance group hidden: its warnings."""
    import logging

    from megatron.core import parallel_state as ps

    from trainermon.adapters.megatron.optimizer import instance_copies

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("trainermon")
    getter = ps.get_inter_distributed_optimizer_instance_group
    ps.get_inter_distributed_optimizer_instance_group = lambda check_initialized=True: None
    logger.addHandler(handler)
    try:
        copies = instance_copies([], optimizer)
    finally:
        logger.removeHandler(handler)
        ps.get_inter_distributed_optimizer_instance_group = getter
    return records, len(copies)


def _train(rank: int, world: int, out_root: str, keys: dict, plain: bool) -> dict:
    from tests.helpers import ref_stats
    from tests.megatron_gpt import Layout, full_optimizer_tensors, setup, train_step
    from trainermon import TrainerMon

    _stub_cuda_streams()
    os.environ["MONITOR_OUTPUT_DIR"] = out_root
    cfg = os.path.join(out_root, f"rank{rank}.json")
    with open(cfg, "w") as fh:
        body = {"wg_distribution": True, "mv_distribution": True, "param_distribution": True}
        json.dump({**body, "ops": list(OPS), "ndigits": 12}, fh)
    # a clip far above the norm: Megatron still computes the norm, and leaves the gradients as they are
    layout = Layout(dist_opt=True, instances=2, clip=1e9, **keys)
    model, optimizer = setup(layout)
    monitor = TrainerMon(cfg, params_have_main_grad=True)
    # plain: the modules inside Megatron's DDP wrappers, which hold the inter-instance group no more
    monitor.set_monitor(
        [ddp.module for ddp in model] if plain else model, grad_acc_steps=2, optimizer=optimizer
    )
    refs: dict[tuple, dict] = {}
    norms, derived = [], []
    for step in range(STEPS):
        _, grad_norm = train_step(model, optimizer, layout, step)
        norms.append(grad_norm)
        # gathered by the test over this rank's instance (its optimizer's data-parallel group)
        for name, tensors in full_optimizer_tensors(model, optimizer).items():
            for family, key in FAMILIES.items():
                refs[(family, name, step)] = ref_stats(tensors[key])
        monitor.flush()
        batch = monitor.last_batch
        derived.append(None if batch is None else batch.derived.global_grad_norm)
    monitor.close()
    warned = _warnings_without_inter_group(optimizer) if plain else None
    return {"run_dir": monitor.run_dir, "refs": refs, "norms": norms, "derived": derived, "warned": warned}


def _close(got: float, want: float, scale: float) -> bool:
    # float64 merges of float32 partials; the 12-digit CSV rounds at 1e-12 relative
    return abs(got - want) <= 1e-5 * abs(want) + 1e-6 * scale + 1e-12


# dense: DP4 as 2 instances of 2; MoE: expert parallel 2, expert data parallel 2 as 2 instances of 1
# dense-plain: set_monitor given the modules inside the DDP wrappers
@pytest.mark.parametrize(
    ("keys", "plain"),
    [({}, False), ({"experts": 4, "ep": 2}, False), ({}, True)],
    ids=["dense", "moe-ep2", "dense-plain"],
)
def test_partial_distributed_optimizer_rows_once_and_exact(tmp_path, keys: dict, plain: bool) -> None:
    results = run_ranks(_train, world_size=4, timeout=600, out_root=str(tmp_path), keys=keys, plain=plain)
    refs = {key: ref for res in results for key, ref in res["refs"].items()}  # experts: their EP ranks'
    # the premise: both instances hold the same full state (rank 2 is the first rank of instance 1)
    for key, ref in refs.items():
        for other in [res for res in results if key in res["refs"]]:
            assert all(_close(other["refs"][key][op], ref[op], ref["norm"]) for op in OPS), key
    wrong = []
    for family in FAMILIES:
        rows = [row for res in results for row in read_family(res["run_dir"], family)]
        writers = Counter((row["name"], int(row["step"])) for row in rows)
        twice = sorted(k for k, n in writers.items() if n > 1)
        assert not twice, f"{family}: {len(twice)} rows written by more than one rank, e.g. {twice[:3]}"
        expected = {(n, s) for (f, n, s) in refs if f == family}
        assert set(writers) == expected, (family, sorted(expected ^ set(writers))[:5])
        for row in rows:
            ref = refs[(family, row["name"], int(row["step"]))]
            numel = math.prod(json.loads(row["shape"]))
            for op in OPS:
                if not _close(float(row[op]), ref[op], ref["norm"] / math.sqrt(numel)):
                    wrong.append((family, row["name"], row["step"], op, row[op], ref[op]))
    assert not wrong, f"{len(wrong)} wrong values, e.g. {wrong[:5]}"
    grad_rows = [row for res in results for row in read_family(res["run_dir"], "grad_reduced")]
    for step in range(STEPS):
        megatron_norm = results[0]["norms"][step]
        assert all(abs(r["norms"][step] - megatron_norm) <= 1e-6 * megatron_norm for r in results)
        sumsq = sum(float(row["norm"]) ** 2 for row in grad_rows if int(row["step"]) == step)
        assert abs(math.sqrt(sumsq) - megatron_norm) <= 1e-5 * megatron_norm, (step, sumsq, megatron_norm)
        # the global norm on rank 0 (the writer under data parallelism; the job's norm under EP)
        got = results[0]["derived"][step]
        assert got is not None and abs(got - megatron_norm) <= 1e-5 * megatron_norm, (step, got)
    if plain:  # neither the wrappers nor parallel_state name the group: one warning a rank, no copies
        for res in results:
            records, copies = res["warned"]
            assert copies == 0 and len(records) == 1 and "each instance" in records[0], records
