"""Property-based tests of the layout cost estimates: ``training/layout_choice.py`` (which block layout a micro-batch
is cheaper in, from its lengths alone) and ``training/micro_batches.computed_tokens`` (what a token budget counts).

Both estimate, from lengths, what a layout will build from tensors; the properties hold them to the layouts that
``training/sequence_layout.py`` actually builds for the same lengths, so an estimate that drifts from its layout
(another packing, another width, a prompt counted per sample) fails.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colossal_rl.training.layout_choice import cheaper_block_layout, forward_cost
from colossal_rl.training.micro_batches import computed_tokens, make_units
from colossal_rl.training.sequence_layout import block_layout, make_blocks, pack_rows, padded_layout

PROPERTY = settings(max_examples=80, deadline=None, derandomize=True, database=None)


@st.composite
def group_lengths(draw, max_group_size: int = 4) -> tuple[list[int], list[int], int]:
    """(prompt lengths [n], response lengths [n], group size): group-major, a group's samples share a prompt."""
    group_size = draw(st.integers(1, max_group_size))
    num_groups = draw(st.integers(1, 4))
    prompts = draw(st.lists(st.integers(1, 12), min_size=num_groups, max_size=num_groups))
    responses = draw(st.lists(st.integers(1, 12), min_size=num_groups * group_size, max_size=num_groups * group_size))
    return [length for length in prompts for _ in range(group_size)], responses, group_size


def tensors(prompt_lengths: list[int], response_lengths: list[int], width_slack: int = 1):
    """Left-padded prompts (a group's the same tokens) and right-padded responses of those lengths."""
    n = len(prompt_lengths)
    prompt_width, response_width = max(prompt_lengths) + width_slack, max(response_lengths) + width_slack
    prompt_mask = torch.zeros(n, prompt_width, dtype=torch.long)
    response_mask = torch.zeros(n, response_width, dtype=torch.long)
    for sample, (prompt, response) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        prompt_mask[sample, prompt_width - prompt :] = 1
        response_mask[sample, :response] = 1
    return prompt_mask * 5, prompt_mask, response_mask * 7, response_mask


def built_cost(prompt_lengths: list[int], response_lengths: list[int], group_size: int, *, shared: bool, weight: float):
    """The estimate's formula on the rows ``block_layout`` builds: rows x (L + weight L^2)."""
    layout = block_layout(*tensors(prompt_lengths, response_lengths), group_size=group_size, shared_prompt=shared,
                          pad_token_id=0, mask_dtype=None)  # fmt: skip
    rows, width = layout.inputs["input_ids"].shape
    return rows * (width + weight * width * width)


@PROPERTY
@given(lengths=group_lengths(), shared=st.booleans(), capacity_slack=st.integers(0, 10))
def test_packing_places_every_block_once_within_capacity_and_leaves_at_most_one_row_half_empty(
    lengths, shared, capacity_slack
):
    """First-fit decreasing: each block in exactly one row, no row over the capacity (by default the longest
    block), and no two rows both at most half full (the later one's blocks would have fitted the earlier)."""
    prompt_lengths, response_lengths, group_size = lengths
    blocks = make_blocks(prompt_lengths, response_lengths, group_size, shared_prompt=shared)
    longest = max(block.length for block in blocks)
    for capacity, row_capacity in ((None, longest), (longest + capacity_slack, longest + capacity_slack)):
        rows = pack_rows(blocks, capacity)
        placed = sorted((block for row in rows for block in row), key=lambda block: block.samples)
        assert placed == sorted(blocks, key=lambda block: block.samples)
        used = [sum(block.length for block in row) for row in rows]
        assert max(used) <= row_capacity
        assert sum(2 * total <= row_capacity for total in used) <= 1, used


@PROPERTY
@given(lengths=group_lengths())
def test_blocks_cover_every_sample_once_with_its_own_lengths(lengths):
    """``make_blocks``: samples in order, each once, a block's prompt its first sample's, its responses theirs;
    a shared block is one whole group."""
    prompt_lengths, response_lengths, group_size = lengths
    for shared in (False, True):
        blocks = make_blocks(prompt_lengths, response_lengths, group_size, shared_prompt=shared)
        assert [sample for block in blocks for sample in block.samples] == list(range(len(prompt_lengths)))
        for block in blocks:
            assert len(block.samples) == (group_size if shared else 1)
            assert block.prompt_length == prompt_lengths[block.samples[0]]
            assert block.response_lengths == tuple(response_lengths[sample] for sample in block.samples)


@PROPERTY
@given(lengths=group_lengths(), weight=st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.3, 2.0]))
def test_the_layout_choice_prices_the_rows_the_layouts_build_and_takes_the_cheaper(lengths, weight):
    """``cheaper_block_layout`` from lengths alone: its estimate of each layout is the built layout's rows x
    (L + w L^2), and it picks the cheaper built layout, shared_prompt on a tie."""
    prompt_lengths, response_lengths, group_size = lengths
    costs = {}
    for shared in (False, True):
        rows = pack_rows(make_blocks(prompt_lengths, response_lengths, group_size, shared_prompt=shared))
        costs[shared] = built_cost(prompt_lengths, response_lengths, group_size, shared=shared, weight=weight)
        assert abs(forward_cost(rows, weight) - costs[shared]) <= 1e-9 * costs[shared]
    expected = "shared_prompt" if costs[True] <= costs[False] else "packed"
    assert cheaper_block_layout(prompt_lengths, response_lengths, group_size, weight) == expected


@PROPERTY
@given(lengths=group_lengths(max_group_size=1), weight=st.floats(0.0, 5.0))
def test_groups_of_one_share_nothing_so_the_tie_goes_to_shared_prompt(lengths, weight):
    """With one sample a group both layouts build the same blocks: equal cost, the tie's shared_prompt."""
    prompt_lengths, response_lengths, _ = lengths
    assert cheaper_block_layout(prompt_lengths, response_lengths, 1, weight) == "shared_prompt"


@PROPERTY
@given(lengths=group_lengths(), width_slack=st.integers(0, 3))
def test_the_token_budget_counts_what_each_layout_computes(lengths, width_slack):
    """``computed_tokens`` of a micro-batch's units (what ``--max-tokens-per-microbatch`` bounds) is, padded, the
    padded layout's computed positions (whatever the tensors' own widths or the units' grouping), else the block layout's occupied ones
    (a shared prompt once a group)."""
    prompt_lengths, response_lengths, group_size = lengths
    batch = tensors(prompt_lengths, response_lengths, width_slack)
    for samples_per_unit in (1, group_size):  # however samples are grouped into units
        units = make_units(prompt_lengths, response_lengths, samples_per_unit)
        assert computed_tokens(units, padded=True, shared_prompt=False) == padded_layout(*batch).computed_tokens
    for shared in (False, True):
        units = make_units(prompt_lengths, response_lengths, group_size if shared else 1)
        layout = block_layout(*batch, group_size=group_size, shared_prompt=shared, pad_token_id=0, mask_dtype=None)
        assert computed_tokens(units, padded=False, shared_prompt=shared) == layout.occupied_tokens
