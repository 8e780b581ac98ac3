"""The embedded default model and data (built by ``scripts/build_tiny_model.py``) load offline and behave.

The behaviour check pins the property the default run relies on: the shipped model is only partially
competent greedily, so GRPO has room to improve it.
"""

from __future__ import annotations

import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the network

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from colossal_rl.config import EMBEDDED_EVAL_DATA, EMBEDDED_MODEL_DIR, EMBEDDED_TRAIN_DATA
from colossal_rl.data import build_messages, encode_prompt
from colossal_rl.prompts import DEFAULT_SYSTEM_PROMPTS

EOS = "<|endoftext|>"
QUESTION = re.compile(r"^(\d+)\+(\d+)=\?$")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, local_files_only=True)
    return model.eval()


def read_rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def boxed_answer(text: str) -> str | None:
    matches = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return matches[-1].strip() if matches else None


def test_model_is_a_small_fp32_qwen2(model, tokenizer):
    assert model.config.model_type == "qwen2"
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.is_fast
    assert tokenizer.bos_token is None
    assert tokenizer.eos_token == EOS
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.unk_token is not None
    assert tokenizer("abc")["input_ids"] == tokenizer("abc", add_special_tokens=False)["input_ids"]  # no BOS added


@pytest.mark.parametrize(
    "text",
    ["12+7=?", "a  b\tc", "\\boxed{19}", "{[(x)]} \\frac{1}{2}\n\nline two\n", " leading and trailing "],
)
def test_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text


def test_chat_template_renders_turns_and_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "1+2=?"},
        {"role": "assistant", "content": "\\boxed{3}"},
        {"role": "user", "content": "2+2=?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == f"<|system|>sys<|user|>1+2=?<|assistant|>\\boxed{{3}}{EOS}<|user|>2+2=?<|assistant|>"
    without_prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False, tokenize=False)
    assert without_prompt == "<|system|>sys<|user|>1+2=?"
    ids = encode_prompt(tokenizer, build_messages(messages[1], DEFAULT_SYSTEM_PROMPTS["boxed"]))
    assert tokenizer.convert_ids_to_tokens(ids[-1]) == "<|assistant|>"
    assert len(ids) < 128


def test_generate_produces_tokens(model, tokenizer):
    prompt = encode_prompt(tokenizer, build_messages({"role": "user", "content": "3+4=?"}, "sys"))
    output = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)
    assert output.shape[1] > len(prompt)


def test_data_files_parse_and_are_disjoint():
    train_rows, eval_rows = read_rows(EMBEDDED_TRAIN_DATA), read_rows(EMBEDDED_EVAL_DATA)
    assert len(train_rows) >= 1000 and len(eval_rows) >= 100
    for row in train_rows + eval_rows:
        assert set(row) == {"messages", "gt_answer"}
        assert row["messages"]["role"] == "user"
        first, second = QUESTION.match(row["messages"]["content"]).groups()
        assert row["gt_answer"] == str(int(first) + int(second))
    train_questions = {row["messages"]["content"] for row in train_rows}
    eval_questions = {row["messages"]["content"] for row in eval_rows}
    assert len(train_questions) == len(train_rows) and len(eval_questions) == len(eval_rows)
    assert not train_questions & eval_questions


@torch.no_grad()
def test_greedy_accuracy_is_partial(model, tokenizer):
    """Prompted exactly as the RL producers prompt it, the model is right on some but not most questions."""
    rows = read_rows(EMBEDDED_EVAL_DATA)[:100]
    system_prompt = DEFAULT_SYSTEM_PROMPTS["boxed"]
    prompts = [encode_prompt(tokenizer, build_messages(row["messages"], system_prompt)) for row in rows]
    length = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), length), tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for index, prompt in enumerate(prompts):  # left padding, as the producers do
        input_ids[index, length - len(prompt) :] = torch.tensor(prompt)
        attention_mask[index, length - len(prompt) :] = 1
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    texts = tokenizer.batch_decode(output[:, length:], skip_special_tokens=True)
    answers = [boxed_answer(text) for text in texts]
    assert sum(answer is not None for answer in answers) >= 90  # the format is learnt
    accuracy = sum(answer == row["gt_answer"] for answer, row in zip(answers, rows, strict=True)) / len(rows)
    assert 0.03 <= accuracy <= 0.4


def test_chat_template_refuses_unknown_roles(tokenizer):
    with pytest.raises(Exception, match="unsupported role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
