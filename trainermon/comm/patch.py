"""The temporary patches: each watched function of torch.distributed (and of its functional collectives)
is replaced by a wrapper while a collected step runs, and put back when the step ends, at `close()` and at
a dynamic switch-off. A wrapper that finds its recorder idle (the monitor's own collectives, a nested
call) calls the original at once.

Code that imported a collective by name (`from torch.distributed import all_reduce`, or Megatron's
`dist_all_gather_func = torch.distributed.all_gather_into_tensor`) holds the original in a module global:
the first install scans the modules already imported (outside torch and trainermon) once for such
aliases, and each install patches the ones that still hold the original. Modules imported after that
scan, and aliases held elsewhere (a class attribute, a closure), keep the original and are not seen.

Each wrapper calls what it replaced through a one-item list, its link (`__trainermon_link__`): a wrapper
left under another monitor's (a monitor dropped without `close()` while a newer one is patched over it)
is spliced out of the chain when it is removed, instead of staying in it for the rest of the process."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from .spec import BATCH_P2P, OpSpec

logger = logging.getLogger("trainermon")
_inside = threading.local()  # a wrapper is running on this thread: nested collectives are its own


COALESCING = "_coalescing_manager"


class Recorder(Protocol):
    def active(self) -> bool: ...
    def before(self, spec: OpSpec, args: tuple, kwargs: dict) -> Any: ...
    def after(self, ctx: Any, result: Any) -> None: ...
    def before_batch(self, ops: list) -> Any: ...
    def after_batch(self, ctx: Any, works: Any) -> None: ...
    def fault(self, where: str, exc: BaseException) -> None: ...
    def coalesced_done(self, cm: Any, async_ops: bool) -> None: ...


def _wrap(original: Any, spec: OpSpec, recorder: Recorder) -> Any:
    link = [original]  # what this wrapper calls: changed when a wrapper under it is spliced out

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        original = link[0]
        if getattr(_inside, "depth", 0) or not recorder.active():
            return original(*args, **kwargs)
        _inside.depth = 1
        try:
            try:
                ctx = recorder.before(spec, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - never reaches the training loop
                recorder.fault("collective pre-hook", exc)
                ctx = None
            result = original(*args, **kwargs)
            if ctx is not None:
                try:
                    recorder.after(ctx, result)
                except Exception as exc:  # noqa: BLE001
                    recorder.fault("collective post-hook", exc)
            return result
        finally:
            _inside.depth = 0

    wrapper.__trainermon_comm__ = True  # type: ignore[attr-defined]
    eager = _eager(wrapper)
    eager.__trainermon_link__ = link  # type: ignore[attr-defined]
    return eager


def _eager(wrapper: Any) -> Any:
    """Under torch.compile, dynamo would trace into the wrapper (its locks, frames and the native kernel
    cannot be traced; its statistics would see fake tensors): marked as not compilable, it runs eagerly
    with the real tensors, a graph break around each watched collective on collected steps only (dynamo
    guards on the patched function, so graphs compiled while it is not installed stay unbroken)."""
    try:
        import torch.compiler

        eager = torch.compiler.disable(wrapper)
    except Exception:  # noqa: BLE001 - a build without dynamo: nothing compiles anyway
        return wrapper
    eager.__trainermon_comm__ = True  # type: ignore[attr-defined]
    return eager


def _wrap_batch(original: Any, recorder: Recorder) -> Any:
    link = [original]

    @functools.wraps(original)
    def wrapper(p2p_op_list: list, *args: Any, **kwargs: Any) -> Any:
        original = link[0]
        if getattr(_inside, "depth", 0) or not recorder.active():
            return original(p2p_op_list, *args, **kwargs)
        _inside.depth = 1
        try:
            try:
                ctx = recorder.before_batch(list(p2p_op_list))
            except Exception as exc:  # noqa: BLE001
                recorder.fault("collective pre-hook", exc)
                ctx = None
            works = original(p2p_op_list, *args, **kwargs)
            if ctx is not None:
                try:
                    recorder.after_batch(ctx, works)
                except Exception as exc:  # noqa: BLE001
                    recorder.fault("collective post-hook", exc)
            return works
        finally:
            _inside.depth = 0

    wrapper.__trainermon_comm__ = True  # type: ignore[attr-defined]
    wrapper.__trainermon_link__ = link  # type: ignore[attr-defined]
    return wrapper


def find_aliases(originals: dict[int, Any]) -> list[tuple[Any, str, Any]]:
    """(module, attribute, original) for every module global outside torch and trainermon that holds one
    of `originals` (by identity). One pass over the imported modules."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or name in ("torch", "trainermon") or name.startswith(("torch.", "trainermon.")):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            if id(value) in originals and originals[id(value)] is value:
                found.append((module, attr, value))
    return found


def _wrap_coalescing(original: Any, recorder: Recorder) -> Any:
    """Inside `_coalescing_manager` a collective only queues its op; the data moves at the block's exit,
    so the outputs of the calls queued in it are read there (or when its work completes)."""
    link = [original]

    @contextlib.contextmanager
    @functools.wraps(original)
    def wrapper(group: Any = None, device: Any = None, async_ops: bool = False):  # noqa: ANN202
        with link[0](group, device, async_ops) as cm:
            yield cm
        if recorder.active():
            try:
                recorder.coalesced_done(cm, async_ops)
            except Exception as exc:  # noqa: BLE001
                recorder.fault("collective post-hook", exc)

    wrapper.__trainermon_comm__ = True  # type: ignore[attr-defined]
    wrapper.__trainermon_link__ = link  # type: ignore[attr-defined]
    return wrapper


class Patches:
    """The installed wrappers and what they replaced."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, Any]] = []  # (module, attr, original, wrapper)
        self._aliases: list[tuple[Any, str, Any]] | None = None  # found at the first install

    @property
    def installed(self) -> bool:
        return bool(self._saved)

    def install(self, specs: Sequence[OpSpec], batch: bool, recorder: Recorder) -> None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        from torch.distributed import distributed_c10d as c10d

        if self._saved:
            return
        modules = {"dist": dist, "funcol": funcol}
        wrappers: dict[int, Any] = {}
        for spec in specs:
            module = modules[spec.module]
            original = getattr(module, spec.attr, None)
            if original is None:
                continue
            wrapper = _wrap(original, spec, recorder)
            wrappers[id(original)] = wrapper
            self._set(module, spec.attr, original, wrapper)
            if spec.attr in ("isend", "irecv") and getattr(c10d, spec.attr) is original:
                # P2POp checks its op against c10d's own isend/irecv: the same wrapper there keeps
                # P2POp(dist.isend, ...) valid while patched.
                self._set(c10d, spec.attr, original, wrapper)
        if batch and getattr(dist, BATCH_P2P, None) is not None:
            original = getattr(dist, BATCH_P2P)
            wrappers[id(original)] = _wrap_batch(original, recorder)
            self._set(dist, BATCH_P2P, original, wrappers[id(original)])
        original = getattr(dist, COALESCING, None)
        if original is not None:
            wrappers[id(original)] = _wrap_coalescing(original, recorder)
            self._set(dist, COALESCING, original, wrappers[id(original)])
        originals = {id(orig): orig for _, _, orig, _ in self._saved}
        if self._aliases is None or any(id(orig) not in originals for _, _, orig in self._aliases):
            # Scanned when something else was installed (another monitor's wrapper, since spliced out and
            # put back as torch's own): those aliases now hold other objects, so scan again.
            self._aliases = find_aliases(originals)
        for module, attr, original in self._aliases:
            if id(original) in wrappers and getattr(module, attr, None) is original:
                self._set(module, attr, original, wrappers[id(original)])

    def forget_aliases(self) -> None:
        """Scan again at the next install (a new config may watch other functions)."""
        self._aliases = None

    def _set(self, module: Any, attr: str, original: Any, wrapper: Any) -> None:
        setattr(module, attr, wrapper)
        self._saved.append((module, attr, original, wrapper))

    def uninstall(self) -> None:
        """Put back what each wrapper calls now; a wrapper another monitor's wrapper replaced is spliced out
        of that one's link. Changes module attributes and links only (no dict grows or shrinks)."""
        spliced: set[int] = set()  # one wrapper set in several modules (c10d, aliases): one chain
        for module, attr, original, wrapper in reversed(self._saved):
            link = getattr(wrapper, "__trainermon_link__", None)
            below = original if link is None else link[0]  # a wrapper under ours may be spliced out since
            current = getattr(module, attr, None)
            if current is wrapper:
                setattr(module, attr, below)
            elif id(wrapper) in spliced:
                continue
            elif _splice(current, wrapper, below):
                spliced.add(id(wrapper))
            else:  # another tool's wrapper: it stays, ours is idle from here on
                logger.warning(
                    "trainermon: %s.%s was replaced while cc_distribution watched it; left as it is",
                    module.__name__,
                    attr,
                )
        self._saved.clear()


def _splice(top: Any, wrapper: Any, below: Any) -> bool:
    """Make the trainermon wrapper that calls `wrapper` (in the chain of our wrappers from `top`) call
    `below` instead. False when the chain reaches something else first."""
    node = top
    for _ in range(256):  # a chain is as long as the monitors patched over one another
        link = getattr(node, "__trainermon_link__", None)
        if link is None:
            return False
        if link[0] is wrapper:
            link[0] = below
            return True
        node = link[0]
    return False
