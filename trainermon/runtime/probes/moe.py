"""The `moe_load` family: per MoE router and collected step, the tokens routed to each expert, summed over
every rank that routed some of them (data, context, tensor/sequence parallel ranks of the stage, so
expert-parallel ranks too), with the tokens the router dropped (capacity factor) and its auxiliary loss.

Routers: modules whose class name ends in `Router` and that know their expert count (`num_experts`, as
transformers' `MixtralTopKRouter`, or `config.num_moe_experts`, as Megatron-Core's `TopKRouter`). A
forward hook, armed on collected steps only, reads the router's own output (`routing_of`): the last
integer or bool tensor of it, a routing map when its last dimension is the expert count (`[tokens,
experts]` bool, Megatron, after token dropping; the one-hot `[batch, seq, experts]` integers of
transformers' Switch router), else top-k expert indices (`[tokens, k]` integers, Mixtral). Floating
tensors (logits, probabilities, weights) are never read as indices. Counts stay on the device (sum /
scatter_add, no host sync) and are summed over the step's micro-batches. A forward recomputed inside
backward (activation checkpointing) is not counted: its tokens were counted by the first forward. A router
whose output holds no routing tensor, or whose hook failed, is said once and gets NaN counts for the step:
its `moe_load` row is left out rather than written as zeros. Routers whose output would give wrong counts
(`UNSUPPORTED`: NLLB-MoE's top-2 router returns only its top-1 mask; DeepSpeed's `TopKGate` returns
pre-capacity counts and a dispatch mask) are named once as not supported and get no rows.

At the post-step hook each router adds hidden rows (`HIDDEN`): one per expert, whose value is this rank's
count, placed as the adapter says tokens are spread (`adapter.token_placement()`), so the collector sums
them over those ranks in its one packed reduction per group; then one row for the dropped tokens and one
for the aux loss where the router reports them: Megatron's first load-balancing loss of
`moe_router_load_balancing_type` (`aux_loss` -> its tracker's `load_balancing_loss`), this rank's
micro-batch mean scaled by (its reduce group's size / the placement's size), so that the collector's sum
is what Megatron logs (summed over the reduce group, tp x cp, averaged over data-parallel ranks). The
worker turns each router's rows into one `moe_load` row (`pipeline/health.py`). Counts travel as float32
values: exact up to 2^24 tokens per expert, rank and step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainermon.collect.placement import Local, TensorPiece
from trainermon.copies import CopySafe
from trainermon.names import clean_name
from trainermon.pipeline.health import MOE_AUX, MOE_DROPPED, MOE_HIDDEN

from ..plan import StepPlan
from .base import Probe
from .eval_pass import GradForward
from .module_hooks import in_backward, not_a_micro_batch

logger = logging.getLogger("trainermon")

# class name -> why moe_load cannot count its tokens from its output (never write wrong counts)
UNSUPPORTED = {
    "NllbMoeTop2Router": "a top-2 router whose output holds only its top-1 mask",
    "TopKGate": "DeepSpeed's gate, whose output holds counts before capacity dropping",
}
# Megatron's load-balancing types and the names their losses are logged under (attach_and_log_...)
AUX_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def router_experts(module: torch.nn.Module) -> int | None:
    """The number of experts of a top-k router module, None for other modules."""
    if not type(module).__name__.endswith("Router"):
        return None
    n = getattr(module, "num_experts", None)
    if n is None:
        n = getattr(getattr(module, "config", None), "num_moe_experts", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


class _Router:
    __slots__ = (
        "vpp",
        "name",
        "module",
        "experts",
        "counts",
        "dropped",
        "aux",
        "calls",
        "aux_again",
        "calls_again",
        "drops",
        "aux_name",
        "aux_share",
        "failed",
        "said",
    )

    def __init__(self, vpp: int, name: str, module: torch.nn.Module, experts: int) -> None:
        self.vpp, self.name, self.module, self.experts = vpp, name, module, experts
        config = getattr(module, "config", None)
        # what the router reports, decided from its config alike on every rank (rows must match)
        self.drops = getattr(config, "moe_expert_capacity_factor", None) is not None
        self.aux_name = aux_name(module)  # the one load-balancing loss written as aux_loss
        self.aux_share: int | None = None  # size of Megatron's reduce_group for the loss, read once
        self.said = False  # an output without a routing tensor, said once
        self.reset()

    @property
    def has_aux(self) -> bool:
        return self.aux_name is not None

    def reset(self) -> None:
        self.counts: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None
        self.aux: torch.Tensor | None = None
        self.calls = 0
        # the losses handed in by a recompute in backward: used only when the forward handed none
        # (Megatron attaches the loss only with grad enabled, so under its reentrant recompute, whose
        # first forward runs without grad, the recompute's is the only one)
        self.aux_again: torch.Tensor | None = None
        self.calls_again = 0
        self.failed = False  # this step's counts are unknown: NaN rows, no moe_load row


class MoEProbe(Probe):
    def __init__(self, loop: Any) -> None:
        super().__init__(loop)
        self.routers: list[_Router] = []
        self.armed = False
        self.enabled = False
        self._warned = False
        self._attached = False
        self.unsupported: list[str] = []  # "name (class)" of routers moe_load cannot count
        self._passes = GradForward("moe_load")  # evaluation passes route no training tokens

    def attach(self) -> list[Any]:
        adapter, handles = self.loop.adapter, []
        for vpp, root in enumerate(adapter.roots()):
            for name, module in root.named_modules():
                if type(module).__name__ in UNSUPPORTED:
                    self.unsupported.append(
                        f"{adapter.global_name(vpp, clean_name(name))} ({type(module).__name__})"
                    )
                    continue
                experts = router_experts(module)
                if experts is None:
                    continue
                router = _Router(vpp, adapter.global_name(vpp, clean_name(name)), module, experts)
                self.routers.append(router)
                handles.append(module.register_forward_hook(CopySafe(self._hook(router))))
                if router.has_aux:
                    handles.append(_wrap_aux(module, router, self))
        self._attached = True
        self._warn()
        return handles

    def configure(self, config) -> None:
        self.enabled = config.moe_distribution
        self._warn()

    def _warn(self) -> None:
        if not self.enabled or not self._attached or self._warned:
            return
        if self.unsupported:
            self._warned = True
            kinds = sorted({u.rsplit(" (", 1)[1][:-1] for u in self.unsupported})
            logger.warning(
                "trainermon: moe_distribution: router %s not supported by moe_load (%s): no moe_load rows "
                "for %s",
                ", ".join(kinds),
                "; ".join(f"{k}: {UNSUPPORTED[k]}" for k in kinds),
                ", ".join(self.unsupported[:4]) + (", ..." if len(self.unsupported) > 4 else ""),
            )
        elif not self.routers:
            self._warned = True
            logger.warning(
                "trainermon: moe_distribution is on but the model has no top-k router (a module whose class "
                "name ends in 'Router' with num_experts or config.num_moe_experts); no moe_load rows"
            )

    def begin(self, plan: StepPlan) -> None:
        self.armed = plan.moe and bool(self.routers)
        self._passes.arm(self.loop.adapter.roots(), self.armed)
        for router in self.routers:
            router.reset()

    def close(self) -> None:
        self._passes.close()

    def _hook(self, router: _Router):
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            # a framework's own pass or an evaluation pass (eval + no_grad: evaluate(), generate()) routes
            # no training tokens; a recompute in backward routes them again
            if not self.armed or not_a_micro_batch() or in_backward():
                return
            if self._passes.skips(module, router.name):
                return
            try:
                self._count(router, output)
            except Exception as exc:  # noqa: BLE001 - never into the training loop
                router.failed = True
                self.loop.faults.record("moe router hook", exc)

        return hook

    def _count(self, router: _Router, output: Any) -> None:
        found = routing_of(output, router.experts, _topk(router.module))
        if found is None:
            router.failed = True
            if not router.said:
                router.said = True
                logger.warning(
                    "trainermon: router %s returned no integer or bool tensor (expert indices or a routing "
                    "map, last dimension %d), only %s: its moe_load rows are left out",
                    router.name,
                    router.experts,
                    _describe(output),
                )
            return
        is_map, chosen = found
        chosen = chosen.detach()
        if is_map:  # routing map [tokens, experts] (Megatron, after dropping; Switch's one-hot)
            routed = chosen.reshape(-1, router.experts).sum(0)
            if router.drops:
                topk = int(getattr(router.module, "topk", 0) or 0)
                dropped = chosen.shape[0] * topk - routed.sum() if chosen.dim() == 2 else routed.sum() * 0
                router.dropped = dropped if router.dropped is None else router.dropped + dropped
        else:  # top-k expert indices [tokens, k] (transformers)
            index = chosen.reshape(-1).long()  # scatter_add, not bincount: bincount syncs on CUDA
            routed = torch.zeros(router.experts, dtype=torch.long, device=index.device)
            routed.scatter_add_(0, index, torch.ones_like(index))
        router.counts = routed if router.counts is None else router.counts + routed

    def post_optim(self, plan: StepPlan) -> None:
        if not plan.moe or not self.routers:
            return
        placement = self.loop.adapter.token_placement()
        size = 1 if isinstance(placement, Local) else _group_size(placement.over)
        entries = []
        for r in self.routers:
            device = r.counts.device if r.counts is not None else torch.device("cpu")
            counts = r.counts if r.counts is not None else torch.zeros(r.experts, device=device)
            values = counts.float()
            if r.failed:  # NaN: the merged rows tell the worker to leave this router out (health.py)
                values = torch.full((r.experts,), float("nan"), device=device)
            for e in range(r.experts):
                piece = TensorPiece(values[e : e + 1], placement, (1,), torch.int64)
                entries.append((r.vpp, r.name, e, piece))
            if r.drops:
                dropped = r.dropped if r.dropped is not None else torch.zeros((), device=device)
                piece = TensorPiece(dropped.float().reshape(1), placement, (1,), torch.int64)
                entries.append((r.vpp, r.name, MOE_DROPPED, piece))
            if r.has_aux:
                # the collector sums over the placement; Megatron sums over reduce_group, averages the rest
                share = (r.aux_share or 1) / size
                aux, calls = (r.aux, r.calls) if r.calls else (r.aux_again, r.calls_again)
                # no loss handed in this step: NaN (unknown), never a zero that reads as balanced
                aux = torch.full((), float("nan"), device=device) if aux is None else aux * (share / calls)
                piece = TensorPiece(aux.float().reshape(1), placement, (1,), torch.float32)
                entries.append((r.vpp, r.name, MOE_AUX, piece))
        self.loop.record(MOE_HIDDEN, entries)


def routing_of(output: Any, experts: int, topk: int | None) -> tuple[bool, torch.Tensor] | None:
    """(is a routing map, tensor): the last integer or bool tensor of a router's output (the output
    itself, or the tensors of a tuple / list). A map when it is bool, or when its last dimension is the
    expert count (unless the router routes each token to all of them, `topk == experts`); top-k indices
    otherwise. None when the output holds no such tensor (logits or probabilities only)."""
    if isinstance(output, torch.Tensor):
        tensors = [output]
    elif isinstance(output, (tuple, list)):
        tensors = [t for t in output if isinstance(t, torch.Tensor)]
    else:
        return None
    for t in reversed(tensors):
        if t.dtype == torch.bool:
            return True, t
        if not (t.is_floating_point() or t.is_complex()):
            return (t.dim() >= 2 and t.shape[-1] == experts and topk != experts), t
    return None


def _topk(module: torch.nn.Module) -> int | None:
    for attr in ("topk", "top_k"):
        k = getattr(module, attr, None)
        if isinstance(k, int) and not isinstance(k, bool):
            return k
    return None


def _describe(output: Any) -> str:
    items = output if isinstance(output, (tuple, list)) else [output]
    kinds = [f"{t.dtype} {list(t.shape)}" for t in items if isinstance(t, torch.Tensor)]
    return ", ".join(kinds) or type(output).__name__


def _group_size(groups: tuple) -> int:
    import torch.distributed as dist

    size = 1
    for g in groups:
        size *= dist.get_world_size(group=g)
    return size


class _Restore:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("attach_and_log_load_balancing_loss", None)


def aux_name(module: torch.nn.Module) -> str | None:
    """The name Megatron logs the router's first load-balancing loss under (its first type of
    `moe_router_load_balancing_type` with a nonzero coefficient), None when it has none. Read once."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(module, "attach_and_log_load_balancing_loss"):
        return None
    kinds = getattr(config, "moe_router_load_balancing_type", "aux_loss")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or ())
    coeffs = getattr(config, "moe_aux_loss_coeff", 0.0)
    for i, kind in enumerate(kinds):
        if kind not in AUX_NAMES:  # sinkhorn, none: no loss handed to attach_and_log_...
            continue
        get = getattr(module, "get_aux_loss_coeff", None)  # a list of coefficients, one per type
        if callable(get):
            coeff = get(kind)
        else:
            coeff = coeffs[i] if isinstance(coeffs, (list, tuple)) and i < len(coeffs) else coeffs
        if coeff:
            return AUX_NAMES[kind]
    return None


def _wrap_aux(module: torch.nn.Module, router: _Router, probe: MoEProbe) -> _Restore:
    """Megatron's router hands its load-balancing losses to `attach_and_log_load_balancing_loss` (0.16.1:
    (activation, coeff, aux_loss, name, reduce_group, reduce_group_has_dp, ...)): read the one named
    `router.aux_name` there on collected steps (a device tensor; the group size is read once)."""
    original = module.attach_and_log_load_balancing_loss

    def attach(*args: Any, **kwargs: Any) -> Any:
        if probe.armed:
            try:
                name = kwargs.get("aux_loss_name", args[3] if len(args) > 3 else None)
                aux = kwargs.get("aux_loss", args[2] if len(args) > 2 else None)
                coeff = kwargs.get("aux_loss_coeff", args[1] if len(args) > 1 else 1.0)
                # the one loss written as aux_loss (a call without a name: the router's only one)
                if name in (None, router.aux_name) and isinstance(aux, torch.Tensor) and coeff:
                    value = aux.detach().float() / float(coeff)  # as Megatron logs it: before its coeff
                    if in_backward():  # a recompute hands the forward's loss again: kept apart
                        router.aux_again = value if router.aux_again is None else router.aux_again + value
                        router.calls_again += 1
                    else:
                        router.aux = value if router.aux is None else router.aux + value
                        router.calls += 1
                    if router.aux_share is None:
                        group = kwargs.get("reduce_group", args[4] if len(args) > 4 else None)
                        # under sequence / context parallelism each rank's loss is a partial sum
                        router.aux_share = _group_size((group,)) if group is not None else 1
            except Exception as exc:  # noqa: BLE001
                probe.loop.faults.record("moe aux loss", exc)
        return original(*args, **kwargs)

    module.attach_and_log_load_balancing_loss = CopySafe(attach, original)
    return _Restore(module)
