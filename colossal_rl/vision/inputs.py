"""One prompt's processed images: what the vision tower reads, and what the rotary positions are built from.

A rollout batch carries one :class:`VisionInputs` per sample, the samples of a group sharing *the same object*:
pickling (Ray's object store included) memoises it, so a group's pixels travel once, not ``group_size`` times.
Only torch is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionInputs:
    pixel_values: torch.Tensor
    """[patches, channels * temporal_patch * patch * patch]: every image's flattened patches, image after image."""
    image_grid_thw: torch.Tensor
    """[images, 3] long: each image's grid of patches (time, height, width) before the spatial merge."""

    def __post_init__(self) -> None:
        if self.image_grid_thw.ndim != 2 or self.image_grid_thw.shape[1] != 3:
            raise ValueError(f"image_grid_thw must be [images, 3], got {tuple(self.image_grid_thw.shape)}")
        patches = int(self.image_grid_thw.prod(dim=1).sum())
        if patches != self.pixel_values.shape[0]:
            raise ValueError(
                f"image_grid_thw describes {patches} patches, pixel_values has {self.pixel_values.shape[0]}"
            )


def model_vision_kwargs(per_sample: list[VisionInputs | None], device: torch.device | str, dtype: torch.dtype):
    """The forward's ``pixel_values``/``image_grid_thw`` for samples in row order (samples without images add
    nothing); {} when no sample has images."""
    present = [v for v in per_sample if v is not None]
    if not present:
        return {}
    return {
        "pixel_values": torch.cat([v.pixel_values for v in present]).to(device, dtype),
        "image_grid_thw": torch.cat([v.image_grid_thw for v in present]).to(device),
    }
