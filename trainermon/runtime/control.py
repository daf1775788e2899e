"""Dynamic start/stop: the watched config file, and the rank-consistent decision of what to apply when.

- `ConfigWatcher` notices saves of the config file: watchdog's inotify observer by default (in-place
  writes, atomic replace, rename-and-create, delete-and-recreate), watchdog's polling observer for
  filesystems without inotify, or a small stat-polling thread when watchdog is not installed. It only
  sets a flag; the file is read at the next step boundary, so a burst of events becomes one reload.
- `DynamicControl` runs at every step boundary. Only the deciding rank (rank 0) looks at the file. With
  more than one rank, rank 0 broadcasts the config version and its clock over a dedicated gloo group (one
  24-byte broadcast per step), and the config itself (as JSON) only when the version changed, and once at the
  first step (each rank read its own file when it started: a `trainermon on` landing while the ranks
  start gave ranks different configs, and the job hung in the first collective only some ran), so every
  rank applies the same config at the same step whatever its own view of a shared filesystem. The file
  is read again at the first step: an edit between `TrainerMon()` and `set_monitor` is not missed.
- `update_config_file` rewrites the file atomically (temporary file, fsync, rename), keeping the user's
  other keys, and never over a save made meanwhile (`replace_if_unchanged`, a compare-and-swap). The CLI's
  `on`/`off` use it; the automatic stop after `collect_times` writes only over the config it applied.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from typing import Any

from trainermon.config import ConfigError, MonitorConfig, parse_config, read_config_json

from .config_file import replace_if_unchanged, update_config_file  # noqa: F401 - update_config_file: the CLI's

logger = logging.getLogger("trainermon")
#: Seconds a deleted config file may stay away (an editor's delete-and-write) before the monitor says so.
GONE_S = 1.0


def read_config_or_defer(path: str, dynamic: bool) -> Any:
    """The config file's JSON (`read_config_json`), or None where it cannot be read on a rank other than 0
    in dynamic mode: every rank runs rank 0's config, which the first `DynamicControl.poll` (at
    `set_monitor`) hands it, so with node-local disks only rank 0's node needs the file. Said once; raises
    `ConfigError` anywhere else (rank 0, static mode, a file that is there but invalid). Cost: one read."""
    import torch.distributed as dist

    try:
        return read_config_json(path)
    except ConfigError as exc:
        cause = exc.__cause__
        if not dynamic or not isinstance(cause, OSError):
            raise
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
        else:  # made before init_process_group: the launcher's variable (torchrun, mpirun, srun)
            names = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
            rank = next((int(v) for v in map(os.environ.get, names) if v and v.strip().isdigit()), 0)
        if rank == 0:
            raise
        logger.warning(
            "trainermon: rank %d cannot read the config file %r (%s); in dynamic mode every rank runs rank "
            "0's config (only rank 0's copy is read and watched): this rank takes it at set_monitor",
            rank,
            path,
            cause.strerror or cause,
        )
        return None


def agree_config(raw: Any, group: Any) -> Any:
    """Rank 0's config mapping on every rank of `group` (a gloo group of every rank), as JSON bytes (never
    pickled). Collective: every rank calls it once, at `set_monitor`, outside dynamic mode (there the
    first `DynamicControl.poll` does the same)."""
    import torch
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0)
    data = json.dumps(raw).encode() if dist.get_rank(group) == 0 else b""
    box = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(box, src=src, group=group)
    return json.loads(_broadcast_bytes(data, int(box), src, group).decode())


def _broadcast_bytes(data: bytes, length: int, src: int, group: Any) -> bytes:
    """`data` of rank `src` on every rank of `group`; `length`, its size, is already known on every rank.
    One broadcast of a uint8 tensor (bytes, never a pickle)."""
    import torch
    import torch.distributed as dist

    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(length, dtype=torch.uint8)
    )
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf.tolist())


class ConfigWatcher:
    """Sets `dirty` when the file at `path` may have changed. Never reads the file on the training thread.

    Symlinks are followed: the folder of the resolved target is watched too, and a swap of any link on the
    way (a k8s ConfigMap's `..data`) sets `dirty` and moves that watch to the new target's folder. The
    pollers compare the file's content (a hash, read on their own thread), not only its stat: an edit
    of the same size within a coarse mtime (NFS) is seen. Cost: events and poll intervals only."""

    def __init__(self, path: str, polling: bool = False, poll_interval: float = 1.0) -> None:
        self.path = os.path.abspath(path)
        self.dirty = False
        self.backend = "none"
        self._observer: Any = None
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self._target = os.path.realpath(self.path)
        self._target_watch: Any = None  # the observer's watch of the target's folder, when another folder
        self._handler: Any = None
        self._start(polling, poll_interval)

    def _start(self, polling: bool, poll_interval: float) -> None:
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
            from watchdog.observers.polling import PollingObserver
        except Exception:  # noqa: BLE001 - watchdog missing or broken: use the built-in poller
            self._start_stat_poller(poll_interval)
            self.backend = "stat-polling"
            return
        watcher = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                # Opening or reading the file (our own reload included) is not a change.
                if event.event_type in ("opened", "closed_no_write"):
                    return
                watcher._on_event({getattr(event, "src_path", ""), getattr(event, "dest_path", "")})

        observer = PollingObserver(timeout=poll_interval) if polling else Observer()
        self._handler = Handler()
        # Watch the directory, not the file: atomic replaces and re-creations give the file a new inode.
        observer.schedule(self._handler, os.path.dirname(self.path), recursive=False)
        self._observer = observer
        self._watch_target_folder()
        observer.daemon = True
        observer.start()
        if polling:
            # Watchdog's poller compares stat only: the content poller catches same-size, same-mtime edits.
            self._start_stat_poller(poll_interval)
        self.backend = "watchdog-polling" if polling else "watchdog"

    def _on_event(self, raw_paths: set) -> None:
        """Observer thread: dirty when the event is for the file (by either name), or when the path now
        resolves elsewhere (a symlink on the way was swapped); the read compares content anyway."""
        paths = {os.path.abspath(os.fsdecode(p)) for p in raw_paths if p}
        if self.path in paths or self._target in paths:
            self.dirty = True
        target = os.path.realpath(self.path)
        if target != self._target:
            self._target = target
            self.dirty = True
            self._watch_target_folder()

    def _watch_target_folder(self) -> None:
        """(Re)watch the folder of the resolved target when it is not the config's own folder."""
        folder = os.path.dirname(self._target)
        try:
            if self._target_watch is not None:
                if self._target_watch.path == folder:
                    return
                self._observer.unschedule(self._target_watch)
                self._target_watch = None
            if folder != os.path.dirname(self.path) and os.path.isdir(folder):
                self._target_watch = self._observer.schedule(self._handler, folder, recursive=False)
        except Exception as exc:  # noqa: BLE001 - the config's own folder stays watched
            logger.debug("trainermon: could not watch %s: %s", folder, exc)

    def _start_stat_poller(self, interval: float) -> None:
        def signature() -> tuple | None:
            # Stat and a hash of the content (the file is small), read here, on the poller's thread.
            try:
                st = os.stat(self.path)
                with open(self.path, "rb") as fh:
                    digest = hashlib.sha256(fh.read()).digest()
                return (os.path.realpath(self.path), st.st_mtime_ns, st.st_size, st.st_ino, digest)
            except OSError:
                return None

        first = signature()  # before the thread starts: an edit made once the watcher exists is seen

        def run() -> None:
            last = first
            while not self._stop.wait(interval):
                now = signature()
                if now != last:
                    last = now
                    self.dirty = True

        self._poller = threading.Thread(target=run, name="trainermon-config-poller", daemon=True)
        self._poller.start()

    def stop(self) -> None:
        self._stop.set()
        if self._observer is not None:
            try:
                self._observer.stop()
                self._observer.join(timeout=5)
            except Exception:  # noqa: BLE001
                pass
        if self._poller is not None:
            self._poller.join(timeout=5)


class DynamicControl:
    """Decides, identically on every rank, when a new config applies.

    `poll()` is called at every step boundary by every rank. It returns a new `MonitorConfig` to apply
    now, or None. Cost per step: a flag check on rank 0, plus (with several ranks) one broadcast of three
    int64 over a gloo group; the config itself travels only when it changed. `stamp` is rank 0's clock
    (whole seconds) at the poll that returned the config: every rank names the run directory of a
    reloaded config by it, so the names match whatever the ranks' clocks say.
    """

    def __init__(self, path: str, initial: MonitorConfig, polling: bool = False) -> None:
        self.path = os.path.abspath(path)  # read at every reload: a later os.chdir must not move it
        self.config = initial
        self.version = 0
        self._raw: dict | None = None  # the config mapping of the current version (deciding rank)
        try:
            with open(path, encoding="utf-8") as fh:
                self._raw = json.load(fh)
        except (OSError, ValueError):
            self._raw = None
        self._bad: str | None = None  # why the file is invalid (deciding rank)
        self._bad_due: float | None = None  # when to say so if it stays invalid; None: said, or valid
        self._validated: MonitorConfig | None = None  # `_raw` parsed by the deciding rank (warned once)
        self._gone_since: float | None = None  # when the file was found deleted (deciding rank)
        self._group: Any = None
        self._distributed = False
        self._rank = 0
        self.watcher: ConfigWatcher | None = None
        self._polling = polling
        self._first = True  # the first poll: rank 0's config reaches every rank, whatever it read
        self.stamp = int(time.time())

    def attach(self, process_group: Any = None) -> None:
        """Collective when distributed: every rank calls it once (from set_monitor)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
            self._distributed = True
            self._rank = dist.get_rank(process_group)
            ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
            self._group = dist.new_group(ranks=ranks, backend="gloo")
            self._src = dist.get_global_rank(self._group, 0)
        if self._rank == 0:
            self.watcher = ConfigWatcher(self.path, polling=self._polling)
            self.watcher.dirty = True  # the file may have changed since it was read (before the watcher)

    def _read_if_changed(self) -> None:
        """Deciding rank: reload the file if the watcher saw a change. A bad file keeps the old config."""
        if self.watcher is None:
            return
        # An invalid file is read again once it has stayed so for GONE_S (a save being written completes
        # within ms), to say so if it still is. Cost: one comparison per step while the file is valid.
        if not self.watcher.dirty and (self._bad_due is None or time.monotonic() < self._bad_due):
            if self._gone_since is not None:
                self._check_gone()
            return
        self.watcher.dirty = False
        try:
            with open(self.path, encoding="utf-8") as fh:
                text = fh.read()
            raw = json.loads(text)
            validated = parse_config(raw, source=self.path)  # validate before publishing
        except FileNotFoundError:
            # Deleted: an editor's save in progress (its re-creation sets dirty again), or for good,
            # which `_check_gone` says once the file has stayed away for GONE_S.
            if self._gone_since is None:
                self._gone_since = time.monotonic()
            self._bad = self._bad_due = None  # gone is not invalid (`_check_gone` says it)
            return
        except json.JSONDecodeError as exc:
            self._warn_bad(
                f"not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})", syntax=True
            )
            return
        except Exception as exc:  # noqa: BLE001 - whatever is in the file, the running config stays
            self._warn_bad(str(exc))
            return
        self._bad = self._bad_due = self._gone_since = None
        if raw == self._raw:
            return  # saved again with the same content (or a spurious event): nothing to apply
        self._raw, self._validated = raw, validated
        self.version += 1

    def _check_gone(self) -> None:
        """A deleted config file that has not come back: said once (the running config stays)."""
        if time.monotonic() - self._gone_since < GONE_S:
            return
        if not os.path.exists(self.path):
            logger.warning(
                "trainermon: %s was deleted and has not come back; keeping the current config "
                "(dynamic_on=%s) until the file is written again",
                self.path,
                str(self.config.dynamic_on).lower(),
            )
        self._gone_since = None  # said, or back (the watcher's event reloads it)

    def _warn_bad(self, message: str, syntax: bool = False) -> None:
        """An invalid file keeps the running config: said once per distinct problem, invalid JSON (`syntax`:
        maybe a save still being written) at DEBUG until it has lasted GONE_S."""
        now = time.monotonic()
        if message != self._bad:
            if self._bad is None or self._bad_due is None:  # a new problem (not one replacing a pending one)
                self._bad_due = now + GONE_S
            if not syntax:
                self._bad_due = now  # valid JSON, a wrong value: the user's own mistake, said at once
            self._bad = message
        if self._bad_due is None:
            return  # said
        if now >= self._bad_due:
            self._bad_due = None
            logger.warning("trainermon: %s is invalid, keeping the current config: %s", self.path, message)
        else:
            logger.debug("trainermon: %s is invalid for now (a save in progress?): %s", self.path, message)

    def poll(self) -> MonitorConfig | None:
        import torch
        import torch.distributed as dist

        previous, first, self._first = self.version, self._first, False
        if self._rank == 0:
            self._read_if_changed()
        if self._distributed:
            # The config travels as JSON bytes (never pickled): [version, length, clock] first, bytes if
            # new (or at the first poll, on every rank alike).
            data = json.dumps(self._raw).encode() if self._rank == 0 and self._raw is not None else b""
            box = torch.tensor([self.version, len(data), int(time.time())], dtype=torch.int64)
            dist.broadcast(box, src=self._src, group=self._group)
            version, length, self.stamp = (int(v) for v in box.tolist())
            if version == previous and not first:
                return None
            received = _broadcast_bytes(data, length, self._src, self._group)
            self.version = version
            mine, self._raw = self._raw, json.loads(received.decode()) if length else None
            if version == previous and (self._rank == 0 or self._raw is None or self._raw == mine):
                return None  # the first poll, and this rank already runs rank 0's config
        elif self.version == previous:
            return None
        else:
            self.stamp = int(time.time())
        validated, self._validated = self._validated, None
        # The deciding rank parsed this version already (and said its warnings); the others parse it once.
        self.config = validated if validated is not None else parse_config(self._raw, source=self.path)
        return self.config

    def digest(self) -> str | None:
        """A fingerprint of the applied config mapping (the same on every rank: rank 0's), saved with the
        state: a resumed run whose file differs runs a new config, as an edit while running would. None
        before the first poll: the mapping is still this rank's own, not the one every rank runs."""
        if self._first or not isinstance(self._raw, dict):
            return None
        return hashlib.sha256(json.dumps(self._raw, sort_keys=True).encode()).hexdigest()[:16]

    def switch_off_in_file(self) -> None:
        """After the last collection, on every rank: the applied mapping is off too, so that saving the
        config that was on again is news; and rank 0 sets dynamic_on to false in the file, unless the file
        holds an edit not applied yet (that edit decides, at the next step)."""
        applied = self._raw
        if isinstance(applied, dict):
            self._raw = {**applied, "dynamic_on": False}
        if self._rank != 0:
            return
        if not isinstance(applied, dict):
            return  # the file said nothing valid to switch off
        try:
            # Only over the applied content: a save since (even during this write) applies at the next step.
            replace_if_unchanged(self.path, {"dynamic_on": False}, expected=applied)
        except (FileNotFoundError, ValueError):
            return  # gone or mid-save: a new version is coming
        except Exception as exc:  # noqa: BLE001
            logger.warning("trainermon: could not set dynamic_on to false in %s: %s", self.path, exc)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
