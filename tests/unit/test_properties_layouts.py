"""Property-based tests of the sequence layouts (``training/sequence_layout.py``): whatever the micro-batch's shape,
every layout puts each sample's per-token values where its tokens are, as the padded reference has them.

The values laid out are codes naming their source (sample, prompt or response, column), so a value that lands on
the wrong token, the wrong position or the wrong row names where it came from. Hypothesis draws group-major
micro-batches: groups sharing a prompt, prompt and response lengths all different, and prompt and response widths
wider than any sample needs (left and right padding columns the padded layout cuts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colossal_rl.training.sequence_layout import ForwardLayout, block_layout, padded_layout

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None)
LAYOUTS = ("padded", "packed", "shared_prompt")
FILL = -7
PROMPT_BASE, RESPONSE_BASE, PER_SAMPLE = 1_000, 100_000, 100


@dataclass(frozen=True)
class MicroBatch:
    group_size: int
    prompt_ids: torch.Tensor  # [n, P] left-padded
    prompt_mask: torch.Tensor  # [n, P]
    response_ids: torch.Tensor  # [n, R] right-padded
    response_mask: torch.Tensor  # [n, R]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.prompt_ids, self.prompt_mask, self.response_ids, self.response_mask

    @property
    def num_samples(self) -> int:
        return self.prompt_ids.shape[0]


@st.composite
def micro_batches(draw, *, shared_prompts: bool) -> MicroBatch:
    """Group-major samples; with ``shared_prompts`` a group's samples share one prompt (else each its own)."""
    group_size = draw(st.integers(1, 3))
    num_groups = draw(st.integers(1, 3))
    n = group_size * num_groups
    if shared_prompts:
        prompt_lengths = [length for length in draw(st.lists(st.integers(1, 6), min_size=num_groups,
                                                             max_size=num_groups)) for _ in range(group_size)]  # fmt: skip
    else:
        prompt_lengths = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    response_lengths = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    prompt_width = max(prompt_lengths) + draw(st.integers(0, 2))
    response_width = max(max(response_lengths), 1) + draw(st.integers(0, 2))
    token = st.integers(3, 50)
    prompt_ids = torch.zeros(n, prompt_width, dtype=torch.long)
    prompt_mask = torch.zeros(n, prompt_width, dtype=torch.long)
    for sample, length in enumerate(prompt_lengths):
        owner = sample - sample % group_size if shared_prompts else sample
        if owner == sample:
            prompt_ids[sample, prompt_width - length :] = torch.tensor(draw(st.lists(token, min_size=length,
                                                                                     max_size=length)))  # fmt: skip
        else:
            prompt_ids[sample] = prompt_ids[owner]
        prompt_mask[sample, prompt_width - length :] = 1
    response_ids = torch.zeros(n, response_width, dtype=torch.long)
    response_mask = torch.zeros(n, response_width, dtype=torch.long)
    for sample, length in enumerate(response_lengths):
        response_ids[sample, :length] = torch.tensor(draw(st.lists(token, min_size=length, max_size=length)))
        response_mask[sample, :length] = 1
    return MicroBatch(group_size, prompt_ids, prompt_mask, response_ids, response_mask)


def lay_out(batch: MicroBatch, layout: str) -> ForwardLayout:
    if layout == "padded":
        return padded_layout(*batch.tensors)
    return block_layout(*batch.tensors, group_size=batch.group_size, shared_prompt=layout == "shared_prompt",
                        pad_token_id=0, mask_dtype=None)  # fmt: skip


def codes(batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token values [n, P, 2] and [n, R, 2] naming their source; a trailing axis as routes have."""
    n, prompt_width = batch.prompt_ids.shape
    response_width = batch.response_ids.shape[1]
    sample = torch.arange(n)[:, None] * PER_SAMPLE
    prompt = PROMPT_BASE + sample + torch.arange(prompt_width)[None, :]
    response = RESPONSE_BASE + sample + torch.arange(response_width)[None, :]
    return torch.stack([prompt, -prompt], -1), torch.stack([response, -response], -1)


def decode(code: int) -> tuple[str, int, int]:
    """(``prompt`` or ``response``, sample, column) of a code."""
    kind, base = ("response", RESPONSE_BASE) if code >= RESPONSE_BASE else ("prompt", PROMPT_BASE)
    return kind, (code - base) // PER_SAMPLE, (code - base) % PER_SAMPLE


def prompt_owner(batch: MicroBatch, layout: str, sample: int) -> int:
    """The sample whose prompt values a sample's block holds: its group's first under shared_prompt."""
    return sample - sample % batch.group_size if layout == "shared_prompt" else sample


def padded_reference(batch: MicroBatch, layout: str, sample: int) -> list[int]:
    """The codes of a sample's real tokens in order, as the full padded [prompt | response] row holds them."""
    prompt_values, response_values = codes(batch)
    owner = prompt_owner(batch, layout, sample)
    prompt = prompt_values[owner, batch.prompt_mask[sample].bool(), 0]
    response = response_values[sample, batch.response_mask[sample].bool(), 0]
    return torch.cat([prompt, response]).tolist()


def is_real(batch: MicroBatch, kind: str, sample: int, column: int) -> bool:
    mask = batch.prompt_mask if kind == "prompt" else batch.response_mask
    return bool(mask[sample, column])


def sample_places(batch: MicroBatch, layout: str, laid_out: torch.Tensor) -> dict[int, list[tuple[int, int, int]]]:
    """Sample -> (row, column, code) of the real tokens its own forward reads, in the layout's order."""
    places: dict[int, list[tuple[int, int, int]]] = {sample: [] for sample in range(batch.num_samples)}
    for row, column in torch.nonzero(laid_out[..., 0] != FILL).tolist():
        code = int(laid_out[row, column, 0])
        kind, source, source_column = decode(code)
        if not is_real(batch, kind, source, source_column):
            assert layout == "padded", f"{layout}: padding of sample {source} laid out at ({row}, {column})"
            continue
        readers = [source]
        if kind == "prompt" and layout == "shared_prompt":
            readers = list(range(source, source + batch.group_size))
        for reader in readers:
            places[reader].append((row, column, code))
    return places


@PROPERTY
@given(data=st.data(), layout=st.sampled_from(LAYOUTS))
def test_every_layout_puts_each_samples_values_in_one_row_as_its_padded_reference(data, layout):
    """Per-token values laid out by ``per_position`` (routing replay's routes): each sample's real tokens sit in one
    row, prompt then response, each at its position 0..len-1, carrying exactly the values of the full padded
    ``[prompt | response]`` row (a shared prompt: its group's first sample's); ids lay out as the forward's ids."""
    batch = data.draw(micro_batches(shared_prompts=layout != "packed"))
    forward = lay_out(batch, layout)
    laid_out = forward.per_position(*codes(batch), FILL)  # [rows, L, 2]
    held = laid_out[..., 0] != FILL
    assert torch.equal(laid_out[held][:, 1], -laid_out[held][:, 0]) and bool((laid_out[~held] == FILL).all())
    assert torch.equal(forward.per_position(batch.prompt_ids, batch.response_ids, 0), forward.inputs["input_ids"])
    positions = forward.inputs["position_ids"]
    for sample, places in sample_places(batch, layout, laid_out).items():
        assert [code for _, _, code in places] == padded_reference(batch, layout, sample), f"sample {sample}"
        assert len({row for row, _, _ in places}) == 1, f"sample {sample} spans rows"
        assert [int(positions[row, column]) for row, column, _ in places] == list(range(len(places)))
        columns = [column for _, column, _ in places]
        assert columns == sorted(columns)


@PROPERTY
@given(data=st.data(), layout=st.sampled_from(("packed", "shared_prompt")))
def test_a_block_layout_lays_each_real_token_out_once_and_fills_the_rest(data, layout):
    """Block layouts: every real response token once, every block's prompt once (a shared prompt once a group),
    ``fill`` everywhere else; ``occupied_tokens`` counts exactly the positions holding a token."""
    batch = data.draw(micro_batches(shared_prompts=layout == "shared_prompt"))
    forward = lay_out(batch, layout)
    laid_out = forward.per_position(*codes(batch), FILL)[..., 0]
    held = laid_out[laid_out != FILL].tolist()
    assert len(held) == len(set(held)) == forward.occupied_tokens
    owners = {prompt_owner(batch, layout, sample) for sample in range(batch.num_samples)}
    expected = [
        code for owner in owners for code in codes(batch)[0][owner, batch.prompt_mask[owner].bool(), 0].tolist()
    ]
    expected += codes(batch)[1][..., 0][batch.response_mask.bool()].tolist()
    assert sorted(held) == sorted(expected)


@PROPERTY
@given(data=st.data(), layout=st.sampled_from(("packed", "shared_prompt")))
def test_a_block_layout_reads_each_response_token_off_the_output_of_the_token_before_it(data, layout):
    """``prediction_index``/``token_index``: response token r of sample s (each real one exactly once) is read off
    the output at the input position holding the token before it in s's own sequence (the prompt's last for r = 0),
    at position prompt length + r - 1: the causal shift that gives each token its log-prob."""
    batch = data.draw(micro_batches(shared_prompts=layout == "shared_prompt"))
    forward = lay_out(batch, layout)
    laid_out = forward.per_position(*codes(batch), FILL)[..., 0]
    rows, columns = forward.prediction_index
    token_samples, token_positions = forward.token_index
    read = list(zip(token_samples.tolist(), token_positions.tolist(), strict=True))
    assert sorted(read) == sorted(map(tuple, torch.nonzero(batch.response_mask).tolist()))
    for (sample, r), row, column in zip(read, rows.tolist(), columns.tolist(), strict=True):
        reference = padded_reference(batch, layout, sample)
        prompt_length = int(batch.prompt_mask[sample].sum())
        assert int(laid_out[row, column]) == reference[prompt_length + r - 1], f"token {r} of sample {sample}"
        assert int(forward.inputs["position_ids"][row, column]) == prompt_length + r - 1
