"""Where the `attn_logit` family reads queries and keys (plugin side: the frameworks are looked up in
`sys.modules`, never imported).

- `torch.nn.MultiheadAttention`: a forward pre-hook recomputes this call's q (sampled positions only) and
  k from the module's own in-projection; masks: `attn_mask` (bool True = masked, or additive float),
  `key_padding_mask`, `is_causal` without a mask. The extra key of `add_bias_kv` / `add_zero_attn` is
  not included.
- transformers attention modules (a class of `transformers.*` whose name ends in `Attention`, with a
  `config._attn_implementation`): every implementation (eager, sdpa, flash, flex) is fetched through
  `AttentionInterface.get_interface` and called as `fn(module, query, key, value, attention_mask,
  scaling=...)` with q and k after the rotary embedding, so that lookup is wrapped (once, at class level,
  undone with the last handle) to see them. Masks: transformers' boolean (True = visible) or additive
  float masks; no mask means causal where the module is causal, as sdpa decides. A non-tensor mask
  (flex attention's BlockMask) is not read: the call is skipped and counted. A model that computes
  attention without the interface (GPT-2's `reorder_and_upcast_attn`) gives no rows for those layers.
- Megatron-Core `DotProductAttention` (the local core attention): a forward pre-hook on
  (query [sq, b, np, hn], key [sk, b, ng, hn], attention_mask), scale `softmax_scale` (so with
  `apply_query_key_layer_scaling` the logit Megatron feeds its softmax); mask bool True = masked, else
  causal when `attn_mask_type` is causal. Heads are this tensor-parallel rank's: global index = tp rank
  x heads per partition + local index.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from trainermon.copies import CopySafe
from trainermon.runtime.attn_math import causal_keep, mask_keep, sample_positions


class AttnSite:
    """One attention module: `heads` global heads, this rank's are `head_offset + range(local_heads)`."""

    kind = ""

    def __init__(self, module: torch.nn.Module, heads: int, local_heads: int, head_offset: int = 0) -> None:
        self.module, self.heads, self.local_heads, self.head_offset = module, heads, local_heads, head_offset

    def install(self, observer: Any) -> Any:
        """Start handing (site, query [B,H,n,D], key [B,Hkv,Sk,D], scale, keep, positions) to
        `observer.observe` while `observer.armed`, unless `observer.skips_call(site)` (an evaluation pass,
        asked before any work); returns a handle with `remove()`."""
        raise NotImplementedError


def find_site(module: torch.nn.Module) -> AttnSite | None:
    """The attention site of `module`, or None."""
    if isinstance(module, torch.nn.MultiheadAttention):
        return _MhaSite(module, module.num_heads, module.num_heads)
    cls = type(module)
    path = cls.__module__
    if path.startswith("transformers.") and cls.__name__.endswith("Attention"):
        config = getattr(module, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        if hasattr(config, "_attn_implementation") and isinstance(heads, int):
            return _HfSite(module, heads, heads)
    if path.startswith("megatron.core") and cls.__name__ == "DotProductAttention":
        local = int(module.num_attention_heads_per_partition)
        group = getattr(module, "tp_group", None)
        rank = group.rank() if group is not None and hasattr(group, "rank") else 0
        return _MegatronSite(module, int(module.config.num_attention_heads), local, rank * local)
    return None


# ---- torch.nn.MultiheadAttention ------------------------------------------------------------------
_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights")


class _MhaSite(AttnSite):
    kind = "torch.nn.MultiheadAttention"

    def install(self, observer: Any) -> Any:
        def hook(module: torch.nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
            if observer.armed and not observer.skips_call(self):  # an evaluation pass: no work
                try:
                    got = dict(zip(_MHA_ARGS, args)) | kwargs
                    self._observe(module, got, observer)
                except Exception as exc:  # noqa: BLE001
                    observer.fault(exc)

        return self.module.register_forward_pre_hook(CopySafe(hook), with_kwargs=True)

    def _observe(self, m: torch.nn.MultiheadAttention, got: dict, observer: Any) -> None:
        query, key = got["query"], got["key"]
        if query.dim() == 2:  # unbatched [L, E]
            query, key = query.unsqueeze(0), key.unsqueeze(0)
        elif not m.batch_first:  # [L, B, E] -> [B, L, E]
            query, key = query.transpose(0, 1), key.transpose(0, 1)
        e, h = m.embed_dim, m.num_heads
        d = e // h
        if m._qkv_same_embed_dim:
            wq, wk = m.in_proj_weight[:e], m.in_proj_weight[e : 2 * e]
        else:
            wq, wk = m.q_proj_weight, m.k_proj_weight
        bias = m.in_proj_bias
        bq, bk = (None, None) if bias is None else (bias[:e], bias[e : 2 * e])
        b, sq, sk = query.shape[0], query.shape[1], key.shape[1]
        positions = sample_positions(sq, observer.sample, query.device)
        with torch.no_grad():
            q = torch.nn.functional.linear(query.detach().index_select(1, positions), wq, bq)
            k = torch.nn.functional.linear(key.detach(), wk, bk)
        q = q.view(b, -1, h, d).transpose(1, 2)
        k = k.view(b, sk, h, d).transpose(1, 2)
        keep = None
        mask = got.get("attn_mask")
        if mask is not None:
            if mask.dim() == 3:  # [B * H, L, S]
                mask = mask.view(b, h, mask.shape[-2], mask.shape[-1])
            keep = mask_keep(mask, true_means_visible=False)
        elif got.get("is_causal") and sq > 1:
            keep = causal_keep(sq, sk, query.device)
        pad = got.get("key_padding_mask")
        if pad is not None:
            pad_keep = mask_keep(pad.view(b, 1, 1, sk), true_means_visible=False)
            keep = pad_keep if keep is None else _and(keep, pad_keep)
        observer.observe(self, q, k, 1.0 / math.sqrt(d), keep, positions)


def _and(a: Any, b: Any) -> Any:
    return lambda pos: a(pos) & b(pos)


# ---- transformers -----------------------------------------------------------------------------------
_HF_SITES: dict[int, tuple[AttnSite, Any]] = {}  # id(module) -> (site, observer)
_HF_PATCH: dict[str, Any] = {}  # "original": the class's get_interface while patched


class _HfSite(AttnSite):
    kind = "transformers attention"

    def install(self, observer: Any) -> Any:
        _HF_SITES[id(self.module)] = (self, observer)
        _patch_interface()
        return _HfHandle(id(self.module))

    def observe_call(self, observer: Any, query: Any, key: Any, mask: Any, kwargs: dict) -> None:
        if not isinstance(query, torch.Tensor) or query.dim() != 4:
            return
        if mask is not None and not isinstance(mask, torch.Tensor):
            observer.skipped(self, f"attention mask of type {type(mask).__name__}")
            return
        sq, sk = query.shape[2], key.shape[2]
        scale = kwargs.get("scaling")
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        if mask is not None:
            keep = mask_keep(mask[..., :sk], true_means_visible=True)
        elif sq > 1 and getattr(self.module, "is_causal", True):
            keep = causal_keep(sq, sk, query.device)
        else:
            keep = None
        positions = sample_positions(sq, observer.sample, query.device)
        observer.observe(self, query.index_select(2, positions), key, scale, keep, positions)


class _HfHandle:
    def __init__(self, key: int) -> None:
        self.key = key

    def remove(self) -> None:
        if _HF_SITES.pop(self.key, None) is not None and not _HF_SITES:
            _unpatch_interface()


def _patch_interface() -> None:
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None or "original" in _HF_PATCH:
        return
    cls = modeling.AttentionInterface
    original = cls.get_interface
    wrapped: dict[Any, Any] = {}  # one wrapper per attention function

    def get_interface(self: Any, attn_implementation: str, default: Any) -> Any:
        fn = original(self, attn_implementation, default)
        out = wrapped.get(fn)
        if out is None:
            out = wrapped[fn] = _wrap(fn)
        return out

    _HF_PATCH["original"], _HF_PATCH["cls"] = original, cls
    cls.get_interface = get_interface


def _unpatch_interface() -> None:
    original = _HF_PATCH.pop("original", None)
    if original is not None:
        _HF_PATCH.pop("cls").get_interface = original


def _wrap(fn: Any) -> Any:
    def attention(module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        entry = _HF_SITES.get(id(module))
        if entry is not None and entry[1].armed and not entry[1].skips_call(entry[0]):
            site, observer = entry
            mask = args[0] if args else kwargs.get("attention_mask")
            try:
                site.observe_call(observer, query, key, mask, kwargs)
            except Exception as exc:  # noqa: BLE001
                observer.fault(exc)
        return fn(module, query, key, value, *args, **kwargs)

    attention.__wrapped__ = fn
    return attention


# ---- Megatron-Core ----------------------------------------------------------------------------------
class _MegatronSite(AttnSite):
    kind = "Megatron-Core DotProductAttention"

    def install(self, observer: Any) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            if observer.armed and not observer.skips_call(self):  # an evaluation pass: no work
                try:
                    names = ("query", "key", "value", "attention_mask")
                    got = dict(zip(names, args)) | kwargs
                    self._observe(module, got, observer)
                except Exception as exc:  # noqa: BLE001
                    observer.fault(exc)

        return self.module.register_forward_pre_hook(CopySafe(hook), with_kwargs=True)

    def _observe(self, module: Any, got: dict, observer: Any) -> None:
        query = got["query"].permute(1, 2, 0, 3)  # [sq, b, np, hn] -> [b, np, sq, hn]
        key = got["key"].permute(1, 2, 0, 3)
        sq, sk = query.shape[2], key.shape[2]
        mask = got.get("attention_mask")
        if mask is not None:
            keep = mask_keep(mask, true_means_visible=False)
        elif getattr(module.attn_mask_type, "name", "") == "causal" and sq > 1:
            keep = causal_keep(sq, sk, query.device)
        else:
            keep = None
        positions = sample_positions(sq, observer.sample, query.device)
        observer.observe(
            self, query.index_select(2, positions), key, float(module.softmax_scale), keep, positions
        )
