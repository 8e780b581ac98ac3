"""Decode-step attention without copying the key/value cache: transformers' SDPA attention, grouped-query aware.

transformers 4.51's ``sdpa_attention_forward`` expands a grouped-query model's key/value heads to one per query head
(``repeat_kv``: ``expand`` then ``reshape``, a copy) before every attention call. In a decode step that copies the
whole cache of every layer, every step: measured on the producer's sampling loop (1 M-parameter Qwen2, 4 query / 2
key-value heads, 128 rows, 128 new tokens, one thread), ``repeat_kv`` took 1.47 s of 4.17 s, more than the attention
itself (0.99 s).

For one query position per row (a decode step) the query heads of a group can instead be laid along the query axis
of their key/value head: ``[B, H, 1, d]`` viewed as ``[B, H_kv, H / H_kv, d]``; the mask ``[B, 1, 1, C]`` broadcasts
over them. One SDPA call then reads each cached key/value once, with nothing copied. Everything else (prefill, the
trainers' forwards, dropout) goes to transformers' own function. Registered over ``"sdpa"`` in the producer's
process by :func:`use_in_this_process` (``TransformersBackend``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa_without_kv_copy(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` [B, H, q, d], ``key``/``value`` [B, H_kv, C, d];
    returns ([B, q, H, d], None) as ``sdpa_attention_forward`` does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1))
    batch, heads, positions, dim = query.shape
    if groups == 1 or positions != 1 or dropout != 0.0 or (attention_mask is not None and attention_mask.ndim != 4):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]
    grouped = query.reshape(batch, heads // groups, groups, dim)  # query head h reads key/value head h // groups
    output = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return output.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def use_in_this_process() -> None:
    """Every model of this process whose attention is ``"sdpa"`` uses :func:`sdpa_without_kv_copy`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_without_kv_copy
