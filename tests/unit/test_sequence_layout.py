"""Padded, packed and shared-prompt layouts give the same log-probs and gradients as the padded forward.

The reference is the padded forward over the full ``[N, P + R]`` tensors (``response_logprobs``), what the
trainer computed before layouts existed. fp32, the embedded tiny model, random batches whose groups share a
prompt and whose prompt and response lengths differ; both log-prob paths (full logits, hidden states with
the chunked head).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.training.policy_forward import output_head_returns_hidden, response_logprobs
from colossal_rl.training.sequence_layout import (
    Block,
    block_attention_mask,
    block_layout,
    make_blocks,
    pack_rows,
    padded_layout,
)

GROUP_SIZE = 3


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, torch_dtype=torch.float32).eval()


def group_batch(num_groups: int = 3, prompt_width: int = 9, response_width: int = 7, seed: int = 0):
    """Left-padded prompts shared within each group, right-padded responses, all lengths unequal."""
    generator = torch.Generator().manual_seed(seed)
    n = num_groups * GROUP_SIZE
    prompt_ids = torch.zeros(n, prompt_width, dtype=torch.long)
    prompt_mask = torch.zeros(n, prompt_width, dtype=torch.long)
    for group in range(num_groups):
        length = int(torch.randint(2, prompt_width + 1, (1,), generator=generator))
        tokens = torch.randint(3, 40, (length,), generator=generator)
        rows = slice(group * GROUP_SIZE, (group + 1) * GROUP_SIZE)
        prompt_ids[rows, prompt_width - length :] = tokens
        prompt_mask[rows, prompt_width - length :] = 1
    response_ids = torch.zeros(n, response_width, dtype=torch.long)
    response_mask = torch.zeros(n, response_width, dtype=torch.long)
    for sample in range(n):
        length = int(torch.randint(1, response_width + 1, (1,), generator=generator))
        response_ids[sample, :length] = torch.randint(3, 40, (length,), generator=generator)
        response_mask[sample, :length] = 1
    return prompt_ids, prompt_mask, response_ids, response_mask


def reference_terms(model, batch, *, hidden: bool):
    prompt_ids, prompt_mask, response_ids, response_mask = batch
    return response_logprobs(
        model,
        torch.cat([prompt_ids, response_ids], 1),
        torch.cat([prompt_mask, response_mask], 1),
        prompt_length=prompt_ids.shape[1],
        response_ids=response_ids,
        temperature=0.7,
        logits_from_hidden=hidden,
    )[0]


def layout_terms(model, batch, layout: str, *, hidden: bool, mask_dtype=torch.float32):
    prompt_ids, prompt_mask, response_ids, response_mask = batch
    if layout == "padded":
        forward = padded_layout(*batch)
    else:
        forward = block_layout(
            *batch,
            group_size=GROUP_SIZE,
            shared_prompt=layout == "shared_prompt",
            pad_token_id=0,
            mask_dtype=mask_dtype,
        )
    if hidden:
        with output_head_returns_hidden(model) as head_weight:
            outputs = model(**forward.inputs).logits
            return forward.response_terms(
                outputs, response_ids, temperature=0.7, head_weight=head_weight, with_entropy=False
            )[0], forward
    outputs = model(**forward.inputs).logits
    return forward.response_terms(outputs, response_ids, temperature=0.7, head_weight=None, with_entropy=False)[
        0
    ], forward


def gradients(model, logprobs, weights) -> torch.Tensor:
    model.zero_grad()
    (logprobs * weights).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_layout_equals_padded_forward_in_logprobs_and_gradients(model, layout, hidden):
    batch = group_batch(seed=1)
    response_mask = batch[3]
    weights = torch.randn(response_mask.shape, generator=torch.Generator().manual_seed(2)) * response_mask
    reference = reference_terms(model, batch, hidden=hidden)
    reference_grad = gradients(model, reference, weights)
    logprobs, forward = layout_terms(model, batch, layout, hidden=hidden)
    torch.testing.assert_close(logprobs * response_mask, reference * response_mask, atol=1e-5, rtol=1e-5)
    if layout != "padded":  # block layouts compute only real tokens: zero elsewhere
        assert bool((logprobs[response_mask == 0] == 0).all())
    grad = gradients(model, logprobs, weights)
    # fp32: summation order differs, so element-wise bounds scale with the gradient (|g| up to ~400 here);
    # in fp64 the packed gradients are identical to 5e-14 (shared-prompt: 6e-8, Qwen2RMSNorm computes in fp32).
    assert float((grad - reference_grad).norm() / reference_grad.norm()) <= 1e-5
    torch.testing.assert_close(grad, reference_grad, atol=1e-5 * float(reference_grad.abs().max()), rtol=1e-5)
    assert forward.real_tokens == int(batch[1].sum() + batch[3].sum())
    padded_tokens = batch[0].numel() + batch[2].numel()
    assert forward.computed_tokens <= padded_tokens if layout == "padded" else forward.computed_tokens < padded_tokens


def test_shared_prompt_computes_each_prompt_once(model):
    batch = group_batch(num_groups=4, seed=3)
    prompt_mask, response_mask = batch[1], batch[3]
    shared = block_layout(*batch, group_size=GROUP_SIZE, shared_prompt=True, pad_token_id=0, mask_dtype=torch.float32)
    packed = block_layout(*batch, group_size=GROUP_SIZE, shared_prompt=False, pad_token_id=0, mask_dtype=torch.float32)
    once = int(prompt_mask[::GROUP_SIZE].sum() + response_mask.sum())
    assert shared.occupied_tokens == once  # each group's prompt laid out once
    assert packed.occupied_tokens == packed.real_tokens == int(prompt_mask.sum() + response_mask.sum())
    assert shared.computed_tokens < packed.computed_tokens


def test_block_mask_lets_responses_see_prompt_and_themselves_only():
    # One row: prompt of 2 (block 0), response A of 2, response B of 1, then one padding position.
    block = torch.tensor([[0, 0, 0, 0, 0, -1]])
    segment = torch.tensor([[0, 0, 1, 1, 2, 0]])
    allowed = block_attention_mask(block, segment, torch.float32)[0, 0] == 0
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],  # response B: prompt and itself, not response A
            [0, 0, 0, 0, 0, 1],  # padding: itself only
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)


def test_pack_rows_first_fit_decreasing_within_the_longest_block():
    blocks = make_blocks([3, 2, 4, 1], [2, 1, 4, 1], group_size=1, shared_prompt=False)
    rows = pack_rows(blocks)
    assert [[b.samples for b in row] for row in rows] == [[(2,)], [(0,), (1,)], [(3,)]]
    assert max(sum(b.length for b in row) for row in rows) == 8
    with pytest.raises(ValueError, match="exceeds the row capacity"):
        pack_rows([Block(samples=(0,), prompt_length=5, response_lengths=(5,))], capacity=9)


def test_shared_prompt_refuses_groups_with_different_prompts():
    prompt_ids, prompt_mask, response_ids, response_mask = group_batch(seed=4)
    prompt_ids = prompt_ids.clone()
    prompt_ids[1, -1] = prompt_ids[0, -1] + 1
    with pytest.raises(ValueError, match="share one prompt"):
        block_layout(
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            group_size=GROUP_SIZE,
            shared_prompt=True,
            pad_token_id=0,
            mask_dtype=torch.float32,
        )


def test_flash_attention_inputs_restart_positions_per_block_and_carry_no_mask():
    batch = group_batch(seed=5)
    packed = block_layout(*batch, group_size=GROUP_SIZE, shared_prompt=False, pad_token_id=0, mask_dtype=None)
    assert packed.inputs["attention_mask"] is None
    positions = packed.inputs["position_ids"]
    starts = int((positions == 0).sum())
    assert starts >= batch[0].shape[0]  # every sample's block starts at 0 (padding may start one more)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_per_position_lays_out_any_per_token_values_as_the_forwards_ids(layout):
    """Routing replay's layout of per-token values: the token ids themselves, laid out by ``per_position``, are the
    forward's ``input_ids`` exactly (so any [n, P or R, ...] values land on their tokens); with trailing dims too."""
    batch = group_batch(seed=4)
    prompt_ids, prompt_mask, response_ids, response_mask = batch
    if layout == "padded":
        forward = padded_layout(*batch)
    else:
        forward = block_layout(*batch, group_size=GROUP_SIZE, shared_prompt=layout == "shared_prompt",
                               pad_token_id=0, mask_dtype=None)  # fmt: skip
    assert torch.equal(forward.per_position(prompt_ids, response_ids, 0), forward.inputs["input_ids"])
    pairs = forward.per_position(
        torch.stack([prompt_ids, -prompt_ids], -1), torch.stack([response_ids, -response_ids], -1), 0
    )
    assert torch.equal(pairs[..., 0], forward.inputs["input_ids"]) and torch.equal(pairs[..., 1], -pairs[..., 0])
    real = forward.per_position(prompt_mask, response_mask, 0)
    assert int(real.sum()) == forward.occupied_tokens
