"""FlashAttention's `flash_attn_varlen_func` in plain PyTorch, for test models where no kernel is at hand.

TRL's `AsyncGRPOTrainer` packs sequences and calls a varlen FlashAttention kernel fetched from the Hub
(`kernels-community/flash-attn3`), which neither CI (CPU) nor the GPU machine can fetch. This is the
same computation one segment at a time with `scaled_dot_product_attention`: the CPU test of TRL's
trainer against `grpo serve` and the GPU benchmark's reference (`bench/trl_async.py`) both use it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def segment_attention(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                      max_seqlen_k: int, softmax_scale: float | None = None, causal: bool = True,
                      window_size: tuple[int, int] = (-1, -1), **_: Any) -> Any:
    """(total, heads, dim) layout, causal bottom-right aligned (as FlashAttention when the key run is
    longer), grouped-query heads; no sliding window."""
    import torch
    import torch.nn.functional as F

    if tuple(window_size) != (-1, -1):
        raise ValueError("segment_attention: no sliding window")
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        query = q[qs:qe].transpose(0, 1)
        key = k[ks:ke].transpose(0, 1).repeat_interleave(groups, 0)
        value = v[ks:ke].transpose(0, 1).repeat_interleave(groups, 0)
        mask = None
        if causal:
            mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).tril(
                diagonal=(ke - ks) - (qe - qs))
        out[qs:qe] = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                    scale=softmax_scale).transpose(0, 1)
    return out


#: A stand-in for the kernel module TRL loads (`packing._flash_attn()` returns it; TRL calls its
#: `flash_attn_varlen_func`).
KERNEL = SimpleNamespace(flash_attn_varlen_func=segment_attention)
