"""Names as the user's model names them: wrapper segments removed, optional msprobe-style squashing."""

from __future__ import annotations

import re

#: Segments that wrappers insert into parameter and module names (FSDP1, torch.compile, checkpointing).
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")
#: msprobe's `squash_param_name` rules, in its order: the first rule that matches keeps the tail from the
#: LAST `.layers.`/`.layer.`/`.embedding(s).`/`.final`/`.output`/`.norm` (a dot before it: a name that starts
#: with `layers.` has no match there, so `layers.0.norm.weight` becomes `norm.weight`).
_SQUASH_PATTERNS = [
    re.compile(r".*\.(" + tail + r".*)", re.DOTALL)
    for tail in (r"layers?\.", r"embeddings?\.", "final", "output", "norm")
]


#: `target_form`'s segments: the first occurrence from the start of the name.
_TARGET_PATTERNS = [
    re.compile(r"(?:^|\.)(" + tail + r".*)$", re.DOTALL)
    for tail in (r"layers?\.", r"embeddings?\.", "final", "output", "norm")
]


def clean_name(name: str) -> str:
    """Drop wrapper segments: 'layers.0._fsdp_wrapped_module.fc.weight' -> 'layers.0.fc.weight'. A name
    that UTF-8 cannot hold (a lone surrogate, as `os.fsdecode` makes of undecodable bytes) gets the
    character's escape (`\\udcff`): every sink writes UTF-8, and one such name once switched them all off."""
    if not name.isascii():
        name = name.encode("utf-8", "backslashreplace").decode("utf-8")
    if not any(seg in name for seg in WRAPPER_SEGMENTS):
        return name
    parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
    return ".".join(parts)


def squash_name(name: str) -> str:
    """msprobe's `squash_name`: `model.layers.3.mlp.weight` -> `layers.3.mlp.weight`,
    `layers.0.norm.weight` -> `norm.weight` (the rules of `_SQUASH_PATTERNS`); unchanged when none matches."""
    for pattern in _SQUASH_PATTERNS:
        match = pattern.fullmatch(name)
        if match:
            return match.group(1)
    return name


def unique_names(names: list[str], fallbacks: list[str], stages: list[int] | None = None) -> list[str]:
    """msprobe's rule, in order: a name keeps its squashed form unless an earlier one took it, then it
    gets its fallback (unsquashed) name (`norm.weight`, then `layers.1.norm.weight`). A name still taken
    gets an index suffix (`#1`): never two rows under one name. `stages`: each name's model chunk (vpp
    stage); names of different chunks never collide (rows carry the stage, msprobe's names `0:`/`1:`)."""
    taken: set[tuple[int, str]] = set()
    out = []
    for i, (name, fallback) in enumerate(zip(names, fallbacks)):
        stage = stages[i] if stages is not None else 0
        if (stage, name) in taken:
            name = fallback
        base, k = name, 0
        while (stage, name) in taken:
            k += 1
            name = f"{base}#{k}"
        taken.add((stage, name))
        out.append(name)
    return out


def target_form(name: str) -> str:
    """The name from its first `layers.`/`embedding.`/`final`/`output`/`norm` segment on
    (`model.layers.0.fc.weight` -> `layers.0.fc.weight`): a target may name a parameter this way too,
    with or without `squash_name` (msprobe 26.2 matches it only with `squash_name` on: this selects more,
    never less)."""
    for pattern in _TARGET_PATTERNS:
        match = pattern.search(name)
        if match:
            return match.group(1)
    return name


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


def rename_prefixes(name: str, renames: dict[str, str]) -> str:
    """`name` with each dotted prefix found in `renames` given a new last segment: an adapter's local
    expert numbers made global (`experts.1` -> `experts.5` on expert-parallel rank 2 of 4 local experts
    each), for every parameter and module under that prefix."""
    if not renames:
        return name
    parts = name.split(".")
    out = list(parts)
    for k in range(1, len(parts) + 1):
        new = renames.get(".".join(parts[:k]))
        if new is not None:
            out[k - 1] = new
    return ".".join(out)
