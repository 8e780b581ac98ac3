"""Rows with images -> chat messages with image parts -> prompt token ids and :class:`VisionInputs`.

A row's images (``--image-key``, default ``images``) are a list of file paths relative to the dataset file (or
absolute), ``datasets`` Image values (PIL images, or ``{"bytes": ..., "path": ...}`` dicts), or one of those
alone. The prompt text marks where each image goes with ``<image>`` (EasyR1's and geometry3k's convention);
a prompt without markers gets its images before its text. Markers and images must agree in number.

Every image prompt is encoded by :func:`encode_vision_prompt`, the one path the producers, the evaluator and
the tiny VLM's pre-training (``scripts/build_tiny_vlm.py``) share: the processor's chat template renders the
image parts as ``<|vision_start|><|image_pad|><|vision_end|>``, the processor expands each ``<|image_pad|>`` to
one token per merged patch of that image (resized within ``--min-pixels``/``--max-pixels``).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from colossal_rl.vision.inputs import VisionInputs

IMAGE_PLACEHOLDER = "<image>"


class ImageDataError(ValueError):
    """A row's images are missing, unreadable or disagree with its ``<image>`` markers; names file and row."""


def open_image(value: Any, base_dir: Path, where: str):
    """One image value of a row as an RGB PIL image."""
    from PIL import Image

    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, dict) and value.get("bytes") is not None:
            image = Image.open(io.BytesIO(value["bytes"]))
        elif isinstance(value, dict) and value.get("path"):
            image = Image.open(_resolve(value["path"], base_dir))
        elif isinstance(value, str):
            image = Image.open(_resolve(value, base_dir))
        else:
            raise ImageDataError(
                f"{where}: an image must be a path, a PIL image or a {{bytes, path}} dict, got {type(value).__name__}"
            )
        return image.convert("RGB")
    except (OSError, ValueError) as error:
        if isinstance(error, ImageDataError):
            raise
        raise ImageDataError(
            f"{where}: cannot read image {value if isinstance(value, str) else type(value).__name__}: {error}"
        ) from error


def _resolve(path: str, base_dir: Path) -> Path:
    candidate = Path(path).expanduser()
    return candidate if candidate.is_absolute() else base_dir / candidate


def row_images(row: dict, image_key: str, base_dir: Path, where: str) -> list:
    """The row's images (opened), [] when it has none."""
    value = row.get(image_key)
    if value is None:
        return []
    values = value if isinstance(value, list | tuple) else [value]
    return [open_image(v, base_dir, f"{where}, {image_key}[{i}]") for i, v in enumerate(values)]


def count_image_markers(messages: list[dict]) -> int:
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m.get("content"), str))


def with_image_parts(messages: list[dict], num_images: int, where: str) -> list[dict]:
    """``messages`` with each ``<image>`` marker turned into an image part (``{"type": "image"}``) between text
    parts; without markers, ``num_images`` image parts open the first user message."""
    markers = count_image_markers(messages)
    if markers and markers != num_images:
        raise ImageDataError(f"{where}: the prompt has {markers} {IMAGE_PLACEHOLDER} markers but {num_images} images")
    result = []
    placed = markers > 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str):
            result.append(message)
            continue
        if markers:
            parts = []
            for i, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
                if i:
                    parts.append({"type": "image"})
                if text:
                    parts.append({"type": "text", "text": text})
        elif not placed and message.get("role") == "user" and num_images:
            parts = [{"type": "image"}] * num_images + ([{"type": "text", "text": content}] if content else [])
            placed = True
        else:
            parts = [{"type": "text", "text": content}]
        result.append({**message, "content": parts})
    if not placed and num_images:
        raise ImageDataError(f"{where}: {num_images} images but no user message to put them in")
    return result


def encode_vision_prompt(
    processor, messages: list[dict], images: list, *, min_pixels: int | None = None, max_pixels: int | None = None
) -> tuple[list[int], VisionInputs | None]:
    """Token ids of the chat prompt (ending with the assistant turn's opening) with every image's placeholder
    expanded, and the images' processed inputs (None without images). ``messages`` come from
    :func:`with_image_parts`."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not images:
        return list(processor.tokenizer(text, add_special_tokens=False)["input_ids"]), None
    pixel_kwargs = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    features = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False, **pixel_kwargs)
    vision = VisionInputs(
        pixel_values=features["pixel_values"], image_grid_thw=features["image_grid_thw"].to(torch.long)
    )
    return features["input_ids"][0].tolist(), vision
