"""Which parameters and modules the config selects, and the names they are written under.

A tied parameter (GPT-2's `lm_head.weight` is `transformer.wte.weight`) or a module registered under
two names is selected by a target naming any of its names, and written once, under the name
`named_parameters()` / `named_modules()` give it first.

Names are the unwrapped model's (`model.layers.0`, under every wrapper and framework). msprobe names the
modules of the object it was given, so under DDP its configs say `module.model.layers.0`: a target that
selects nothing as written is read without the wrapper path msprobe saw (`resolve_targets`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainermon.config import MonitorConfig
from trainermon.names import clean_name, squash_name, target_form, unique_names


@dataclass
class ParamSelection:
    """The monitored parameters (adapter order) and their output names."""

    params: list = field(default_factory=list)  # adapter MonitoredParams
    names: list[str] = field(default_factory=list)
    position: dict[int, int] = field(default_factory=dict)  # adapter index -> position in `params`
    stages: list[int] = field(init=False)  # each parameter's vpp_stage, as in `params`

    def __post_init__(self) -> None:
        self.stages = [mp.vpp_stage for mp in self.params]

    def entries(self, pieces: list, micro_step: int | None = None) -> list[tuple]:
        """(vpp_stage, name, micro_step, piece) for every parameter with a piece."""
        return [
            (mp.vpp_stage, name, micro_step, piece)
            for mp, name, piece in zip(self.params, self.names, pieces)
            if piece is not None
        ]


def param_aliases(adapter) -> dict[int, list[str]]:
    """id(parameter) -> its other names, for parameters registered under several (tied weights), named
    as a single-process model names them (the module part through `adapter.global_name`)."""
    out: dict[int, list[str]] = {}
    for vpp_stage, root in enumerate(adapter.roots()):
        names: dict[int, list[str]] = {}
        for name, p in root.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(clean_name(name))
        for pid, all_names in names.items():
            if len(all_names) > 1:
                out.setdefault(pid, []).extend(
                    _global_param_name(adapter, vpp_stage, n) for n in all_names[1:]
                )
    return out


def _global_param_name(adapter, vpp_stage: int, name: str) -> str:
    module, _, leaf = name.rpartition(".")
    return f"{adapter.global_name(vpp_stage, module)}.{leaf}" if module else name


def param_matches(vpp_stage: int, names: list[str], target: str, squash: bool = False) -> bool:
    """A target selects a parameter whose name (any of them) starts with it: plainly, from its first
    `layers.`/... segment (`target_form`), squashed (with `squash_name` on, as msprobe compares the
    squashed names then), or, for a target with a `:`, `vpp:`-prefixed. (msprobe also tries the `vpp:`
    form for a target without one, so that `"0"`, meant for module `0` of an `nn.Sequential`, selects
    every parameter of stage 0.)"""
    staged = ":" in target
    return any(
        n.startswith(target)
        or target_form(n).startswith(target)
        or (squash and squash_name(n).startswith(target))
        or (staged and f"{vpp_stage}:{n}".startswith(target))
        for n in names
    )


def cuts_a_name(params: list[tuple[int, list[str]]], target: str, squash: bool = False) -> str | None:
    """A name `target` selects by a prefix that ends inside one of its dotted parts (`layers.1` selecting
    `layers.10.weight`, or `model.layers.10.weight` by its `target_form`), or None: such a target selects
    more than the module it seems to name. `params`: (vpp_stage, names); every form `param_matches`
    selects by is checked."""
    if target.endswith((".", ":")):  # "0:" selects all of stage 0: it cuts no name
        return None
    for vpp_stage, names in params:
        for n in names:
            staged = f"{vpp_stage}:{n}" if ":" in target else n
            forms = {n, target_form(n), squash_name(n) if squash else n, staged}
            if any(f.startswith(target) and len(f) > len(target) and f[len(target)] != "." for f in forms):
                return n
    return None


def wrapper_paths(adapter) -> dict[int, list[str]]:
    """vpp_stage -> the paths msprobe would put before the unwrapped model's names, longest first
    (`["module.module.", "module."]` for DDP around Float16Module): the segments from each chunk the user
    passed down to its unwrapped root (`adapter.chunks` -> `adapter.roots()`). A path whose first segment
    names a real module of the unwrapped model is left out (stripping it would change what a target
    means). Costs a walk down the wrappers, at attach."""
    out: dict[int, list[str]] = {}
    for vpp_stage, (chunk, root) in enumerate(zip(getattr(adapter, "chunks", ()), adapter.roots())):
        if chunk is root:
            continue
        # pre-order: the root comes right after its wrappers, before any module of the model
        path = next((n for n, m in chunk.named_modules(remove_duplicate=False) if m is root), None)
        if not path:
            continue
        segments = path.split(".")
        if segments[0] in root._modules:
            continue
        out[vpp_stage] = [".".join(segments[:k]) + "." for k in range(len(segments), 0, -1)]
    return out


def _selects(target: str, params: list, modules: list, squash: bool) -> bool:
    return any(param_matches(v, names, target, squash) for v, names in params) or any(
        module_matches(v, names, (target,)) for v, names in modules
    )


def resolve_targets(adapter, config: MonitorConfig) -> dict[str, str]:
    """Each target (as written: `name` or `vpp:name`) -> the target selections use: itself, or, when it
    selects nothing as written but does without a wrapper path msprobe saw (`wrapper_paths`), that
    shorter form (`module.model.layers.0` -> `model.layers.0` under DDP). Attach-time work: one pass over
    the parameters and modules per target, only with wrappers and targets."""
    targets = config.targets
    paths = wrapper_paths(adapter) if targets else {}
    if not paths:
        return {t: t for t in targets}
    aliases = param_aliases(adapter)
    params = [(mp.vpp_stage, [mp.name, *aliases.get(id(mp.param), ())]) for mp in adapter.parameters()]
    modules = [(vpp, names) for vpp, names, _ in named_modules(adapter)]
    out = {}
    for target in targets:
        out[target] = target
        if _selects(target, params, modules, config.squash_name):
            continue
        stage, sep, name = target.partition(":")
        if not sep or not stage.isdigit():  # a plain name: any stage's wrappers
            stage, sep, name = "", "", target
        candidates = paths.get(int(stage), []) if stage else [p for ps in paths.values() for p in ps]
        for path in candidates:
            if name.startswith(path) and len(name) > len(path):
                shorter = f"{stage}{sep}{name[len(path) :]}"
                if _selects(shorter, params, modules, config.squash_name):
                    out[target] = shorter
                    break
    return out


def select_params(adapter, config: MonitorConfig) -> ParamSelection:
    """Parameters whose name (or a tied alias) starts with a target; all without targets. Names are
    squashed with `squash_name`, falling back to full names where they would collide."""
    targets = tuple(resolve_targets(adapter, config).values())
    aliases = param_aliases(adapter) if targets else {}
    chosen = []
    for mp in adapter.parameters():
        names = [mp.name, *aliases.get(id(mp.param), ())]
        if not targets or any(param_matches(mp.vpp_stage, names, t, config.squash_name) for t in targets):
            chosen.append(mp)
    names = [mp.name for mp in chosen]
    if config.squash_name:
        names = unique_names([squash_name(n) for n in names], names, [mp.vpp_stage for mp in chosen])
    return ParamSelection(chosen, names, {mp.index: i for i, mp in enumerate(chosen)})


def named_modules(adapter) -> list[tuple[int, list[str], torch.nn.Module]]:
    """(vpp_stage, [output name, other names...], module) of every module that is not a wrapper (nor
    scripted: torch.jit modules take no Python hooks), in model order; names in their single-process
    form only, as parameters are named. Attach-time work: one walk over each chunk's modules."""
    out = []
    seen: dict[int, list[str]] = {}
    for vpp_stage, root in enumerate(adapter.roots()):
        for name, module in root.named_modules(remove_duplicate=False):
            if not name or adapter.is_wrapper_module(module):
                continue
            if isinstance(module, torch.jit.ScriptModule):  # a scripted part takes no Python hooks
                continue
            # No chunk-local form: under pipeline stages (expert parallelism) a local name is another
            # layer's (expert's) global name, so a target would select activations of several layers but
            # the parameters of one
            forms = [adapter.global_name(vpp_stage, clean_name(name))]
            if id(module) in seen:
                seen[id(module)].extend(f for f in forms if f not in seen[id(module)])
                continue
            seen[id(module)] = forms
            out.append((vpp_stage, forms, module))
    return out


def module_matches(vpp_stage: int, names: list[str], targets) -> bool:
    return any(n in targets or f"{vpp_stage}:{n}" in targets for n in names)


def select_modules(adapter, config: MonitorConfig, every: bool) -> list[tuple[int, str, torch.nn.Module]]:
    """(vpp_stage, output name, module) of the modules whose activations are collected: every module
    (`every`), or those named in `targets` (any of their names, plainly or as `vpp:name`). Wrapper
    modules are skipped."""
    out = []
    targets = () if every else frozenset(resolve_targets(adapter, config).values())
    for vpp_stage, names, module in named_modules(adapter):
        if every or module_matches(vpp_stage, names, targets):
            name = names[0]
            out.append((vpp_stage, squash_name(name) if config.squash_name else name, module))
    return out
