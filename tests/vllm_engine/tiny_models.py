"""Tiny random models with the embedded tokenizer, for the real-engine tests: a Qwen3 vLLM's CPU attention can serve
(head_dim 32) and a Qwen2 it refuses (head_dim 16). Built with the trainers' transformers (4.51.3)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from colossal_rl.config import EMBEDDED_MODEL_DIR


def tokenizer_files(source: Path, target: Path) -> None:
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(path, target / path.name)


def build_qwen3(directory: Path) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(3)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    tokenizer_files(EMBEDDED_MODEL_DIR, directory)
    return directory


def build_head_dim_16(directory: Path) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer_files(EMBEDDED_MODEL_DIR, directory)
    return directory
