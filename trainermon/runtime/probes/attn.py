"""The `attn_logit` family: per attention layer and collected step, the largest (and smallest) pre-softmax
attention logit q.k * scale of every head, over the step's micro-batches, on a sample of query positions
(`attn_logit_distribution.sample`, see runtime/attn_math.py), masked logits excluded.

Sites (the adapter's `attention_site`, adapters/attention.py): `torch.nn.MultiheadAttention`,
transformers attention modules, Megatron-Core's core attention. Their hooks are armed on collected steps
only and hand over q (sampled positions) and k; the extremes are computed there, on the device, in
chunks (no host sync, no full attention matrix), and kept as a running max / min per head.

At the post-step hook each layer adds hidden rows (`ATTN_HIDDEN`), one per global head (`micro_step` =
head index) whose values are [max, min] of this rank, placed as the adapter says tokens are spread
(`adapter.token_placement()`: Megatron tensor x data parallel ranks of the stage, else the default
group), so the collector's one packed reduction takes the max / min over the ranks that saw the head's
tokens. A tensor-parallel rank adds empty pieces for the heads it does not hold. The worker turns each
layer's rows into one `attn_logit` row (`pipeline/health.py`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainermon.collect.placement import Local, TensorPiece
from trainermon.names import clean_name
from trainermon.pipeline.health import ATTN_HIDDEN

from ..attn_math import head_extremes
from ..plan import StepPlan
from .base import Probe
from .eval_pass import GradForward
from .module_hooks import not_a_micro_batch

logger = logging.getLogger("trainermon")


class _Layer:
    __slots__ = ("vpp", "name", "site", "top", "low")

    def __init__(self, vpp: int, name: str, site: Any) -> None:
        self.vpp, self.name, self.site = vpp, name, site
        self.top: torch.Tensor | None = None
        self.low: torch.Tensor | None = None


class AttnLogitProbe(Probe):
    def __init__(self, loop: Any) -> None:
        super().__init__(loop)
        self.layers: dict[int, _Layer] = {}  # id(site) -> layer
        self.armed = False
        self.enabled = False
        self.sample = 256
        self._warned: set[str] = set()
        self._attached = False
        self._passes = GradForward("attn_logit")  # evaluation passes are not the step's micro-batches

    def attach(self) -> list[Any]:
        adapter, handles = self.loop.adapter, []
        find = getattr(adapter, "attention_site", None)
        if find is None:
            return []
        for vpp, root in enumerate(adapter.roots()):
            for name, module in root.named_modules():
                site = find(module)
                if site is None:
                    continue
                layer = _Layer(vpp, adapter.global_name(vpp, clean_name(name)), site)
                self.layers[id(site)] = layer
                handles.append(site.install(self))
        self._attached = True
        self._warn_none()
        return handles

    def configure(self, config) -> None:
        self.enabled = config.attn_logit_distribution.enable
        self.sample = config.attn_logit_distribution.sample
        self._warn_none()

    def _warn_none(self) -> None:
        if self.enabled and self._attached and not self.layers:
            self._once(
                "none",
                "trainermon: attn_logit_distribution is on but the model has no attention module it reads "
                "(torch.nn.MultiheadAttention, a transformers *Attention module, Megatron-Core "
                "DotProductAttention); no attn_logit rows",
            )

    def _once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    def begin(self, plan: StepPlan) -> None:
        self.armed = plan.attn and bool(self.layers)
        self._passes.arm(self.loop.adapter.roots(), self.armed)
        for layer in self.layers.values():
            layer.top = layer.low = None

    def close(self) -> None:
        self._passes.close()

    # ---- the sites' observer interface -----------------------------------------------------------
    def skips_call(self, site: Any) -> bool:
        """Whether the site's call is an evaluation pass (eval + no_grad, `eval_pass`): the sites ask first,
        before any work (projections, masks, faults). A dict lookup, two attribute reads and a C call."""
        layer = self.layers.get(id(site))
        return layer is not None and self._passes.skips(site.module, layer.name)

    def observe(
        self, site: Any, query: torch.Tensor, key: torch.Tensor, scale: float, keep: Any, positions: Any
    ) -> None:
        layer = self.layers.get(id(site))
        if layer is None or not_a_micro_batch():  # a framework's own pass (pipelining's shape inference)
            return
        if query.shape[1] != site.local_heads:
            raise ValueError(f"{layer.name}: {query.shape[1]} query heads, expected {site.local_heads}")
        top, low = head_extremes(query, key, scale, keep, positions)
        layer.top = top if layer.top is None else torch.maximum(layer.top, top)
        layer.low = low if layer.low is None else torch.minimum(layer.low, low)

    def fault(self, exc: BaseException) -> None:
        self.loop.faults.record("attention logit hook", exc)

    def skipped(self, site: Any, why: str) -> None:
        layer = self.layers.get(id(site))
        self.loop.faults.record("attention logit hook", ValueError(f"call not read: {why}"))
        self._once(
            f"skip:{why}",
            "trainermon: attn_logit: %s of %s is not read; that call is skipped",
            why,
            layer.name if layer else "?",
        )

    # ---- rows ------------------------------------------------------------------------------------
    def post_optim(self, plan: StepPlan) -> None:
        if not plan.attn or not self.layers:
            return
        placement = self.loop.adapter.token_placement()
        local = isinstance(placement, Local)
        entries = []
        unseen = [layer.name for layer in self.layers.values() if layer.top is None]
        if unseen:  # a forward that did not run the layer, or ran attention past the site
            self._once(
                "unseen",
                "trainermon: attn_logit: no attention call was read at step %d for %s (of %d layers); "
                "those layers have no row (their forward did not run, or computed attention without the "
                "module's attention function)",
                plan.step,
                unseen[:8],
                len(self.layers),
            )
        for layer in self.layers.values():
            site = layer.site
            values = None
            if layer.top is not None:
                values = torch.stack([layer.top, layer.low], dim=1)  # [local heads, 2]
            elif local:
                continue  # the layer did not run this step: no rows (nothing to agree on)
            for head in range(site.heads):
                i = head - site.head_offset
                mine = values is not None and 0 <= i < site.local_heads
                piece = TensorPiece(values[i] if mine else None, placement, (2,), torch.float32)
                entries.append((layer.vpp, layer.name, head, piece))
        if entries:
            self.loop.record(ATTN_HIDDEN, entries)
