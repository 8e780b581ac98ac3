"""Which block layout a micro-batch is cheaper in, from its shape (``--sequence-layout auto``).

``shared_prompt`` computes a group's prompt once, but lays the whole group out in one row: the prompt, then every
response. CPU attention (and SDPA with a float mask anywhere) computes every (query, key) pair of a row, whatever
the mask says, so that row costs (P + G R)^2 pairs where ``packed`` rows of one sample each cost G (P + R)^2. Short
responses: sharing the prompt wins; long responses: the quadratic term does (measured on the 1 M model with 128-token
responses: packed 23.2 samples/s against shared_prompt's 20.7, benchmarks/README.md).

The estimate, in units of one position through the linear layers (2 N FLOPs forward for N non-embedding parameters
a token): a row of width W costs W + w W^2, where a (query, key) pair costs w = 4 q L / (2 N) (its scores and its
weighted values, 2 q FLOPs each, a layer), for a query width q = heads x head_dim; the layer count cancels. Backward
scales both alike.
Pure functions: no model, no tensors.
"""

from __future__ import annotations

from typing import Any

from colossal_rl.training.sequence_layout import Block, make_blocks, pack_rows


def pair_weight(model_config: Any) -> float:
    """Cost of one attended (query, key) pair relative to one position through the linear layers, for a Hugging
    Face decoder config (a vision-language model's text config; a mixture of experts counts the experts a token
    runs through)."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    query, key_value = heads * head_dim, getattr(config, "num_key_value_heads", heads) * head_dim
    attention = 2 * hidden * query + 2 * hidden * key_value
    experts = getattr(config, "num_experts_per_tok", None)
    if experts and getattr(config, "moe_intermediate_size", None):
        mlp = 3 * hidden * config.moe_intermediate_size * experts
    else:
        mlp = 3 * hidden * config.intermediate_size
    return 2 * query / (attention + mlp)


def forward_cost(rows: list[list[Block]], weight: float) -> float:
    """Estimated cost of a forward over ``rows`` (padded to the widest): every position, every pair of a row."""
    if not rows:
        return 0.0
    width = max(sum(block.length for block in row) for row in rows)
    return len(rows) * (width + weight * width * width)


def cheaper_block_layout(prompt_lengths: list[int], response_lengths: list[int], group_size: int, weight: float) -> str:
    """``shared_prompt`` or ``packed``, whichever computes ``group_size``-sample groups (group-major) for less;
    shared_prompt on a tie (it needs no more memory for activations)."""
    shared = pack_rows(make_blocks(prompt_lengths, response_lengths, group_size, shared_prompt=True))
    packed = pack_rows(make_blocks(prompt_lengths, response_lengths, group_size, shared_prompt=False))
    return "shared_prompt" if forward_cost(shared, weight) <= forward_cost(packed, weight) else "packed"
