"""A whole train step in every sequence layout and micro-batch plan gives the padded step's loss and gradients.

A real ``Trainer`` (world size 1, TorchDDPPlugin, fp32, the embedded model, a KL term to the reference
model) trains one step on random groups with unequal prompt and response lengths. The optimizer is plain
SGD with lr 1 and clipping off, so ``weights before - weights after`` is the step's gradient exactly: the
AdamW the trainer builds would turn any gradient into about ``lr * sign(gradient)`` in its first step and
hide differences (the optimizer sits around the unit under test, the step's forward/backward).
Two-process DDP, ZeRO and TP runs of the same comparison live in ``tests/dist/test_sequence_layouts.py``.
"""

from __future__ import annotations

import pytest
import torch
from trainer_harness import make_batch, make_config, make_trainer

from colossal_rl.config import AlgorithmConfig, replace

LAYOUTS = {
    "packed": {"sequence_layout": "packed"},
    "shared_prompt": {"sequence_layout": "shared_prompt"},
    "padded_token_budget": {"sequence_layout": "padded", "max_tokens_per_microbatch": 40},
    "packed_token_budget": {"sequence_layout": "packed", "max_tokens_per_microbatch": 40},
    "shared_prompt_token_budget": {"sequence_layout": "shared_prompt", "max_tokens_per_microbatch": 40},
}


@pytest.fixture()
def sgd(monkeypatch):
    """AdamW -> SGD(lr) in the trainer's build: the update is then the gradient itself."""
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr))


def one_step(train_changes: dict) -> tuple[dict[str, float], torch.Tensor]:
    config = make_config(
        algorithm=replace(AlgorithmConfig(), kl_coeff=0.1),
        train={"learning_rate": 1.0, "max_norm": 1e9, "microbatch_size": 4} | train_changes,
    )
    trainer = make_trainer(config, device="cpu")
    before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
    batch = make_batch(seed=7, prompt_len=9, response_len=7, shared_prompts=True)
    metrics = trainer.train_step(batch)
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    return metrics, before - after


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_step_equals_the_padded_step(sgd, name):
    reference_metrics, reference_grad = one_step({"sequence_layout": "padded"})
    metrics, grad = one_step(LAYOUTS[name])
    assert float(reference_grad.norm()) > 0
    assert float((grad - reference_grad).norm() / reference_grad.norm()) <= 1e-5
    torch.testing.assert_close(grad, reference_grad, atol=1e-5 * float(reference_grad.abs().max()), rtol=1e-5)
    for key in ("train/loss", "train/entropy", "train/grad_norm", "train/ratio_max"):
        assert metrics[key] == pytest.approx(reference_metrics[key], rel=1e-5, abs=1e-6), key
    assert metrics["train/real_tokens"] == reference_metrics["train/real_tokens"]


def test_layouts_compute_fewer_tokens_and_say_so(sgd):
    padded, _ = one_step({"sequence_layout": "padded", "microbatch_size": 16})
    packed, _ = one_step({"sequence_layout": "packed", "microbatch_size": 16})
    shared, _ = one_step({"sequence_layout": "shared_prompt", "microbatch_size": 16})
    batch = make_batch(seed=7, prompt_len=9, response_len=7, shared_prompts=True)
    real = int(batch.prompt_mask.sum() + batch.response_mask.sum())
    assert padded["train/real_tokens"] == packed["train/real_tokens"] == shared["train/real_tokens"] == real
    assert padded["train/computed_tokens"] == batch.num_samples * (9 + 7)  # nothing to cut: full-length samples
    assert padded["train/computed_per_real_token"] == pytest.approx(batch.num_samples * 16 / real)
    # Blocks of 12-16 tokens: none pair up within the longest (16), so packing saves nothing here.
    assert packed["train/computed_tokens"] <= padded["train/computed_tokens"]
    assert shared["train/computed_tokens"] < packed["train/computed_tokens"]
    assert shared["train/computed_per_real_token"] < 1.0  # each group's prompt computed once


def test_shared_prompt_refuses_a_group_whose_prompts_differ(sgd):
    config = make_config(train={"sequence_layout": "shared_prompt"})
    trainer = make_trainer(config, device="cpu")
    with pytest.raises(ValueError, match="share one prompt"):
        trainer.train_step(make_batch(seed=7, shared_prompts=False))


def test_auto_layout_shares_prompts_except_where_a_layout_cannot():
    from colossal_rl.config import ParallelConfig, RLConfig, TrainConfig

    def resolved(**changes) -> str:
        parallel = changes.pop("parallel", ParallelConfig())
        return RLConfig(train=TrainConfig(**changes), parallel=parallel).sequence_layout

    assert resolved() == "shared_prompt"
    assert resolved(attn_implementation="flash_attention_2") == "packed"
    assert resolved(parallel=ParallelConfig(num_trainers=2, pp_size=2)) == "padded"
    assert resolved(sequence_layout="padded") == "padded"


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"sequence_layout": "packed"}, "pipeline parallelism"),
        ({"max_tokens_per_microbatch": 512}, "pipeline parallelism"),
    ],
)
def test_pipeline_parallelism_refuses_layouts_it_cannot_run(train, message):
    from colossal_rl.config import ParallelConfig, RLConfig, TrainConfig

    config = RLConfig(train=TrainConfig(microbatch_size=4, **train), parallel=ParallelConfig(num_trainers=2, pp_size=2))
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_shared_prompt_refuses_flash_attention():
    from colossal_rl.config import TrainConfig

    with pytest.raises(ValueError, match="flash_attention_2 cannot take"):
        TrainConfig(sequence_layout="shared_prompt", attn_implementation="flash_attention_2").validate()
