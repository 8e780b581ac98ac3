"""Per-token side data through batch concatenation when the parts' prompt (and response) widths differ: expert
routes, token versions, policy masks, old and behaviour log-probs must stay on the token they belong to, padded
the way their tokens are (prompt data on the left, response data on the right) with their own fill value.

Every place batches are joined: ``batch.concat_batches`` (an optimizer step's groups, ``driver/actors.step_batch``;
a round's steps re-cut per PPO epoch, ``training/round_plan.epoch_steps``) and ``rollout/producer``'s
``concat_generation_outputs`` (a producer's generate calls). Each token's side value is derived from its id, so
a value read at a real token that is not its own shows up.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from colossal_rl.batch import RolloutBatch, concat_batches
from colossal_rl.driver.actors import step_batch
from colossal_rl.rollout.backend import GenerationOutput
from colossal_rl.rollout.producer import concat_generation_outputs
from colossal_rl.training.round_plan import epoch_steps

PAD = 0
LAYERS, TOP_K = 2, 2


def left(rows: list[list[int]], fill=PAD) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([[fill] * (width - len(row)) + row for row in rows])


def right(rows: list[list[int]], fill=PAD) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows])


def routes_of(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, T, layers, k] each real token's routes (id + layer, id + 10 k), -1 on padding."""
    offsets = torch.arange(LAYERS)[:, None] + 10 * torch.arange(TOP_K)[None, :]
    routes = ids[:, :, None, None] + offsets
    return torch.where(mask.bool()[:, :, None, None], routes, -1).to(torch.int16)


def side_data(prompts: list[list[int]], responses: list[list[int]]) -> dict[str, torch.Tensor]:
    """Prompt ids left-padded, responses right-padded, and every per-token field of them."""
    prompt_ids, prompt_mask = left(prompts), left([[1] * len(p) for p in prompts])
    response_ids, response_mask = right(responses), right([[1] * len(r) for r in responses])
    real = response_mask.bool()
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "behaviour_logprobs": torch.where(real, -0.01 * response_ids, 0.0),
        "token_versions": torch.where(real, response_ids // 100, -1),
        "prompt_routes": routes_of(prompt_ids, prompt_mask),
        "response_routes": routes_of(response_ids, response_mask),
    }


def rollout(prompts, responses, *, policy_mask: bool) -> RolloutBatch:
    """A batch of groups of 2 whose side data derive from the token ids (policy mask: ids that are odd)."""
    data = side_data(prompts, responses)
    n = len(prompts)
    real = data["response_mask"].bool()
    return RolloutBatch(
        **data,
        rewards=torch.zeros(n),
        answer_correct=torch.zeros(n),
        loss_mask=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=torch.zeros(n),
        old_logprobs=torch.where(real, -0.02 * data["response_ids"], 0.0),
        policy_mask=torch.where(real, data["response_ids"] % 2, 0) if policy_mask else None,
        group_size=2,
        policy_version=0,
    )


# prompt widths 1 and 4, response widths 3 and 1: neither part's padding is the joined batch's
NARROW = ([[5], [5]], [[301, 102, 203], [104]])
WIDE = ([[11, 12, 13, 14], [21, 22]], [[405], [306]])


def assert_side_data_on_their_tokens(batch: RolloutBatch, *, policy_mask_of_none: list[int]) -> None:
    """Every per-token field of ``batch`` is what its own token's id gives, and padding's fill value elsewhere.
    ``policy_mask_of_none``: rows from a part without a policy mask (every real token the policy's)."""
    prompt_real, response_real = batch.prompt_mask.bool(), batch.response_mask.bool()
    ids = batch.response_ids
    torch.testing.assert_close(batch.prompt_routes, routes_of(batch.prompt_ids, batch.prompt_mask))
    torch.testing.assert_close(batch.response_routes, routes_of(ids, batch.response_mask))
    torch.testing.assert_close(batch.token_versions, torch.where(response_real, ids // 100, -1))
    torch.testing.assert_close(batch.behaviour_logprobs, torch.where(response_real, -0.01 * ids, 0.0))
    torch.testing.assert_close(batch.old_logprobs, torch.where(response_real, -0.02 * ids, 0.0))
    expected_mask = torch.where(response_real, ids % 2, 0)
    expected_mask[policy_mask_of_none] = batch.response_mask[policy_mask_of_none]
    torch.testing.assert_close(batch.policy_mask, expected_mask)
    assert batch.prompt_ids[~prompt_real].eq(PAD).all() and batch.response_ids[~response_real].eq(PAD).all()
    for row in torch.cat([batch.prompt_mask, batch.response_mask], dim=1):  # one contiguous run of real tokens
        positions = row.nonzero().flatten()
        assert positions.tolist() == list(range(int(positions[0]), int(positions[-1]) + 1))


def test_concat_batches_keeps_every_tokens_side_data_across_prompt_widths():
    narrow, wide = rollout(*NARROW, policy_mask=True), rollout(*WIDE, policy_mask=False)
    for parts, no_mask in (([narrow, wide], [2, 3]), ([wide, narrow], [0, 1])):
        joined = concat_batches(parts, PAD)
        assert joined.prompt_ids.shape == (4, 4) and joined.response_ids.shape == (4, 3)
        assert joined.prompt_ids.tolist()[no_mask[0] ^ 2] == [0, 0, 0, 5]
        assert_side_data_on_their_tokens(joined, policy_mask_of_none=no_mask)


def test_a_step_joins_single_groups_of_different_widths_with_their_side_data():
    """``step_batch``: each group cut out of its payload (``select_groups``) and joined, in the order given."""
    narrow = rollout(*NARROW, policy_mask=True)
    wide_two = rollout(WIDE[0] * 2, WIDE[1] * 2, policy_mask=True)
    groups = [SimpleNamespace(payload=payload, group_index=index) for payload, index in ((wide_two, 1), (narrow, 0))]
    step = step_batch(groups, {id(wide_two): wide_two, id(narrow): narrow}, PAD)
    assert step.prompt_ids.tolist()[0] == [11, 12, 13, 14] and step.prompt_ids.tolist()[3] == [0, 0, 0, 5]
    assert_side_data_on_their_tokens(step, policy_mask_of_none=[])


def test_a_later_ppo_epoch_recuts_steps_of_different_widths_with_their_side_data():
    narrow, wide = rollout(*NARROW, policy_mask=True), rollout(*WIDE, policy_mask=True)
    recut = epoch_steps([narrow, wide], epoch=1, seed=3, round_index=0, pad_token_id=PAD)
    assert len(recut) == 2
    for step in recut:
        assert_side_data_on_their_tokens(step, policy_mask_of_none=[])


def generation(prompts, responses) -> GenerationOutput:
    data = side_data(prompts, responses)
    n = len(prompts)
    return GenerationOutput(
        **data,
        truncated=torch.zeros(n, dtype=torch.bool),
        responses=[str(row) for row in responses],
    )


def test_a_producers_generate_calls_join_with_their_side_data_across_prompt_widths():
    for parts in ((NARROW, WIDE), (WIDE, NARROW)):
        joined = concat_generation_outputs([generation(*part) for part in parts], PAD)
        prompt_real, response_real = joined.prompt_mask.bool(), joined.response_mask.bool()
        ids = joined.response_ids
        torch.testing.assert_close(joined.prompt_routes, routes_of(joined.prompt_ids, joined.prompt_mask))
        torch.testing.assert_close(joined.response_routes, routes_of(ids, joined.response_mask))
        torch.testing.assert_close(joined.token_versions, torch.where(response_real, ids // 100, -1))
        torch.testing.assert_close(joined.behaviour_logprobs, torch.where(response_real, -0.01 * ids, 0.0))
        assert joined.prompt_ids[~prompt_real].eq(PAD).all()
        expected = [row for part in parts for row in part[0]]
        assert [
            row[mask.bool()].tolist() for row, mask in zip(joined.prompt_ids, joined.prompt_mask, strict=True)
        ] == expected
        assert joined.responses == [str(row) for part in parts for row in part[1]]
