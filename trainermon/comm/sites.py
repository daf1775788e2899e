"""Call sites of collectives, resolved once per code location.

A call site is the first frame outside torch and trainermon, its adapters and exporters included wherever
an editable install keeps them (the user's or the framework's line that asked for the collective); where
every frame is inside torch (a hook run by the autograd engine), the outermost torch frame. A function
nested in one of DDP's communication hooks (torch/distributed/algorithms/ddp_comm_hooks/: PowerSGD's
compute_qs, chained with `fut.then`) ends the walk too, as the site: such a callback runs inline on the
thread that chained it when the future is done already (the walk would reach the user's backward line),
else on the backend's thread (it would stop at the callback), so only its own frame names it the same on
every rank and step. The hooks' own bodies (fp16 compression, DDP's default all-reduce) keep the user's
line. The walk stops at that first frame, and its text is cached by (code object, line), so a call costs
a few attribute reads and a dict lookup per frame."""

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
_HOOKS = os.path.join(os.path.dirname(torch.__file__), "distributed", "algorithms", "ddp_comm_hooks", "")
_MAX_CACHE = 100_000
_CALLBACK: dict[CodeType, bool] = {}  # code object -> a function nested in a DDP communication hook


def _hook_callback(code: CodeType) -> bool:
    found = _CALLBACK.get(code)
    if found is None:
        if len(_CALLBACK) > _MAX_CACHE:
            _CALLBACK.clear()  # bounded, as `_CACHE`
        nested = "<locals>" in code.co_qualname if hasattr(code, "co_qualname") else code.co_flags & 0x10
        found = _CALLBACK[code] = bool(nested) and code.co_filename.startswith(_HOOKS)  # 0x10: CO_NESTED
    return found


_CACHE: dict[tuple[CodeType, int], str] = {}


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
            if _hook_callback(frame.f_code):
                return _text(frame)  # the same on whichever thread the callback runs
        frame = frame.f_back
    return _text(last) if last is not None else "<unknown>"


def within_comm_hook(depth: int = 2) -> bool:
    """Whether the collective whose wrapper called this (`depth` frames up) was issued by the code of one of
    DDP's communication hooks: its body (PowerSGD's all-reduce of the uncompressed tensors) or a callback it
    chained (the P and Q all-reduces), on whichever thread. Walks torch's and trainermon's frames only."""
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        if frame.f_code.co_filename.startswith(_HOOKS):
            return True
        frame = frame.f_back
    return False


def short(site: str) -> str:
    """A site as rows name it: the file's last two path components, line and function."""
    path, _, rest = site.rpartition(":")
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) + ":" + rest
