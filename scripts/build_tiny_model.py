"""Build the embedded default model and data: a tiny Qwen2 that is partially competent at small addition.

Writes, deterministically (fixed seeds, one thread, deterministic algorithms):

* ``colossal_rl/assets/tiny_qwen2/``: a real Hugging Face Qwen2 causal LM (fp32 safetensors) with a
  character-level fast tokenizer and a compact chat template;
* ``colossal_rl/assets/data/{train,eval}.jsonl``: ``a+b=?`` questions in ColossalChat's math format,
  disjoint between the splits.

The model is pre-trained on ``\\boxed{<sum>}`` completions whose labels are deliberately noisy: right
only part of the time and otherwise one too high. Its greedy answer is therefore usually off by one
while sampling often finds the right sum — the regime in which GRPO visibly lifts greedy accuracy in a
few hundred steps. Prompts are encoded exactly as the RL system encodes them (``build_messages`` +
``encode_prompt`` with the "boxed" system prompt), so rebuild the model whenever that prompt changes.

Usage: ``python scripts/build_tiny_model.py [--output-root DIR]`` (about four minutes on one CPU core).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import DynamicCache, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from colossal_rl.config import ASSETS_DIR
from colossal_rl.data import build_messages, encode_prompt
from colossal_rl.prompts import DEFAULT_SYSTEM_PROMPTS

logger = logging.getLogger("build_tiny_model")

SEED = 20250101

EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
# Each turn is its role marker (one special token) followed by its content; an assistant turn ends
# with eos, which is also where generation stops. The generation prompt is the bare assistant marker.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ '<|endoftext|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass(frozen=True)
class TaskSpec:
    """The synthetic task: ``a+b=?`` with ``0 <= a <= max_first`` and ``0 <= b <= max_second``.

    Adding a single digit to a number is learnable by a 0.8 M-parameter model in a few hundred steps
    (two-digit + two-digit addition is not, on CPU budgets), and 250 x 10 pairs leave room for
    2,000 + 200 distinct questions."""

    max_first: int = 249
    max_second: int = 9
    num_train: int = 2000
    num_eval: int = 200
    label_correct_probability: float = 0.3
    """Pre-training labels are the true sum with this probability, else the sum plus one."""


@dataclass(frozen=True)
class TrainSpec:
    """Pre-training schedule: ``clean_steps`` on true sums (learn the arithmetic), then ``noisy_steps``
    on noisy labels (learn the off-by-one habit); one warmup + cosine learning-rate schedule over both."""

    clean_steps: int = 600
    noisy_steps: int = 400
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01

    @property
    def steps(self) -> int:
        return self.clean_steps + self.noisy_steps


def build_tokenizer(
    extra_specials: tuple[str, ...] = (),
    tokenizer_class: type[PreTrainedTokenizerFast] = PreTrainedTokenizerFast,
    model_max_length: int = 256,
) -> PreTrainedTokenizerFast:
    """Character-level fast tokenizer: one token per printable ASCII character, newline and tab. The tiny VLM
    adds its vision tokens (``extra_specials``) and asks for a ``Qwen2TokenizerFast`` (the processor loads its
    tokenizer through Qwen2's classes)."""
    specials = [EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS.values(), *extra_specials]
    characters = [chr(code) for code in range(32, 127)] + ["\n", "\t"]
    vocab = {token: index for index, token in enumerate(specials + characters)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    backend.decoder = decoders.Fuse()  # join tokens back without separators
    backend.add_special_tokens(specials)
    tokenizer = tokenizer_class(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        bos_token=None,
        additional_special_tokens=specials[2:],
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        sliding_window=None,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_new_tokens=12
    )
    return model


def build_rows(task: TaskSpec) -> tuple[list[dict], list[dict]]:
    """Train and eval rows: a seeded split of all ``(a, b)`` pairs, so the questions are disjoint."""
    pairs = [(a, b) for a in range(task.max_first + 1) for b in range(task.max_second + 1)]
    if task.num_train + task.num_eval > len(pairs):
        raise ValueError(f"only {len(pairs)} distinct questions for {task.num_train} + {task.num_eval} rows")
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(SEED)).tolist()
    rows = [
        {"messages": {"role": "user", "content": f"{a}+{b}=?"}, "gt_answer": str(a + b)}
        for a, b in (pairs[i] for i in order[: task.num_train + task.num_eval])
    ]
    return rows[: task.num_train], rows[task.num_train :]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True) + "\n")


def prompt_ids_of(tokenizer: PreTrainedTokenizerFast, rows: list[dict]) -> list[list[int]]:
    """Prompt token ids built exactly as the RL producers build them."""
    system_prompt = DEFAULT_SYSTEM_PROMPTS["boxed"]
    return [encode_prompt(tokenizer, build_messages(row["messages"], system_prompt)) for row in rows]


def response_ids_of(tokenizer: PreTrainedTokenizerFast, answer: int) -> list[int]:
    return tokenizer(f"\\boxed{{{answer}}}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def common_prefix_length(sequences: list[list[int]]) -> int:
    """Length of the token prefix shared by all sequences, leaving at least one token in each."""
    length = min(len(s) for s in sequences) - 1
    for position in range(length):
        if len({s[position] for s in sequences}) > 1:
            return position
    return length


def make_suffix_batch(
    suffixes: list[list[int]], num_unlabelled: list[int], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` [B, T]; the first ``num_unlabelled[i]``
    tokens of row ``i`` (its prompt) are not labelled."""
    length = max(len(s) for s in suffixes)
    input_ids = torch.full((len(suffixes), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, (suffix, skip) in enumerate(zip(suffixes, num_unlabelled, strict=True)):
        input_ids[row, : len(suffix)] = torch.tensor(suffix)
        attention_mask[row, : len(suffix)] = 1
        labels[row, skip : len(suffix)] = torch.tensor(suffix[skip:])
    return input_ids, attention_mask, labels


def prefix_shared_loss(model: Qwen2ForCausalLM, prefix: list[int], suffixes, num_unlabelled, pad_token_id: int):
    """Language-model loss of ``prefix + suffix`` rows, running the shared prefix once.

    Every prompt starts with the same system prompt (~75 characters, most of each sequence): its keys
    and values are computed once with gradients and broadcast over the batch. Mathematically the same
    loss as the full batch, several times cheaper on CPU.
    """
    input_ids, suffix_mask, labels = make_suffix_batch(suffixes, num_unlabelled, pad_token_id)
    return loss_after_shared_prefix(model, prefix, input_ids, suffix_mask, labels)


def loss_after_shared_prefix(model, prefix: list[int], input_ids, suffix_mask, labels) -> torch.Tensor:
    """Loss of the suffix rows ``input_ids`` [B, S] (``labels`` -100 where untrained) after ``prefix``, whose keys
    and values are computed once, with gradients, and broadcast over the batch.

    Runs under transformers 4.51 and 5 alike: the prefix pass gets a cache of plain layers (transformers 5 would
    otherwise keep only a sliding-window layer's last tokens), and the expanded cache is built from (key, value)
    pairs, which both versions' ``DynamicCache`` accept (5 has no legacy-cache converters)."""
    prefix_cache = model.model(
        input_ids=torch.tensor([prefix]), past_key_values=DynamicCache(), use_cache=True
    ).past_key_values
    batch_size = input_ids.shape[0]
    cache = DynamicCache(
        tuple(
            (layer[0].expand(batch_size, -1, -1, -1), layer[1].expand(batch_size, -1, -1, -1)) for layer in prefix_cache
        )
    )
    attention_mask = torch.cat([torch.ones(batch_size, len(prefix), dtype=torch.long), suffix_mask], dim=1)
    position_ids = torch.arange(len(prefix), len(prefix) + input_ids.shape[1]).expand(batch_size, -1)
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        labels=labels,
        use_cache=False,
    )
    return output.loss


def pretrain(model: Qwen2ForCausalLM, tokenizer, rows: list[dict], task: TaskSpec, train: TrainSpec) -> None:
    """Supervised pre-training on ``\\boxed{}`` answers to every question (both splits), noisy at the end."""
    generator = torch.Generator().manual_seed(SEED + 1)
    prompts = prompt_ids_of(tokenizer, rows)
    prefix_length = common_prefix_length(prompts)
    prefix = prompts[0][:prefix_length]
    answers = torch.tensor([int(row["gt_answer"]) for row in rows])

    def loss_at(step: int) -> torch.Tensor:
        indices = torch.randint(len(rows), (train.batch_size,), generator=generator).tolist()
        correct = torch.rand(train.batch_size, generator=generator) < task.label_correct_probability
        if step < train.clean_steps:
            correct[:] = True
        labels = answers[indices] + (~correct).long()  # wrong labels are systematically one too high
        suffixes = [
            prompts[i][prefix_length:] + response_ids_of(tokenizer, int(label))
            for i, label in zip(indices, labels, strict=True)
        ]
        num_unlabelled = [len(prompts[i]) - prefix_length for i in indices]
        return prefix_shared_loss(model, prefix, suffixes, num_unlabelled, tokenizer.pad_token_id)

    optimize(model, train, loss_at)


def optimize(model, train: TrainSpec, loss_at: Callable[[int], torch.Tensor]) -> None:
    """``train.steps`` AdamW steps on ``loss_at(step)`` (gradients clipped to norm 1, ``_lr_factor``'s schedule),
    the model in train mode meanwhile; the pre-training loop of every build script."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.learning_rate, weight_decay=train.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, train))
    model.train()
    start = time.perf_counter()
    losses: list[float] = []
    for step in range(train.steps):
        loss = loss_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == train.steps - 1:
            logger.info("step %d/%d loss %.4f (mean of last 100 %.4f) (%.0f s)", step, train.steps, losses[-1],
                        statistics.mean(losses[-100:]), time.perf_counter() - start)  # fmt: skip
    model.eval()


def _lr_factor(step: int, train: TrainSpec) -> float:
    """Linear warmup, then cosine decay to 10 %."""
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text``, or None."""
    matches = _BOXED.findall(text)
    return matches[-1].strip() if matches else None


@torch.no_grad()
def generate_texts(model, tokenizer, prompts: list[list[int]], num_samples: int, do_sample: bool) -> list[str]:
    """Decoded responses, ``num_samples`` per prompt in prompt order (left padding, as the producers do)."""
    length = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), length), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, length - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, length - len(prompt) :] = 1
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=12,
        num_return_sequences=num_samples,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **sampling,
    )
    return tokenizer.batch_decode(output[:, length:], skip_special_tokens=True)


def evaluate(model, tokenizer, rows: list[dict], num_samples: int = 8, batch_size: int = 50) -> dict[str, float]:
    """Greedy accuracy (and how often greedy says sum + 1), mean sampled accuracy at temperature 1
    and pass@``num_samples`` on ``rows``."""
    torch.manual_seed(SEED + 2)
    prompts = prompt_ids_of(tokenizer, rows)
    greedy_answers: list[str | None] = []
    sampled_answers: list[str | None] = []  # num_samples consecutive entries per row
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        greedy_answers += map(boxed_answer, generate_texts(model, tokenizer, chunk, 1, do_sample=False))
        sampled_answers += map(boxed_answer, generate_texts(model, tokenizer, chunk, num_samples, do_sample=True))
    truths = [row["gt_answer"] for row in rows]
    sampled_hits = [
        [answer == truth for answer in sampled_answers[i * num_samples : (i + 1) * num_samples]]
        for i, truth in enumerate(truths)
    ]
    return {
        "greedy_accuracy": statistics.mean(a == t for a, t in zip(greedy_answers, truths, strict=True)),
        "greedy_off_by_one": statistics.mean(a == str(int(t) + 1) for a, t in zip(greedy_answers, truths, strict=True)),
        "sampled_accuracy": statistics.mean(sum(hits) / num_samples for hits in sampled_hits),
        f"pass@{num_samples}": statistics.mean(any(hits) for hits in sampled_hits),
    }


def start_build(
    doc: str, train_spec: TrainSpec, task_spec: type, seed: int, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """A build script's flags (defaults from its ``TrainSpec`` values and ``TaskSpec``; added to ``parser``, which
    may hold the script's own), logging, and the reproducibility settings every build runs under: one thread,
    deterministic algorithms, ``seed``. Shared with build_tiny_vlm, build_tiny_moe_model and build_tiny_2026_models."""
    parser = parser or argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--output-root", type=Path, default=ASSETS_DIR)
    parser.add_argument("--clean-steps", type=int, default=train_spec.clean_steps)
    parser.add_argument("--noisy-steps", type=int, default=train_spec.noisy_steps)
    parser.add_argument("--label-correct-probability", type=float, default=task_spec.label_correct_probability)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)  # fixed thread count: reproducible reductions, and modest CPU use
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    return args


def main() -> None:
    args = start_build(__doc__, TrainSpec(), TaskSpec, SEED)
    start = time.perf_counter()
    task = TaskSpec(label_correct_probability=args.label_correct_probability)
    train = TrainSpec(clean_steps=args.clean_steps, noisy_steps=args.noisy_steps)

    train_rows, eval_rows = build_rows(task)
    write_jsonl(args.output_root / "data" / "train.jsonl", train_rows)
    write_jsonl(args.output_root / "data" / "eval.jsonl", eval_rows)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    logger.info("model: %.2f M parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    pretrain(model, tokenizer, train_rows + eval_rows, task, train)

    model_dir = args.output_root / "tiny_qwen2"
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    metrics = evaluate(model, tokenizer, eval_rows)
    for name, value in metrics.items():
        logger.info("eval %s: %.3f", name, value)
    elapsed = time.perf_counter() - start
    print(f"built {model_dir} in {elapsed:.0f} s: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))


if __name__ == "__main__":
    main()
