"""What the vLLM producers load is the checkpoint's layout, whatever layout the trainers' transformers keeps in memory.

Runs in both environments: in the trainers' (transformers 4.51.3, where memory and checkpoint agree) the weights pass
through unchanged; in the producers' (transformers 5, run by ``tests/engines/test_trainer_under_fsdp2.py``) the tiny
GLM-4 MoE's fused experts come back as the per-expert tensors its checkpoint holds, equal to the file's.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from colossal_rl.config import ASSETS_DIR, EMBEDDED_MODEL_DIR
from colossal_rl.rollout.checkpoint_format import CheckpointFormat

TRANSFORMERS_5 = int(__import__("transformers").__version__.split(".")[0]) >= 5


def test_a_dense_models_weights_pass_through_unchanged():
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, torch_dtype=torch.float32)
    state = model.state_dict()
    converted = CheckpointFormat(model.config)(state)
    assert converted.keys() == state.keys()
    assert all(converted[name] is state[name] for name in state)


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.51.3 keeps a checkpoint's layout in memory")
def test_fused_experts_of_transformers_5_return_to_the_checkpoints_per_expert_tensors():
    path = ASSETS_DIR / "tiny_glm4_moe"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = model.state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)  # fused in memory
    converted = CheckpointFormat(AutoConfig.from_pretrained(path))(state)
    on_disk = load_file(path / "model.safetensors")
    assert converted.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(converted[name], tensor), name
