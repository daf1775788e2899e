"""Multi-node defects (audit d_nodes): the Prometheus port's local rank under mpirun inside sbatch, run
directory names on nodes in different timezones, the node's name in layout.json, and dynamic mode with
the config file on rank 0's node only (node-local disks), which hung rank 0 in set_monitor."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import datetime, timezone

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.helpers import keyed, read_family, ref_stats
from trainermon.config import read_env

LOCAL_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


@pytest.mark.parametrize(
    ("env", "want"),
    [
        # mpirun inside an sbatch job: the batch step's SLURM_LOCALID=0 is inherited by every rank
        ({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (1, "OMPI_COMM_WORLD_LOCAL_RANK")),
        ({"SLURM_LOCALID": "0", "MPI_LOCALRANKID": "3"}, (3, "MPI_LOCALRANKID")),
        ({"SLURM_LOCALID": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "LOCAL_RANK": "5"}, (5, "LOCAL_RANK")),
        ({"SLURM_LOCALID": "2"}, (2, "SLURM_LOCALID")),  # srun alone
    ],
)
def test_local_rank_order(monkeypatch: pytest.MonkeyPatch, env: dict, want: tuple) -> None:
    for name in LOCAL_VARS + ("MV2_COMM_WORLD_LOCAL_RANK",):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    got = read_env()
    assert (got.local_rank, got.local_rank_from) == want


_LAST: list = []  # the rank's last monitor (closed)


def _train(rank: int, config: str, out: str, steps: int = 2) -> dict:
    """A tiny model trained `steps` SGD steps (no gradient sync: each rank's gradients are its own),
    every gradient kept (clone, after backward) as the reference."""
    os.environ["MONITOR_OUTPUT_DIR"] = out
    from trainermon import TrainerMon

    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    handler = Keep()
    logging.getLogger("trainermon").addHandler(handler)
    try:
        before = time.time()
        monitor = TrainerMon(config)
        start = time.monotonic()
        monitor.set_monitor(model, optimizer=opt)
        attach_s = time.monotonic() - start
        after = time.time()
        grads: dict = {}
        for step in range(steps):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).sum().backward()
            for name, p in model.named_parameters():
                grads[(name, step)] = p.grad.detach().clone()
            opt.step()
            opt.zero_grad()
        monitor.close()
        _LAST[:] = [monitor]
    finally:
        logging.getLogger("trainermon").removeHandler(handler)
    with open(os.path.join(monitor.run_dir, "layout.json"), encoding="utf-8") as fh:
        layout = json.load(fh)
    rows = keyed(read_family(monitor.run_dir, "grad_unreduced"))
    return {
        "run_dir": os.path.basename(monitor.run_dir),
        "layout": layout,
        "host": socket.gethostname(),
        "window": (before, after),
        "attach_s": attach_s,
        "warnings": messages,
        "rows": {(k[0], k[1]): {"norm": float(v["norm"]), "max": float(v["max"])} for k, v in rows.items()},
        "want": {k: ref_stats(g) for k, g in grads.items()},
    }


RENEW_STAMP = 4_000_000_000  # rank 0's clock as a reload hands it on (after the start: renew moves on)


def _tz_rank(rank: int, world_size: int, root: str) -> dict:
    # node 0 in UTC, node 1 eight hours east (POSIX TZ strings: no tz database needed)
    os.environ["TZ"] = "UTC0" if rank == 0 else "CST-8"
    time.tzset()
    result = _train(rank, os.path.join(root, "cfg.json"), os.path.join(root, "out"))
    # the folder a config reload opens (`Outputs.renew` with rank 0's stamp), on each rank by itself
    from trainermon.config import load_config

    outputs = _LAST[0].loop.outputs
    for sink in outputs.renew(load_config(os.path.join(root, "cfg.json")), stamp=RENEW_STAMP):
        sink.close()
    result["renewed"] = os.path.basename(outputs.run_dir)
    return result


def test_run_dirs_and_host_across_timezones(tmp_path) -> None:
    (tmp_path / "cfg.json").write_text(
        json.dumps({"wg_distribution": True, "format": "csv", "ops": ["norm", "max"]})
    )
    results = run_ranks(_tz_rank, world_size=2, timeout=240, root=str(tmp_path))
    names = [r["run_dir"] for r in results]
    assert names[0].replace("-rank0-", "-rankX-") == names[1].replace("-rank1-", "-rankX-"), names
    # the {time} part is rank 0's clock written in rank 0's timezone (UTC), inside its set_monitor window
    stamp = names[0].split("-rank0-")[0]
    lo, hi = results[0]["window"]
    year = datetime.fromtimestamp(lo, tz=timezone.utc).year
    when = datetime.strptime(f"{year}{stamp}", "%Y%b%d_%H-%M-%S").replace(tzinfo=timezone.utc).timestamp()
    assert lo - 2 <= when <= hi + 1, (stamp, lo, hi)
    # a reloaded config's folder: rank 0's stamp in rank 0's timezone on every rank
    want = datetime.fromtimestamp(RENEW_STAMP, tz=timezone.utc).strftime("%b%d_%H-%M-%S")
    assert [r["renewed"] for r in results] == [f"{want}-rank{k}-{names[0][-8:]}" for k in range(2)], results
    for rank, r in enumerate(results):
        assert r["layout"]["host"] == r["host"] == socket.gethostname(), r["layout"]
        assert (r["layout"]["rank"], r["layout"]["world_size"]) == (rank, 2)


def _dynamic_rank(rank: int, world_size: int, root: str) -> dict:
    # node-local disks: each rank reads its own node's folder; only node 0 holds the file
    return _train(rank, os.path.join(root, f"node{rank}", "cfg.json"), os.path.join(root, "out"), steps=3)


def test_dynamic_config_on_rank0_node_only(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "node0").mkdir()
    config = {
        "wg_distribution": True,
        "format": "csv",
        "ops": ["norm", "max"],
        "dynamic_on": True,
        "collect_times": 100,
    }
    (tmp_path / "node0" / "cfg.json").write_text(json.dumps(config))
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    # the old code hung rank 0 in set_monitor (rank 1 raised in TrainerMon()): bounded here
    results = run_ranks(_dynamic_rank, world_size=2, timeout=120, root=str(tmp_path))
    for rank, r in enumerate(results):
        assert r["attach_s"] < 60, (rank, r["attach_s"])
        # rank 0's config (grad_unreduced on, every step) ran on both ranks: rows vs this rank's gradients
        assert set(r["rows"]) == set(r["want"]), (rank, sorted(r["rows"]))
        for key, row in r["rows"].items():
            want = r["want"][key]
            for op in ("norm", "max"):
                assert abs(row[op] - want[op]) <= 1e-5 * abs(want[op]) + 1e-9, (rank, key, op, row, want)
    missing = str(tmp_path / "node1" / "cfg.json")
    named = [m for m in results[1]["warnings"] if missing in m]
    assert len(named) == 1 and "rank 0's config" in named[0], results[1]["warnings"]
    assert not any("node0" in m for r in results for m in r["warnings"]), results


def test_dynamic_rank0_without_file_still_raises(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainermon import TrainerMon
    from trainermon.config import ConfigError

    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="cannot be read"):
        TrainerMon(str(tmp_path / "absent.json"))


def test_framework_callbacks_leave_a_missing_file_to_rank_0_in_dynamic_mode(tmp_path, monkeypatch):
    """HF's and Lightning's callbacks read the config at construction; on a node without the file in
    dynamic mode that read must not fail (TrainerMon() decides at train start, knowing the rank), while
    static mode still refuses it there."""
    pytest.importorskip("transformers")
    from trainermon.config import ConfigError
    from trainermon.integrations.hf import TrainerMonCallback

    missing = str(tmp_path / "node1" / "cfg.json")
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    assert TrainerMonCallback(missing) is not None
    monkeypatch.setenv("DYNAMIC_MONITOR", "false")
    with pytest.raises(ConfigError, match="cannot be read"):
        TrainerMonCallback(missing)
