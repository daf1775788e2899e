"""Prometheus across nodes (an audit ran 2 nodes x 2 ranks): the advertised address of each node's ranks,
and the port offset under launchers that set no LOCAL_RANK (srun, mpirun). Loopback only: the wildcard
bind is exercised through `advertised_host`, never by binding 0.0.0.0."""

from __future__ import annotations

import glob
import json
import logging

import torch

from tests.sinks.prometheus_common import scrape, train_step, url_of, value
from tests.sinks.test_prometheus import start
from tests.sinks.test_prometheus_reopen import _free_port
from trainermon.config.env import LOCAL_RANK_VARS
from trainermon.exporters.prometheus import address


def _targets(tmp_path) -> list[str]:
    (sd,) = glob.glob(str(tmp_path / "out" / "prometheus_sd" / "*.json"))
    with open(sd) as fh:
        return json.load(fh)[0]["targets"]


def test_srun_local_rank_offsets_the_port_and_the_node_advertises_itself(tmp_path, monkeypatch):
    """SLURM_LOCALID 1 and no LOCAL_RANK: the rank used to listen on the base port (its node's rank 0
    took it first, this one's endpoint was switched off). One config (rank 0's, with its advertise_host)
    for all nodes: the node's own TRAINERMON_ADVERTISE_HOST is what its discovery file names."""
    for name in LOCAL_RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("TRAINERMON_ADVERTISE_HOST", "node7.cluster")
    free = _free_port()
    mon, model, opt = start(tmp_path, monkeypatch, prometheus={"port": free - 1, "advertise_host": "node0"})
    try:
        assert _targets(tmp_path) == [f"node7.cluster:{free}"]
        assert url_of(mon) == f"http://node7.cluster:{free}/metrics"  # prometheus.json
        train_step(model, opt, torch.Generator().manual_seed(0))
        mon.flush()
        assert value(scrape(f"http://127.0.0.1:{free}/metrics"), "trainermon_last_step") == 0
    finally:
        mon.close()


def test_a_wildcard_bind_never_advertises_a_loopback_name(monkeypatch, caplog):
    """`socket.getfqdn()` is 'localhost' where /etc/hosts maps the host's name to 127.0.x.1 (Debian,
    containers): every rank of the job was advertised as localhost:PORT."""
    resolve = {"localhost": "127.0.0.1", "vm": "127.0.1.1", "node3.cluster": "10.1.2.3"}
    monkeypatch.setattr(address.socket, "gethostbyname", lambda name: resolve[name])
    monkeypatch.setattr(address.socket, "getfqdn", lambda: "localhost")
    monkeypatch.setattr(address.socket, "gethostname", lambda: "node3.cluster")
    assert address.advertised_host("0.0.0.0", None, None) == "node3.cluster"
    monkeypatch.setattr(address.socket, "gethostname", lambda: "vm")
    monkeypatch.setattr(address, "_route_to_master", lambda: "10.1.2.4")
    assert address.advertised_host("0.0.0.0", None, None) == "10.1.2.4"  # the route to MASTER_ADDR
    monkeypatch.setattr(address, "_route_to_master", lambda: None)
    with caplog.at_level(logging.WARNING, logger="trainermon"):
        assert address.advertised_host("::", None, None) == "localhost"
    assert "set TRAINERMON_ADVERTISE_HOST on each node" in caplog.text
    # what is set wins, in this order; a bound address is advertised as it is
    assert address.advertised_host("0.0.0.0", "cfg.host", "node.env") == "node.env"
    assert address.advertised_host("0.0.0.0", "cfg.host", None) == "cfg.host"
    assert address.advertised_host("127.0.0.1", None, None) == "127.0.0.1"


def test_the_route_to_a_loopback_master_is_no_answer(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert address._route_to_master() is None
    monkeypatch.delenv("MASTER_ADDR")
    assert address._route_to_master() is None
