"""Resuming a trainer from its checkpoint continues exactly like the trainer that was never stopped.

A real trainer (world size 1, gloo; see ``trainer_harness``) on a copy of the embedded model with attention
dropout 0.1, and a learning-rate warm-up of 4 steps: so the steps after a resume depend on the two pieces of
state a checkpoint must restore besides weights and optimizer — the LR scheduler (step 3 trains at 3/4 of the
learning rate, not at 1/4 as after a restart of the warm-up) and the trainer's random stream (every dropout
mask). One trainer takes 4 steps and checkpoints after step 2 (``save_checkpoint``, HF export included); a
fresh trainer loads that checkpoint and takes steps 3 and 4. Same process, same arithmetic: learning rates,
every metric and the final weights must be equal, not close.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from trainer_harness import make_batch, make_config, make_trainer

from colossal_rl.config import EMBEDDED_MODEL_DIR, replace

WARMUP_STEPS = 4
SAVED_AT = 2
STEPS = 4


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory) -> str:
    model_dir = tmp_path_factory.mktemp("dropout_model") / "tiny_qwen2"
    shutil.copytree(EMBEDDED_MODEL_DIR, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["attention_dropout"] = 0.1
    (model_dir / "config.json").write_text(json.dumps(config))
    return str(model_dir)


def learning_rate(trainer) -> float:
    return trainer.lr_scheduler.get_last_lr()[0]


def train_steps(trainer, first: int, last: int) -> list[dict]:
    """Steps ``first``..``last``: the learning rate each one used and its metrics (timings dropped)."""
    records = []
    for step in range(first, last + 1):
        rate = learning_rate(trainer)
        metrics = trainer.train_step(make_batch(seed=step))
        records.append({"lr": rate} | {k: v for k, v in metrics.items() if not k.startswith("time/")})
    return records


def test_resumed_trainer_continues_like_the_uninterrupted_one(dropout_model, tmp_path):
    base = make_config(train={"warmup_steps": WARMUP_STEPS})
    config = replace(base, model=replace(base.model, path=dropout_model))
    configured_lr = config.train.learning_rate

    uninterrupted = make_trainer(config)
    train_steps(uninterrupted, 1, SAVED_AT)
    uninterrupted.save_checkpoint(tmp_path / "checkpoint")
    expected = train_steps(uninterrupted, SAVED_AT + 1, STEPS)
    expected_weights = uninterrupted.full_state_dict()
    assert [record["lr"] for record in expected] == pytest.approx([configured_lr * 3 / 4, configured_lr])

    resumed = make_trainer(config)
    resumed.load_checkpoint(tmp_path / "checkpoint", policy_version=SAVED_AT)
    assert resumed.step == SAVED_AT
    got = train_steps(resumed, SAVED_AT + 1, STEPS)
    assert [record["lr"] for record in got] == [record["lr"] for record in expected], "LR schedule not restored"
    for step, (want, have) in enumerate(zip(expected, got, strict=True), start=SAVED_AT + 1):
        assert have == want, f"step {step} differs after the resume (random stream not restored?)"
    weights = resumed.full_state_dict()
    assert weights.keys() == expected_weights.keys()
    for name, tensor in expected_weights.items():
        assert torch.equal(weights[name], tensor), name


def test_dropout_makes_the_random_stream_observable(dropout_model):
    """The check above can fail on an unrestored random stream: the same step on the same weights gives other
    metrics when only the RNG state differs."""
    base = make_config(train={"warmup_steps": WARMUP_STEPS})
    config = replace(base, model=replace(base.model, path=dropout_model))
    results = []
    for rng_seed in (1, 2):
        trainer = make_trainer(config)
        torch.manual_seed(rng_seed)
        results.append(trainer.train_step(make_batch(seed=1)))
    assert results[0]["train/entropy"] != results[1]["train/entropy"]
    assert results[0]["train/grad_norm"] != results[1]["train/grad_norm"]
