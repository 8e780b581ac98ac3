"""The memory features change memory, not results: each equals the plain path to 1e-5.

Plain path: full [B, L, V] logits, no gradient checkpointing. Each feature is switched on alone —
``logits_from_hidden`` (the output head applied chunk by chunk), ``gradient_checkpointing``, and the
attention implementation — and log-probs, entropy and every parameter's gradient are compared, first through the
functions the trainer calls (in fp64, so 1e-5 compares the math rather than fp32 summation orders), then
through a real fp32 training step (loss, gradient norm and entropy to 1e-5 relative). (Memory itself is measured by
``benchmarks/train_memory.py``, not here.)
"""

from __future__ import annotations

import pytest
import torch
from trainer_harness import make_batch, make_config, make_trainer

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.training.model_loading import load_policy
from colossal_rl.training.policy_forward import response_logprobs

PLAIN = {"logits_from_hidden": False, "gradient_checkpointing": False, "attn_implementation": "sdpa"}
FEATURES = [
    {"logits_from_hidden": True},
    {"gradient_checkpointing": True},
    {"logits_from_hidden": True, "gradient_checkpointing": True},
]


def _logprobs_and_grads(options: dict, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, dict]:
    """fp64 by default, so that 1e-5 compares the math rather than fp32 summation orders."""
    model = load_policy(
        str(EMBEDDED_MODEL_DIR),
        dtype=dtype,
        device="cpu",
        attn_implementation=options["attn_implementation"],
        gradient_checkpointing=options["gradient_checkpointing"],
    ).train()
    batch = make_batch(seed=7)
    input_ids, attention_mask = batch.sequences()
    logprobs, entropy = response_logprobs(
        model,
        input_ids,
        attention_mask,
        prompt_length=batch.prompt_ids.shape[1],
        response_ids=batch.response_ids,
        temperature=0.7,
        logits_from_hidden=options["logits_from_hidden"],
        chunk_size=5,  # several chunks per row
        with_entropy=True,
    )
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(logprobs.shape, generator=generator, dtype=dtype) * batch.response_mask
    (logprobs * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return torch.stack([logprobs.detach(), entropy]), grads


@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: "+".join(sorted(f)))
def test_feature_equals_the_plain_path(feature):
    expected_values, expected_grads = _logprobs_and_grads(PLAIN)
    values, grads = _logprobs_and_grads(PLAIN | feature)
    torch.testing.assert_close(values, expected_values, rtol=1e-5, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    assert any(g.abs().max() > 1e-3 for g in grads.values())  # the comparison is not between zeros


def test_attention_implementations_agree():
    """eager against sdpa, in fp32 (eager's fp32 softmax gives NaN on fully padded rows in fp64): to 1e-5 of
    each tensor's largest magnitude (the kernels sum in different orders)."""
    expected_values, expected_grads = _logprobs_and_grads(PLAIN, torch.float32)
    values, grads = _logprobs_and_grads(PLAIN | {"attn_implementation": "eager"}, torch.float32)
    torch.testing.assert_close(values, expected_values, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        scale = float(expected_grads[name].abs().max())
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_gradient_checkpointing_is_on_in_the_trainer():
    trainer = make_trainer(make_config(train={"gradient_checkpointing": True}))
    assert trainer.engine.unwrapped().is_gradient_checkpointing


def test_a_training_step_is_the_same_with_every_feature_on():
    batch = make_batch(seed=3)
    plain = make_trainer(make_config(train=PLAIN | {"attn_implementation": "eager"})).train_step(batch)
    featured = make_trainer(
        make_config(train={"logits_from_hidden": True, "gradient_checkpointing": True, "attn_implementation": "sdpa"})
    ).train_step(batch)
    for name in ("train/loss", "train/grad_norm", "train/entropy"):
        assert featured[name] == pytest.approx(plain[name], rel=1e-5, abs=1e-6), name
