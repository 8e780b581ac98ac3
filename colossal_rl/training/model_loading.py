"""Loading the policy and reference models for training: in the training precision, on the trainer's device.

One function, so the policy, the reference model, tests and benchmarks load models the same way:
weights are read straight into ``dtype`` (no fp32 copy of a bf16 run's weights on the host), placed on
``device`` (on a GPU straight from the checkpoint, without a host copy), with the chosen attention
implementation and, when asked, Hugging Face gradient checkpointing (activations of each decoder layer
recomputed in backward instead of kept; non-reentrant, so it composes with DDP, ZeRO and frozen inputs).
"""

from __future__ import annotations

from typing import Literal

import torch

from colossal_rl.hf_compat import dtype_kwargs

AttentionImplementation = Literal["sdpa", "eager", "flash_attention_2"]


def load_policy(
    path: str,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_implementation: AttentionImplementation = "sdpa",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """The causal LM at ``path`` (hub name or local directory) in ``dtype`` on ``device``; a vision-language
    checkpoint (Qwen2.5-VL) loads as its image-text-to-text class, vision tower included."""
    from transformers import AutoConfig

    from colossal_rl.vision.models import auto_model_class

    device = torch.device(device)
    on_accelerator = device.type == "cuda"
    auto_class = auto_model_class(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
    model = auto_class.from_pretrained(
        path,
        **dtype_kwargs(dtype),
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        low_cpu_mem_usage=True,
        device_map={"": device} if on_accelerator else None,
    )
    if not on_accelerator:
        model = model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model
