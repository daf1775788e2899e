"""The HTTP side of the Prometheus sink: one endpoint per rank that serves its owner's page.

A scrape asks the owning sink for its page (`server.source`): the sink renders the exposition text then,
only when a step was written since its last render, under the lock its worker-thread writes hold, so a
page never mixes two steps. Rendering per scrape (every 15 s or so) instead of per collected step spares
the worker ~10 ms of interpreter time per step at a few thousand series (docs/PERFORMANCE.md); a scrape
waits at most for one step's gauge updates, and never for, or on behalf of, training.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("trainermon")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Servers of this process by (host, port). A sink reopened with a fixed port while the old one is still
#: open (a dynamic config change opens the new sinks before closing the old ones) takes the server over.
LIVE: dict[tuple[str, int], MetricsServer] = {}
LIVE_LOCK = threading.Lock()
#: Which sink wrote each file_sd target file: the file of a run keeps its path when its sink is reopened,
#: and only the sink that wrote it last may remove it.
SD_OWNERS: dict[str, object] = {}


class Handler(BaseHTTPRequestHandler):
    server: MetricsServer
    timeout = 10  # a stuck client cannot hold a server thread forever

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        try:
            body = self.server.source()
        except Exception:  # noqa: BLE001 - never a traceback on the job's stderr; the scrape fails
            logger.debug("trainermon: rendering the Prometheus page failed", exc_info=True)
            self.send_error(500)
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence per-request logs
        pass


class MetricsServer(ThreadingHTTPServer):
    """One thread per connection (daemon: never holds up interpreter exit), each one tracked, so that
    `close_connections` can end them all, even one waiting on a client that never sends its request."""

    daemon_threads = True
    request_queue_size = 256  # dozens of concurrent scrapers must not overflow the listen backlog
    source: Callable[[], bytes] = staticmethod(lambda: b"")  # the owner's current page
    owner: object = None
    group: object = None  # the monitor (run and rank) whose sinks may take this server over

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._active: dict[threading.Thread, socket.socket] = {}
        self._active_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self._serve_one, args=(request, client_address), name="trainermon-prometheus-request"
        )
        thread.daemon = True
        with self._active_lock:
            self._active[thread] = request
        thread.start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._active_lock:
                self._active.pop(threading.current_thread(), None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper that disconnects mid-response (or a connection ended by close) is not an error
        # worth a traceback on the job's stderr.
        logger.debug("trainermon: Prometheus request from %s failed", client_address, exc_info=True)

    def close_connections(self, timeout: float = 2.0) -> None:
        """End every open connection and join its thread (after `shutdown()`: no new ones come)."""
        with self._active_lock:
            active = dict(self._active)
        for request in active.values():
            try:
                request.shutdown(socket.SHUT_RDWR)  # a handler blocked reading its request returns now
            except OSError:
                pass
        end = time.monotonic() + timeout
        for thread in active:
            thread.join(max(0.0, end - time.monotonic()))


def start(
    host: str, port: int, owner: Any, source: Callable[[], bytes], group: object = None
) -> MetricsServer:
    """The endpoint at (host, port), owned by `owner`: a live one of this process with a fixed port is
    taken over, else a new server thread starts. A live server of the same `group` (the sinks of one
    monitor) on that port under another host is shut down first: the port is the new address's. Binding
    errors (port taken) propagate to the caller."""
    with LIVE_LOCK:
        server = LIVE.get((host, port)) if port else None
        if server is not None and server.group != group:  # another monitor's endpoint: the port is taken
            raise OSError(
                errno.EADDRINUSE, f"{os.strerror(errno.EADDRINUSE)} (another monitor of this process)"
            )
        if server is None and not port and group is not None:
            # an ephemeral port: the same monitor's sink, reopened, keeps its address (one scrape target,
            # whose counters go on: a new address would be a new series starting at the run's totals)
            server = next((s for (h, _), s in LIVE.items() if h == host and s.group == group), None)
        if server is None and port:
            for (other_host, other_port), other in list(LIVE.items()):
                if other_port == port and group is not None and other.group == group:
                    LIVE.pop((other_host, other_port))
                    other.owner = owner  # its own sink's later stop() leaves it alone
                    other.shutdown()
                    other.server_close()
                    other.close_connections()
        if server is None:
            server = MetricsServer((host, port), Handler)
            thread = threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="trainermon-prometheus"
            )
            thread.daemon = True
            thread.start()
            LIVE[(host, server.server_address[1])] = server
        server.owner = owner
        server.group = group
        server.source = source
    return server


def stop(server: MetricsServer, owner: Any, host: str, port: int) -> None:
    """Shut the endpoint down, unless a newer sink of this process owns it now."""
    with LIVE_LOCK:
        if server.owner is not owner:
            return
        LIVE.pop((host, port), None)
    server.shutdown()
    server.server_close()
    server.close_connections()


def write_target(path: str, body: Any, owner: object) -> None:
    """Write a file_sd target file, owned by `owner` from now on."""
    atomic_json(path, body)
    with LIVE_LOCK:
        SD_OWNERS[path] = owner


def remove_target(path: str, owner: object) -> bool:
    """Remove a target file, unless a newer sink wrote it since (the same run reopened its sinks); True
    when this owner's file is gone."""
    with LIVE_LOCK:
        if SD_OWNERS.get(path) is not owner:
            return False
        del SD_OWNERS[path]
    try:
        os.unlink(path)  # the target is gone: Prometheus stops scraping it
    except FileNotFoundError:
        pass
    return True


def atomic_json(path: str, body: Any) -> None:
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")  # not matched by a *.json file_sd glob
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(body, fh)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)  # a failed write (disk full) leaves no temporary file behind
        except OSError:
            pass
        raise
