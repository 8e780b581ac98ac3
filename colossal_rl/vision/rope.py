"""Qwen2.5-VL's multimodal rotary positions: three axes (time, height, width) per token.

Text tokens advance all three axes together; the tokens of an image (``<|image_pad|>`` after
``<|vision_start|>``) sit on its grid of merged patches: time 0, row ``h``, column ``w``, offset by the position
the image starts at (a still image's time axis is 0 for every frame of its temporal patch). The text after an image resumes at one past the largest position used so far, so a
sequence's positions end below its length and generation continues from there (the model's ``rope_deltas``).

:func:`sequence_positions` numbers one sequence's real tokens from 0; the padded and packed layouts place those
numbers where the sequence's tokens sit (left padding, or a block of a packed row). Equal to the model's own
``get_rope_index`` (``tests/unit/test_vision.py``). Images only: video inputs are not supported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeTokens:
    """What the positions depend on, from the model config."""

    image_token_id: int
    vision_start_token_id: int
    spatial_merge_size: int

    @classmethod
    def of(cls, model_config) -> RopeTokens:
        return cls(
            image_token_id=model_config.image_token_id,
            vision_start_token_id=model_config.vision_start_token_id,
            spatial_merge_size=model_config.vision_config.spatial_merge_size,
        )


def sequence_positions(
    token_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, tokens: RopeTokens
) -> torch.Tensor:
    """[3, L] long positions of one sequence's real tokens ``token_ids`` [L], numbered from 0;
    ``image_grid_thw`` [images, 3] lists its images in order (None or empty: a text-only sequence)."""
    length = token_ids.shape[0]
    ids = token_ids.tolist()
    pieces: list[torch.Tensor] = []
    next_position, cursor = 0, 0
    starts = [
        i + 1
        for i, t in enumerate(ids[:-1])
        if t == tokens.vision_start_token_id and ids[i + 1] == tokens.image_token_id
    ]
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    if len(starts) != len(grids):
        raise ValueError(f"the sequence has {len(starts)} images but image_grid_thw lists {len(grids)}")
    for start, (t, h, w) in zip(starts, grids, strict=True):
        merged_h, merged_w = h // tokens.spatial_merge_size, w // tokens.spatial_merge_size
        text = start - cursor
        pieces.append(torch.arange(text).expand(3, -1) + next_position)
        next_position += text
        grid = torch.stack(
            [
                torch.zeros(t * merged_h * merged_w, dtype=torch.long),  # an image's time axis stays at 0
                torch.arange(merged_h).repeat_interleave(merged_w).repeat(t),
                torch.arange(merged_w).repeat(t * merged_h),
            ]
        )
        pieces.append(grid + next_position)
        next_position = int(grid.max()) + next_position + 1
        cursor = start + t * merged_h * merged_w
    if cursor < length:
        pieces.append(torch.arange(length - cursor).expand(3, -1) + next_position)
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    if positions.shape[1] != length:
        raise ValueError(f"image tokens do not fit image_grid_thw: {positions.shape[1]} positions for {length} tokens")
    return positions.to(torch.long)


def padded_positions(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, grids: list[torch.Tensor | None], tokens: RopeTokens
) -> torch.Tensor:
    """[3, N, L] positions of rows ``input_ids`` [N, L] whose real tokens are where ``attention_mask`` is 1
    (any padding), row ``i``'s images being ``grids[i]``. Padding gets 1, as the model's ``get_rope_index`` gives."""
    positions = torch.ones(3, *input_ids.shape, dtype=torch.long)
    for row in range(input_ids.shape[0]):
        real = attention_mask[row].bool().cpu()
        positions[:, row, real] = sequence_positions(input_ids[row].cpu()[real], grids[row], tokens)
    return positions.to(input_ids.device)


def next_text_position(positions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[N, 1]: the position of the first token after each row's last real one (where generation continues)."""
    masked = positions.masked_fill(~attention_mask.bool().unsqueeze(0), -1)
    return masked.amax(dim=(0, 2)).unsqueeze(-1) + 1
