"""Multi-turn rollouts of the embedded model on the transformers backend (CPU), trained on: every policy token's
behaviour log-prob equals a full forward over the finished sequence and the trainer's recompute in every layout
(padded, packed, shared_prompt: the environment's tokens stay context), and the loss's gradient is zero on the
environment's tokens."""

from __future__ import annotations

import pytest
import torch

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.environments import StepResult
from colossal_rl.presets import grpo
from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.chat_turns import ChatTurns
from colossal_rl.rollout.environment_rollout import episodes_batch
from colossal_rl.rollout.multi_turn import MultiTurnLimits, collate, run_episodes
from colossal_rl.rollout.transformers_backend import TransformersBackend
from colossal_rl.training.objective import objective_for
from colossal_rl.training.sequence_layout import block_layout, padded_layout
from colossal_rl.training.step_loss import StepCounts, StepLoss, StepTotals

GROUP_SIZE = 2
TEMPERATURE = 0.7
ROWS = [{"messages": {"role": "user", "content": "12+3=?"}}, {"messages": {"role": "user", "content": "7+8=?"}}]


class TryAgain:
    """Answers the first two turns with a tool result, then ends with a reward of the turn's length parity."""

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return [row["messages"]]

    def step(self, text):
        self.turns += 1
        if self.turns < 3:
            return StepResult(observation=({"role": "tool", "name": "check", "content": f"no {self.turns}"},))
        return StepResult(reward=float(len(text) % 2), done=True)


@pytest.fixture(scope="module")
def rollout():
    torch.manual_seed(0)
    backend = TransformersBackend(str(EMBEDDED_MODEL_DIR), device="cpu")
    sampling = SamplingSettings(temperature=TEMPERATURE, max_new_tokens=6)
    rows = [row for row in ROWS for _ in range(GROUP_SIZE)]
    limits = MultiTurnLimits(max_turns=3, max_total_tokens=100)
    episodes = run_episodes(backend, ChatTurns(backend.tokenizer), [TryAgain() for _ in rows], rows, sampling, limits)
    output = collate(episodes, backend.pad_token_id)
    advantages = torch.tensor([1.0, -0.5, 0.75, -1.0])
    batch = episodes_batch(output, backend.tokenizer, group_size=GROUP_SIZE, policy_version=0).with_advantages(
        advantages
    )
    return backend, episodes, batch


def test_episodes_have_three_turns_and_environment_tokens(rollout):
    _, episodes, batch = rollout
    assert all(len(e.turns) == 3 and e.end == "done" for e in episodes)
    environment_tokens = batch.response_mask * (1 - batch.policy_mask)
    assert bool((environment_tokens.sum(1) > 0).all())
    assert int(batch.trained_token_mask().sum()) == sum(sum(e.policy_mask) for e in episodes)


def full_forward_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_behaviour_logprobs_equal_a_full_forward_across_turns(rollout):
    backend, episodes, _ = rollout
    for episode in episodes:
        recomputed = full_forward_logprobs(backend.model, episode.prompt_ids, episode.response_ids)
        policy = torch.tensor(episode.policy_mask).bool()
        behaviour = torch.tensor(episode.behaviour_logprobs)
        torch.testing.assert_close(behaviour[policy], recomputed[policy], atol=2e-4, rtol=0)
        assert bool((behaviour[~policy] == 0).all())


def layout_logprobs(model, batch: RolloutBatch, layout: str) -> torch.Tensor:
    tensors = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    if layout == "padded":
        forward = padded_layout(*tensors)
    else:
        shared = layout == "shared_prompt"
        forward = block_layout(
            *tensors, group_size=GROUP_SIZE, shared_prompt=shared, pad_token_id=0, mask_dtype=torch.float32
        )
    outputs = model(**forward.inputs).logits
    return forward.response_terms(
        outputs, batch.response_ids, temperature=TEMPERATURE, head_weight=None, with_entropy=False
    )[0]


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_every_layout_recomputes_behaviour_and_trains_only_policy_tokens(rollout, layout):
    backend, _, batch = rollout
    model = backend.model
    new_logprobs = layout_logprobs(model, batch, layout)
    policy = batch.policy_token_mask().bool()
    torch.testing.assert_close(new_logprobs[policy], batch.behaviour_logprobs[policy], atol=2e-4, rtol=0)

    algorithm = grpo()
    step = StepLoss(
        objective=objective_for(algorithm),
        algorithm=algorithm,
        max_response_length=batch.response_ids.shape[1],
        counts=StepCounts(trained_tokens=float(batch.trained_token_mask().sum()), loss_samples=4.0),
        step_samples=batch.num_samples,
    )
    new_logprobs.retain_grad()
    model.zero_grad()
    loss = step(new_logprobs, torch.zeros_like(new_logprobs), batch, 0, batch.num_samples, None, StepTotals())
    loss.backward()
    environment = batch.response_mask.bool() & ~policy
    assert bool((new_logprobs.grad[environment] == 0).all())
    assert bool((new_logprobs.grad[policy] != 0).all())
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())
    model.zero_grad()
