"""Run a function on N gloo ranks (CPU, 127.0.0.1) and return each rank's result to the test process.

    results = run_ranks(fn, world_size=2, out_dir=str(tmp_path))   # [rank 0's return value, rank 1's]

`fn(rank, world_size, **kwargs)` must be a module-level function (it is pickled into the rank processes)
and return something picklable. The process group is initialised before `fn` runs and destroyed after.
A rank that raises makes `run_ranks` raise in the test process with that rank's traceback; a rank that
dies without a word (a crash, a hang past `timeout`) is reported with its exit code.

Ranks are forked from one server process per test session that has already imported torch and its
compiler stack (`PRELOAD`): importing them takes 10-20 s of CPU per process on a 2-core host, more than
most multi-rank tests run for. Each rank still imports its test module and every training framework
afresh (Megatron, DeepSpeed, transformers: none is preloaded), runs in the test's working directory and
sys.path, and gets the test process's environment as it is at launch. Forked ranks share the server's
string-hash seed (so the same iteration order of string sets), where ranks started by torchrun each have
their own: `fresh_interpreters=True` spawns new interpreters instead, as a few broad tests do, so that an
order that differs across ranks still shows. Where CUDA is available every launch spawns (see run_ranks).
"""

from __future__ import annotations

import os
import pickle
import queue
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A child rank raised, crashed or timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# No training framework: torch, its distributed tensors and compiler stack, and the Parquet writer's
# pyarrow (which imports pandas on its first table).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch._inductor.lowering",
    "pyarrow.parquet",
    "pandas",
]


def _child(
    rank: int, world_size: int, port: int, job: bytes, results: Any, env: dict[str, str], log: str
) -> None:
    # A forkserver child inherits the environment and output of the session's first launch (a spawned
    # one, the parent's): take this launch's before the test module is imported (the job is unpickled
    # here, not by multiprocessing).
    os.environ.clear()
    os.environ.update(env)
    with open(log, "ab", buffering=0) as fh:
        os.dup2(fh.fileno(), 1)
        os.dup2(fh.fileno(), 2)
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    try:
        fn, kwargs = pickle.loads(job)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    timeout: float = 600.0,
    fresh_interpreters: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world_size, **kwargs)` on `world_size` gloo ranks; return results by rank.
    `fresh_interpreters`: spawn each rank (its own hash seed; 10-20 s more per rank on 2 cores)."""
    # With a GPU, spawn as well: the preloaded compiler stack may initialise CUDA in the server, and a
    # forked child of a process that did cannot use CUDA.
    if fresh_interpreters or torch.cuda.is_available():
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # used when the server starts, at the session's first launch
    results = ctx.Queue()
    port = free_port()
    job = pickle.dumps((fn, kwargs))
    env = dict(os.environ)
    logs = tempfile.mkdtemp(prefix="ranks-")
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, port, job, results, env, os.path.join(logs, f"rank{r}.log")),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
                got[rank] = (ok, value)
                if not ok:
                    break  # the other ranks may be blocked in a collective: stop them below
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead:
                # Give a rank that just put its result a moment to arrive before calling it dead.
                try:
                    rank, ok, value = results.get(timeout=2.0)
                    got[rank] = (ok, value)
                    continue
                except queue.Empty:
                    raise RankFailed(
                        f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"
                    ) from None
            if time.monotonic() > deadline:
                raise RankFailed(
                    f"ranks {sorted(set(range(world_size)) - set(got))} timed out after {timeout}s"
                )
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(got) == world_size and all(ok for ok, _ in got.values()) else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
        results.close()
        _echo_logs(logs, world_size)
    for rank in sorted(got):
        ok, value = got[rank]
        if not ok:
            raise RankFailed(f"rank {rank} failed:\n{value}")
    return [got[r][1] for r in range(world_size)]


def _echo_logs(logs: str, world_size: int) -> None:
    """Write each rank's output to this process's file descriptor 2, where spawned ranks wrote theirs:
    pytest's fd capture shows it when the test fails, and capsys (sys.stdout) never sees it."""
    with open(2, "wb", closefd=False) as err:
        for r in range(world_size):
            path = os.path.join(logs, f"rank{r}.log")
            if os.path.exists(path):
                with open(path, "rb") as fh:
                    data = fh.read()
                if data:
                    err.write(f"----- rank {r} -----\n".encode() + data)
    shutil.rmtree(logs, ignore_errors=True)
