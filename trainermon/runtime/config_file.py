"""Edits of the monitor's JSON config file by the monitor itself (the automatic stop after `collect_times`)
and by the CLI (`trainermon on`/`off`): keys set on the file as it is, never over a save made meanwhile."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from trainermon.config import ConfigError


def update_config_file(path: str, **changes: Any) -> dict:
    """Set keys in a JSON config file atomically, keeping every other key. Returns the new mapping. A save
    made meanwhile is never written over: the keys are set on it instead (5 tries, then `ConfigError`)."""
    for _ in range(5):
        if (new := replace_if_unchanged(path, changes)) is not None:
            return new
    raise ConfigError(f"config file {path!r} kept changing while it was being written; it was not updated")


def replace_if_unchanged(path: str, changes: dict, expected: Any = None) -> dict | None:
    """Set `changes` in the JSON file at `path` (its symlink target) unless it changes meanwhile: returns
    the new mapping, or None where the file was saved again (or, given `expected`, does not hold it), and
    then the file is left as saved. A temporary file, fsync, rename. Cost: two reads, one write and fsync."""
    target = os.path.realpath(path)  # a symlinked config stays a symlink (the watcher follows it)
    with open(target, "rb") as fh:
        text = fh.read()
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!r}: the top level must be a JSON object")
    if expected is not None and raw != expected:
        return None
    raw.update(changes)
    fd, tmp = tempfile.mkstemp(prefix=".trainermon-", suffix=".json", dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(raw, fh, indent=2)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.chmod(tmp, os.stat(target).st_mode & 0o777)
        except OSError:
            pass
        return raw if _swap_if_unchanged(target, tmp, text) else None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _swap_if_unchanged(target: str, tmp: str, text: bytes) -> bool:
    """Compare-and-swap, after the slow part (the fsync: ms, far more on NFS): `tmp` becomes `target` only
    if `target` still holds `text`; a save meanwhile wins. The file is renamed aside (atomic: a save from
    then on makes a new file, which `link` never replaces) and compared; it is absent for microseconds.
    Left: an in-place writer that opened the file before and writes between the compare and the link."""
    aside = tmp + ".old"
    try:
        os.rename(target, aside)
    except FileNotFoundError:
        return False  # deleted mid-save: the saver decides
    try:
        with open(aside, "rb") as fh:
            unchanged = fh.read() == text
        try:
            os.link(tmp if unchanged else aside, target)
        except FileExistsError:
            return False  # saved meanwhile: theirs stays
        except OSError:  # no hard links here: back in place (a save in these microseconds is lost)
            os.replace(tmp if unchanged else aside, target)
        return unchanged
    finally:
        if os.path.exists(aside):
            if os.path.lexists(target):
                os.unlink(aside)
            else:  # interrupted (a signal's exception) before the link: the file goes back, never lost
                os.rename(aside, target)
