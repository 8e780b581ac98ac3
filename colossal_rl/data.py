"""Prompt datasets: rows (from any source, see ``data_sources``) turned into model token ids.

Rows follow ColossalChat's math format ``{"messages": {"role": "user", "content": ...}, "gt_answer": ...}``
(``messages`` may also be a list of such dicts). Every prompt is encoded through
:func:`encode_prompt` — the one path the producers, the evaluator and the embedded
model's pre-training all share, so the model always sees the token sequence it was trained on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colossal_rl.data_sources import DataError, RowKeys, load_prompt_rows, split_source

if TYPE_CHECKING:
    from colossal_rl.vision.inputs import VisionInputs

logger = logging.getLogger(__name__)

__all__ = ["DataError", "PromptDataset", "build_messages", "encode_prompt", "load_prompt_dataset"]


def build_messages(row_messages: Any, system_prompt: str | None) -> list[dict[str, str]]:
    """Chat messages for one row: the system prompt (if any) followed by the row's messages."""
    messages = [row_messages] if isinstance(row_messages, dict) else list(row_messages)
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}] + [m for m in messages if m.get("role") != "system"]
    return messages


def encode_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt, ending with the assistant turn's opening (the generation prompt)."""
    # return_dict=False: transformers 5 (the vLLM producers' environment) returns a BatchEncoding by default.
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(token) for token in ids]


@dataclass(frozen=True)
class ImagePrompting:
    """How a vision-language policy's prompts take their rows' images (``colossal_rl/vision/prompts.py``)."""

    processor: Any
    """The model's processor (``AutoProcessor``): chat template, tokenizer and image processor."""
    image_key: str = "images"
    min_pixels: int | None = None
    max_pixels: int | None = None
    limit_images: int | None = None

    def encode(self, row: dict, system_prompt: str | None, base_dir: Path, where: str) -> tuple[list[int], Any]:
        """(prompt ids, :class:`VisionInputs` or None) of one row."""
        from colossal_rl.vision.prompts import encode_vision_prompt, row_images, with_image_parts

        images = row_images(row, self.image_key, base_dir, where)
        messages = with_image_parts(build_messages(row["messages"], system_prompt), len(images), where)
        return encode_vision_prompt(
            self.processor, messages, images, min_pixels=self.min_pixels, max_pixels=self.max_pixels
        )

    def num_images(self, row: dict) -> int:
        value = row.get(self.image_key)
        return 0 if value is None else len(value) if isinstance(value, list | tuple) else 1


@dataclass(frozen=True)
class PromptDataset:
    """Rows of one source with their encoded prompts (``prompt_ids[i]`` belongs to ``rows[i]``)."""

    path: str
    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    dropped_overlong: int = 0
    """Rows of the source left out for being longer than the prompt budget."""
    images: ImagePrompting | None = None
    """Set for a vision-language policy: rows' images are processed again when a round needs them
    (:meth:`vision_inputs`), so a dataset's pixels are never all held at once."""
    dropped_too_many_images: int = 0
    """Rows left out for having more than ``limit_images`` images."""
    system_prompt: str | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def vision_inputs(self, index: int) -> VisionInputs | None:
        """Row ``index``'s processed images (None: a text-only dataset or row)."""
        if self.images is None:
            return None
        where = f"{self.path} row {index + 1}"
        return self.images.encode(self.rows[index], self.system_prompt, source_directory(self.path), where)[1]

    def raw_images(self, index: int) -> list:
        """Row ``index``'s images as RGB PIL images, before any processing ([] for a text-only dataset or row):
        what the vLLM backend hands its engine, which processes them itself."""
        if self.images is None:
            return []
        from colossal_rl.vision.prompts import row_images

        where = f"{self.path} row {index + 1}"
        return row_images(self.rows[index], self.images.image_key, source_directory(self.path), where)


def source_directory(source: str | Path) -> Path:
    """Where a source's relative image paths start: a file's directory, or a saved dataset's own directory."""
    location = Path(split_source(str(source))[0]).expanduser()
    return location if location.is_dir() else location.parent


def load_prompt_dataset(
    source: str | Path,
    tokenizer,
    system_prompt: str | None,
    max_prompt_tokens: int,
    keys: RowKeys | None = None,
    images: ImagePrompting | None = None,
) -> PromptDataset:
    """Load and encode a prompt source; prompts longer than ``max_prompt_tokens`` (image tokens included) are
    left out and counted (logged), as are rows with more than ``images.limit_images`` images; a source with
    none left is an error."""
    rows, prompt_ids = [], []
    all_rows = load_prompt_rows(source, keys or RowKeys())
    base_dir, too_many_images = source_directory(source), 0
    for number, row in enumerate(all_rows, 1):
        if images is None:
            ids = encode_prompt(tokenizer, build_messages(row["messages"], system_prompt))
        elif images.limit_images is not None and images.num_images(row) > images.limit_images:
            too_many_images += 1
            continue
        else:
            ids = images.encode(row, system_prompt, base_dir, f"{source} row {number}")[0]
        if len(ids) <= max_prompt_tokens:
            rows.append(row)
            prompt_ids.append(ids)
    if too_many_images:
        logger.warning(
            "%s: left out %d of %d prompts with more than --limit-images = %d images",
            source,
            too_many_images,
            len(all_rows),
            images.limit_images,
        )
    dropped = len(all_rows) - len(rows) - too_many_images
    if not rows:
        overlong = f"longer than -mpt/--max-prompt-tokens = {max_prompt_tokens} tokens"
        if not too_many_images:
            raise DataError(f"{source}: all {len(all_rows)} prompts are {overlong}")
        raise DataError(
            f"{source}: no prompt left: {too_many_images} of {len(all_rows)} have more than --limit-images = "
            f"{images.limit_images} images, the other {len(all_rows) - too_many_images} are {overlong}"
        )
    if dropped:
        logger.warning(
            "%s: left out %d of %d prompts longer than -mpt/--max-prompt-tokens = %d tokens",
            source,
            dropped,
            len(all_rows),
            max_prompt_tokens,
        )
    return PromptDataset(
        path=str(source),
        rows=rows,
        prompt_ids=prompt_ids,
        dropped_overlong=dropped,
        images=images,
        dropped_too_many_images=too_many_images,
        system_prompt=system_prompt,
    )
