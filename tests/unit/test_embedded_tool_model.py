"""The shipped tool-calling model and arithmetic task (``scripts/build_tiny_tool_model.py``) load offline, are what
the script builds, render episodes the way the script pre-trained on, and behave as RL with ``--env calculator``
needs: the model sometimes calls the calculator when sampled (and is then right), but greedily answers directly.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the network

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from colossal_rl.config import EMBEDDED_ARITHMETIC_EVAL_DATA, EMBEDDED_ARITHMETIC_TRAIN_DATA, EMBEDDED_TOOL_MODEL_DIR
from colossal_rl.environments import EnvironmentContext
from colossal_rl.environments.calculator import CalculatorEnvironment, evaluate
from colossal_rl.prompts import DEFAULT_SYSTEM_PROMPTS
from colossal_rl.rollout.chat_turns import ChatTurns

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import build_tiny_tool_model as build  # noqa: E402


def read_rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_TOOL_MODEL_DIR, local_files_only=True)


def test_the_shipped_rows_are_the_scripts_and_the_splits_are_disjoint():
    train_rows, eval_rows = build.build_rows(build.TaskSpec())
    assert read_rows(EMBEDDED_ARITHMETIC_TRAIN_DATA) == train_rows
    assert read_rows(EMBEDDED_ARITHMETIC_EVAL_DATA) == eval_rows
    questions = [row["messages"]["content"] for row in train_rows + eval_rows]
    assert len(set(questions)) == len(questions) == 2200
    for row in eval_rows:
        assert str(evaluate(build.expression_of(row))) == row["gt_answer"]


def test_the_shipped_tokenizer_and_template_are_the_scripts(tmp_path, tokenizer):
    build.build_tool_tokenizer().save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shipped = json.loads((EMBEDDED_TOOL_MODEL_DIR / name).read_text())
        assert json.loads((tmp_path / name).read_text()) == shipped, name
    assert tokenizer.model_max_length == build.MAX_POSITIONS


def test_the_model_is_a_small_fp32_qwen2_with_room_for_a_tool_episode(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_TOOL_MODEL_DIR, local_files_only=True)
    assert model.config.model_type == "qwen2" and model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.max_position_embeddings == build.MAX_POSITIONS == 512
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_tool_tokens_are_single_ordinary_tokens_that_survive_decoding(tokenizer):
    call = build.tool_call_text("12*34")
    ids = tokenizer(call, add_special_tokens=False)["input_ids"]
    assert [tokenizer.convert_ids_to_tokens(i) for i in (ids[0], ids[-1])] == ["<tool_call>", "</tool_call>"]
    assert len(ids) < 35  # the JSON's words are one token each, as in a BPE vocabulary
    assert tokenizer.decode(ids, skip_special_tokens=True) == call  # what the environment reads


def test_the_rollout_renders_the_tools_and_results_through_the_models_own_template(tokenizer):
    """What ``--env calculator`` builds: the compact tools line in the prompt, the result as Qwen's
    ``<tool_response>`` block; the whole two-turn episode fits the model with room to spare."""
    chat = ChatTurns(tokenizer)
    assert chat.tool_role and chat.template_tools
    environment = CalculatorEnvironment(
        EnvironmentContext(reward_scorer=None, system_prompt=DEFAULT_SYSTEM_PROMPTS["boxed"])
    )
    row = read_rows(EMBEDDED_ARITHMETIC_EVAL_DATA)[0]
    prompt = chat.prompt_ids(environment.reset(row), environment.tools)
    text = tokenizer.decode(prompt)
    assert "\nTools: calculator(expression). Call one as <tool_call>" in text
    assert text.endswith(f"<|user|>{row['messages']['content']}<|assistant|>") and len(prompt) < 160
    (episode,) = build.render_episodes(tokenizer, [row])
    ids, mask = episode.tool
    assert ids[: len(prompt)] == prompt and len(ids) < 256
    trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    eos = tokenizer.eos_token  # each policy turn ends with it; the tool result and the prompts are not trained
    assert trained == build.tool_call_text(build.expression_of(row)) + eos + f"\\boxed{{{row['gt_answer']}}}" + eos
    assert f"<tool_response>\n{row['gt_answer']}\n</tool_response><|assistant|>" in tokenizer.decode(ids)


@pytest.mark.slow
def test_sampled_episodes_sometimes_call_the_calculator_and_greedy_ones_answer_directly():
    """The regime RL needs: at temperature 1 some episodes call the calculator and are then often right, direct
    answers are wrong, and greedy decoding answers directly (so the eval starts low)."""
    metrics = build.evaluate(EMBEDDED_TOOL_MODEL_DIR, read_rows(EMBEDDED_ARITHMETIC_EVAL_DATA)[:40], num_samples=4)
    assert 0.1 <= metrics["sampled_tool_call_rate"] <= 0.6, metrics
    assert metrics["sampled_accuracy_with_tool"] >= 0.15, metrics  # the build measured 0.32 on all 200 eval rows
    assert metrics["sampled_accuracy_without_tool"] <= 0.05, metrics  # (0.0): calling the calculator pays
    assert metrics["greedy_tool_call_rate"] <= 0.2 and metrics["greedy_accuracy"] <= 0.2, metrics
