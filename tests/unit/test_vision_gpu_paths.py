"""Vision-language training on the GPU-only paths, checked on CPU (issue 33, items 2 and 3).

flash_attention_2 cannot run here (no flash-attn), so what is checked is what decides correctness: the layout a
vision-language model gets under it, and the reason packed is wrong for it, read from transformers' own source.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from colossal_rl.config import EMBEDDED_VLM_DIR, RLConfig, TrainConfig
from colossal_rl.input_checks import InputError, check_images
from colossal_rl.training.micro_batch_forward import MicroBatchForward
from colossal_rl.vision.rope import RopeTokens


def flash_config(layout: str = "auto") -> RLConfig:
    train = TrainConfig(attn_implementation="flash_attention_2", sequence_layout=layout)
    config = RLConfig(train=train)
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, precision="bf16"))


def vlm_rope_tokens() -> RopeTokens:
    from transformers import AutoConfig

    return RopeTokens.of(AutoConfig.from_pretrained(EMBEDDED_VLM_DIR))


def forward_for(config: RLConfig, rope_tokens: RopeTokens | None) -> MicroBatchForward:
    return MicroBatchForward(
        config, dtype=torch.bfloat16, pad_token_id=0, tp_group=None, vocab_size=64, max_over_ranks=None,
        rope_tokens=rope_tokens,
    )  # fmt: skip


def test_qwen2_5_vl_flash_attention_passes_no_position_ids_to_flash_attention():
    """Why packed is wrong for it: packed rows have no attention mask, and flash-attention separates the packed
    samples only through position_ids, which this layer never hands over (transformers 4.51.3)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLFlashAttention2

    source = inspect.getsource(Qwen2_5_VLFlashAttention2.forward)
    call = source[source.index("_flash_attention_forward(") :]
    call = call[: call.index("\n        )")]
    assert "attention_mask" in call and "position_ids" not in call, call


def test_qwen2_flash_attention_does_pass_position_ids_so_text_models_keep_packed():
    """The text model's path, for contrast: Qwen2's decoder layer hands position_ids to its attention, which
    forwards its keyword arguments to the flash-attention interface (varlen over the packed samples)."""
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2DecoderLayer

    assert "position_ids=position_ids" in inspect.getsource(Qwen2DecoderLayer.forward)
    assert "**kwargs,\n        )" in inspect.getsource(Qwen2Attention.forward)
    assert "**kwargs" in inspect.getsource(flash_attention_forward).split("_flash_attention_forward(")[-1]


def test_auto_gives_a_vision_model_the_padded_layout_under_flash_attention():
    config = flash_config()
    assert config.sequence_layout == "packed"  # a text model: flash-attention's varlen path through position_ids
    assert config.sequence_layout_for(vision_language=True) == "padded"
    assert forward_for(config, None).layout == "packed"
    assert forward_for(config, vlm_rope_tokens()).layout == "padded"  # what the trainer of a VLM runs
    sdpa = RLConfig()
    assert forward_for(sdpa, vlm_rope_tokens()).layout == "shared_prompt"  # unchanged without flash-attention


def test_packed_vision_training_under_flash_attention_is_refused():
    config = flash_config("packed")
    with pytest.raises(InputError, match=r"^--sequence-layout packed: .*passes no position_ids"):
        check_images(config, {}, vision_language=True)
    check_images(config, {}, vision_language=False)  # text models keep packed under flash-attention
    check_images(flash_config("padded"), {}, vision_language=True)
    with pytest.raises(ValueError, match="passes no position_ids"):
        forward_for(config, vlm_rope_tokens())


def test_a_vision_model_in_bf16_without_zero_boosts_and_trains(tmp_path):
    """Item 3: bf16/fp16 with ZeRO 0 went to HybridParallelPlugin, whose ShardFormer has no Qwen2.5-VL policy
    (NotImplementedError at boost, before the first step). It now trains on LowLevelZeroPlugin stage 1."""
    from colossalai.booster.plugin import LowLevelZeroPlugin
    from trainer_harness import make_config, make_trainer
    from vision_fixtures import build_random_vlm

    config = make_config(train={"microbatch_size": 8})
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=str(build_random_vlm(tmp_path / "vlm"))),
        parallel=dataclasses.replace(config.parallel, precision="bf16", zero_stage=0),
    )
    trainer = make_trainer(config, device="cpu")
    assert isinstance(trainer.engine.plugin, LowLevelZeroPlugin) and trainer.engine.plugin.stage == 1
    assert next(trainer.engine.unwrapped().parameters()).dtype == torch.bfloat16
    assert trainer.stage_state_dict()  # the weight sync's gather works on it
