"""Build the embedded tool-calling model and task: a tiny Qwen2 that sometimes calls a calculator.

Writes, deterministically (fixed seeds, one thread, deterministic algorithms):

* ``colossal_rl/assets/arithmetic/{train,eval}.jsonl``: ``a*b=?`` (three digits times two) and ``a+b=?`` (four
  digits plus four) questions in ColossalChat's math format, disjoint between the splits. A 0.8 M-parameter
  model cannot do these in its head; the calculator can.
* ``colossal_rl/assets/tiny_qwen2_tools/``: a Hugging Face Qwen2 causal LM (fp32 safetensors) with the embedded
  model's character-level tokenizer plus Qwen's four tool tokens (``<tool_call>``, ``</tool_call>``,
  ``<tool_response>``, ``</tool_response>``, ordinary added tokens as in Qwen2.5's vocabulary, so they survive
  ``skip_special_tokens``), 512 positions, and a chat template that takes ``tools=`` (one compact line per
  tool, so a prompt with its tools is ~160 tokens) and renders ``tool`` messages as Qwen does
  (``<tool_response>`` blocks in a user turn).

Recipe: supervised pre-training on two kinds of episode of every question, rendered by the rollout's own code
(``ChatTurns`` and ``CalculatorEnvironment`` with the "boxed" system prompt), so the token sequences are exactly
what ``python rl_example.py --env calculator`` samples and trains on; the loss is on the policy's tokens only.

* tool episode: ``<tool_call>{"name": "calculator", "arguments": {"expression": "a*b"}}</tool_call>``, the
  calculator's ``<tool_response>``, then ``\\boxed{<result>}`` copied from it;
* direct episode: ``\\boxed{<true answer>}`` at once (which the model mostly gets wrong: it cannot multiply).

First ``clean_steps`` with tool episodes half of the time (learn to call and to copy), then ``noisy_steps``
with tool episodes ``tool_probability`` of the time (the habit). The model then samples a tool call for about a
quarter of the questions and is right on a third of those (it does not always copy the numbers exactly), never
without the tool; its greedy first token is the direct answer, so its greedy accuracy is 0 — the regime in which
GRPO with the calculator environment raises the tool-call rate, the copying, and, once calling becomes the
greedy choice, the accuracy.

Measured (one CPU thread, this seed, 200 eval rows through ``run_episodes``): greedy accuracy 0.000, greedy
tool-call rate 0.000; at temperature 1 (4 samples a row) accuracy 0.087, tool-call rate 0.271, accuracy 0.323
with the tool and 0.000 without. 0.80 M parameters (model.safetensors 3.2 MB, the data 0.17 MB).

Usage: ``python scripts/build_tiny_tool_model.py [--output-root DIR]`` (800 steps of 32 episodes at ~0.35 CPU
seconds a step, so about 5 minutes of one core plus the evaluation; it took 36 minutes of wall time on a shared
machine at load ~20).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_model import (  # noqa: E402
    TrainSpec,
    build_model,
    build_tokenizer,
    loss_after_shared_prefix,
    optimize,
    write_jsonl,
)

from colossal_rl.config import ASSETS_DIR  # noqa: E402
from colossal_rl.environments import EnvironmentContext  # noqa: E402
from colossal_rl.environments.calculator import CalculatorEnvironment  # noqa: E402
from colossal_rl.prompts import DEFAULT_SYSTEM_PROMPTS  # noqa: E402
from colossal_rl.rollout.chat_turns import ChatTurns  # noqa: E402

logger = logging.getLogger("build_tiny_tool_model")

SEED = 20250303
MODEL_DIR_NAME = "tiny_qwen2_tools"
DATA_DIR_NAME = "arithmetic"
MAX_POSITIONS = 512
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
WORD_TOKENS = ("calculator", "expression", "arguments", "name")
"""Whole words of the call's JSON as one token each, as a BPE vocabulary has them: a call is ~30 tokens, not 75."""

# The embedded model's template (a role token, then the content; eos ends an assistant turn) plus tools: one
# line naming each tool and its arguments after the system prompt, and tool results as Qwen renders them (one
# user turn of <tool_response> blocks for consecutive tool messages).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(tools_line='') -%}"
    "{%- if tools -%}"
    "{%- set ns.tools_line = 'Tools:' -%}"
    "{%- for tool in tools -%}{%- set f = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set ns.tools_line = ns.tools_line + ' ' + f['name'] + '('"
    " + ((f['parameters']['properties'] if f['parameters'] is defined and f['parameters']['properties'] is defined"
    " else {}) | list | join(', ')) + ')' -%}"
    "{%- endfor -%}"
    '{%- set ns.tools_line = ns.tools_line + \'. Call one as <tool_call>{"name": ..., "arguments": {...}}'
    "</tool_call>.' -%}"
    "{%- if messages[0]['role'] != 'system' -%}{{ '<|system|>' + ns.tools_line }}{%- endif -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{ '<|user|>' }}{%- else -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- elif message['role'] in ['system', 'user', 'assistant'] -%}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{%- if message['role'] == 'system' and loop.first and ns.tools_line -%}{{ '\\n' + ns.tools_line }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ '<|endoftext|>' }}{%- endif -%}"
    "{%- else -%}{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


@dataclass(frozen=True)
class TaskSpec:
    """The task: half ``a*b=?`` (100 <= a <= 999, 10 <= b <= 99), half ``a+b=?`` (1000 <= a, b <= 9999)."""

    num_train: int = 2000
    num_eval: int = 200
    tool_probability: float = 0.25
    """After the clean phase, a pre-training episode calls the calculator with this probability."""


TRAIN = TrainSpec(clean_steps=600, noisy_steps=200, batch_size=32, learning_rate=3e-3, warmup_steps=100)
"""``clean_steps`` with tool episodes half of the time, then ``noisy_steps`` at ``tool_probability``; one warmup +
cosine learning-rate schedule over both (``build_tiny_model._lr_factor``)."""


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """The embedded model's tokenizer, 512 positions, Qwen's tool tokens as ordinary added tokens, this template."""
    tokenizer = build_tokenizer(model_max_length=MAX_POSITIONS)
    tokenizer.add_tokens(list(TOOL_TOKENS + WORD_TOKENS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tool_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    # The embedded model's shape, sized to this vocabulary; its first initialisation is discarded, but the random
    # numbers it drew are part of this recipe (the shipped weights depend on them).
    config = build_model(tokenizer).config
    config.max_position_embeddings = MAX_POSITIONS
    model = Qwen2ForCausalLM(config)
    model.generation_config.max_new_tokens = 64
    return model


def question(rng: random.Random) -> tuple[str, int]:
    if rng.random() < 0.5:
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        return f"{a}*{b}", a * b
    a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
    return f"{a}+{b}", a + b


def build_rows(task: TaskSpec) -> tuple[list[dict], list[dict]]:
    """Train and eval rows of distinct seeded questions (so the splits are disjoint)."""
    rng = random.Random(SEED)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < task.num_train + task.num_eval:
        expression, answer = question(rng)
        if expression not in seen:
            seen.add(expression)
            rows.append({"messages": {"role": "user", "content": f"{expression}=?"}, "gt_answer": str(answer)})
    return rows[: task.num_train], rows[task.num_train :]


def expression_of(row: dict) -> str:
    return row["messages"]["content"].removesuffix("=?")


def tool_call_text(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def boxed_text(answer: str) -> str:
    return f"\\boxed{{{answer}}}"


@dataclass(frozen=True)
class Episodes:
    """One row's two pre-training episodes as token ids, each with a 0/1 mask of the tokens that are trained."""

    tool: tuple[list[int], list[int]]
    direct: tuple[list[int], list[int]]


def render_episodes(tokenizer: PreTrainedTokenizerFast, rows: list[dict]) -> list[Episodes]:
    """Every row's tool and direct episode, rendered exactly as the ``--env calculator`` rollout renders them."""
    chat = ChatTurns(tokenizer)
    context = EnvironmentContext(reward_scorer=None, system_prompt=DEFAULT_SYSTEM_PROMPTS["boxed"])
    eos = tokenizer.eos_token_id

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    episodes = []
    for row in rows:
        environment = CalculatorEnvironment(context)
        prompt = chat.prompt_ids(environment.reset(row), environment.tools)
        call = encode(tool_call_text(expression_of(row))) + [eos]
        result = environment.step(tokenizer.decode(call, skip_special_tokens=True))
        if result.tool_calls != 1 or result.tool_errors:
            raise RuntimeError(f"the calculator refused {row}: {result}")
        observation = chat.observation_ids(result.observation, eos)
        answer = encode(boxed_text(row["gt_answer"])) + [eos]
        tool = prompt + call + observation + answer
        tool_mask = [0] * len(prompt) + [1] * len(call) + [0] * len(observation) + [1] * len(answer)
        direct = prompt + answer
        episodes.append(Episodes(tool=(tool, tool_mask), direct=(direct, [0] * len(prompt) + [1] * len(answer))))
    return episodes


def shared_prefix_length(sequences: list[list[int]]) -> int:
    length = min(len(s) for s in sequences) - 1
    for position in range(length):
        if len({s[position] for s in sequences}) > 1:
            return position
    return length


def masked_batch(sequences: list[tuple[list[int], list[int]]], skip: int, pad_token_id: int):
    """Right-padded ``input_ids``, ``attention_mask``, ``labels`` [B, T] of the sequences past their first
    ``skip`` tokens; labels only where the mask is 1."""
    length = max(len(ids) for ids, _ in sequences) - skip
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, (ids, mask) in enumerate(sequences):
        ids, mask = torch.tensor(ids[skip:]), torch.tensor(mask[skip:])
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return input_ids, attention_mask, labels


def batch_loss(model, prefix: list[int], sequences, pad_token_id: int) -> torch.Tensor:
    """Loss of the policy tokens of ``sequences`` (which all start with ``prefix``), the prefix run once."""
    input_ids, suffix_mask, labels = masked_batch(sequences, len(prefix), pad_token_id)
    return loss_after_shared_prefix(model, prefix, input_ids, suffix_mask, labels)


def pretrain(model, tokenizer, episodes: list[Episodes], task: TaskSpec, train: TrainSpec) -> None:
    generator = torch.Generator().manual_seed(SEED + 1)
    prefix_length = shared_prefix_length([e.direct[0] for e in episodes])
    prefix = episodes[0].direct[0][:prefix_length]

    def loss_at(step: int) -> torch.Tensor:
        indices = torch.randint(len(episodes), (train.batch_size,), generator=generator).tolist()
        tool_probability = 0.5 if step < train.clean_steps else task.tool_probability
        calls = (torch.rand(train.batch_size, generator=generator) < tool_probability).tolist()
        sequences = [episodes[i].tool if call else episodes[i].direct for i, call in zip(indices, calls, strict=True)]
        return batch_loss(model, prefix, sequences, tokenizer.pad_token_id)

    optimize(model, train, loss_at)


def evaluate(model_dir: Path, rows: list[dict], num_samples: int = 4) -> dict[str, float]:
    """Greedy and temperature-1 episodes of ``rows`` through the rollout's own code (``run_episodes`` on the
    transformers backend, the calculator environment, the boxed reward): accuracy and tool-call rate."""
    from colossal_rl.reward import build_reward_scorer
    from colossal_rl.rollout.backend import SamplingSettings
    from colossal_rl.rollout.multi_turn import MultiTurnLimits, run_episodes
    from colossal_rl.rollout.transformers_backend import TransformersBackend

    torch.manual_seed(SEED + 2)
    backend = TransformersBackend(str(model_dir))
    chat = ChatTurns(backend.tokenizer)
    context = EnvironmentContext(
        reward_scorer=build_reward_scorer("boxed", timeout_s=5.0, num_workers=1),
        system_prompt=DEFAULT_SYSTEM_PROMPTS["boxed"],
    )
    limits = MultiTurnLimits(max_turns=3, max_total_tokens=192)
    metrics = {}
    for name, greedy, samples in (("greedy", True, 1), ("sampled", False, num_samples)):
        sampling = SamplingSettings(temperature=1.0, max_new_tokens=64, greedy=greedy)
        part = [row for row in rows for _ in range(samples)]
        episodes = []
        for start in range(0, len(part), 50):
            chunk = part[start : start + 50]
            environments = [CalculatorEnvironment(context) for _ in chunk]
            episodes += run_episodes(backend, chat, environments, chunk, sampling, limits)
        called = [any(turn.tool_calls for turn in e.turns) for e in episodes]
        metrics[f"{name}_accuracy"] = statistics.mean(e.answer_ok for e in episodes)
        metrics[f"{name}_tool_call_rate"] = statistics.mean(called)
        metrics[f"{name}_accuracy_with_tool"] = statistics.mean(
            [e.answer_ok for e, c in zip(episodes, called, strict=True) if c] or [0]
        )
        metrics[f"{name}_accuracy_without_tool"] = statistics.mean(
            [e.answer_ok for e, c in zip(episodes, called, strict=True) if not c] or [0]
        )
    return metrics


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-root", type=Path, default=ASSETS_DIR)
    parser.add_argument("--clean-steps", type=int, default=TRAIN.clean_steps)
    parser.add_argument("--noisy-steps", type=int, default=TRAIN.noisy_steps)
    parser.add_argument("--tool-probability", type=float, default=TaskSpec.tool_probability)
    parser.add_argument("--skip-eval", action="store_true", help="build only; do not measure the model")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)  # fixed thread count: reproducible reductions, and modest CPU use
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    start = time.perf_counter()
    task = TaskSpec(tool_probability=args.tool_probability)
    train = replace(TRAIN, clean_steps=args.clean_steps, noisy_steps=args.noisy_steps)

    train_rows, eval_rows = build_rows(task)
    write_jsonl(args.output_root / DATA_DIR_NAME / "train.jsonl", train_rows)
    write_jsonl(args.output_root / DATA_DIR_NAME / "eval.jsonl", eval_rows)
    tokenizer = build_tool_tokenizer()
    model = build_tool_model(tokenizer)
    logger.info("model: %.2f M parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    pretrain(model, tokenizer, render_episodes(tokenizer, train_rows), task, train)

    model_dir = args.output_root / MODEL_DIR_NAME
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    if args.skip_eval:
        return
    metrics = evaluate(model_dir, eval_rows)
    elapsed = time.perf_counter() - start
    print(f"built {model_dir} in {elapsed:.0f} s: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))


if __name__ == "__main__":
    main()
