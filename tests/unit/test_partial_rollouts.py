"""Partial rollouts in the continuous batcher (``ContinuousBatcher.take_new_weights``, issue 35), on the embedded
model: weights A decode k tokens, weights B are loaded mid-flight and the running rows re-prefilled, decoding goes
on. Greedy tokens after the swap are B's own greedy continuation of prompt + the first k tokens; every behaviour
log-prob equals a full forward of the weights that sampled it (A before, B after), and ``token_versions`` says
which — for rows of different lengths, rows of a group that diverged, and a prompt admitted after the swap. (That
the objective weighs such tokens one by one: ``test_two_version_tokens.py``.)"""

from __future__ import annotations

import copy

import pytest
import torch

from colossal_rl.config import EMBEDDED_MODEL_DIR
from colossal_rl.data import encode_prompt
from colossal_rl.rollout.backend import SamplingSettings
from colossal_rl.rollout.continuous_batching import ContinuousBatcher, DecodedGroup
from colossal_rl.rollout.transformers_backend import TransformersBackend

GREEDY = SamplingSettings(temperature=1.0, max_new_tokens=10, greedy=True)
SAMPLED = SamplingSettings(temperature=2.0, max_new_tokens=10)  # hot: the tiny model is peaked
NO_EOS = [-1]  # every row runs max_new_tokens
VERSION_A, VERSION_B = 3, 4


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    return TransformersBackend(str(EMBEDDED_MODEL_DIR))


@pytest.fixture(scope="module")
def models(backend):
    """Weights A (the embedded model) and B: A plus noise of 0.2 standard deviations per tensor (enough that
    greedy continuations differ, little enough that B's logits stay A's scale: rounding within 1e-5)."""
    model_a = copy.deepcopy(backend.model)
    model_b = copy.deepcopy(backend.model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model_b.parameters():
            parameter.add_(0.2 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    return {VERSION_A: model_a, VERSION_B: model_b}


@pytest.fixture(scope="module")
def prompts(backend) -> list[list[int]]:
    questions = ["26+0=?", "Please: 196+7=?", "Please: please: 3+4=?"]
    return [encode_prompt(backend.tokenizer, [{"role": "user", "content": q}]) for q in questions]


def batcher_on(model, backend, sampling, num_samples=1) -> ContinuousBatcher:
    engine = ContinuousBatcher(
        model, sampling, num_samples, max_rows=64, eos_token_ids=NO_EOS, pad_token_id=backend.pad_token_id
    )
    engine.policy_version = VERSION_A
    return engine


def swap_to_b(engine: ContinuousBatcher, models) -> None:
    engine.model.load_state_dict(models[VERSION_B].state_dict())
    engine.take_new_weights(VERSION_B)


def greedy_alone(model, backend, prompt: list[int], max_new_tokens: int) -> list[int]:
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=max_new_tokens, greedy=True)
    engine = batcher_on(model, backend, sampling)
    engine.submit(prompt)
    (group,) = engine.run()
    return group.response_ids[0].tolist()


def full_forward_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """[len(tokens)] each token's log-prob under ``model`` given the prompt and the tokens before it."""
    sequence = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(sequence).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, sequence[0, len(prompt) :, None]).squeeze(-1)


def assert_each_token_is_its_versions(group: DecodedGroup, prompt, models, temperature, tokens_before_swap: int):
    """Every sample: versions [A]*k + [B]*rest, each log-prob that version's full forward's."""
    assert group.policy_version == (VERSION_A if tokens_before_swap > 0 else VERSION_B)
    for sample, length in enumerate(group.lengths):
        tokens = group.response_ids[sample, :length].tolist()
        versions = group.token_versions[sample, :length].tolist()
        assert versions == [VERSION_A] * tokens_before_swap + [VERSION_B] * (length - tokens_before_swap)
        expected = torch.where(
            group.token_versions[sample, :length] == VERSION_A,
            full_forward_logprobs(models[VERSION_A], prompt, tokens, temperature),
            full_forward_logprobs(models[VERSION_B], prompt, tokens, temperature),
        )
        torch.testing.assert_close(group.logprobs[sample, :length], expected, rtol=0, atol=1e-5)


def test_greedy_tokens_after_the_swap_are_b_continuing_a_s_first_tokens(backend, models, prompts):
    prompt, before = prompts[1], 4
    engine = batcher_on(copy.deepcopy(models[VERSION_A]), backend, GREEDY)
    engine.submit(prompt)
    for _ in range(before):
        assert engine.step() == []
    swap_to_b(engine, models)
    assert not engine._batch.logits.requires_grad  # the re-prefill builds no autograd graph
    (group,) = engine.run()
    tokens = group.response_ids[0].tolist()
    a_alone = greedy_alone(models[VERSION_A], backend, prompt, GREEDY.max_new_tokens)
    assert tokens[:before] == a_alone[:before]
    b_continues = greedy_alone(models[VERSION_B], backend, prompt + tokens[:before], GREEDY.max_new_tokens - before)
    assert tokens[before:] == b_continues
    assert tokens[before:] != a_alone[before:], "A and B agree: the test could not tell the versions apart"
    assert_each_token_is_its_versions(group, prompt, models, 1.0, before)


def test_rows_of_every_length_and_a_prompt_admitted_after_the_swap_are_each_version_s(backend, models, prompts):
    """Sampled, 3 samples a prompt (a group's rows diverge): prompt 0 is 5 tokens in at the swap, prompt 1 (admitted
    3 steps later) 2 tokens, prompt 2 joins after it."""
    torch.manual_seed(0)
    engine = batcher_on(copy.deepcopy(models[VERSION_A]), backend, SAMPLED, num_samples=3)
    engine.submit(prompts[0])
    for _ in range(3):
        engine.step()
    engine.submit(prompts[1])
    for _ in range(2):
        engine.step()
    swap_to_b(engine, models)
    engine.submit(prompts[2])
    groups = {group.request_id: group for group in engine.run()}
    for request_id, tokens_before_swap in ((0, 5), (1, 2), (2, 0)):
        group = groups[request_id]
        before_swap = group.response_ids[:, : max(tokens_before_swap, 1)].tolist()
        assert len(set(map(tuple, before_swap))) > 1, "a group's samples had not diverged by the swap"
        assert_each_token_is_its_versions(group, prompts[request_id], models, SAMPLED.temperature, tokens_before_swap)


def test_taking_weights_while_idle_only_relabels(backend, models, prompts):
    engine = batcher_on(copy.deepcopy(models[VERSION_A]), backend, GREEDY)
    swap_to_b(engine, models)
    assert engine.idle and engine.policy_version == VERSION_B
    engine.submit(prompts[0])
    (group,) = engine.run()
    assert group.token_versions[0].tolist() == [VERSION_B] * GREEDY.max_new_tokens
