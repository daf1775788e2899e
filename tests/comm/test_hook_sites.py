"""Call sites of collectives issued from torch's Future callbacks (DDP's PowerSGD hook issues its P and Q
all-reduces from `fut.then` callbacks). Such a callback runs inline on the thread that registered it when
the future is done already, else on the thread that completes it (gloo's or NCCL's own, or one calling
`set_result`): the site used to follow the thread (the user's backward line, or the hook's frame), so the
same all-reduce had different rows on different ranks and steps, and the communication checks compared
unlike calls (false AnomalyComm). It is now the callback's own frame on every thread; the sites of DDP's
default all-reduce and of the fp16 compression hook (the user's backward line) are as they were."""

from __future__ import annotations

import copy
import json
import os
import sys
import threading

import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import read_family

OPS = ["norm", "mean", "min", "max"]
STEPS = 4


def _torch_hook() -> tuple:
    """A hook whose frames lie in torch's DDP hooks folder: its body asks for a collective's call site, and
    so does the callback it chains (as PowerSGD's compute_qs)."""
    from trainermon.comm.sites import call_site

    folder = os.path.join(os.path.dirname(torch.__file__), "distributed", "algorithms", "ddp_comm_hooks")
    path = os.path.join(folder, "_probe_hook.py")
    text = (
        "def hook(fut):\n"
        "    def compute(fut):\n"
        "        return call_site(1)\n"
        "    return call_site(1), fut.then(compute)\n"
    )
    space = {"call_site": call_site}
    exec(compile(text, path, "exec"), space)  # noqa: S102 - functions whose frames lie in torch's folder
    return space["hook"], f"{path}:3(compute)"


def test_hook_callback_site_is_the_same_on_every_thread():
    hook, want = _torch_hook()
    done = torch.futures.Future()
    done.set_result(1)
    line = sys._getframe().f_lineno + 1
    body, inline = hook(done)  # done already: the callback runs here, under this test's frame
    pending = torch.futures.Future()
    _, chained = hook(pending)
    worker = threading.Thread(target=pending.set_result, args=(1,))  # completed, and run, on another thread
    worker.start()
    worker.join()
    assert (inline.wait(), chained.wait()) == (want, want)
    # the hook's own body (as fp16_compress_hook's all-reduce): the user's line, as before
    assert body == f"{__file__}:{line}(test_hook_callback_site_is_the_same_on_every_thread)", body


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * rank + step))


def _job(rank: int, world: int, out: str) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainermon import TrainerMon

    res = {}
    for hook in ("none", "fp16", "powersgd"):
        os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(out, hook)
        cfg = os.path.join(out, f"{hook}-{rank}.json")
        with open(cfg, "w") as fh:
            cc = {"enable": True, "cc_pre_hook": True}  # input rows: written when each call is made
            json.dump({"cc_distribution": cc, "ops": OPS, "ndigits": 12}, fh)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
        reference = copy.deepcopy(model)
        ddp = DDP(model, bucket_cap_mb=25)  # one bucket
        if hook == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        mon = TrainerMon(cfg)
        mon.set_monitor(ddp, grad_acc_steps=1, optimizer=opt)
        means = []
        for step in range(STEPS):
            reference.load_state_dict(model.state_dict())
            reference.zero_grad()
            for r in range(world):  # the averaged gradient, from every rank's known data
                (reference(_x(r, step)).double().pow(2).mean() / world).backward()
            means.append(float(torch.cat([p.grad.flatten() for p in reference.parameters()]).norm()))
            line = sys._getframe().f_lineno + 1
            ddp(_x(rank, step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        probe = mon.loop.probes[-1]
        mon.close()
        res[hook] = {
            "rows": read_family(mon.run_dir, "comm"),
            "means": means,
            "line": line,
            "violations": len(probe.violations),
        }
    return res


def test_ddp_hook_sites_agree_across_ranks_and_steps(tmp_path):
    runs = run_ranks(_job, world_size=2, timeout=400, out=str(tmp_path))
    hooks = "ddp_comm_hooks/powerSGD_hook.py:"
    callbacks = {hooks + "585(unpack_uncompressed_tensors_and_allreduce_ps)", hooks + "607(compute_qs)"}
    for hook in ("none", "fp16", "powersgd"):
        by_rank = [run[hook] for run in runs]
        user = f"comm/test_hook_sites.py:{by_rank[0]['line']}(_job)"
        for rank, res in enumerate(by_rank):
            for row in res["rows"]:  # one call a step from the user's line: the hook's body (or DDP's)
                site = row["name"].split("@")[1]
                assert site == user or (hook == "powersgd" and site in callbacks), (hook, rank, row)
                assert site != user or row["calls"] == "1", (hook, rank, row)
        names = [{(int(r["step"]), r["name"]) for r in res["rows"]} for res in by_rank]
        assert names[0] == names[1], (hook, sorted(names[0] ^ names[1]))  # the same rows on every rank
        if hook == "powersgd":
            continue  # its P/Q values: tests/comm/test_powersgd_rows.py
        assert by_rank[0]["violations"] == by_rank[1]["violations"] == 0, hook
        for step in range(STEPS):  # one all-reduce of the whole bucket: the averaged gradient
            out = [r for r in by_rank[0]["rows"] if int(r["step"]) == step and "/output@" in r["name"]]
            want = by_rank[0]["means"][step]
            tol = 2e-3 if hook == "fp16" else 1e-5
            assert len(out) == 1 and abs(float(out[0]["norm"]) - want) <= tol * want, (hook, step, out)
