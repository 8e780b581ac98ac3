"""Build the embedded reward model: a tiny Qwen2 sequence classifier that prefers correct ``\\boxed{}`` sums.

Writes, deterministically (fixed seeds, one thread, deterministic algorithms), ``colossal_rl/assets/tiny_reward_model/``:
a Hugging Face ``Qwen2ForSequenceClassification`` (``num_labels=1``, fp32 safetensors) with the embedded policy's
character tokenizer and chat template (``build_tiny_model.build_tokenizer``). Both phases use the embedded TRAIN
questions only, and texts rendered exactly as :class:`colossal_rl.reward.reward_model.RewardModelScorer` renders
them (the row's messages, no system prompt):

1. Exact sums (:func:`learn_exact_sums`). The policy (``colossal_rl/assets/tiny_qwen2``) knows sums only to within
   one (it was pre-trained to answer sum + 1 most of the time), and only behind the system prompt it is prompted
   with: on the scorer's texts its greedy answers are not even boxed. A short supervised fine-tune on the true
   ``\\boxed{<sum>}`` fixes both. (``build_tiny_model``'s clean phase alone does not know exact sums: 5 % greedy.)
2. Preferences. Like InstructGPT's reward models, a fresh score head on that backbone, trained on pairs: chosen =
   ``\\boxed{<sum>}``, rejected = a wrong answer drawn like the policy's mistakes (mostly sum + 1, sometimes sum - 1,
   off by 2 or by a ten, any other number, no box, an unclosed box, two answers). The loss is the Bradley-Terry
   pairwise loss plus a pointwise logistic loss (correct -> 1, wrong -> 0) that anchors raw score 0 at even odds, so
   ``sigmoid(score) > 0.5`` reads as "correct". The learning rate is low: at 1e-3 the updates wreck the sum features
   before the head learns to compare the written digits with them (sum + 1 stays at chance).

Usage: ``python scripts/build_tiny_reward_model.py [--output-root DIR] [--steps N] [--sum-steps N]``; logs, at the
end, the pairwise accuracy on EVAL-question pairs and the agreement with the boxed verifier on the policy's samples.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_model import (  # noqa: E402
    TrainSpec,
    boxed_answer,
    build_tokenizer,
    generate_texts,
    make_suffix_batch,
    optimize,
    prompt_ids_of,
)

from colossal_rl.config import ASSETS_DIR, EMBEDDED_EVAL_DATA, EMBEDDED_MODEL_DIR, EMBEDDED_TRAIN_DATA  # noqa: E402
from colossal_rl.reward.reward_model import render_conversation  # noqa: E402

logger = logging.getLogger("build_tiny_reward_model")

SEED = 20250147
SUM_TRAIN = TrainSpec(clean_steps=200, noisy_steps=0, batch_size=64, learning_rate=1e-3, warmup_steps=20)
"""The backbone's fine-tune on true sums, rendered as the scorer renders them; ``clean_steps`` is the number of steps."""
REWARD_MODEL_TRAIN = TrainSpec(clean_steps=1200, noisy_steps=0, batch_size=32, learning_rate=2e-4, warmup_steps=120)
"""``batch_size`` pairs per step; ``clean_steps`` is the number of steps (there is no noisy phase)."""
EVAL_PAIRS_PER_QUESTION = 3
POLICY_SAMPLES_PER_QUESTION = 4

# Wrong answers as the policy makes them: (kind, probability).
MISTAKES = (("plus_one", 0.45), ("minus_one", 0.1), ("near", 0.1), ("other_number", 0.15), ("unboxed", 0.1),
            ("malformed", 0.1))  # fmt: skip


def correct_response(answer: int) -> str:
    return f"\\boxed{{{answer}}}"


def rejected_response(answer: int, rng: random.Random) -> tuple[str, str]:
    """``(kind, response)``: a wrong response to a question whose sum is ``answer``."""
    kind = rng.choices([k for k, _ in MISTAKES], [p for _, p in MISTAKES])[0]
    if kind == "plus_one":
        return kind, f"\\boxed{{{answer + 1}}}"
    if kind == "minus_one":
        return kind, f"\\boxed{{{answer - 1}}}"
    if kind == "near":
        return kind, f"\\boxed{{{answer + rng.choice([-10, -9, -2, 2, 9, 10, 11])}}}"
    if kind == "other_number":
        other = rng.randrange(0, 260)
        return kind, f"\\boxed{{{other if other != answer else other + 1}}}"
    if kind == "unboxed":
        return kind, str(answer)
    malformed = ["\\boxed{}", f"\\boxed{{{answer}", f"\\boxed{{{answer + 1}}}\\boxed{{{answer}}}", ""]
    return kind, rng.choice(malformed)


def read_rows(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def encode(tokenizer, response: str, row: dict) -> list[int]:
    return tokenizer(render_conversation(tokenizer, response, row), add_special_tokens=False)["input_ids"]


def scores_of(model, sequences: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """The model's score of each token sequence [N], right-padded as the scorer pads."""
    length = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)  # [N, T]
    attention_mask = torch.zeros_like(input_ids)  # [N, T]
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]


def preference_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry ``-log sigmoid(s_chosen - s_rejected)`` plus the pointwise logistic anchor, both means."""
    pairwise = -F.logsigmoid(chosen_scores - rejected_scores).mean()
    pointwise = (F.softplus(-chosen_scores).mean() + F.softplus(rejected_scores).mean()) / 2
    return pairwise + pointwise


def train_reward_model(model, tokenizer, rows: list[dict], train: TrainSpec) -> None:
    rng = random.Random(SEED + 1)

    def loss_at(step: int) -> torch.Tensor:
        batch = [rows[rng.randrange(len(rows))] for _ in range(train.batch_size)]
        chosen = [encode(tokenizer, correct_response(int(row["gt_answer"])), row) for row in batch]
        rejected = [encode(tokenizer, rejected_response(int(row["gt_answer"]), rng)[1], row) for row in batch]
        scores = scores_of(model, chosen + rejected, tokenizer.pad_token_id)
        return preference_loss(scores[: len(batch)], scores[len(batch) :])

    optimize(model, train, loss_at)


@torch.inference_mode()
def pairwise_accuracy(model, tokenizer, rows: list[dict]) -> dict[str, float]:
    """How often the correct response outscores a wrong one, over ``EVAL_PAIRS_PER_QUESTION`` seeded wrong responses
    per row: overall and per kind of mistake."""
    rng = random.Random(SEED + 2)
    kinds, chosen, rejected = [], [], []
    for row in rows:
        for _ in range(EVAL_PAIRS_PER_QUESTION):
            kind, response = rejected_response(int(row["gt_answer"]), rng)
            kinds.append(kind)
            chosen.append(encode(tokenizer, correct_response(int(row["gt_answer"])), row))
            rejected.append(encode(tokenizer, response, row))
    wins = (
        scores_of(model, chosen, tokenizer.pad_token_id) > scores_of(model, rejected, tokenizer.pad_token_id)
    ).tolist()
    accuracy = {"pairwise_accuracy": statistics.mean(wins)}
    for kind, _ in MISTAKES:
        accuracy[f"pairwise_accuracy_{kind}"] = statistics.mean(
            w for w, k in zip(wins, kinds, strict=True) if k == kind
        )
    return accuracy


@torch.inference_mode()
def policy_sample_agreement(model, tokenizer, rows: list[dict]) -> dict[str, float]:
    """On ``POLICY_SAMPLES_PER_QUESTION`` samples of the embedded policy per row (temperature 1, prompted as the
    producers prompt it): how often ``score > 0`` agrees with the boxed verifier, and how often a correct sample
    outscores a wrong one to the same question (the comparison GRPO's group advantages make)."""
    policy = Qwen2ForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, local_files_only=True)
    torch.manual_seed(SEED + 4)
    responses = generate_texts(policy, tokenizer, prompt_ids_of(tokenizer, rows), POLICY_SAMPLES_PER_QUESTION, True)
    sample_rows = [row for row in rows for _ in range(POLICY_SAMPLES_PER_QUESTION)]
    correct = [boxed_answer(text) == row["gt_answer"] for text, row in zip(responses, sample_rows, strict=True)]
    scores = scores_of(model, [encode(tokenizer, text, row) for text, row in zip(responses, sample_rows, strict=True)],
                       tokenizer.pad_token_id).tolist()  # fmt: skip
    group_wins = [
        scores[i] > scores[j]
        for start in range(0, len(responses), POLICY_SAMPLES_PER_QUESTION)
        for i in range(start, start + POLICY_SAMPLES_PER_QUESTION)
        for j in range(start, start + POLICY_SAMPLES_PER_QUESTION)
        if correct[i] and not correct[j]
    ]
    return {
        "policy_samples": len(responses),
        "policy_samples_correct": statistics.mean(correct),
        "verifier_agreement": statistics.mean((score > 0) == ok for score, ok in zip(scores, correct, strict=True)),
        "group_pairwise_accuracy": statistics.mean(group_wins) if group_wins else math.nan,
    }


def learn_exact_sums(tokenizer, rows: list[dict], train: TrainSpec) -> Qwen2ForCausalLM:
    """The policy fine-tuned on true sums, its texts rendered as the scorer renders them (no system prompt).

    The policy knows sums only to within one, and only after the system prompt it was trained behind: on the
    scorer's texts its greedy answers are not even boxed. A short supervised fine-tune on the TRAIN questions' true
    ``\\boxed{<sum>}`` (the loss on the response tokens) gives the reward model features that know exact sums."""
    model = Qwen2ForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, local_files_only=True)
    generator = torch.Generator().manual_seed(SEED + 3)
    texts = [encode(tokenizer, correct_response(int(row["gt_answer"])), row) for row in rows]
    prompt_lengths = [len(encode(tokenizer, "", row)) - 1 for row in rows]  # up to the assistant marker; no eos

    def loss_at(step: int) -> torch.Tensor:
        indices = torch.randint(len(rows), (train.batch_size,), generator=generator).tolist()
        input_ids, attention_mask, labels = make_suffix_batch(
            [texts[i] for i in indices], [prompt_lengths[i] for i in indices], tokenizer.pad_token_id
        )
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    optimize(model, train, loss_at)
    return model


def reward_model_from(language_model: Qwen2ForCausalLM) -> Qwen2ForSequenceClassification:
    """A one-logit classifier on ``language_model``'s backbone, with a fresh score head."""
    config = copy.deepcopy(language_model.config)
    config.num_labels = 1
    model = Qwen2ForSequenceClassification(config)
    model.model.load_state_dict(language_model.model.state_dict())
    return model


def build_reward_model(
    model_dir: Path, train: TrainSpec = REWARD_MODEL_TRAIN, sum_train: TrainSpec = SUM_TRAIN
) -> Qwen2ForSequenceClassification:
    """Train the reward model (seeded here, so two builds in one process are equal) and save it to ``model_dir``."""
    torch.manual_seed(SEED)
    tokenizer = build_tokenizer()
    rows = read_rows(EMBEDDED_TRAIN_DATA)
    model = reward_model_from(learn_exact_sums(tokenizer, rows, sum_train))
    train_reward_model(model, tokenizer, rows, train)
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-root", type=Path, default=ASSETS_DIR)
    parser.add_argument("--steps", type=int, default=REWARD_MODEL_TRAIN.clean_steps)
    parser.add_argument("--sum-steps", type=int, default=SUM_TRAIN.clean_steps)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)  # fixed thread count: reproducible reductions, and modest CPU use
    torch.use_deterministic_algorithms(True)
    start = time.perf_counter()
    model_dir = args.output_root / "tiny_reward_model"
    train = dataclasses.replace(REWARD_MODEL_TRAIN, clean_steps=args.steps)
    model = build_reward_model(model_dir, train, dataclasses.replace(SUM_TRAIN, clean_steps=args.sum_steps))
    tokenizer, eval_rows = build_tokenizer(), read_rows(EMBEDDED_EVAL_DATA)
    metrics = pairwise_accuracy(model, tokenizer, eval_rows) | policy_sample_agreement(model, tokenizer, eval_rows[:50])
    for name, value in metrics.items():
        logger.info("eval %s: %.3f", name, value)
    logger.info("built %s in %.0f s", model_dir, time.perf_counter() - start)


if __name__ == "__main__":
    main()
