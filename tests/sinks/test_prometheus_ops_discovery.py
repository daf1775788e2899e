"""Live-monitoring operations of the Prometheus sink, with real training processes: a rank killed without
closing its sink leaves no target that outlives it (the next sink of that rank removes a dead writer's
file, or any file naming its own address; SIGTERM still ends the process at once: the monitor installs no
handler, which would defer the signal while the main thread waits in a native call), and local rank 0
says on stderr where its endpoint listens."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from tests.distributed import free_port

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from trainermon import TrainerMon

    if sys.argv[2] == "own_handler":  # the program's own SIGTERM handler: a graceful exit
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
    mon = TrainerMon(sys.argv[1])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    model(torch.randn(3, 4)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    mon.flush()
    print(mon.run_dir, flush=True)
    if sys.argv[2] == "exit":
        mon.close()
        sys.exit(0)
    time.sleep(120)  # killed by the test
    """
)


def _config(tmp_path, port: int = 0) -> str:
    path = tmp_path / f"cfg{port}.json"
    path.write_text(json.dumps({"wg_distribution": True, "ops": ["norm"], "format": ["prometheus"],
                                "prometheus": {"port": port}}))  # fmt: skip
    return str(path)


def _child(tmp_path, mode: str, port: int = 0, **env: str) -> tuple[subprocess.Popen, str]:
    """A training process with the sink open; returns it and its run directory."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    child_env.update(MONITOR_OUTPUT_DIR=str(tmp_path / "out"), PYTHONPATH=os.getcwd(), **env)
    proc = subprocess.Popen(
        [sys.executable, str(script), _config(tmp_path, port), mode],
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_dir = proc.stdout.readline().strip()
    if not run_dir:
        proc.kill()
        pytest.fail(f"the child did not start: {proc.communicate(timeout=60)[1][-3000:]}")
    return proc, run_dir


def _targets(tmp_path) -> dict[str, list[str]]:
    """Each target file's name and the targets Prometheus would make of it (groups with targets)."""
    out = {}
    for path in sorted(glob.glob(str(tmp_path / "out" / "prometheus_sd" / "*.json"))):
        with open(path) as fh:
            out[os.path.basename(path)] = [t for group in json.load(fh) for t in group["targets"]]
    return out


def _answers(target: str) -> bool:
    try:
        urllib.request.urlopen(f"http://{target}/metrics", timeout=3).read()
    except OSError:
        return False
    return True


def _run_id(run_dir: str) -> str:
    return run_dir.rsplit("-", 1)[-1]


def test_a_killed_ranks_target_file_is_removed_when_the_rank_opens_again(tmp_path):
    dead, dead_dir = _child(tmp_path, "sleep")
    (old_name,) = _targets(tmp_path)
    dead.kill()  # SIGKILL: no close, no atexit, no handler
    dead.wait(30)
    assert _targets(tmp_path) == {old_name: _targets(tmp_path)[old_name]}  # left behind by the kill
    # another job's rank 0 on this host, alive: its file must stay
    live, live_dir = _child(tmp_path, "sleep")
    try:
        live_name = f"rank0-{_run_id(live_dir)}.json"
        assert old_name not in _targets(tmp_path), "the dead writer's file outlived the next rank 0"
        new, new_dir = _child(tmp_path, "exit")
        assert new.wait(60) == 0
        # reference: every target Prometheus would scrape now answers, and belongs to a live run
        targets = _targets(tmp_path)
        assert list(targets) == [live_name], targets
        assert all(_answers(t) for t in targets[live_name])
    finally:
        live.kill()
        live.wait(30)


def test_a_file_naming_this_ranks_address_is_removed_when_it_opens(tmp_path):
    """A relaunch on a fixed port: an old file (here one without a writer, as older versions wrote it)
    that names the address this rank now holds would file its series under the old run's id."""
    port = free_port()
    sd = tmp_path / "out" / "prometheus_sd"
    sd.mkdir(parents=True)
    stale = {"targets": [f"127.0.0.1:{port}"], "labels": {"run_id": "deadbeef"}}
    (sd / "rank0-deadbeef.json").write_text(json.dumps([stale]))
    other = {"targets": ["127.0.0.1:1"], "labels": {"run_id": "0ther0ne"}}  # rank 0 of a live job elsewhere
    (sd / "rank0-0ther0ne.json").write_text(json.dumps([other]))
    (sd / "rank1-deadbeef.json").write_text(json.dumps([{**stale, "targets": ["127.0.0.1:2"]}]))
    proc, run_dir = _child(tmp_path, "sleep", port)
    try:
        assert _targets(tmp_path) == {
            "rank0-0ther0ne.json": ["127.0.0.1:1"],
            f"rank0-{_run_id(run_dir)}.json": [f"127.0.0.1:{port}"],
            "rank1-deadbeef.json": ["127.0.0.1:2"],  # another rank's: its own next sink decides
        }
    finally:
        proc.kill()
        proc.wait(30)


def test_sigterm_ends_the_process_at_once_and_the_next_sink_removes_its_file(tmp_path):
    proc, run_dir = _child(tmp_path, "sleep")
    (name,) = _targets(tmp_path)
    with open(os.path.join(run_dir, "prometheus.json")) as fh:
        info = json.load(fh)
    assert info["pid"] == proc.pid and info["node"] == socket.gethostname()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM  # the default action: no handler of the monitor's
    assert list(_targets(tmp_path)) == [name]  # left behind, its writer dead
    proc, run_dir = _child(tmp_path, "exit")
    proc.communicate(timeout=60)
    assert _targets(tmp_path) == {}  # the next rank 0 removed the dead writer's file, then closed its own


def test_a_programs_own_sigterm_handler_keeps_control(tmp_path):
    proc, run_dir = _child(tmp_path, "own_handler")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 7  # the program's handler ran (its exit status), then atexit closed the sink
    assert _targets(tmp_path) == {}


def test_local_rank_0_says_where_it_listens_once_and_the_others_do_not(tmp_path):
    proc, run_dir = _child(tmp_path, "exit")
    stderr = proc.communicate(timeout=60)[1]
    with open(os.path.join(run_dir, "prometheus.json")) as fh:
        url = json.load(fh)["url"]
    said = [line for line in stderr.splitlines() if "Prometheus metrics" in line]
    assert len(said) == 1 and url in said[0] and str(tmp_path / "out" / "prometheus_sd") in said[0], stderr
    proc, run_dir = _child(tmp_path, "exit", LOCAL_RANK="1")
    stderr = proc.communicate(timeout=60)[1]
    assert "Prometheus metrics" not in stderr, stderr
    with open(os.path.join(run_dir, "prometheus.json")) as fh:
        assert json.load(fh)["url"].startswith("http://127.0.0.1:")


def _target_file(path, target: str, pid: int, host: str) -> None:
    from trainermon.exporters.prometheus.discovery import HOST_LABEL, PID_LABEL

    body = [
        {"targets": [target], "labels": {"run_id": "r"}},
        {"targets": [], "labels": {PID_LABEL: str(pid), HOST_LABEL: host}},
    ]
    path.write_text(json.dumps(body))


def test_a_relaunch_with_fewer_ranks_removes_the_dead_ranks_files_on_local_rank_0(tmp_path):
    from trainermon.exporters.prometheus.discovery import remove_stale

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)  # a pid of this host that no longer runs
    here = socket.gethostname()
    _target_file(tmp_path / "rank3-old.json", "127.0.0.1:1", dead.pid, here)  # scaled away, writer dead
    _target_file(tmp_path / "rank4-live.json", "127.0.0.1:2", os.getpid(), here)  # a live job's
    _target_file(tmp_path / "rank5-far.json", "127.0.0.1:3", dead.pid, here + "-other")  # another host's
    _target_file(tmp_path / "rank1-old.json", "127.0.0.1:4", dead.pid, here)  # a rank this job has
    own = str(tmp_path / "rank0-new.json")
    assert remove_stale(str(tmp_path), 0, own, "127.0.0.1:9", world_size=2, local_rank=1) == []
    removed = remove_stale(str(tmp_path), 0, own, "127.0.0.1:9", world_size=2, local_rank=0)
    assert [os.path.basename(p) for p in removed] == ["rank3-old.json"]
    left = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "*.json")))
    assert left == ["rank1-old.json", "rank4-live.json", "rank5-far.json"]  # rank 1 removes its own


def test_an_address_named_by_another_hosts_file_is_not_ours(tmp_path):
    from trainermon.exporters.prometheus.discovery import remove_stale

    _target_file(tmp_path / "rank0-far.json", "127.0.0.1:9", os.getpid(), socket.gethostname() + "-other")
    assert remove_stale(str(tmp_path), 0, str(tmp_path / "rank0-new.json"), "127.0.0.1:9") == []
