"""Telling a vision-language checkpoint from a text one, and loading either with the right Hugging Face class.

A checkpoint is vision-language when its config has a ``vision_config`` (Qwen2.5-VL: ``Qwen2_5_VLConfig``); it
loads through ``AutoModelForImageTextToText`` (the class is not a ``AutoModelForCausalLM`` in transformers
4.51), a text one through ``AutoModelForCausalLM``. The vision tower's weights are those under ``visual.``.
"""

from __future__ import annotations

import torch

VISION_TOWER_PREFIX = "visual."
"""Names of the vision tower's weights in Qwen2.5-VL's state dict (transformers 4.51, and vLLM 0.7.3's loader)."""


def is_vision_language_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config):
    """The ``transformers`` auto class that loads this config's generative model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language_config(config) else AutoModelForCausalLM


def is_vision_tower_weight(name: str) -> bool:
    return name.startswith(VISION_TOWER_PREFIX)


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop gradients to the vision tower's parameters; returns how many were frozen (0: the model has none)."""
    frozen = 0
    for name, parameter in model.named_parameters():
        if is_vision_tower_weight(name):
            parameter.requires_grad_(False)
            frozen += 1
    return frozen


def without_vision_tower(named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights a sync carries when the tower is frozen: it never changes, producers keep the one they loaded."""
    return {name: tensor for name, tensor in named_tensors.items() if not is_vision_tower_weight(name)}
