"""RolloutBatch: group selection, concatenation with re-padding, shape checks, and the per-token versions of
partial rollouts."""

import dataclasses

import pytest
import torch

from colossal_rl.batch import RolloutBatch, concat_batches, multi_version_fractions, tensor_field_names

PAD = 0


def make_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    group_size: int,
    policy_version: int = 0,
    round_index: int = 0,
    first_id: int = 0,
    with_advantages: bool = True,
) -> RolloutBatch:
    """A batch from real token lists: prompts left-padded, responses right-padded, per-sample values tagged by id."""
    n = len(prompts)
    prompt_len, response_len = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.full((n, prompt_len), PAD)
    prompt_mask = torch.zeros((n, prompt_len), dtype=torch.long)
    response_ids = torch.full((n, response_len), PAD)
    response_mask = torch.zeros((n, response_len), dtype=torch.long)
    behaviour_logprobs = torch.zeros((n, response_len))
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[i, prompt_len - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[i, prompt_len - len(prompt) :] = 1
        response_ids[i, : len(response)] = torch.tensor(response)
        response_mask[i, : len(response)] = 1
        behaviour_logprobs[i, : len(response)] = -0.1 * torch.tensor(response, dtype=torch.float)
    sample_ids = torch.arange(first_id, first_id + n, dtype=torch.float)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        behaviour_logprobs=behaviour_logprobs,
        rewards=sample_ids,
        answer_correct=(sample_ids % 2 == 0).float(),
        loss_mask=torch.ones(n),
        truncated=sample_ids % 3 == 0,
        advantages=sample_ids - 100 if with_advantages else None,
        group_size=group_size,
        policy_version=policy_version,
        round_index=round_index,
        prompts=[f"prompt {first_id // group_size + g}" for g in range(n // group_size)],
        responses=[f"response {first_id + i}" for i in range(n)],
        reward_status=[f"status {first_id + i}" for i in range(n)],
        data_indices=[10 + first_id // group_size + g for g in range(n // group_size)],
    )


def real_tokens(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[row_mask.bool()].tolist() for row, row_mask in zip(ids, mask, strict=True)]


def real_values(values: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [row[row_mask.bool()].tolist() for row, row_mask in zip(values, mask, strict=True)]


def test_select_groups_picks_whole_groups_in_the_given_order():
    prompts = [[1], [1], [2, 2], [2, 2], [3, 3, 3], [3, 3, 3]]
    responses = [[11], [12, 12], [21], [22], [31, 31, 31], [32]]
    batch = make_batch(prompts, responses, group_size=2)
    picked = batch.select_groups([2, 0])
    samples = [4, 5, 0, 1]
    for name in tensor_field_names():
        torch.testing.assert_close(getattr(picked, name), getattr(batch, name)[samples], msg=name)
    torch.testing.assert_close(picked.advantages, batch.advantages[samples])
    assert picked.prompts == ["prompt 2", "prompt 0"]
    assert picked.data_indices == [12, 10]
    assert picked.responses == [f"response {i}" for i in samples]
    assert picked.reward_status == [f"status {i}" for i in samples]
    assert (picked.num_groups, picked.num_samples, picked.group_size) == (2, 4, 2)
    assert real_tokens(picked.response_ids, picked.response_mask) == [[31, 31, 31], [32], [11], [12, 12]]


def test_select_groups_without_advantages_or_texts():
    batch = make_batch([[1]] * 4, [[5]] * 4, group_size=2, with_advantages=False)
    batch = dataclasses.replace(batch, prompts=[], responses=[], reward_status=[], data_indices=[])
    picked = batch.select_groups([1])
    assert picked.advantages is None
    assert (picked.prompts, picked.responses, picked.reward_status, picked.data_indices) == ([], [], [], [])
    assert picked.num_samples == 2


def test_concat_repads_and_preserves_every_real_token():
    short = make_batch([[7], [7, 8]], [[1, 2], [3]], group_size=2, policy_version=5, round_index=3)
    long_prompts, long_responses = [[4, 5, 6, 7], [9, 9, 9, 9]], [[1, 2, 3, 4, 5], [6]]
    long = make_batch(long_prompts, long_responses, group_size=2, policy_version=4, round_index=4, first_id=2)
    merged = concat_batches([short, long], pad_token_id=PAD)

    assert merged.prompt_ids.shape == (4, 4) and merged.response_ids.shape == (4, 5)
    assert real_tokens(merged.prompt_ids, merged.prompt_mask) == [[7], [7, 8]] + long_prompts
    assert real_tokens(merged.response_ids, merged.response_mask) == [[1, 2], [3]] + long_responses
    expected_logprobs = [[-0.1 * t for t in tokens] for tokens in [[1, 2], [3]] + long_responses]
    for got, want in zip(real_values(merged.behaviour_logprobs, merged.response_mask), expected_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))

    # Prompts padded on the left, responses on the right, with the pad id, zero mask and zero logprob.
    torch.testing.assert_close(merged.prompt_mask[0], torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(merged.prompt_ids[1], torch.tensor([PAD, PAD, 7, 8]))
    torch.testing.assert_close(merged.response_mask[0], torch.tensor([1, 1, 0, 0, 0]))
    torch.testing.assert_close(merged.response_ids[1], torch.tensor([3, PAD, PAD, PAD, PAD]))
    assert merged.behaviour_logprobs[1, 1:].eq(0).all()
    # So every sequence is one contiguous run of real tokens.
    _, attention_mask = merged.sequences()
    for row in attention_mask:
        positions = row.nonzero().flatten()
        assert positions.tolist() == list(range(int(positions[0]), int(positions[-1]) + 1))

    torch.testing.assert_close(merged.rewards, torch.tensor([0.0, 1.0, 2.0, 3.0]))
    torch.testing.assert_close(merged.advantages, torch.tensor([-100.0, -99.0, -98.0, -97.0]))
    torch.testing.assert_close(merged.truncated, torch.tensor([True, False, False, True]))
    assert merged.policy_version == 4  # the oldest part: staleness is never understated
    assert merged.round_index == 3
    assert merged.prompts == ["prompt 0", "prompt 1"]
    assert merged.responses == [f"response {i}" for i in range(4)]
    assert merged.data_indices == [10, 11]


def test_concat_drops_advantages_unless_every_part_has_them():
    with_adv = make_batch([[1], [1]], [[2], [2]], group_size=2)
    without = make_batch([[1], [1]], [[2], [2]], group_size=2, with_advantages=False)
    assert concat_batches([with_adv, without], pad_token_id=PAD).advantages is None


def test_concat_refuses_mixed_group_sizes_and_empty_input():
    pairs = make_batch([[1], [1]], [[2], [2]], group_size=2)
    singles = make_batch([[1], [1]], [[2], [2]], group_size=1)
    with pytest.raises(ValueError, match=r"group sizes \[1, 2\]"):
        concat_batches([pairs, singles], pad_token_id=PAD)
    with pytest.raises(ValueError, match="at least one batch"):
        concat_batches([], pad_token_id=PAD)


def test_sample_count_must_be_whole_groups():
    with pytest.raises(ValueError, match="5 samples is not a whole number of groups of 2"):
        make_batch([[1]] * 5, [[2]] * 5, group_size=2)


def test_every_tensor_field_must_have_one_row_per_sample():
    batch = make_batch([[1]] * 4, [[2]] * 4, group_size=2)
    with pytest.raises(ValueError, match="rewards has 3 rows, expected 4"):
        dataclasses.replace(batch, rewards=torch.zeros(3))


def test_trained_token_mask_keeps_response_tokens_of_kept_samples_only():
    batch = make_batch([[1], [2, 3]], [[4, 5, 6], [7]], group_size=1)
    batch = batch.with_advantages(batch.advantages, loss_mask=torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(batch.trained_token_mask(), torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))


def with_token_versions(batch: RolloutBatch, versions: list[list[int]]) -> RolloutBatch:
    """``batch`` with each response's tokens labelled by ``versions`` (-1 on padding)."""
    token_versions = torch.full(batch.response_ids.shape, -1)
    for row, row_versions in enumerate(versions):
        token_versions[row, : len(row_versions)] = torch.tensor(row_versions)
    return dataclasses.replace(batch, token_versions=token_versions)


def test_token_versions_follow_their_samples_through_select_and_concat():
    short = with_token_versions(make_batch([[7], [7]], [[1, 2], [3]], group_size=2), [[0, 1], [1]])
    long = with_token_versions(make_batch([[4], [4]], [[1, 2, 3], [6]], group_size=2, first_id=2), [[1, 1, 2], [2]])
    merged = concat_batches([short, long], pad_token_id=PAD)
    assert merged.token_versions.tolist() == [[0, 1, -1], [1, -1, -1], [1, 1, 2], [2, -1, -1]]
    assert merged.select_groups([1]).token_versions.tolist() == [[1, 1, 2], [2, -1, -1]]
    assert concat_batches([short, make_batch([[4], [4]], [[1], [6]], group_size=2)], PAD).token_versions is None
    with pytest.raises(ValueError, match="token_versions"):
        dataclasses.replace(short, token_versions=torch.zeros(2, 5, dtype=torch.long))


def test_multi_version_fractions_count_responses_spanning_a_sync_and_their_later_tokens():
    versions = torch.tensor([[3, 3, 4, 4], [3, 3, 3, -1], [4, 4, -1, -1], [-1, -1, -1, -1]])
    mask = (versions >= 0).long()
    # responses 0-2 have tokens; only response 0 spans two versions; its last two of the 9 real tokens are later
    responses, tokens = multi_version_fractions(versions, mask)
    assert responses == pytest.approx(1 / 3) and tokens == pytest.approx(2 / 9)
    trained = mask * torch.tensor([[1], [1], [0], [1]])  # a sample out of the loss does not count
    assert multi_version_fractions(versions, trained) == (pytest.approx(1 / 2), pytest.approx(2 / 7))
    assert multi_version_fractions(versions, torch.zeros_like(mask)) == (0.0, 0.0)
