"""Names as the user's model names them: wrapper segments removed, optional msprobe-style squashing."""

from __future__ import annotations

import re

#: Segments that wrappers insert into parameter and module names (FSDP1, torch.compile, checkpointing).
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")
_SQUASH_PATTERNS = [
    re.compile(p)
    for p in (
        r"(?:^|\.)(layers?\..*)$",
        r"(?:^|\.)(embeddings?\..*)$",
        r"(?:^|\.)(final.*)$",
        r"(?:^|\.)(output.*)$",
        r"(?:^|\.)(norm.*)$",
    )
]


def clean_name(name: str) -> str:
    """Drop wrapper segments: 'layers.0._fsdp_wrapped_module.fc.weight' -> 'layers.0.fc.weight'."""
    if not any(seg in name for seg in WRAPPER_SEGMENTS):
        return name
    parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
    return ".".join(parts)


def squash_name(name: str) -> str:
    """msprobe's `squash_name`: keep the tail from the first 'layers.'/'embedding.'/... segment."""
    for pattern in _SQUASH_PATTERNS:
        match = pattern.search(name)
        if match:
            return match.group(1)
    return name


def unique_names(names: list[str], fallbacks: list[str]) -> list[str]:
    """Keep `names` where unique; where two collide, use the fallback (unsquashed) names for them."""
    seen: dict[str, int] = {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
    out = [n if seen[n] == 1 else f for n, f in zip(names, fallbacks)]
    if len(set(out)) != len(out):  # still colliding: suffix with an index, never silently merge
        counts: dict[str, int] = {}
        result = []
        for n in out:
            k = counts.get(n, 0)
            counts[n] = k + 1
            result.append(n if k == 0 else f"{n}#{k}")
        return result
    return out


#: trainermon's family -> msprobe's tag kind (its TensorBoard tags and in-memory metric keys)
MSPROBE_KIND = {
    "grad_unreduced": "pre_grad",
    "grad_reduced": "post_grad",
    "param_origin": "param_origin",
    "param_updated": "param_updated",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "actv": "actv",
    "actv_grad": "actv_grad",
}


def msprobe_tag(
    family: str, vpp_stage: int, name: str, micro_step: int | None, rank: int, unreduced: str = "pre_grad"
) -> str:
    """msprobe's tag of a row, without the `_{statistic}` suffix: `0:layers.0.weight/rank0/post_grad`,
    `0:layers.0.output:1/rank0/actv` (with the micro-step). `unreduced`: the kind of `grad_unreduced` rows
    (`Adapter.msprobe_unreduced_kind`)."""
    key = f"{vpp_stage}:{name}" if micro_step is None else f"{vpp_stage}:{name}:{micro_step}"
    kind = unreduced if family == "grad_unreduced" else MSPROBE_KIND.get(family, family)
    return f"{key}/rank{rank}/{kind}"
