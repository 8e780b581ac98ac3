"""How a micro-batch's ``[prompt | response]`` samples are laid out for one training forward.

Three layouts, equal in exact arithmetic (``tests/unit/test_sequence_layout.py`` checks log-probs and
gradients against each other to 1e-5 in fp32):

- **padded**: one sample per row, prompts left-padded and responses right-padded to the micro-batch's own
  longest prompt and response (padding columns no sample uses are cut first).
- **packed** (padding-free): each sample's real tokens form one block with positions 0..len-1; blocks are
  packed first-fit-decreasing into rows no longer than the longest block, and a block-diagonal causal
  4D mask keeps blocks apart. With ``flash_attention_2`` no mask is built: packed ``position_ids`` (each
  block restarting at 0) drive flash-attention's variable-length path.
- **shared_prompt**: one block per prompt group: the prompt's tokens once, then each of its responses; each
  response attends to the prompt and causally to itself, its positions continuing from the prompt's length.
  The prompt is computed once instead of ``group_size`` times. Needs a 4D mask: not expressible with
  flash-attention's variable-length path (refused by the config).

Pure tensor code: no model, no config, no communication. A layout gives the model's keyword inputs and
turns the model's per-position outputs (logits or hidden states) back into per-sample response log-probs
[n, R], the shape the loss expects whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from colossal_rl.training.policy_forward import aligned_response_terms, model_inputs, response_terms

SequenceLayout = Literal["padded", "packed", "shared_prompt"]
SEQUENCE_LAYOUTS: tuple[str, ...] = ("padded", "packed", "shared_prompt")


@dataclass(frozen=True)
class Block:
    """Tokens laid out together: one prompt and the responses that continue it (one, or a whole group)."""

    samples: tuple[int, ...]
    """Sample indices (within the micro-batch) whose responses follow the prompt, in order."""
    prompt_length: int
    response_lengths: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.prompt_length + sum(self.response_lengths)


def make_blocks(
    prompt_lengths: list[int], response_lengths: list[int], group_size: int, *, shared_prompt: bool
) -> list[Block]:
    """One block per sample, or (``shared_prompt``) one per consecutive run of ``group_size`` samples."""
    per_block = group_size if shared_prompt else 1
    blocks = []
    for start in range(0, len(prompt_lengths), per_block):
        samples = tuple(range(start, min(start + per_block, len(prompt_lengths))))
        blocks.append(
            Block(
                samples=samples,
                prompt_length=prompt_lengths[start],
                response_lengths=tuple(response_lengths[i] for i in samples),
            )
        )
    return blocks


def pack_rows(blocks: list[Block], capacity: int | None = None) -> list[list[Block]]:
    """First-fit decreasing: rows of blocks, each row at most ``capacity`` tokens (default: the longest block).

    Rows no longer than the longest block: attention on the CPU (and SDPA with a float mask on a GPU)
    computes every (query, key) pair of a row whatever the mask says, so longer rows cost more than padding.
    Deterministic: ties keep the blocks' order.
    """
    if not blocks:
        return []
    capacity = max(block.length for block in blocks) if capacity is None else capacity
    rows: list[list[Block]] = []
    room: list[int] = []
    for block in sorted(blocks, key=lambda b: -b.length):
        if block.length > capacity:
            raise ValueError(f"a block of {block.length} tokens exceeds the row capacity {capacity}")
        for index, free in enumerate(room):
            if block.length <= free:
                rows[index].append(block)
                room[index] -= block.length
                break
        else:
            rows.append([block])
            room.append(capacity - block.length)
    return rows


@dataclass(frozen=True)
class ForwardLayout:
    """One forward's keyword inputs, and where each real response token's prediction sits in its outputs."""

    inputs: dict[str, torch.Tensor | None]
    computed_tokens: int
    """Token positions the forward computes (rows x row length)."""
    real_tokens: int
    """Real tokens of the micro-batch's samples, counted as if each sample were computed on its own."""
    occupied_tokens: int
    """Positions of the rows that hold a token (the rest is padding): below ``real_tokens`` when prompts are shared."""
    num_samples: int
    response_length: int
    prompt_length: int | None = None
    """Padded layout: the (cut) prompt width P of ``inputs``; None for block layouts."""
    prediction_index: tuple[torch.Tensor, torch.Tensor] | None = None
    """Block layouts: (row [T], column [T]) of the outputs predicting the T real response tokens."""
    token_index: tuple[torch.Tensor, torch.Tensor] | None = None
    """Block layouts: (sample [T], response position [T]) of those tokens."""
    prompt_token_mask: torch.Tensor | None = None
    """[rows, L] bool: True at prompt tokens (a vision-language forward puts image features only there: a
    response may contain an image token, which generation embedded as text)."""
    prompt_owners: tuple[int, ...] = ()
    """The samples whose prompt tokens the rows hold, in the order they appear (row by row): the order a
    vision-language forward takes their images in. Every sample for padded and packed; one a group for
    shared_prompt."""
    token_source: torch.Tensor | None = None
    """Block layouts: [rows, L] where each input position's token comes from, indexing
    ``cat([prompt_ids.flatten(), response_ids.flatten(), [pad]])`` of the micro-batch (:meth:`per_position`)."""

    def per_position(self, prompt_values: torch.Tensor, response_values: torch.Tensor, fill: int) -> torch.Tensor:
        """Per-token values laid out as the forward's input tokens: [rows, L, ...] from the micro-batch's
        ``prompt_values`` [n, P, ...] and ``response_values`` [n, R, ...] (full widths, as its ids), ``fill`` at
        padding positions. Routing replay lays out recorded expert choices with it."""
        if self.token_source is None:  # padded: [cut prompt | cut response]
            return torch.cat(
                [prompt_values[:, prompt_values.shape[1] - self.prompt_length :],
                 response_values[:, : self.response_length]], dim=1,
            )  # fmt: skip
        trailing = prompt_values.shape[2:]
        flat = torch.cat(
            [prompt_values.reshape(-1, *trailing), response_values.reshape(-1, *trailing),
             prompt_values.new_full((1, *trailing), fill)]
        )  # fmt: skip
        return flat[self.token_source.to(flat.device)]

    def response_terms(
        self,
        outputs: torch.Tensor,
        response_ids: torch.Tensor,
        *,
        temperature: float,
        head_weight: torch.Tensor | None,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs [n, R] fp32, entropy [n, R] or None) of the responses, zero at padding.

        ``outputs`` [rows, L, V or H]: the forward's logits, or hidden states when ``head_weight`` [V, H] is set.
        ``response_ids`` [n, R]: the micro-batch's responses at full width R.
        """
        if self.prediction_index is None:
            cut = response_ids[:, : self.response_length]
            logprobs, entropy = response_terms(
                outputs,
                prompt_length=self.prompt_length,
                response_ids=cut,
                temperature=temperature,
                head_weight=head_weight,
                with_entropy=with_entropy,
            )
            missing = response_ids.shape[1] - self.response_length
            return F.pad(logprobs, (0, missing)), None if entropy is None else F.pad(entropy, (0, missing))
        logprobs, entropy = aligned_response_terms(
            outputs[self.prediction_index].unsqueeze(0),  # [1, T, V or H]
            response_ids[self.token_index].unsqueeze(0),  # [1, T]
            temperature=temperature,
            head_weight=head_weight,
            with_entropy=with_entropy,
        )
        return self._scatter(logprobs[0], response_ids), None if entropy is None else self._scatter(
            entropy[0], response_ids
        )

    def _scatter(self, values: torch.Tensor, response_ids: torch.Tensor) -> torch.Tensor:
        """Values of the T real response tokens [T] -> [n, R], zero elsewhere (differentiable)."""
        full = values.new_zeros(response_ids.shape)
        return full.index_put(self.token_index, values)


def padded_layout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    prompt_positions: list[torch.Tensor] | None = None,
) -> ForwardLayout:
    """Today's layout with the micro-batch's unused padding columns cut: [n, P' + R'] rows.

    ``prompt_positions``: each sample's multimodal positions [3, p] of its real prompt tokens
    (``vision/rope.py``); the layout's ``position_ids`` are then [3, n, P' + R'] (see :func:`multimodal_positions`).
    """
    prompt_width = int(prompt_mask.sum(1).max())
    response_width = max(int(response_mask.sum(1).max()), 1)
    prompt_ids, prompt_mask = prompt_ids[:, -prompt_width:], prompt_mask[:, -prompt_width:]
    response_ids, response_mask = response_ids[:, :response_width], response_mask[:, :response_width]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    inputs = model_inputs(input_ids, attention_mask)
    if prompt_positions is not None:
        inputs["position_ids"] = _padded_multimodal_positions(prompt_positions, prompt_mask, response_mask)
    return ForwardLayout(
        inputs=inputs,
        computed_tokens=input_ids.numel(),
        real_tokens=int(attention_mask.sum()),
        occupied_tokens=int(attention_mask.sum()),
        num_samples=input_ids.shape[0],
        response_length=response_width,
        prompt_length=prompt_width,
        prompt_token_mask=torch.cat([prompt_mask.bool(), torch.zeros_like(response_mask, dtype=torch.bool)], dim=1),
        prompt_owners=tuple(range(input_ids.shape[0])),
    )


def _padded_multimodal_positions(
    prompt_positions: list[torch.Tensor], prompt_mask: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """[3, n, P + R]: each prompt's positions on its real tokens, its response continuing all three axes from one
    past the prompt's largest position; 1 at padding (as the model's own ``get_rope_index``)."""
    n, prompt_width = prompt_mask.shape
    positions = torch.ones(3, n, prompt_width + response_mask.shape[1], dtype=torch.long)
    for sample, (prompt_length, response_length) in enumerate(
        zip(prompt_mask.sum(1).tolist(), response_mask.sum(1).tolist(), strict=True)
    ):
        own = prompt_positions[sample]
        positions[:, sample, prompt_width - prompt_length : prompt_width] = own
        next_position = int(own.max()) + 1 if own.numel() else 0
        positions[:, sample, prompt_width : prompt_width + response_length] = (
            torch.arange(response_length) + next_position
        )
    return positions.to(prompt_mask.device)


def block_layout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_size: int,
    shared_prompt: bool,
    pad_token_id: int,
    mask_dtype: torch.dtype | None,
    prompt_positions: list[torch.Tensor] | None = None,
) -> ForwardLayout:
    """Packed (``shared_prompt`` False) or shared-prompt rows of the micro-batch's real tokens.

    ``prompt_positions``: each sample's multimodal positions [3, p] of its real prompt tokens; ``position_ids``
    are then [3, rows, L]: a block's prompt tokens take its first sample's, each response continues from one
    past them on all three axes (what the padded layout gives each sample on its own).

    Samples are group-major (``group_size`` consecutive samples share a prompt; the micro-batch starts at a
    group boundary). ``mask_dtype``: dtype of the additive 4D mask (the model's); None builds no mask, for
    flash-attention's variable-length path (packed only). Raises if ``shared_prompt`` and a group's prompts
    differ.
    """
    prompt_lengths = prompt_mask.sum(1).tolist()
    response_lengths = response_mask.sum(1).tolist()
    if shared_prompt:
        _check_shared_prompts(prompt_ids, prompt_mask, group_size)
    rows = pack_rows(make_blocks(prompt_lengths, response_lengths, group_size, shared_prompt=shared_prompt))
    tokens = _RowTokens.lay_out(
        rows, num_samples=prompt_ids.shape[0], prompt_width=prompt_ids.shape[1], response_width=response_ids.shape[1]
    )
    device = prompt_ids.device
    flat_ids = torch.cat([prompt_ids.reshape(-1), response_ids.reshape(-1), prompt_ids.new_full((1,), pad_token_id)])
    source = torch.tensor(tokens.source, device=device).view(len(rows), tokens.width)
    as_tensor = lambda values: torch.tensor(values, device=device)  # noqa: E731
    inputs: dict[str, torch.Tensor | None] = {
        "input_ids": flat_ids[source],
        "position_ids": as_tensor(tokens.position).view(len(rows), tokens.width),
        "attention_mask": None,
    }
    if prompt_positions is not None:
        inputs["position_ids"] = tokens.multimodal_positions(
            prompt_positions, prompt_lengths, num_samples=prompt_ids.shape[0], prompt_width=prompt_ids.shape[1]
        ).to(device)
    if mask_dtype is not None:
        inputs["attention_mask"] = block_attention_mask(
            as_tensor(tokens.block).view(len(rows), tokens.width),
            as_tensor(tokens.segment).view(len(rows), tokens.width),
            mask_dtype,
        )
    return ForwardLayout(
        inputs=inputs,
        computed_tokens=len(rows) * tokens.width,
        real_tokens=int(sum(prompt_lengths) + sum(response_lengths)),
        occupied_tokens=sum(block.length for row in rows for block in row),
        num_samples=prompt_ids.shape[0],
        response_length=response_ids.shape[1],
        prediction_index=(as_tensor(tokens.predict_row), as_tensor(tokens.predict_column)),
        token_index=(as_tensor(tokens.token_sample), as_tensor(tokens.token_position)),
        prompt_token_mask=((as_tensor(tokens.segment) == 0) & (as_tensor(tokens.block) >= 0)).view(
            len(rows), tokens.width
        ),
        prompt_owners=tuple(block.samples[0] for row in rows for block in row),
        token_source=source,
    )


def block_attention_mask(block: torch.Tensor, segment: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask [rows, 1, L, L] in ``dtype``: 0 where query q may attend key k, dtype's min elsewhere.

    ``block`` [rows, L]: block id of each position (-1 at padding); ``segment`` [rows, L]: 0 for a prompt
    token, j + 1 for response j. q attends k iff same block, k <= q, and k is a prompt token or in q's
    own response. Padding attends only to itself, so no row of the softmax is empty.
    """
    length = block.shape[1]
    columns = torch.arange(length, device=block.device)
    causal = columns[None, :] <= columns[:, None]  # [L(q), L(k)]
    same_block = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0)
    visible_segment = (segment[:, None, :] == 0) | (segment[:, None, :] == segment[:, :, None])
    allowed = (same_block & visible_segment & causal) | torch.eye(length, dtype=torch.bool, device=block.device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=block.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def _check_shared_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int) -> None:
    n = prompt_ids.shape[0]
    if n % group_size:
        raise ValueError(f"shared_prompt: {n} samples are not whole groups of {group_size}")
    ids = (prompt_ids * prompt_mask).view(n // group_size, group_size, -1)
    if not bool((ids == ids[:, :1]).all()):
        raise ValueError("shared_prompt needs the samples of a group to share one prompt; use sequence_layout=packed")


@dataclass
class _RowTokens:
    """Per-position index lists of laid-out rows (built in Python: a few thousand entries per micro-batch)."""

    width: int
    source: list[int]
    position: list[int]
    block: list[int]
    segment: list[int]
    predict_row: list[int]
    predict_column: list[int]
    token_sample: list[int]
    token_position: list[int]
    response_width: int = 0
    """R of the micro-batch's [n, R] responses (``source`` indexes them after the prompts)."""

    @classmethod
    def lay_out(
        cls, rows: list[list[Block]], *, num_samples: int, prompt_width: int, response_width: int
    ) -> _RowTokens:
        """``source`` indexes ``cat([prompt_ids.flatten(), response_ids.flatten(), [pad]])``."""
        pad_source = num_samples * (prompt_width + response_width)
        width = max(sum(block.length for block in row) for row in rows)
        tokens = cls(width, [], [], [], [], [], [], [], [], response_width)
        block_id = 0
        for row_index, row in enumerate(rows):
            used = 0
            for block in row:
                tokens._add_block(block, block_id, row_index, used, prompt_width, response_width, num_samples)
                used += block.length
                block_id += 1
            padding = width - used
            tokens.source += [pad_source] * padding
            tokens.position += list(range(padding))  # its own sequence for flash-attention's varlen path
            tokens.block += [-1] * padding
            tokens.segment += [0] * padding
        return tokens

    def multimodal_positions(
        self, prompt_positions: list[torch.Tensor], prompt_lengths: list[int], *, num_samples: int, prompt_width: int
    ) -> torch.Tensor:
        """[3, rows, width] positions from the 1D ones: a prompt token takes its sample's multimodal position, a
        response token shifts its 1D position by its sample's offset (one past the prompt's largest position,
        minus the prompt's length); padding keeps its 1D position on all axes."""
        prompt_end = num_samples * prompt_width
        pad_source = prompt_end + num_samples * self.response_width
        offsets = [
            (int(own.max()) + 1 if own.numel() else 0) - length
            for own, length in zip(prompt_positions, prompt_lengths, strict=True)
        ]
        columns = []
        for source, position in zip(self.source, self.position, strict=True):
            if source < prompt_end:
                columns.append(prompt_positions[source // prompt_width][:, position])
            elif source < pad_source:
                sample = (source - prompt_end) // self.response_width
                columns.append(torch.full((3,), position + offsets[sample], dtype=torch.long))
            else:
                columns.append(torch.full((3,), position, dtype=torch.long))
        return torch.stack(columns, dim=1).view(3, -1, self.width)

    def _add_block(
        self,
        block: Block,
        block_id: int,
        row: int,
        start: int,
        prompt_width: int,
        response_width: int,
        num_samples: int,
    ) -> None:
        first = block.samples[0]
        prompt_start = first * prompt_width + prompt_width - block.prompt_length  # prompts are left-padded
        self.source += range(prompt_start, prompt_start + block.prompt_length)
        self.position += range(block.prompt_length)
        self.block += [block_id] * block.prompt_length
        self.segment += [0] * block.prompt_length
        prompt_last = start + block.prompt_length - 1
        column = prompt_last + 1
        for segment, (sample, length) in enumerate(zip(block.samples, block.response_lengths, strict=True), 1):
            response_start = num_samples * prompt_width + sample * response_width
            self.source += range(response_start, response_start + length)
            self.position += range(block.prompt_length, block.prompt_length + length)
            self.block += [block_id] * length
            self.segment += [segment] * length
            if length:  # token r is predicted by the output before it: the prompt's last token for r = 0
                self.predict_row += [row] * length
                self.predict_column += [prompt_last, *range(column, column + length - 1)]
                self.token_sample += [sample] * length
                self.token_position += range(length)
            column += length
