"""The address a rank's endpoint is advertised at in Prometheus' discovery files.

Each node needs its own: every rank runs rank 0's config, so `prometheus.advertise_host` is one name for
the whole job; `TRAINERMON_ADVERTISE_HOST`, set per node by the launcher script, comes first. Bound to
all interfaces without either, the node's name is used, but never a loopback one (a Debian host maps its
own name to 127.0.1.1, a container often to 127.0.0.1: another machine cannot scrape it): then the
address this node reaches the job's master (MASTER_ADDR) from.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket

logger = logging.getLogger("trainermon")

WILDCARDS = ("0.0.0.0", "::", "")


def _is_loopback(name: str) -> bool:
    if name.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(socket.gethostbyname(name)).is_loopback
    except (OSError, ValueError):
        return False  # a name this node cannot resolve may still resolve where Prometheus runs


def _route_to_master() -> str | None:
    """This node's address on the route to MASTER_ADDR (a UDP socket's connect sends nothing)."""
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, int(os.environ.get("MASTER_PORT", "29500") or 29500)))
            address = probe.getsockname()[0]
    except (OSError, ValueError):
        return None
    return None if ipaddress.ip_address(address).is_loopback else address


def advertised_host(bound: str, configured: str | None, per_node: str | None) -> str:
    """The host written into the discovery files: `per_node` (TRAINERMON_ADVERTISE_HOST), `configured`
    (prometheus.advertise_host), the bound host, or for a wildcard bind a name other machines can use
    (said once at WARNING when only a loopback one is found). Runs once, when the sink opens."""
    if per_node:
        return per_node
    if configured:
        return configured
    if bound not in WILDCARDS:
        return bound
    for name in (socket.getfqdn(), socket.gethostname()):
        if name and not _is_loopback(name):
            return name
    routed = _route_to_master()
    if routed is not None:
        return routed
    name = socket.getfqdn()
    logger.warning(
        "trainermon: this node's name %r is a loopback address and no other was found: the Prometheus "
        "discovery files advertise it, which another machine cannot scrape; set TRAINERMON_ADVERTISE_HOST "
        "on each node (or prometheus.advertise_host)",
        name,
    )
    return name
