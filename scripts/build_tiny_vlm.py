"""Build the embedded vision-language model and data: a tiny Qwen2.5-VL partially competent at counting shapes.

Writes, deterministically (fixed seeds, one thread, deterministic algorithms):

* ``colossal_rl/assets/shapes/{train,eval}.jsonl`` and ``shapes/images/*.png``: 112 x 112 pictures of 1-5
  filled squares and circles in a few solid colours, each in its own cell of a 4 x 4 grid, asked "how many
  shapes?" (answer: the total count), in ColossalChat's math format with an ``<image>`` marker and the image
  path relative to the jsonl;
* ``colossal_rl/assets/tiny_qwen2_5_vl/``: a real Hugging Face Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``,
  fp32 safetensors) with a character-level fast tokenizer (plus the vision special tokens), a compact chat
  template whose image parts render as ``<|vision_start|><|image_pad|><|vision_end|>``, and a
  ``Qwen2VLImageProcessor`` that turns each 112 x 112 picture into an 8 x 8 patch grid (16 image tokens after
  the 2 x 2 merge). Loads with ``AutoProcessor`` / ``AutoModelForImageTextToText``.

Recipe (as ``scripts/build_tiny_model.py``): the model is pre-trained on ``\\boxed{<count>}`` completions of the
train split (loss on the completion only), first 800 steps on true counts (learn to count: the model ignores the
picture for ~350 steps, then reaches a completion loss of ~0.02 per token by step 700), then 250 steps on
deliberately noisy labels: the true count with probability 0.3, otherwise one too many (one too few for 5). Its
greedy answer is therefore right or one off, while sampling at temperature 1 finds the right count in a few tries
— the regime in which GRPO visibly lifts greedy accuracy. Batches of 8, AdamW at 3e-4 (50 warmup steps, cosine to
10 %): at 2e-3 (batches of 16) it stayed on the ignore-the-picture plateau for 800+ steps, and batches of 8 learn
about twice as much per example seen as batches of 16 (whose vision attention also costs more: transformers 4.51
masks all of a batch's patches at once, quadratic in the number of images). Every prompt is
encoded exactly as the RL system encodes it (``build_messages`` with the "boxed" system prompt, ``row_images`` +
``with_image_parts`` + ``encode_vision_prompt``), so rebuild the model whenever that prompt or encoding changes.
Batches are left-padded and the model computes its own multimodal rotary positions (``position_ids=None``).

Measured (one CPU thread, this seed): greedy accuracy 0.400 on eval (0.600 one off), 0.360 on 200 train rows;
temperature-1 sampled accuracy 0.341 on eval, eval pass@8 0.915 (train 0.880). 0.86 M parameters (model.safetensors
3.5 MB; the pictures 0.5 MB).

Usage: ``python scripts/build_tiny_vlm.py [--output-root DIR] [--clean-steps N] [--noisy-steps N]`` (about seven
minutes on one CPU core: 0.26 s a training step, two minutes of evaluation).
"""

from __future__ import annotations

import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from transformers import (
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2TokenizerFast,
    Qwen2VLImageProcessor,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_model import (  # noqa: E402
    TrainSpec,
    boxed_answer,
    optimize,
    start_build,
    write_jsonl,
)
from build_tiny_model import build_tokenizer as build_text_tokenizer  # noqa: E402

from colossal_rl.data import build_messages  # noqa: E402
from colossal_rl.prompts import DEFAULT_SYSTEM_PROMPTS  # noqa: E402
from colossal_rl.vision.inputs import VisionInputs, model_vision_kwargs  # noqa: E402
from colossal_rl.vision.prompts import encode_vision_prompt, row_images, with_image_parts  # noqa: E402

logger = logging.getLogger("build_tiny_vlm")

SEED = 20250202

VISION_TOKENS = {
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image_pad": "<|image_pad|>",
    "video_pad": "<|video_pad|>",
}
# build_tiny_model's template, with list-of-parts contents: an image part is the vision block the processor
# expands to one <|image_pad|> per merged patch.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}{{ raise_exception('unsupported content part: ' + part['type']) }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|endoftext|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
QUESTIONS = ("How many shapes are in the picture?", "Count the shapes.", "How many shapes do you see?")
COLOURS = ((220, 40, 40), (40, 80, 220), (30, 160, 60), (240, 150, 20), (140, 60, 180))


@dataclass(frozen=True)
class TaskSpec:
    """The synthetic task: count 1..``max_shapes`` squares and circles on a white ``image_side`` picture."""

    image_side: int = 112
    max_shapes: int = 5
    cells: int = 4
    """The picture is a cells x cells grid (28-pixel cells: one merged patch each); a shape sits inside one cell."""
    min_size: int = 12
    max_size: int = 24
    num_train: int = 1500
    num_eval: int = 200
    label_correct_probability: float = 0.3
    """Noisy-phase labels are the true count with this probability, else one off (count + 1, or 4 for 5)."""


TRAIN = TrainSpec(clean_steps=800, noisy_steps=250, batch_size=8, learning_rate=3e-4, warmup_steps=50)
"""Pre-training schedule: ``clean_steps`` on true counts, then ``noisy_steps`` on noisy labels; one warmup +
cosine learning-rate schedule over both (``build_tiny_model._lr_factor``)."""


def build_tokenizer() -> Qwen2TokenizerFast:
    """build_tiny_model's character-level tokenizer plus the vision special tokens, with this model's template."""
    tokenizer = build_text_tokenizer(tuple(VISION_TOKENS.values()), Qwen2TokenizerFast, model_max_length=512)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_processor(tokenizer: Qwen2TokenizerFast, task: TaskSpec) -> Qwen2_5_VLProcessor:
    """An image is resized to exactly ``image_side`` squared pixels (a multiple of patch 14 x merge 2)."""
    pixels = task.image_side * task.image_side
    image_processor = Qwen2VLImageProcessor(
        min_pixels=pixels, max_pixels=pixels, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    return Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def build_model(tokenizer: Qwen2TokenizerFast) -> Qwen2_5_VLForConditionalGeneration:
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKENS.items()}
    config = Qwen2_5_VLConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},  # head_dim 32: 16 frequencies
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=None,
        image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "in_channels": 3,
            "out_hidden_size": 128,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
        },
        torch_dtype="float32",
    )
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_new_tokens=12
    )
    return model


# ---------------------------------------------------------------------------------------------------- data


def draw_picture(rng: random.Random, count: int, task: TaskSpec) -> Image.Image:
    """A palette picture of ``count`` filled squares and circles, each inside its own cell of a
    ``cells`` x ``cells`` grid (no anti-aliasing). A cell is one merged patch of the vision tower (28 pixels), so
    counting is counting the image tokens that show a shape: learnable by a model this small on CPU in minutes
    (shapes anywhere, spanning several tokens, were not, in this budget)."""
    image = Image.new("P", (task.image_side, task.image_side), 0)
    image.putpalette([255, 255, 255, *(channel for colour in COLOURS for channel in colour)])
    draw = ImageDraw.Draw(image)
    cell = task.image_side // task.cells
    for index in rng.sample(range(task.cells * task.cells), count):
        row, column = divmod(index, task.cells)
        size = rng.randint(task.min_size, task.max_size)
        x = column * cell + rng.randint(0, cell - size)
        y = row * cell + rng.randint(0, cell - size)
        box = (x, y, x + size - 1, y + size - 1)
        colour = 1 + rng.randrange(len(COLOURS))
        if rng.random() < 0.5:
            draw.rectangle(box, fill=colour)
        else:
            draw.ellipse(box, fill=colour)
    return image


def build_split(rng: random.Random, split: str, num_rows: int, task: TaskSpec, data_dir: Path) -> list[dict]:
    """Rows of one split, counts balanced over 1..max_shapes (shuffled); writes their pictures."""
    counts = [1 + i % task.max_shapes for i in range(num_rows)]
    rng.shuffle(counts)
    rows = []
    for index, count in enumerate(counts, start=1):
        relative = f"images/{split}_{index:05d}.png"
        (data_dir / relative).parent.mkdir(parents=True, exist_ok=True)
        draw_picture(rng, count, task).save(data_dir / relative, optimize=True)
        question = QUESTIONS[rng.randrange(len(QUESTIONS))]
        rows.append(
            {
                "messages": {"role": "user", "content": f"{question}<image>"},
                "gt_answer": str(count),
                "images": [relative],
            }
        )
    return rows


@dataclass(frozen=True)
class Encoded:
    prompt_ids: list[int]
    vision: VisionInputs
    count: int


def encode_rows(processor, rows: list[dict], jsonl_path: Path) -> list[Encoded]:
    """Prompts built exactly as the RL producers build them."""
    system_prompt = DEFAULT_SYSTEM_PROMPTS["boxed"]
    encoded = []
    for index, row in enumerate(rows):
        where = f"{jsonl_path}, row {index}"
        images = row_images(row, "images", jsonl_path.parent, where)
        messages = with_image_parts(build_messages(row["messages"], system_prompt), len(images), where)
        prompt_ids, vision = encode_vision_prompt(processor, messages, images)
        encoded.append(Encoded(prompt_ids, vision, int(row["gt_answer"])))
    return encoded


# ------------------------------------------------------------------------------------------- pre-training


def response_ids_of(tokenizer, answer: int) -> list[int]:
    return tokenizer(f"\\boxed{{{answer}}}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def left_padded(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, sequence in enumerate(sequences):
        input_ids[row, length - len(sequence) :] = torch.tensor(sequence)
        attention_mask[row, length - len(sequence) :] = 1
    return input_ids, attention_mask


def noisy_label(count: int, task: TaskSpec) -> int:
    return count + 1 if count < task.max_shapes else count - 1


def pretrain(model, tokenizer, examples: list[Encoded], task: TaskSpec, train: TrainSpec) -> None:
    """Supervised pre-training on ``\\boxed{}`` answers (loss on the completion only), noisy at the end."""
    generator = torch.Generator().manual_seed(SEED + 1)

    def loss_at(step: int) -> torch.Tensor:
        indices = torch.randint(len(examples), (train.batch_size,), generator=generator).tolist()
        correct = torch.rand(train.batch_size, generator=generator) < task.label_correct_probability
        if step < train.clean_steps:
            correct[:] = True
        batch = [examples[i] for i in indices]
        sequences, labels_from = [], []
        for example, right in zip(batch, correct.tolist(), strict=True):
            label = example.count if right else noisy_label(example.count, task)
            sequences.append(example.prompt_ids + response_ids_of(tokenizer, label))
            labels_from.append(len(example.prompt_ids))
        input_ids, attention_mask = left_padded(sequences, tokenizer.pad_token_id)
        labels = torch.full_like(input_ids, -100)
        for row, (sequence, first) in enumerate(zip(sequences, labels_from, strict=True)):
            completion = len(sequence) - first
            labels[row, -completion:] = input_ids[row, -completion:]
        output = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=None,
            labels=labels,
            use_cache=False,
            **model_vision_kwargs([e.vision for e in batch], "cpu", torch.float32),
        )
        return output.loss

    optimize(model, train, loss_at)


# --------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def generate_texts(model, tokenizer, examples: list[Encoded], do_sample: bool, max_new_tokens: int = 12) -> list[str]:
    """Decoded responses to ``examples`` (left padding, KV cache; the model derives its rotary positions)."""
    input_ids, attention_mask = left_padded([e.prompt_ids for e in examples], tokenizer.pad_token_id)
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **model_vision_kwargs([e.vision for e in examples], "cpu", torch.float32),
        **sampling,
    )
    return tokenizer.batch_decode(output[:, input_ids.shape[1] :], skip_special_tokens=True)


def evaluate(
    model, tokenizer, examples: list[Encoded], num_samples: int = 8, greedy_batch: int = 20, sample_prompts: int = 4
) -> dict[str, float]:
    """Greedy accuracy (and how often greedy is one off), mean sampled accuracy at temperature 1 and
    pass@``num_samples``. Small generation batches: transformers 4.51's vision attention masks the whole batch's
    patches at once (quadratic in the number of images)."""
    torch.manual_seed(SEED + 2)
    greedy: list[str | None] = []
    sampled: list[str | None] = []  # num_samples consecutive entries per example
    for start in range(0, len(examples), greedy_batch):
        chunk = examples[start : start + greedy_batch]
        greedy += map(boxed_answer, generate_texts(model, tokenizer, chunk, do_sample=False))
    for start in range(0, len(examples), sample_prompts):
        repeated = [e for e in examples[start : start + sample_prompts] for _ in range(num_samples)]
        sampled += map(boxed_answer, generate_texts(model, tokenizer, repeated, do_sample=True))
    truths = [str(e.count) for e in examples]
    hits = [[a == t for a in sampled[i * num_samples : (i + 1) * num_samples]] for i, t in enumerate(truths)]
    return {
        "greedy_accuracy": statistics.mean(a == t for a, t in zip(greedy, truths, strict=True)),
        "greedy_off_by_one": statistics.mean(
            a in (str(int(t) - 1), str(int(t) + 1)) for a, t in zip(greedy, truths, strict=True)
        ),
        "sampled_accuracy": statistics.mean(sum(h) / num_samples for h in hits),
        f"pass@{num_samples}": statistics.mean(any(h) for h in hits),
    }


def main() -> None:
    args = start_build(__doc__, TRAIN, TaskSpec, SEED)
    start = time.perf_counter()
    task = TaskSpec(label_correct_probability=args.label_correct_probability)
    train = replace(TRAIN, clean_steps=args.clean_steps, noisy_steps=args.noisy_steps)

    data_dir = args.output_root / "shapes"
    rng = random.Random(SEED)
    train_rows = build_split(rng, "train", task.num_train, task, data_dir)
    eval_rows = build_split(rng, "eval", task.num_eval, task, data_dir)
    write_jsonl(data_dir / "train.jsonl", train_rows)
    write_jsonl(data_dir / "eval.jsonl", eval_rows)
    logger.info(
        "wrote %d + %d rows to %s (%.0f s)", len(train_rows), len(eval_rows), data_dir, time.perf_counter() - start
    )

    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer, task)
    train_examples = encode_rows(processor, train_rows, data_dir / "train.jsonl")
    eval_examples = encode_rows(processor, eval_rows, data_dir / "eval.jsonl")
    lengths = [len(e.prompt_ids) for e in train_examples]
    logger.info(
        "prompts: %d-%d tokens, grid %s (%.0f s)",
        min(lengths),
        max(lengths),
        train_examples[0].vision.image_grid_thw.tolist(),
        time.perf_counter() - start,
    )

    model = build_model(tokenizer)
    logger.info("model: %.2f M parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    pretrain(model, tokenizer, train_examples, task, train)

    model_dir = args.output_root / "tiny_qwen2_5_vl"
    model.save_pretrained(model_dir, safe_serialization=True)
    processor.save_pretrained(model_dir)
    metrics = {f"eval {k}": v for k, v in evaluate(model, tokenizer, eval_examples).items()}
    metrics |= {f"train {k}": v for k, v in evaluate(model, tokenizer, train_examples[:200]).items()}
    for name, value in metrics.items():
        logger.info("%s: %.3f", name, value)
    elapsed = time.perf_counter() - start
    print(f"built {model_dir} in {elapsed:.0f} s: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))


if __name__ == "__main__":
    main()
