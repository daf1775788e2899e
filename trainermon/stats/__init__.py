"""Statistics: the table of statistics (`table`), which tensors can be read (`kinds`), partial statistics
and how they merge (`partials`), and the engine that computes them on the tensor's device (`engine`, with
the native CPU kernel in `fused`).

Names are imported on first use: the table is needed by the offline tools, which run without torch."""

from __future__ import annotations

_EXPORTS = {
    "engine": ("GROUP_MAX", "EngineOptions", "StatsEngine"),
    "eager": ("CHUNK", "DEVICE_CHUNK", "RUN"),
    "kinds": ("Readable", "Unreadable", "readable"),
    "partials": (
        "ADDITIVE",
        "INFS",
        "MAX",
        "MIN",
        "NANS",
        "NUM_PARTIALS",
        "PARTIALS",
        "SUM",
        "SUMSQ",
        "ZEROS",
        "empty_partials",
        "finalize",
        "grad_sumsq",
        "merge",
        "reduce_across",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module == "engine":
        from . import engine as source
    elif module == "eager":
        from . import eager as source
    elif module == "kinds":
        from . import kinds as source
    elif module == "partials":
        from . import partials as source
    else:
        raise AttributeError(f"module 'trainermon.stats' has no attribute {name!r}")
    return getattr(source, name)
