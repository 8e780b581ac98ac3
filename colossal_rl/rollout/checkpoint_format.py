"""Weights in the layout of a checkpoint on disk, which is what vLLM's loaders take.

transformers >= 5 holds some models' weights in another layout in memory than in their checkpoints: a mixture of
experts' per-expert projections fused into one 3D tensor per layer (``mlp.experts.gate_up_proj``), among others, by the
conversions it applies at load (``conversion_mapping.py``). A trainer on today's transformers (``--trainer-backend
fsdp2``) therefore sends the fused names; vLLM loads checkpoint names. :func:`to_checkpoint_format` reverts them the
way ``save_pretrained`` does, with transformers' own ``revert_weight_conversion`` over a model built on the meta device
(the conversions depend on the model's class, not on its values) — for every model type, none named here. Under
transformers 4 the in-memory names are the checkpoint's, and weights pass through unchanged; so do weights already in
checkpoint format (a ColossalAI trainer's), which no reverse conversion matches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class CheckpointFormat:
    """Reverts a model's in-memory weight layout to its checkpoint's; built once per producer."""

    def __init__(self, hf_config: Any):
        self._model = _meta_model(hf_config)

    def __call__(self, named_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._model is None:
            return dict(named_tensors)
        from transformers.core_model_loading import revert_weight_conversion

        return dict(revert_weight_conversion(self._model, dict(named_tensors)))


def _meta_model(hf_config: Any) -> torch.nn.Module | None:
    """The model on the meta device (no memory), or None when this transformers has no weight conversions."""
    try:
        from transformers.core_model_loading import revert_weight_conversion  # noqa: F401
    except ImportError:
        return None
    from colossal_rl.vision.models import auto_model_class

    with torch.device("meta"):
        return auto_model_class(hf_config).from_config(hf_config)
