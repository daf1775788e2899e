"""Pre-softmax attention logits q.k * scale, per head, on a sample of query positions, in chunks.

`head_extremes` is the computation behind the `attn_logit` family (runtime/probes/attn.py): the largest
and the smallest logit of each head over the batch, the sampled query positions and every key position
the mask lets that query see. It never builds the whole [batch, heads, queries, keys] matrix of a long
sequence: queries go in chunks of at most `CHUNK_ELEMENTS` logits (float32, 64 MiB; with a mask, one
masked copy of the chunk and the mask's rows for it besides: about 150 MiB transient at most), plus a
float32 copy of the keys when they are in a lower precision. Everything stays on the tensors' device (no
host sync); the result is two [heads] float32 tensors, -inf / +inf for a head that has no visible logit
(every sampled query fully masked).

Query sampling: all positions when a sequence has at most `sample` of them, else `sample` positions
evenly spaced from the first to the last (both included), the same positions for every sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK_ELEMENTS = 1 << 24  # logits per chunk: 64 MiB of float32 at most, whatever the sequence length

#: keep(query_positions [c] long) -> bool mask broadcastable to [batch, heads, c, keys], True = visible;
#: None when every key is visible to every query.
KeepFn = Callable[[torch.Tensor], torch.Tensor | None]


def sample_positions(length: int, sample: int, device: torch.device) -> torch.Tensor:
    """The query positions measured in a sequence of `length` (see the module docstring)."""
    if length <= sample:
        return torch.arange(length, device=device)
    if sample == 1:
        return torch.arange(length - 1, length, device=device)  # torch.tensor(..., device) would sync
    return torch.div(torch.arange(sample, device=device) * (length - 1), sample - 1, rounding_mode="floor")


def head_extremes(
    query: torch.Tensor, key: torch.Tensor, scale: float, keep: KeepFn | None, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [B, H, n, D] at the sampled `positions` [n] of the sequence, key [B, Hkv, Sk, D] (H a
    multiple of Hkv: query head h reads key head h // (H / Hkv), grouped-query attention as transformers
    and Megatron-Core lay it out). Returns the (max, min) over the batch, the sampled queries and the
    visible keys of q.k * scale, per head."""
    with torch.no_grad():
        b, h, n, d = query.shape
        hkv, sk = key.shape[1], key.shape[2]
        group = h // hkv
        # float32 logits whatever the model's dtype: a transient float32 copy of the keys (B*Hkv*Sk*D)
        k = key.detach().float().transpose(-1, -2)  # [B, Hkv, D, Sk]
        q = query.detach().float() * scale  # [B, H, n, D]
        step = max(1, CHUNK_ELEMENTS // max(1, b * h * sk))
        top = torch.full((h,), float("-inf"), device=query.device)
        low = torch.full((h,), float("inf"), device=query.device)
        for start in range(0, n, step):
            stop = min(n, start + step)
            if group > 1:  # [B, Hkv, group, c, D] @ [B, Hkv, 1, D, Sk] -> [B, H, c, Sk]
                qc = q.view(b, hkv, group, n, d)[:, :, :, start:stop]
                logits = (qc @ k.unsqueeze(2)).reshape(b, h, stop - start, sk)
            else:
                logits = q[:, :, start:stop] @ k  # [B, H, c, Sk]
            visible = keep(positions[start:stop]) if keep is not None else None
            if visible is None:
                top = torch.maximum(top, logits.amax(dim=(0, 2, 3)))
                low = torch.minimum(low, logits.amin(dim=(0, 2, 3)))
                continue
            hidden = ~visible  # broadcast by masked_fill: a causal mask stays [1, 1, c, Sk]
            top = torch.maximum(top, logits.masked_fill(hidden, float("-inf")).amax(dim=(0, 2, 3)))
            low = torch.minimum(low, logits.masked_fill_(hidden, float("inf")).amin(dim=(0, 2, 3)))
        return top, low


def causal_keep(sq: int, sk: int, device: torch.device) -> KeepFn:
    """Causal visibility, aligned at the end (query i sees keys up to i + sk - sq), as transformers and
    Megatron-Core align it; sq == sk in training."""
    keys = torch.arange(sk, device=device)
    offset = sk - sq

    def keep(pos: torch.Tensor) -> torch.Tensor:
        return (keys[None, :] <= (pos[:, None] + offset)).view(1, 1, pos.numel(), sk)

    return keep


def mask_keep(mask: torch.Tensor, true_means_visible: bool) -> KeepFn:
    """Visibility from an attention mask broadcastable to [B, H, Sq, Sk]: boolean (True = visible for
    transformers' masks, True = masked for PyTorch's and Megatron's) or additive float (visible where the
    bias is above -inf / the dtype's lowest value / 2: the values masks use to hide a key)."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.dtype == torch.bool:
        visible = mask if true_means_visible else ~mask
    else:
        visible = mask > torch.finfo(mask.dtype).min / 2

    def keep(pos: torch.Tensor) -> torch.Tensor:
        return visible.index_select(2, pos) if visible.shape[2] > 1 else visible

    return keep


def both(first: KeepFn | None, second: KeepFn | None) -> KeepFn | None:
    """Visible where both say visible."""
    if first is None or second is None:
        return first or second

    def keep(pos: torch.Tensor) -> torch.Tensor:
        a, b = first(pos), second(pos)
        if a is None or b is None:
            return a if b is None else b
        return a & b

    return keep
