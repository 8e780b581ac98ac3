"""Property-based tests of batch concatenation and padding (``colossal_rl/batch.py``): every per-token field stays
on its token when batches of different prompt and response widths are re-padded together.

Each drawn batch gives every real token a unique id and derives all its side data from that id (behaviour and old
log-probs, the sampling version, the policy mask, the recorded expert routes), so after concatenation each field,
position by position, must still be the function of the id beside it, and padding must hold the field's own pad
value. Prompt widths, response widths, real lengths and which optional fields a batch carries all vary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colossal_rl.batch import RolloutBatch, concat_batches, pad_to

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None)
PAD_ID = 2
LAYERS, SLOTS = 2, 2
FIRST_ID = 10  # real tokens' ids are unique and above the pad id


def behaviour_of(ids: torch.Tensor) -> torch.Tensor:
    return -ids.float() / 1000


def old_of(ids: torch.Tensor) -> torch.Tensor:
    return -ids.float() / 500


def version_of(ids: torch.Tensor) -> torch.Tensor:
    return ids % 7


def policy_of(ids: torch.Tensor) -> torch.Tensor:
    return ids % 2


def routes_of(ids: torch.Tensor) -> torch.Tensor:
    """[..., layers, k] int16: a different expert per layer and slot, all derived from the token's id."""
    layer = torch.arange(LAYERS)[:, None] * 2
    slot = torch.arange(SLOTS)[None, :]
    return (ids[..., None, None] * 4 + layer + slot).to(torch.int16)


@dataclass(frozen=True)
class Fields:
    """Which optional per-token fields the drawn batches carry."""

    versions: bool
    routes: bool
    old_logprobs: bool
    advantages: bool


@st.composite
def batches(draw, group_size: int, fields: Fields, first_id: int, policy_mask: bool, version: int) -> RolloutBatch:
    """One producer batch of its own widths: left-padded prompts, right-padded responses, side data from the ids."""
    num_groups = draw(st.integers(1, 2))
    n = num_groups * group_size
    prompt_width, response_width = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    prompt_lengths = draw(st.lists(st.integers(1, prompt_width), min_size=n, max_size=n))
    response_lengths = draw(st.lists(st.integers(0, response_width), min_size=n, max_size=n))
    prompt_mask = (torch.arange(prompt_width)[None, :] >= prompt_width - torch.tensor(prompt_lengths)[:, None]).long()
    response_mask = (torch.arange(response_width)[None, :] < torch.tensor(response_lengths)[:, None]).long()
    prompt_ids = torch.where(
        prompt_mask.bool(), first_id + torch.arange(prompt_mask.numel()).view_as(prompt_mask), PAD_ID
    )
    first_id += prompt_mask.numel()
    response_ids = torch.where(
        response_mask.bool(), first_id + torch.arange(response_mask.numel()).view_as(response_mask), PAD_ID
    )
    real = response_mask.bool()
    on_real = lambda values, pad: torch.where(real, values, pad)  # noqa: E731
    routes = fields.routes
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        behaviour_logprobs=on_real(behaviour_of(response_ids), 0.0),
        rewards=first_id + torch.arange(n).float(),
        answer_correct=torch.arange(n).remainder(2).float(),
        loss_mask=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=first_id - torch.arange(n).float() if fields.advantages else None,
        old_logprobs=on_real(old_of(response_ids), 0.0) if fields.old_logprobs else None,
        policy_mask=on_real(policy_of(response_ids), 0) if policy_mask else None,
        token_versions=on_real(version_of(response_ids), -1) if fields.versions else None,
        prompt_routes=torch.where(prompt_mask.bool()[..., None, None], routes_of(prompt_ids), -1) if routes else None,
        response_routes=torch.where(real[..., None, None], routes_of(response_ids), -1) if routes else None,
        group_size=group_size,
        policy_version=version,
        round_index=version,
        responses=[f"response {first_id + sample}" for sample in range(n)],
    )


@st.composite
def batch_lists(draw) -> list[RolloutBatch]:
    group_size = draw(st.integers(1, 2))
    fields = Fields(*(draw(st.booleans()) for _ in range(4)))
    parts, first_id = [], FIRST_ID
    for _ in range(draw(st.integers(1, 3))):
        part = draw(batches(group_size, fields, first_id, draw(st.booleans()), draw(st.integers(0, 5))))
        parts.append(part)
        first_id = int(max(part.prompt_ids.max(), part.response_ids.max())) + 1
    return parts


def real_ids(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[keep].tolist() for row, keep in zip(ids, mask.bool(), strict=True)]


@PROPERTY
@given(parts=batch_lists())
def test_concatenation_keeps_every_tokens_side_data_on_its_id(parts):
    """Prompts re-padded on the left, responses on the right, to the widest part: at every real position each
    per-token field (behaviour and old log-probs, versions, the policy mask, prompt and response routes) is still
    its own token's, and every padding position holds the pad id and the field's pad value (0, -1)."""
    batch = concat_batches(parts, pad_token_id=PAD_ID)
    prompt_real, response_real = batch.prompt_mask.bool(), batch.response_mask.bool()
    assert batch.prompt_ids.shape[1] == max(part.prompt_ids.shape[1] for part in parts)
    assert batch.response_ids.shape[1] == max(part.response_ids.shape[1] for part in parts)
    # left padding: a prompt's real tokens end at the last column; right padding: a response's start at the first
    assert torch.equal(prompt_real, prompt_real.long().cummax(1).values.bool())
    assert torch.equal(response_real, response_real.flip(1).long().cummax(1).values.flip(1).bool())
    assert bool((batch.prompt_ids[~prompt_real] == PAD_ID).all()) and bool(
        (batch.response_ids[~response_real] == PAD_ID).all()
    )
    ids = batch.response_ids
    per_token = {
        "behaviour_logprobs": (behaviour_of, 0.0),
        "old_logprobs": (old_of, 0.0),
        "token_versions": (version_of, -1),
    }
    for name, (of, pad) in per_token.items():
        values = getattr(batch, name)
        if values is None:
            continue
        assert torch.equal(values[response_real], of(ids)[response_real]), name
        assert bool((values[~response_real] == pad).all()), name
    if batch.policy_mask is not None:  # a part without one is all policy tokens: its response mask
        sample_part = torch.cat([torch.full((part.num_samples,), part.policy_mask is not None) for part in parts])
        expected = torch.where(sample_part[:, None], policy_of(ids), 1)
        assert torch.equal(batch.policy_mask[response_real], expected[response_real])
        assert bool((batch.policy_mask[~response_real] == 0).all())
    if batch.prompt_routes is not None:
        for routes, token_ids, real in ((batch.prompt_routes, batch.prompt_ids, prompt_real),
                                        (batch.response_routes, ids, response_real)):  # fmt: skip
            assert torch.equal(routes[real], routes_of(token_ids)[real])
            assert bool((routes[~real] == -1).all())


@PROPERTY
@given(parts=batch_lists())
def test_concatenation_keeps_the_parts_samples_in_order_and_the_oldest_version(parts):
    """Sample i of the result is sample i of the parts laid end to end: its real prompt and response ids, its
    scalars and texts; the batch carries its oldest part's policy version and round (staleness never understated)."""
    batch = concat_batches(parts, pad_token_id=PAD_ID)
    assert real_ids(batch.prompt_ids, batch.prompt_mask) == [
        row for part in parts for row in real_ids(part.prompt_ids, part.prompt_mask)
    ]
    assert real_ids(batch.response_ids, batch.response_mask) == [
        row for part in parts for row in real_ids(part.response_ids, part.response_mask)
    ]
    for name in ("rewards", "answer_correct", "loss_mask", "truncated", "advantages"):
        if getattr(batch, name) is not None:
            assert torch.equal(getattr(batch, name), torch.cat([getattr(part, name) for part in parts])), name
    assert batch.responses == [text for part in parts for text in part.responses]
    assert batch.policy_version == min(part.policy_version for part in parts)
    assert batch.round_index == min(part.round_index for part in parts)


@PROPERTY
@given(parts=batch_lists(), groups_per_chunk=st.integers(1, 3))
def test_cutting_a_batch_into_group_chunks_and_concatenating_them_gives_it_back(parts, groups_per_chunk):
    """``group_chunks`` then ``concat_batches``: every tensor field and list as before (a round trip)."""
    batch = concat_batches(parts, pad_token_id=PAD_ID)
    again = concat_batches(batch.group_chunks(groups_per_chunk), pad_token_id=PAD_ID)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "behaviour_logprobs", "rewards",
                 "advantages", "old_logprobs", "policy_mask", "token_versions", "prompt_routes", "response_routes"):  # fmt: skip
        before, after = getattr(batch, name), getattr(again, name)
        assert (before is None) == (after is None), name
        assert before is None or torch.equal(before, after), name
    assert again.responses == batch.responses


@PROPERTY
@given(
    widths=st.tuples(st.integers(1, 4), st.integers(0, 4), st.integers(0, 3)),
    value=st.integers(-3, 3),
    left=st.booleans(),
)
def test_pad_to_keeps_the_tensor_at_its_end_and_fills_the_other(widths, value, left):
    """``pad_to`` [N, T, ...] -> [N, T + extra, ...]: the original intact at the end its padding side leaves
    (the right end for left padding), ``value`` in the new columns, trailing axes untouched."""
    rows, length, extra = widths
    tensor = torch.arange(rows * length * 2).view(rows, length, 2) + 10
    padded = pad_to(tensor, length + extra, value, left)
    assert padded.shape == (rows, length + extra, 2)
    kept, added = (padded[:, extra:], padded[:, :extra]) if left else (padded[:, :length], padded[:, length:])
    assert torch.equal(kept, tensor)
    assert bool((added == value).all())
