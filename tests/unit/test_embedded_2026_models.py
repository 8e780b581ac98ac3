"""The embedded checkpoints of architectures the trainers' transformers cannot load (``scripts/build_tiny_2026_models.py``).

Run in the trainers' environment (transformers 4.51.3): the model types must be unknown here (that is their point:
they exercise the path for models only the producers' transformers can build), while their tokenizer must load here
and encode prompts exactly as the embedded tiny Qwen2's does. The models themselves are checked in the producers'
environment (``scripts/probe_vllm_logprobs.py``).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the network

import pytest
from safetensors import safe_open
from transformers import CONFIG_MAPPING, AutoTokenizer

from colossal_rl.config import ASSETS_DIR, EMBEDDED_MODEL_DIR
from colossal_rl.data import build_messages, encode_prompt
from colossal_rl.prompts import DEFAULT_SYSTEM_PROMPTS
from colossal_rl.rollout.tokenizer_loading import load_tokenizer

MODELS = {"tiny_olmo3": "dense", "tiny_glm4_moe": "moe"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_BYTES = 5_000_000
"""Per checkpoint directory: the repository ships them, so each stays a few MB (the tiny Qwen2: 3.1 MB)."""


def read_json(path) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def reference_prompt() -> list[int]:
    tokenizer = load_tokenizer(str(EMBEDDED_MODEL_DIR))
    messages = build_messages({"role": "user", "content": "12+7=?"}, DEFAULT_SYSTEM_PROMPTS["boxed"])
    return encode_prompt(tokenizer, messages)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_type_is_unknown_to_the_trainers_transformers(name):
    config = read_json(ASSETS_DIR / name / "config.json")
    assert name == f"tiny_{config['model_type']}"
    assert config["model_type"] not in CONFIG_MAPPING
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    is_moe = any(key in config for key in ("num_local_experts", "num_experts", "n_routed_experts"))
    assert is_moe == (MODELS[name] == "moe")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tokenizer_is_the_embedded_one_and_encodes_as_tiny_qwen2(name, reference_prompt):
    directory = ASSETS_DIR / name
    for file_name in TOKENIZER_FILES:
        assert (directory / file_name).read_bytes() == (EMBEDDED_MODEL_DIR / file_name).read_bytes(), file_name
    messages = build_messages({"role": "user", "content": "12+7=?"}, DEFAULT_SYSTEM_PROMPTS["boxed"])
    for tokenizer in (load_tokenizer(str(directory)), AutoTokenizer.from_pretrained(directory)):
        assert encode_prompt(tokenizer, messages) == reference_prompt
        config = read_json(directory / "config.json")
        assert config["vocab_size"] == len(tokenizer)
        assert config["eos_token_id"] == tokenizer.eos_token_id
        assert config["pad_token_id"] == tokenizer.pad_token_id
    generation = read_json(directory / "generation_config.json")
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (tokenizer.eos_token_id, tokenizer.pad_token_id)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_checkpoint_is_small_and_fp32(name):
    directory = ASSETS_DIR / name
    assert sum(path.stat().st_size for path in directory.iterdir()) < MAX_BYTES
    with safe_open(str(directory / "model.safetensors"), framework="pt") as weights:
        names = list(weights.keys())
        assert names
        assert {weights.get_slice(key).get_dtype() for key in names} == {"F32"}
