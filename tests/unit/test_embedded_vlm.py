"""The shipped tiny VLM and its shapes-counting task (``scripts/build_tiny_vlm.py``) load offline, are what the
script builds, and behave as GRPO needs: the policy looks at the picture but is often one off.

Evaluated through the producer's own ``evaluate`` (prompts, images and decoding exactly as a run's eval at step
0), so a change to how the RL system prompts a VLM that the model was not pre-trained on shows up here.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the network

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from colossal_rl.config import EMBEDDED_SHAPES_EVAL_DATA, EMBEDDED_SHAPES_TRAIN_DATA, EMBEDDED_VLM_DIR, RLConfig
from colossal_rl.config_resolve import resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import build_tiny_vlm  # noqa: E402


def read_rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def test_the_model_is_a_small_fp32_qwen2_5_vl_with_the_scripts_tokenizer_and_processor(tmp_path):
    model = AutoModelForImageTextToText.from_pretrained(EMBEDDED_VLM_DIR, local_files_only=True)
    processor = AutoProcessor.from_pretrained(EMBEDDED_VLM_DIR, local_files_only=True)
    assert model.config.model_type == "qwen2_5_vl"
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    assert model.config.vocab_size == len(processor.tokenizer)
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    # The shipped tokenizer and processor are the script's (a rebuild must not silently change either).
    tokenizer = build_tiny_vlm.build_tokenizer()
    build_tiny_vlm.build_processor(tokenizer, build_tiny_vlm.TaskSpec()).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "preprocessor_config.json", "chat_template.json"):
        shipped = json.loads((EMBEDDED_VLM_DIR / name).read_text())
        assert json.loads((tmp_path / name).read_text()) == shipped, name


def test_the_shipped_rows_and_pictures_are_the_scripts_deterministic_output(tmp_path):
    task = build_tiny_vlm.TaskSpec()
    rng = random.Random(build_tiny_vlm.SEED)
    train_rows = build_tiny_vlm.build_split(rng, "train", task.num_train, task, tmp_path)
    eval_rows = build_tiny_vlm.build_split(rng, "eval", task.num_eval, task, tmp_path)
    assert read_rows(EMBEDDED_SHAPES_TRAIN_DATA) == train_rows
    assert read_rows(EMBEDDED_SHAPES_EVAL_DATA) == eval_rows
    shipped_dir = EMBEDDED_SHAPES_TRAIN_DATA.parent
    for row in train_rows[:50] + eval_rows[:50]:
        (image,) = row["images"]
        assert (shipped_dir / image).read_bytes() == (tmp_path / image).read_bytes(), image
    assert sorted(Counter(int(r["gt_answer"]) for r in eval_rows)) == list(range(1, task.max_shapes + 1))


@pytest.mark.slow
def test_greedy_counts_depend_on_the_picture_and_are_often_one_off():
    """Eval at step 0, as ``python rl_example.py -m <this model> -d <shapes> -rt boxed`` runs it: right on some
    pictures (well above the 0.2 of a constant answer), wrong — one off — on many, so GRPO has room to lift it."""
    from colossal_rl.reward import build_reward_scorer
    from colossal_rl.rollout.producer import Producer

    config = RLConfig()  # the flags' defaults: -rt boxed, greedy eval, one sample a prompt
    config = replace(
        config,
        model=replace(config.model, path=str(EMBEDDED_VLM_DIR)),
        data=replace(
            config.data,
            train_path=str(EMBEDDED_SHAPES_TRAIN_DATA),
            eval_paths=(("shapes", str(EMBEDDED_SHAPES_EVAL_DATA)),),
        ),
        generation=replace(config.generation, max_new_tokens=12),
    ).validate()
    producer = Producer(0, resolve(config), build_reward_scorer("boxed", timeout_s=5.0, num_workers=1))
    (result,) = producer.evaluate(num_producers=1)
    assert result.num_prompts == 200
    truths = [int(record["gt_answer"]) for record in result.records]
    answers = [build_tiny_vlm.boxed_answer(record["response"]) for record in result.records]
    assert all(answer is not None for answer in answers)  # the format is learned: every answer is boxed
    right = sum(int(a) == t for a, t in zip(answers, truths, strict=True)) / len(truths)
    assert right == pytest.approx(result.accuracy)  # the reward's verdict is the count's
    one_off = sum(abs(int(a) - t) == 1 for a, t in zip(answers, truths, strict=True)) / len(truths)
    assert 0.3 <= right <= 0.6, right
    assert right + one_off >= 0.95
    per_count = {c: Counter(int(a) for a, t in zip(answers, truths, strict=True) if t == c) for c in set(truths)}
    most_common = {c: counts.most_common(1)[0][0] for c, counts in per_count.items()}
    assert len(set(most_common.values())) >= 4, most_common  # the answer follows the picture
