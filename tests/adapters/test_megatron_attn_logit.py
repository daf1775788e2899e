"""attn_logit on Megatron-Core's core attention (DotProductAttention, local spec), 2 gloo ranks on CPU.

Layouts of the same tiny GPTModel (tests/megatron_gpt.py, Megatron's own schedule, 2 micro-batches
per replica): dp2 (every rank all heads, different data), tp2 (heads split over tensor-parallel ranks),
tp2 + sequence parallelism with grouped-query attention (2 query groups, one per rank). For each:

- one attn_logit row per layer and step, written once, named as the single-process model names it;
- its per-head maxima equal an explicit float64 q.k^T * softmax_scale the test computes from the
  core attention's own inputs (its own pre-hook), masked keys excluded, max over micro-batches and over
  the data-parallel ranks; a tensor-parallel rank's heads placed at tp_rank x heads per rank (the test's
  all-gather over the tensor-parallel group);
- independently of that placement: the tp2 rows of the first step (same weights, same global batch)
  equal the dp2 rows head by head, so the monitor's global head indices are the single-process ones.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import read_family

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

STEPS = 2
LAYOUTS = (
    ("dp2", {}),
    ("tp2", {"tp": 2}),
    ("tp2-sp-gqa", {"tp": 2, "sp": True, "extra": {"num_query_groups": 2}}),
)


class _Reference:
    """Per core attention: the max over this rank's micro-batches of q.k^T * scale per local head, from the
    module's inputs, then gathered over tensor-parallel ranks (heads) and maxed over data-parallel ones."""

    def __init__(self, model: list) -> None:
        from tests.megatron_gpt import single_process_name

        self.tops: dict[str, list[torch.Tensor]] = {}
        self.bound: dict[str, float] = {}
        for vpp, chunk in enumerate(model):
            root = chunk.module
            for name, module in root.named_modules():
                if type(module).__name__ == "DotProductAttention":
                    full = single_process_name(root, vpp, f"{name}.x")[:-2]
                    module.register_forward_pre_hook(
                        lambda m, a, kw, n=full: self._add(n, m, a, kw), with_kwargs=True
                    )

    def _add(self, name: str, module, args: tuple, kwargs: dict) -> None:
        got = dict(zip(("query", "key", "value", "attention_mask"), args)) | kwargs
        q = got["query"].detach().double().permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = got["key"].detach().double().permute(1, 2, 0, 3)  # [b, ng, sk, hn]
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scale = float(module.softmax_scale)
        logits = (q @ k.transpose(-1, -2)) * scale
        masked = got["attention_mask"].expand_as(logits)  # Megatron: True = masked
        self.tops.setdefault(name, []).append(logits.masked_fill(masked, -np.inf).amax(dim=(0, 2, 3)))
        bound = float(((q.abs() @ k.abs().transpose(-1, -2)) * scale).max())
        self.bound[name] = max(self.bound.get(name, 0.0), bound)

    def start(self) -> None:
        self.tops = {}

    def finish(self) -> dict[str, dict]:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        out = {}
        tp, dp = mpu.get_tensor_model_parallel_group(), mpu.get_data_parallel_group()
        for name in sorted(self.tops):
            local = torch.stack(self.tops[name]).amax(0)
            pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(tp))]
            dist.all_gather(pieces, local, group=tp)
            heads = torch.cat(pieces)  # tensor-parallel rank r holds heads r * np .. (r + 1) * np - 1
            dist.all_reduce(heads, op=dist.ReduceOp.MAX, group=dp)
            bound = torch.tensor([self.bound[name]], dtype=torch.float64)
            dist.all_reduce(bound, op=dist.ReduceOp.MAX)
            out[name] = {"heads": heads.tolist(), "bound": float(bound)}
        return out


def _run(rank: int, world_size: int, out_root: str) -> dict:
    from tests.megatron_gpt import Layout, setup, train_step
    from trainermon import TrainerMon

    results = {}
    for tag, keys in LAYOUTS:
        out = os.path.join(out_root, tag)
        os.environ["MONITOR_OUTPUT_DIR"] = out
        cfg = os.path.join(out_root, f"{tag}-rank{rank}.json")
        with open(cfg, "w") as fh:
            json.dump({"attn_logit_distribution": True, "ops": ["max", "mean", "min"], "ndigits": 12}, fh)
        layout = Layout(clip=1e9, **keys)
        model, optimizer = setup(layout)
        monitor = TrainerMon(cfg, params_have_main_grad=True)
        monitor.set_monitor(model, grad_acc_steps=2, optimizer=optimizer)
        reference = _Reference(model)
        refs = {}
        for step in range(STEPS):
            reference.start()
            train_step(model, optimizer, layout, step)
            refs.update({f"{name}@{step}": ref for name, ref in reference.finish().items()})
        monitor.close()
        results[tag] = {"run_dir": monitor.run_dir, "refs": refs, "faults": dict(monitor.faults.counts)}
    return results


def test_megatron_core_attention_global_heads(tmp_path: Path) -> None:
    results = run_ranks(_run, world_size=2, timeout=900, out_root=str(tmp_path))
    first_step: dict[str, dict[str, list[float]]] = {}
    for tag, _ in LAYOUTS:
        assert all(res[tag]["faults"] == {} for res in results), (tag, [r[tag]["faults"] for r in results])
        refs = results[0][tag]["refs"]
        assert refs == results[1][tag]["refs"]  # the test's gathered reference, alike on both ranks
        rows = [row for res in results for row in read_family(res[tag]["run_dir"], "attn_logit")]
        writers = Counter(f"{row['name']}@{row['step']}" for row in rows)
        assert set(writers) == set(refs) and set(writers.values()) == {1}, (tag, writers, sorted(refs))
        assert len(refs) == 4 * STEPS and all("decoder.layers." in k for k in refs)
        for row in rows:
            key = f"{row['name']}@{row['step']}"
            ref = np.array(refs[key]["heads"])
            got = np.array(json.loads(row["head_max_logit"]))
            # float32 projections (hidden 32 terms) and dot products (8 terms) against float64
            tol = 8 * (32 + 8) * 2.0**-24 * refs[key]["bound"]
            assert got.shape == (4,), (tag, row)
            np.testing.assert_allclose(got, ref, rtol=0, atol=tol, err_msg=f"{tag} {key}")
            assert abs(float(row["max"]) - ref.max()) <= tol and int(row["max_head"]) == int(np.argmax(got))
            if row["step"] == "0":
                first_step.setdefault(tag, {})[row["name"]] = got.tolist()
    # the tp2 layout's global heads are the dp2 layout's (same weights and batch at the first step)
    assert set(first_step["tp2"]) == set(first_step["dp2"])
    for name, heads in first_step["dp2"].items():
        np.testing.assert_allclose(first_step["tp2"][name], heads, rtol=1e-4, atol=1e-6, err_msg=name)
