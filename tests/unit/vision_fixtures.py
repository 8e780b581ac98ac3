"""A random-weight tiny Qwen2.5-VL (real architecture, real processor) built in a temporary directory, and
synthetic image rows: what the vision tests run on without the shipped, pre-trained ``tiny_qwen2_5_vl``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # build_tiny_vlm.py

IMAGE_SIDE = 56
"""56 x 56 pixels: a 4 x 4 grid of 14-pixel patches, 4 image tokens after the 2 x 2 merge."""


def build_random_vlm(directory: Path, *, seed: int = 0) -> Path:
    """The shipped VLM's tokenizer and processor (``scripts/build_tiny_vlm.py``, images resized to 56 x 56), with a
    smaller random-weight model (52 K parameters: the tests generate and train with it)."""
    from build_tiny_vlm import VISION_TOKENS, TaskSpec, build_processor, build_tokenizer
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer, TaskSpec(image_side=IMAGE_SIDE))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS.values()}
    config = Qwen2_5_VLConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        tie_word_embeddings=True,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def draw_shapes(path: Path, count: int, *, size: tuple[int, int] = (IMAGE_SIDE, IMAGE_SIDE), seed: int = 0) -> Path:
    """``count`` coloured squares on white, ``size`` = (width, height) pixels."""
    generator = torch.Generator().manual_seed(seed)
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    for i in range(count):
        x = int(torch.randint(0, size[0] - 10, (1,), generator=generator))
        y = int(torch.randint(0, size[1] - 10, (1,), generator=generator))
        draw.rectangle([x, y, x + 8, y + 8], fill=("red", "blue", "green")[i % 3])
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def write_image_rows(path: Path, counts: list[int], *, size: tuple[int, int] = (IMAGE_SIDE, IMAGE_SIDE)) -> Path:
    """A jsonl of "<image>How many?" rows whose images (relative paths) hold ``counts[i]`` squares."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for i, count in enumerate(counts):
            draw_shapes(path.parent / "images" / f"{i}.png", count, size=size, seed=i)
            row = {
                "messages": {"role": "user", "content": "<image>How many?"},
                "gt_answer": str(count),
                "images": [f"images/{i}.png"],
            }
            handle.write(json.dumps(row) + "\n")
    return path
