"""Cost of the training-health families (issue 25): `update_distribution` beside no monitor and beside
`param_distribution` (which reads the same parameters twice, without the copy), on the two workloads of
benchmarks/overhead.py; `moe_distribution` beside no monitor on (c), a small Mixtral;
`attn_logit_distribution` on (a) (torch MultiheadAttention, seq 256: every query position) and on (d), a
small Llama (transformers, sdpa) at seq 2048: default sample (256 query positions) and every position.

    python benchmarks/health_cost.py            # every workload and arm
    python benchmarks/health_cost.py --quick    # smoke run
    python benchmarks/health_cost.py --workloads a,d --arms none,attn,attn_all   # the attention arms

Method: the arms (none, param, update) each get their own model copy (same seed), AdamW and fixed batch,
attached for the whole run; after a warm-up step per arm they run in interleaved blocks (a fresh random
order per block), figures are medians over the timed steps (as benchmarks/overhead.py). Own time is the
monitor's time on the training thread (its entry points). `copy_mb` is what the update probe holds between
the optimizer's pre- and post-step hooks, measured by summing the bytes of its copies at the post hook;
peak RSS per arm is measured in a fresh subprocess (VmHWM, glibc mmap threshold pinned, 3 steps).
`hook_ms`: the attention sites' time per collected step (q/k handed over, the chunked logits; for
MultiheadAttention also its q/k recomputation), spent in forward hooks outside the monitor's entry points.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.overhead import OwnTimer, gpt_workload, many_workload, peak_rss_mb  # noqa: E402

OPS = ["norm", "min", "max", "mean"]
CONFIGS = {
    "none": None,
    "param": {"param_distribution": True},
    "update": {"update_distribution": True},
    "moe": {"moe_distribution": True},
    "attn": {"attn_logit_distribution": True},
    "attn_all": {"attn_logit_distribution": {"enable": True, "sample": 1 << 20}},
}
#: The arms of each workload: the update beside param on the dense models, moe_load on the MoE one,
#: attn_logit on the two with attention.
ARMS = {
    "a": ("none", "param", "update", "attn"),
    "b": ("none", "param", "update"),
    "c": ("none", "moe"),
    "d": ("none", "attn", "attn_all"),
}


def llama_workload(hidden: int = 128, layers: int = 4, seq: int = 2048, batch: int = 2):
    """(d) a small Llama from transformers' config (sdpa attention, 4 heads, 2 kv heads), long sequences."""
    from benchmarks.overhead import Workload

    def build() -> torch.nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=1024,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=seq,
        )
        config._attn_implementation = "sdpa"
        return _Logits(LlamaForCausalLM(config))

    def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(1))
        return ids, ids

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())

    return Workload(
        "d", f"Llama-like hidden={hidden} layers={layers} seq={seq} batch={batch}", build, make_batch, loss
    )


class _HookMeter:
    """Time spent in the attention sites' hooks (outside the monitor's timed entry points)."""

    def __init__(self) -> None:
        from trainermon.adapters import attention

        self.seconds = 0.0
        for cls, name in ((attention._MhaSite, "_observe"), (attention._HfSite, "observe_call")):
            setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def mixtral_workload(hidden: int = 128, layers: int = 4, experts: int = 8, seq: int = 128, batch: int = 4):
    """(c) a small Mixtral from transformers' config (never downloaded): top-2 of `experts` per layer."""
    from benchmarks.overhead import Workload

    def build() -> torch.nn.Module:
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=1024,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=experts,
            num_experts_per_tok=2,
            max_position_embeddings=seq,
        )
        return _Logits(MixtralForCausalLM(config))

    def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(1))
        return ids, ids

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())

    title = f"Mixtral-like hidden={hidden} layers={layers} experts={experts} top-2 seq={seq} batch={batch}"
    return Workload("c", title, build, make_batch, loss)


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def _workloads(quick: bool) -> dict[str, Any]:
    if quick:
        small = mixtral_workload(hidden=32, layers=2, experts=4, seq=32, batch=2)
        return {
            "a": gpt_workload(d=128, layers=2, vocab=1024, seq=64, batch=2),
            "b": many_workload(layers=8),
            "c": small,
            "d": llama_workload(hidden=32, layers=2, seq=512, batch=1),
        }
    return {"a": gpt_workload(), "b": many_workload(), "c": mixtral_workload(), "d": llama_workload()}


class _CopyMeter:
    """Bytes held by the update probe's copies when the post hook runs (the peak of what it keeps)."""

    def __init__(self) -> None:
        from trainermon.runtime.probes.update import UpdateProbe

        self.bytes: list[int] = []
        original = UpdateProbe.post_optim

        def post_optim(probe, plan):
            if probe._before is not None:
                self.bytes.append(sum(c.nbytes for x in probe._before if x is not None for c in (x[1],)))
            return original(probe, plan)

        UpdateProbe.post_optim = post_optim


def _arm(work, config: str, out_dir: str) -> dict[str, Any]:
    from trainermon import TrainerMon

    torch.manual_seed(0)
    model = work.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    arm = {
        "name": config,
        "model": model,
        "opt": opt,
        "batch": work.batch(),
        "times": [],
        "own": [],
        "hook": [],
    }
    if CONFIGS[config] is not None:
        path = os.path.join(out_dir, f"{config}.json")
        with open(path, "w") as fh:
            json.dump({**CONFIGS[config], "ops": OPS, "format": ["csv"]}, fh)
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out_dir, config)
        arm["monitor"] = TrainerMon(path)
        arm["monitor"].set_monitor(model, optimizer=opt)
        arm["timer"] = OwnTimer(arm["monitor"])
    arm["params"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return arm


def _step(arm: dict, loss) -> None:
    x, y = arm["batch"]
    timer = arm.get("timer")
    own0 = timer.total if timer else 0.0
    hook0 = HOOKS.seconds if HOOKS else 0.0
    t0 = time.perf_counter()
    loss(arm["model"](x), y).backward()
    arm["opt"].step()
    arm["opt"].zero_grad(set_to_none=True)
    arm["times"].append(time.perf_counter() - t0)
    arm["own"].append((timer.total - own0) if timer else 0.0)
    arm["hook"].append((HOOKS.seconds - hook0) if HOOKS else 0.0)


def rss_probe(key: str, config: str, quick: bool) -> float:
    work = _workloads(quick)[key]
    with tempfile.TemporaryDirectory(prefix="tm-health-") as out:
        arm = _arm(work, config, out)
        for _ in range(3):
            _step(arm, work.loss)
        if "monitor" in arm:
            arm["monitor"].close()
    return peak_rss_mb()


HOOKS: _HookMeter | None = None


def bench(key: str, work, blocks: int, steps: int, quick: bool, names: tuple[str, ...]) -> dict[str, Any]:
    meter = _CopyMeter()
    with tempfile.TemporaryDirectory(prefix="tm-health-") as out:
        arms = [_arm(work, c, out) for c in names]
        for arm in arms:
            _step(arm, work.loss)
            arm["times"].clear()
            arm["own"].clear()
        for _ in range(blocks):
            random.shuffle(arms)
            for arm in arms:
                for _ in range(steps):
                    _step(arm, work.loss)
        for arm in arms:
            if "monitor" in arm:
                arm["monitor"].close()
    by = {a["name"]: a for a in arms}
    base = statistics.median(by["none"]["times"])
    out: dict[str, Any] = {"title": work.title, "param_mb": by["none"]["params"] / 2**20, "arms": {}}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    for name, arm in by.items():
        med = statistics.median(arm["times"])
        rss = subprocess.run(
            [sys.executable, __file__, "--rss", key, name] + (["--quick"] if quick else []),
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        out["arms"][name] = {
            "median_step_ms": med * 1e3,
            "overhead_pct": (med / base - 1) * 100,
            "own_ms": statistics.median(arm["own"]) * 1e3,
            "hook_ms": statistics.median(arm["hook"]) * 1e3,
            "peak_rss_mb": float(rss.stdout.strip().splitlines()[-1]),
        }
    out["copy_mb"] = max(meter.bytes) / 2**20 if meter.bytes else 0.0
    return out


def attn_micro(reps: int = 15) -> list[dict[str, Any]]:
    """The logit computation alone (`head_extremes`, causal mask) against the attention it watches
    (`scaled_dot_product_attention`, causal, forward only) on the same q, k, v: medians of interleaved
    repetitions, so the ratio holds on a loaded machine."""
    from trainermon.runtime.attn_math import causal_keep, head_extremes, sample_positions

    out = []
    for b, h, s, d in ((8, 8, 256, 64), (2, 4, 2048, 32), (1, 8, 4096, 64)):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, generator=gen) for _ in range(3))
        keep = causal_keep(s, s, q.device)
        times: dict[str, list[float]] = {"sdpa": [], "sample256": [], "all": []}
        for _ in range(reps):
            for name in random.sample(list(times), len(times)):
                t0 = time.perf_counter()
                if name == "sdpa":
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                else:
                    pos = sample_positions(s, 256 if name == "sample256" else s, q.device)
                    head_extremes(q.index_select(2, pos), k, d**-0.5, keep, pos)
                times[name].append(time.perf_counter() - t0)
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        out.append({"shape": [b, h, s, d], **{f"{n}_ms": m for n, m in med.items()}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rss", nargs=2, metavar=("WORKLOAD", "CONFIG"))
    ap.add_argument("--json")
    ap.add_argument("--workloads", default="a,b,c,d", help="comma-separated workload keys")
    ap.add_argument("--arms", default="", help="comma-separated arms (default: every arm of a workload)")
    ap.add_argument("--attn-micro", action="store_true", help="only the logit computation vs sdpa")
    args = ap.parse_args()
    torch.set_num_threads(1)
    global HOOKS
    HOOKS = _HookMeter()
    if args.rss:
        print(rss_probe(args.rss[0], args.rss[1], args.quick))
        return
    if args.attn_micro:
        for r in attn_micro():
            print(
                f"  [B,H,S,D]={r['shape']}: sdpa forward {r['sdpa_ms']:8.2f} ms, logits sample 256 "
                f"{r['sample256_ms']:8.2f} ms, every position {r['all_ms']:8.2f} ms"
            )
        return
    blocks, steps = (2, 2) if args.quick else (6, 1)
    results = {}
    wanted = args.arms.split(",") if args.arms else None
    for key, work in _workloads(args.quick).items():
        names = tuple(a for a in ARMS[key] if wanted is None or a in wanted)
        if key not in args.workloads.split(",") or len(names) < 2 or names[0] != "none":
            continue
        results[key] = r = bench(key, work, blocks, 5 * steps if key == "b" else steps, args.quick, names)
        copy = f", update copy {r['copy_mb']:.1f} MB" if "update" in r["arms"] else ""
        print(f"({key}) {r['title']}: parameters {r['param_mb']:.1f} MB{copy}")
        for name, a in r["arms"].items():
            print(
                f"  {name:7s} step {a['median_step_ms']:9.1f} ms  overhead {a['overhead_pct']:+6.1f}%  "
                f"own {a['own_ms']:7.2f} ms  hooks {a['hook_ms']:7.2f} ms  "
                f"peak RSS {a['peak_rss_mb']:8.1f} MB"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
