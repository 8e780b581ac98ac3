"""Per-GPU memory of one consumer (trainer) in each parallel layout: model states by arithmetic.

An estimate, not measured on a GPU. Bytes per parameter held on one GPU during forward/backward in
bf16 training, for the plugins ``colossal_rl.training.booster_plugins.make_plugin`` builds (ColossalAI 0.5.0,
read from its source), with N the data-parallel size:

- ZeRO 0, no pipeline (``HybridParallelPlugin`` wrapping torch DDP): 2 bf16 weights + 2 bf16 gradients
  + 2 DDP gradient buckets (``gradient_as_bucket_view=False``) + 4 fp32 master weights + 8 Adam = 18.
- ZeRO 0 with a pipeline (no DDP): 16.
- ZeRO-1 (``LowLevelZeroOptimizer``, stage 1 keeps every rank's gradient slice): 2 + 2 + 12 / N.
- ZeRO-2 (gradients partitioned too): 2 + 2 / N + 12 / N.

Not counted: the optimizer step's transient fp32 copy of the gradients (+2 per parameter without
ZeRO, +4 / N with it), CUDA context, NCCL buffers, cuBLAS workspaces and allocator fragmentation
(a few GB), and a reference model for ``-kl > 0`` (2 bytes per parameter of this GPU's shard, not
ZeRO-sharded). Activations are measured by ``train_memory.py`` and added by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 2**30


@dataclass(frozen=True)
class Layout:
    """A consumer layout on ``gpus`` GPUs: tensor- and pipeline-parallel sizes, ZeRO stage."""

    name: str
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    gpus: int = 8

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


LAYOUTS = (
    Layout("DDP bf16"),
    Layout("ZeRO-1", zero_stage=1),
    Layout("ZeRO-2", zero_stage=2),
    Layout("ZeRO-2, 4 trainers (docs/gpu.md's one-node example)", zero_stage=2, gpus=4),
    Layout("TP=2", tp=2),
    Layout("TP=2 + ZeRO-1", tp=2, zero_stage=1),
    Layout("TP=4", tp=4),
    Layout("TP=4 + ZeRO-1", tp=4, zero_stage=1),
    Layout("PP=2", pp=2),
    Layout("PP=2 + ZeRO-1", pp=2, zero_stage=1),
)


def model_state_bytes_per_parameter(layout: Layout) -> float:
    """Bytes per parameter of this GPU's shard held through forward/backward (see the module docstring)."""
    optimizer = 4 + 8  # fp32 master weights + Adam's two fp32 moments
    if layout.zero_stage == 0:
        ddp_buckets = 2 if layout.pp == 1 and layout.dp > 1 else 0
        return 2 + 2 + ddp_buckets + optimizer
    gradients = 2 if layout.zero_stage == 1 else 2 / layout.dp
    return 2 + gradients + optimizer / layout.dp


def parameters_per_gpu(config: dict[str, Any], layout: Layout) -> int:
    """Parameters of the largest shard a GPU holds: Qwen2 weights split 1/tp (all but the norms) and into
    pp stages of equal layer counts, the embedding on the first stage, final norm and head on the last."""
    hidden, vocab, tp = config["hidden_size"], config["vocab_size"], layout.tp
    head_dim = hidden // config["num_attention_heads"]
    q_size, kv_size = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    attention = hidden * (q_size + 2 * kv_size) + (q_size + 2 * kv_size) + q_size * hidden  # q, k, v (bias), o
    mlp = 3 * hidden * config["intermediate_size"]
    layer = (attention + mlp) // tp + 2 * hidden  # two RMSNorms, replicated
    embedding = vocab * hidden // tp
    head = 0 if config["tie_word_embeddings"] else vocab * hidden // tp
    layers = config["num_hidden_layers"] // layout.pp * layer
    if layout.pp == 1:
        return embedding + layers + hidden + head
    tied_copy = embedding if config["tie_word_embeddings"] else 0  # the last stage holds the tied weight too
    return max(embedding + layers, layers + hidden + head + tied_copy)


def model_state_bytes(config: dict[str, Any], layout: Layout) -> float:
    return parameters_per_gpu(config, layout) * model_state_bytes_per_parameter(layout)
