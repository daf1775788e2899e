"""Call sites of collectives, resolved once per code location.

A call site is the first frame outside torch and trainermon, its adapters and exporters included wherever
an editable install keeps them (the user's or the framework's line that asked for the collective); where
every frame is inside torch (a hook run by the autograd engine), the outermost torch frame. The walk stops
at that first frame, and its text is cached by (code object, line), so a call costs
a few attribute reads and one dict lookup."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import CodeType, FrameType

import torch

import trainermon


def _own_dirs() -> tuple[str, ...]:
    """trainermon's folders, with `trainermon.adapters` and `trainermon.exporters`, which an editable
    install maps to the repository's adapters/ and exporters/ (found without importing them)."""
    dirs = [os.path.dirname(trainermon.__file__)]
    for name in ("trainermon.adapters", "trainermon.exporters"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        dirs += list(spec.submodule_search_locations or []) if spec is not None else []
    found = {os.path.join(d, "") for d in dirs} | {os.path.join(os.path.realpath(d), "") for d in dirs}
    return tuple(sorted(found))


_OWN = _own_dirs()
#: torch's folder first: `call_site` keeps the outermost torch frame where no frame is outside both
_INSIDE = (os.path.join(os.path.dirname(torch.__file__), ""), *_OWN)
_CACHE: dict[tuple[CodeType, int], str] = {}
_MAX_CACHE = 100_000


def _text(frame: FrameType) -> str:
    key = (frame.f_code, frame.f_lineno)
    site = _CACHE.get(key)
    if site is None:
        if len(_CACHE) > _MAX_CACHE:
            _CACHE.clear()  # bounded: code locations are few, but never let it grow unchecked
        path = frame.f_code.co_filename
        site = _CACHE[key] = f"{path}:{frame.f_lineno}({frame.f_code.co_name})"
    return site


def call_site(depth: int = 2) -> str:
    """The call site of the collective whose wrapper called this (`depth` frames up)."""
    frame: FrameType | None = sys._getframe(depth)
    last = frame
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_INSIDE):
            return _text(frame)
        if not frame.f_code.co_filename.startswith(_OWN):
            last = frame  # outermost torch frame so far
        frame = frame.f_back
    return _text(last) if last is not None else "<unknown>"


def short(site: str) -> str:
    """A site as rows name it: the file's last two path components, line and function."""
    path, _, rest = site.rpartition(":")
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) + ":" + rest
